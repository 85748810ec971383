"""The local backend's scheduler: which pending run starts next, on which GPUs, and what ends the batch.

:class:`LocalScheduler` holds the batch's state (pending and active runs, the GPU slots, the runs to run
again alone, the cancel event, the share's failures) and makes each decision in a method of its own; the
runs themselves go through :meth:`LocalBackend._execute <nbbatch.backends.local.LocalBackend._execute>`
in worker threads. Everything but that call runs without kernels, so each decision can be tested alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from nbbatch.backends.base import SubmitOptions
from nbbatch.backends.local.cores import thread_environment
from nbbatch.backends.local.gpus import GpuLease, MemoryNeeds, is_gpu_oom
from nbbatch.backends.local.mps import MpsDaemon
from nbbatch.errors import ShareError
from nbbatch.execute.attempts import SHARE_FAILED, kernel_launch
from nbbatch.execute.prestart import KernelPool
from nbbatch.plan.runs import Run
from nbbatch.store.runfiles import (
    CANCEL_REQUEST,
    CancelRequests,
    StopEvent,
    StopRequest,
    cancel_request,
    cancel_requests,
    requested_outcome,
    requester,
    stop_request,
    write_record,
)
from nbbatch.store.runjson import ErrorKind, GpuSharing, RunError, RunRecord, Status
from nbbatch.store.share import Share, poll_interval

if TYPE_CHECKING:
    from nbbatch.backends.local.backend import LocalBackend
    from nbbatch.execute.telemetry import GpuSampler

logger = logging.getLogger(__name__)

PRESTART_DEFAULT = 2  # kernels started ahead of the next runs (`backend: {name: local, prestart: N}`; 0: none)
SIMULATE_NODES_ENV = "NBBATCH_SIMULATE_NODES"  # tests: every node of a distributed run on this machine
WAKE_S = 0.5  # the longest a pass waits for a run to finish before it looks at the cancel requests again
SETTLE_QUIET_S = 3.0  # a run of unknown need whose memory has not grown for this long lets other runs join it


def nodes_here(run: Run) -> int:
    """How many of the run's nodes run on this machine: one, or all of them when simulated."""
    return int(run.distribution.nodes) if run.distribution and os.environ.get(SIMULATE_NODES_ENV) else 1


def run_batch(backend: LocalBackend, runs: Sequence[Run], share: Share, options: SubmitOptions) -> None:
    """Run every run on this machine, with the batch's MPS daemon when ``resources.mps`` asks for one."""
    with contextlib.ExitStack() as stack:
        daemon = None
        if options.mps and any(r.gpus for r in runs):
            daemon = stack.enter_context(MpsDaemon([g.index for g in backend.gpus]))
        LocalScheduler(backend, runs, share, options, daemon).run()


class LocalScheduler:
    """Starts a batch's runs in worker threads as the parallel limits and the GPU slots allow; returns when all are final.

    The main thread runs :meth:`run`, one :meth:`step` per pass; worker threads run :meth:`work` and
    wake it through :attr:`changed`, the condition that guards the pending and active runs.
    """

    def __init__(self, backend: LocalBackend, runs: Sequence[Run], share: Share, options: SubmitOptions,
                 daemon: MpsDaemon | None = None):
        prestart, container = backend.settings.prestart, backend.settings.container
        self.backend, self.share, self.options, self.daemon = backend, share, options, daemon
        self.pool = backend.slot_pool(options.runs_per_gpu, mps=daemon is not None)
        self.needs = MemoryNeeds(options.earlier if self.pool.auto else (), self.pool.first_guess_mb())
        limit = backend.parallel_limit(options)
        self.cpu_parallel = limit or (os.cpu_count() or 1)
        self.gpu_parallel = limit or max(self.pool.capacity, 1)
        # Each CPU run's share of the cores: of the runs at once, a search's trials across its launches
        self.runs_at_once = options.runs_at_once or min(self.cpu_parallel, max(1, sum(map(self.pinned, runs))))
        self.pending = list(runs)
        # The CPUs a run keeps busy: a distributed CPU run, one per rank.
        self.weight = {r.run_id: r.world_size if r.distribution and not r.gpus else 1 for r in runs}
        self.active: dict[str, threading.Thread] = {}
        self.gpu_runs: set[str] = set()  # active runs holding GPU slots
        self.out_of_memory: dict[str, str] = {}  # runs to run again alone: the error that ended their shared attempt
        # Runs alone on their GPUs because their need is unknown (auto): since when, and their GPU sampler once it
        # samples; then how long they ran alone before their memory settled and other runs joined them.
        self.unmeasured: dict[str, tuple[Run, GpuLease, float]] = {}
        self.samplers: dict[str, GpuSampler] = {}
        self.opened: dict[str, float] = {}
        self.cancel = StopEvent()
        self.changed = threading.Condition()
        self.notify = options.guarded_update  # a failing display never changes a run's record
        self.share_failures: list[ShareError] = []  # the share cannot be written (full): start no more runs
        # A container starts its run's kernel itself: nothing to start ahead.
        self.kernels = KernelPool(0 if container else PRESTART_DEFAULT if prestart is None else prestart)
        self.requests = CancelWatch(share, runs[0].experiment if runs else "")

    # --- the loop (main thread) -----------------------------------------------------------------------

    def run(self) -> None:
        """Pass after pass until every run is final. Ctrl-C, SIGTERM or a defect cancels the runs not started
        and waits for the running ones (which see :attr:`cancel`), so no run is left ``running``."""
        try:
            self.warm_first_wave()
            with self.changed:
                while self.pending or self.active:
                    if not self.step() and (self.pending or self.active):  # a pass may end the last pending runs
                        self.changed.wait(timeout=WAKE_S)
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):  # Ctrl-C, or SIGTERM/SIGHUP (their names): the records say which
                self.cancel.stop(cancel_request(f"{str(exc) or 'Ctrl-C (SIGINT)'} to its driver", f", {requester()}"))
            self.stop("interrupted before it started" if isinstance(exc, KeyboardInterrupt)
                      else f"not started: nbbatch error: {exc}")
            raise
        finally:
            self.kernels.close()
        if self.share_failures:
            raise self.share_failures[0]

    def stop(self, reason: str) -> None:
        """Cancel the runs not started (saying ``reason``) and wait for the running ones, whose watchdogs kill their
        kernels and record them ``cancelled``. A second Ctrl-C does not cut this short: that would leave them
        ``running``; it takes as long as killing a kernel and writing its records."""
        self.cancel.set()
        while True:
            try:
                self.cancel_pending(reason, self.cancel.request)
                for thread in list(self.active.values()):
                    thread.join()
                return
            except KeyboardInterrupt:
                continue

    def step(self) -> bool:
        """One pass, holding :attr:`changed`: end the runs that must not start, open the GPUs of runs whose memory
        settled, start those that fit, start kernels ahead of the next ones. Whether a run started."""
        standing = self.stop_starts()
        self.open_settled()
        started = False
        for run in list(self.pending):
            if run.run_id in standing:
                self.cancel_before_start(run)
                continue
            lease = self.admit(run)
            if lease is not None:
                self.prestart_run(run, lease, now=True)  # its kernel starts while the run's records are written
                self.launch(run, lease)
                started = True
        self.prestart()
        return started

    def stop_starts(self) -> CancelRequests:
        """End the pending runs when no more may start (the share failed, the lease was lost: another driver took
        the experiment over or its folder is gone, everything is cancelled); the cancel requests standing now."""
        if self.share_failures and self.pending:
            self.end_pending(Status.CANCELLED, RunError("ShareError", str(self.share_failures[0]),
                                                        reason="not started: " + SHARE_FAILED, kind=ErrorKind.SHARE))
            self.kernels.close()
        if self.pending and self.options.halt is not None and self.options.halt.is_set():
            self.cancel_pending("not started: " + self.options.halt.reason)
        standing = self.requests.current()
        if self.cancel.is_set() or standing.everything:
            request = self.asked_to_stop()
            self.cancel.set()
            self.cancel_pending("cancelled before it started", request)
            self.kernels.close()
        return standing

    def admit(self, run: Run) -> GpuLease | None:
        """The GPUs the run starts on now (an empty lease for a CPU run), or None while the parallel limits or the
        GPU slots keep it waiting."""
        if not self.within_parallel_limit(run):
            return None
        if self.pinned(run) and self.backend.cores.take(run.run_id, self.core_count(run)) is None:
            return None  # a run that asked for more cores than are free now
        need_mb = self.needs.need_mb(run) if self.pool.auto and run.gpus else None
        return self.pool.acquire(run.gpus * nodes_here(run), need_mb,
                                 alone=run.run_id in self.out_of_memory or bool(run.distribution))

    def pinned(self, run: Run) -> bool:
        """Whether the run is given its share of the cores: a one-kernel CPU run of this machine's venvs (a
        distributed run's ranks get theirs from its placement)."""
        return not run.gpus and not run.distribution and not self.backend.settings.container

    def core_count(self, run: Run) -> int:
        return self.backend.cores.cores_per_run(run.cpus, self.runs_at_once)

    def within_parallel_limit(self, run: Run) -> bool:
        """Whether one more run of its kind (GPU or CPU) may run beside the active ones. A CPU run always may
        when no CPU run is active, even one whose ranks alone exceed the limit."""
        if run.gpus:
            return sum(1 for r in self.active if r in self.gpu_runs) < self.gpu_parallel
        running_cpu = sum(self.weight[r] for r in self.active if r not in self.gpu_runs)
        return not running_cpu or running_cpu + self.weight[run.run_id] <= self.cpu_parallel

    def launch(self, run: Run, lease: GpuLease) -> None:
        """Start the run in a worker thread of its own."""
        self.pending.remove(run)
        self.backend.claim_queued(run.run_id)  # a queued record not written yet is left to its executor
        if run.gpus:
            self.gpu_runs.add(run.run_id)
        if self.pool.auto and lease.gpu_ids and not lease.alone and not run.distribution and (
                (lease.exclusive and lease.need_mb is None) or self.needs.source(run) == MemoryNeeds.GUESS):
            self.unmeasured[run.run_id] = (run, lease, time.monotonic())
        thread = threading.Thread(target=self.work, args=(run, lease), name=f"run-{run.run_id}", daemon=True)
        self.active[run.run_id] = thread
        thread.start()

    def cancel_before_start(self, run: Run) -> None:
        """End a pending run whose cancel was requested."""
        self.pending.remove(run)
        self.kernels.discard(run.run_id)
        try:
            self.backend.finalize(self.share, run, *requested_outcome(
                self.share, run.experiment, run.run_id, "cancelled before it started"), self.notify)
        except ShareError as exc:
            self.share_failures.append(exc)

    def end_pending(self, status: Status, error: RunError) -> None:
        """End every run not started yet with ``status`` and ``error``."""
        while self.pending:  # one at a time, so that an interrupted stop (see stop) goes on where it was
            run = self.pending[-1]
            self.kernels.discard(run.run_id)
            try:
                self.backend.finalize(self.share, run, status, error, self.notify)
            except ShareError as exc:  # not recorded: resubmitting reruns it
                self.share_failures.append(exc)
            self.pending.pop()

    def cancel_pending(self, reason: str, request: StopRequest = CANCEL_REQUEST) -> None:
        """Cancel every run not started yet, saying why in its error's reason, and who asked (``request``'s sender)."""
        self.end_pending(*(request if request.status == Status.CANCELLED else CANCEL_REQUEST).outcome(reason=reason))

    def asked_to_stop(self) -> StopRequest:
        """Who asked the runs to stop: the driver's own stop (Ctrl-C), else a pending run's marker (`nbbatch cancel`)."""
        if self.cancel.is_set():
            return self.cancel.request
        for run in self.pending:
            with contextlib.suppress(ShareError, OSError):
                marked = stop_request(self.share, run.experiment, run.run_id)
                if marked is not None:
                    return marked
        return CANCEL_REQUEST

    def warm_first_wave(self) -> None:
        """Start, now, a fork server for each kernel environment of the first runs whose framework has ``preload``:
        their kernels are forked from it with the framework imported (:meth:`KernelPool.warm`)."""
        first = max(self.cpu_parallel, self.gpu_parallel)
        for run in [r for r in self.pending if r.preload and not r.distribution][:first]:
            with contextlib.suppress(Exception):  # the runs then start their kernels as usual
                kernel_name, env, _cwd = self.launch_settings(run, self.preview_lease(run))
                self.kernels.warm(kernel_name, env, run.preload, per_run=tuple(run.shared_gpu_env))

    def prestart(self) -> None:
        """Start the kernels of the next runs to start. A GPU run's kernel is started for the GPUs it will most
        likely get; if it gets others, the kernel is not used (its environment does not match) and is killed."""
        for run in self.pending[:self.kernels.size]:
            if not self.prestart_run(run, self.preview_lease(run)):
                return

    def preview_lease(self, run: Run) -> GpuLease:
        """The GPUs the run will most likely get."""
        alone = run.run_id in self.out_of_memory
        need_mb = self.needs.need_mb(run) if self.pool.auto else None
        return GpuLease(self.pool.preview(run.gpus), need_mb, exclusive=alone or (self.pool.auto and need_mb is None),
                        alone=alone)

    def launch_settings(self, run: Run, lease: GpuLease) -> tuple[str, dict[str, str], str]:
        """The kernel name, environment and working directory of the run's kernel on ``lease``."""
        shared, gpu_env, _info = self.placement(run, lease)
        return kernel_launch(run, lease.gpu_ids, shared, gpu_env=gpu_env, share=self.share)

    def prestart_run(self, run: Run, lease: GpuLease, now: bool = False) -> bool:
        """Start the run's kernel on ``lease`` unless it has one (``now``: it starts now, also with the pool full);
        False when it could not be (the next runs are not tried: the run starts its kernel itself)."""
        if run.run_id in self.kernels or run.distribution:  # a distributed run starts a kernel per rank itself
            return True
        try:
            self.kernels.prestart(run.run_id, *self.launch_settings(run, lease), preload=run.preload, now=now,
                                  per_run=tuple(run.shared_gpu_env))
        except Exception:  # noqa: BLE001 - the run then starts its kernel itself
            return False
        return True

    # --- one run (its worker thread) ------------------------------------------------------------------

    def work(self, run: Run, lease: GpuLease) -> None:
        """Execute the run, then give its GPUs back and wake the loop; a run out of GPU memory beside others
        goes back to the front of the queue."""
        again = False
        try:
            again = self.execute(run, lease)
        except ShareError as exc:  # not even the failure could be recorded; resubmitting reruns the run
            self.share_failures.append(exc)
        finally:
            with self.changed:  # not while a pass opens its GPUs to others (open_settled)
                self.pool.release(lease)
                self.backend.cores.give_back(run.run_id)
                self.requests.expire()  # a run that ended may have been cancelled: the next pass reads the requests
                self.unmeasured.pop(run.run_id, None)
                self.samplers.pop(run.run_id, None)
                self.opened.pop(run.run_id, None)
                self.needs.forget_running(run.run_id)
                self.active.pop(run.run_id, None)
                self.gpu_runs.discard(run.run_id)
                if again:
                    self.pending.insert(0, run)
                self.changed.notify_all()

    def execute(self, run: Run, lease: GpuLease) -> bool:
        """Execute the run on its lease; whether to run it again, alone. A failure of nbbatch (not of the
        notebook) fails this run only, never another's results."""
        try:
            shared, gpu_env, info = self.placement(run, lease)
            watch = {"on_sampler": lambda sampler: self.on_sampler(run.run_id, sampler)} \
                if run.run_id in self.unmeasured else {}  # only these runs' memory is watched while they run
            record = self.backend._execute(run, self.share, lease, shared, gpu_env, info, self.cancel, self.notify,
                                           self.kernels, **watch)
            return self.on_finished(run, lease, record)
        except ShareError as exc:
            self.share_failures.append(exc)
            self.backend.finalize(self.share, run, Status.FAILED, RunError(
                "ShareError", str(exc), reason=SHARE_FAILED, kind=ErrorKind.SHARE), self.notify)
        except Exception as exc:  # noqa: BLE001 - a failure in one run never loses another's results
            self.backend.finalize(self.share, run, Status.FAILED, RunError(
                type(exc).__name__, str(exc), reason="nbbatch error", kind=ErrorKind.INTERNAL), self.notify)
        return False

    def placement(self, run: Run, lease: GpuLease) -> tuple[bool, dict[str, str], GpuSharing | None]:
        """Whether the run shares its GPUs, its placement's environment (MPS; a CPU run's cores and threads), and
        what run.json says about the GPUs."""
        if not lease.gpu_ids:
            if not self.pinned(run):
                return False, {}, None
            size, cores = self.core_count(run), self.backend.cores.of(run.run_id)
            if cores is None:  # a kernel started ahead, on the cores it will likely get (pinned again if not)
                cores = self.backend.cores.preview(size)
            return False, thread_environment(size, cores, run.env), None
        shared = self.pool.shared(lease)
        info = GpuSharing(runs_per_gpu=self.options.runs_per_gpu, shared=shared, exclusive=lease.exclusive,
                          mps=self.daemon is not None)
        if self.pool.auto:
            info = replace(info, need_mb=lease.need_mb, need_from=self.needs.source(run))
        if lease.alone:
            info = replace(info, alone=True, retried_after=self.out_of_memory.get(run.run_id, ""))
        return shared, self.daemon.client_env(lease.gpu_ids) if self.daemon else {}, info

    def on_sampler(self, run_id: str, sampler: GpuSampler | None) -> None:
        """A run of unknown need started sampling its GPUs (None: stopped)."""
        with self.changed:
            if sampler is None:
                self.samplers.pop(run_id, None)
            elif run_id in self.unmeasured:
                self.samplers[run_id] = sampler

    def open_settled(self) -> None:
        """Open the GPUs of each run of unknown need whose memory stopped growing to other runs: its peak so far,
        with headroom, is reserved for it, and becomes the need of its notebook's runs until a finished run's
        replaces it. A run that ran out of memory after others joined is run again alone (:meth:`on_finished`)."""
        for run_id, sampler in list(self.samplers.items()):
            peak_mb = sampler.settled_run_memory_mb(SETTLE_QUIET_S)
            if peak_mb is None:
                continue
            run, lease, started = self.unmeasured.pop(run_id)
            del self.samplers[run_id]
            if lease.exclusive:  # held alone until now (no guess could be made)
                sampler.others_join()
                self.opened[run_id] = round(time.monotonic() - started, 1)
            self.pool.reserve(lease, self.needs.learn_running(run, peak_mb))
            logger.info("run %s: its GPU memory settled at %.0f MiB after %.1f s; other runs of its notebook reserve "
                        "that", run_id, peak_mb, time.monotonic() - started)

    def on_finished(self, run: Run, lease: GpuLease, record: RunRecord) -> bool:
        """Learn the run's memory need from its record; whether it ran out of GPU memory beside other runs, and so
        runs again, alone (its record says why, and is ``queued`` again)."""
        self.needs.learn(record)
        alone_for_s = self.opened.get(run.run_id)
        if alone_for_s is not None and record.gpu_share is not None:  # others joined it: its record says when
            record.gpu_share = replace(record.gpu_share, exclusive=False, need_mb=lease.need_mb,
                                       alone_for_s=alone_for_s)
        if record.error is None or not self.out_of_memory_while_sharing(record, lease):
            if alone_for_s is not None and record.gpu_share is not None:
                write_record(self.share, record)
                self.notify(record)
            return False
        summary = record.error.summary()
        record.gpu_share = replace(record.gpu_share or GpuSharing(), out_of_memory=summary)
        record.status = Status.QUEUED  # its next attempt says why it runs alone
        write_record(self.share, record)
        self.notify(record)
        self.out_of_memory[run.run_id] = summary
        self.needs.ran_short(run)
        return True

    def out_of_memory_while_sharing(self, record: RunRecord, lease: GpuLease) -> bool:
        """Whether the run failed for GPU memory on GPUs other runs could share (running it alone may help)."""
        return (record.status == Status.FAILED and not lease.exclusive and bool(lease.gpu_ids)
                and record.error is not None and is_gpu_oom(record.error) and self.pool.capacity > len(self.pool.load))


class CancelWatch:
    """The scheduler's view of the cancel requests: one listing per pass at most every ``poll`` seconds.

    A share error keeps the last answer and backs off (doubling, at most 30 s): a flaky share neither
    floods the service nor stops the batch; each running run's watchdog watches its own markers too.
    """

    def __init__(self, share: Share, experiment: str):
        self.share, self.experiment = share, experiment
        self.poll = poll_interval(share)
        self.failures = 0
        self._last = CancelRequests()
        self._next = 0.0

    def expire(self) -> None:
        """Read the requests again at the next :meth:`current`, however recent the last listing (a run was just
        stopped by one: its watchdog saw it before this view, and no queued run may start in between)."""
        self._next = 0.0

    def current(self) -> CancelRequests:
        """The cancel requests standing now (the last answer between two listings, or while the share fails)."""
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
