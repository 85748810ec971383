"""Searches when things go wrong: bad metric values, damaged journals, failing notebooks, settings Optuna refuses."""

from __future__ import annotations

import json

import pytest
from support.notebooks import make_notebook

from nbbatch.api import submit
from nbbatch.store.share import FileShare

pytest.importorskip("optuna")
pytestmark = pytest.mark.timeout(300)

KINDS = """\
import nbbatch
bad = {"nan": float("nan"), "inf": float("inf"), "text": "diverged", "bool": True}
for step in (1, 2):
    nbbatch.record(step=step, loss=bad.get(KIND, 1.0 / step + LR))
"""


def _study(project, experiment: str, label: str = "nb"):
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    path = project / ".nbbatch-search" / experiment / f"{label}.journal"
    return optuna.load_study(study_name=f"{experiment}/{label}", storage=JournalStorage(JournalFileBackend(str(path))))


def _grid_search(project, write_experiment, name: str, kinds: list[str], cells: list[str] | None = None,
                 **block) -> object:
    """An experiment file: a grid search of the tiny notebook over KIND (what it records as loss)."""
    make_notebook(project / "nb.ipynb", cells or [KINDS], parameters="KIND = 'ok'\nLR = 0.0")
    search = {"metric": "loss", "mode": "min", "trials": len(kinds), "sampler": "grid", "seed": 0,
              "params": {"KIND": kinds}, **block}
    return write_experiment(json.dumps({"experiment": name, "notebooks": ["nb.ipynb"], "search": search,
                                        "resources": {"max_parallel": 2}}), name=f"{name}.yaml")


@pytest.mark.kernel
def test_a_trial_whose_metric_is_nan_inf_text_or_a_bool_fails_alone_and_the_search_goes_on(project, write_experiment):
    exp = _grid_search(project, write_experiment, "bad", ["nan", "inf", "text", "bool", "ok"])
    result = submit(exp, progress=False)
    assert len(result.records) == 5, [(r.run_id, r.status, r.error) for r in result.records]
    reasons = {r.parameters["KIND"]: r.trial for r in result.records}
    assert reasons["ok"]["state"] == "complete" and reasons["ok"]["value"] == pytest.approx(0.5)
    assert reasons["nan"] == {**reasons["nan"], "state": "failed", "reason": "recorded loss = nan: not a finite number"}
    assert reasons["inf"]["reason"] == "recorded loss = inf: not a finite number"
    assert reasons["text"]["reason"] == "recorded loss = 'diverged': not a number"
    assert reasons["bool"]["reason"] == "recorded loss = True: not a number"
    states = sorted(t.state.name for t in _study(project, "bad").trials)
    assert states == ["COMPLETE"] + ["FAIL"] * 4
    on_share = json.loads((FileShare(project / "results").root / "bad" / result.records[0].run_id / "run.json")
                          .read_text())
    assert on_share["trial"]["state"] in ("complete", "failed")
