"""Executing runs for real: papermill in a real kernel, parameters, failures, timeouts, cancel, retries."""

from __future__ import annotations

import json
import os
import threading
import time

import nbformat
import pytest
from support.notebooks import make_notebook
from support.processes import gone, kernels_of

import nbbatch
from nbbatch.api import submit
from nbbatch.errors import ValidationError

pytestmark = pytest.mark.timeout(180)


def _records(result):
    return {r.parameters.get("A", r.run_id): r for r in result.records}


def _output(project, run):
    return nbformat.read(project / "results" / run.experiment / run.run_id / "output.ipynb", as_version=4)


@pytest.mark.kernel
def test_parameters_are_injected_typed_and_metrics_recorded(project, write_experiment):
    make_notebook(project / "nb.ipynb", [
        "import nbbatch, os\nprint('A is', A, type(A).__name__, 'B is', B)",
        "nbbatch.record(score=A * 2, label=B)",
    ], parameters="A = 1\nB = 'x'\nC = [1, 2]")
    exp = write_experiment("experiment: inj\nnotebooks: [nb.ipynb]\nparameters: {B: hello}\n"
                           "sweep: {grid: {A: [2, 3]}}\n")
    result = submit(exp, progress=False)
    assert result.ok and len(result.records) == 2
    record = _records(result)[3]
    assert record.metrics == {"score": 6, "label": "hello"}
    assert record.status == "succeeded" and record.attempts == 1 and record.duration_s > 0
    assert record.kernel == "python3" and record.gpu_ids == [] and record.host
    nb = _output(project, record)
    assert "injected-parameters" in nb.cells[1].metadata.tags
    assert nb.metadata.kernelspec.name == "python3"
    assert nb.metadata.papermill.parameters == {"A": 3, "B": "hello"}
    log = (project / "results/inj" / record.run_id / "log.txt").read_text()
    assert "A is 3 int B is hello" in log and "=== succeeded" in log
    on_disk = json.loads((project / "results/inj" / record.run_id / "run.json").read_text())
    assert on_disk["schema_version"] == 1 and on_disk["metrics"]["score"] == 6


@pytest.mark.kernel
def test_failure_keeps_partial_outputs_and_names_the_cell(project, write_experiment):
    make_notebook(project / "nb.ipynb", ["print('before')", "raise KeyError('missing-thing')", "print('never')"])
    result = submit(write_experiment("experiment: fail\nnotebooks: [nb.ipynb]\n"), progress=False)
    (record,) = result.records
    assert record.status == "failed" and not result.ok
    assert record.error.ename == "KeyError" and "missing-thing" in record.error.evalue
    assert "raise KeyError" in record.error.cell_source
    nb = _output(project, record)
    sources = [c.source for c in nb.cells]
    assert "papermill-error-cell-tag" in nb.cells[0].metadata.get("tags", [])
    failing = next(c for c in nb.cells if "raise KeyError" in c.source)
    assert failing.outputs[0].output_type == "error"
    assert any(c.source == "print('before')" and c.outputs for c in nb.cells)
    assert not next(c for c in nb.cells if c.source == "print('never')").get("outputs")
    assert sources.count("print('never')") == 1


@pytest.mark.kernel
def test_notebook_without_parameters_cell_still_runs(project, write_experiment):
    make_notebook(project / "nb.ipynb", ["print(A + 1)"], parameters=None)
    exp = write_experiment("experiment: noparams\nnotebooks: [nb.ipynb]\nparameters: {A: 41}\n")
    result = submit(exp, progress=False)
    assert result.ok
    assert any("no cell tagged `parameters`" in w for w in result.warnings)
    nb = _output(project, result.records[0])
    assert "injected-parameters" in nb.cells[0].metadata.tags
    assert nb.cells[1].outputs[0].text.strip() == "42"


@pytest.mark.kernel
def test_cell_timeout_gives_timed_out_with_partial_notebook(project, write_experiment):
    make_notebook(project / "nb.ipynb", ["print('started')", "import time; time.sleep(60)"])
    exp = write_experiment("experiment: celltimeout\nnotebooks: [nb.ipynb]\ntimeout: {cell: 2}\n")
    (record,) = submit(exp, progress=False).records
    assert record.status == "timed_out" and "cell timeout" in record.error.reason  # not the 60 s the cell sleeps
    assert any(getattr(c, "outputs", None) and "started" in c.outputs[0].get("text", "") for c in _output(project, record).cells)


@pytest.mark.kernel
def test_run_timeout_kills_the_kernel_and_its_children(project, write_experiment):
    make_notebook(project / "nb.ipynb", [
        "import os, subprocess, sys\nprint('started', flush=True)\n"
        "child = subprocess.Popen(['sh', '-c', 'sleep 120 & echo $! > grandchild.pid; wait'])\n"
        "open('pids', 'w').write(f'{os.getpid()} {child.pid}')",
        "import time; time.sleep(120)",
    ])
    exp = write_experiment("experiment: runtimeout\nnotebooks: [nb.ipynb]\ntimeout: 3\n")
    (record,) = submit(exp, progress=False).records
    assert record.status == "timed_out" and "run timeout" in record.error.reason
    kernel, child = map(int, (project / "pids").read_text().split())
    grandchild = int((project / "grandchild.pid").read_text())  # a child of the kernel's child
    deadline = time.time() + 15
    while time.time() < deadline and not all(gone(p) for p in (kernel, child, grandchild)):
        time.sleep(0.2)
    assert gone(kernel) and gone(child) and gone(grandchild)
    nb = _output(project, record)
    assert "nbbatch stopped this run" in nb.cells[0].source
    started = next(c for c in nb.cells if "print('started'" in c.source)
    assert started.outputs[0].text == "started\n"  # the partial notebook keeps what ran before the timeout


@pytest.mark.kernel
def test_cancel_stops_running_and_queued_runs(project, write_experiment):
    make_notebook(project / "nb.ipynb", ["import time; time.sleep(60)"])
    exp = write_experiment("experiment: cancelme\nnotebooks: [nb.ipynb]\nsweep: {grid: {A: [1, 2, 3, 4]}}\n"
                           "resources: {max_parallel: 1}\n")
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("result", submit(exp, progress=False)))
    thread.start()
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            if any(r.status == "running" for r in nbbatch.status("cancelme")):
                break
        except nbbatch.NbbatchError:
            pass
        time.sleep(0.3)
    asked = nbbatch.cancel("cancelme")
    assert asked
    thread.join(60)
    statuses = sorted(r.status for r in box["result"].records)
    assert statuses == ["cancelled"] * 4


@pytest.mark.kernel
def test_kernel_death_is_retried(project, write_experiment):
    make_notebook(project / "nb.ipynb", [
        "import os, pathlib\nflag = pathlib.Path('died-once')\nif not flag.exists():\n"
        "    flag.write_text('x')\n    os._exit(1)\nprint('second attempt')",
    ])
    exp = write_experiment("experiment: retry\nnotebooks: [nb.ipynb]\nretries: 1\n")
    (record,) = submit(exp, progress=False).records
    assert record.status == "succeeded" and record.attempts == 2


@pytest.mark.kernel
def test_kernel_death_without_retries_fails_with_reason(project, write_experiment):
    make_notebook(project / "nb.ipynb", ["import os; os._exit(3)"])
    (record,) = submit(write_experiment("experiment: died\nnotebooks: [nb.ipynb]\n"), progress=False).records
    assert record.status == "failed" and record.error.reason == "kernel died"


@pytest.mark.kernel
def test_resubmit_skips_succeeded_and_force_reruns(project, write_experiment):
    make_notebook(project / "nb.ipynb", ["import time; print(time.time())", "assert A != 2"])
    exp = write_experiment("experiment: resume\nnotebooks: [nb.ipynb]\nsweep: {grid: {A: [1, 2, 3]}}\n")
    first = submit(exp, progress=False)
    assert sorted(r.status for r in first.records) == ["failed", "succeeded", "succeeded"]
    again = submit(exp, progress=False)
    assert len(again.skipped) == 2 and len(again.started) == 1
    forced = submit(exp, progress=False, force=True)
    assert len(forced.started) == 3 and not forced.skipped


@pytest.mark.kernel
def test_outputs_are_always_whole_notebooks_while_running(project, write_experiment):
    cells = [f"print('cell {i}' * 200)\nimport time; time.sleep(0.02)" for i in range(40)]
    make_notebook(project / "nb.ipynb", cells)
    exp = write_experiment("experiment: atomic\nnotebooks: [nb.ipynb]\n")
    seen, bad, stop = [0], [], threading.Event()

    def reader():
        root = project / "results" / "atomic"
        while not stop.is_set():
            for out in root.glob("*/output.ipynb"):
                try:
                    json.loads(out.read_bytes())
                    seen[0] += 1
                except FileNotFoundError:
                    pass
                except ValueError as exc:
                    bad.append(str(exc))

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        result = submit(exp, progress=False)
    finally:
        stop.set()
        thread.join()
    assert result.ok and seen[0] > 0 and not bad
    assert not list((project / "results").rglob("*.part"))


def test_invalid_parameter_is_refused_before_anything_runs(project, write_experiment):
    make_notebook(project / "nb.ipynb", ["pass"], parameters="EPOCHS = 1\nLR = 0.1")
    exp = write_experiment("experiment: bad\nnotebooks: [nb.ipynb]\nparameters: {EPCHS: 3}\n")
    with pytest.raises(ValidationError, match=r"`EPCHS` is not in nb.ipynb's parameters cell \(did you mean `EPOCHS`\?\)"):
        submit(exp, progress=False)
    assert not (project / "results" / "bad").exists()


@pytest.mark.kernel
def test_ctrl_c_cancels_unfinished_runs_and_keeps_finished_ones(project, write_experiment):
    import signal
    import subprocess
    import sys

    make_notebook(project / "nb.ipynb", ["import time\nif A > 1: time.sleep(120)\nprint('done', A)"])
    write_experiment("experiment: ctrlc\nnotebooks: [nb.ipynb]\nsweep: {grid: {A: [1, 2, 3, 4]}}\n"
                     "resources: {max_parallel: 2}\n")
    # restore SIGINT's default: a test runner started in the background inherits it ignored
    proc = subprocess.Popen([sys.executable, "-m", "nbbatch", "submit", "exp.yaml", "-q"], cwd=project,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 90
    while time.time() < deadline:
        try:
            records = nbbatch.status("ctrlc")
        except nbbatch.NbbatchError:
            records = []
        if any(r.status == "succeeded" for r in records) and any(r.status == "running" for r in records):
            break
        time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 130 and "interrupted" in out
    statuses = {r.parameters["A"]: r.status for r in nbbatch.status("ctrlc")}
    assert statuses[1] == "succeeded"
    assert {statuses[a] for a in (2, 3, 4)} == {"cancelled"}
    assert kernels_of("ctrlc") == [], "no kernel is left, also none started ahead of a queued run"


@pytest.mark.kernel
@pytest.mark.parametrize("resources, runs", [("{cpus: 1, max_parallel: 2}", 2), ("{}", 1)])
def test_a_cpu_runs_kernel_runs_on_its_share_of_the_cores(project, write_experiment, monkeypatch, resources, runs):
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NBBATCH_CPUS"):
        monkeypatch.delenv(name, raising=False)
    make_notebook(project / "nb.ipynb", [
        "import nbbatch, os\nnbbatch.record(cores=len(os.sched_getaffinity(0)), omp=os.environ['OMP_NUM_THREADS'])"],
        parameters="A = 0")
    exp = write_experiment(f"experiment: cores\nnotebooks: [nb.ipynb]\nsweep: {{grid: {{A: {list(range(runs))}}}}}\n"
                           f"resources: {resources}\n")
    result = submit(exp, progress=False)
    assert result.ok, [r.error for r in result.records]
    share = 1 if runs == 2 else len(os.sched_getaffinity(0))  # 1 core each asked; a run alone has them all
    assert [(r.metrics["cores"], r.metrics["omp"]) for r in result.records] == [(share, str(share))] * runs
