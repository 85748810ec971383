"""Searches whose trials pause at rungs and continue from their checkpoints (``search.resource``): the schedule
(:mod:`nbbatch.search.rungs`) on its own, the block's checks, and the driver over runs faked at the backend's launch
(no kernel: the notebooks' own resuming is tested in test_resume_from and test_notebooks)."""

from __future__ import annotations

import json

import pytest
from support.notebooks import make_notebook

from nbbatch.api import submit
from nbbatch.errors import SpecError
from nbbatch.search.rungs import Promotions
from nbbatch.spec.search import parse_search
from nbbatch.store.runfiles import load_records

pytestmark = pytest.mark.timeout(300)

BLOCK = {"metric": "accuracy", "mode": "max", "trials": 9, "sampler": "random", "seed": 5, "resource": "EPOCHS",
         "pruner": {"asha": {"min_resource": 1, "max_resource": 9, "reduction_factor": 3}},
         "params": {"LR": {"loguniform": [1.0e-4, 1.0]}}}


# --- the block --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block, says", [
    ({"pruner": "median"}, "use pruner asha or hyperband with it"),
    ({"pruner": {"asha": {"min_resource": 1}}}, "needs max_resource with search.resource"),
    ({"pruner": {"asha": {"min_resource": 4, "max_resource": 3}}}, "max_resource must be ≥ min_resource"),
    ({"resource": "epochs count"}, "names the notebook parameter that sets how far a run trains"),
    ({"params": {"EPOCHS": {"randint": [1, 9]}}}, "remove it from search.params"),
    ({"resource": None}, "asha.max_resource is for trials that pause and continue"),
])
def test_a_promoting_block_that_cannot_work_is_refused_naming_the_fix(block, says):
    with pytest.raises(SpecError, match=says):
        parse_search({**BLOCK, **block})


def test_the_rungs_and_the_written_block():
    search = parse_search(BLOCK)
    assert search.promotes and search.rungs == (1, 3, 9)
    assert parse_search({**BLOCK, "pruner": {"hyperband": {"min_resource": 1, "max_resource": 20}}}).rungs == (1, 3, 9, 20)
    assert parse_search({**BLOCK, "pruner": {"asha": {"min_resource": 2, "max_resource": 2}}}).rungs == (2,)
    assert parse_search(search.to_dict()) == search and search.to_dict()["resource"] == "EPOCHS"
    plain = parse_search({**BLOCK, "resource": None, "pruner": {"asha": {"min_resource": 1}}})
    assert "resource" not in plain.to_dict() and plain.to_dict()["pruner"] == {"asha": {
        "min_resource": 1, "reduction_factor": 3, "min_early_stopping_rate": 0}}, "an older search's fingerprint"


def test_a_parameter_fixed_and_the_resource_is_refused(project, write_experiment):
    make_notebook(project / "nb.ipynb", ["x = 1"], parameters="LR = 0.1\nEPOCHS = 1")
    with pytest.raises(SpecError, match="remove it from parameters:"):
        submit(write_experiment(json.dumps({"experiment": "p", "notebooks": ["nb.ipynb"], "parameters": {"EPOCHS": 3},
                                            "search": BLOCK})), progress=False)


def test_a_resource_the_notebook_does_not_take_is_refused_at_plan_time(project, write_experiment):
    from nbbatch.errors import ValidationError

    make_notebook(project / "nb.ipynb", ["x = 1"], parameters="LR = 0.1\nEPOCH_COUNT = 1")
    with pytest.raises(ValidationError, match="parameter `EPOCHS` is not in nb.ipynb's parameters cell"):
        submit(write_experiment(json.dumps({"experiment": "r", "notebooks": ["nb.ipynb"], "search": BLOCK})),
               progress=False)


# --- the schedule -------------------------------------------------------------------------------------------


def _drive(schedule: Promotions, values, budget: int, parallel: int = 1):
    """Run ``schedule`` as the driver does, one run ending at a time (the oldest first): ``values[n][rung]`` is what
    trial n's run to that rung records. The segments launched, in order, and the trials stopped."""
    in_flight, started, launched, stopped = [], 0, [], []
    while True:
        while len(in_flight) < parallel:
            number = schedule.promotion()
            if number is not None:
                launched.append((number, schedule.launched(number)))
            elif started < budget and schedule.can_start():
                launched.append((started, schedule.start(started)))
                number, started = started, started + 1
            else:
                break
            in_flight.append(number)
        if not in_flight:
            stopped += schedule.decide(no_more_trials=True)
            if not schedule.busy():
                return launched, stopped
            continue
        number = in_flight.pop(0)
        schedule.paused(number, values[number][schedule.trials[number].running])
        stopped += schedule.decide(no_more_trials=started >= budget or not schedule.can_start())


def test_asha_promotes_the_best_paused_trial_of_the_highest_rung_and_stops_the_rest_at_the_end():
    values = {0: [0.5, 0.55, 0.6], 1: [0.7, 0.75, 0.8], 2: [0.9, 0.95, 0.99], 3: [0.6, 0.65, 0.7]}
    schedule = Promotions((1, 2, 4), 2, "max", 4, synchronous=False)
    launched, stopped = _drive(schedule, values, budget=4)
    # trial 1 is the best of two at the first rung; trial 2, better, goes on twice; trial 3 comes last and stays
    assert launched == [(0, 0), (1, 0), (1, 1), (2, 0), (2, 1), (2, 2), (3, 0)]
    assert [(d.number, d.rung, d.value) for d in stopped] == [(0, 0, 0.5), (1, 1, 0.75), (3, 0, 0.6)]
    assert "stopped at 1: the search ended" in stopped[0].reason
    assert all(t.settled for t in schedule.trials.values()) and schedule.trials[2].values == {0: 0.9, 1: 0.95, 2: 0.99}


def test_asha_minimising_keeps_the_lowest():
    values = {n: [v, v / 2] for n, v in enumerate([3.0, 1.0, 2.0, 4.0])}
    schedule = Promotions((1, 3), 2, "min", 4, synchronous=False)
    launched, _ = _drive(schedule, values, budget=4, parallel=2)
    assert {n for n, rung in launched if rung == 1} == {1, 2}, "the best half of the four, the lowest values"


def test_hyperband_spreads_the_budget_over_brackets_and_decides_a_rung_only_when_all_its_trials_reached_it():
    assert Promotions((1, 3, 9, 27), 3, "max", 64, synchronous=True).shares == [35, 16, 8, 5]
    schedule = Promotions((1, 3, 9), 3, "max", 9, synchronous=True)
    assert schedule.shares == [5, 3, 1] and schedule.starts == [0, 1, 2]
    values = {n: [0.1 * n, 0.1 * n + 0.01, 0.1 * n + 0.02] for n in range(9)}
    launched, stopped = _drive(schedule, values, budget=9, parallel=3)
    first_promotion = next(i for i, (_, rung) in enumerate(launched) if rung == 1 and schedule.trials[_].bracket == 0)
    assert sum(1 for n, rung in launched[:first_promotion] if rung == 0) == 5, "all of bracket 0 paused first"
    # bracket 0 (trials 0-4) keeps its best (4) to the end; bracket 1 (5-7) its best (7); bracket 2 (8) runs whole
    complete = sorted(n for n, t in schedule.trials.items() if 2 in t.values)
    assert complete == [4, 7, 8]
    assert sorted((d.number, d.rung) for d in stopped) == [(0, 0), (1, 0), (2, 0), (3, 0), (5, 1), (6, 1)]
    assert "not among the best 1 of the 5 trials of bracket 0" in next(d for d in stopped if d.number == 0).reason


def test_a_trial_failed_outside_its_notebook_holds_its_rung_and_a_schedule_restored_mid_way_goes_on_the_same():
    values = {n: [0.1 * n, 0.1 * n + 0.01, 0.1 * n + 0.02] for n in range(9)}
    whole = Promotions((1, 3, 9), 3, "max", 9, synchronous=True)
    expected = _drive(whole, values, budget=9, parallel=3)
    # a driver stopped after bracket 0's first rung: rebuilt from what its journal keeps, the rest is the same
    half = Promotions((1, 3, 9), 3, "max", 9, synchronous=True)
    for n in range(5):
        half.start(n)
        half.paused(n, values[n][0])
    restored = Promotions((1, 3, 9), 3, "max", 9, synchronous=True)
    for n, trial in half.trials.items():
        restored.restore(n, trial.bracket, trial.values, trial.running, trial.settled)
    stopped = restored.decide(no_more_trials=False)
    assert sorted(d.number for d in stopped) == [0, 1, 2, 3] and restored.promotion() == 4
    held = Promotions((1, 3, 9), 3, "max", 9, synchronous=True)
    for n in range(5):
        held.start(n)
    for n in range(4):
        held.paused(n, values[n][0])
    held.held(4)
    assert held.decide(no_more_trials=False) == [] and not held.busy(), "the rung waits for the held trial"
    assert expected[1], "the whole schedule stopped trials"


# --- the driver, over runs faked at the backend's launch ------------------------------------------------------


def _fake_training(monkeypatch, launches: list):
    """The local backend's launch as a run that 'trains' from its resume_from run's EPOCHS to its own: one point per
    epoch of an accuracy curve that rises with the epochs and peaks at LR = 0.01; no kernel runs."""
    import math

    from nbbatch.backends.local.backend import LocalBackend
    from nbbatch.store.jsonl import jsonl_line
    from nbbatch.store.layout import run_paths
    from nbbatch.store.runfiles import new_record, read_record_or_none, write_record
    from nbbatch.store.runjson import Status

    def launch(self, runs, share, options):
        run, = runs
        start = read_record_or_none(share, run.experiment, run.resume_from).parameters["EPOCHS"] if run.resume_from else 0
        quality = 1 - abs(math.log10(run.parameters["LR"]) + 2) / 4
        points = [{"step": s, "time": None, "attempt": 1, "accuracy": quality * (1 - 0.5 ** s)}
                  for s in range(start + 1, run.parameters["EPOCHS"] + 1)]
        share.write_bytes(run_paths(run.experiment, run.run_id).metrics, b"".join(map(jsonl_line, points)))
        record = new_record(run)
        record.status, record.attempts, record.metrics = Status.SUCCEEDED, 1, {"accuracy": points[-1]["accuracy"]}
        write_record(share, record)
        launches.append((run.run_id, run.resume_from, start, run.parameters["EPOCHS"]))

    monkeypatch.setattr(LocalBackend, "launch", launch)


def _search(project, write_experiment, name, block):
    make_notebook(project / "nb.ipynb", ["import nbbatch"], parameters="LR = 0.1\nEPOCHS = 1")
    return write_experiment(json.dumps({"experiment": name, "notebooks": ["nb.ipynb"], "search": block,
                                        "resources": {"max_parallel": 2}}), name=f"{name}.yaml")


def _trials(share_root, name):
    """Each trial's segments (records, in order), checking that each continues the one before."""
    from nbbatch.store.share import FileShare

    by_trial: dict[int, list] = {}
    for record in load_records(FileShare(share_root), name)[0]:
        by_trial.setdefault(record.trial["number"], []).append(record)
    for segments in by_trial.values():
        segments.sort(key=lambda r: r.trial["segment"])
        assert [r.trial["segment"] for r in segments] == list(range(len(segments)))
        for before, after in zip(segments, segments[1:], strict=False):
            assert after.trial["continues"] == before.run_id and before.trial["continued_by"] == after.run_id
            assert before.trial["state"] == "promoted"
        assert segments[-1].trial["state"] in ("complete", "pruned"), segments[-1].trial
    return by_trial


@pytest.mark.parametrize("pruner", [{"asha": {"min_resource": 1, "max_resource": 9, "reduction_factor": 3}},
                                    {"hyperband": {"min_resource": 1, "max_resource": 9, "reduction_factor": 3}}])
def test_a_promoting_search_continues_its_best_trials_from_their_last_run(project, write_experiment, monkeypatch,
                                                                          pruner):
    import optuna

    launches: list = []
    _fake_training(monkeypatch, launches)
    result = submit(_search(project, write_experiment, "pro", {**BLOCK, "pruner": pruner}), progress=False)
    assert result.ok, [(r.run_id, r.status, r.error) for r in result.records]
    by_trial = _trials(project / "results", "pro")
    assert sorted(by_trial) == list(range(9))
    complete = [n for n, segments in by_trial.items() if segments[-1].trial["state"] == "complete"]
    assert complete and all(by_trial[n][-1].parameters["EPOCHS"] == 9 for n in complete)
    for _run_id, resume_from, start, epochs in launches:  # a continued run trains only the epochs after its last
        assert (resume_from is None) == (start == 0) and epochs > start
    trained = sum(epochs - start for _, _, start, epochs in launches)
    assert trained < 9 * 9 / 2, f"{trained} epochs: promotions train at most half of a full search's"
    study = optuna.load_study(study_name="pro/nb", storage=optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(project / ".nbbatch-search" / "pro" / "nb.journal"))))
    states = {t.number: t.state.name for t in study.trials}
    assert set(states.values()) <= {"COMPLETE", "PRUNED"} and sorted(n for n, s in states.items()
                                                                    if s == "COMPLETE") == sorted(complete)
    best = max(complete, key=lambda n: by_trial[n][-1].metrics["accuracy"])
    assert study.best_trial.number == best
    for trial in study.trials:  # the study holds each trial's whole curve, every segment's points
        assert sorted(trial.intermediate_values) == list(range(1, by_trial[trial.number][-1].parameters["EPOCHS"] + 1))


def test_a_promoting_search_stopped_mid_way_goes_on_where_it_was(project, write_experiment, monkeypatch):
    from nbbatch.drivers.promoting import PromotingSearchDriver

    launches: list = []
    _fake_training(monkeypatch, launches)
    original = PromotingSearchDriver._launch_more

    def interrupted(self):
        if len(launches) >= 6 and not getattr(PromotingSearchDriver, "_interrupted", False):
            PromotingSearchDriver._interrupted = True
            raise KeyboardInterrupt
        original(self)

    monkeypatch.setattr(PromotingSearchDriver, "_launch_more", interrupted)
    monkeypatch.setattr(PromotingSearchDriver, "_interrupted", False, raising=False)
    exp = _search(project, write_experiment, "again", {**BLOCK, "pruner": {
        "hyperband": {"min_resource": 1, "max_resource": 9, "reduction_factor": 3}}})
    with pytest.raises(KeyboardInterrupt):
        submit(exp, progress=False)
    before = len(launches)
    result = submit(exp, progress=False)
    assert result.ok
    run_ids = [run_id for run_id, *_ in launches]
    assert len(set(run_ids[:before])) == before and not set(run_ids[before:]) & set(run_ids[:before]), \
        "no run of the first driver ran again"
    by_trial = _trials(project / "results", "again")
    assert sorted(by_trial) == list(range(9)) and sum(len(s) for s in by_trial.values()) == len(launches)


@pytest.mark.slow
def test_a_promoting_search_of_the_pytorch_notebook_continues_each_trial_from_its_checkpoint(pytorch_env, tmp_path,
                                                                                             monkeypatch):
    """The real PyTorch notebook on digits, 4 trials of LR under ASHA with promotions (EPOCHS 1, 2, 4): every
    continued run resumed from the epoch its trial paused at and trained only the epochs after it."""
    from support.machine import REPO

    from nbbatch.store.jsonl import JsonlTail
    from nbbatch.store.layout import run_paths
    from nbbatch.store.share import FileShare

    monkeypatch.setenv("NBBATCH_PROJECT", str(REPO))  # the real frameworks and their envs
    block = {"metric": "loss", "mode": "min", "trials": 4, "sampler": "random", "seed": 1, "resource": "EPOCHS",
             "pruner": {"asha": {"min_resource": 1, "max_resource": 4, "reduction_factor": 2}},
             "params": {"LR": {"loguniform": [1.0e-3, 0.3]}}}
    exp = tmp_path / "pro.yaml"
    exp.write_text(json.dumps({"experiment": "pro", "frameworks": ["pytorch"], "search": block,
                               "parameters": {"DATASET": "digits", "MAX_SAMPLES": 300},
                               "resources": {"max_parallel": 2}, "share": "results"}))
    result = submit(exp, progress=False)
    assert result.ok, [(r.run_id, r.status, r.error) for r in result.records]
    by_trial = _trials(tmp_path / "results", "pro")
    assert sorted(by_trial) == [0, 1, 2, 3] and any(len(s) > 1 for s in by_trial.values())
    share = FileShare(tmp_path / "results")
    for segments in by_trial.values():
        for before, after in zip(segments, segments[1:], strict=False):
            paused_at = before.parameters["EPOCHS"]
            assert after.metrics.get("resumed_from_epoch") == paused_at, after.metrics
            assert after.continues["run_id"] == before.run_id and after.continues["checkpoint"]["files"] >= 1
            steps = [p["step"] for p in JsonlTail(share, run_paths("pro", after.run_id).metrics).read()]
            assert steps == list(range(paused_at + 1, after.parameters["EPOCHS"] + 1)), steps
            assert not (tmp_path / "results" / "pro" / before.run_id / "checkpoints").exists(), "copied, then dropped"
        last = segments[-1]  # a trial stopped at a rung keeps its checkpoints, as a pruned run does
        kept = (tmp_path / "results" / "pro" / last.run_id / "checkpoints").is_dir()
        assert kept == (last.trial["state"] == "pruned"), (last.trial, kept)


def test_a_promoting_study_is_not_rebuilt_from_its_records_but_started_afresh(project, write_experiment, monkeypatch):
    from nbbatch.search.study import SearchError

    launches: list = []
    _fake_training(monkeypatch, launches)
    exp = _search(project, write_experiment, "rb", BLOCK)
    with pytest.raises(SearchError, match="cannot rebuild a study whose trials pause and continue yet.*--force"):
        submit(exp, progress=False, rebuild_search=True)
    assert not launches
