"""A node launcher told to stop from outside: SIGTERM, SIGINT or SIGHUP to ``nbbatch run-one``.

Every cluster stops a run's launcher with a signal: Slurm's ``scancel`` and time limit (SIGTERM to every process of
the job, the kernel too, then SIGKILL after ``KillWait``), a Ray task's worker ending, a container's or a Kubernetes
pod's stop, an Azure ML cancel. Such a signal stops the run the way a cancel marker does (:class:`SignalStop` is the
attempt's stop event): the watchdog kills the kernel, and the notebook as far as it ran, the stopped cell marked,
and the final record are written, within the cluster's grace. Why it was stopped is the backend's to say (its node
stop hook, asked once after the kernel is killed: Slurm's says scancel or time limit), else the signal's name.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

from nbbatch.store.runfiles import StopEvent, StopRequest, cancel_request

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, name))
StopExplainer = Callable[[int], "StopRequest | None"]  # a backend's node stop hook: why signal N came, or None


class SignalStop(StopEvent):
    """The stop event of a run whose launcher got a stop signal; :attr:`request` asks ``explain`` once, when read."""

    def __init__(self, explain: StopExplainer | None = None) -> None:
        super().__init__()
        self._explain = explain
        self._signum: int | None = None
        self._request: StopRequest | None = None
        self._lock = threading.Lock()

    def stop_for_signal(self, signum: int) -> None:
        """Stop for signal ``signum`` (the first stop is kept). Safe in a signal handler: it only sets the event."""
        if not self.is_set():
            self._signum = signum
        self.set()

    @property  # type: ignore[override]
    def request(self) -> StopRequest:
        with self._lock:
            if self._request is None and self._signum is not None:
                explained = None
                if self._explain is not None:
                    with contextlib.suppress(Exception):  # a hook that fails leaves the signal's own words
                        explained = self._explain(self._signum)
                self._request = explained or signal_request(self._signum)
            return self._request or super().request

    @request.setter
    def request(self, request: StopRequest) -> None:
        self._request = request


def signal_request(signum: int) -> StopRequest:
    """A stop for signal ``signum`` whose sender nbbatch cannot name: the signal, where and when it came."""
    return cancel_request(f"{signal.Signals(signum).name} to its launcher", f" on {socket.gethostname()} "
                          f"(pid {os.getpid()})")


@contextlib.contextmanager
def stopped_by_signals(event: SignalStop) -> Iterator[None]:
    """While inside: every stop signal stops ``event`` (later ones change nothing, so nothing cuts the save short;
    the cluster's SIGKILL ends it all the same). Outside the main thread, or for a signal ignored when nbbatch
    started (``nohup``), nothing changes."""
    with handling_stop_signals(lambda signum, frame: event.stop_for_signal(signum)):
        yield


@contextlib.contextmanager
def handling_stop_signals(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """While inside: ``handler`` is called for SIGTERM, SIGINT and SIGHUP, in the main thread only, and not for a
    signal ignored when nbbatch started (``nohup``); the handlers before are put back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {number: signal.signal(number, handler) for number in STOP_SIGNALS
                if signal.getsignal(number) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for number, old in previous.items():
            signal.signal(number, old)
