"""nbbatch.execute.telemetry.GpuSampler: silent without a GPU, samples with one (or with a stand-in NVML)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from support.nvml import FakeNvml
from support.waiting import wait_until

from nbbatch.execute import telemetry
from nbbatch.execute.telemetry import TELEMETRY_FILE, GpuSampler, read_series


def _sampler_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "nbbatch-gpu-sampler"]


def test_no_gpu_ids_samples_nothing(tmp_path: Path) -> None:
    with GpuSampler([]) as sampler:
        assert not _sampler_threads()  # nothing to wait for: without GPU ids no sampling thread starts
    summary = sampler.summary()
    assert summary["samples"] == 0 and summary["util_mean_pct"] is None
    assert summary["unavailable"] == "no GPU ids"
    written = sampler.write_series(tmp_path / TELEMETRY_FILE)
    assert written.read_bytes() == b""  # JSON Lines: no sample, no line; still written
    assert read_series(written) == []


def test_without_nvml_records_nothing_and_raises_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = FakeNvml()

    def missing() -> None:
        raise fake.NVMLError("NVML Shared Library Not Found")  # no driver installed: pynvml is, libnvidia-ml is not

    fake.nvmlInit = missing  # type: ignore[method-assign]
    monkeypatch.setattr(telemetry, "pynvml", fake)
    with GpuSampler([0, 1], interval_s=0.1) as sampler:
        assert not _sampler_threads()  # nothing to wait for: without NVML no sampling thread starts
    assert sampler.summary()["samples"] == 0
    assert "NVML unavailable" in sampler.summary()["unavailable"]
    assert not _sampler_threads()
    sampler.write_series(tmp_path / "telemetry.csv")
    assert read_series(tmp_path / "telemetry.csv") == []


def test_real_nvml_without_a_gpu_raises_nothing() -> None:
    """On this machine's real pynvml: samples when a GPU answers, otherwise says why — never raises."""
    with GpuSampler([0], interval_s=0.1) as sampler:
        wait_until(lambda: sampler.unavailable or sampler.summary()["samples"], 30, "a sample or why there is none")
    summary = sampler.summary()
    if summary["samples"] == 0:
        assert summary["unavailable"]
    assert not _sampler_threads()


def test_nvml_init_failure_is_silent(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml()

    def broken() -> None:
        raise fake.NVMLError("Driver Not Loaded")

    fake.nvmlInit = broken  # type: ignore[method-assign]
    monkeypatch.setattr(telemetry, "pynvml", fake)
    with GpuSampler([0]) as sampler:
        pass
    assert sampler.summary()["samples"] == 0 and "Driver Not Loaded" in sampler.summary()["unavailable"]


def test_samples_in_the_background_with_a_stand_in_nvml(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = FakeNvml(gpus=2)
    monkeypatch.setattr(telemetry, "pynvml", fake)
    with GpuSampler([0, 1, 7], interval_s=0.1) as sampler:  # GPU 7 does not exist: skipped
        assert fake.initialised
        wait_until(lambda: sampler.summary()["samples"] >= 3, 30, "three rounds of samples")  # + one at stop
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
        wait_until(lambda: sampler.summary()["samples"] >= 4, 30, "four rounds of samples")  # + one at stop
    summary = sampler.summary()
    print("real GPU summary:", json.dumps(summary))
    assert summary["samples"] >= 5
    assert summary["memory_max_mb"] is not None and summary["memory_max_mb"] >= 0
    assert 0 <= summary["util_max_pct"] <= 100
    assert "unavailable" not in summary
    series = read_series(sampler.write_series(tmp_path / TELEMETRY_FILE))
    assert len(series) == summary["samples"] and all(s["gpu"] == 0 for s in series)


# -- the run's own memory ------------------------------------------------------------------------

MB = 2**20


class ProcessNvml(FakeNvml):
    """A stand-in NVML that also lists GPU processes: ``compute`` and ``mps`` are ``[(pid, bytes or None)]``."""

    def __init__(self, gpus: int = 1) -> None:
        super().__init__(gpus)
        self.compute: list[tuple[int, int | None]] = []
        self.mps: list[tuple[int, int | None]] = []
        self.broken = False

    def _listing(self, entries: list[tuple[int, int | None]]) -> list[SimpleNamespace]:
        if self.broken:
            raise self.NVMLError("Not Supported")
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in entries]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[SimpleNamespace]:  # noqa: N802
        return self._listing(self.compute)

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: int) -> list[SimpleNamespace]:  # noqa: N802
        return self._listing(self.mps)


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    """A process of its own process group (as the run's kernel is)."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def _gone_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def _sampler(monkeypatch: pytest.MonkeyPatch, fake: FakeNvml, gpus: list[int], **kwargs: Any) -> GpuSampler:
    """A started sampler whose thread never samples by itself: the test calls ``_sample_once``."""
    monkeypatch.setattr(telemetry, "pynvml", fake)
    sampler = GpuSampler(gpus, interval_s=3600, **kwargs)
    sampler.start()
    return sampler


def test_run_memory_sums_the_processes_of_the_run_group(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                        child: subprocess.Popen[bytes]) -> None:
    fake = ProcessNvml(gpus=2)
    streamed: list[bytes] = []
    sampler = _sampler(monkeypatch, fake, [0, 1], sink=streamed.append)
    try:
        assert sampler.process_group is None  # the kernel is not there yet
        sampler.process_group = os.getpgid(child.pid)  # set after start, as the executor does
        fake.compute = [(child.pid, 1000 * MB), (os.getpid(), 5000 * MB), (_gone_pid(), 7000 * MB)]
        fake.mps = [(child.pid, 1000 * MB)]  # listed twice (MPS): counted once
        sampler._sample_once()
        fake.compute = [(child.pid, 1500 * MB)]
        fake.mps = []
        sampler._sample_once()
    finally:
        sampler.stop()
    summary = sampler.summary()
    # two GPUs list the same stand-in processes: the run's memory is summed over its GPUs
    assert summary["memory_run_max_mb"] == 3000.0 and summary["memory_run_source"] == "processes"
    assert [s.get("run_memory_mb") for s in sampler.samples] == [None, None, 1000.0, 1000.0, 1500.0, 1500.0,
                                                                 1500.0, 1500.0]
    assert summary["memory_max_mb"] is not None and summary["memory_now_mb"] is not None  # unchanged keys
    assert list(sampler.samples[2]) == ["t", "gpu", "util_pct", "memory_mb", "power_w", "run_memory_mb"]
    streamed_rows = read_series(b"".join(streamed))
    assert streamed_rows == sampler.samples
    csv_path = sampler.write_series(tmp_path / "telemetry.csv")
    assert csv_path.read_text().splitlines()[0] == "t,gpu,util_pct,memory_mb,power_w,run_memory_mb"
    assert read_series(csv_path) == read_series(sampler.write_series(tmp_path / TELEMETRY_FILE)) == sampler.samples


def test_unknown_memory_is_not_counted_and_no_match_falls_back(monkeypatch: pytest.MonkeyPatch,
                                                             child: subprocess.Popen[bytes]) -> None:
    fake = ProcessNvml()
    sampler = _sampler(monkeypatch, fake, [0], alone=True)  # first round: the baseline, 1024 + 256 MB
    try:
        sampler.process_group = os.getpgid(child.pid)
        fake.compute = [(child.pid, None), (os.getpid(), 900 * MB)]  # the run's value unknown; another's known
        sampler._sample_once()
        sampler._sample_once()
    finally:
        sampler.stop()
    assert all("run_memory_mb" not in s for s in sampler.samples)
    used = [s["memory_mb"] for s in sampler.samples]
    assert used == sorted(used) and len(used) == 4  # the stand-in's used memory grows each round
    summary = sampler.summary()
    assert summary["memory_run_source"] == "device"
    assert summary["memory_run_max_mb"] == used[-1] - used[0] > 0


def test_without_alone_and_without_the_run_processes_there_is_no_run_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = ProcessNvml()
    sampler = _sampler(monkeypatch, fake, [0])
    try:
        sampler.process_group = os.getpgid(os.getpid())
        sampler._sample_once()  # as in a container: NVML lists no process at all
    finally:
        sampler.stop()
    summary = sampler.summary()
    assert summary["memory_run_max_mb"] is None and summary["memory_run_source"] is None
    assert summary["memory_max_mb"] is not None


def test_device_fallback_uses_the_first_round_as_baseline_and_floors_at_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = ProcessNvml(gpus=2)
    sampler = _sampler(monkeypatch, fake, [0, 1], alone=True)
    try:
        fake.calls = -4  # the used memory drops below the baseline (of the first round): nothing of the run's
        sampler._sample_once()
    finally:
        sampler.stop()
    assert all(0 < s["memory_mb"] < 1280 for s in sampler.samples[2:])
    assert sampler.summary()["memory_run_max_mb"] == 0.0
    assert sampler.summary()["memory_run_source"] == "device"


def test_process_queries_that_raise_do_not_stop_the_sampling(monkeypatch: pytest.MonkeyPatch,
                                                             child: subprocess.Popen[bytes]) -> None:
    fake = ProcessNvml()
    fake.broken = True
    sampler = _sampler(monkeypatch, fake, [0], alone=True)
    try:
        sampler.process_group = os.getpgid(child.pid)
        fake.compute = [(child.pid, 1000 * MB)]
        sampler._sample_once()
    finally:
        sampler.stop()
    summary = sampler.summary()
    assert summary["samples"] >= 2 and all("run_memory_mb" not in s for s in sampler.samples)
    assert summary["memory_run_source"] == "device" and summary["memory_run_max_mb"] > 0
    assert not _sampler_threads()


def test_only_the_mps_query_failing_still_counts_the_compute_processes(monkeypatch: pytest.MonkeyPatch,
                                                                       child: subprocess.Popen[bytes]) -> None:
    fake = ProcessNvml()

    def unsupported(handle: int) -> list[SimpleNamespace]:
        raise fake.NVMLError("Not Supported")

    fake.nvmlDeviceGetMPSComputeRunningProcesses = unsupported  # type: ignore[method-assign]
    sampler = _sampler(monkeypatch, fake, [0])
    try:
        sampler.process_group = os.getpgid(child.pid)
        fake.compute = [(child.pid, 512 * MB)]
        sampler._sample_once()
    finally:
        sampler.stop()
    assert sampler.summary()["memory_run_max_mb"] == 512.0


def test_run_memory_in_the_background_thread(monkeypatch: pytest.MonkeyPatch, child: subprocess.Popen[bytes]) -> None:
    fake = ProcessNvml()
    fake.compute = [(child.pid, 256 * MB)]
    monkeypatch.setattr(telemetry, "pynvml", fake)
    with GpuSampler([0], interval_s=0.1) as sampler:
        sampler.process_group = os.getpgid(child.pid)
        wait_until(lambda: sampler.summary()["memory_run_max_mb"] is not None, 60, "the run's memory")  # CI is busy
    assert sampler.summary()["memory_run_max_mb"] == 256.0
    assert sampler.summary()["memory_run_source"] == "processes"
