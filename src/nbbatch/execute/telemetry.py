"""GPU telemetry of a run: utilisation, memory and power sampled through NVML while it executes.

The executor wraps a run in a :class:`GpuSampler` whose ``sink`` appends each round of samples to
the run's ``telemetry.jsonl`` as it is taken (so the series is on the share while the run goes)::

    with GpuSampler(record.gpu_ids, sink=append_to_telemetry_file) as sampler:
        ...  # execute the notebook; sampler.summary() is the live summary
    record.telemetry = sampler.summary()

Without a GPU, without NVML (the driver's library, read through ``pynvml``) or with no GPU ids the sampler samples
nothing and raises nothing: ``summary()`` says ``samples: 0`` and why. GPU ids are NVML indices
(the order of ``nvidia-smi``), the same numbers the local backend puts in ``CUDA_VISIBLE_DEVICES``.
Utilisation and memory are those of the whole GPU: runs that share a GPU see each other's load.
The memory of the run itself is measured too, from the GPU processes in the run's process group
(:attr:`GpuSampler.process_group`), or, for a run alone on its GPUs, from the growth of the used memory.

The series file (:data:`TELEMETRY_FILE`, ``telemetry.jsonl``) holds one sample a line,
``{"t", "gpu", "util_pct", "memory_mb", "power_w"}`` with ``t`` in seconds since the sampler started,
plus ``"run_memory_mb"`` when the run's own processes were seen on that GPU; a ``.csv`` path writes the
samples as CSV with the same columns (``run_memory_mb`` last, empty when unknown). :func:`read_series` reads either,
and the single JSON document (``{"samples": [...]}``) that nbbatch wrote before it streamed.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType
from typing import Any

import pynvml  # nvidia-ml-py: loads the NVML library only at nvmlInit

from nbbatch.store.jsonl import jsonl_line, parse_jsonl
from nbbatch.store.layout import TELEMETRY_FILE
from nbbatch.store.share import FILE_MODE, write_file_atomic

__all__ = ["TELEMETRY_FILE", "GpuSampler", "read_series"]

SERIES_FIELDS = ("t", "gpu", "util_pct", "memory_mb", "power_w")
OPTIONAL_SERIES_FIELDS = ("run_memory_mb",)  # in a sample only when known
_NOT_AVAILABLE = 2**63  # a raw NVML "not available" (2**64 - 1) from a pynvml that does not map it to None
_MIN_INTERVAL_S = 0.1
SETTLED_TOLERANCE = 0.02  # of the peak: growth this small (or ≤ SETTLED_TOLERANCE_MB) counts as not growing
SETTLED_TOLERANCE_MB = 32.0

Round = tuple[float, dict[int, float], float | None, float | None]  # t, used memory per GPU, the run's, utilisation

log = logging.getLogger(__name__)


class GpuSampler:
    """Sample the given GPUs through NVML in a background thread while the ``with`` block runs.

    ``interval_s`` is the time between samples (at least 0.1 s; the default of one sample per
    second costs nothing measurable). The sampler never raises because of NVML: a missing driver,
    a missing ``pynvml`` or a GPU that cannot be read only leaves fewer samples. ``sink``, when given,
    gets each round of samples as JSON Lines bytes as soon as they are taken; an exception it raises
    is logged and the sampling goes on.

    ``process_group``, settable at any time (the kernel starts after the sampling), is the process
    group of the run: the GPU memory of the processes in it is the run's (``run_memory_mb``). ``alone``
    says no other run uses these GPUs, so that, when no process of the run can be seen (NVML often
    lists none inside a container), the growth of the GPUs' used memory since the start is the run's.
    """

    def __init__(self, gpu_ids: Sequence[int], interval_s: float = 1.0, sink: Callable[[bytes], None] | None = None,
                 *, alone: bool = False):
        self.gpu_ids = [int(g) for g in gpu_ids]
        self.alone = alone
        self.process_group: int | None = None
        self.sink = sink
        self.interval_s = max(float(interval_s), _MIN_INTERVAL_S)
        self.samples: list[dict[str, Any]] = []
        self.started_at: str | None = None
        self.unavailable: str | None = None  # why nothing is sampled, when so
        self._nvml: Any = None
        self._handles: list[tuple[int, Any]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self._lock = threading.Lock()
        # per round: its time, the GPUs' used memory {gpu: MB}, the run's own memory over them (None: unknown) and
        # the GPUs' highest utilisation (None: unknown)
        self._rounds: list[Round] = []
        self._alone_rounds: int | None = None  # others joined the GPUs after this many rounds (see others_join)
        self._latest: list[dict[str, Any]] = []  # the rows of the last round

    # -- context manager -------------------------------------------------------------------------
    def __enter__(self) -> GpuSampler:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        """Start sampling (what ``with`` does); a second call does nothing."""
        if self._thread is not None or self.started_at is not None:
            return
        self.started_at = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
        self._t0 = time.monotonic()
        if not self.gpu_ids:
            self.unavailable = "no GPU ids"
            return
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # NVMLError (no driver, no library), anything else
            self.unavailable = f"NVML unavailable: {exc}"
            return
        self._nvml = pynvml
        for gpu in self.gpu_ids:
            try:
                self._handles.append((gpu, pynvml.nvmlDeviceGetHandleByIndex(gpu)))
            except Exception as exc:
                log.debug("GPU %s cannot be sampled: %s", gpu, exc)
        if not self._handles:
            self.unavailable = f"none of GPUs {self.gpu_ids} can be read through NVML"
            self._shutdown()
            return
        self._sample_once()
        self._thread = threading.Thread(target=self._loop, name="nbbatch-gpu-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop sampling (what leaving ``with`` does); takes one last sample; safe to call twice."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=max(5.0, 2 * self.interval_s))
            self._thread = None
            self._sample_once()
        self._shutdown()

    def _shutdown(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # pragma: no cover - defensive
                pass
            self._nvml = None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample_once()

    def _sample_once(self) -> None:
        nvml = self._nvml
        if nvml is None:
            return
        t = round(time.monotonic() - self._t0, 3)
        group = self.process_group
        taken = []
        run_total: float | None = None
        for gpu, handle in self._handles:
            row: dict[str, Any] = {"t": t, "gpu": gpu, "util_pct": None, "memory_mb": None, "power_w": None}
            try:
                row["util_pct"] = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except Exception:
                pass
            try:
                row["memory_mb"] = round(nvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20, 1)
            except Exception:
                pass
            try:
                row["power_w"] = round(nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0, 1)
            except Exception:  # some GPUs do not report power
                pass
            run_bytes = self._run_memory(handle, group) if group is not None else None
            if run_bytes is not None:
                row["run_memory_mb"] = round(run_bytes / 2**20, 1)
                run_total = (run_total or 0.0) + run_bytes / 2**20
            if all(row.get(name) is None for name in (*SERIES_FIELDS[2:], *OPTIONAL_SERIES_FIELDS)):
                continue
            taken.append(row)
        used = {r["gpu"]: r["memory_mb"] for r in taken if r["memory_mb"] is not None}
        busy = max((r["util_pct"] for r in taken if r["util_pct"] is not None), default=None)
        with self._lock:
            self.samples.extend(taken)
            if taken:  # a round is one sample, also two within the same millisecond
                self._rounds.append((t, used, None if run_total is None else round(run_total, 1), busy))
                self._latest = taken
        if taken and self.sink is not None:
            try:
                self.sink(b"".join(jsonl_line(row) for row in taken))
            except Exception as exc:  # noqa: BLE001 - the share's trouble is the run's, not the sampler's
                log.warning("GPU telemetry could not be streamed: %s", exc)

    def _run_memory(self, handle: Any, group: int) -> int | None:
        """Bytes of GPU memory the processes of ``group`` use on the GPU; ``None`` when none is seen with a known value."""
        nvml = self._nvml
        try:
            listed = list(nvml.nvmlDeviceGetComputeRunningProcesses(handle))
        except Exception:  # unknown this round, never the sampler's failure
            return None
        mps = getattr(nvml, "nvmlDeviceGetMPSComputeRunningProcesses", None)
        if mps is not None:
            try:  # under MPS the clients are listed here (the server in the list above)
                listed += mps(handle)
            except Exception:  # not supported by this GPU/driver: no MPS clients
                pass
        used: dict[int, int | None] = {}
        for process in listed:
            try:
                pid, value = int(process.pid), process.usedGpuMemory
            except Exception:  # a malformed entry is not ours
                continue
            known = value if isinstance(value, int) and 0 <= value < _NOT_AVAILABLE else None
            if used.get(pid) is None:  # a pid in both lists counts once, with a known value if either has one
                used[pid] = known
        total: int | None = None
        for pid, value in used.items():
            if value is None:
                continue  # unknown (NVML could not tell): not counted as 0
            try:
                if os.getpgid(pid) != group:
                    continue
            except OSError:  # ProcessLookupError (gone, or a pid of another namespace), PermissionError: not ours
                continue
            total = (total or 0) + value
        return total

    # -- results ---------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """What run.json's ``telemetry`` holds.

        ``{"samples", "interval_s", "gpu_ids", "util_mean_pct", "util_max_pct", "memory_max_mb",
        "power_mean_w", "util_now_pct", "memory_now_mb", "memory_run_max_mb", "memory_run_source"}``
        over all sampled GPUs (a value is ``None`` when nothing was sampled), plus ``"unavailable"``
        saying why when nothing could be sampled. ``memory_run_max_mb`` is the peak memory of the run
        itself over its GPUs, from its processes (``memory_run_source: "processes"``) or, when
        ``alone``, from the growth of the used memory since the start (``"device"``); else ``None``.
        """
        with self._lock:
            rows = list(self.samples)
            rounds = list(self._rounds)
        util = [r["util_pct"] for r in rows if r["util_pct"] is not None]
        memory = [r["memory_mb"] for r in rows if r["memory_mb"] is not None]
        power = [r["power_w"] for r in rows if r["power_w"] is not None]
        result: dict[str, Any] = {
            "samples": len(rounds),
            "interval_s": self.interval_s,
            "gpu_ids": list(self.gpu_ids),
            "util_mean_pct": round(sum(util) / len(util), 1) if util else None,
            "util_max_pct": max(util) if util else None,
            "memory_max_mb": max(memory) if memory else None,
            "power_mean_w": round(sum(power) / len(power), 1) if power else None,
        }
        with self._lock:
            latest = list(self._latest)
        util_now = [r["util_pct"] for r in latest if r["util_pct"] is not None]
        memory_now = [r["memory_mb"] for r in latest if r["memory_mb"] is not None]
        result["util_now_pct"] = round(sum(util_now) / len(util_now), 1) if util_now else None
        result["memory_now_mb"] = round(sum(memory_now), 1) if memory_now else None
        result["memory_run_max_mb"], result["memory_run_source"] = self._run_peak(rounds)
        if self.unavailable:
            result["unavailable"] = self.unavailable
        return result

    def _run_peak(self, rounds: list[Round]) -> tuple[float | None, str | None]:
        """The run's peak memory (MB) and where it comes from: ``"processes"``, ``"device"`` or ``None``."""
        series, source = self._run_series(rounds)
        if source is None:
            return None, None
        return round(max(0.0, *(mb for _, mb, _ in series)), 1), source

    def _run_series(self, rounds: list[Round]) -> tuple[list[tuple[float, float, float | None]], str | None]:
        """The run's memory in each round it is known, ``(t, MB, utilisation)``, and where it comes from."""
        from_processes = [(t, run, busy) for t, _, run, busy in rounds if run is not None]
        if from_processes:
            return from_processes, "processes"
        if self._alone_rounds is not None:
            rounds = rounds[:self._alone_rounds]  # later growth may be the other runs'
        if not self.alone or not rounds or not rounds[0][1]:
            return [], None
        baseline = rounds[0][1]  # taken at start(), before the kernel exists
        # per GPU, so that a GPU missing from a round does not count as freed memory
        return [(t, sum(used[g] - baseline[g] for g in baseline if g in used), busy)
                for t, used, _, busy in rounds], "device"

    def settled_run_memory_mb(self, quiet_s: float) -> float | None:
        """The run's peak memory so far (MB, as ``summary()``'s ``memory_run_max_mb``) once it has stopped growing:
        it grew by no more than :data:`SETTLED_TOLERANCE` (or :data:`SETTLED_TOLERANCE_MB`) over the last
        ``quiet_s`` seconds, seen in two rounds at least, while the GPU computed (utilisation above 0 in one of
        them, where NVML tells it: a run that only created its CUDA context and still loads its data has not
        settled). ``None`` otherwise: not started, nothing sampled, no memory of its own yet, still growing."""
        with self._lock:
            rounds = list(self._rounds)
        series, source = self._run_series(rounds)
        if source is None or not series:
            return None
        cutoff = series[-1][0] - quiet_s
        before = [mb for t, mb, _ in series if t <= cutoff]
        window = [(mb, busy) for t, mb, busy in series if t > cutoff]
        if not before or len(window) < 2:
            return None
        peak_before = max(before)
        peak = max(peak_before, *(mb for mb, _ in window))
        known = [busy for _, busy in window if busy is not None]
        if peak <= 0 or peak - peak_before > max(SETTLED_TOLERANCE_MB, SETTLED_TOLERANCE * peak) \
                or (known and not any(busy > 0 for busy in known)):
            return None
        return round(peak, 1)

    def others_join(self) -> None:
        """Other runs may use these GPUs from now on: the growth of their used memory is no longer the run's, so a
        run ``alone`` keeps the peak it reached until now (its own processes' memory, when seen, still counts)."""
        with self._lock:
            self._alone_rounds = len(self._rounds)

    def series_jsonl(self) -> bytes:
        """The whole series as JSON Lines (what the run's ``telemetry.jsonl`` holds at the end)."""
        with self._lock:
            rows = [dict(r) for r in self.samples]
        return b"".join(jsonl_line(row) for row in rows)

    def write_series(self, path: str | os.PathLike[str]) -> Path:
        """Write the series to a local ``path``: JSON Lines, or CSV when the name ends in ``.csv``.

        Also written when empty (so a reader can tell "sampled nothing" from "not sampled").
        """
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.suffix.lower() == ".csv":
            buffer = io.StringIO()
            writer = csv.DictWriter(buffer, fieldnames=(*SERIES_FIELDS, *OPTIONAL_SERIES_FIELDS), lineterminator="\n")
            writer.writeheader()
            with self._lock:
                writer.writerows(self.samples)
            data = buffer.getvalue().encode()
        else:
            data = self.series_jsonl()
        write_file_atomic(target, data, FILE_MODE)
        return target


def read_series(data: bytes | str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The samples of a series file (JSON Lines, CSV, or the older single JSON document), from its path or its bytes.

    Each sample is ``{"t", "gpu", "util_pct", "memory_mb", "power_w"}`` with numbers (or ``None``),
    plus ``run_memory_mb`` where it is known.
    """
    if isinstance(data, bytes):
        text = data.decode()
    else:
        text = Path(data).read_text()
    stripped = text.lstrip()
    if stripped.startswith("{") or stripped.startswith("["):
        try:
            doc = json.loads(text)
        except ValueError:  # JSON Lines
            return parse_jsonl(text)
        rows = doc.get("samples", [doc]) if isinstance(doc, dict) else doc  # a one-line JSON Lines file is a sample
        return [dict(r) for r in rows if isinstance(r, dict)]
    samples = []
    for row in csv.DictReader(io.StringIO(text)):
        sample: dict[str, Any] = {}
        for name in SERIES_FIELDS:
            value = row.get(name)
            if value in (None, ""):
                sample[name] = None
            else:
                sample[name] = int(value) if name == "gpu" else float(value)
        for name in OPTIONAL_SERIES_FIELDS:  # as in JSON Lines: present only when known
            if row.get(name) not in (None, ""):
                sample[name] = float(row[name])
        samples.append(sample)
    return samples
