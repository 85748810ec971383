"""Each rank of a distributed run on the cores near its GPU where the GPUs sit on different sockets (NVML), the
``NBBATCH_CPUS`` cpu-list every rank gets, and the kernel manager pinning the kernel to it."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import types

import nbformat
import pytest
from support.notebooks import make_notebook

from nbbatch.api import submit
from nbbatch.errors import NbbatchError
from nbbatch.execute import affinity, kernels
from nbbatch.execute.affinity import format_cpu_list, node_cpu_blocks, parse_cpu_list
from nbbatch.execute.placement import NodePlacement, rank_env, ranks_of
from nbbatch.metrics import metrics_from_notebook
from nbbatch.plan.runs import Run
from nbbatch.spec.resources import Distribution

PINNING = hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= 2


@pytest.fixture(autouse=True)
def _no_user_cpus(monkeypatch):
    monkeypatch.delenv("NBBATCH_CPUS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


def _machine(monkeypatch, cpus: int, near: dict[int, int] | None = None, nvml_fails: bool = False):
    """This process may use CPUs 0 … cpus-1; ``near``: GPU → its NVML CPU mask (one 64-bit word; None: no NVML)."""
    monkeypatch.setattr(affinity, "available_cpus", lambda: list(range(cpus)))
    monkeypatch.setattr(affinity, "pynvml", _FakeNvml(near, nvml_fails))


class _FakeNvml:
    def __init__(self, near: dict[int, int] | None, fails: bool = False):
        self.near, self.fails, self.calls = near, fails, 0

    def nvmlInit(self) -> None:
        if self.near is None:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetCpuAffinity(self, handle: int, words: int) -> list[int]:
        self.calls += 1
        if self.fails:
            raise RuntimeError("Not Supported")
        assert self.near is not None
        mask = self.near[handle]
        return [(mask >> (64 * w)) & (2**64 - 1) for w in range(words)]


def _run(per_node: int = 2, kind: str = "torch", env: dict[str, str] | None = None) -> Run:
    return Run(run_id="r-1", experiment="e", notebook="/nb.ipynb", notebook_rel="nb.ipynb", kernel="k",
               env=env or {}, distribution=Distribution(kind, 1, per_node, 0))


# --- cpu-lists ------------------------------------------------------------------------------------------------


CPU_LISTS = [("0", {0}), ("0-15", set(range(16))), ("0-3,8-11", {0, 1, 2, 3, 8, 9, 10, 11}), ("1,3,5", {1, 3, 5}),
             ("4-5,7", {4, 5, 7}), ("0-1,3-4,64-66", {0, 1, 3, 4, 64, 65, 66})]


@pytest.mark.parametrize(("text", "cpus"), CPU_LISTS)
def test_cpu_lists_parse_and_format_round_trip(text, cpus):
    assert parse_cpu_list(text) == cpus
    assert format_cpu_list(cpus) == text
    assert parse_cpu_list(format_cpu_list(cpus)) == cpus


def test_a_cpu_list_may_be_unordered_and_spaced():
    assert parse_cpu_list(" 8-11, 0-3 ") == {0, 1, 2, 3, 8, 9, 10, 11}
    assert format_cpu_list([3, 1, 2, 2]) == "1-3"


@pytest.mark.parametrize("bad", ["", "a", "3-1", "-1", "0-", "1,,2", "0-3:2", "0-99999999999"])
def test_a_malformed_cpu_list_is_an_error_naming_it(bad):
    with pytest.raises(NbbatchError, match=f"NBBATCH_CPUS={bad!r} is not a list of CPU cores"):
        parse_cpu_list(bad)


# --- the split ---------------------------------------------------------------------------------------------


SOCKETS = {0: 0x0F, 1: 0x0F, 2: 0xF0, 3: 0xF0}  # GPUs 0, 1 near cores 0-3 (socket 0); GPUs 2, 3 near 4-7


def test_ranks_run_on_the_cores_near_their_gpu_shared_with_the_ranks_of_that_socket(monkeypatch):
    _machine(monkeypatch, 8, near=SOCKETS)
    assert [format_cpu_list(b) for b in node_cpu_blocks(4, [0, 1, 2, 3])] == ["0-3", "0-3", "4-7", "4-7"]
    # local rank r uses the r-th GPU of CUDA_VISIBLE_DEVICES (NVML indices), whatever their order
    assert [format_cpu_list(b) for b in node_cpu_blocks(2, [2, 0])] == ["4-7", "0-3"]
    # only the cores this process may use
    monkeypatch.setattr(affinity, "available_cpus", lambda: [1, 2, 5, 6])
    assert [format_cpu_list(b) for b in node_cpu_blocks(2, [0, 3])] == ["1-2", "5-6"]


@pytest.mark.parametrize("why", ["one socket", "no NVML", "NVML fails", "no near core left", "one rank", "CPU ranks"])
def test_nothing_is_pinned_where_every_gpu_is_near_every_core_or_nvml_cannot_say(monkeypatch, why):
    """One socket is the measured case (docs/benchmarks.md §17): fixed masks there only slowed the ranks down."""
    near = {"one socket": {g: 0xFF for g in range(4)}, "no NVML": None, "NVML fails": {},
            "no near core left": {0: 0x0F, 1: 0x0F, 2: 0xF00, 3: 0xF00}}.get(why, SOCKETS)
    _machine(monkeypatch, 8, near=near, nvml_fails=why == "NVML fails")
    ranks, gpus = {"one rank": (1, [0]), "CPU ranks": (2, None)}.get(why, (4, [0, 1, 2, 3]))
    assert node_cpu_blocks(ranks, gpus) == ()


def test_nvml_masks_of_several_words_are_read_bit_by_bit(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 128)
    _machine(monkeypatch, 128, near={0: 0b11 << 64 | 1, 1: 1 << 127})
    assert affinity.gpu_near_cpus([0, 1]) == {0: {0, 64, 65}, 1: {127}}


# --- what each rank gets -----------------------------------------------------------------------------------


def test_every_rank_gets_its_cores_as_nbbatch_cpus_and_its_share_of_them_as_omp_threads(monkeypatch):
    _machine(monkeypatch, 8, near={0: 0x0F, 1: 0xF0, 2: 0xF0})
    ranks = ranks_of(_run(3), NodePlacement(0, ("127.0.0.1:7000",)), gpu_ids=[0, 1, 2])
    assert [(r.env["NBBATCH_CPUS"], r.env["OMP_NUM_THREADS"]) for r in ranks] == [("0-3", "4"), ("4-7", "2"),
                                                                                   ("4-7", "2")]
    # a launcher of one rank of an MPI node gets that rank's cores
    (only,) = ranks_of(_run(3), NodePlacement(0, ("127.0.0.1:7000",), (1,)), gpu_ids=[0, 1, 2])
    assert only.local_rank == 1 and only.env["NBBATCH_CPUS"] == "4-7"
    # nothing pinned (CPU ranks): OMP_NUM_THREADS the node's cores ÷ its ranks
    cpu = rank_env(_run(2), NodePlacement(0, ("127.0.0.1:7000",)), 0)
    assert "NBBATCH_CPUS" not in cpu and cpu["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 2))
    jax = rank_env(_run(1, "jax"), NodePlacement(0, ("127.0.0.1:7000",)), 0)
    assert "NBBATCH_CPUS" not in jax and "OMP_NUM_THREADS" not in jax  # one process per node: the default
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # the user's own stands
    assert "OMP_NUM_THREADS" not in rank_env(_run(2), NodePlacement(0, ("127.0.0.1:7000",)), 0)


def test_the_node_asks_nvml_once_for_all_its_ranks(monkeypatch):
    _machine(monkeypatch, 8, near=SOCKETS)
    asked = []
    real = affinity.gpu_near_cpus
    monkeypatch.setattr(affinity, "gpu_near_cpus", lambda gpus: asked.append(list(gpus)) or real(gpus))
    ranks = ranks_of(_run(4), NodePlacement(0, ("127.0.0.1:7000",)), gpu_ids=[0, 1, 2, 3])
    assert [r.env["NBBATCH_CPUS"] for r in ranks] == ["0-3", "0-3", "4-7", "4-7"]
    assert [r.env["OMP_NUM_THREADS"] for r in ranks] == ["2"] * 4
    assert asked == [[0, 1, 2, 3]]


@pytest.mark.parametrize("where", ["env:", "environment"])
@pytest.mark.parametrize("value", ["", "0-1"])
def test_the_users_nbbatch_cpus_is_left_alone(monkeypatch, where, value):
    _machine(monkeypatch, 8, near={0: 0x0F, 1: 0xF0})
    monkeypatch.setattr(affinity, "gpu_near_cpus", lambda gpus: pytest.fail("NVML asked for nothing"))
    if where == "environment":
        monkeypatch.setenv("NBBATCH_CPUS", value)
    run = _run(2, env={"NBBATCH_CPUS": value} if where == "env:" else {})
    for rank in ranks_of(run, NodePlacement(0, ("127.0.0.1:7000",)), gpu_ids=[0, 1]):
        assert "NBBATCH_CPUS" not in rank.env  # the kernel gets the user's own (an empty one: unpinned)
        assert rank.env["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 2))
    assert "NBBATCH_CPUS" not in rank_env(run, NodePlacement(0, ("127.0.0.1:7000",)), 0)


# --- pinning a kernel process -----------------------------------------------------------------------------------

THREADS = "import threading, time\n" \
          "for _ in range(3):\n    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n" \
          "print('ready', flush=True)\ntime.sleep(60)\n"


@pytest.fixture
def threaded_process():
    """A process with four threads, as a kernel manager's provisioner holds it."""
    proc = subprocess.Popen([sys.executable, "-c", THREADS], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    try:
        yield types.SimpleNamespace(provisioner=types.SimpleNamespace(process=proc))
    finally:
        proc.kill()
        proc.wait()


def _thread_masks(pid: int) -> list[set[int]]:
    return [os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")]


@pytest.mark.skipif(not PINNING, reason="needs sched_setaffinity and two cores")
def test_the_kernel_manager_pins_every_thread_of_the_kernel(threaded_process):
    cpu = min(os.sched_getaffinity(0))
    kernels.pin_kernel(threaded_process, {"NBBATCH_CPUS": str(cpu)})
    masks = _thread_masks(threaded_process.provisioner.process.pid)
    assert len(masks) == 4 and all(mask == {cpu} for mask in masks)


@pytest.mark.skipif(not PINNING, reason="needs sched_setaffinity and two cores")
@pytest.mark.parametrize("value", ["0-x", "4096", "gone"])
def test_a_kernel_that_cannot_be_pinned_runs_unpinned_with_one_warning(threaded_process, monkeypatch, caplog, value):
    monkeypatch.setattr(kernels, "_pin_warned", threading.Event())
    process = threaded_process.provisioner.process
    before = _thread_masks(process.pid)
    if value == "gone":
        process.kill()
        process.wait()
        value = "0"
    with caplog.at_level(logging.DEBUG, logger=kernels.__name__):
        kernels.pin_kernel(threaded_process, {"NBBATCH_CPUS": value})
        kernels.pin_kernel(threaded_process, {"NBBATCH_CPUS": value})
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"NBBATCH_CPUS={value}" in warnings[0].getMessage()
    if process.returncode is None:
        assert _thread_masks(process.pid) == before


def test_no_nbbatch_cpus_or_no_local_process_pins_nothing(monkeypatch):
    monkeypatch.setattr(affinity.os, "sched_setaffinity", lambda *a: pytest.fail("pinned"), raising=False)
    kernels.pin_kernel(types.SimpleNamespace(provisioner=types.SimpleNamespace(process=None)), {"NBBATCH_CPUS": "0"})
    kernels.pin_kernel(types.SimpleNamespace(), {"NBBATCH_CPUS": "0"})
    kernels.pin_kernel(types.SimpleNamespace(provisioner=types.SimpleNamespace(process=types.SimpleNamespace(pid=1))),
                       {"NBBATCH_CPUS": ""})


# --- end to end ---------------------------------------------------------------------------------------------

RECORD_CPUS = """\
import os
from nbbatch import record
threads = {tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir('/proc/self/task')}
record(rank=int(os.environ['RANK']), cpus=sorted(os.sched_getaffinity(0)), listed=os.environ.get('NBBATCH_CPUS', ''),
       omp=int(os.environ['OMP_NUM_THREADS']), threads=sorted(threads))
"""


def _ranks_cpus(project, write_experiment, name: str, env: str = "") -> list[dict]:
    make_notebook(project / "pin.ipynb", [RECORD_CPUS])
    exp = write_experiment(f"experiment: {name}\nnotebooks: [pin.ipynb]\nresources: {{processes_per_node: 2}}\n"
                           f"distribution: {{type: torch}}\n{env}", name=f"{name}.yaml")
    (record,) = submit(exp, progress=False).records
    assert record.status == "succeeded", record.error
    folder = project / "results" / name / record.run_id / "ranks"
    return [metrics_from_notebook(nbformat.read(folder / str(rank) / "output.ipynb", 4)) for rank in range(2)]


@pytest.mark.kernel
@pytest.mark.skipif(not PINNING, reason="needs sched_setaffinity and two cores")
def test_every_thread_of_each_ranks_kernel_runs_on_the_cores_nbbatch_cpus_names(project, write_experiment):
    cpu = max(os.sched_getaffinity(0))
    zero, one = _ranks_cpus(project, write_experiment, "pinned", env=f'env: {{NBBATCH_CPUS: "{cpu}"}}\n')
    assert [zero["rank"], one["rank"]] == [0, 1]
    for metrics in (zero, one):
        assert metrics["cpus"] == [cpu] and metrics["listed"] == str(cpu)
        assert metrics["threads"] == [[cpu]]  # every thread of the kernel, not only its main one


@pytest.mark.kernel
@pytest.mark.skipif(not PINNING, reason="needs sched_setaffinity and two cores")
def test_an_empty_nbbatch_cpus_in_env_leaves_the_ranks_unpinned(project, write_experiment):
    ranks = _ranks_cpus(project, write_experiment, "unpinned", env='env: {NBBATCH_CPUS: ""}\n')
    assert all(set(m["cpus"]) == os.sched_getaffinity(0) and m["listed"] == "" for m in ranks)
