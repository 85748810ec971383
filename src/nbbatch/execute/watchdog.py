"""Watching a running kernel: the run's timeout and cancel markers, and a reaper for when the driver dies.

:class:`Watchdog` kills a run's kernel (and every process it started) when the run times out or is
cancelled; :data:`REAPER` kills the kernels of this process when this process dies, however it dies.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
from typing import Any

from nbbatch.execute.kernels import kill_kernel_group
from nbbatch.plan.runs import Run
from nbbatch.store.layout import run_paths
from nbbatch.store.runfiles import CANCEL_REQUEST, StopEvent, StopRequest, stop_request
from nbbatch.store.runjson import Status
from nbbatch.store.share import Share, poll_interval

logger = logging.getLogger(__name__)


def kernel_pid(km: Any) -> int | None:
    """The process id of a kernel manager's kernel (None before it started)."""
    provisioner = getattr(km, "provisioner", None)
    return getattr(provisioner, "pid", None) or getattr(getattr(provisioner, "process", None), "pid", None)


_REAPER_SOURCE = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
groups = set()
for line in sys.stdin:
    op, _, pgid = line.strip().partition(" ")
    if pgid.isdigit():
        (groups.add if op == "+" else groups.discard)(int(pgid))
for pgid in groups:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
"""


class KernelReaper:
    """Kills the process groups of this process's running kernels when this process dies, even by SIGKILL.

    A kernel polls its parent and exits when it is gone (``JPY_PARENT_PID``), but the processes the
    notebook started (data loaders, servers, ``subprocess``) would live on. One small helper process
    per driver holds the kernels' process groups and reads a pipe from the driver: the pipe closes
    when the driver dies however it dies, and the helper then kills the groups still registered.
    """

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._owner: int | None = None
        self._lock = threading.Lock()

    def watch(self, km: Any) -> int | None:
        pid = kernel_pid(km)
        if not pid or not hasattr(os, "killpg"):  # no process groups (Windows)
            return None
        try:
            pgid = os.getpgid(pid) if pid else None
        except OSError:
            return None
        if pgid and pgid != os.getpgid(0):  # never our own group
            self._send(f"+ {pgid}\n")
            return pgid
        return None

    def forget(self, pgid: int | None) -> None:
        if pgid:
            self._send(f"- {pgid}\n")

    def _send(self, line: str) -> None:
        if not hasattr(os, "killpg"):
            return
        with self._lock:
            if self._proc is None or self._proc.poll() is not None or self._owner != os.getpid():
                try:
                    self._proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _REAPER_SOURCE],
                                                  stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                                  stderr=subprocess.DEVNULL, start_new_session=True)
                except OSError:
                    self._proc = None
                    return
                self._owner = os.getpid()
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.write(line.encode())
                self._proc.stdin.flush()
            except OSError:
                self._proc = None

    def close(self) -> None:
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is not None and self._owner == os.getpid():
            with contextlib.suppress(Exception):
                assert proc.stdin is not None
                proc.stdin.close()
                proc.wait(timeout=2)


REAPER = KernelReaper()
atexit.register(REAPER.close)


class Watchdog:
    """Stops the kernel when the run times out or is cancelled (by event or by marker in the share).

    The deadline and the kill live in one thread that never touches the share; the markers are
    polled in another, which backs off while the share fails. A slow or failing share (an HTTP 503,
    an NFS hiccup, a request hanging in its retries) thus never delays a timeout or stops the watch.
    """

    MAX_BACKOFF_S = 30.0

    def __init__(self, run: Run, share: Share, deadline: float | None, cancel_event: threading.Event | None):
        self.run, self.share, self.deadline, self.cancel_event = run, share, deadline, cancel_event
        self.reason: Status | None = None  # TIMED_OUT, CANCELLED or PRUNED once it has stopped the kernel
        self.by_event = False  # the reason is ``cancel_event``'s: the run ends as its request says (why())
        self.request: StopRequest | None = None  # what the run's marker asked, once seen
        self.km: Any = None
        self.share_errors = 0  # failed marker checks so far (they are retried)
        self._stop = threading.Event()
        self._marker_seen = threading.Event()
        self._threads = [threading.Thread(target=self._loop, name=f"watchdog-{run.run_id}", daemon=True),
                         threading.Thread(target=self._poll_markers, name=f"cancel-poll-{run.run_id}", daemon=True)]
        self._poll = poll_interval(share, local=0.1, remote=2.0)  # a stat; a pruned run stops within ~0.1 s of its marker

    def __enter__(self) -> Watchdog:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._threads[0].join(timeout=5)  # the poller may sit in a slow share request: it is a daemon
        # A stop that came as the kernel ended still counts: the signal that stops a launcher may reach its kernel
        # too (Slurm signals every process of the job), which then dies before the next tick here.
        self._decide()

    def _decide(self) -> None:
        if self.reason is None:
            if self.deadline is not None and time.monotonic() > self.deadline:
                self.reason = Status.TIMED_OUT
            elif self._marker_seen.is_set():
                self.reason = (self.request or CANCEL_REQUEST).status
            elif self.cancel_event is not None and self.cancel_event.is_set():
                self.reason, self.by_event = Status.CANCELLED, True

    def _loop(self) -> None:
        while not self._stop.wait(0.1):
            self._decide()
            if self.reason and self.km is not None:
                try:
                    kill_kernel_group(self.km)
                except Exception:  # noqa: BLE001 - try again on the next tick; the watch must go on
                    logger.debug("killing the kernel of %s failed", self.run.run_id, exc_info=True)

    def why(self) -> StopRequest:
        """Why the run was stopped (once it was, not by its timeout): the request of the marker seen; for an
        in-process stop, a marker's request all the same when there is one (the scheduler stops its runs for it
        too), else the stop's own (its driver interrupted). Read after the kernel is killed: the share may be slow."""
        if self.request is not None:
            return self.request
        with contextlib.suppress(Exception):  # ShareError, OSError, SDK errors: the event's own reason then
            marked = stop_request(self.share, self.run.experiment, self.run.run_id)
            if marked is not None:
                return marked
        return self.cancel_event.request if isinstance(self.cancel_event, StopEvent) else CANCEL_REQUEST

    def _poll_markers(self) -> None:
        wait = self._poll
        while not self._stop.wait(wait):
            try:
                if any(self.share.exists(m) for m in self._markers):
                    self.request = stop_request(self.share, self.run.experiment, self.run.run_id) or CANCEL_REQUEST
                    self._marker_seen.set()
                    return
                wait = self._poll
            except Exception as exc:  # noqa: BLE001 - ShareError, OSError, SDK errors: retried with back-off
                self.share_errors += 1
                wait = min(self._poll * 2 ** self.share_errors, self.MAX_BACKOFF_S)
                if self.share_errors == 1:
                    logger.warning("run %s: cannot check its cancel markers (%s); retrying every %g s at most",
                                   self.run.run_id, exc, self.MAX_BACKOFF_S)

    @property
    def _markers(self) -> tuple[str, str]:
        return run_paths(self.run.experiment, self.run.run_id).cancel_markers
