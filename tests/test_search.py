"""Searches (``search:``): the block's checks, and real searches of a tiny notebook through the local backend."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
from support.notebooks import LOSS_CURVE, SEARCH, make_notebook
from support.waiting import wait_until

from nbbatch.api import submit
from nbbatch.errors import NbbatchError, SpecError
from nbbatch.spec.experiment import Experiment
from nbbatch.store.runfiles import load_records, read_record_or_none
from nbbatch.store.share import FileShare
from nbbatch.ui.cli import main

pytest.importorskip("optuna")
pytestmark = pytest.mark.timeout(300)



def _search(**block) -> dict:
    return {"metric": "loss", "mode": "min", "trials": 6, "params": {"LR": {"loguniform": [1.0e-4, 1.0]}}, **block}


@pytest.mark.parametrize("block, says", [
    ({"mode": "lowest"}, "search.mode must be min or max"),
    ({"trials": 0}, "search.trials must be a positive integer"),
    ({"sampler": "tpes"}, r"unknown sampler `tpes` \(did you mean `tpe`\?\)"),
    ({"pruner": "medain"}, r"unknown pruner `medain` \(did you mean `median`\?\)"),
    ({"pruner": {"hyperband": {"min_resource": 1}}}, "hyperband needs max_resource"),
    ({"pruner": {"median": {"warmup": 2}}}, "unknown setting `warmup`"),
    ({"params": {"LR": {"normal": [0, 1]}}}, "unknown distribution `normal`.*use uniform"),
    ({"params": {"LR": {"loguniform": [0, 1]}}}, "loguniform needs 0 < low < high"),
    ({"sampler": "cmaes", "params": {"LR": {"uniform": [0, 1]}, "OPT": {"choice": ["sgd", "adam"]}}},
     "CMA-ES draws numbers only, and `OPT` is a choice"),
    ({"sampler": "grid"}, "grid walks lists of values, and `LR` is a range"),
    ({"sampler": "grid", "params": {"LR": [0.1, 0.01]}}, "the grid has 2 points: set trials: 2"),
    ({"trials": 8, "pruner": {"hyperband": {"min_resource": 1, "max_resource": 27}}},
     r"below what pruner hyperband needs to ever stop a run \(12: 4 brackets"),
    ({"trials": 3, "pruner": "median"}, r"below what pruner median needs .*\(6: it compares with the 5 trials"),
])
def test_mistakes_in_the_search_block_are_refused_before_anything_runs(block, says):
    with pytest.raises(SpecError, match=says):
        Experiment.from_dict({"experiment": "s", "frameworks": ["pytorch"], "search": _search(**block)})


def test_a_search_with_a_sweep_or_a_fixed_searched_parameter_is_refused():
    with pytest.raises(SpecError, match="`search:` or `sweep:`, not both"):
        Experiment.from_dict({"experiment": "s", "frameworks": ["pytorch"], "search": _search(),
                              "sweep": {"grid": {"EPOCHS": [1, 2]}}})
    with pytest.raises(SpecError, match="`LR` is both in `parameters:` and searched"):
        Experiment.from_dict({"experiment": "s", "frameworks": ["pytorch"], "search": _search(),
                              "parameters": {"LR": 0.1}})


def test_plan_says_what_a_search_will_draw(project, write_experiment, capsys):
    make_notebook(project / "nb.ipynb", [LOSS_CURVE], parameters="LR = 0.1\nEPOCHS = 12\nPAUSE = 0.3")
    exp = write_experiment(json.dumps({"experiment": "lr", "notebooks": ["nb.ipynb"], "search": SEARCH}))
    assert main(["plan", str(exp)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "lr: a search of 1 notebook(s)" in out
    assert "search: up to 6 trials each, minimising loss: LR loguniform [0.0001, 1.0]; sampler random (seed 3), " \
           "pruner median" in out


def test_a_search_is_not_submitted_without_waiting_or_for_some_runs_only(project, write_experiment):
    make_notebook(project / "nb.ipynb", [LOSS_CURVE], parameters="LR = 0.1\nEPOCHS = 12\nPAUSE = 0.3")
    exp = write_experiment(json.dumps({"experiment": "lr", "notebooks": ["nb.ipynb"], "search": SEARCH}))
    with pytest.raises(NbbatchError, match=r"without waiting \(--no-wait\).*submit again to resume"):
        submit(exp, wait=False, progress=False)
    with pytest.raises(NbbatchError, match="--only selects runs of a planned batch"):
        submit(exp, only=["nb-"], progress=False)
    assert not (project / "results" / "lr").exists()  # nothing ran


@pytest.mark.kernel
def test_a_median_pruned_search_stops_bad_runs_and_keeps_good_ones(project, write_experiment):
    make_notebook(project / "nb.ipynb", [LOSS_CURVE], parameters="LR = 0.1\nEPOCHS = 12\nPAUSE = 0.3")
    exp = write_experiment(json.dumps({"experiment": "lr", "notebooks": ["nb.ipynb"], "search": SEARCH,
                                       "resources": {"max_parallel": 2}}))
    result = submit(exp, progress=False)
    assert len(result.records) == 6 and result.ok, [(r.run_id, r.status, r.error) for r in result.records]
    by_status = {}
    for record in result.records:
        by_status.setdefault(str(record.status), []).append(record)
        assert record.trial["study"] == "lr/nb" and record.trial["state"] in ("complete", "pruned")
    assert set(by_status) <= {"succeeded", "pruned"} and by_status.get("pruned"), by_status
    for record in by_status["pruned"]:  # stopped where the pruner said, its notebook kept
        assert record.error.kind == "pruned" and f"at step {record.trial['step']}" in record.error.reason
        assert (project / "results" / "lr" / record.run_id / "output.ipynb").exists()
    # compare: best first, by the search's metric; the report's search section names the best trial
    assert main(["compare", "lr", "--csv", str(project / "lr.csv"), "--report", str(project / "lr.html")]) == 0
    table = list(csv.DictReader((project / "lr.csv").open()))  # finished runs best first, then the pruned ones
    finished = [float(r["metric.loss"]) for r in table if r["status"] == "succeeded"]
    pruned = [float(r["metric.loss"]) for r in table if r["status"] == "pruned"]
    assert [r["status"] for r in table] == ["succeeded"] * len(finished) + ["pruned"] * len(pruned)
    assert finished == sorted(finished) and pruned == sorted(pruned)
    best = min((r for r in by_status["succeeded"]), key=lambda r: r.metrics["loss"])
    html = (project / "lr.html").read_text()
    assert "<h2>Search</h2>" in html and f"trial {best.trial['number']} (run {best.run_id})" in html
    assert html.count("<img") >= 3 and "search: best loss by trial" in html


PRUNERS = {"median": {"median": {"startup_trials": 2, "warmup_steps": 1}},
           "percentile": {"percentile": {"percentile": 40, "startup_trials": 2, "warmup_steps": 1}},
           "asha": {"asha": {"min_resource": 1, "reduction_factor": 3}},
           "hyperband": {"hyperband": {"min_resource": 1, "max_resource": 3, "reduction_factor": 3}}}


@pytest.mark.kernel
def test_each_pruner_stops_the_runs_it_rejects_at_the_step_it_rejects_them(project, write_experiment):
    """One trial at a time over a fixed grid of LRs (the notebook's loss: |log10 LR + 2| + 1/step, so LR 0.01 is
    best at every step): each trial's decision is replayed in an in-memory study holding the trials before it as the
    driver left them. A run is pruned exactly where Optuna, given every point one by one, first rejects it; the best
    LR is never pruned; some run is. A point that arrives just as its run ends may go unjudged (only the last one)."""
    import optuna

    make_notebook(project / "nb.ipynb", [LOSS_CURVE], parameters="LR = 0.1\nEPOCHS = 5\nPAUSE = 0.3")
    grid = [0.01, 0.03, 0.003, 0.1, 0.5, 1.0e-4]
    drivers = {}
    for name, pruner in PRUNERS.items():
        block = {"metric": "loss", "mode": "min", "trials": len(grid), "sampler": "grid", "seed": 1,
                 "pruner": pruner, "params": {"LR": grid}}
        exp = write_experiment(json.dumps({"experiment": name, "notebooks": ["nb.ipynb"], "search": block,
                                           "resources": {"max_parallel": 1}}), name=f"{name}.yaml")
        drivers[name] = subprocess.Popen([sys.executable, "-m", "nbbatch", "submit", str(exp)],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    share = FileShare(project / "results")
    for name, driver in drivers.items():
        assert driver.wait(240) == 0, driver.stderr.read()
        trials = _study(project, name, "nb").trials
        records = {r.run_id: r for r in load_records(share, name)[0]}
        assert len(trials) == len(records) == len(grid)
        for number, trial in enumerate(trials):
            record = records[trial.user_attrs["run_id"]]
            judged = optuna.create_study(study_name=f"{name}/nb", pruner=_pruner(name))
            for earlier in trials[:number]:
                judged.add_trial(earlier)
            replay = judged.ask({"LR": trial.distributions["LR"]})
            rejected_at = None
            for step, value in sorted(trial.intermediate_values.items()):
                replay.report(value, step)
                if replay.should_prune():
                    rejected_at = step
                    break
            if record.status == "pruned":
                assert rejected_at == record.trial["step"] == max(trial.intermediate_values), (name, number)
                assert trial.state.name == "PRUNED" and record.error.kind == "pruned"
            else:
                assert record.status == "succeeded" and trial.state.name == "COMPLETE", (name, record.status)
                assert rejected_at in (None, 5), (name, number, rejected_at)
        statuses = {records[t.user_attrs["run_id"]].parameters["LR"]: records[t.user_attrs["run_id"]].status
                    for t in trials}
        assert statuses[0.01] == "succeeded" and "pruned" in statuses.values(), (name, statuses)


def _pruner(name: str):
    import optuna

    settings = PRUNERS[name][name]
    return {"median": lambda: optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1),
            "percentile": lambda: optuna.pruners.PercentilePruner(40, n_startup_trials=2, n_warmup_steps=1),
            "asha": lambda: optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=3),
            "hyperband": lambda: optuna.pruners.HyperbandPruner(**settings)}[name]()


def _study(project, experiment: str, label: str):
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    path = project / ".nbbatch-search" / experiment / f"{label}.journal"
    return optuna.load_study(study_name=f"{experiment}/{label}", storage=JournalStorage(JournalFileBackend(str(path))))


def _driver_under_way(project, write_experiment, name: str, trials: int, seed: int, parallel: int, told: int):
    """`nbbatch submit` of a random search of the tiny notebook in a process of its own, once ``told`` of its runs
    succeeded and another is running: (experiment file, share, driver process)."""
    make_notebook(project / "nb.ipynb", [LOSS_CURVE], parameters="LR = 0.1\nEPOCHS = 8\nPAUSE = 0.4")
    block = {"metric": "loss", "mode": "min", "trials": trials, "sampler": "random", "seed": seed,
             "params": {"LR": {"loguniform": [1.0e-4, 1.0]}}}
    exp = write_experiment(json.dumps({"experiment": name, "notebooks": ["nb.ipynb"], "search": block,
                                       "resources": {"max_parallel": parallel}}))
    share = FileShare(project / "results")
    driver = subprocess.Popen([sys.executable, "-m", "nbbatch", "submit", str(exp)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)

    def under_way() -> bool:  # told in the study itself: a run's record says succeeded before the driver tells it
        try:
            states = [t.state.name for t in _study(project, name, "nb").trials]
        except (FileNotFoundError, KeyError):  # the driver has not created the study yet
            return False
        return (sum(state == "COMPLETE" for state in states) >= told and "RUNNING" in states
                and any(r.status == "running" for r in load_records(share, name)[0]))

    try:
        wait_until(under_way, timeout=180, message=f"{told} trial(s) told and one running", interval=0.2)
    except BaseException:
        driver.kill()
        raise
    return exp, share, driver


@pytest.mark.kernel
def test_a_search_whose_driver_was_killed_resumes_the_same_study(project, write_experiment):
    """The driver is killed (SIGKILL) with trials told and runs in flight; `submit` again goes on with the same
    study: the runs the dead driver left are run again under their trials, no trial is lost or asked twice, and the
    budget is the one given."""
    exp, _share, driver = _driver_under_way(project, write_experiment, "again", trials=5, seed=7, parallel=2, told=2)
    driver.kill()
    driver.wait(30)
    before = _study(project, "again", "nb")
    told = [t.number for t in before.trials if t.state.is_finished()]
    in_flight = [t.number for t in before.trials if t.state.name == "RUNNING"]
    assert len(told) >= 2 and in_flight and len(before.trials) <= 5
    result = submit(exp, progress=False)
    assert result.ok and len(result.records) == 5, [(r.run_id, r.status, r.error) for r in result.records]
    after = _study(project, "again", "nb")
    assert [t.number for t in after.trials] == [0, 1, 2, 3, 4]
    assert all(t.state.name == "COMPLETE" for t in after.trials)
    assert len({t.user_attrs["run_id"] for t in after.trials}) == 5
    for trial in before.trials:  # each trial kept the parameters it had drawn
        assert after.trials[trial.number].params == trial.params
    assert sorted(r.trial["number"] for r in result.records) == [0, 1, 2, 3, 4]


@pytest.mark.kernel
def test_cancelling_the_experiment_stops_the_search_and_submit_resumes_it(project, write_experiment):
    """`nbbatch cancel EXPERIMENT` mid-search: the driver starts no more trials and ends; the trial whose run the
    cancel stopped stays open in the study (not a failed trial), and `submit` again runs it and the rest."""
    exp, share, driver = _driver_under_way(project, write_experiment, "cx", trials=4, seed=5, parallel=1, told=1)
    try:
        assert main(["cancel", "cx"]) == 0
        assert driver.wait(120) == 1  # it ended by itself, its runs not all succeeded
    finally:
        driver.kill()
    said = driver.stderr.read()
    assert "the experiment was cancelled: no more trials start" in said, said
    study = _study(project, "cx", "nb")
    states = [t.state.name for t in study.trials]  # told up to the one the cancel stopped, and no trial after it
    assert states[-1] == "RUNNING" and set(states[:-1]) == {"COMPLETE"} and len(states) < 4, states
    number, stopped = len(states) - 1, study.trials[-1].user_attrs["run_id"]
    assert read_record_or_none(share, "cx", stopped).status == "cancelled"
    result = submit(exp, progress=False)
    assert result.ok and len(result.records) == 4, [(r.run_id, r.status, r.error) for r in result.records]
    study = _study(project, "cx", "nb")
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 4
    assert study.trials[number].user_attrs["run_id"] == stopped  # the same trial, run again


@pytest.mark.slow
def test_a_hyperband_search_of_the_pytorch_notebook_on_digits(pytorch_env, tmp_path, monkeypatch):
    """The real PyTorch notebook, 6 trials of LR under Hyperband (3 brackets), on digits: every trial's run ends
    succeeded or pruned, the study has every trial told, and the best trial is a run that succeeded."""
    from support.machine import REPO

    monkeypatch.setenv("NBBATCH_PROJECT", str(REPO))  # the real frameworks and their envs
    block = {"metric": "loss", "mode": "min", "trials": 6, "sampler": "tpe", "seed": 0,
             "pruner": {"hyperband": {"min_resource": 1, "max_resource": 4, "reduction_factor": 2}},
             "params": {"LR": {"loguniform": [1.0e-4, 1.0]}}}
    exp = tmp_path / "hb.yaml"
    exp.write_text(json.dumps({"experiment": "hb", "frameworks": ["pytorch"], "search": block,
                               "parameters": {"DATASET": "digits", "EPOCHS": 4, "MAX_SAMPLES": 300},
                               "resources": {"max_parallel": 2}, "share": "results"}))
    result = submit(exp, progress=False)
    assert result.ok and len(result.records) == 6, [(r.run_id, r.status, r.error) for r in result.records]
    study = _study(tmp_path, "hb", "pytorch")
    assert len(study.trials) == 6 and all(t.state.is_finished() for t in study.trials)
    best = next(r for r in result.records if r.run_id == study.best_trial.user_attrs["run_id"])
    assert best.status == "succeeded" and best.metrics["loss"] == pytest.approx(study.best_value)
    for record in result.records:
        assert record.trial["state"] == {"succeeded": "complete", "pruned": "pruned"}[record.status]
        assert record.parameters["EPOCHS"] == 4 and 1.0e-4 <= record.parameters["LR"] <= 1.0


def test_a_metric_history_is_read_as_it_grows_line_by_line(tmp_path):
    """The driver's tail of metrics.jsonl: only complete lines, each once, whatever the writer is mid-way through."""
    from nbbatch.store.jsonl import JsonlTail

    share = FileShare(tmp_path)
    tail = JsonlTail(share, "e/r/metrics.jsonl")
    assert tail.read() == []  # not there yet
    path = tmp_path / "e" / "r" / "metrics.jsonl"
    path.parent.mkdir(parents=True)
    path.write_bytes(b'{"step":1,"loss":2.0}\n{"step":2,"lo')
    assert tail.read() == [{"step": 1, "loss": 2.0}]
    with path.open("ab") as out:
        out.write(b'ss":1.5}\n\x00\x00\n{"step":3,"loss":1.2}\n')
    assert tail.read() == [{"step": 2, "loss": 1.5}, {"step": 3, "loss": 1.2}]  # a zero-filled line is skipped
    assert tail.read() == []


@pytest.mark.kernel
def test_the_submit_widget_counts_a_searchs_trials(project, monkeypatch):
    """The widget's bar covers the search's budget from the start, and counts the trials' runs as they end (the
    plan's own run, the notebook without the searched parameters, is never shown)."""
    pytest.importorskip("ipywidgets")
    from nbbatch import widgets
    from nbbatch.ui.widgets import display as widget_display

    monkeypatch.setattr(widget_display, "display_mode", lambda: "widgets")
    monkeypatch.setattr(widget_display, "show", lambda obj: None)
    make_notebook(project / "nb.ipynb", [LOSS_CURVE], parameters="LR = 0.1\nEPOCHS = 2\nPAUSE = 0.1")
    spec = Experiment.from_dict({"experiment": "wsearch", "notebooks": ["nb.ipynb"],
                                 "search": {**_search(trials=3), "pruner": "none", "sampler": "random", "seed": 0},
                                 "resources": {"max_parallel": 2}}, base_dir=project)
    submission = widgets.submit_all(spec)
    assert submission.planned_runs(timeout=60) == [] and submission.model.total == 3
    result = submission.wait(timeout=240)
    assert result.ok and len(result.records) == 3
    label, bar, _details = submission.widget.children
    assert (bar.value, bar.max, bar.bar_style) == (3, 3, "success")
    assert "wsearch: done, 3/3 finished — 3 succeeded" in label.value
    assert sorted(submission.model.run_ids) == sorted(r.run_id for r in result.records)
