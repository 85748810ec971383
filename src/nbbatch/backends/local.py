"""The local backend: runs in parallel on this machine, placed on GPU slots.

Each run executes in a worker thread of this process (papermill is imported once; the kernels are
separate processes). Runs start longest-first by their past durations, GPU runs get
``CUDA_VISIBLE_DEVICES`` from a :class:`~nbbatch.gpus.SlotPool`, CPU runs get it empty.
Ctrl-C cancels: kernels are killed, runs are marked ``cancelled``, finished output stays.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, ClassVar

from ..errors import BackendError, ShareError, ValidationError, did_you_mean
from ..execute import CANCEL_MARKER, SHARE_FAILED, execute_run, kernel_launch, read_record, write_cancel_markers, write_record
from ..gpus import GpuInfo, SlotPool, detect_gpus
from ..runrecord import RunError, RunRecord, utc_now
from ..runs import Run
from ..share import Share
from .base import Compute, SubmitOptions

if TYPE_CHECKING:
    from ..kernels import KernelPool


PRESTART_DEFAULT = 0  # kernels started ahead of the next CPU runs (opt-in: `backend: {name: local, prestart: 2}`)


class LocalBackend:
    """Execute runs on this machine's CPUs and GPUs."""

    name: ClassVar[str] = "local"

    def __init__(self, gpus: list[GpuInfo] | None = None, max_parallel: int | None = None,
                 prestart: int | None = None, **unknown: object):
        if unknown:  # named only, never echoed: a mistaken setting may hold a secret
            bad = sorted(map(str, unknown))[0]
            raise BackendError(f"unknown local backend setting `{bad}`{did_you_mean(bad, ['max_parallel', 'prestart'])}; "
                               "the local backend takes only max_parallel and prestart (use resources: for gpus, "
                               "runs_per_gpu, max_parallel)")
        if max_parallel is not None and (isinstance(max_parallel, bool) or not isinstance(max_parallel, int)
                                         or max_parallel < 1):
            raise BackendError(f"local backend setting max_parallel must be an integer ≥ 1 (got {max_parallel!r})")
        if prestart is not None and (isinstance(prestart, bool) or not isinstance(prestart, int) or prestart < 0):
            raise BackendError(f"local backend setting prestart must be an integer ≥ 0 (got {prestart!r})")
        self._gpus = gpus
        self.max_parallel = max_parallel
        self.prestart = prestart  # kernels started ahead of their CPU runs (None: PRESTART_DEFAULT)

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
        share_failures: list[ShareError] = []  # the share cannot be written (full): start no more runs
        from ..kernels import KernelPool  # imports jupyter_client: not at module import

        kernels = KernelPool(PRESTART_DEFAULT if self.prestart is None else self.prestart)

        def worker(run: Run, gpu_ids: list[int]) -> None:
            try:
                try:
                    execute_run(run, share, gpu_ids=gpu_ids, shared_gpu=pool.shared(gpu_ids), cancel_event=cancel,
                                on_update=notify, kernels=kernels)
                except ShareError as exc:
                    share_failures.append(exc)
                    _mark(share, run, "failed", RunError("ShareError", str(exc), reason=SHARE_FAILED), notify)
                except Exception as exc:  # noqa: BLE001 - a failure in one run never loses another's results
                    _mark(share, run, "failed", RunError(type(exc).__name__, str(exc), reason="nbbatch error"), notify)
            except ShareError as exc:  # not even the failure could be recorded; resubmitting reruns the run
                share_failures.append(exc)
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
                    if share_failures and pending:
                        for run in pending:
                            with contextlib.suppress(ShareError):
                                _mark(share, run, "cancelled", RunError("ShareError", str(share_failures[0]),
                                                                        reason="not started: " + SHARE_FAILED), notify)
                        pending.clear()
                        kernels.close()
                    if cancel.is_set() or experiment_cancelled():
                        cancel.set()
                        for run in pending:
                            _mark(share, run, "cancelled", RunError("cancelled", "", reason="cancelled before it started"),
                                  notify)
                        pending.clear()
                        kernels.close()
                    started = False
                    for run in list(pending):
                        if share.exists(f"{run.experiment}/{run.run_id}/{CANCEL_MARKER}"):
                            pending.remove(run)
                            kernels.discard(run.run_id)
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
                    _prestart(kernels, pending)
                    if not started:
                        changed.wait(timeout=0.5)
        except KeyboardInterrupt:
            cancel.set()
            for run in pending:
                _mark(share, run, "cancelled", RunError("cancelled", "", reason="interrupted before it started"), notify)
            for thread in list(active.values()):
                thread.join()
            raise
        finally:
            kernels.close()
        if share_failures:
            raise share_failures[0]

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
        return write_cancel_markers(share, experiment, run_ids)

    def stream_log(self, experiment: str, share: Share, run_id: str, follow: bool = False) -> Iterator[str] | None:
        return None



def _prestart(kernels: KernelPool, pending: list[Run]) -> None:
    """Start the kernels of the next CPU runs to start (GPU runs learn their GPUs only when they start)."""
    for run in [r for r in pending if not r.gpus][:kernels.size]:
        if run.run_id not in kernels:
            try:
                kernels.prestart(run.run_id, *kernel_launch(run))
            except Exception:  # noqa: BLE001 - the run then starts its kernel itself
                return


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
