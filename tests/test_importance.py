"""Which parameters matter (issue 48, item 4): PED-ANOVA importances from the runs' records, in the report and in
``compare --json``, with a warning when too few trials make them meaningless.

The shares are written by hand, as the driver writes them: a search's runs carry their trial, its manifest the
search block.
"""

from __future__ import annotations

import json
import random
import re
from html import unescape
from pathlib import Path
from typing import Any

import pytest

from nbbatch.results import compare
from nbbatch.results.compare.importance import needed_trials, parameter_importance
from nbbatch.store.runfiles import write_record
from nbbatch.store.runjson import RunRecord
from nbbatch.store.share import open_share
from nbbatch.ui.cli import main

pytest.importorskip("pandas")
pytest.importorskip("matplotlib")
pytest.importorskip("optuna")

SPACE = {"LR": {"loguniform": [1e-4, 1e-1]}, "MOMENTUM": {"uniform": [0.0, 0.99]}, "BATCH": {"choice": [32, 64]}}


def _trial(experiment: str, number: int, parameters: dict[str, Any], loss: float | None,
           status: str = "succeeded") -> RunRecord:
    return RunRecord(run_id=f"train-{number:04x}a1b2c3", experiment=experiment, notebook="train.ipynb",
                     kernel="python3", framework=None, parameters=parameters, status=status, attempts=1,
                     duration_s=5.0, metrics={} if loss is None else {"loss": loss},
                     trial={"study": experiment, "number": number, "state": "pruned" if status == "pruned" else
                            "complete", **({"step": 2} if status == "pruned" else {})})


def _search_share(root: Path, experiment: str, trials: int, seed: int = 1) -> Path:
    """A search whose loss is all LR (its distance from 1e-2, in decades), a little MOMENTUM, and no BATCH; a few
    trials pruned and failed, which must not count."""
    rng = random.Random(seed)
    share = open_share(root)
    records = []
    for number in range(trials):
        params = {"LR": 10 ** rng.uniform(-4, -1), "MOMENTUM": rng.uniform(0, 0.99), "BATCH": rng.choice([32, 64])}
        loss = abs(__import__("math").log10(params["LR"]) + 2) + 0.05 * params["MOMENTUM"] + rng.uniform(0, 0.01)
        status = "pruned" if number % 7 == 3 else "failed" if number % 11 == 5 else "succeeded"
        records.append(_trial(experiment, number, params, loss if status != "failed" else None, status))
    for record in records:
        write_record(share, record)
    (root / experiment / "experiment.json").write_text(json.dumps(
        {"runs": [r.run_id for r in records], "search": {"metric": "loss", "mode": "min", "params": SPACE}}))
    return root


def test_the_parameter_the_metric_depends_on_comes_first(tmp_path: Path) -> None:
    frame = compare.collect(_search_share(tmp_path / "share", "lr", 80), "lr")
    importance = parameter_importance(frame)
    assert importance is not None
    ranked = list(importance["parameters"])
    assert ranked[0] == "LR" and importance["parameters"]["LR"] > 0.5, importance
    assert importance["parameters"]["BATCH"] < importance["parameters"]["LR"] / 3
    finished = int(((frame["status"] == "succeeded") & frame["metric.loss"].notna()).sum())
    assert importance["trials"] == finished < 80  # pruned and failed runs left out, as Optuna leaves them
    assert importance["evaluator"] == "PED-ANOVA" and importance["warning"] is None
    assert abs(sum(importance["parameters"].values()) - 1) < 1e-3
    # the same runs in another order: the same numbers (no randomness, no order)
    assert parameter_importance(frame.iloc[::-1].reset_index(drop=True)) == importance


def test_the_mode_says_which_end_is_best(tmp_path: Path) -> None:
    """A score best at a high A, whose worst runs are those with B above 0.9: maximised, A matters; read the other
    way round (the worst as the best), B would."""
    rng, share = random.Random(3), open_share(tmp_path / "share")
    records = []
    for number in range(100):
        a, b = rng.uniform(0, 1), rng.uniform(0, 1)
        records.append(_trial("score", number, {"A": a, "B": b}, None))
        records[-1].metrics = {"score": a - 10 * (b > 0.9)}
    for record in records:
        write_record(share, record)
    frame = compare.collect(tmp_path / "share", "score")
    spaces = {"A": {"uniform": [0, 1]}, "B": {"uniform": [0, 1]}}
    best_high = parameter_importance(frame, {"metric": "score", "mode": "max", "params": spaces})
    best_low = parameter_importance(frame, {"metric": "score", "mode": "min", "params": spaces})
    assert best_high is not None and best_low is not None
    assert list(best_high["parameters"]) == ["A", "B"] and list(best_low["parameters"]) == ["B", "A"]


def test_too_few_trials_say_so(tmp_path: Path) -> None:
    frame = compare.collect(_search_share(tmp_path / "share", "few", 12), "few")
    importance = parameter_importance(frame)
    assert importance is not None
    assert importance["trials"] < needed_trials(3)
    assert re.fullmatch(rf"{importance['trials']} trials for 3 parameters: too few for the importances to mean "
                        r"much \(read them from 15 on\)", importance["warning"])


def test_a_sweep_not_crossed_is_named(tmp_path: Path) -> None:
    """A plain sweep: importances for its metric (best at its min for a loss); parameters swept together (not a
    crossed grid) cannot be told apart, and the warning says it."""
    share = open_share(tmp_path / "share")
    zipped = [RunRecord(run_id=f"t-{i:04x}a1b2c3", experiment="zip", notebook="t.ipynb", kernel="python3",
                        parameters={"A": a, "B": a * 10}, status="succeeded", metrics={"loss": float(a)})
              for i, a in enumerate(range(12))]
    for record in zipped:
        write_record(share, record)
    importance = parameter_importance(compare.collect(tmp_path / "share", "zip"))
    assert importance is not None and importance["mode"] == "min" and importance["metric"] == "loss"
    assert "not swept independently (12 of the 144 combinations ran)" in importance["warning"]
    html = compare.render_report(compare.collect(tmp_path / "share", "zip"), tmp_path / "r.html")
    assert "Which parameters matter" in html and "not swept independently" in html


def test_one_varied_parameter_has_nothing_to_rank(tmp_path: Path) -> None:
    share = open_share(tmp_path / "share")
    for i in range(12):
        write_record(share, RunRecord(run_id=f"t-{i:04x}a1b2c3", experiment="one", notebook="t.ipynb",
                                      kernel="python3", parameters={"A": i, "B": 1}, status="succeeded",
                                      metrics={"loss": float(i)}))
    assert parameter_importance(compare.collect(tmp_path / "share", "one")) is None


def test_compare_json_and_report_carry_the_importance(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    share = _search_share(tmp_path / "share", "lr", 80)
    _search_share(share, "few", 12)
    monkeypatch.chdir(tmp_path)
    assert main(["compare", "lr", "--share", str(share), "--json", "t.json", "--report", "r.html"]) == 0
    data = json.loads((tmp_path / "t.json").read_text())
    assert list(data["importance"]["parameters"])[0] == "LR"
    assert data["importance"]["evaluator"] == "PED-ANOVA" and data["importance"]["warning"] is None
    assert data["importance"]["trials"] == sum(r["status"] == "succeeded" for r in data["runs"])
    assert compare.read_table(tmp_path / "t.json")["run_id"].nunique() == 80  # still a table to read back
    html = (tmp_path / "r.html").read_text()
    section = html[html.index("Which parameters matter"):]
    assert re.search(r'<img src="data:image/png;base64,[^"]+" alt="which parameters matter', section)
    assert re.search(r"<td>LR</td>\s*<td class=\"num\">", section)
    assert main(["compare", "few", "--share", str(share), "--json", "f.json", "--report", "f.html"]) == 0
    warning = json.loads((tmp_path / "f.json").read_text())["importance"]["warning"]
    assert "too few for the importances to mean much" in warning
    assert warning in (tmp_path / "f.html").read_text()


def test_without_optuna_one_line_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    frame = compare.collect(_search_share(tmp_path / "share", "lr", 30), "lr")
    monkeypatch.setitem(__import__("sys").modules, "optuna", None)  # `import optuna` raises ImportError
    importance = parameter_importance(frame)
    assert importance is not None and importance["parameters"] == {}
    assert importance["warning"] == "parameter importance needs optuna: pip install 'nbbatch[search]'"
    html = compare.render_report(frame, tmp_path / "r.html")
    assert importance["warning"] in unescape(html) and 'alt="which parameters matter' not in html


def test_no_run_finished_has_nothing_to_rank(tmp_path: Path) -> None:
    share = open_share(tmp_path / "share")
    for i in range(3):
        write_record(share, RunRecord(run_id=f"t-{i:04x}a1b2c3", experiment="none", notebook="t.ipynb",
                                      kernel="python3", parameters={"A": i, "B": -i}, status="failed",
                                      metrics={"loss": float(i)}))
    frame = compare.collect(tmp_path / "share", "none")
    assert parameter_importance(frame) is None
    assert "Which parameters matter" not in compare.render_report(frame, tmp_path / "r.html")


def test_several_objectives_rank_for_their_pareto_front(tmp_path: Path) -> None:
    """loss is all LR; a second objective that is all MOMENTUM makes MOMENTUM matter to reach the Pareto front."""
    frame = compare.collect(_search_share(tmp_path / "share", "two", 90), "two")
    frame["metric.seconds"] = frame["param.MOMENTUM"]
    alone = parameter_importance(frame)
    search = {"metric": "loss", "mode": "min", "objectives": [["loss", "min"], ["seconds", "min"]], "params": SPACE}
    both = parameter_importance(frame, search)
    assert alone is not None and both is not None and both["metric"] == ["loss", "seconds"]
    assert both["parameters"]["MOMENTUM"] > alone["parameters"]["MOMENTUM"] + 0.2, (alone, both)
    assert list(both["parameters"])[-1] == "BATCH"
