"""Searches when things go wrong: bad metric values, damaged journals, failing notebooks, settings Optuna refuses."""

from __future__ import annotations

import json
import math
import os

import pytest
from support.notebooks import make_notebook

from nbbatch.api import submit
from nbbatch.errors import SpecError
from nbbatch.search.study import SearchError, open_study, search_fingerprint
from nbbatch.spec.search import PRUNER_SETTINGS, Search, SearchParam, parse_search
from nbbatch.store.runfiles import read_record_or_none
from nbbatch.store.share import FileShare
from nbbatch.ui.cli import main

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
                 block: dict | None = None, **params: list) -> object:
    """An experiment file: a grid search of the tiny notebook over KIND (what it records as loss)."""
    make_notebook(project / "nb.ipynb", cells or [KINDS], parameters="KIND = 'ok'\nLR = 0.0")
    trials = len(kinds) * math.prod(len(values) for values in params.values())
    search = {"metric": "loss", "mode": "min", "trials": trials, "sampler": "grid", "seed": 0,
              "params": {"KIND": kinds, **params}, **(block or {})}
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


DIVERGING = """\
import time, nbbatch
for step in range(1, 9):
    nbbatch.record(step=step, loss=float(KIND) if step >= 2 and KIND != "ok" else 1.0 / step + LR)
    time.sleep(0.3)
"""


@pytest.mark.kernel
def test_a_trial_whose_metric_turns_nan_or_inf_midway_is_pruned_there_saying_so_and_the_search_goes_on(
        project, write_experiment):
    """A run whose loss became nan (or inf) at step 2 trained on to its end, out of the pruner's sight, and the
    search learnt only there that it had diverged. With a pruner, the trial stops at that step, pruned with the
    true reason; the other trials go on."""
    exp = _grid_search(project, write_experiment, "diverged", ["ok", "nan", "-inf"], cells=[DIVERGING],
                       block={"pruner": {"median": {"startup_trials": 0}}})
    result = submit(exp, progress=False)
    trials = {r.parameters["KIND"]: r for r in result.records}
    assert sorted(trials) == ["-inf", "nan", "ok"], [(r.run_id, r.status, r.error) for r in result.records]
    assert trials["ok"].trial["state"] == "complete"
    for kind in ("nan", "-inf"):
        record = trials[kind]
        assert str(record.status) == "pruned" and record.trial["state"] == "pruned" and record.trial["step"] == 2
        assert record.trial["reason"].startswith(f"loss was {kind} at step 2 (not a finite number): stopped there")
        assert record.error.reason == record.trial["reason"]
    assert sorted(t.state.name for t in _study(project, "diverged").trials) == ["COMPLETE", "PRUNED", "PRUNED"]


CANDIDATES = [-1, 0, 0.5, 1, 2, 2.5, 3, 25, 99.5, 100, 101, float("inf"), float("nan"), True, "3", None]


# pbt is nbbatch's own schedule, no Optuna pruner: test_search_pbt checks its settings
@pytest.mark.parametrize("pruner, key", [(p, k) for p, keys in PRUNER_SETTINGS.items() for k in keys if p != "pbt"])
def test_a_pruner_setting_is_accepted_at_plan_time_exactly_when_optuna_accepts_it(pruner, key):
    """Every setting of every pruner, over values around each limit: planning refuses what Optuna would refuse in
    the driver (after the lock), and what it accepts, Optuna accepts."""
    base = {"max_resource": 1000} if pruner == "hyperband" else {}
    # asha's max_resource is nbbatch's own (the last rung of trials that pause and continue, with `resource:`): it is
    # held to what Hyperband's max_resource must be
    promoting = pruner == "asha" and key == "max_resource"
    for value in CANDIDATES:
        try:
            parse_search(_block(trials=10**6, pruner={pruner: {**base, key: value}},
                                **({"resource": "EPOCHS"} if promoting else {})))
        except SpecError as exc:
            planned = str(exc)
            assert planned.startswith(f"search.pruner.{pruner}.{key} must be"), planned
        else:
            planned = None
        judged, settings = ("hyperband", PRUNER_SETTINGS["hyperband"]) if promoting else (pruner, PRUNER_SETTINGS[pruner])
        assert (planned is None) == _optuna_takes(judged, {**settings, **base, key: value}), (
            pruner, key, value, planned)


def _optuna_takes(pruner: str, settings: dict) -> bool:
    """Whether Optuna's own pruner takes these settings, through its first decisions (Hyperband checks late)."""
    import optuna

    if pruner == "asha" and settings.get("max_resource") is None:
        settings = {k: v for k, v in settings.items() if k != "max_resource"}  # not Optuna's (see above)
    # Optuna's signatures take ints for the counts and steps (a fraction runs, truncated or compared as it is; inf
    # never ends): nbbatch refuses one rather than guess
    if not all(isinstance(v, int) and not isinstance(v, bool) for k, v in settings.items() if k != "percentile"):
        return False
    names = {"startup_trials": "n_startup_trials", "warmup_steps": "n_warmup_steps"}
    given = {names.get(k, k): v for k, v in settings.items()}
    kind = {"median": optuna.pruners.MedianPruner, "percentile": optuna.pruners.PercentilePruner,
            "asha": optuna.pruners.SuccessiveHalvingPruner, "hyperband": optuna.pruners.HyperbandPruner}[pruner]
    try:
        study = optuna.create_study(pruner=kind(**given))
        for number in range(3):
            trial = study.ask()
            for step in (1, 2, 3):
                trial.report(1.0 / (step + number), step)
                trial.should_prune()
            study.tell(trial, 1.0)
    except (ValueError, TypeError, OverflowError, ZeroDivisionError):
        return False
    return not isinstance(settings.get("percentile"), (bool, str))  # Optuna compares what it is given


def test_a_seed_is_accepted_at_plan_time_exactly_when_optuna_accepts_it():
    from nbbatch.search.study import sampler_of

    for sampler in ("tpe", "random", "qmc"):
        for seed in (-1, 0, 7, 2**32 - 1, 2**32, 2**40):
            try:
                search = parse_search(_block(sampler=sampler, seed=seed))
            except SpecError as exc:
                assert "search.seed must be a whole number from 0 to 4294967295" in str(exc)
                continue
            for asked in (0, 5):  # a resumed study's seed moves on, and stays in numpy's range
                sampler_of(search, asked=asked).sample_independent(*_one_draw(search))


def test_percentile_0_and_100_are_accepted_as_optuna_accepts_them():
    for percentile in (0, 100):
        assert parse_search(_block(pruner={"percentile": {"percentile": percentile}})).pruner_settings[
            "percentile"] == percentile


def _block(**block) -> dict:
    return {"metric": "loss", "mode": "min", "trials": 8, "params": {"LR": {"loguniform": [1.0e-4, 1.0]}}, **block}


def _unchecked(pruner: str, given: dict):
    """A Search with settings the spec would refuse, to ask Optuna itself."""
    return Search("loss", "min", 100, (SearchParam("LR", "uniform", (0.0, 1.0)),), pruner=pruner,
                  pruner_settings={**PRUNER_SETTINGS[pruner], **given})


def _one_draw(search):
    import optuna

    study = optuna.create_study()
    trial = study.ask()
    return study, study._storage.get_trial(trial._trial_id), "LR", optuna.distributions.FloatDistribution(1e-4, 1.0)


def _journal_with_trials(tmp_path, told: int = 3):
    """A study's journal as a driver leaves it: ``told`` trials asked and told."""
    search = parse_search(_block(sampler="random", seed=1))
    path = tmp_path / "s" / "nb.journal"
    study = open_study(search, path, "s/nb", "f")
    for number in range(told):
        trial = study.ask()
        trial.suggest_float("LR", 1e-4, 1.0, log=True)
        study.tell(trial, float(number))
    return search, path


@pytest.mark.parametrize("damage, left", [
    (b'{"op_code":6,"worker_id":"x","trial_id":3,"sta', 3),  # a driver killed mid-write
    (b'{"op_code":6,"worker_id":"x","trial_id":3,"sta\x00\x00\x00\x00\n', 3),  # a full disk's zero-filled tail
    (b"garbage\n\xff\xfe junk\n", 3),
])
def test_a_journal_with_a_damaged_end_is_read_up_to_it_once_said(tmp_path, damage, left):
    search, path = _journal_with_trials(tmp_path)
    with path.open("ab") as journal:
        journal.write(damage)
    said = []
    study = open_study(search, path, "s/nb", "f", say=said.append)
    assert len(study.trials) == left and all(t.state.name == "COMPLETE" for t in study.trials)
    assert len(said) == 1 and f"the search journal {path} ended in" in said[0] and "dropped" in said[0]
    trial = study.ask()  # the study goes on, and the journal stays whole
    trial.suggest_float("LR", 1e-4, 1.0, log=True)
    study.tell(trial, 9.0)
    said.clear()
    assert len(open_study(search, path, "s/nb", "f", say=said.append).trials) == left + 1 and not said


@pytest.mark.parametrize("damage", [b"garbage\n", b"\x00\xff\xfe\x01\n", b'{"op_code":6,"wor'])
def test_a_journal_damaged_in_the_middle_is_refused_in_one_line_naming_the_fix(tmp_path, damage):
    search, path = _journal_with_trials(tmp_path, told=1)
    data = path.read_bytes().split(b"\n")
    path.write_bytes(b"\n".join(data[:2]) + b"\n" + damage + b"\n".join(data[2:]))
    with pytest.raises(SearchError, match=rf"the search journal {path} is damaged at line 3 .* submit with --force "
                                          "to start the search afresh"):
        open_study(search, path, "s/nb", "f", say=print)
    study = open_study(search, path, "s/nb", "f", fresh=True, say=print)  # --force: afresh, the old one kept
    assert study.trials == [] and path.with_suffix(".journal.old").exists()


def test_a_folder_or_a_read_only_file_in_place_of_the_journal_is_one_line(tmp_path):
    search = parse_search(_block())
    path = tmp_path / "s" / "nb.journal"
    path.mkdir(parents=True)
    with pytest.raises(SearchError, match=rf"the search journal {path} is not a file: move it aside, or submit with "
                                          "--force"):
        open_study(search, path, "s/nb", "f")
    path.rmdir()
    _journal_with_trials(tmp_path)
    path.chmod(0o444)
    if os.access(path, os.W_OK):
        pytest.skip("root writes a read-only file")
    with pytest.raises(SearchError, match=r"cannot be written \(read-only\): make it writable"):
        open_study(search, path, "s/nb", "f")


def test_submit_with_a_folder_in_place_of_the_journal_says_so_in_one_line(project, write_experiment, capsys):
    exp = _grid_search(project, write_experiment, "dir", ["ok"])
    (project / ".nbbatch-search" / "dir" / "nb.journal").mkdir(parents=True)
    assert main(["submit", str(exp)]) != 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "nb.journal is not a file: move it aside" in err, err


@pytest.mark.kernel
def test_a_trial_lost_to_the_share_stays_open_and_runs_again_when_the_search_is_resubmitted(project, write_experiment,
                                                                                             monkeypatch):
    """The first trial's run fails outside its notebook (the share could not be written): the search goes on without
    counting it, and `submit` again runs it under the same trial and run id."""
    from nbbatch.backends.base import Backend
    from nbbatch.backends.local.backend import LocalBackend
    from nbbatch.store.runfiles import write_record
    from nbbatch.store.runjson import ErrorKind, RunError, Status

    exp = _grid_search(project, write_experiment, "full", ["ok"], LR=[0.1, 0.2, 0.3])
    lost = []

    def launch(self, runs, share, options):
        Backend.launch(self, runs, share, options)
        if not lost:  # the first trial: as a full share leaves it
            record = read_record_or_none(share, "full", runs[0].run_id)
            record.status = Status.FAILED
            record.error = RunError("OSError", "No space left on device", reason="the share could not be written",
                                    kind=ErrorKind.SHARE)
            write_record(share, record)
            lost.append(record.run_id)

    monkeypatch.setattr(LocalBackend, "launch", launch)
    first = submit(exp, progress=False)
    assert not first.ok and len(first.records) == 3
    study = _study(project, "full")
    open_trials = [t for t in study.trials if t.state.name == "RUNNING"]
    assert [t.user_attrs["run_id"] for t in open_trials] == lost
    assert sorted(t.state.name for t in study.trials) == ["COMPLETE", "COMPLETE", "RUNNING"]
    assert read_record_or_none(FileShare(project / "results"), "full", lost[0]).trial["state"] == "open"
    monkeypatch.undo()
    again = submit(exp, progress=False)
    assert again.ok, [(r.run_id, r.status, r.error) for r in again.records]
    study = _study(project, "full")
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 3
    assert study.trials[open_trials[0].number].user_attrs["run_id"] == lost[0]


@pytest.mark.kernel
def test_raising_the_budget_of_a_finished_search_goes_on_in_the_same_study(project, write_experiment):
    exp = _grid_search(project, write_experiment, "grow", ["ok"], LR=[0.1, 0.2, 0.3], block={"trials": 2})
    assert submit(exp, progress=False).ok
    numbers = [(t.number, t.user_attrs["run_id"]) for t in _study(project, "grow").trials]
    text = json.loads(exp.read_text())
    text["search"]["trials"] = 3
    exp.write_text(json.dumps(text))
    result = submit(exp, progress=False)
    assert result.ok and len(result.records) == 3
    trials = _study(project, "grow").trials
    assert [(t.number, t.user_attrs["run_id"]) for t in trials[:2]] == numbers and len(trials) == 3
    assert sorted(r.parameters["LR"] for r in result.records) == [0.1, 0.2, 0.3]  # the grid's last point, once


def test_a_study_fingerprinted_with_its_budget_resumes_and_is_brought_up_to_date(tmp_path):
    search = parse_search(_block())
    path = tmp_path / "s" / "nb.journal"
    old = search_fingerprint(search, "nb-1", with_budget=True)
    open_study(search, path, "s/nb", old)
    new = search_fingerprint(search, "nb-1")
    assert open_study(search, path, "s/nb", new, earlier=[old]).user_attrs["fingerprint"] == new
    with pytest.raises(SearchError, match="of another search"):
        open_study(search, path, "s/nb", search_fingerprint(search, "nb-2"))


@pytest.mark.kernel
def test_a_notebook_failing_the_same_way_in_its_first_trials_stops_the_search_and_a_resubmit_runs_nothing(
        project, write_experiment):
    failing = "import nbbatch\nnbbatch.record(step=1, loss=LR)\n1 / 0"
    exp = _grid_search(project, write_experiment, "broken", ["ok"], cells=[failing], LR=[0.1, 0.2, 0.3, 0.4, 0.5],
                       block={"pruner": "none"})
    text = json.loads(exp.read_text())
    text["resources"]["max_parallel"] = 1
    exp.write_text(json.dumps(text))
    for _ in range(2):
        with pytest.raises(SearchError, match=r"the first 3 trials of nb all failed the same way \(ZeroDivisionError "
                                              r"in cell \d \(\"import nbbatch\"\); runs .*\): its notebook fails whatever "
                                              r"the parameters"
                                              r".* submit with --force"):
            submit(exp, progress=False)
        assert [t.state.name for t in _study(project, "broken").trials] == ["FAIL"] * 3


@pytest.mark.kernel
def test_a_search_stopped_for_a_missing_metric_spends_no_run_when_submitted_again(project, write_experiment):
    exp = _grid_search(project, write_experiment, "nometric", ["ok"], cells=["import nbbatch\nnbbatch.record(acc=LR)"],
                       LR=[0.1, 0.2, 0.3, 0.4])
    text = json.loads(exp.read_text())
    text["resources"]["max_parallel"] = 1
    exp.write_text(json.dumps(text))
    for _ in range(2):
        with pytest.raises(SearchError, match=r"search.metric `loss` was never recorded: run nb-\w+ of nb succeeded "
                                              r"without it \(it recorded acc\)"):
            submit(exp, progress=False)
        assert len(_study(project, "nometric").trials) == 1


def test_the_reused_name_warning_counts_a_searchs_trials_not_its_first_run(tmp_path):
    from nbbatch.drivers.manifest import write_manifest
    from nbbatch.spec.experiment import Experiment

    spec = Experiment.from_dict({"experiment": "s", "frameworks": ["pytorch"], "search": _block(trials=12)})
    share = FileShare(tmp_path)
    assert write_manifest(share, spec, ["pytorch-1"], source=tmp_path / "a.yaml") == []
    warning, = write_manifest(share, spec, ["pytorch-2"], source=tmp_path / "b.yaml")
    assert "show this submission's search (up to 12 trials per notebook)" in warning and "1 run(s)" not in warning


def _finished_search(project, write_experiment, name: str, told: int, pruner: object = "none"):
    """An experiment file of a random search whose study holds ``told`` finished trials, their runs' records and
    metric histories on the share as a driver leaves them (no kernel runs): every fifth trial pruned at step 1, every
    seventh failed; its budget spent. Returns the file and the study's journal."""
    from nbbatch.api import prepare
    from nbbatch.search.study import journal_path
    from nbbatch.store.jsonl import jsonl_line
    from nbbatch.store.layout import run_paths
    from nbbatch.store.runfiles import new_record, write_record
    from nbbatch.store.runjson import RunError, Status

    make_notebook(project / "nb.ipynb", [KINDS], parameters="KIND = 'ok'\nLR = 0.0")
    search = _block(trials=told, sampler="random", seed=1, pruner=pruner)
    exp = write_experiment(json.dumps({"experiment": name, "notebooks": ["nb.ipynb"], "search": search}),
                           name=f"{name}.yaml")
    the_plan, _, share = prepare(exp, progress=False)
    template = the_plan.runs[0]
    label = template.run_id.rsplit("-", 1)[0]
    path = journal_path(project, name, label)
    study = open_study(the_plan.experiment.search, path, f"{name}/{label}",
                       search_fingerprint(the_plan.experiment.search, template.run_id))
    for number in range(told):
        trial = study.ask()
        lr = trial.suggest_float("LR", 1e-4, 1.0, log=True)
        run = the_plan.trial(template, {"LR": lr})
        trial.set_user_attr("run_id", run.run_id)
        steps = (1,) if number % 5 == 3 else (1, 2)
        history = b""
        for step in steps:
            trial.report(lr + 1.0 / step, step)
            history += jsonl_line({"step": step, "time": None, "attempt": 1, "loss": lr + 1.0 / step})
        share.write_bytes(run_paths(name, run.run_id).metrics, history)
        record = new_record(run)
        record.attempts = 1
        if number % 5 == 3:
            study.tell(trial, state=optuna_state("PRUNED"))
            record.status, record.trial = Status.PRUNED, {"state": "pruned", "step": 1, "value": lr + 1.0}
        elif number % 7 == 6:
            trial.set_user_attr("failure", "ValueError in cell 1")
            study.tell(trial, state=optuna_state("FAIL"))
            record.status, record.trial = Status.FAILED, {"state": "failed", "reason": "its run failed"}
            record.error = RunError("ValueError", "diverged", cell_index=1)
        else:
            study.tell(trial, lr + 0.5)
            record.status, record.trial = Status.SUCCEEDED, {"state": "complete", "value": lr + 0.5}
            record.metrics = {"loss": lr + 0.5}
        record.trial = {"study": f"{name}/{label}", "number": number, **record.trial}
        write_record(share, record)
    return exp, path


def optuna_state(name: str):
    import optuna

    return optuna.trial.TrialState[name]


def test_resuming_a_search_of_many_finished_trials_writes_its_manifest_once(project, write_experiment, monkeypatch):
    """Resuming a study of N finished trials wrote experiment.json once per trial (3,000 trials: ~3,011 writes, each
    reading the last): the trials' runs are written once per batch of changes."""
    exp, _ = _finished_search(project, write_experiment, "many", told=60)
    writes = []
    real = FileShare.write_bytes

    def counting(self, path, data):
        if path.endswith("experiment.json"):
            writes.append(len(json.loads(data)["runs"]))
        return real(self, path, data)

    monkeypatch.setattr(FileShare, "write_bytes", counting)
    for _ in range(2):  # a resume, and the resume of a resume
        writes.clear()
        submit(exp, progress=False)
        assert writes == [60], writes


def _attempts_launch(monkeypatch, attempts: dict[int, list[float]]):
    """The local backend's launch, as a run that ``attempts`` leave: each attempt's loss by step (1, 2, …) appended
    to metrics.jsonl, then the run's record ends succeeded with the last attempt's last loss. No kernel runs."""
    from nbbatch.backends.local.backend import LocalBackend
    from nbbatch.store.jsonl import jsonl_line
    from nbbatch.store.layout import run_paths
    from nbbatch.store.runfiles import new_record, write_record
    from nbbatch.store.runjson import Status

    def launch(self, runs, share, options):
        run, = runs
        path = run_paths(run.experiment, run.run_id).metrics
        try:
            history = share.read_bytes(path)
        except Exception:  # noqa: BLE001 - no history yet
            history = b""
        for attempt, losses in attempts.items():
            history += b"".join(jsonl_line({"step": step, "time": None, "attempt": attempt, "loss": loss})
                                for step, loss in enumerate(losses, 1))
        share.write_bytes(path, history)
        record = new_record(run)
        record.status, record.attempts, record.metrics = Status.SUCCEEDED, max(attempts), {"loss": losses[-1]}
        write_record(share, record)

    monkeypatch.setattr(LocalBackend, "launch", launch)


def test_a_retried_trials_steps_take_the_retrys_values_without_a_warning(project, write_experiment, monkeypatch):
    """A run retried within one submission records its steps again: the study held the first attempt's values and
    dropped the retry's silently. It holds the values of the attempt that ended the trial."""
    import warnings

    make_notebook(project / "nb.ipynb", [KINDS], parameters="KIND = 'ok'\nLR = 0.0")
    exp = write_experiment(json.dumps({"experiment": "retried", "notebooks": ["nb.ipynb"],
                                       "search": _block(trials=1, sampler="random", seed=1, pruner="none")}))
    _attempts_launch(monkeypatch, {1: [9.0, 8.0], 2: [3.0, 2.0, 1.0]})
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert submit(exp, progress=False).ok
    assert not [w for w in said if "already reported" in str(w.message)]
    trial, = _study(project, "retried").trials
    assert trial.state.name == "COMPLETE" and trial.value == 1.0
    assert trial.intermediate_values == {1: 3.0, 2: 2.0, 3: 1.0}


def _one_trial_search(project, write_experiment, name):
    """A one-trial random search of the KINDS notebook, planned, and its study opened as its driver opens it:
    (the experiment file, its plan, its share, the study)."""
    from nbbatch.api import prepare
    from nbbatch.search.study import journal_path

    make_notebook(project / "nb.ipynb", [KINDS], parameters="KIND = 'ok'\nLR = 0.0")
    exp = write_experiment(json.dumps({"experiment": name, "notebooks": ["nb.ipynb"],
                                       "search": _block(trials=1, sampler="random", seed=1, pruner="none")}))
    the_plan, _, share = prepare(exp, progress=False)
    template, search = the_plan.runs[0], the_plan.experiment.search
    label = template.run_id.rsplit("-", 1)[0]
    return exp, the_plan, share, open_study(search, journal_path(project, name, label), f"{name}/{label}",
                                            search_fingerprint(search, template.run_id))


def test_a_trial_run_again_on_resume_reports_its_steps_again_without_a_warning_per_step(
        project, write_experiment, monkeypatch):
    """A trial left open (its run failed outside the notebook) runs again when the search is submitted again: Optuna
    warned once per step the rerun reported again, and kept the first run's values. The rerun's values are the
    study's, said by no warning."""
    import warnings

    from nbbatch.store.jsonl import jsonl_line
    from nbbatch.store.layout import run_paths
    from nbbatch.store.runfiles import new_record, write_record
    from nbbatch.store.runjson import ErrorKind, RunError, Status

    exp, the_plan, share, study = _one_trial_search(project, write_experiment, "again")
    template = the_plan.runs[0]
    trial = study.ask()  # the first driver's trial: two steps told, then the share failed its run
    run = the_plan.trial(template, {"LR": trial.suggest_float("LR", 1e-4, 1.0, log=True)})
    trial.set_user_attr("run_id", run.run_id)
    history = b""
    for step, loss in ((1, 9.0), (2, 8.0)):
        trial.report(loss, step)
        history += jsonl_line({"step": step, "time": None, "attempt": 1, "loss": loss})
    share.write_bytes(run_paths("again", run.run_id).metrics, history)
    record = new_record(run)
    record.status, record.attempts = Status.FAILED, 1
    record.error = RunError("OSError", "No space left on device", reason="the share could not be written",
                            kind=ErrorKind.SHARE)
    write_record(share, record)
    _attempts_launch(monkeypatch, {2: [3.0, 2.0, 1.0]})
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert submit(exp, progress=False).ok
    assert not [w for w in said if "already reported" in str(w.message)], [str(w.message) for w in said]
    trial, = _study(project, "again").trials
    assert trial.state.name == "COMPLETE" and trial.value == 1.0
    assert trial.intermediate_values == {1: 3.0, 2: 2.0, 3: 1.0}


def _trials(study) -> list[tuple]:
    return [(t.number, t.state.name, t.params, t.distributions, t.value, t.intermediate_values, t.user_attrs)
            for t in study.trials]


def test_a_lost_journal_is_refused_naming_the_rebuild_and_rebuilt_from_the_records_as_it_was(
        project, write_experiment, capsys):
    """A deleted journal whose trials' runs are on the share: submit refuses to start the search over (it would run
    them again) and names --rebuild-search, which gives back every trial as the study held it."""
    exp, path = _finished_search(project, write_experiment, "lost", told=24, pruner={"asha": {"min_resource": 1}})
    before = _trials(_study(project, "lost"))
    assert {t[1] for t in before} == {"COMPLETE", "PRUNED", "FAIL"}
    path.unlink()
    assert main(["submit", str(exp)]) != 0
    err = " ".join(capsys.readouterr().err.split())
    assert "Traceback" not in err and f"the search journal {path} is missing, but 24 run(s) on the share record " \
        "trials of study `lost/nb`: submit with --rebuild-search to rebuild the study" in err, err
    main(["submit", str(exp), "--rebuild-search"])  # 1: some trials failed
    err = " ".join(capsys.readouterr().err.split())
    assert "Traceback" not in err and f"rebuilt the search journal {path} from 24 run record(s): 24 trial(s)" in err, err
    assert _trials(_study(project, "lost")) == before
    assert list(path.parent.iterdir()) == [path]  # nothing left beside it: there was nothing to keep


def test_a_rebuilt_study_goes_on_without_running_its_finished_trials_again(project, write_experiment, monkeypatch):
    """A journal damaged beyond reading, rebuilt: the damaged file is kept beside the new one, and the search,
    its budget raised, runs only new trials."""
    exp, path = _finished_search(project, write_experiment, "damaged", told=12)
    before = _trials(_study(project, "damaged"))
    lines = path.read_bytes().split(b"\n")
    damaged = b"\n".join(lines[:3] + [b"garbage"] + lines[3:])
    path.write_bytes(damaged)
    with pytest.raises(SearchError, match="submit with --rebuild-search to rebuild the study"):
        submit(exp, progress=False)
    text = json.loads(exp.read_text())
    text["search"]["trials"] = 14
    exp.write_text(json.dumps(text))
    launched = []
    _attempts_launch(monkeypatch, {1: [0.2, 0.1]})
    from nbbatch.backends.local.backend import LocalBackend

    fake = LocalBackend.launch
    monkeypatch.setattr(LocalBackend, "launch", lambda self, runs, share, options: (
        launched.extend(r.run_id for r in runs), fake(self, runs, share, options)))
    result = submit(exp, progress=False, rebuild_search=True)
    after = _study(project, "damaged")
    assert _trials(after)[:12] == before and len(after.trials) == 14
    assert launched == [t.user_attrs["run_id"] for t in after.trials[12:]]
    assert {r.run_id for r in result.records} >= set(launched)
    backup, = path.parent.glob("nb.journal.before-rebuild-*")
    assert backup.read_bytes() == damaged


def test_a_rebuilt_grid_search_draws_on_from_the_points_it_had_not_visited(tmp_path):
    from nbbatch.search.rebuild import rebuild_journal
    from nbbatch.store.runjson import RunRecord, Status

    search = parse_search(_block(trials=4, sampler="grid", params={"LR": [0.1, 0.2, 0.3, 0.4]}))
    path = tmp_path / "g" / "nb.journal"
    study = open_study(search, path, "g/nb", "f")
    records = []
    for number in range(2):
        trial = study.ask()
        lr = trial.suggest_categorical("LR", [0.1, 0.2, 0.3, 0.4])
        study.tell(trial, lr)
        records.append(RunRecord(f"nb-{number}", "g", "nb.ipynb", "python3", parameters={"LR": lr},
                                 status=Status.SUCCEEDED, trial={"study": "g/nb", "number": number,
                                                                 "state": "complete", "value": lr}))
    visited = {t.params["LR"] for t in study.trials}
    path.unlink()
    rebuild_journal(search, path, "g/nb", "f", records, lambda run_id: [], say=print)
    study = open_study(search, path, "g/nb", "f")
    for _ in range(2):
        trial = study.ask()
        study.tell(trial, trial.suggest_categorical("LR", [0.1, 0.2, 0.3, 0.4]))
    assert {t.params["LR"] for t in study.trials[2:]} == {0.1, 0.2, 0.3, 0.4} - visited


def test_a_trial_asked_by_a_driver_killed_before_it_named_the_run_draws_and_runs_on_resume(
        project, write_experiment, monkeypatch):
    """The driver was killed between asking Optuna for a trial and naming its run (no parameters, no run id in the
    journal): the resumed search drew the template's parameters and told a trial that names no run."""
    exp, *_, study = _one_trial_search(project, write_experiment, "bare")
    study.ask()
    _attempts_launch(monkeypatch, {1: [0.5]})
    result = submit(exp, progress=False)
    trial, = _study(project, "bare").trials
    record, = result.records
    assert result.ok and trial.state.name == "COMPLETE" and trial.user_attrs["run_id"] == record.run_id
    assert 1e-4 <= trial.params["LR"] == record.parameters["LR"] <= 1.0


def test_rebuild_search_is_refused_in_one_line_where_it_means_nothing(project, write_experiment, capsys):
    make_notebook(project / "nb.ipynb", [KINDS], parameters="KIND = 'ok'\nLR = 0.0")
    batch = write_experiment(json.dumps({"experiment": "batch", "notebooks": ["nb.ipynb"]}), name="batch.yaml")
    assert main(["submit", str(batch), "--rebuild-search"]) != 0
    searched = _grid_search(project, write_experiment, "both", ["ok"])
    assert main(["submit", str(searched), "--rebuild-search", "--force"]) != 0
    err = " ".join(capsys.readouterr().err.split())
    assert "Traceback" not in err and "experiment `batch` has no `search:`" in err, err
    assert "--force starts the search afresh and --rebuild-search rebuilds its study" in err, err
