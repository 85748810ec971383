"""GPU telemetry of a run: utilisation, memory and power sampled through NVML while it executes.

The executor wraps a run in a :class:`GpuSampler` whose ``sink`` appends each round of samples to
the run's ``telemetry.jsonl`` as it is taken (so the series is on the share while the run goes)::

    with GpuSampler(record.gpu_ids, sink=append_to_telemetry_file) as sampler:
        ...  # execute the notebook; sampler.summary() is the live summary
    record.telemetry = sampler.summary()

Without a GPU, without NVML (``pynvml`` from nvidia-ml-py) or with no GPU ids the sampler samples
nothing and raises nothing: ``summary()`` says ``samples: 0`` and why. GPU ids are NVML indices
(the order of ``nvidia-smi``), the same numbers the local backend puts in ``CUDA_VISIBLE_DEVICES``.
Utilisation and memory are those of the whole GPU: runs that share a GPU see each other's load.

The series file (:data:`TELEMETRY_FILE`, ``telemetry.jsonl``) holds one sample a line,
``{"t", "gpu", "util_pct", "memory_mb", "power_w"}`` with ``t`` in seconds since the sampler started;
a ``.csv`` path writes the samples as CSV with the same columns. :func:`read_series` reads either,
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

from nbbatch.store.jsonl import jsonl_line, parse_jsonl
from nbbatch.store.layout import TELEMETRY_FILE

__all__ = ["TELEMETRY_FILE", "GpuSampler", "read_series"]

SERIES_FIELDS = ("t", "gpu", "util_pct", "memory_mb", "power_w")
_MIN_INTERVAL_S = 0.1

log = logging.getLogger(__name__)


class GpuSampler:
    """Sample the given GPUs through NVML in a background thread while the ``with`` block runs.

    ``interval_s`` is the time between samples (at least 0.1 s; the default of one sample per
    second costs nothing measurable). The sampler never raises because of NVML: a missing driver,
    a missing ``pynvml`` or a GPU that cannot be read only leaves fewer samples. ``sink``, when given,
    gets each round of samples as JSON Lines bytes as soon as they are taken; an exception it raises
    is logged and the sampling goes on.
    """

    def __init__(self, gpu_ids: Sequence[int], interval_s: float = 1.0, sink: Callable[[bytes], None] | None = None):
        self.gpu_ids = [int(g) for g in gpu_ids]
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
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
        except Exception as exc:  # ImportError, NVMLError (no driver/library), anything else
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
        taken = []
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
            if row["util_pct"] is None and row["memory_mb"] is None and row["power_w"] is None:
                continue
            taken.append(row)
        with self._lock:
            self.samples.extend(taken)
        if taken and self.sink is not None:
            try:
                self.sink(b"".join(jsonl_line(row) for row in taken))
            except Exception as exc:  # noqa: BLE001 - the share's trouble is the run's, not the sampler's
                log.warning("GPU telemetry could not be streamed: %s", exc)

    # -- results ---------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """What run.json's ``telemetry`` holds.

        ``{"samples", "interval_s", "gpu_ids", "util_mean_pct", "util_max_pct", "memory_max_mb",
        "power_mean_w"}`` over all sampled GPUs (a value is ``None`` when nothing was sampled),
        plus ``"unavailable"`` saying why when nothing could be sampled.
        """
        with self._lock:
            rows = list(self.samples)
        util = [r["util_pct"] for r in rows if r["util_pct"] is not None]
        memory = [r["memory_mb"] for r in rows if r["memory_mb"] is not None]
        power = [r["power_w"] for r in rows if r["power_w"] is not None]
        result: dict[str, Any] = {
            "samples": len({r["t"] for r in rows}),
            "interval_s": self.interval_s,
            "gpu_ids": list(self.gpu_ids),
            "util_mean_pct": round(sum(util) / len(util), 1) if util else None,
            "util_max_pct": max(util) if util else None,
            "memory_max_mb": max(memory) if memory else None,
            "power_mean_w": round(sum(power) / len(power), 1) if power else None,
        }
        latest = [r for r in rows if rows and r["t"] == rows[-1]["t"]]
        util_now = [r["util_pct"] for r in latest if r["util_pct"] is not None]
        memory_now = [r["memory_mb"] for r in latest if r["memory_mb"] is not None]
        result["util_now_pct"] = round(sum(util_now) / len(util_now), 1) if util_now else None
        result["memory_now_mb"] = round(sum(memory_now), 1) if memory_now else None
        if self.unavailable:
            result["unavailable"] = self.unavailable
        return result

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
            writer = csv.DictWriter(buffer, fieldnames=SERIES_FIELDS, lineterminator="\n")
            writer.writeheader()
            with self._lock:
                writer.writerows(self.samples)
            data = buffer.getvalue().encode()
        else:
            data = self.series_jsonl()
        tmp = target.with_name(f".{target.name}.part")
        tmp.write_bytes(data)
        os.replace(tmp, target)
        return target


def read_series(data: bytes | str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The samples of a series file (JSON Lines, CSV, or the older single JSON document), from its path or its bytes.

    Each sample is ``{"t", "gpu", "util_pct", "memory_mb", "power_w"}`` with numbers (or ``None``).
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
        samples.append(sample)
    return samples
