"""Searches of several objectives (``metric: [a, b]``, ``mode: [max, min]``), and what plan time refuses of a search
block the way Optuna would: no kernel runs (the backend's launch is faked, as in test_search_reliability)."""

from __future__ import annotations

import json

import pytest
from support.notebooks import make_notebook

from nbbatch.api import submit
from nbbatch.errors import SpecError
from nbbatch.spec.experiment import Experiment
from nbbatch.spec.search import parse_search

pytest.importorskip("optuna")
pytestmark = pytest.mark.timeout(300)

TWO = {"metric": ["accuracy", "seconds"], "mode": ["max", "min"], "trials": 6, "sampler": "random", "seed": 3,
       "params": {"LR": {"uniform": [0.0, 1.0]}}}


def _block(**block) -> dict:
    return {**TWO, **block}


@pytest.mark.parametrize("block, says", [
    ({"mode": "max"}, "two lists of the same length"),
    ({"mode": ["max"]}, "two lists of the same length"),
    ({"metric": ["accuracy"], "mode": ["max"]}, "each of at least two"),
    ({"metric": ["accuracy", "accuracy"]}, "names a metric twice"),
    ({"mode": ["max", "lowest"]}, "search.mode must be min or max: whether a lower or a higher seconds is better"),
    ({"metric": ["accuracy", "step"]}, "`step` is a key of every point, no metric"),
    ({"pruner": "median"}, "Optuna's pruners judge one objective, and this search has 2 .*use pruner: none"),
    ({"sampler": "cmaes"}, "sampler cmaes optimises one objective.*use sampler tpe"),
])
def test_several_objectives_that_optuna_cannot_judge_are_refused_at_plan_time(block, says):
    with pytest.raises(SpecError, match=says):
        Experiment.from_dict({"experiment": "s", "frameworks": ["pytorch"], "search": _block(**block)})


ONE = {"metric": "loss", "mode": "min", "trials": 6, "params": {"LR": {"uniform": [0.0, 1.0]}}}


@pytest.mark.parametrize("block, says", [
    ({"params": {"LR": {"uniform": [-1e308, 1e308]}}}, "wider than a float can hold"),  # Optuna: OverflowError
    ({"params": {"LR": {"choice": [1, 1.0]}}}, "choice values must differ"),  # Optuna draws 1.0 for both
    ({"params": {"LR": {"choice": [1, True]}}}, "choice values must differ"),
    ({"params": {"LR": {"choice": ["a", "a"]}}, "sampler": "grid", "trials": 2}, "choice values must differ"),
    ({"pruner": {"hyperband": {"max_resource": 10**400}}}, "must be a whole number from 1 to"),  # was OverflowError
    ({"pruner": {"asha": {"reduction_factor": 2**40}}}, "must be a whole number from 2 to"),
    ({"metric": "attempt"}, "`attempt` is a key of every point"),
])
def test_values_optuna_would_refuse_after_the_lock_are_refused_at_plan_time(block, says):
    with pytest.raises(SpecError, match=says):
        parse_search({**ONE, **block})


def test_one_objective_is_written_as_before_so_its_studies_fingerprint_stays_the_same():
    one = parse_search(ONE)
    assert one.to_dict()["metric"] == "loss" and one.to_dict()["mode"] == "min" and not one.multi
    two = parse_search(TWO)
    assert two.multi and two.metrics == ("accuracy", "seconds") and two.modes == ("max", "min")
    assert two.to_dict()["metric"] == ["accuracy", "seconds"] and parse_search(two.to_dict()) == two
    assert "maximising accuracy, minimising seconds" in two.describe()


NOTEBOOK = "import nbbatch\nnbbatch.record(step=1, accuracy=LR)\n"


def _fake_launch(monkeypatch, metrics):
    """The local backend's launch as a run that records ``metrics(LR)`` (a dict) as its final metrics, one point of
    history, and succeeds (nan as nbbatch.record keeps it: text). No kernel runs."""
    from nbbatch.backends.local.backend import LocalBackend
    from nbbatch.store.jsonl import jsonl_line
    from nbbatch.store.layout import run_paths
    from nbbatch.store.runfiles import new_record, write_record
    from nbbatch.store.runjson import Status

    def launch(self, runs, share, options):
        run, = runs
        values = metrics(run.parameters["LR"])
        share.write_bytes(run_paths(run.experiment, run.run_id).metrics,
                          jsonl_line({"step": 1, "time": None, "attempt": 1, **values}))
        record = new_record(run)
        record.status, record.attempts, record.metrics = Status.SUCCEEDED, 1, values
        write_record(share, record)

    monkeypatch.setattr(LocalBackend, "launch", launch)


def _submit(project, write_experiment, name, block):
    make_notebook(project / "nb.ipynb", [NOTEBOOK], parameters="LR = 0.0")
    exp = write_experiment(json.dumps({"experiment": name, "notebooks": ["nb.ipynb"], "search": block}),
                           name=f"{name}.yaml")
    return exp, submit(exp, progress=False)


def _study(project, name):
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    path = project / ".nbbatch-search" / name / "nb.journal"
    return optuna.load_study(study_name=f"{name}/nb", storage=JournalStorage(JournalFileBackend(str(path)))), path


def test_each_trial_is_told_every_objective_and_its_record_keeps_them(project, write_experiment, monkeypatch):
    _fake_launch(monkeypatch, lambda lr: {"accuracy": lr, "seconds": 10 * lr * lr})
    _, result = _submit(project, write_experiment, "two", _block())
    assert result.ok and len(result.records) == 6
    study, _ = _study(project, "two")
    assert [d.name for d in study.directions] == ["MAXIMIZE", "MINIMIZE"]
    for record in result.records:
        lr = record.parameters["LR"]
        assert record.trial["state"] == "complete"
        assert record.trial["values"] == {"accuracy": pytest.approx(lr), "seconds": pytest.approx(10 * lr * lr)}
    told = {t.user_attrs["run_id"]: t.values for t in study.trials}
    assert told == {r.run_id: [r.metrics["accuracy"], r.metrics["seconds"]] for r in result.records}


@pytest.mark.parametrize("broken, reason", [
    ({"seconds": "nan"}, "recorded seconds = nan: not a finite number"),  # nbbatch.record keeps nan as text
    ({"seconds": None}, "its run recorded no value of seconds"),
])
def test_a_trial_missing_an_objective_or_recording_nan_fails_alone_naming_it(project, write_experiment, monkeypatch,
                                                                          broken, reason):
    """Every trial but the first (a search whose first trial lacks a metric stops: its notebook never records it)
    with LR > 0.5 records a bad ``seconds``: those trials fail saying so, and the search goes on with the others."""
    launched = []

    def metrics(lr):
        launched.append(lr)
        values = {"accuracy": lr, "seconds": 1.0, **(broken if lr > 0.5 and len(launched) > 1 else {})}
        return {k: v for k, v in values.items() if v is not None}

    _fake_launch(monkeypatch, metrics)
    _, result = _submit(project, write_experiment, "gaps", _block(trials=8, seed=0))
    bad = [r for r in result.records if r.parameters["LR"] > 0.5 and r.parameters["LR"] != launched[0]]
    good = [r for r in result.records if r not in bad]
    assert len(result.records) == 8 and bad and len(good) > 1  # the search went on past the failed trials
    assert all(r.trial == {**r.trial, "state": "failed", "reason": reason} for r in bad)
    assert all(r.trial["state"] == "complete" for r in good)


def test_a_multi_objective_study_is_rebuilt_from_its_records_as_it_was(project, write_experiment, monkeypatch,
                                                                      capsys):
    from nbbatch.ui.cli import main

    _fake_launch(monkeypatch, lambda lr: {"accuracy": lr, "seconds": 10 * lr * lr})
    exp, _ = _submit(project, write_experiment, "lost2", _block())
    study, path = _study(project, "lost2")
    before = [(t.number, t.state.name, t.params, t.values, t.user_attrs) for t in study.trials]
    path.unlink()
    assert main(["submit", str(exp), "--rebuild-search"]) == 0, capsys.readouterr().err
    study, _ = _study(project, "lost2")
    assert [(t.number, t.state.name, t.params, t.values, t.user_attrs) for t in study.trials] == before


def _dominates(a, b) -> bool:
    """Whether run ``a`` is as good as ``b`` in both objectives (accuracy max, seconds min) and better in one."""
    x, y = (a["metric.accuracy"], -a["metric.seconds"]), (b["metric.accuracy"], -b["metric.seconds"])
    return all(p >= q for p, q in zip(x, y, strict=True)) and x != y


def test_status_compare_and_the_report_show_every_objective_and_the_pareto_front(project, write_experiment,
                                                                                monkeypatch, capsys):
    from nbbatch.ui.cli import main

    _fake_launch(monkeypatch, lambda lr: {"accuracy": lr, "seconds": (lr - 0.5) ** 2})  # below 0.5: worse in both
    _submit(project, write_experiment, "front", _block(trials=10, seed=5))
    capsys.readouterr()
    assert main(["status", "front"]) == 0
    header = next(line for line in capsys.readouterr().out.splitlines() if "status" in line and "run" in line)
    assert "trial" in header and header.index("accuracy") < header.index("seconds")
    assert main(["compare", "front", "--json", str(project / "front.json"),
                 "--report", str(project / "front.html")]) == 0
    rows = json.loads((project / "front.json").read_text())["runs"]  # a search's JSON: its search, importance, runs
    assert len(rows) == 10 and all(isinstance(r["pareto"], bool) for r in rows)
    front = [r for r in rows if r["pareto"]]
    assert front and len(front) < 10  # the trials below 0.5 are dominated: some were drawn with seed 5
    assert all(not _dominates(other, r) for r in front for other in rows)
    assert all(any(_dominates(other, r) for other in front) for r in rows if not r["pareto"])
    html = (project / "front.html").read_text()
    numbers = ", ".join(str(n) for n in sorted(r["trial"] for r in front))
    assert f"{len(front)} trial(s) on the Pareto front (none better in every objective): trial {numbers}" in \
        " ".join(html.split())
    assert "search: Pareto front of accuracy and seconds" in html and "search: best accuracy by trial" in html


def test_a_trial_told_by_a_driver_killed_before_it_wrote_the_record_gets_its_decision_on_resume(
        project, write_experiment, monkeypatch):
    """A driver killed between telling the study and writing the run's record left a record without `trial:`; the
    next submit finds the study's decision and writes it (the trial is not run or told again)."""
    from nbbatch.store.runfiles import read_record_or_none, write_record
    from nbbatch.store.share import FileShare

    _fake_launch(monkeypatch, lambda lr: {"accuracy": lr, "seconds": 1.0})
    exp, first = _submit(project, write_experiment, "told", _block(trials=3))
    share = FileShare(project / "results")
    lost = first.records[1]
    decided = dict(lost.trial)
    lost.trial = None
    write_record(share, lost)
    again = submit(exp, progress=False)
    assert again.ok and read_record_or_none(share, "told", lost.run_id).trial == decided
    assert len(_study(project, "told")[0].trials) == 3
