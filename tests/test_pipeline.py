"""Pipelines: the file and its checks (unit), then a real three-stage pipeline of small notebooks on the local
backend — references resolved with their origins in the run records, resubmit skips all, an upstream change reruns
what depends on it only, a failed stage blocks its dependents and not the others, ``--force STAGE``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.notebooks import make_notebook
from support.waiting import wait_until

from nbbatch import api
from nbbatch.errors import NbbatchError, SpecError
from nbbatch.spec.pipeline import Select, pipeline_from_dict

PREP = ["import json, os\nout = os.environ['NBBATCH_OUTPUT_DIR']\n"
        "json.dump({'n': N}, open(os.path.join(out, 'data.json'), 'w'))"]
TRAIN = ["import json, os, nbbatch\nn = json.load(open(os.path.join(DATA_DIR, 'data.json')))['n']\n"
         "assert LR < 1, 'diverged'\n"
         "open(os.path.join(os.environ['NBBATCH_OUTPUT_DIR'], 'model.txt'), 'w').write(str(LR))\n"
         "nbbatch.record(accuracy=1 - abs(LR - 0.01) + n / 1e6)"]
FINAL = ["import os, nbbatch\nassert open(os.path.join(MODEL_DIR, 'model.txt')).read() == str(LR)\n"
         "nbbatch.record(final=LR, runs=len(RUNS))"]


def _notebooks(folder: Path) -> None:
    make_notebook(folder / "prep.ipynb", PREP, parameters="N = 10")
    make_notebook(folder / "train.ipynb", TRAIN, parameters="DATA_DIR = ''\nLR = 0.1")
    make_notebook(folder / "final.ipynb", FINAL, parameters="LR = 0.0\nMODEL_DIR = ''\nRUNS = []")
    make_notebook(folder / "side.ipynb", ["import nbbatch\nnbbatch.record(side=1)"], parameters="X = 1")


def _pipeline(folder: Path, lrs: list[float], n: int = 10, **train: object) -> dict:
    return {
        "pipeline": "study", "share": "results",
        "stages": {
            "prep": {"notebooks": [{"path": "prep.ipynb", "kernel": "python3"}], "parameters": {"N": n}},
            "train": {"notebooks": [{"path": "train.ipynb", "kernel": "python3"}],
                      "inputs": {"DATA_DIR": "${prep.outputs}"}, "sweep": {"grid": {"LR": lrs}},
                      "select": {"metric": "accuracy", "mode": "max"}, **train},
            "final": {"notebooks": [{"path": "final.ipynb", "kernel": "python3"}],
                      "parameters": {"LR": "${train.best.parameters.LR}", "RUNS": "${train.runs}"},
                      "inputs": {"MODEL_DIR": "${train.best.outputs}"}},
            "side": {"notebooks": [{"path": "side.ipynb", "kernel": "python3"}]},
        },
    }


def _multi_objective_train(data: dict, select: dict | None) -> None:
    """Stage train of ``data`` made a search of two objectives, with ``select`` (or none)."""
    train = data["stages"]["train"]
    del train["sweep"], train["select"]
    train["search"] = {"metric": ["accuracy", "seconds"], "mode": ["max", "min"], "trials": 3,
                       "params": {"LR": {"uniform": [0.01, 0.5]}}}
    if select:
        train["select"] = select


def _write(folder: Path, data: dict) -> Path:
    path = folder / "study.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# --- the file -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d["stages"]["final"]["parameters"].update(LR="${trian.best.parameters.LR}"),
     "needs stage `trian`, which the pipeline does not have (did you mean `train`?)"),
    (lambda d: d["stages"]["prep"].update(needs=["final"]), "form a cycle"),
    (lambda d: d["stages"]["train"].pop("select"), "stage `train` has no `select:`"),
    (lambda d: _multi_objective_train(d, select=None),
     "stage `train` searches 2 objectives, so its best run depends on which one decides: add `select: {metric"),
    (lambda d: d["stages"]["final"]["inputs"].update(MODEL_DIR="${train.outputs}"),
     "stage `train` has 3 runs, so it has no single outputs folder"),
    (lambda d: d["stages"]["final"]["parameters"].update(LR="${train.best.parameters.LRX}"),
     "stage `train` sets no parameter `LRX` (did you mean `LR`?)"),
    (lambda d: d["stages"]["final"]["parameters"].update(LR="${train.best.param.LR}"),
     "after `best.` comes one of outputs, parameters, metrics, framework, run_id (did you mean `parameters`?)"),
    (lambda d: d["stages"]["train"].update(select={"metric": "accuracy"}), "needs `mode: max` or `mode: min`"),
    (lambda d: d["stages"]["train"].update(share="elsewhere"), "`share:` belongs to the pipeline"),
    (lambda d: d["stages"]["train"].update(select={"metric": "accuracy", "mode": "max", "where": {"seconds": 60}}),
     "select.where.seconds is {min: NUMBER}, {max: NUMBER} or both"),
    (lambda d: d["stages"]["train"].update(select={"metric": "accuracy", "mode": "max",
                                                   "where": {"seconds": {"min": 9, "max": 1}}}),
     "select.where.seconds has min 9 above max 1: no run could count"),
    (lambda d: d.update(stagse={}), "pipeline key `stagse` is not known (did you mean `stages`?)"),
    (lambda d: d["stages"]["train"].update(sweep={"grid": {"LR": "${prep.outputs}"}}),
     "references go in parameters, inputs, env, frameworks only"),
])
def test_a_wrong_pipeline_is_one_line_naming_the_fix(tmp_path, change, message):
    _notebooks(tmp_path)
    data = _pipeline(tmp_path, [0.01, 0.1, 0.5])
    change(data)
    with pytest.raises(SpecError) as caught:
        pipeline_from_dict(data, base_dir=tmp_path)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_multi_objective_search_stage_has_a_best_by_its_select(tmp_path):
    _notebooks(tmp_path)
    data = _pipeline(tmp_path, [0.01])
    _multi_objective_train(data, select={"metric": "seconds", "mode": "min"})
    assert pipeline_from_dict(data, base_dir=tmp_path).stages["train"].select == Select("seconds", "min")


def test_a_best_under_a_rule_is_the_best_run_within_the_bounds_on_other_metrics(tmp_path):
    """`select.where` weighs the objectives of a search against each other: the most accurate run under 60 s."""
    from nbbatch.results.pipeline import best_record
    from nbbatch.store.runjson import RunRecord, Status

    _notebooks(tmp_path)
    data = _pipeline(tmp_path, [0.01])
    _multi_objective_train(data, select={"metric": "accuracy", "mode": "max", "where": {"seconds": {"max": 60}}})
    select = pipeline_from_dict(data, base_dir=tmp_path).stages["train"].select
    assert select == Select("accuracy", "max", {"seconds": {"max": 60.0}})
    assert select.describe() == "max accuracy where seconds ≤ 60.0"
    runs = [RunRecord(f"r{i}", "e", "nb", "k", status=Status.SUCCEEDED, metrics=m) for i, m in enumerate(
        [{"accuracy": 0.99, "seconds": 90}, {"accuracy": 0.95, "seconds": 50}, {"accuracy": 0.97}, {"accuracy": 0.9,
                                                                                                    "seconds": 10}])]
    assert best_record(runs, select).run_id == "r1", "the most accurate of those that recorded seconds ≤ 60"
    assert best_record(runs, Select("accuracy", "max")).run_id == "r0"
    assert best_record(runs[:1], select) is None


def test_references_imply_needs_and_the_order_follows_them(tmp_path):
    _notebooks(tmp_path)
    pipeline = pipeline_from_dict(_pipeline(tmp_path, [0.01]), base_dir=tmp_path)
    assert pipeline.stages["train"].needs == ("prep",) and pipeline.stages["final"].needs == ("train",)
    assert pipeline.order() == ["prep", "train", "final", "side"]
    assert pipeline.dependents("prep") == ["train", "final"]
    assert pipeline.experiment("prep").name == "study.prep"
    with pytest.raises(NbbatchError, match=r"is a pipeline file: run it with nbbatch.submit_pipeline\("):
        api.submit(_write(tmp_path, _pipeline(tmp_path, [0.01])))


@pytest.mark.kernel
def test_plan_refuses_a_parameter_the_downstream_notebook_lacks(project):
    _notebooks(project)
    data = _pipeline(project, [0.01])
    data["stages"]["final"]["parameters"]["LRATE"] = "${train.best.parameters.LR}"
    path = _write(project, data)
    done = _cli("plan", str(path), cwd=project)
    assert done.returncode != 0 and "LRATE" in done.stderr and "Traceback" not in done.stderr


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nbbatch", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=600)


def _state(project: Path) -> dict:
    return json.loads((project / "results" / "study" / "pipeline.json").read_text())


def _records(project: Path, experiment: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((project / "results" / experiment).glob("*/run.json"))]


# --- for real, on the local backend ---------------------------------------------------------------------------------


@pytest.mark.kernel
@pytest.mark.timeout(900)
def test_a_pipeline_runs_in_order_resolves_references_and_resumes_without_rerunning(project):
    _notebooks(project)
    path = _write(project, _pipeline(project, [0.01, 0.1, 5.0], allow_failures=True))
    planned = _cli("plan", str(path), cwd=project)
    assert planned.returncode == 0, planned.stderr
    assert "will run" in planned.stdout and "done" not in planned.stdout

    result = api.submit_pipeline(path, progress=False)
    assert result.ok, {n: (s.state, s.reason) for n, s in result.stages.items()}
    state = _state(project)
    assert {n: s["state"] for n, s in state["stages"].items()} == dict.fromkeys(("prep", "train", "final", "side"),
                                                                               "succeeded")
    train = state["stages"]["train"]
    assert train["counts"] == {"succeeded": 2, "failed": 1} and train["best"]["parameters"] == {"LR": 0.01}
    [final] = _records(project, "study.final")
    assert final["status"] == "succeeded" and final["metrics"] == {"final": 0.01, "runs": 2}
    origin = final["origins"]["parameters.LR"]
    assert origin["stage"] == "train" and origin["run"] == train["best"]["run_id"] and origin["value"] == 0.01
    assert final["origins"]["inputs.MODEL_DIR"]["value"].endswith(f"{train['best']['run_id']}/outputs")
    first = {e: [r["ended_at"] for r in _records(project, e)] for e in ("study.prep", "study.train", "study.final")}

    # the control notebook's view (text here): the stages, then each stage's runs
    from nbbatch.widgets import print_pipeline_summary

    shown = print_pipeline_summary("study")
    assert set(shown.stages) == {"prep", "train", "final", "side"} and f"accuracy=1 {train['best']['run_id']}" in shown.text
    assert [len(s.model.records) for s in shown.stages.values()] == [1, 3, 1, 1]

    # one report of the whole pipeline: the stages, where each resolved value came from (linked), each stage's runs
    reported = _cli("compare", "study", "--report", "report.html", cwd=project)
    assert reported.returncode == 0, reported.stderr
    page = (project / "report.html").read_text()
    assert "Where the resolved values came from" in page and "${train.best.parameters.LR}" in page
    assert f'href="results/study.train/{train["best"]["run_id"]}/output.ipynb"' in page
    assert all(f'id="stage-{stage}"' in page for stage in ("prep", "train", "final", "side"))

    # submitted again: every stage is done, no run reruns
    replanned = _cli("plan", str(path), cwd=project)
    assert replanned.stdout.count("done (skipped)") == 4, replanned.stdout
    again = api.submit_pipeline(path, progress=False)
    assert again.ok
    assert {e: [r["ended_at"] for r in _records(project, e)] for e in first} == first

    # prep changes: prep, train and final run again; side does not
    side = [r["ended_at"] for r in _records(project, "study.side")]
    path = _write(project, _pipeline(project, [0.01, 0.1, 5.0], n=20, allow_failures=True))
    changed = api.submit_pipeline(path, progress=False)
    assert changed.ok
    assert len(_records(project, "study.prep")) == 2 and len(_records(project, "study.final")) == 2
    assert [r["ended_at"] for r in _records(project, "study.side")] == side

    # --force final: that stage alone runs again
    status = _cli("status", "study", cwd=project)
    assert status.returncode == 0 and "final" in status.stdout and "succeeded" in status.stdout, status.stderr
    forced = _cli("submit", str(path), "--force", "final", "-q", cwd=project)
    assert forced.returncode == 0, forced.stderr
    ended = {e: sorted(r["ended_at"] for r in _records(project, e)) for e in ("study.train", "study.final")}
    assert ended["study.final"][-1] > ended["study.train"][-1]


@pytest.mark.kernel
@pytest.mark.timeout(900)
def test_a_failed_stage_blocks_what_needs_it_and_not_the_rest(project):
    _notebooks(project)
    path = _write(project, _pipeline(project, [0.01, 5.0]))  # LR 5.0 fails; failures not allowed
    done = _cli("submit", str(path), cwd=project)
    assert done.returncode == 1, done.stderr
    state = _state(project)["stages"]
    assert state["train"]["state"] == "failed" and "AssertionError: diverged" in state["train"]["reason"]
    assert state["final"]["state"] == "blocked" and state["final"]["reason"].startswith("stage `train` failed")
    assert state["side"]["state"] == "succeeded" and state["prep"]["state"] == "succeeded"
    assert not (project / "results" / "study.final").exists()
    assert "stage final: blocked" in done.stderr and "Traceback" not in done.stderr


HELD = ["import os, time\nwhile os.path.exists(HOLD):\n    time.sleep(0.2)\nimport nbbatch\nnbbatch.record(accuracy=LR)"]


def _held_pipeline(project: Path) -> Path:
    make_notebook(project / "prep.ipynb", PREP, parameters="N = 10")
    make_notebook(project / "held.ipynb", HELD, parameters="HOLD = ''\nLR = 0.1")
    make_notebook(project / "final.ipynb", ["print(LR)"], parameters="LR = 0.0")
    (project / "hold").write_text("")
    return _write(project, {"pipeline": "study", "share": "results", "stages": {
        "prep": {"notebooks": [{"path": "prep.ipynb", "kernel": "python3"}]},
        "train": {"notebooks": [{"path": "held.ipynb", "kernel": "python3"}], "needs": ["prep"],
                  "parameters": {"HOLD": str(project / "hold")}, "sweep": {"grid": {"LR": [0.1, 0.2]}},
                  "select": {"metric": "accuracy", "mode": "max"}},
        "final": {"notebooks": [{"path": "final.ipynb", "kernel": "python3"}],
                  "parameters": {"LR": "${train.best.parameters.LR}"}}}})


def _wait_train_running(project: Path, driver: subprocess.Popen) -> None:
    def running() -> bool:
        assert driver.poll() is None, driver.communicate()
        try:
            return _state(project)["stages"]["train"]["state"] == "running" and any(
                r["status"] == "running" for r in _records(project, "study.train"))
        except (FileNotFoundError, ValueError, KeyError):
            return False
    wait_until(running, timeout=300, message="train running", interval=0.2)


@pytest.mark.kernel
@pytest.mark.timeout(900)
def test_a_cancelled_or_killed_pipeline_resumes_where_it_stopped(project):
    path = _held_pipeline(project)
    command = [sys.executable, "-m", "nbbatch", "submit", str(path), "-q"]
    driver = subprocess.Popen(command, cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_train_running(project, driver)
    cancelled = _cli("cancel", "study", cwd=project)
    assert cancelled.returncode == 0, cancelled.stderr
    assert driver.wait(timeout=300) == 1
    stages = _state(project)["stages"]
    assert stages["prep"]["state"] == "succeeded" and stages["train"]["state"] == "cancelled"
    assert stages["final"]["state"] == "cancelled" and not (project / "results" / "study.final").exists()
    prep_ended = [r["ended_at"] for r in _records(project, "study.prep")]

    driver = subprocess.Popen(command, cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_train_running(project, driver)
    driver.kill()  # the driver is gone at once: its runs' kernels with it
    driver.wait(timeout=60)
    (project / "hold").unlink()
    resumed = _cli("submit", str(path), "-q", cwd=project)
    assert resumed.returncode == 0, resumed.stderr
    stages = _state(project)["stages"]
    assert {n: s["state"] for n, s in stages.items()} == dict.fromkeys(("prep", "train", "final"), "succeeded")
    assert [r["ended_at"] for r in _records(project, "study.prep")] == prep_ended  # not run again
    [final] = _records(project, "study.final")
    assert final["parameters"] == {"LR": 0.2}


@pytest.mark.kernel
@pytest.mark.timeout(900)
def test_a_search_stage_hands_its_best_trial_downstream(project):
    _notebooks(project)
    path = _write(project, {"pipeline": "study", "share": "results", "stages": {
        "prep": {"notebooks": [{"path": "prep.ipynb", "kernel": "python3"}]},
        "train": {"notebooks": [{"path": "train.ipynb", "kernel": "python3"}], "inputs": {"DATA_DIR": "${prep.outputs}"},
                  "search": {"metric": "accuracy", "mode": "max", "trials": 3, "sampler": "grid", "seed": 1,
                             "params": {"LR": [0.1, 0.01, 0.5]}}},  # a search's metric is its `select:`
        "final": {"notebooks": [{"path": "final.ipynb", "kernel": "python3"}],
                  "parameters": {"LR": "${train.best.parameters.LR}"}, "inputs": {"MODEL_DIR": "${train.best.outputs}"}},
    }})
    result = api.submit_pipeline(path, progress=False)
    assert result.ok, {n: (s.state, s.reason) for n, s in result.stages.items()}
    trials = _records(project, "study.train")
    assert len(trials) == 3 and all(r["trial"] for r in trials)
    [final] = _records(project, "study.final")
    assert final["parameters"]["LR"] == 0.01 and final["origins"]["parameters.LR"]["run"] == next(
        r["run_id"] for r in trials if r["parameters"]["LR"] == 0.01)
