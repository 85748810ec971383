"""Which CPU cores each rank of a node runs on, and pinning a kernel to them.

On a node whose GPUs sit on different sockets (NUMA nodes), each rank runs on the cores NVML says are near its
GPU, as ``torchrun --numa-binding`` would have it: its host memory, and its copies to the GPU, stay on its socket.
Ranks whose GPUs share a socket share its cores; where every GPU is near every core nothing is pinned. A rank's
cores reach its kernel as ``NBBATCH_CPUS``, a Linux cpu-list (``"0-3,8-11"``), which
:class:`~nbbatch.execute.kernels.BatchKernelManager` applies to the kernel process once it started
(:func:`pin_process`). A value the user sets pins every kernel to those cores; an empty one pins none.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Sequence

import pynvml  # nvidia-ml-py: loads the NVML library only at nvmlInit

from nbbatch.errors import NbbatchError

CPUS_VARIABLE = "NBBATCH_CPUS"  # a rank's cores (a cpu-list); set empty in `env:` to leave ranks unpinned
CpuBlocks = tuple[frozenset[int], ...]  # each local rank's cores, by local rank; empty: pin none
_WORD_BITS = 64  # NVML's CPU masks: 64 CPUs a word
_THREAD_ROUNDS = 5  # passes over a kernel's threads until no new one appears
_CPU_LIMIT = 1 << 15  # no machine numbers its CPUs this high (Linux's NR_CPUS is at most 8192): a typo


def parse_cpu_list(text: str) -> frozenset[int]:
    """The CPUs a Linux cpu-list names (``"0-3,8,10-11"``); an :class:`NbbatchError` naming ``text`` if it is not one."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            first, dash, last = part.strip().partition("-")
            low, high = int(first), int(last) if dash else int(first)
            if low < 0 or high < low or high >= _CPU_LIMIT:
                raise ValueError(part)
            cpus.update(range(low, high + 1))
    except ValueError:
        raise NbbatchError(f"{CPUS_VARIABLE}={text!r} is not a list of CPU cores such as 0-3,8,10-11 (or empty, "
                           "to leave the kernel unpinned)") from None
    return frozenset(cpus)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """A compact Linux cpu-list of ``cpus``, runs of consecutive cores as ranges (``"0-3,8-11"``)."""
    runs: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(low) if low == high else f"{low}-{high}" for low, high in runs)


def available_cpus() -> list[int]:
    """The CPUs this process may run on, sorted (every CPU where the platform cannot say)."""
    getter = getattr(os, "sched_getaffinity", None)
    return sorted(getter(0)) if getter is not None else list(range(os.cpu_count() or 1))


def gpu_near_cpus(gpu_ids: Iterable[int]) -> dict[int, frozenset[int]] | None:
    """The CPUs NVML says are near each GPU (by NVML index); None without NVML, or where it cannot say for one."""
    words = -(-max(os.cpu_count() or 1, *(cpu + 1 for cpu in available_cpus())) // _WORD_BITS)
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded…
        return None
    try:
        near = {}
        for gpu in gpu_ids:
            mask = pynvml.nvmlDeviceGetCpuAffinity(pynvml.nvmlDeviceGetHandleByIndex(gpu), words)
            near[gpu] = frozenset(word * _WORD_BITS + bit for word, bits in enumerate(mask)
                                  for bit in range(_WORD_BITS) if int(bits) >> bit & 1)
    except Exception:  # noqa: BLE001 - NotSupported, a GPU gone: no preference
        return None
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    return near if all(near.values()) else None


def node_cpu_blocks(ranks: int, gpu_ids: Sequence[int] | None = None) -> CpuBlocks:
    """The cores each of a node's ``ranks`` local ranks is pinned to: those near its GPU (local rank ``r`` uses
    ``gpu_ids[r]``, an NVML index), shared with the ranks whose GPUs are near the same ones.

    Empty (pin nothing) unless the node's GPUs are near different cores (its sockets or NUMA nodes) and NVML
    says which: where every GPU is near every core, a fixed mask only takes cores from the scheduler (ranks
    each pinned to its own quarter of a 64-core machine's cores were 2-12 % slower, docs/benchmarks.md §17). Empty too
    for one rank per node (it drives every GPU itself) and for ranks without a GPU each.
    """
    gpus = list(gpu_ids or [])[:ranks]
    if ranks < 2 or len(gpus) < ranks:
        return ()
    near = gpu_near_cpus(sorted(set(gpus)))
    if near is None:
        return ()
    cpus = set(available_cpus())
    blocks = tuple(near[gpu] & cpus for gpu in gpus)
    if not all(blocks) or len(set(blocks)) == 1:
        return ()
    return blocks


def pin_process(pid: int, cpus: Iterable[int]) -> None:
    """Pin every thread of process ``pid`` to ``cpus``: its main thread first (threads started later inherit the mask
    of the thread that starts them), then the threads it has, until no new one appears.

    Raises OSError: the process is gone, or ``cpus`` holds none this process may use.
    """
    mask = set(cpus)
    os.sched_setaffinity(pid, mask)
    pinned = {pid}
    for _ in range(_THREAD_ROUNDS):
        threads = _threads_of(pid) - pinned
        if not threads:
            return
        for thread in threads:
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                os.sched_setaffinity(thread, mask)
        pinned |= threads


def _threads_of(pid: int) -> set[int]:
    try:
        return {int(name) for name in os.listdir(f"/proc/{pid}/task")}
    except OSError:
        return set()
