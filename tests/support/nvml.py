"""A stand-in for ``pynvml`` on machines without a GPU."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


class FakeNvml:
    """Stands in for ``pynvml`` on machines without a GPU: a GPU whose load ramps up, then down."""

    class NVMLError(Exception):
        pass

    def __init__(self, gpus: int = 2):
        self.gpus = gpus
        self.calls = 0
        self.initialised = False

    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's names
        self.initialised = True

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.initialised = False

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:  # noqa: N802
        if index >= self.gpus:
            raise self.NVMLError("Invalid Argument")
        return index

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:  # noqa: N802
        self.calls += 1
        return SimpleNamespace(gpu=min(100, 10 * self.calls + 5 * handle), memory=20)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:  # noqa: N802
        return SimpleNamespace(used=(1024 + 256 * self.calls) * 2**20, total=16384 * 2**20, free=0)

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:  # noqa: N802
        return 70_000 + 1_000 * self.calls
