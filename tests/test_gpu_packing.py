"""Runs packed onto GPUs by memory (`runs_per_gpu: auto`), retried alone after running out of GPU memory,
and kernels started ahead of GPU runs: on stand-in GPUs (a GPU list given to the backend; the kernels are
CPU kernels that print what they were given)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import psutil
import pytest
from support.notebooks import make_notebook
from support.processes import kernels_of

from nbbatch.api import submit
from nbbatch.backends.local import gpus as gpus_module
from nbbatch.backends.local.gpus import AUTO, GpuInfo, MemoryNeeds, SlotPool, auto_cap, is_gpu_oom
from nbbatch.errors import SpecError, ValidationError
from nbbatch.plan.runs import Run
from nbbatch.spec.experiment import Experiment
from nbbatch.store.runfiles import write_record
from nbbatch.store.runjson import GpuSharing, RunError, RunRecord, Status
from nbbatch.store.share import open_share


def _gpu(index: int = 0, memory: int = 10_000, free: int | None = None, mode: str = "default") -> GpuInfo:
    return GpuInfo(index, f"Fake {index}", memory, free_mb=free, compute_mode=mode)


def _run(run_id: str = "nb-1", framework: str | None = None, memory: int | None = None) -> Run:
    return Run(run_id=run_id, experiment="e", notebook="/x/nb.ipynb", notebook_rel="nb.ipynb", kernel="python3",
               framework=framework, gpus=1, gpu_memory_mb=memory)


# --- the pool ----------------------------------------------------------------------------------------

def test_auto_packs_runs_by_memory_up_to_the_free_memory_less_the_margin():
    pool = SlotPool([_gpu(memory=10_000, free=9_000)], AUTO, cap=16)  # budget 9000 - 10 % of 10000 = 8000
    leases = [pool.acquire(1, need_mb=2_500) for _ in range(3)]
    assert all(lease is not None and lease.gpu_ids == [0] for lease in leases)
    assert pool.acquire(1, need_mb=2_500) is None, "a fourth would reserve 10 000 MiB of 8 000"
    assert pool.acquire(1, need_mb=500) is not None, "a smaller run still fits"
    pool.release(leases[0])
    assert pool.acquire(1, need_mb=2_500) is not None
    assert all(pool.shared(lease) for lease in leases), "under auto every run leaves room for others"


def test_a_run_of_unknown_need_has_its_gpu_alone():
    pool = SlotPool([_gpu(0), _gpu(1)], AUTO, cap=16)
    known = pool.acquire(1, need_mb=100)
    unknown = pool.acquire(1, need_mb=None)
    assert known.gpu_ids == [0] and unknown.gpu_ids == [1] and unknown.exclusive
    assert pool.acquire(1, need_mb=100).gpu_ids == [0], "nothing joins the GPU of a run whose need is unknown"
    assert pool.acquire(1, need_mb=None) is None, "an unknown need waits for an empty GPU"
    assert pool.shared(unknown), "it still runs with its framework's sharing settings, so its peak is what it needs"
    pool.release(unknown)
    assert pool.acquire(1, need_mb=100).gpu_ids == [1]


def test_a_run_larger_than_the_budget_still_runs_alone_on_an_empty_gpu():
    pool = SlotPool([_gpu(memory=1_000)], AUTO, cap=16)
    big = pool.acquire(1, need_mb=50_000)
    assert big is not None and pool.acquire(1, need_mb=1) is None


def test_auto_never_packs_more_than_the_cap():
    pool = SlotPool([_gpu(memory=80_000)], AUTO, cap=3)
    assert [pool.acquire(1, need_mb=10) is not None for _ in range(4)] == [True, True, True, False]
    assert pool.capacity == 3
    assert auto_cap(1, cpus=64) == gpus_module.AUTO_CAP and auto_cap(4, cpus=8) == 2 and auto_cap(8, cpus=2) == 1


def test_exclusive_process_gpus_take_one_run_unless_mps_funnels_them():
    gpus = [_gpu(0, mode="exclusive_process"), _gpu(1)]
    assert SlotPool(gpus, AUTO, cap=4).cap == {0: 1, 1: 4}
    assert SlotPool(gpus, AUTO, cap=4, mps=True).cap == {0: 4, 1: 4}


def test_a_run_retried_alone_keeps_every_other_run_off_its_gpu_and_loses_the_sharing_settings():
    pool = SlotPool([_gpu(0)], AUTO, cap=8)
    alone = pool.acquire(1, need_mb=100, alone=True)
    assert alone.exclusive and not pool.shared(alone)
    assert pool.acquire(1, need_mb=1) is None


def test_fixed_runs_per_gpu_ignores_memory():
    pool = SlotPool([_gpu(memory=1_000)], 2)
    assert pool.acquire(1, need_mb=5_000) is not None and pool.acquire(1, need_mb=5_000) is not None
    assert pool.acquire(1) is None


# --- what a run needs ----------------------------------------------------------------------------------

def _record(run_id: str, peak: float | None, shared: bool = True, status: str = "succeeded",
            framework: str | None = None, gpu_ids: tuple[int, ...] = (0,)) -> RunRecord:
    return RunRecord(run_id=run_id, experiment="e", notebook="nb.ipynb", kernel="python3", framework=framework,
                     status=Status(status), gpu_ids=list(gpu_ids), telemetry={"memory_run_max_mb": peak},
                     gpu_share=GpuSharing(shared=shared))


def test_needs_come_from_earlier_runs_that_shared_their_gpu():
    needs = MemoryNeeds([_record("nb-0", 1_000.0), _record("nb-big", 3_000.0, shared=False),
                         _record("nb-failed", 9_000.0, status="failed")])
    assert needs.need_mb(_run("nb-1")) == 1_200.0, "the notebook's measured peak, with 20 % to spare"
    assert needs.source(_run("nb-1")) == "measured"
    needs.learn(_record("nb-1", 500.0))
    assert needs.need_mb(_run("nb-1")) == 600.0, "the run's own earlier peak comes first"
    assert needs.need_mb(_run("nb-2")) == 1_200.0, "other runs of the notebook take the largest peak seen"


def test_needs_fall_back_to_the_framework_estimate_then_unknown():
    needs = MemoryNeeds([_record("two-gpus", 4_000.0, gpu_ids=(0, 1))])
    assert needs.need_mb(_run("x", framework="pytorch", memory=2_000)) == 2_000.0
    assert needs.source(_run("x", framework="pytorch", memory=2_000)) == "framework"
    assert needs.need_mb(_run("x", framework="pytorch")) is None
    assert needs.need_mb(_run("y")) == 2_400.0, "a peak over two GPUs is per GPU"


@pytest.mark.parametrize(("ename", "evalue", "oom"), [
    ("OutOfMemoryError", "CUDA out of memory. Tried to allocate 2.00 GiB", True),
    ("XlaRuntimeError", "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17179869184 bytes.", True),
    ("ResourceExhaustedError", "OOM when allocating tensor with shape[512,3,32,32]", True),
    ("RuntimeError", "cuDNN error: CUDNN_STATUS_ALLOC_FAILED", True),
    ("ValueError", "shapes (3,) and (4,) not aligned", False),
])
def test_gpu_out_of_memory_errors_are_recognised(ename, evalue, oom):
    assert is_gpu_oom(RunError(ename, evalue)) is oom


# --- the spec ------------------------------------------------------------------------------------------

def test_runs_per_gpu_is_auto_unless_a_number_is_given(tmp_path):
    assert Experiment("e", notebooks=[], frameworks=["x"]).resources.runs_per_gpu == AUTO
    data = {"experiment": "e", "frameworks": ["x"]}
    assert Experiment.from_dict({**data, "resources": {"runs_per_gpu": 3}}).resources.runs_per_gpu == 3
    with pytest.raises(SpecError, match=r"runs_per_gpu.*or `auto`.*'lots'"):
        Experiment.from_dict({**data, "resources": {"runs_per_gpu": "lots"}})
    with pytest.raises(SpecError, match="resources.mps.*true or false"):
        Experiment.from_dict({**data, "resources": {"gpus": 1, "mps": "yes"}})
    with pytest.raises(SpecError, match="ask for no GPU"):
        Experiment.from_dict({**data, "resources": {"mps": True}})


# --- on the local backend, with stand-in GPUs ----------------------------------------------------------

@pytest.fixture
def one_gpu(monkeypatch):
    from nbbatch.backends.local import backend as local

    monkeypatch.setattr(local, "detect_gpus", lambda: [_gpu(0, memory=1_000)])
    monkeypatch.setattr(gpus_module, "auto_cap", lambda count, cpus=None: 8)  # not the CI machine's 2 cores


# Each run marks itself running and waits until `WANT` runs are running at once (or fails after 60 s),
# then notes the most it saw then and half a second later; a run ends by removing its mark (before its
# kernel ends and frees its place, so a run that takes the place never sees the mark of the one before).
TOGETHER = """
import os, time, pathlib
folder = pathlib.Path(FOLDER); folder.mkdir(exist_ok=True)
mine = folder / f"run-{A}"; mine.touch()
deadline = time.time() + 60
while (seen := len(list(folder.glob("run-*")))) < WANT:
    assert time.time() < deadline, "the other runs never came"
    time.sleep(0.05)
time.sleep(0.5)
seen = max(seen, len(list(folder.glob("run-*"))))
import nbbatch; nbbatch.record(together=seen, devices=os.environ["CUDA_VISIBLE_DEVICES"])
mine.unlink()
"""


@pytest.mark.kernel
def test_auto_shares_a_gpu_as_far_as_the_memory_measured_before_allows(project, write_experiment, one_gpu):
    make_notebook(project / "nb.ipynb", [TOGETHER], parameters="A = 1\nFOLDER = ''\nWANT = 2")
    earlier = _record("nb-earlier", 300.0)  # a run of the same notebook used 300 MiB: 360 with headroom
    earlier.experiment = "packed"
    write_record(open_share(str(project / "results")), earlier)
    exp = write_experiment(f"experiment: packed\nnotebooks: [nb.ipynb]\nparameters: {{FOLDER: '{project / 'marks'}'}}\n"
                           "sweep: {grid: {A: [1, 2, 3, 4]}}\nresources: {gpus: 1}\n")
    records = [r for r in submit(exp, progress=False).records if r.run_id != "nb-earlier"]
    assert [r.status for r in records] == ["succeeded"] * 4, [r.error for r in records]
    # 1 000 MiB less the 10 % margin holds two runs of 360 MiB, not three
    assert {r.metrics["together"] for r in records} == {2}
    assert all(r.metrics["devices"] == "0" for r in records)
    share = records[0].gpu_share
    assert share == GpuSharing(runs_per_gpu="auto", shared=True, exclusive=False, mps=False,
                               need_mb=360.0, need_from="measured")


@pytest.mark.kernel
def test_a_resubmitted_run_reserves_what_it_used_last_time(project, write_experiment, one_gpu):
    make_notebook(project / "nb.ipynb", ["pass"])
    exp = write_experiment("experiment: again\nnotebooks: [nb.ipynb]\nsweep: {grid: {A: [1, 2]}}\n"
                           "resources: {gpus: 1}\n")
    first = submit(exp, progress=False).records
    assert all(r.gpu_share.need_from == "guess" for r in first)
    share = open_share(str(project / "results"))
    for record, peak in zip(first, (100.0, 200.0), strict=True):  # as NVML would have measured them
        record.telemetry["memory_run_max_mb"] = peak
        write_record(share, record)
    again = {r.run_id: r for r in submit(exp, progress=False, force=True).records}
    # the queued records of the new submission replace the old ones: what they measured is read before
    assert [again[r.run_id].gpu_share.need_mb for r in first] == [120.0, 240.0]
    assert {r.gpu_share.need_from for r in again.values()} == {"measured"}


@pytest.mark.kernel
def test_a_notebook_never_measured_shares_its_gpu_from_the_start(project, write_experiment, one_gpu):
    """Of no known framework and never measured: each run reserves a first guess, a quarter of the GPU's 1 000 MiB,
    so three start at once (900 MiB less the margin), instead of the first alone until it ends."""
    make_notebook(project / "nb.ipynb", [TOGETHER], parameters="A = 1\nFOLDER = ''\nWANT = 3")
    exp = write_experiment(f"experiment: guess\nnotebooks: [nb.ipynb]\nparameters: {{FOLDER: '{project / 'marks'}'}}\n"
                           "sweep: {grid: {A: [1, 2, 3]}}\nresources: {gpus: 1}\n")
    records = submit(exp, progress=False).records
    assert [r.status for r in records] == ["succeeded"] * 3, [r.error for r in records]
    assert {r.metrics["together"] for r in records} == {3}
    assert all(not r.gpu_share.exclusive and r.gpu_share.need_from == "guess" and r.gpu_share.need_mb == 250
               for r in records)
    log = (project / "results" / "guess" / records[0].run_id / "log.txt").read_text()
    assert "GPUs 0: runs per GPU auto, 250 MiB reserved (guess)" in log


OOM_ONCE = """
import pathlib
marker = pathlib.Path(FOLDER) / f"oom-{A}"
if A == 1 and not marker.exists():
    marker.parent.mkdir(exist_ok=True); marker.touch()
    raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB")
"""


@pytest.mark.kernel
def test_a_run_out_of_gpu_memory_beside_others_is_run_again_alone(project, write_experiment, one_gpu):
    make_notebook(project / "nb.ipynb", [OOM_ONCE, "import time; time.sleep(1)"], parameters="A = 1\nFOLDER = ''")
    exp = write_experiment(f"experiment: oom\nnotebooks: [nb.ipynb]\nparameters: {{FOLDER: '{project / 'marks'}'}}\n"
                           "sweep: {grid: {A: [1, 2]}}\nresources: {gpus: 1, runs_per_gpu: 2}\n")
    records = {r.parameters["A"]: r for r in submit(exp, progress=False).records}
    retried = records[1]
    assert retried.status == "succeeded" and retried.attempts == 2
    assert retried.gpu_share.alone and retried.gpu_share.exclusive and not retried.gpu_share.shared
    assert "out of memory" in retried.gpu_share.retried_after
    assert records[2].status == "succeeded" and records[2].attempts == 1
    log = (project / "results" / "oom" / retried.run_id / "log.txt").read_text()
    assert "CUDA out of memory" in log and "alone on it after running out of GPU memory" in log


@pytest.mark.kernel
def test_a_run_out_of_gpu_memory_on_its_own_gpu_fails(project, write_experiment, one_gpu):
    make_notebook(project / "nb.ipynb", [OOM_ONCE], parameters="A = 1\nFOLDER = ''")
    exp = write_experiment(f"experiment: oomalone\nnotebooks: [nb.ipynb]\nparameters: {{FOLDER: '{project / 'm'}'}}\n"
                           "resources: {gpus: 1, runs_per_gpu: 1}\n")
    [record] = submit(exp, progress=False).records
    assert record.status == "failed" and record.attempts == 1 and "out of memory" in record.error.evalue


PRINT_DEVICES = "import os, time; print('DEVICES=' + os.environ['CUDA_VISIBLE_DEVICES']); time.sleep(0.2 * A)"


@pytest.mark.kernel
def test_kernels_started_ahead_of_gpu_runs_see_the_gpus_their_runs_got(project, write_experiment, monkeypatch):
    from nbbatch.backends.local import backend as local

    monkeypatch.setattr(local, "detect_gpus", lambda: [_gpu(0), _gpu(1)])
    make_notebook(project / "nb.ipynb", [PRINT_DEVICES])
    exp = write_experiment("experiment: ahead\nnotebooks: [nb.ipynb]\nsweep: {grid: {A: [1, 5, 2, 4, 3, 6]}}\n"
                           "resources: {gpus: 1, runs_per_gpu: 1}\n")  # prestart is on by default
    records = submit(exp, progress=False).records
    assert len(records) == 6 and all(r.status == "succeeded" for r in records)
    for record in records:
        log = (project / "results" / "ahead" / record.run_id / "log.txt").read_text()
        printed = next(x for x in log.splitlines() if x.startswith("DEVICES="))
        assert printed == f"DEVICES={record.gpu_ids[0]}", (record.run_id, printed, record.gpu_ids)
    assert sorted({r.gpu_ids[0] for r in records}) == [0, 1]


@pytest.mark.kernel
def test_a_run_timeout_stops_a_kernel_started_ahead_and_leaves_none(project, write_experiment):
    make_notebook(project / "nb.ipynb", ["import time; time.sleep(120)"])
    exp = write_experiment("experiment: aheadtimeout\nnotebooks: [nb.ipynb]\nsweep: {grid: {A: [1, 2, 3]}}\n"
                           "resources: {max_parallel: 1}\ntimeout: 3\n")
    records = submit(exp, progress=False).records
    assert [r.status for r in records] == ["timed_out"] * 3
    assert kernels_of("aheadtimeout") == []


@pytest.mark.kernel
def test_run_json_of_a_cpu_run_says_nothing_of_gpu_sharing(project, write_experiment):
    make_notebook(project / "nb.ipynb", ["pass"])
    [record] = submit(write_experiment("experiment: cpuonly\nnotebooks: [nb.ipynb]\n"), progress=False).records
    data = json.loads(Path(project / "results" / "cpuonly" / record.run_id / "run.json").read_text())
    assert data["gpu_share"] == {} and record.status == "succeeded"


def test_gpu_runs_on_an_exclusive_process_gpu_are_refused_a_fixed_share_without_mps(project, write_experiment,
                                                                                    monkeypatch):
    from nbbatch.backends.local import backend as local

    monkeypatch.setattr(local, "detect_gpus", lambda: [_gpu(0, mode="exclusive_process")])
    make_notebook(project / "nb.ipynb", ["pass"])
    exp = write_experiment("experiment: excl\nnotebooks: [nb.ipynb]\nresources: {gpus: 1, runs_per_gpu: 2}\n")
    with pytest.raises(ValidationError, match="exclusive-process.*mps: true"):
        submit(exp, progress=False)
    assert not (project / "results" / "excl").exists()


# --- on a real GPU (skipped without one) -----------------------------------------------------------------

TORCH_ON_GPU = """
import os, time, torch
x = torch.ones(64 * 2**20, device="cuda")  # 256 MiB
torch.cuda.synchronize(); time.sleep(2.5)
import nbbatch
nbbatch.record(pipe=os.environ.get("CUDA_MPS_PIPE_DIRECTORY", ""), devices=os.environ["CUDA_VISIBLE_DEVICES"])
"""


def _mps_processes() -> list[int]:
    return [p.pid for p in psutil.process_iter(["name"]) if (p.info["name"] or "").startswith("nvidia-cuda-mps")]


@pytest.mark.kernel
@pytest.mark.gpu
def test_auto_packs_a_new_notebook_at_once_then_by_what_it_measured(project, write_experiment):
    """A torch notebook from any folder is recognised (the bundled PyTorch estimate); one that hides its import is
    of no known framework and starts under the first guess. Either way no run waits alone, and the peak each
    measured (its own processes) is what a later batch reserves."""
    make_notebook(project / "nb.ipynb", [TORCH_ON_GPU])
    make_notebook(project / "hidden.ipynb", [TORCH_ON_GPU.replace("import os, time, torch",
                                                                  "import os, time; torch = __import__('torch')")])
    exp = write_experiment("experiment: realauto\nnotebooks: [nb.ipynb, hidden.ipynb]\n"
                           "sweep: {grid: {A: [1, 2, 3, 4]}}\nresources: {gpus: 1}\n")
    records = submit(exp, progress=False).records
    assert [r.status for r in records] == ["succeeded"] * 8, [r.error for r in records]
    assert not any(r.gpu_share.exclusive for r in records)
    plain = [r for r in records if Path(r.notebook).stem == "nb"]
    assert {r.gpu_share.need_from for r in plain} == {"framework"} and {r.recognised_as for r in plain} == {"pytorch"}
    hidden = sorted((r for r in records if Path(r.notebook).stem == "hidden"), key=lambda r: r.started_at)
    assert hidden[0].gpu_share.need_from == "guess" and hidden[0].recognised_as is None
    assert all(r.telemetry["memory_run_max_mb"] >= 256 for r in records), [r.telemetry for r in records]
    again = submit(exp, progress=False, force=True).records
    assert {r.gpu_share.need_from for r in again} == {"measured"}
    assert all(r.gpu_share.need_mb >= 256 * 1.2 for r in again)


@pytest.mark.kernel
@pytest.mark.gpu
def test_mps_runs_the_runs_as_clients_of_a_daemon_stopped_at_the_end(project, write_experiment):
    if _mps_processes():
        pytest.skip("an MPS daemon already runs on this machine")
    make_notebook(project / "nb.ipynb", [TORCH_ON_GPU])
    exp = write_experiment("experiment: realmps\nnotebooks: [nb.ipynb]\nsweep: {grid: {A: [1, 2, 3]}}\n"
                           "resources: {gpus: 1, runs_per_gpu: 3, mps: true}\n")
    records = submit(exp, progress=False).records
    assert [r.status for r in records] == ["succeeded"] * 3, [r.error for r in records]
    assert all(r.gpu_share.mps and r.metrics["pipe"] and r.metrics["devices"] == "0" for r in records)
    assert len({r.metrics["pipe"] for r in records}) == 1
    assert not Path(records[0].metrics["pipe"]).exists(), "the daemon's folder is removed"
    deadline = time.time() + 15
    while _mps_processes() and time.time() < deadline:
        time.sleep(0.2)
    assert _mps_processes() == []
