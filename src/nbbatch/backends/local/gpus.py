"""GPUs of this machine (through NVML), and how runs are packed onto them.

A run asking for ``k`` GPUs takes a place on each of the ``k`` least-loaded GPUs that have room.
Room is either a fixed number of runs per GPU (``runs_per_gpu: N``) or, with ``runs_per_gpu: auto``,
memory: each run reserves what it needs (:class:`MemoryNeeds`: what an earlier run of the same
notebook used, else its framework's estimate, else a first guess of :data:`FIRST_GUESS` of the GPU's memory)
against the GPU's free memory less a safety margin, never more than :data:`AUTO_CAP` runs per GPU (nor more
than the CPU cores per GPU: each run's Python loop needs a core to keep the GPU fed). Once the memory of a run
reserving a guess (or, where no guess can be made, a run held alone) stops growing, its peak so far tells the
next runs of that notebook what to reserve (:meth:`SlotPool.reserve`); its final peak replaces that measure
once it ends. A notebook that ran out of memory under the guess gets no guess again: its next run is measured
alone. No GPU (or no NVML) means CPU-only runs, with ``CUDA_VISIBLE_DEVICES`` empty.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pynvml  # nvidia-ml-py: loads the NVML library only at nvmlInit

from nbbatch.spec.resources import AUTO, AUTO_CAP, auto_cap  # noqa: F401 - what `auto` means (the scheduler packs by it)

if TYPE_CHECKING:
    from nbbatch.plan.runs import Run
    from nbbatch.store.runjson import RunError, RunRecord

MEMORY_MARGIN = 0.10  # of each GPU's memory never reserved under `auto` (allocator slack, fragmentation)
HEADROOM = 1.2  # a measured peak is reserved with this much to spare (data and batches vary)
# What a run of a notebook never measured, of no known framework, reserves at first: this share of its GPU's
# memory (of the smallest GPU's), so that short runs share a GPU from the start (4 at once) instead of waiting
# alone for a measure they end before giving.
FIRST_GUESS = 0.25


@dataclass(frozen=True)
class GpuInfo:
    """One NVIDIA GPU as NVML sees it."""

    index: int
    name: str
    memory_mb: int
    uuid: str = ""
    free_mb: int | None = None  # free when detected (None: unknown, taken as all of it)
    compute_mode: str = "default"  # NVML's: default | exclusive_process | prohibited


def _visible_filter() -> set[int] | None:
    """GPUs this process may use: NBBATCH_GPUS, else the driver's own CUDA_VISIBLE_DEVICES."""
    for var in ("NBBATCH_GPUS", "CUDA_VISIBLE_DEVICES"):
        value = os.environ.get(var)
        if value is None:
            continue
        value = value.strip()
        if value in ("", "none", "-1"):
            return set()
        try:
            return {int(v) for v in value.split(",") if v.strip()}
        except ValueError:
            return None  # UUIDs: let NVML's full list stand
    return None


def detect_gpus() -> list[GpuInfo]:
    """The NVIDIA GPUs NVML reports (empty without a GPU or a driver)."""
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded…
        return []
    try:
        found = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle).total // (1024 * 1024)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            found.append(GpuInfo(index, name.decode() if isinstance(name, bytes) else str(name), int(memory),
                                 uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                                 free_mb=_free_mb(pynvml, handle), compute_mode=_compute_mode(pynvml, handle)))
    finally:
        pynvml.nvmlShutdown()
    allowed = _visible_filter()
    return [g for g in found if allowed is None or g.index in allowed]


_COMPUTE_MODES = {0: "default", 1: "exclusive_thread", 2: "prohibited", 3: "exclusive_process"}


def _free_mb(pynvml: Any, handle: Any) -> int | None:
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).free // (1024 * 1024))
    except Exception:  # noqa: BLE001
        return None


def _compute_mode(pynvml: Any, handle: Any) -> str:
    try:
        return _COMPUTE_MODES.get(int(pynvml.nvmlDeviceGetComputeMode(handle)), "default")
    except Exception:  # noqa: BLE001 - not reported: nothing known against sharing it
        return "default"


@dataclass
class GpuLease:
    """The GPUs one run holds, and what it reserved on them."""

    gpu_ids: list[int]
    need_mb: float | None = None  # reserved on each GPU (None: unknown, so the GPUs are the run's alone)
    exclusive: bool = False  # no other run joins these GPUs while it runs
    alone: bool = False  # retried after running out of GPU memory: not even its framework's sharing settings


class SlotPool:
    """Places on GPUs: ``runs_per_gpu`` runs on each, or with ``"auto"`` as many as their memory needs allow."""

    def __init__(self, gpus: Sequence[GpuInfo] | Sequence[int], runs_per_gpu: int | str = 1,
                 cap: int | None = None, mps: bool = False):
        if runs_per_gpu != AUTO and (not isinstance(runs_per_gpu, int) or runs_per_gpu < 1):
            raise ValueError(f"runs_per_gpu must be ≥ 1 or {AUTO!r}")
        infos = [g if isinstance(g, GpuInfo) else GpuInfo(int(g), f"GPU {g}", 0) for g in gpus]
        self.runs_per_gpu = runs_per_gpu
        self.auto = runs_per_gpu == AUTO
        self.mps = mps
        cap = cap if cap is not None else auto_cap(len(infos))
        # Exclusive-process GPUs take one process each, unless MPS funnels the runs into one.
        self.cap = {g.index: (1 if g.compute_mode == "exclusive_process" and not mps else cap) if self.auto
                    else int(runs_per_gpu) for g in infos}
        self.budget_mb = {g.index: _budget_mb(g) for g in infos}
        self.total_mb = {g.index: g.memory_mb for g in infos}
        self.load: dict[int, int] = {g.index: 0 for g in infos}
        self.reserved_mb: dict[int, float] = {g.index: 0.0 for g in infos}
        self.exclusive: set[int] = set()
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        return sum(self.cap.values())

    def _fits(self, gpu: int, need_mb: float | None, exclusive: bool) -> bool:
        if gpu in self.exclusive or self.load[gpu] >= self.cap[gpu]:
            return False
        if exclusive:
            return self.load[gpu] == 0
        return not self.auto or self.load[gpu] == 0 or self.reserved_mb[gpu] + (need_mb or 0.0) <= self.budget_mb[gpu]

    def acquire(self, count: int, need_mb: float | None = None, alone: bool = False) -> GpuLease | None:
        """A place on ``count`` distinct GPUs (least loaded first), or None while none has room.

        ``need_mb`` is the memory the run needs on each (``auto`` only; None: unknown, so the run gets
        its GPUs to itself); ``alone`` keeps every other run off its GPUs."""
        exclusive = alone or (self.auto and need_mb is None)
        if count == 0:
            return GpuLease([], need_mb, exclusive, alone)
        with self._lock:
            free = sorted((self.load[g], g) for g in self.load if self._fits(g, need_mb, exclusive))
            if len(free) < count:
                return None
            chosen = sorted(g for _, g in free[:count])
            for gpu in chosen:
                self.load[gpu] += 1
                self.reserved_mb[gpu] += need_mb or 0.0
                if exclusive:
                    self.exclusive.add(gpu)
            return GpuLease(chosen, need_mb, exclusive, alone)

    def preview(self, count: int) -> list[int]:
        """The GPUs a run would most likely get once there is room (for kernels started ahead of their run)."""
        with self._lock:
            return sorted(g for _, g in sorted((self.load[g], g) for g in self.load)[:count])

    def release(self, lease: GpuLease) -> None:
        with self._lock:
            for gpu in lease.gpu_ids:
                self.load[gpu] -= 1
                self.reserved_mb[gpu] = max(0.0, self.reserved_mb[gpu] - (lease.need_mb or 0.0))
                if lease.exclusive:
                    self.exclusive.discard(gpu)

    def reserve(self, lease: GpuLease, need_mb: float) -> None:
        """Reserve ``need_mb`` on each of the lease's GPUs instead of what it reserved, its memory having been
        measured while it runs; a run held alone (its need was unknown) opens its GPUs to other runs. The
        caller guarantees the lease is still held."""
        with self._lock:
            for gpu in lease.gpu_ids:
                if lease.exclusive:
                    self.exclusive.discard(gpu)
                self.reserved_mb[gpu] = max(0.0, self.reserved_mb[gpu] + need_mb - (lease.need_mb or 0.0))
            lease.need_mb, lease.exclusive = need_mb, False

    def first_guess_mb(self) -> float | None:
        """What a never-measured run of no known framework reserves per GPU (:data:`FIRST_GUESS`); None where
        a GPU's memory is not known (it then runs alone until measured)."""
        sizes = [self.total_mb.get(g, 0) for g in self.load]
        return round(FIRST_GUESS * min(sizes), 1) if sizes and all(sizes) else None

    def shared(self, lease: GpuLease) -> bool:
        """Whether the run must leave room for others (its framework's ``shared_gpu_env``: no grabbing all memory).

        Under ``auto`` every run does (also one alone for now, so that what it measures is what it needs),
        except a run retried alone after running out of memory."""
        if not lease.gpu_ids or lease.alone:
            return False
        return self.auto or int(self.runs_per_gpu) > 1


def _budget_mb(gpu: GpuInfo) -> float:
    if not gpu.memory_mb:
        return float("inf")  # no memory known (a GPU given by index only): counted by runs alone
    free = gpu.free_mb if gpu.free_mb is not None else gpu.memory_mb
    return max(0.0, free - MEMORY_MARGIN * gpu.memory_mb)


class MemoryNeeds:
    """The GPU memory a run needs, per GPU: the peak an earlier run of it (or else of the same notebook) used,
    measured on its own processes, with :data:`HEADROOM`; else its framework's ``gpu_memory_mb``; else
    ``first_guess_mb`` (:meth:`SlotPool.first_guess_mb`) until a run of its notebook ran out of memory under it;
    else unknown.

    Only peaks of runs that shared their GPU count: alone, frameworks such as JAX and TensorFlow take most of
    a GPU's memory whether they need it or not."""

    MEASURED = "measured"
    RUNNING = "measured (running)"  # the peak so far of a run that still runs, once its memory stopped growing
    GUESS = "guess"  # never measured, of no known framework: FIRST_GUESS of the GPU's memory

    def __init__(self, records: Iterable[RunRecord] = (), first_guess_mb: float | None = None):
        self.first_guess_mb = first_guess_mb
        self._short: set[str] = set()  # notebooks (or frameworks) a run of which ran out of memory beside others
        self._by_run: dict[str, float] = {}
        self._by_notebook: dict[str, float] = {}
        self._running: dict[str, tuple[str, float]] = {}  # run id -> (notebook or framework, peak per GPU so far)
        self._lock = threading.Lock()
        for record in records:
            self.learn(record)

    def learn(self, record: RunRecord) -> None:
        """Remember what a finished run used."""
        peak = record.telemetry.get("memory_run_max_mb") if isinstance(record.telemetry, dict) else None
        if (record.status != "succeeded" or record.gpu_share is None or not record.gpu_share.shared or isinstance(peak, bool)
                or not isinstance(peak, (int, float)) or peak <= 0):
            return
        per_gpu = float(peak) / max(1, len(record.gpu_ids))
        with self._lock:
            self._by_run[record.run_id] = per_gpu
            key = record.framework or record.notebook
            self._by_notebook[key] = max(self._by_notebook.get(key, 0.0), per_gpu)

    def learn_running(self, run: Run, peak_mb: float) -> float:
        """Remember the peak so far (over its GPUs) of a run still running whose memory stopped growing, until
        :meth:`forget_running`; the other runs of its notebook reserve it until a finished run is learnt. Returns
        what the run itself reserves from now on."""
        per_gpu = float(peak_mb) / max(1, run.gpus)
        with self._lock:
            self._running[run.run_id] = (run.framework or run.notebook_rel, per_gpu)
        return round(per_gpu * HEADROOM, 1)

    def ran_short(self, run: Run) -> None:
        """A run of ``run``'s notebook ran out of GPU memory beside others: its runs get no first guess any more."""
        with self._lock:
            self._short.add(run.framework or run.notebook_rel)

    def _guess(self, run: Run) -> float | None:
        with self._lock:
            short = (run.framework or run.notebook_rel) in self._short
        return None if short or run.gpu_memory_mb else self.first_guess_mb

    def forget_running(self, run_id: str) -> None:
        """The run ended: its final peak (:meth:`learn`), if it counts, replaces what it used while running."""
        with self._lock:
            self._running.pop(run_id, None)

    def _measured(self, run: Run) -> tuple[float | None, str]:
        key = run.framework or run.notebook_rel
        with self._lock:
            measured = self._by_run.get(run.run_id) or self._by_notebook.get(key)
            if measured:
                return measured, self.MEASURED
            return max((mb for k, mb in self._running.values() if k == key), default=None), self.RUNNING

    def need_mb(self, run: Run) -> float | None:
        measured, _ = self._measured(run)
        if measured:
            return round(measured * HEADROOM, 1)
        return float(run.gpu_memory_mb) if run.gpu_memory_mb else self._guess(run)

    def source(self, run: Run) -> str:
        """Where :meth:`need_mb` comes from: ``measured``, ``measured (running)`` (a run of the same notebook that
        still runs), ``framework``, ``guess`` or ``unknown``."""
        measured, source = self._measured(run)
        if measured:
            return source
        return "framework" if run.gpu_memory_mb else self.GUESS if self._guess(run) else "unknown"


# How CUDA, cuDNN, XLA and the frameworks on them say that a GPU ran out of memory.
_OUT_OF_MEMORY = ("out of memory", "outofmemoryerror", "resource_exhausted", "oom when allocating",
                  "cuda_error_out_of_memory", "cudaerrormemoryallocation", "cudnn_status_alloc_failed")


def is_gpu_oom(error: RunError) -> bool:
    """Whether a run's error says a GPU ran out of memory."""
    text = f"{error.ename} {error.evalue}".lower()
    return any(marker in text for marker in _OUT_OF_MEMORY)
