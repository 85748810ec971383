"""The metric history while a run goes: ``record(step=...)`` points reach metrics.jsonl and run.json live."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
from support.notebooks import make_notebook

from nbbatch.api import submit
from nbbatch.results.history import read_history
from nbbatch.store.layout import run_paths
from nbbatch.store.runfiles import read_record, run_ids
from nbbatch.store.share import FileShare

# Six points a second apart; after the third the notebook waits for the test (so "midway" is a fact, not a race).
SIX_STEPS = """\
import os, time, nbbatch
for step in range(1, 7):
    nbbatch.record(step=step, loss=1.0 / step, accuracy=0.5 + step / 20)
    if step == 3:
        while not os.path.exists(RELEASE):
            time.sleep(0.05)
    else:
        time.sleep(1)
nbbatch.record(accuracy=0.99)
"""


def _wait_for(predicate, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("timed out waiting")


def _submit_in_thread(exp: Path) -> tuple[threading.Thread, dict]:
    box: dict = {}
    thread = threading.Thread(target=lambda: box.setdefault("outcome", submit(exp, progress=False)), daemon=True)
    thread.start()
    return thread, box


@pytest.mark.kernel
def test_points_reach_the_share_while_the_run_goes(project, write_experiment):
    release = project / "release"
    make_notebook(project / "nb.ipynb", [SIX_STEPS], parameters=f"RELEASE = {str(release)!r}")
    exp = write_experiment("experiment: live\nnotebooks: [nb.ipynb]\n")
    share = FileShare(project / "results")
    thread, box = _submit_in_thread(exp)
    run_id = _wait_for(lambda: next((n for n in run_ids(share, "live") if (project / "results/live" / n).is_dir()), None))

    midway = _wait_for(lambda: len(read_history(share, "live", run_id)) >= 3 and read_history(share, "live", run_id))
    assert [p["step"] for p in midway] == [1, 2, 3]  # the run waits after step 3: no more can be there
    assert midway[2]["loss"] == pytest.approx(1 / 3) and midway[2]["attempt"] == 1 and "time" in midway[2]
    # run.json follows within seconds (written by the live record, not once per point)
    record = _wait_for(lambda: (r := read_record(share, "live", run_id)) and r.metrics.get("loss") == 1 / 3 and r)
    assert record.status == "running" and record.metrics["accuracy"] == pytest.approx(0.65)

    release.write_text("go")
    thread.join(120)
    outcome = box["outcome"]
    assert [r.status for r in outcome.records] == ["succeeded"], [r.error for r in outcome.records]
    points = read_history(share, "live", run_id)
    assert [p["step"] for p in points] == [1, 2, 3, 4, 5, 6]
    assert points[-1]["loss"] == pytest.approx(1 / 6)
    final = read_record(share, "live", run_id)
    assert final.metrics["accuracy"] == 0.99 and final.metrics["loss"] == pytest.approx(1 / 6)
    # the notebook alone still carries the run's metrics: the last point of the cell, then the final record()
    nb = json.loads(share.read_bytes(run_paths("live", run_id).notebook))
    outputs = [o for c in nb["cells"] for o in c.get("outputs", []) if o.get("output_type") == "display_data"]
    history = [o for o in outputs if "application/vnd.nbbatch.history+json" in o["data"]]
    assert len(history) == 1 and history[0]["data"]["application/vnd.nbbatch.history+json"]["step"] == 6


HISTORY_AND_FINAL = """\
import nbbatch
for step in range(1, 4):
    nbbatch.record(step=step, loss=1.0 / step)
nbbatch.record(accuracy=0.9, framework="python")
"""


def _mlflow_runs(store: Path) -> list[Path]:
    return [p for p in store.glob("*/*") if (p / "meta.yaml").is_file()]


@pytest.mark.kernel
def test_record_logs_points_and_parameters_to_mlflow_when_the_variable_is_set(project, write_experiment, monkeypatch):
    pytest.importorskip("mlflow")
    store = project / "mlruns"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 keeps its file store behind this switch
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    make_notebook(project / "nb.ipynb", [HISTORY_AND_FINAL], parameters="LR = 0.1\nNAME = 'a'")
    exp = write_experiment("experiment: tracked\nnotebooks: [nb.ipynb]\nsweep: {grid: {LR: [0.1, 0.01]}}\n")
    outcome = submit(exp, progress=False)
    assert {r.status for r in outcome.records} == {"succeeded"}, [r.error for r in outcome.records]

    runs = _mlflow_runs(store)
    assert len(runs) == 2
    names = {(run / "tags" / "mlflow.runName").read_text() for run in runs}
    assert names == {r.run_id for r in outcome.records}
    assert {"name: tracked" in (run.parent / "meta.yaml").read_text() for run in runs} == {True}
    for run in runs:
        loss = [line.split() for line in (run / "metrics" / "loss").read_text().splitlines()]
        assert [(float(value), int(step)) for _, value, step in loss] == [(1.0, 1), (0.5, 2), (pytest.approx(1 / 3), 3)]
        assert (run / "metrics" / "accuracy").read_text().split()[1] == "0.9"
        assert not (run / "metrics" / "framework").exists()  # strings are not MLflow metrics
        assert (run / "params" / "LR").read_text() in ("0.1", "0.01")
        assert not (run / "params" / "NAME").exists()  # the notebook's default, not a run parameter


@pytest.mark.kernel
def test_without_mlflow_installed_the_run_warns_once_and_succeeds(project, write_experiment, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (project / "mlruns").as_uri())
    blocker = project / "no_mlflow"
    blocker.mkdir()
    (blocker / "mlflow.py").write_text("raise ImportError('mlflow is not installed (test)')\n")
    # first on the path, before whatever else the kernel needs from PYTHONPATH
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(blocker), os.environ.get("PYTHONPATH")])))
    make_notebook(project / "nb.ipynb", [HISTORY_AND_FINAL])
    exp = write_experiment("experiment: untracked\nnotebooks: [nb.ipynb]\n")
    outcome = submit(exp, progress=False)
    assert [r.status for r in outcome.records] == ["succeeded"], [r.error for r in outcome.records]
    share = FileShare(project / "results")
    run_id = outcome.records[0].run_id
    log = share.read_bytes(run_paths("untracked", run_id).log).decode()
    assert log.count("MLflow logging is off for this run") == 1 and "mlflow is not installed" in log
    assert [p["step"] for p in read_history(share, "untracked", run_id)] == [1, 2, 3]


@pytest.mark.kernel
def test_a_remote_share_gets_the_points_while_the_run_goes(project, monkeypatch):
    """Azure Files (the fake on 127.0.0.1, through the real SDK): points are appended as the run goes."""
    pytest.importorskip("azure.storage.fileshare")
    from fakes.azure_files_server import ACCOUNT, FAKE_KEY, FakeAzureFiles

    from nbbatch.execute.attempts import execute_run
    from nbbatch.plan.runs import Run
    from nbbatch.store.share import open_share

    release = project / "release"
    make_notebook(project / "nb.ipynb", [SIX_STEPS], parameters=f"RELEASE = {str(release)!r}")
    run = Run(run_id="remote-live", experiment="exp", notebook=str(project / "nb.ipynb"), notebook_rel="nb.ipynb",
              kernel="python3")
    with FakeAzureFiles() as server:
        monkeypatch.setenv("NBBATCH_AZFILES_ENDPOINT", server.endpoint)
        monkeypatch.setenv("AZURE_STORAGE_KEY", FAKE_KEY)
        share = open_share(f"azfiles://{ACCOUNT}/results/nbb")
        box: dict = {}
        thread = threading.Thread(target=lambda: box.setdefault("record", execute_run(run, share)), daemon=True)
        thread.start()
        midway = _wait_for(lambda: len(read_history(share, "exp", run.run_id)) >= 3 and read_history(share, "exp", run.run_id))
        assert [p["step"] for p in midway] == [1, 2, 3]
        assert _wait_for(lambda: (r := read_record(share, "exp", run.run_id)) and r.metrics.get("loss") == 1 / 3)
        release.write_text("go")
        thread.join(120)
        assert box["record"].status == "succeeded"
        assert [p["step"] for p in read_history(share, "exp", run.run_id)] == [1, 2, 3, 4, 5, 6]
        assert not [n for n in server.file_names("results") if n.endswith(".part")]


DIES_ONCE = """\
import os, time, nbbatch
for step in range(1, 5):
    nbbatch.record(step=step, loss=10.0 * ATTEMPT_MARK.count('x') + step)
    if step == 2 and not os.path.exists(DIED):
        open(DIED, 'w').close()
        # a point still in flight when a kernel dies is lost with it: die once the driver has written step 2
        deadline = time.time() + 60
        while time.time() < deadline and (not os.path.exists(HISTORY) or open(HISTORY).read().count(chr(10)) < 2):
            time.sleep(0.05)
        os._exit(1)  # the kernel dies: nbbatch retries the run
"""


@pytest.mark.kernel
def test_a_retry_continues_the_history_and_its_points_win(project):
    from nbbatch.execute.attempts import execute_run
    from nbbatch.plan.runs import Run

    died = project / "died"
    history = project / "results/exp/retry-live/metrics.jsonl"
    make_notebook(project / "nb.ipynb", [DIES_ONCE],
                  parameters=f"DIED = {str(died)!r}\nHISTORY = {str(history)!r}\nATTEMPT_MARK = ''")
    run = Run(run_id="retry-live", experiment="exp", notebook=str(project / "nb.ipynb"), notebook_rel="nb.ipynb",
              kernel="python3", retries=1)
    share = FileShare(project / "results")
    record = execute_run(run, share)
    assert record.status == "succeeded" and record.attempts == 2
    lines = [json.loads(line) for line in share.read_bytes(run_paths("exp", run.run_id).metrics).splitlines()]
    assert [(p["attempt"], p["step"]) for p in lines] == [(1, 1), (1, 2), (2, 1), (2, 2), (2, 3), (2, 4)]
    assert [p["attempt"] for p in read_history(share, "exp", run.run_id)] == [2, 2, 2, 2]
    assert record.metrics["loss"] == 4.0

    from nbbatch.store.runfiles import new_record, write_record

    write_record(share, new_record(run))  # as a new submission does (Backend.launch)
    again = execute_run(run, share)  # its first attempt starts a new history
    assert again.status == "succeeded"
    assert [p["step"] for p in read_history(share, "exp", run.run_id)] == [1, 2, 3, 4]
    assert len(share.read_bytes(run_paths("exp", run.run_id).metrics).splitlines()) == 4


WAIT = """\
import os, time
while not os.path.exists(RELEASE):
    time.sleep(0.05)
"""


@pytest.mark.kernel
def test_gpu_telemetry_streams_while_the_run_goes(project, monkeypatch):
    """NVML stands in for a GPU (FakeNvml): samples reach telemetry.jsonl and run.json's live values midway."""
    from support.nvml import FakeNvml

    from nbbatch.execute.attempts import AttemptContext, execute_run
    from nbbatch.execute.telemetry import read_series
    from nbbatch.plan.runs import Run

    monkeypatch.setattr("nbbatch.execute.telemetry.pynvml", FakeNvml(gpus=1))
    release = project / "release"
    make_notebook(project / "nb.ipynb", [WAIT], parameters=f"RELEASE = {str(release)!r}")
    run = Run(run_id="gpu-live", experiment="exp", notebook=str(project / "nb.ipynb"), notebook_rel="nb.ipynb",
              kernel="python3")
    share = FileShare(project / "results")
    telemetry = run_paths("exp", run.run_id).telemetry
    box: dict = {}
    thread = threading.Thread(target=lambda: box.setdefault("record", execute_run(run, share, AttemptContext(gpu_ids=[0]))),
                              daemon=True)
    thread.start()
    midway = _wait_for(lambda: share.exists(telemetry) and len(read_series(share.read_bytes(telemetry))) >= 3
                       and read_series(share.read_bytes(telemetry)))
    assert {s["gpu"] for s in midway} == {0} and all(s["util_pct"] is not None for s in midway)
    live = _wait_for(lambda: (r := read_record(share, "exp", run.run_id)) and r.telemetry.get("util_now_pct") and r)
    assert live.status == "running" and live.telemetry["memory_now_mb"] > 1024
    release.write_text("go")
    thread.join(120)
    record = box["record"]
    assert record.status == "succeeded"
    final = read_series(share.read_bytes(telemetry))
    assert len(final) >= len(midway) and record.telemetry["samples"] == len({s["t"] for s in final})


def test_a_kernel_gets_tracking_credentials_only_with_a_tracking_uri(project, monkeypatch):
    from nbbatch.execute.attempts import kernel_launch
    from nbbatch.plan.runs import Run

    make_notebook(project / "nb.ipynb", ["pass"])
    run = Run(run_id="r", experiment="e", notebook=str(project / "nb.ipynb"), notebook_rel="nb.ipynb",
              kernel="python3", parameters={"LR": 0.1})
    monkeypatch.setenv("AZUREML_RUN_TOKEN", "run-token")
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "mlflow-token")
    monkeypatch.setenv("HF_TOKEN", "not-for-kernels")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    _, env, _ = kernel_launch(run, project_root=project)
    assert not {"AZUREML_RUN_TOKEN", "MLFLOW_TRACKING_TOKEN", "HF_TOKEN"} & set(env)
    assert json.loads(env["NBBATCH_PARAMETERS"]) == {"LR": 0.1}

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "azureml://eastus.api.azureml.ms/mlflow/v1.0/subscriptions/x")
    _, env, _ = kernel_launch(run, project_root=project)
    assert env["AZUREML_RUN_TOKEN"] == "run-token" and env["MLFLOW_TRACKING_TOKEN"] == "mlflow-token"
    assert "HF_TOKEN" not in env
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://user:pw@mlflow.example.com")  # a URI holding a secret: no
    _, env, _ = kernel_launch(run, project_root=project)
    assert "MLFLOW_TRACKING_URI" not in env and "MLFLOW_TRACKING_TOKEN" not in env


@pytest.mark.parametrize("step", [True, -1, 1.5, "3", None.__class__])
def test_record_refuses_a_step_that_is_not_a_whole_number(step):
    import nbbatch

    with pytest.raises(TypeError, match="whole number"):
        nbbatch.record(step=step, loss=1.0)


def test_record_refuses_a_metric_named_like_a_point_field():
    import nbbatch

    with pytest.raises(TypeError, match="`time` is a name every point"):
        nbbatch.record(step=1, time=3.0)


def test_the_notebook_alone_carries_the_latest_point():
    import numpy as np

    import nbbatch
    from nbbatch.metrics import HISTORY_MIME, METRICS_MIME, metrics_from_notebook

    point = nbbatch.record(step=np.int64(2), loss=np.float32(0.25))
    assert point["step"] == 2 and point["loss"] == 0.25 and isinstance(point["step"], int)
    nb = {"cells": [{"outputs": [{"data": {HISTORY_MIME: point}}]},
                    {"outputs": [{"data": {METRICS_MIME: {"accuracy": 0.9}}}]}]}
    assert metrics_from_notebook(nb) == {"loss": 0.25, "accuracy": 0.9}


GPU_TRAINING = """\
import os, time, torch, nbbatch
x = torch.randn(4096, 4096, device="cuda")
for step in range(1, 4):
    t0 = time.time()
    while time.time() - t0 < 2:  # keep the GPU busy for 2 s a step
        y = x @ x
    torch.cuda.synchronize()
    nbbatch.record(step=step, loss=float(y.abs().mean()) / step)
while not os.path.exists(RELEASE):
    y = x @ x
    torch.cuda.synchronize()
"""


@pytest.mark.kernel
@pytest.mark.gpu
def test_a_real_gpu_run_streams_its_telemetry_and_history(project):
    pytest.importorskip("torch")
    pytest.importorskip("pynvml")
    from nbbatch.execute.attempts import AttemptContext, execute_run
    from nbbatch.execute.telemetry import read_series
    from nbbatch.plan.runs import Run

    release = project / "release"
    make_notebook(project / "nb.ipynb", [GPU_TRAINING], parameters=f"RELEASE = {str(release)!r}")
    run = Run(run_id="gpu-real", experiment="exp", notebook=str(project / "nb.ipynb"), notebook_rel="nb.ipynb",
              kernel="python3", gpus=1)
    share = FileShare(project / "results")
    telemetry = run_paths("exp", run.run_id).telemetry
    box: dict = {}
    thread = threading.Thread(target=lambda: box.setdefault("record", execute_run(run, share, AttemptContext(gpu_ids=[0]))),
                              daemon=True)
    thread.start()
    assert [p["step"] for p in _wait_for(lambda: len(read_history(share, "exp", run.run_id)) == 3
                                         and read_history(share, "exp", run.run_id), timeout=180)] == [1, 2, 3]
    live = _wait_for(lambda: (r := read_record(share, "exp", run.run_id)) and (r.telemetry.get("util_now_pct") or 0) > 0
                     and r, timeout=60)
    samples = read_series(share.read_bytes(telemetry))
    print("live telemetry:", json.dumps(live.telemetry), "samples so far:", len(samples))
    assert live.status == "running" and live.telemetry["memory_now_mb"] > 0 and len(samples) >= 3
    release.write_text("go")
    thread.join(120)
    assert box["record"].status == "succeeded", box["record"].error
    assert box["record"].telemetry["util_max_pct"] > 0
