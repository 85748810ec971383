"""The local backend: runs in parallel on this machine, placed on GPU slots.

Each run executes in a worker thread of this process (papermill is imported once; the kernels are
separate processes). Runs start longest-first by their past durations, GPU runs get
``CUDA_VISIBLE_DEVICES`` from a :class:`~nbbatch.gpus.SlotPool`, CPU runs get it empty.
Ctrl-C cancels: kernels are killed, runs are marked ``cancelled``, finished output stays.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from typing import ClassVar

from ..errors import ValidationError
from ..execute import CANCEL_MARKER, execute_run, read_record, write_record
from ..gpus import GpuInfo, SlotPool, detect_gpus
from ..runrecord import RunError, RunRecord, utc_now
from ..runs import Run
from ..share import Share
from .base import Compute, SubmitOptions


class LocalBackend:
    """Execute runs on this machine's CPUs and GPUs."""

    name: ClassVar[str] = "local"

    def __init__(self, gpus: list[GpuInfo] | None = None, max_parallel: int | None = None, **_settings: object):
        self._gpus = gpus
        self.max_parallel = max_parallel

    @property
    def gpus(self) -> list[GpuInfo]:
        if self._gpus is None:
            self._gpus = detect_gpus()
        return self._gpus

    def compute(self) -> Compute:
        cpus = os.cpu_count() or 1
        return Compute(
            backend=self.name,
            gpus=[{"index": g.index, "name": g.name, "memory_mb": g.memory_mb} for g in self.gpus],
            nodes=[{"name": os.uname().nodename, "state": "idle", "cpus": cpus, "gpus": len(self.gpus)}],
            slots=max(cpus, len(self.gpus)),
        )

    def check(self, runs: Sequence[Run]) -> None:
        """Refuse runs this machine cannot place, before anything starts."""
        need = max((r.gpus for r in runs), default=0)
        if need > len(self.gpus):
            have = f"{len(self.gpus)} GPU(s)" if self.gpus else "no NVIDIA GPU (NVML found none)"
            raise ValidationError(f"runs ask for {need} GPU(s) each but this machine has {have}; "
                                  "set resources.gpus to 0 to run on the CPU, or use another backend")

    def submit(self, runs: Sequence[Run], share: Share, options: SubmitOptions) -> None:
        self.check(runs)
        pool = SlotPool([g.index for g in self.gpus], options.runs_per_gpu)
        cpu_parallel = options.max_parallel or self.max_parallel or (os.cpu_count() or 1)
        gpu_parallel = options.max_parallel or self.max_parallel or max(pool.capacity, 1)
        pending = list(runs)
        active: dict[str, threading.Thread] = {}
        gpu_runs: set[str] = set()  # active runs holding GPU slots
        cancel = threading.Event()
        changed = threading.Condition()
        notify = options.on_update or (lambda _r: None)

        def worker(run: Run, gpu_ids: list[int]) -> None:
            try:
                execute_run(run, share, gpu_ids=gpu_ids, shared_gpu=pool.shared(gpu_ids), cancel_event=cancel,
                            on_update=notify)
            except Exception as exc:  # noqa: BLE001 - a failure in one run never loses another's results
                _mark(share, run, "failed", RunError(type(exc).__name__, str(exc), reason="nbbatch error"), notify)
            finally:
                pool.release(gpu_ids)
                with changed:
                    active.pop(run.run_id, None)
                    gpu_runs.discard(run.run_id)
                    changed.notify_all()

        def experiment_cancelled() -> bool:
            return share.exists(f"{runs[0].experiment}/{CANCEL_MARKER}") if runs else False

        try:
            with changed:
                while pending or active:
                    if cancel.is_set() or experiment_cancelled():
                        cancel.set()
                        for run in pending:
                            _mark(share, run, "cancelled", RunError("cancelled", "", reason="cancelled before it started"),
                                  notify)
                        pending.clear()
                    started = False
                    for run in list(pending):
                        if share.exists(f"{run.experiment}/{run.run_id}/{CANCEL_MARKER}"):
                            pending.remove(run)
                            _mark(share, run, "cancelled", RunError("cancelled", "", reason="cancelled before it started"),
                                  notify)
                            continue
                        running_gpu = sum(1 for r in active if r in gpu_runs)
                        running_cpu = len(active) - running_gpu
                        if run.gpus and running_gpu >= gpu_parallel or not run.gpus and running_cpu >= cpu_parallel:
                            continue
                        gpu_ids = pool.acquire(run.gpus)
                        if gpu_ids is None:
                            continue
                        pending.remove(run)
                        if run.gpus:
                            gpu_runs.add(run.run_id)
                        thread = threading.Thread(target=worker, args=(run, gpu_ids), name=f"run-{run.run_id}",
                                                  daemon=True)
                        active[run.run_id] = thread
                        thread.start()
                        started = True
                    if not started:
                        changed.wait(timeout=0.5)
        except KeyboardInterrupt:
            cancel.set()
            for run in pending:
                _mark(share, run, "cancelled", RunError("cancelled", "", reason="interrupted before it started"), notify)
            for thread in list(active.values()):
                thread.join()
            raise

    def refresh(self, experiment: str, share: Share) -> None:
        """Local records are written as runs progress; a run left ``running`` by a dead driver is marked failed."""
        import socket

        host = socket.gethostname()
        for run_id in share.list(experiment):
            try:
                record = read_record(share, experiment, run_id)
            except Exception:  # noqa: BLE001 - corrupt records are reported by status, not here
                continue
            if record and record.status in ("running", "queued") and record.host == host and record.backend == "local":
                if record.pid and not _alive(record.pid):
                    record.status = "failed"
                    record.ended_at = utc_now()
                    record.error = RunError("DriverDied", f"process {record.pid} that ran it is gone",
                                            reason="the submitting process died; resubmit to rerun")
                    write_record(share, record)

    def cancel(self, experiment: str, share: Share, run_ids: Sequence[str] | None = None) -> list[str]:
        targets = list(run_ids) if run_ids else [r for r in share.list(experiment)]
        asked = []
        for run_id in targets:
            record = read_record(share, experiment, run_id)
            if record is None or record.final:
                continue
            share.write_bytes(f"{experiment}/{run_id}/{CANCEL_MARKER}", utc_now().encode())
            asked.append(run_id)
        if not run_ids:
            share.write_bytes(f"{experiment}/{CANCEL_MARKER}", utc_now().encode())
        return asked

    def stream_log(self, experiment: str, share: Share, run_id: str, follow: bool = False) -> Iterator[str] | None:
        return None



def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _mark(share: Share, run: Run, status: str, error: RunError, notify) -> RunRecord:
    from ..execute import new_record

    record = read_record(share, run.experiment, run.run_id) or new_record(run)
    record.status, record.error, record.ended_at = status, error, utc_now()
    write_record(share, record)
    notify(record)
    return record
