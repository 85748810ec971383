"""The local backend: runs in parallel on this machine, placed on GPU slots.

Each run executes in a worker thread of this process (papermill is imported once; the kernels are
separate processes). Runs start longest-first by their past durations, GPU runs get
``CUDA_VISIBLE_DEVICES`` from a :class:`~nbbatch.execute.gpus.SlotPool`, CPU runs get it empty.
Ctrl-C cancels: kernels are killed, runs are marked ``cancelled``, finished output stays.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from nbbatch.backends.base import Backend, Capabilities, Compute, Setting, SubmitOptions
from nbbatch.errors import ShareError, ValidationError
from nbbatch.execute.attempt import SHARE_FAILED, execute_run, kernel_launch
from nbbatch.execute.gpus import GpuInfo, SlotPool, detect_gpus
from nbbatch.plan.runs import Run
from nbbatch.store.lock import pid_alive
from nbbatch.store.records import CancelRequests, cancel_requests
from nbbatch.store.runrecord import ErrorKind, RunError, RunRecord, Status
from nbbatch.store.share import Share

if TYPE_CHECKING:
    from nbbatch.execute.kernels import KernelPool


logger = logging.getLogger(__name__)

PRESTART_DEFAULT = 0  # kernels started ahead of the next CPU runs (opt-in: `backend: {name: local, prestart: 2}`)


class LocalBackend(Backend):
    """Execute runs on this machine's CPUs and GPUs."""

    name: ClassVar[str] = "local"
    capabilities: ClassVar[Capabilities] = Capabilities(gpu_slots=True)
    SETTINGS: ClassVar[dict[str, Setting]] = {
        "max_parallel": Setting(None, (int,), minimum=1),
        "prestart": Setting(None, (int,), minimum=0),  # kernels started ahead of their CPU runs
    }
    settings_hint: ClassVar[str] = "use resources: for gpus, runs_per_gpu, max_parallel"

    def __init__(self, gpus: list[GpuInfo] | None = None, max_parallel: int | None = None,
                 prestart: int | None = None, **unknown: object):
        """``gpus`` replaces NVML's list (for tests); the rest are the experiment's ``backend:`` settings."""
        super().__init__(max_parallel=max_parallel, prestart=prestart, **unknown)
        self._gpus = gpus
        self.max_parallel = max_parallel
        self.prestart = prestart  # None: PRESTART_DEFAULT

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

    def start(self, runs: Sequence[Run], share: Share, options: SubmitOptions) -> None:
        """Run every run in worker threads of this process, on GPU slots; return when all are final."""
        pool = SlotPool([g.index for g in self.gpus], options.runs_per_gpu)
        cpu_parallel = options.max_parallel or self.max_parallel or (os.cpu_count() or 1)
        gpu_parallel = options.max_parallel or self.max_parallel or max(pool.capacity, 1)
        pending = list(runs)
        active: dict[str, threading.Thread] = {}
        gpu_runs: set[str] = set()  # active runs holding GPU slots
        cancel = threading.Event()
        changed = threading.Condition()
        notify = options.guarded_update  # a failing display never changes a run's record
        share_failures: list[ShareError] = []  # the share cannot be written (full): start no more runs
        from nbbatch.execute.kernels import KernelPool  # imports jupyter_client: not at module import

        kernels = KernelPool(PRESTART_DEFAULT if self.prestart is None else self.prestart)

        def end_pending(status: Status, error: RunError) -> None:
            for run in pending:
                kernels.discard(run.run_id)
                try:
                    self.finalize(share, run, status, error, notify)
                except ShareError as exc:  # not recorded: resubmitting reruns it
                    share_failures.append(exc)
            pending.clear()

        def cancel_pending(reason: str) -> None:
            end_pending(Status.CANCELLED, RunError("cancelled", "", reason=reason, kind=ErrorKind.CANCELLED))

        def worker(run: Run, gpu_ids: list[int]) -> None:
            try:
                try:
                    execute_run(run, share, gpu_ids=gpu_ids, shared_gpu=pool.shared(gpu_ids), cancel_event=cancel,
                                on_update=notify, kernels=kernels)
                except ShareError as exc:
                    share_failures.append(exc)
                    self.finalize(share, run, Status.FAILED, RunError("ShareError", str(exc), reason=SHARE_FAILED,
                                                                      kind=ErrorKind.SHARE), notify)
                except Exception as exc:  # noqa: BLE001 - a failure in one run never loses another's results
                    self.finalize(share, run, Status.FAILED, RunError(type(exc).__name__, str(exc), reason="nbbatch error",
                                                                      kind=ErrorKind.INTERNAL), notify)
            except ShareError as exc:  # not even the failure could be recorded; resubmitting reruns the run
                share_failures.append(exc)
            finally:
                pool.release(gpu_ids)
                with changed:
                    active.pop(run.run_id, None)
                    gpu_runs.discard(run.run_id)
                    changed.notify_all()

        requests = _CancelWatch(share, runs[0].experiment if runs else "")
        try:
            with changed:
                while pending or active:
                    if share_failures and pending:
                        end_pending(Status.CANCELLED, RunError("ShareError", str(share_failures[0]),
                                                               reason="not started: " + SHARE_FAILED, kind=ErrorKind.SHARE))
                        kernels.close()
                    if pending and options.halt is not None and options.halt.is_set():
                        cancel_pending("not started: another driver took the experiment over (its lease on the share)")
                    standing = requests.current()
                    if cancel.is_set() or standing.everything:
                        cancel.set()
                        cancel_pending("cancelled before it started")
                        kernels.close()
                    started = False
                    for run in list(pending):
                        if run.run_id in standing:
                            pending.remove(run)
                            kernels.discard(run.run_id)
                            try:
                                self.finalize(share, run, Status.CANCELLED, RunError(
                                    "cancelled", "", reason="cancelled before it started", kind=ErrorKind.CANCELLED),
                                    notify)
                            except ShareError as exc:
                                share_failures.append(exc)
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
        except BaseException as exc:  # Ctrl-C, SIGTERM, or a defect: no run may be left `running`
            cancel.set()
            interrupted = isinstance(exc, KeyboardInterrupt)
            cancel_pending("interrupted before it started" if interrupted else f"not started: nbbatch error: {exc}")
            for thread in list(active.values()):
                thread.join()
            raise
        finally:
            kernels.close()
        if share_failures:
            raise share_failures[0]

    def lost_runs(self, experiment: str, share: Share, records: Sequence[RunRecord]) -> dict[str, RunError]:
        """Runs left ``running`` or ``queued`` by a submitting process of this machine that is gone."""
        host = socket.gethostname()
        return {r.run_id: RunError("DriverDied", f"process {r.pid} that ran it is gone",
                                   reason="the submitting process died; resubmit to rerun", kind=ErrorKind.INFRA)
                for r in records if r.host == host and r.pid and not pid_alive(r.pid)}


def _prestart(kernels: KernelPool, pending: list[Run]) -> None:
    """Start the kernels of the next CPU runs to start (GPU runs learn their GPUs only when they start)."""
    for run in [r for r in pending if not r.gpus][:kernels.size]:
        if run.run_id not in kernels:
            try:
                kernels.prestart(run.run_id, *kernel_launch(run))
            except Exception:  # noqa: BLE001 - the run then starts its kernel itself
                return


class _CancelWatch:
    """The scheduler's view of the cancel requests: one listing per pass at most every ``poll`` seconds.

    A share error keeps the last answer and backs off (doubling, at most 30 s): a flaky share neither
    floods the service nor stops the batch; each running run's watchdog watches its own markers too.
    """

    def __init__(self, share: Share, experiment: str):
        self.share, self.experiment = share, experiment
        self.poll = 0.5 if share.local_path("") is not None else 2.0
        self.failures = 0
        self._last = CancelRequests()
        self._next = 0.0

    def current(self) -> CancelRequests:
        if not self.experiment or time.monotonic() < self._next:
            return self._last
        try:
            self._last = cancel_requests(self.share, self.experiment)
            self.failures = 0
            self._next = time.monotonic() + self.poll
        except (ShareError, OSError) as exc:
            self.failures += 1
            self._next = time.monotonic() + min(self.poll * 2 ** self.failures, 30.0)
            if self.failures == 1:
                logger.warning("cannot read the cancel requests of %s (%s); retrying", self.experiment, exc)
        return self._last

