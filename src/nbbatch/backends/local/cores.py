"""This machine's CPU cores, shared out between the CPU runs that go at once.

Each torch, TensorFlow or JAX kernel uses every core it can see; ``max_parallel`` runs at once would each start
that many threads and oversubscribe the machine. So each CPU run gets its share of the cores: pinned to a block of
its own (``NBBATCH_CPUS``: the kernel is pinned at start, and the frameworks size their thread pools to the cores
they may use) and told how many threads to start (:data:`THREAD_VARIABLES`). A run's share is
``resources.cpus`` where the experiment gives it, else the cores divided by the runs that go at once (the parallel
limit, or fewer where the batch has fewer CPU runs). Variables the user sets (in the shell or in ``env:``) are left
alone.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence

from nbbatch.execute.affinity import CPUS_VARIABLE, available_cpus, format_cpu_list

# The thread pools of OpenMP (torch, XLA's Eigen on CPU), Intel MKL and OpenBLAS (numpy, scipy): sized from these.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


class CorePool:
    """This machine's cores that CPU runs are pinned to, taken and given back as runs start and end: one pool per
    backend, so the batches of a search or of a pipeline's stages never pin two runs to one core."""

    def __init__(self, cores: Sequence[int] | None = None):
        self.cores = sorted(cores if cores is not None else available_cpus())
        self._free = list(self.cores)
        self._taken: dict[str, list[int]] = {}
        self._lock = threading.Lock()

    def cores_per_run(self, asked: int | None, runs_at_once: int) -> int:
        """How many cores a run is pinned to: ``asked`` (``resources.cpus``), else the cores divided by the runs
        that go at once; 0 (not pinned) where more runs go at once than there are cores."""
        return min(asked, len(self.cores)) if asked else len(self.cores) // max(runs_at_once, 1)

    def preview(self, size: int) -> list[int]:
        """The cores :meth:`take` would give now (a kernel started ahead is started on them)."""
        with self._lock:
            return self._free[:size]

    def take(self, key: str, size: int) -> list[int] | None:
        """``size`` cores for run ``key`` (an empty list: not pinned); None while too few are free."""
        with self._lock:
            if size > len(self._free):
                return None
            self._taken[key], self._free = self._free[:size], self._free[size:]
            return self._taken[key]

    def of(self, key: str) -> list[int] | None:
        """The cores run ``key`` holds (None: it holds none)."""
        with self._lock:
            return self._taken.get(key)

    def give_back(self, key: str) -> None:
        with self._lock:
            self._free = sorted(self._free + self._taken.pop(key, []))


def thread_environment(size: int, cores: Sequence[int], user_env: Mapping[str, str]) -> dict[str, str]:
    """The variables a CPU run's kernel of ``size`` cores starts with: as many threads (one where it is not pinned),
    pinned to ``cores`` when they are that many (a kernel started ahead while they are taken is pinned when its run
    starts). Those the user set, in ``user_env`` (the run's ``env:``) or the driver's own environment, are not given."""
    wanted = {name: str(size or 1) for name in THREAD_VARIABLES}
    if size and len(cores) == size:
        wanted[CPUS_VARIABLE] = format_cpu_list(cores)
    return {name: value for name, value in wanted.items() if name not in user_env and name not in os.environ}
