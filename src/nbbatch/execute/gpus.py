"""GPUs of this machine (through NVML) and the slots runs are placed on.

Each GPU offers ``runs_per_gpu`` slots; a run asking for ``k`` GPUs takes one slot on each of the
``k`` least-loaded GPUs. No GPU (or no NVML) means CPU-only runs, with ``CUDA_VISIBLE_DEVICES`` empty.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuInfo:
    """One NVIDIA GPU as NVML sees it."""

    index: int
    name: str
    memory_mb: int
    uuid: str = ""


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
    """The NVIDIA GPUs NVML reports (empty without a GPU, a driver or nvidia-ml-py)."""
    try:
        import pynvml
    except ImportError:
        return []
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
                                 uuid.decode() if isinstance(uuid, bytes) else str(uuid)))
    finally:
        pynvml.nvmlShutdown()
    allowed = _visible_filter()
    return [g for g in found if allowed is None or g.index in allowed]


class SlotPool:
    """GPU slots: ``runs_per_gpu`` concurrent runs on each GPU of ``gpu_ids``."""

    def __init__(self, gpu_ids: list[int], runs_per_gpu: int = 1):
        if runs_per_gpu < 1:
            raise ValueError("runs_per_gpu must be ≥ 1")
        self.runs_per_gpu = runs_per_gpu
        self.load: dict[int, int] = {g: 0 for g in gpu_ids}
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        return len(self.load) * self.runs_per_gpu

    def acquire(self, count: int) -> list[int] | None:
        """Take a slot on ``count`` distinct GPUs (least loaded first), or None if none are free."""
        if count == 0:
            return []
        with self._lock:
            free = sorted((load, gpu) for gpu, load in self.load.items() if load < self.runs_per_gpu)
            if len(free) < count:
                return None
            chosen = sorted(gpu for _, gpu in free[:count])
            for gpu in chosen:
                self.load[gpu] += 1
            return chosen

    def release(self, gpu_ids: list[int]) -> None:
        with self._lock:
            for gpu in gpu_ids:
                self.load[gpu] -= 1

    def shared(self, gpu_ids: list[int]) -> bool:
        """Whether runs may share these GPUs (so frameworks must not grab all their memory)."""
        return self.runs_per_gpu > 1 and bool(gpu_ids)
