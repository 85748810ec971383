"""`runs_per_gpu: auto` with a notebook never measured: its first run has its GPU alone only until its memory stops
growing; then the other runs of that notebook join it, reserving its peak so far with headroom.

The sampler's side runs on a stand-in NVML and a stand-in clock; the scheduler's on a fake ``_execute`` that hands
the scheduler a stand-in sampler whose answers the test sets, pass by pass (no kernel, no wall-clock).
"""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from support.nvml import FakeNvml
from support.waiting import wait_until

from nbbatch.backends.base import SubmitOptions
from nbbatch.backends.local import gpus as gpus_module
from nbbatch.backends.local.backend import LocalBackend
from nbbatch.backends.local.gpus import AUTO, FIRST_GUESS, HEADROOM, GpuInfo, GpuLease, MemoryNeeds, SlotPool
from nbbatch.backends.local.scheduler import SETTLE_QUIET_S, LocalScheduler
from nbbatch.execute import telemetry
from nbbatch.execute.telemetry import GpuSampler
from nbbatch.plan.runs import Run
from nbbatch.store.runfiles import new_record, read_record, write_record
from nbbatch.store.runjson import GpuSharing, RunError, RunRecord, Status
from nbbatch.store.share import FileShare, Share

MB = 2**20
EXPERIMENT = "settle"
HOLD_S = 10.0  # the longest a fake attempt waits to be released (fails the test if never)


# --- the sampler: when a run's memory has settled -----------------------------------------------------------

class SteppedNvml(FakeNvml):
    """A stand-in NVML whose used memory, utilisation (None: not reported) and GPU processes the test sets."""

    def __init__(self) -> None:
        super().__init__(gpus=1)
        self.used_mb = 1000.0
        self.util: int | None = 50
        self.processes: list[tuple[int, int]] = []

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:  # noqa: N802 - pynvml's names
        if self.util is None:
            raise self.NVMLError("Not Supported")
        return SimpleNamespace(gpu=self.util, memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:  # noqa: N802
        return SimpleNamespace(used=int(self.used_mb * MB), total=16384 * MB, free=0)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[SimpleNamespace]:  # noqa: N802
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in self.processes]


@dataclass
class Clock:
    t: float = 0.0

    def monotonic(self) -> float:
        return self.t


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> SteppedNvml:
    fake = SteppedNvml()
    monkeypatch.setattr(telemetry, "pynvml", fake)
    return fake


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    stand_in = Clock()
    monkeypatch.setattr(telemetry, "time", stand_in)
    return stand_in


def _answers(sampler: GpuSampler, nvml: SteppedNvml, clock: Clock, used_mb: list[float]) -> list[float | None]:
    """One round a second with these used memories; what ``settled_run_memory_mb`` says after each."""
    answers = []
    for used in used_mb:
        clock.t += 1.0
        nvml.used_mb = used
        sampler._sample_once()
        answers.append(sampler.settled_run_memory_mb(3.0))
    return answers


def _alone(nvml: SteppedNvml, clock: Clock) -> GpuSampler:
    """A started sampler of a run alone on GPU 0 (its baseline, 1000 MB, taken at t 0); the test takes the rounds."""
    sampler = GpuSampler([0], interval_s=3600, alone=True)
    sampler.start()
    return sampler


def test_a_run_settles_once_its_memory_has_not_grown_for_the_quiet_window(nvml: SteppedNvml, clock: Clock) -> None:
    sampler = _alone(nvml, clock)
    try:
        assert sampler.settled_run_memory_mb(3.0) is None, "one round: nothing to tell yet"
        # grows for 2 s, then holds: settled once 3 s of rounds saw no growth over the peak before them
        assert _answers(sampler, nvml, clock, [3000, 5000, 5000, 5000, 5000]) == [None, None, None, None, 4000.0]
        assert _answers(sampler, nvml, clock, [5050]) == [4050.0], "50 MB is within the tolerance (2 % or 32 MB)"
        assert _answers(sampler, nvml, clock, [6000, 6000]) == [None, None], "growing again: not settled"
    finally:
        sampler.stop()


def test_a_run_that_keeps_growing_never_settles(nvml: SteppedNvml, clock: Clock) -> None:
    sampler = _alone(nvml, clock)
    try:
        assert _answers(sampler, nvml, clock, [1000 + 200 * i for i in range(1, 12)]) == [None] * 11
    finally:
        sampler.stop()


def test_a_run_whose_gpu_is_idle_has_not_settled_unless_utilisation_is_unknown(nvml: SteppedNvml,
                                                                              clock: Clock) -> None:
    nvml.util = 0  # the CUDA context is there, the data still loads: the memory to come is not known
    sampler = _alone(nvml, clock)
    try:
        assert _answers(sampler, nvml, clock, [1500] * 5) == [None] * 5
        nvml.util = None  # NVML stops telling: memory alone decides, once the idle rounds left the window
        assert _answers(sampler, nvml, clock, [1500] * 3) == [None, None, 500.0]
    finally:
        sampler.stop()


def test_the_run_processes_memory_counts_when_seen(nvml: SteppedNvml, clock: Clock) -> None:
    sampler = GpuSampler([0], interval_s=3600)  # shared: no device fallback, only the run's own processes
    sampler.start()
    try:
        assert _answers(sampler, nvml, clock, [2000] * 5) == [None] * 5, "nothing of the run's own is seen"
        sampler.process_group = os.getpgid(os.getpid())
        nvml.processes = [(os.getpid(), 700 * MB)]
        assert _answers(sampler, nvml, clock, [9000] * 4) == [None, None, None, 700.0]
    finally:
        sampler.stop()


def test_no_nvml_or_no_start_settles_nothing(monkeypatch: pytest.MonkeyPatch, nvml: SteppedNvml) -> None:
    assert GpuSampler([0], alone=True).settled_run_memory_mb(3.0) is None

    def missing() -> None:
        raise nvml.NVMLError("NVML Shared Library Not Found")

    nvml.nvmlInit = missing  # type: ignore[method-assign]
    with GpuSampler([0], interval_s=3600, alone=True) as sampler:
        assert sampler.unavailable and sampler.settled_run_memory_mb(3.0) is None


def test_once_others_join_the_gpus_growth_is_no_longer_the_run_s(nvml: SteppedNvml, clock: Clock) -> None:
    sampler = _alone(nvml, clock)
    try:
        assert _answers(sampler, nvml, clock, [3000] * 4)[-1] == 2000.0
        sampler.others_join()
        _answers(sampler, nvml, clock, [7000, 9000])  # the runs that joined
    finally:
        sampler.stop()
    assert sampler.summary()["memory_run_max_mb"] == 2000.0
    assert sampler.summary()["memory_run_source"] == "device"


# --- the pool and the needs -----------------------------------------------------------------------------------

def _run(run_id: str, notebook: str = "nb.ipynb", gpus: int = 1) -> Run:
    return Run(run_id=run_id, experiment=EXPERIMENT, notebook=f"/x/{notebook}", notebook_rel=notebook,
               kernel="python3", gpus=gpus)


def test_a_lease_held_alone_is_opened_to_others_by_its_measured_need() -> None:
    pool = SlotPool([GpuInfo(0, "Fake", 10_000)], AUTO, cap=8)  # budget 9000
    first = pool.acquire(1, need_mb=None)
    assert first is not None and first.exclusive and pool.acquire(1, need_mb=100) is None
    pool.reserve(first, 3000.0)
    assert not first.exclusive and first.need_mb == 3000.0 and pool.reserved_mb[0] == 3000.0
    assert pool.acquire(1, need_mb=3000) is not None and pool.acquire(1, need_mb=3001) is None
    pool.release(first)
    assert pool.reserved_mb[0] == 3000.0 and not pool.exclusive


def test_a_running_measure_stands_until_a_finished_run_replaces_it() -> None:
    needs, first, second = MemoryNeeds(), _run("a-1", gpus=2), _run("a-2")
    assert needs.need_mb(second) is None and needs.source(second) == "unknown"
    assert needs.learn_running(first, 4000.0) == 2000.0 * HEADROOM, "per GPU, with headroom"
    assert needs.need_mb(second) == 2000.0 * HEADROOM and needs.source(second) == "measured (running)"
    assert needs.need_mb(_run("b-1", notebook="other.ipynb")) is None, "other notebooks stay unknown"
    record = new_record(first)
    record.status, record.gpu_ids = Status.SUCCEEDED, [0, 1]
    record.gpu_share, record.telemetry = GpuSharing(runs_per_gpu=AUTO, shared=True), {"memory_run_max_mb": 5000.0}
    needs.learn(record)
    needs.forget_running(first.run_id)
    assert needs.need_mb(second) == 2500.0 * HEADROOM and needs.source(second) == "measured"
    needs.forget_running(second.run_id)  # never measured: nothing to forget


# --- the scheduler ---------------------------------------------------------------------------------------------

class FakeSampler:
    """Stands in for a running attempt's GpuSampler: the test says what its memory has settled at (None: growing)."""

    def __init__(self) -> None:
        self.settled_mb: float | None = None
        self.joined = False
        self.asked: list[float] = []

    def settled_run_memory_mb(self, quiet_s: float) -> float | None:
        self.asked.append(quiet_s)
        return self.settled_mb

    def others_join(self) -> None:
        self.joined = True


@dataclass
class Attempt:
    run_id: str
    lease: GpuLease  # the scheduler's own (share() changes it)
    info: GpuSharing | None
    watched: bool  # given on_sampler


class FakeExecute:
    """Stands in for ``LocalBackend._execute``: an attempt hands a stand-in sampler to ``on_sampler`` when given one,
    holds until the test releases it, and ends with ``peak_mb`` as its measured peak (or ``errors[run_id]``)."""

    def __init__(self) -> None:
        self.attempts: list[Attempt] = []
        self.samplers: dict[str, FakeSampler] = {}
        self.gates: defaultdict[str, threading.Event] = defaultdict(threading.Event)
        self.errors: dict[str, RunError] = {}
        self.peak_mb = 2000.0
        self.lock = threading.Lock()

    def __call__(self, run: Run, share: Share, lease: GpuLease, shared: bool, gpu_env: dict[str, str],
                 info: GpuSharing | None, cancel: threading.Event, notify: Any, kernels: Any, *,
                 on_sampler: Any = None) -> RunRecord:
        record = read_record(share, EXPERIMENT, run.run_id)
        record.status, record.gpu_ids, record.gpu_share = Status.RUNNING, list(lease.gpu_ids), info
        write_record(share, record)
        with self.lock:
            self.attempts.append(Attempt(run.run_id, lease, info, on_sampler is not None))
            gate = self.gates[run.run_id]
            gate.clear()  # a retry holds again
        if on_sampler is not None:
            self.samplers[run.run_id] = FakeSampler()
            on_sampler(self.samplers[run.run_id])
        try:
            assert gate.wait(HOLD_S), f"{run.run_id} was never released"
        finally:
            if on_sampler is not None:
                on_sampler(None)
        error = self.errors.pop(run.run_id, None)
        record.status, record.error = (Status.FAILED if error else Status.SUCCEEDED), error
        record.telemetry = {"memory_run_max_mb": self.peak_mb}
        write_record(share, record)
        notify(record)
        return record

    def started(self) -> set[str]:
        with self.lock:
            return {a.run_id for a in self.attempts}

    def attempt(self, run_id: str, index: int = -1) -> Attempt:
        with self.lock:
            return [a for a in self.attempts if a.run_id == run_id][index]

    def release(self, *run_ids: str) -> None:
        for run_id in run_ids:
            with self.lock:
                gate = self.gates[run_id]
            wait_until(lambda r=run_id: r in self.started(), message=f"{run_id} to start")
            gate.set()


@pytest.fixture
def share(tmp_path: Path) -> FileShare:
    return FileShare(tmp_path / "share")


@pytest.fixture(autouse=True)
def eight_per_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpus_module, "auto_cap", lambda count, cpus=None: 8)  # not the CI machine's 2 cores


def _scheduler(share: Share, runs: list[Run], fake: FakeExecute, gpus: int = 1, memory_mb: int = 0) -> LocalScheduler:
    """``memory_mb`` 0: GPUs whose memory is not known, so no first guess is made and a new notebook's first run
    is held alone until its memory settles."""
    backend = LocalBackend(gpus=[GpuInfo(i, f"Fake {i}", memory_mb) for i in range(gpus)], prestart=0)
    backend._execute = fake  # type: ignore[method-assign]
    for run in runs:
        write_record(share, new_record(run))
    return LocalScheduler(backend, runs, share, SubmitOptions(runs_per_gpu=AUTO))


def _step(scheduler: LocalScheduler, fake: FakeExecute) -> None:
    """One pass; returns once every run it started has reached ``_execute`` (the pass itself does not wait)."""
    with scheduler.changed:
        scheduler.step()
        active = set(scheduler.active)
    wait_until(lambda: active <= fake.started(), message=f"{sorted(active)} to start")


def _finish(scheduler: LocalScheduler, fake: FakeExecute) -> None:
    """Release every attempt, also those still to come, and run the scheduler to the end."""
    done = threading.Event()

    def release_all() -> None:
        while not done.is_set():
            with fake.lock:
                gates = list(fake.gates.values())
            for gate in gates:
                gate.set()
            done.wait(0.01)

    releaser = threading.Thread(target=release_all, daemon=True)
    releaser.start()
    try:
        scheduler.run()
    finally:
        done.set()
        releaser.join()


def test_the_next_runs_of_a_new_notebook_join_the_first_once_its_memory_settled(share: FileShare) -> None:
    runs, fake = [_run(f"r{i}") for i in range(3)], FakeExecute()
    scheduler = _scheduler(share, runs, fake)
    _step(scheduler, fake)
    assert fake.started() == {"r0"} and fake.attempt("r0").lease.exclusive and fake.attempt("r0").watched
    sampler = wait_until(lambda: scheduler.samplers.get("r0"), message="r0's sampler")
    for _ in range(3):  # still growing: the others wait, pass after pass
        _step(scheduler, fake)
    assert fake.started() == {"r0"} and sampler.asked == [SETTLE_QUIET_S] * 3 and not sampler.joined

    sampler.settled_mb = 2000.0
    _step(scheduler, fake)
    need = round(2000.0 * HEADROOM, 1)
    assert fake.started() == {"r0", "r1", "r2"}, "both join r0 while it still runs"
    assert sampler.joined
    first = fake.attempt("r0").lease
    assert not first.exclusive and first.need_mb == need
    for run_id in ("r1", "r2"):
        attempt = fake.attempt(run_id)
        assert attempt.lease.need_mb == need and not attempt.lease.exclusive and not attempt.watched
        assert attempt.info is not None and attempt.info.need_from == "measured (running)"
    assert scheduler.pool.reserved_mb[0] == 3 * need and not scheduler.pool.exclusive

    _finish(scheduler, fake)
    record = read_record(share, EXPERIMENT, "r0")
    assert record.status == Status.SUCCEEDED
    assert record.gpu_share is not None and not record.gpu_share.exclusive and record.gpu_share.need_mb == need
    assert record.gpu_share.need_from == "unknown" and record.gpu_share.alone_for_s is not None
    assert {read_record(share, EXPERIMENT, r).status for r in ("r1", "r2")} == {Status.SUCCEEDED}
    assert scheduler.pool.reserved_mb[0] == 0 and not scheduler.needs._running


def test_a_new_notebooks_runs_start_together_under_a_first_guess(share: FileShare) -> None:
    """Short runs end before their memory could settle: they share the GPU from the start, each reserving a
    quarter of it; a run's settled peak then replaces the guess for it and the runs after it."""
    runs, fake = [_run(f"r{i}") for i in range(6)], FakeExecute()
    scheduler = _scheduler(share, runs, fake, memory_mb=10_000)
    guess = FIRST_GUESS * 10_000
    _step(scheduler, fake)
    # 10 000 MiB less the 10 % margin holds three guesses of 2 500, not four
    assert fake.started() == {"r0", "r1", "r2"}
    for run_id in ("r0", "r1", "r2"):
        attempt = fake.attempt(run_id)
        assert attempt.lease.need_mb == guess and not attempt.lease.exclusive and attempt.watched
        assert attempt.info is not None and attempt.info.need_from == "guess" and attempt.info.shared
    sampler = wait_until(lambda: scheduler.samplers.get("r0"), message="r0's sampler")
    sampler.settled_mb = 1000.0
    _step(scheduler, fake)
    need = round(1000.0 * HEADROOM, 1)
    assert fake.attempt("r0").lease.need_mb == need and not sampler.joined  # it never held the GPU alone
    # r0 now reserves 1 200; the rest reserve what r0 measured: 2 × 2 500 + 1 200 + 3 × 1 200 = 9 800 > 9 000
    assert fake.started() == {"r0", "r1", "r2", "r3", "r4"}
    assert fake.attempt("r3").info.need_from == "measured (running)" and fake.attempt("r3").lease.need_mb == need
    _finish(scheduler, fake)
    record = read_record(share, EXPERIMENT, "r0")
    assert record.gpu_share.need_from == "guess" and record.gpu_share.alone_for_s is None
    assert {read_record(share, EXPERIMENT, r.run_id).status for r in runs} == {Status.SUCCEEDED}


def test_a_notebook_out_of_memory_under_the_guess_is_measured_alone(share: FileShare) -> None:
    runs, fake = [_run(f"r{i}") for i in range(4)], FakeExecute()
    scheduler = _scheduler(share, runs, fake, memory_mb=10_000)
    _step(scheduler, fake)
    assert fake.started() == {"r0", "r1", "r2"}
    fake.errors["r0"] = RunError("OutOfMemoryError", "CUDA out of memory. Tried to allocate 4.00 GiB")
    fake.release("r0")
    wait_until(lambda: "r0" not in scheduler.active, message="r0 to end")
    assert scheduler.needs.source(runs[3]) == "unknown", "no guess for its notebook any more"
    fake.release("r1", "r2")
    wait_until(lambda: not scheduler.active, message="r1 and r2 to end")
    # r1 and r2 measured 2 000 MiB: r0 (first in the queue again) reruns alone, r3 then reserves the measure
    _finish(scheduler, fake)
    retry = fake.attempt("r0", 1)
    assert retry.lease.alone and retry.lease.exclusive
    assert fake.attempt("r3").info.need_from == "measured"
    assert read_record(share, EXPERIMENT, "r0").status == Status.SUCCEEDED


def test_a_run_that_ends_before_it_settles_frees_its_gpu_when_it_ends(share: FileShare) -> None:
    runs, fake = [_run(f"r{i}") for i in range(2)], FakeExecute()
    scheduler = _scheduler(share, runs, fake)
    _step(scheduler, fake)
    wait_until(lambda: scheduler.samplers.get("r0"), message="r0's sampler")
    _step(scheduler, fake)
    assert fake.started() == {"r0"}
    fake.release("r0")
    wait_until(lambda: "r0" not in scheduler.active, message="r0 to end")
    _step(scheduler, fake)
    assert fake.started() == {"r0", "r1"}
    assert fake.attempt("r1").info.need_from == "measured"
    assert fake.attempt("r1").lease.need_mb == fake.peak_mb * HEADROOM
    _finish(scheduler, fake)
    record = read_record(share, EXPERIMENT, "r0")
    assert record.gpu_share.exclusive and record.gpu_share.alone_for_s is None


def test_each_new_notebook_opens_its_own_gpu_when_it_settles(share: FileShare) -> None:
    runs = [_run("a0", "a.ipynb"), _run("b0", "b.ipynb"), _run("a1", "a.ipynb"), _run("b1", "b.ipynb")]
    fake = FakeExecute()
    scheduler = _scheduler(share, runs, fake, gpus=2)
    _step(scheduler, fake)
    assert fake.started() == {"a0", "b0"}
    samplers = {r: wait_until(lambda r=r: scheduler.samplers.get(r), message=f"{r}'s sampler") for r in ("a0", "b0")}
    samplers["a0"].settled_mb = 1000.0
    _step(scheduler, fake)
    assert fake.started() == {"a0", "b0", "a1"}, "b's need is still unknown: b1 waits"
    assert fake.attempt("a1").lease.gpu_ids == fake.attempt("a0").lease.gpu_ids
    assert fake.attempt("a1").lease.need_mb == 1000.0 * HEADROOM
    samplers["b0"].settled_mb = 3000.0
    _step(scheduler, fake)
    assert fake.started() == {"a0", "b0", "a1", "b1"}
    assert fake.attempt("b1").lease.gpu_ids == fake.attempt("b0").lease.gpu_ids
    assert fake.attempt("b1").lease.need_mb == 3000.0 * HEADROOM
    _finish(scheduler, fake)


def test_a_run_out_of_memory_after_others_joined_runs_again_alone(share: FileShare) -> None:
    runs, fake = [_run(f"r{i}") for i in range(2)], FakeExecute()
    scheduler = _scheduler(share, runs, fake)
    _step(scheduler, fake)
    wait_until(lambda: scheduler.samplers.get("r0"), message="r0's sampler").settled_mb = 500.0
    _step(scheduler, fake)
    assert fake.started() == {"r0", "r1"}
    fake.errors["r0"] = RunError("OutOfMemoryError", "CUDA out of memory. Tried to allocate 2.00 GiB")
    _finish(scheduler, fake)
    retry = fake.attempt("r0", 1)
    assert retry.lease.alone and retry.lease.exclusive and not retry.watched
    record = read_record(share, EXPERIMENT, "r0")
    assert record.status == Status.SUCCEEDED
    assert record.gpu_share.alone and record.gpu_share.retried_after.startswith("OutOfMemoryError")
