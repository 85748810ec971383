"""The local backend's scheduler without kernels: a fake ``_execute`` writes the records, the GPUs are stand-ins.

Each test drives :class:`~nbbatch.backends.local.scheduler.LocalScheduler` (or one of its decisions) in
well under a second; the runs that must overlap meet at a barrier instead of sleeping.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from nbbatch.backends.base import SubmitOptions
from nbbatch.backends.local import scheduler as local_scheduler
from nbbatch.backends.local.backend import LocalBackend
from nbbatch.backends.local.cores import THREAD_VARIABLES, CorePool
from nbbatch.backends.local.gpus import GpuInfo, GpuLease
from nbbatch.backends.local.scheduler import LocalScheduler
from nbbatch.errors import ShareError, ValidationError
from nbbatch.execute.affinity import CPUS_VARIABLE
from nbbatch.execute.attempts import SHARE_FAILED
from nbbatch.plan.runs import Run
from nbbatch.store.lease import Halt
from nbbatch.store.runfiles import new_record, read_record, write_cancel_markers, write_record
from nbbatch.store.runjson import ErrorKind, GpuSharing, RunError, RunRecord, Status
from nbbatch.store.share import FileShare, Share

EXPERIMENT = "sched"
MEET_S = 5.0  # how long a run waits at a barrier for the runs that must run beside it (fails the test if they never come)


@dataclass
class Call:
    """What the scheduler gave one attempt."""

    run_id: str
    lease: GpuLease
    shared: bool
    info: GpuSharing | None
    env: dict[str, str] = field(default_factory=dict)  # the placement's variables for the kernel


@dataclass
class FakeExecute:
    """Stands in for ``LocalBackend._execute``: records what each attempt got, writes the run's record as the real
    one does (``running``, then final), and counts the attempts running at once.

    ``during(run, lease, cancel)`` runs while the attempt is ``running`` and may return a failed record's error
    (or raise, like a failing nbbatch would)."""

    during: Callable[[Run, GpuLease, threading.Event], RunError | None] = lambda run, lease, cancel: None
    calls: list[Call] = field(default_factory=list)
    running: int = 0
    most: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, run: Run, share: Share, lease: GpuLease, shared: bool, gpu_env: dict[str, str],
                 info: GpuSharing | None, cancel: threading.Event, notify: Callable[[RunRecord], None],
                 kernels: Any) -> RunRecord:
        record = new_record(run)
        record.status, record.gpu_ids, record.gpu_share = Status.RUNNING, list(lease.gpu_ids), info
        write_record(share, record)
        with self.lock:
            self.calls.append(Call(run.run_id, lease, shared, info, dict(gpu_env)))
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            error = self.during(run, lease, cancel)
        finally:
            with self.lock:
                self.running -= 1
        record.status = Status.CANCELLED if cancel.is_set() else Status.FAILED if error else Status.SUCCEEDED
        record.error = error
        write_record(share, record)
        notify(record)
        return record

    def attempts(self, run_id: str) -> list[Call]:
        return [c for c in self.calls if c.run_id == run_id]


def _runs(count: int, gpus: int = 0, prefix: str = "r", **more: Any) -> list[Run]:
    return [Run(run_id=f"{prefix}{i}", experiment=EXPERIMENT, notebook="/x/nb.ipynb", notebook_rel="nb.ipynb",
                kernel="python3", gpus=gpus, **more) for i in range(count)]


def _gpus(count: int) -> list[GpuInfo]:
    return [GpuInfo(i, f"Fake {i}", 10_000) for i in range(count)]


@pytest.fixture
def share(tmp_path: Path) -> FileShare:
    return FileShare(tmp_path / "share")


def _scheduler(share: Share, runs: list[Run], fake: FakeExecute, gpus: int = 0, options: SubmitOptions | None = None,
               cores: int = 4, **settings: Any) -> LocalScheduler:
    """A scheduler of queued runs (as ``submit`` leaves them) on a backend that starts no kernel ahead, on a machine
    of ``cores`` cores."""
    backend = LocalBackend(gpus=_gpus(gpus), prestart=0, **settings)
    backend._execute = fake  # type: ignore[method-assign]
    backend.cores = CorePool(range(cores))
    for run in runs:
        write_record(share, new_record(run))
    return LocalScheduler(backend, runs, share, options or SubmitOptions())


def _statuses(share: Share, runs: list[Run]) -> dict[str, str]:
    return {run.run_id: read_record(share, EXPERIMENT, run.run_id).status for run in runs}


def _meet(parties: int) -> Callable[[Run, GpuLease, threading.Event], None]:
    """Each attempt waits for ``parties`` attempts to run at once (a BrokenBarrierError fails the run otherwise)."""
    barrier = threading.Barrier(parties, timeout=MEET_S)

    def during(run: Run, lease: GpuLease, cancel: threading.Event) -> None:
        barrier.wait()

    return during


# --- parallel limits and GPU slots -----------------------------------------------------------------------

@pytest.mark.parametrize("where", ["backend", "options"])
def test_max_parallel_runs_that_many_cpu_runs_at_once(share: FileShare, where: str) -> None:
    runs, fake = _runs(6), FakeExecute(_meet(2))
    if where == "backend":
        scheduler = _scheduler(share, runs, fake, max_parallel=2)
    else:
        scheduler = _scheduler(share, runs, fake, options=SubmitOptions(max_parallel=2), max_parallel=5)
    scheduler.run()
    assert fake.most == 2
    assert set(_statuses(share, runs).values()) == {"succeeded"}
    assert all(not c.lease.gpu_ids and not c.shared and c.info is None for c in fake.calls), "CPU runs get no GPU"


@pytest.fixture
def no_thread_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's environment sets none of the thread variables (a user's would be left alone)."""
    for name in (*THREAD_VARIABLES, CPUS_VARIABLE):
        monkeypatch.delenv(name, raising=False)


def _holding_cores(scheduler: LocalScheduler, parties: int, held: dict[str, list[int]]):
    """Each attempt notes the cores it holds, then waits for ``parties`` attempts to run at once."""
    barrier = threading.Barrier(parties, timeout=MEET_S)

    def during(run: Run, lease: GpuLease, cancel: threading.Event) -> None:
        held[run.run_id] = list(scheduler.backend.cores.of(run.run_id) or [])
        barrier.wait()

    return during


@pytest.mark.usefixtures("no_thread_settings")
def test_cpu_runs_at_once_each_get_cores_of_their_own_and_as_many_threads(share: FileShare) -> None:
    runs, fake, held = _runs(4), FakeExecute(), {}
    scheduler = _scheduler(share, runs, fake, cores=4, max_parallel=2)
    fake.during = _holding_cores(scheduler, 2, held)
    scheduler.run()
    assert fake.most == 2 and set(_statuses(share, runs).values()) == {"succeeded"}
    assert sorted(map(tuple, held.values())) == [(0, 1), (0, 1), (2, 3), (2, 3)], "two cores each, never shared"
    for call in fake.calls:
        assert call.env[CPUS_VARIABLE] == {(0, 1): "0-1", (2, 3): "2-3"}[tuple(held[call.run_id])]
        assert [call.env[name] for name in THREAD_VARIABLES] == ["2", "2", "2"]
    assert scheduler.backend.cores.preview(4) == [0, 1, 2, 3], "every core given back"


@pytest.mark.usefixtures("no_thread_settings")
@pytest.mark.parametrize("count, options, cores, expected", [
    (1, SubmitOptions(), 4, ("0-3", "4")),  # a run alone has the machine
    (3, SubmitOptions(max_parallel=8), 2, (None, "1")),  # more at once than cores: none pinned, one thread each
    (1, SubmitOptions(runs_at_once=2), 4, ("0-1", "2")),  # a search's trial: its share of the trials at once
])
def test_a_cpu_runs_share_is_of_the_runs_that_go_at_once(share: FileShare, count: int, options: SubmitOptions,
                                                         cores: int, expected: tuple[str | None, str]) -> None:
    fake = FakeExecute()
    _scheduler(share, _runs(count), fake, options=options, cores=cores).run()
    assert {(c.env.get(CPUS_VARIABLE), c.env["OMP_NUM_THREADS"]) for c in fake.calls} == {expected}


@pytest.mark.usefixtures("no_thread_settings")
def test_resources_cpus_gives_each_run_that_many_cores_and_runs_wait_for_them(share: FileShare) -> None:
    runs, fake = _runs(3, cpus=3), FakeExecute()
    _scheduler(share, runs, fake, cores=4, max_parallel=3).run()
    assert fake.most == 1, "3 cores each of 4: one at a time"
    assert {(c.env[CPUS_VARIABLE], c.env["MKL_NUM_THREADS"]) for c in fake.calls} == {("0-2", "3")}
    with pytest.raises(ValidationError, match="resources.cpus: 5 but this machine lets nbbatch use 4 core"):
        _scheduler(share, [], fake, cores=4).backend.check(_runs(1, cpus=5))


def test_the_users_own_thread_settings_are_left_alone(share: FileShare, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MKL_NUM_THREADS", "7")
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    fake = FakeExecute()
    _scheduler(share, _runs(1, env={"OMP_NUM_THREADS": "3", CPUS_VARIABLE: ""}), fake, cores=4).run()
    assert fake.calls[0].env == {"OPENBLAS_NUM_THREADS": "4"}, "env: and the shell's variables win"


def test_runs_per_gpu_packs_the_runs_onto_the_slots_least_loaded_first(share: FileShare) -> None:
    runs = _runs(5, gpus=1)
    first_four = threading.Barrier(4, timeout=MEET_S)

    def during(run: Run, lease: GpuLease, cancel: threading.Event) -> None:
        if run.run_id != "r4":
            first_four.wait()  # all four slots taken at once

    fake = FakeExecute(during)
    _scheduler(share, runs, fake, gpus=2, options=SubmitOptions(runs_per_gpu=2)).run()
    assert fake.most == 4, "two GPUs × runs_per_gpu 2: four at once, the fifth after one ended"
    assert [c.run_id for c in fake.calls][-1] == "r4"
    placed = [c.lease.gpu_ids for c in fake.calls[:4]]
    assert sorted(placed) == [[0], [0], [1], [1]]
    assert all(c.shared for c in fake.calls), "sharing a GPU: the framework's sharing settings"
    assert fake.calls[0].info == GpuSharing(runs_per_gpu=2, shared=True, exclusive=False, mps=False)
    assert set(_statuses(share, runs).values()) == {"succeeded"}


def test_admit_is_a_decision_without_threads(share: FileShare) -> None:
    gpu_runs, cpu_runs = _runs(2, gpus=1, prefix="g"), _runs(2, prefix="c")
    scheduler = _scheduler(share, gpu_runs + cpu_runs, FakeExecute(), gpus=1, max_parallel=1)
    lease = scheduler.admit(gpu_runs[0])
    assert lease is not None and lease.gpu_ids == [0]
    assert scheduler.admit(gpu_runs[1]) is None, "the one slot is taken"
    scheduler.active["g0"], scheduler.active["c0"] = threading.Thread(), threading.Thread()
    scheduler.gpu_runs.add("g0")
    assert not scheduler.within_parallel_limit(gpu_runs[1])
    assert not scheduler.within_parallel_limit(cpu_runs[1]), "max_parallel 1: one CPU run at a time"
    del scheduler.active["c0"]
    assert scheduler.admit(cpu_runs[1]) == GpuLease([], None, False, False), "GPU runs do not count against CPU runs"
    scheduler.pool.release(lease)
    assert scheduler.admit(gpu_runs[1]) is None, "the GPU run limit still holds while g0 is active"


def test_prestart_starts_the_next_runs_kernels_for_the_gpus_they_will_likely_get(share: FileShare,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    runs = _runs(3, gpus=1)
    scheduler = _scheduler(share, runs, FakeExecute(), gpus=2, options=SubmitOptions(runs_per_gpu=2))
    launched: list[tuple[str, list[int], bool]] = []

    def kernel_launch(run: Run, gpu_ids: list[int], shared: bool, **kwargs: Any) -> tuple[str, dict[str, str], str]:
        launched.append((run.run_id, gpu_ids, shared))
        return run.kernel, {}, "/x"

    class Pool:
        size = 2

        def __contains__(self, key: str) -> bool:
            return False

        def prestart(self, key: str, kernel_name: str, env: dict[str, str], cwd: str, preload: Any = (),
                     now: bool = False, per_run: Any = ()) -> bool:
            return True

    monkeypatch.setattr(local_scheduler, "kernel_launch", kernel_launch)
    scheduler.kernels = Pool()  # type: ignore[assignment]
    scheduler.pool.acquire(1)  # GPU 0 now holds a run: the next ones would likely get GPU 1
    scheduler.prestart()
    assert launched == [("r0", [1], True), ("r1", [1], True)], "the first `prestart` pending runs only"


def test_the_first_wave_warms_a_fork_server_and_gets_its_kernels_as_it_launches(share: FileShare,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Servers for the first runs with `preload` (not a distributed run's: it starts a kernel per rank), the sharing
    variables named per run; then every launched run's kernel is started through the pool, also with the pool full."""
    runs = _runs(3, preload=("torch",), shared_gpu_env={"PYTORCH_CUDA_ALLOC_CONF": "x"}) + _runs(1, prefix="plain")
    scheduler = _scheduler(share, runs, FakeExecute(), options=SubmitOptions(max_parallel=2))
    calls: list[tuple[str, Any]] = []

    class Pool:
        size = 1

        def __contains__(self, key: str) -> bool:
            return False

        def warm(self, kernel_name: str, env: dict[str, str], preload: Any, per_run: Any = ()) -> None:
            calls.append(("warm", (kernel_name, tuple(preload), tuple(per_run))))

        def prestart(self, key: str, kernel_name: str, env: dict[str, str], cwd: str, preload: Any = (),
                     now: bool = False, per_run: Any = ()) -> bool:
            calls.append(("prestart", (key, now)))
            return True

        def take(self, *args: Any) -> None:
            return None

        def close(self) -> None:
            pass

    monkeypatch.setattr(local_scheduler, "kernel_launch", lambda run, *a, **k: (run.kernel, {}, "/x"))
    scheduler.kernels = Pool()  # type: ignore[assignment]
    scheduler.warm_first_wave()
    assert calls == [("warm", ("python3", ("torch",), ("PYTORCH_CUDA_ALLOC_CONF",)))] * 2, "the first two runs"
    calls.clear()
    with scheduler.changed:
        scheduler.step()
    assert [c for c in calls if c[1][1]] == [("prestart", ("r0", True)), ("prestart", ("r1", True))], \
        "each run launched gets its kernel through the pool, beyond its size"


# --- out of GPU memory ---------------------------------------------------------------------------------

def _out_of_memory_unless_alone(run: Run, lease: GpuLease, cancel: threading.Event) -> RunError | None:
    if run.run_id == "r0" and not lease.alone:
        return RunError("OutOfMemoryError", "CUDA out of memory")
    return None


def test_a_run_out_of_gpu_memory_beside_others_runs_again_alone(share: FileShare) -> None:
    runs, updates = _runs(2, gpus=1), []
    fake = FakeExecute(_out_of_memory_unless_alone)
    options = SubmitOptions(runs_per_gpu=2, on_update=updates.append)
    _scheduler(share, runs, fake, gpus=1, options=options).run()
    first, again = fake.attempts("r0")
    assert not first.lease.alone and first.shared
    assert again.lease.alone and again.lease.exclusive and not again.shared
    assert again.info.alone is True and again.info.retried_after == "OutOfMemoryError: CUDA out of memory"
    queued = [u for u in updates if u.run_id == "r0" and u.status == "queued"]
    assert queued and queued[0].gpu_share.out_of_memory == "OutOfMemoryError: CUDA out of memory"
    assert _statuses(share, runs) == {"r0": "succeeded", "r1": "succeeded"}


def test_a_run_out_of_gpu_memory_on_a_gpu_of_its_own_fails(share: FileShare) -> None:
    runs = _runs(1, gpus=1)
    fake = FakeExecute(_out_of_memory_unless_alone)
    _scheduler(share, runs, fake, gpus=1).run()  # runs_per_gpu 1: running alone would not help
    assert len(fake.calls) == 1
    assert _statuses(share, runs) == {"r0": "failed"}


# --- what stops runs from starting ------------------------------------------------------------------------

def test_a_run_cancelled_before_it_started_never_starts(share: FileShare) -> None:
    runs, fake = _runs(3), FakeExecute()
    scheduler = _scheduler(share, runs, fake, max_parallel=1)
    write_cancel_markers(share, EXPERIMENT, ["r1"])
    scheduler.run()
    assert [c.run_id for c in fake.calls] == ["r0", "r2"]
    cancelled = read_record(share, EXPERIMENT, "r1")
    assert cancelled.status == "cancelled" and cancelled.error.reason == "cancelled before it started"
    assert cancelled.error.kind == ErrorKind.CANCELLED


def test_cancelling_the_experiment_starts_nothing(share: FileShare) -> None:
    runs, fake = _runs(3), FakeExecute()
    scheduler = _scheduler(share, runs, fake)
    write_cancel_markers(share, EXPERIMENT)
    scheduler.run()
    assert not fake.calls and scheduler.cancel.is_set()
    assert set(_statuses(share, runs).values()) == {"cancelled"}


def test_a_share_failure_starts_no_more_runs(share: FileShare) -> None:
    runs = _runs(3)

    def during(run: Run, lease: GpuLease, cancel: threading.Event) -> None:
        raise ShareError("no space left on the share")

    fake = FakeExecute(during)
    scheduler = _scheduler(share, runs, fake, max_parallel=1)
    with pytest.raises(ShareError, match="no space left"):
        scheduler.run()
    assert [c.run_id for c in fake.calls] == ["r0"]
    failed = read_record(share, EXPERIMENT, "r0")
    assert failed.status == "failed" and failed.error.reason == SHARE_FAILED and failed.error.kind == ErrorKind.SHARE
    for run_id in ("r1", "r2"):
        record = read_record(share, EXPERIMENT, run_id)
        assert record.status == "cancelled" and record.error.reason == "not started: " + SHARE_FAILED
        assert record.error.kind == ErrorKind.SHARE


def test_a_failure_of_nbbatch_fails_that_run_only(share: FileShare) -> None:
    runs = _runs(2)

    def during(run: Run, lease: GpuLease, cancel: threading.Event) -> None:
        if run.run_id == "r0":
            raise RuntimeError("a defect")

    _scheduler(share, runs, FakeExecute(during), max_parallel=1).run()
    failed = read_record(share, EXPERIMENT, "r0")
    assert failed.status == "failed" and failed.error.reason == "nbbatch error" and failed.error.kind == ErrorKind.INTERNAL
    assert read_record(share, EXPERIMENT, "r1").status == "succeeded"


@pytest.mark.parametrize("why", [None, "the experiment's folder /x/e is gone from the share (deleted or renamed)"])
def test_the_halt_event_starts_no_more_runs(share: FileShare, why: str | None) -> None:
    runs, halt = _runs(3), Halt()

    def during(run: Run, lease: GpuLease, cancel: threading.Event) -> None:
        if why is None:
            halt.set()  # another driver took the experiment over while r0 ran
        else:
            halt.halt(why)  # the experiment's folder vanished while r0 ran (issue 45, item 13)

    fake = FakeExecute(during)
    _scheduler(share, runs, fake, options=SubmitOptions(halt=halt), max_parallel=1).run()
    assert [c.run_id for c in fake.calls] == ["r0"]
    assert _statuses(share, runs) == {"r0": "succeeded", "r1": "cancelled", "r2": "cancelled"}
    reason = read_record(share, EXPERIMENT, "r1").error.reason
    assert reason == "not started: " + (why or "another driver took the experiment over (its lease on the share)")


@pytest.mark.parametrize(("raised", "reason"), [(KeyboardInterrupt, "interrupted before it started"),
                                                (RuntimeError, "not started: nbbatch error: ")])
def test_ctrl_c_or_a_defect_in_the_loop_leaves_no_run_running(share: FileShare, raised: type[BaseException],
                                                              reason: str) -> None:
    runs, started = _runs(3), threading.Event()

    def during(run: Run, lease: GpuLease, cancel: threading.Event) -> None:
        started.set()
        assert cancel.wait(MEET_S), "the scheduler never told the running run to stop"

    scheduler = _scheduler(share, runs, FakeExecute(during), max_parallel=1)
    first_pass = scheduler.step

    def step() -> bool:
        if scheduler.active:  # r0 runs: Ctrl-C (or a defect) now
            assert started.wait(MEET_S)
            raise raised()
        return first_pass()

    scheduler.step = step  # type: ignore[method-assign]
    with pytest.raises(raised):
        scheduler.run()
    assert not scheduler.active and not scheduler.pending
    assert _statuses(share, runs) == {"r0": "cancelled", "r1": "cancelled", "r2": "cancelled"}
    assert read_record(share, EXPERIMENT, "r1").error.reason.startswith(reason)
