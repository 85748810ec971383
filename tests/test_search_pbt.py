"""Population-based training (``pruner: {pbt: ...}``): the block's checks, the schedule (:mod:`nbbatch.search.pbt`)
on its own, and the driver over runs faked at the backend's launch (no kernel: the notebooks' own resuming is tested
in test_resume_from and test_notebooks)."""

from __future__ import annotations

import json
import math
import random
import statistics

import pytest
from support.notebooks import make_notebook
from test_search_promotions import _fake_training

from nbbatch.api import submit
from nbbatch.drivers import search_driver
from nbbatch.drivers.pbt import PbtSearchDriver
from nbbatch.errors import SpecError
from nbbatch.search.pbt import Population, Segment
from nbbatch.search.study import SearchError
from nbbatch.spec.search import SearchParam, parse_search
from nbbatch.store.runfiles import load_records

pytestmark = pytest.mark.timeout(300)

PBT = {"interval": 1, "max_resource": 3, "fraction": 0.25, "perturb": [0.8, 1.2], "resample": 0.0}
BLOCK = {"metric": "accuracy", "mode": "max", "trials": 4, "sampler": "random", "seed": 3, "resource": "EPOCHS",
         "pruner": {"pbt": PBT}, "params": {"LR": {"loguniform": [1.0e-4, 1.0]}}}


# --- the block --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block, says", [
    ({"resource": None}, "pbt trains its population in generations of search.resource: add resource"),
    ({"pruner": {"pbt": {"max_resource": 9}}}, "pbt needs interval"),
    ({"pruner": {"pbt": {"interval": 3}}}, "pbt needs max_resource"),
    ({"pruner": {"pbt": {**PBT, "interval": 0}}}, "pbt.interval must be a whole number from 1"),
    ({"pruner": {"pbt": {**PBT, "interval": 4}}}, r"max_resource must be ≥ interval \(4\)"),
    ({"pruner": {"pbt": {**PBT, "fraction": 0.6}}}, "fraction must be a number above 0 and at most 0.5"),
    ({"pruner": {"pbt": {**PBT, "fraction": 0}}}, "fraction must be a number above 0"),
    ({"pruner": {"pbt": {**PBT, "perturb": [0.8, -1]}}}, "perturb must be a list of positive factors"),
    ({"pruner": {"pbt": {**PBT, "perturb": 1.2}}}, "perturb must be a list of positive factors"),
    ({"pruner": {"pbt": {**PBT, "perturb": [1, 1.0]}}}, "not all 1"),
    ({"pruner": {"pbt": {**PBT, "resample": 1.5}}}, "resample must be a probability from 0 to 1"),
    ({"pruner": {"pbt": {**PBT, "explore": 1}}}, "pbt: unknown setting `explore`"),
    ({"trials": 1}, "the population of pbt: at least 2"),
    ({"sampler": "grid", "params": {"LR": {"choice": [0.1, 0.01]}}, "trials": 2}, "use one of those"),
    ({"sampler": "cmaes"}, "sampler cmaes: population-based training draws"),
    ({"metric": ["accuracy", "loss"], "mode": ["max", "min"]}, "Optuna's pruners judge one objective"),
    ({"params": {"EPOCHS": {"randint": [1, 9]}}}, "remove it from search.params"),
])
def test_a_pbt_block_that_cannot_work_is_refused_naming_the_fix(block, says):
    with pytest.raises(SpecError, match=says):
        parse_search({**BLOCK, **block})


def test_the_generations_and_the_written_block():
    search = parse_search({**BLOCK, "pruner": {"pbt": {"interval": 3, "max_resource": 8}}})
    assert search.pbt and search.promotes and search.rungs == (3, 6, 8)
    assert search.pruner_settings == {"interval": 3, "max_resource": 8, "fraction": 0.25, "perturb": [0.8, 1.2],
                                      "resample": 0.25}
    assert parse_search(search.to_dict()) == search
    assert search_driver(search) is PbtSearchDriver


# --- the schedule -------------------------------------------------------------------------------------------

SPACE = (SearchParam("LR", "loguniform", (1.0e-4, 1.0)), SearchParam("WIDTH", "randint", (8, 64)),
         SearchParam("OPT", "choice", ("sgd", "adam", "rms")))


def _population(size: int = 8, **settings) -> Population:
    given = {"fraction": 0.25, "perturb": (0.8, 1.2), "resample": 0.0, "seed": 7, **settings}
    return Population(SPACE, 3, size, "max", **given)


def _start(population: Population, values: list[float]) -> None:
    rng = random.Random(1)
    for n, value in enumerate(values):
        population.join(n, {"LR": 10 ** rng.uniform(-4, 0), "WIDTH": rng.randint(8, 64), "OPT": "adam"})
        population.paused(n, value)


def test_the_bottom_fraction_exploits_the_top_fraction_and_the_rest_continue_unchanged():
    population = _population()
    _start(population, [0.1 * n for n in range(8)])  # member 7 is the best, 0 the worst
    before = {n: dict(m.plan[0].params) for n, m in population.members.items()}
    decided = population.decide()
    assert sorted(decided) == list(range(8)) and population.waiting() == list(range(8))
    copied = {n: s.exploits for n, s in decided.items() if s.exploits is not None}
    assert sorted(copied) == [0, 1] and set(copied.values()) <= {6, 7}, "the worst quarter copies the best quarter"
    for n, segment in decided.items():
        if n not in copied:
            assert segment.params == before[n], "a member that keeps its place keeps its parameters"
            continue
        source = before[copied[n]]
        assert segment.params["LR"] / source["LR"] in (pytest.approx(0.8), pytest.approx(1.2))
        assert segment.params["WIDTH"] in (max(8, round(source["WIDTH"] * 0.8)), min(64, round(source["WIDTH"] * 1.2)))
        assert segment.params["OPT"] in ("sgd", "rms"), "a choice moves to a neighbouring choice"
    assert population.decide() == {}, "a generation is decided once"


def test_a_generation_waits_for_every_living_member_and_the_last_is_never_decided():
    population = _population(size=3)
    population.join(0, {"LR": 0.1, "WIDTH": 8, "OPT": "sgd"})
    population.join(1, {"LR": 0.01, "WIDTH": 8, "OPT": "sgd"})
    population.paused(0, 0.5)
    population.paused(1, 0.6)
    assert population.decide() == {}, "member 2 has not joined"
    population.join(2, {"LR": 0.001, "WIDTH": 8, "OPT": "sgd"})
    assert population.decide() == {} and population.busy()
    population.failed(2)
    assert population.decide()[0].exploits == 1, "a failed member is out: two remain, the worse copies the better"
    for n in (0, 1):
        population.launched(n)
        assert not population.paused(n, 0.7)
    assert sorted(population.decide()) == [0, 1]
    for n in (0, 1):
        population.launched(n)
        assert population.paused(n, 0.8), "the third generation is the last"
    assert population.decide() == {} and not population.busy()


def test_perturbations_stay_in_range_and_resample_draws_afresh():
    population = _population(perturb=(0.01, 100.0), resample=0.0)
    rng = random.Random(0)
    for _ in range(200):
        moved = population.explore({"LR": 0.5, "WIDTH": 60, "OPT": "sgd"}, rng)
        assert 1.0e-4 <= moved["LR"] <= 1.0 and 8 <= moved["WIDTH"] <= 64 and isinstance(moved["WIDTH"], int)
        assert moved["OPT"] == "adam", "the first choice's only neighbour"
    fresh = _population(resample=1.0)
    drawn = [fresh.explore({"LR": 0.5, "WIDTH": 60, "OPT": "sgd"}, rng) for _ in range(200)]
    assert len({d["LR"] for d in drawn}) == 200 and all(1.0e-4 <= d["LR"] <= 1.0 for d in drawn)
    assert {d["OPT"] for d in drawn} == {"sgd", "adam", "rms"} and min(d["LR"] for d in drawn) < 0.01


def test_decisions_are_the_same_from_the_same_seed_and_replay_after_a_restart():
    values = [0.3, 0.9, 0.1, 0.5, 0.7, 0.2, 0.8, 0.4]
    first, second, other = _population(), _population(), _population(seed=8)
    for population in (first, second, other):
        _start(population, values)
    decided = first.decide()
    assert decided == second.decide()
    assert decided != other.decide(), "another seed draws other perturbations"
    # a driver stopped after keeping half of the decisions: the rest are drawn again the same, the kept ones stand
    restored = _population()
    for n, member in first.members.items():
        plan = member.plan if n % 2 else member.plan[:1]
        restored.restore(n, plan, member.values, running=False, failed=False)
    assert restored.decide() == {n: s for n, s in decided.items() if n % 2 == 0}
    assert {n: m.plan for n, m in restored.members.items()} == {n: m.plan for n, m in first.members.items()}


# --- the driver, over runs faked at the backend's launch ------------------------------------------------------


def _search(project, write_experiment, name, block):
    make_notebook(project / "nb.ipynb", ["import nbbatch"], parameters="LR = 0.1\nEPOCHS = 1")
    return write_experiment(json.dumps({"experiment": name, "notebooks": ["nb.ipynb"], "search": block,
                                        "resources": {"max_parallel": 2}}), name=f"{name}.yaml")


def _members(share_root, name, launches):
    """Each member's segments (records, in order), checking that each continues its own last run or the exploited
    member's run of the generation before, with the perturbed parameters."""
    from nbbatch.store.share import FileShare

    records = load_records(FileShare(share_root), name)[0]
    by_id = {r.run_id: r for r in records}
    resumed = {run_id: resume_from for run_id, resume_from, *_ in launches}
    by_member: dict[int, list] = {}
    for record in records:
        by_member.setdefault(record.trial["number"], []).append(record)
    for segments in by_member.values():
        segments.sort(key=lambda r: r.trial["segment"])
        assert [r.trial["segment"] for r in segments] == list(range(len(segments)))
        assert [r.parameters["EPOCHS"] for r in segments] == [r.trial["resource"] for r in segments]
        for before, after in zip(segments, segments[1:], strict=False):
            assert before.trial["state"] == "continued" and before.trial["continued_by"] == after.run_id
            assert after.parameters["LR"] == after.trial["params"]["LR"] and resumed[after.run_id] == after.trial["continues"]
            exploited = after.trial.get("exploited")
            if exploited is None:
                assert after.trial["continues"] == before.run_id and after.trial["params"] == before.trial["params"]
                continue
            source = by_id[exploited["run_id"]]
            assert source.trial["number"] == exploited["trial"] and source.trial["segment"] == before.trial["segment"]
            assert after.trial["continues"] == source.run_id
            assert after.trial["params"]["LR"] / source.trial["params"]["LR"] in (pytest.approx(0.8), pytest.approx(1.2))
        assert segments[-1].trial["state"] == "complete", segments[-1].trial
    return by_member


def _study(project, name):
    import optuna

    return optuna.load_study(study_name=f"{name}/nb", storage=optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(project / ".nbbatch-search" / name / "nb.journal"))))


def test_a_pbt_search_copies_the_best_members_checkpoints_and_perturbs_their_parameters(project, write_experiment,
                                                                                       monkeypatch):
    launches: list = []
    _fake_training(monkeypatch, launches)
    result = submit(_search(project, write_experiment, "pbt", {**BLOCK, "trials": 6}), progress=False)
    assert result.ok, [(r.run_id, r.status, r.error) for r in result.records]
    by_member = _members(project / "results", "pbt", launches)
    assert sorted(by_member) == list(range(6)) and all(len(s) == 3 for s in by_member.values())
    assert len(launches) == len({run_id for run_id, *_ in launches}) == 6 * 3, "population × generations runs"
    for _run_id, resume_from, start, epochs in launches:  # a segment trains only the epochs after its source's
        assert (resume_from is None) == (start == 0) and epochs == start + 1
    exploits = [s for segments in by_member.values() for s in segments if s.trial.get("exploited")]
    assert len(exploits) == 2, "one member in each of the two generations decided"
    for generation in (1, 2):  # the copier was the worst of its generation, its source among the best
        ranked = sorted(by_member, key=lambda n: -by_member[n][generation - 1].trial["value"])
        copier = next(n for n, s in by_member.items() if s[generation].trial.get("exploited"))
        assert copier == ranked[-1] and by_member[copier][generation].trial["exploited"]["trial"] == ranked[0]
    study = _study(project, "pbt")
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 6
    for trial in study.trials:  # the member's whole curve, every segment's points; its parameters its first draw
        assert sorted(trial.intermediate_values) == [1, 2, 3]
        assert trial.params["LR"] == by_member[trial.number][0].trial["params"]["LR"]
        assert trial.user_attrs["pbt_schedule"][2]["params"] == by_member[trial.number][2].trial["params"]
        assert trial.value == by_member[trial.number][-1].metrics["accuracy"]
    initial = statistics.median(s[0].trial["value"] for s in by_member.values())
    best = study.best_value
    assert best > initial * 2 and all(math.isfinite(s[-1].trial["value"]) for s in by_member.values())


def test_a_member_whose_run_fails_leaves_the_population(project, write_experiment, monkeypatch):
    from nbbatch.backends.local.backend import LocalBackend
    from nbbatch.store.runfiles import new_record, write_record
    from nbbatch.store.runjson import RunError, Status

    launches: list = []
    _fake_training(monkeypatch, launches)
    fake = LocalBackend.launch

    def failing(self, runs, share, options):
        run, = runs
        if run.parameters["LR"] > 0.1:  # a member with a large LR fails in its notebook
            record = new_record(run)
            record.status, record.error = Status.FAILED, RunError(kind="notebook", ename="ValueError", evalue="nan")
            write_record(share, record)
            return
        fake(self, runs, share, options)

    monkeypatch.setattr(LocalBackend, "launch", failing)
    block = {**BLOCK, "trials": 4, "params": {"LR": {"loguniform": [1.0e-3, 1.0]}}, "seed": 11}
    submit(_search(project, write_experiment, "fails", block), progress=False)
    states = [t.state.name for t in _study(project, "fails").trials]
    assert "FAIL" in states and "COMPLETE" in states and set(states) <= {"FAIL", "COMPLETE"}, states


def test_a_pbt_search_stopped_mid_way_goes_on_where_it_was(project, write_experiment, monkeypatch):
    launches: list = []
    _fake_training(monkeypatch, launches)
    original = PbtSearchDriver._launch_more

    def interrupted(self):
        if len(launches) >= 6 and not getattr(PbtSearchDriver, "_interrupted", False):
            PbtSearchDriver._interrupted = True
            raise KeyboardInterrupt
        original(self)

    monkeypatch.setattr(PbtSearchDriver, "_launch_more", interrupted)
    monkeypatch.setattr(PbtSearchDriver, "_interrupted", False, raising=False)
    exp = _search(project, write_experiment, "again", BLOCK)
    with pytest.raises(KeyboardInterrupt):
        submit(exp, progress=False)
    before = len(launches)
    schedules = {t.number: t.user_attrs["pbt_schedule"] for t in _study(project, "again").trials}
    result = submit(exp, progress=False)
    assert result.ok
    run_ids = [run_id for run_id, *_ in launches]
    assert len(set(run_ids[:before])) == before and not set(run_ids[before:]) & set(run_ids[:before]), \
        "no run of the first driver ran again"
    by_member = _members(project / "results", "again", launches)
    assert sorted(by_member) == [0, 1, 2, 3] and sum(len(s) for s in by_member.values()) == len(launches) == 12
    for trial in _study(project, "again").trials:  # the decisions kept before the stop stand
        assert trial.user_attrs["pbt_schedule"][:len(schedules[trial.number])] == schedules[trial.number]


@pytest.mark.slow
def test_a_pbt_search_of_the_pytorch_notebook_copies_checkpoints_between_members(pytorch_env, tmp_path, monkeypatch):
    """The real PyTorch notebook on digits, a population of 2 (LR × MOMENTUM), interval 1 up to 3 epochs: the worse
    member copies the better one at each of the two decided generations, and every segment resumed from the epoch of
    the run it continues (its own, or the member's it copied) and trained only the epochs after it."""
    from support.machine import REPO

    from nbbatch.store.jsonl import JsonlTail
    from nbbatch.store.layout import run_paths
    from nbbatch.store.share import FileShare

    monkeypatch.setenv("NBBATCH_PROJECT", str(REPO))  # the real frameworks and their envs
    block = {"metric": "accuracy", "mode": "max", "trials": 2, "sampler": "random", "seed": 2, "resource": "EPOCHS",
             "pruner": {"pbt": {"interval": 1, "max_resource": 3, "resample": 0.0}},
             "params": {"LR": {"loguniform": [1.0e-3, 0.3]}, "MOMENTUM": {"uniform": [0.5, 0.95]}}}
    exp = tmp_path / "pbt.yaml"
    exp.write_text(json.dumps({"experiment": "pbt", "frameworks": ["pytorch"], "search": block,
                               "parameters": {"DATASET": "digits", "MAX_SAMPLES": 300},
                               "resources": {"max_parallel": 2}, "share": "results"}))
    result = submit(exp, progress=False)
    assert result.ok, [(r.run_id, r.status, r.error) for r in result.records]
    share = FileShare(tmp_path / "results")
    records = {r.run_id: r for r in load_records(share, "pbt")[0]}
    assert len(records) == 2 * 3
    copies = [r for r in records.values() if r.trial.get("exploited")]
    assert len(copies) == 2, "one member copied another in each decided generation"
    for record in records.values():
        if record.trial["segment"] == 0:
            continue
        source = records[record.trial["continues"]]
        assert record.continues["run_id"] == source.run_id and record.continues["checkpoint"]["files"] >= 1
        assert record.metrics.get("resumed_from_epoch") == source.parameters["EPOCHS"], record.metrics
        steps = [p["step"] for p in JsonlTail(share, run_paths("pbt", record.run_id).metrics).read()]
        assert steps == [record.parameters["EPOCHS"]], steps
        assert record.parameters["LR"] == record.trial["params"]["LR"]


def test_a_member_asked_but_never_drawn_before_its_driver_stopped_is_failed_and_the_rest_go_on(
        project, write_experiment, monkeypatch):
    import nbbatch.drivers.pbt as pbt_driver

    launches: list = []
    _fake_training(monkeypatch, launches)
    draws = []

    def stopped_mid_ask(trial, search):  # the driver is killed between asking for member 2 and drawing it
        draws.append(trial.number)
        if trial.number == 2 and draws.count(2) == 1:
            raise KeyboardInterrupt
        return suggest(trial, search)

    from nbbatch.search.study import suggest

    monkeypatch.setattr(pbt_driver, "suggest", stopped_mid_ask)
    exp = _search(project, write_experiment, "lost", BLOCK)
    with pytest.raises(KeyboardInterrupt):
        submit(exp, progress=False)
    submit(exp, progress=False)
    states = {t.number: t.state.name for t in _study(project, "lost").trials}
    assert states == {0: "COMPLETE", 1: "COMPLETE", 2: "FAIL", 3: "COMPLETE"}, states


CANDIDATES = [-1, 0, 0.25, 0.5, 0.6, 1, 1.5, 2, 3, float("inf"), float("nan"), True, "3", None, [], [1.2], [0, 1]]


@pytest.mark.parametrize("key", list(PBT))
def test_each_pbt_setting_is_refused_exactly_when_it_is_out_of_its_range(key):
    def valid(value) -> bool:
        real = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if key in ("interval", "max_resource"):
            return real and value == int(value) and 1 <= value <= 3 and (key == "interval" or value >= 1)
        if key == "fraction":
            return real and 0 < value <= 0.5
        if key == "resample":
            return real and 0 <= value <= 1
        return isinstance(value, list) and value == [1.2]

    for value in CANDIDATES:
        settings = {**PBT, key: value} if key != "max_resource" else {**PBT, "interval": 1, key: value}
        try:
            parse_search({**BLOCK, "pruner": {"pbt": settings}})
        except SpecError as exc:
            assert str(exc).startswith((f"search.pruner.pbt.{key} must be", f"search.pruner.pbt needs {key}:")), \
                (value, str(exc))
            assert not valid(value), (key, value, str(exc))
        else:
            assert valid(value), (key, value)


def test_rebuilding_a_pbt_study_is_refused_saying_what_to_do(project, write_experiment):
    with pytest.raises(SearchError, match="cannot rebuild a population-based training study yet.*--force"):
        submit(_search(project, write_experiment, "rebuilt", BLOCK), progress=False, rebuild_search=True)


def test_no_two_segments_of_a_generation_are_the_same_run():
    """A copy's run is known by its parameters and the run it resumes from: two copiers drawing the same source and
    factor, or a copy clipped to its source's parameters, would be one run for two members."""
    space = (SearchParam("LR", "uniform", (0.1, 1.0)),)
    for seed in range(30):
        population = Population(space, 3, 8, "max", fraction=0.5, perturb=(0.8, 1.2), resample=0.0, seed=seed)
        for n in range(8):
            population.join(n, {"LR": 1.0 if n >= 4 else 0.5})  # the best at the top of the range: ×1.2 clips to it
            population.paused(n, float(n))
        decided = population.decide()
        runs = [(n if s.exploits is None else s.exploits, s.params) for n, s in decided.items()]
        assert all(runs.count(run) == 1 for run in runs), (seed, runs)
        assert sum(s.exploits is not None for s in decided.values()) >= 2
    single = Population((SearchParam("OPT", "choice", ("sgd",)),), 3, 2, "max", fraction=0.5, perturb=(0.8, 1.2),
                        resample=0.5, seed=1)
    for n in range(2):
        single.join(n, {"OPT": "sgd"})
        single.paused(n, float(n))
    assert single.decide() == {0: Segment({"OPT": "sgd"}), 1: Segment({"OPT": "sgd"})}, "nothing to copy differently"
