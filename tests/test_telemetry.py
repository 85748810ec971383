"""nbbatch.execute.telemetry.GpuSampler: silent without a GPU, samples with one (or with a stand-in NVML)."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from helpers_notebooks import FakeNvml  # noqa: E402

from nbbatch.execute.telemetry import TELEMETRY_FILE, GpuSampler, read_series  # noqa: E402


def _sampler_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "nbbatch-gpu-sampler"]


def test_no_gpu_ids_samples_nothing(tmp_path: Path) -> None:
    with GpuSampler([]) as sampler:
        time.sleep(0.05)
    summary = sampler.summary()
    assert summary["samples"] == 0 and summary["util_mean_pct"] is None
    assert summary["unavailable"] == "no GPU ids"
    written = sampler.write_series(tmp_path / TELEMETRY_FILE)
    assert written.read_bytes() == b""  # JSON Lines: no sample, no line; still written
    assert read_series(written) == []


def test_without_nvml_records_nothing_and_raises_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    with GpuSampler([0, 1], interval_s=0.1) as sampler:
        time.sleep(0.2)
    assert sampler.summary()["samples"] == 0
    assert "NVML unavailable" in sampler.summary()["unavailable"]
    assert not _sampler_threads()
    sampler.write_series(tmp_path / "telemetry.csv")
    assert read_series(tmp_path / "telemetry.csv") == []


def test_real_nvml_without_a_gpu_raises_nothing() -> None:
    """On this machine's real pynvml: samples when a GPU answers, otherwise says why — never raises."""
    with GpuSampler([0], interval_s=0.1) as sampler:
        time.sleep(0.25)
    summary = sampler.summary()
    if summary["samples"] == 0:
        assert summary["unavailable"]
    assert not _sampler_threads()


def test_nvml_init_failure_is_silent(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml()

    def broken() -> None:
        raise fake.NVMLError("Driver Not Loaded")

    fake.nvmlInit = broken  # type: ignore[method-assign]
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    with GpuSampler([0]) as sampler:
        pass
    assert sampler.summary()["samples"] == 0 and "Driver Not Loaded" in sampler.summary()["unavailable"]


def test_samples_in_the_background_with_a_stand_in_nvml(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = FakeNvml(gpus=2)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    with GpuSampler([0, 1, 7], interval_s=0.1) as sampler:  # GPU 7 does not exist: skipped
        assert fake.initialised
        time.sleep(0.45)
    assert not fake.initialised and not _sampler_threads()
    summary = sampler.summary()
    assert summary["samples"] >= 4  # one at start, ~4 in the loop, one at stop
    assert summary["gpu_ids"] == [0, 1, 7]
    assert 0 < summary["util_mean_pct"] <= summary["util_max_pct"] <= 100
    assert summary["memory_max_mb"] > 1024 and summary["power_mean_w"] > 70
    assert {s["gpu"] for s in sampler.samples} == {0, 1}
    json_path = sampler.write_series(tmp_path / TELEMETRY_FILE)
    csv_path = sampler.write_series(tmp_path / "telemetry.csv")
    assert read_series(json_path) == read_series(csv_path) == sampler.samples
    assert read_series(json_path.read_bytes()) == sampler.samples
    times = [s["t"] for s in sampler.samples]
    assert times == sorted(times)


def test_interval_has_a_floor() -> None:
    assert GpuSampler([0], interval_s=0).interval_s == 0.1


@pytest.mark.gpu
def test_samples_a_real_gpu(tmp_path: Path) -> None:
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
    except Exception as exc:  # no driver / no GPU
        pytest.skip(f"no NVML: {exc}")
    if count == 0:
        pytest.skip("NVML sees no GPU")
    with GpuSampler([0], interval_s=0.2) as sampler:
        time.sleep(1.1)
    summary = sampler.summary()
    print("real GPU summary:", json.dumps(summary))
    assert summary["samples"] >= 5
    assert summary["memory_max_mb"] is not None and summary["memory_max_mb"] >= 0
    assert 0 <= summary["util_max_pct"] <= 100
    assert "unavailable" not in summary
    series = read_series(sampler.write_series(tmp_path / TELEMETRY_FILE))
    assert len(series) == summary["samples"] and all(s["gpu"] == 0 for s in series)
