"""Where a detached driver runs by default: a background process of this machine, in a session of its own.

:meth:`~nbbatch.backends.base.Backend.start_driver` and :meth:`~nbbatch.backends.base.Backend.driver_state` of every
backend that has no better place for a driver (local, Ray, Azure ML: the driver only waits on the service) use
these. The process has no terminal (its own session, stdin from /dev/null, stdout and stderr to its log), so
closing the terminal, a SIGHUP to the submitting process group or the submitting process's end change nothing.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from nbbatch.store.drivers import PROCESS, DetachedDriver, DriverState, logged_exit_code
from nbbatch.store.lock import pid_alive
from nbbatch.store.runjson import utc_now

SUPERVISOR = "nbbatch.drivers.detach"  # the module every detached driver's process runs (it records the exit code)
_STARTED: dict[int, subprocess.Popen[bytes]] = {}  # drivers this process started: reaped when asked about


def start_process(name: str, backend: str, args: Sequence[str], log: Path, cwd: Path, command: str) -> DetachedDriver:
    """Start ``python ARGS`` (this interpreter) in a session of its own, its output to ``log`` (replaced)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        child = subprocess.Popen([sys.executable, *args], cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
    _STARTED[child.pid] = child  # kept: a Popen dropped while its process runs warns, and its end must be reaped
    return DetachedDriver(name, backend, PROCESS, str(child.pid), str(log), command, utc_now())


def process_state(driver: DetachedDriver) -> DriverState:
    """How a driver started by :func:`start_process` is: running while its process lives (None on another host)."""
    if driver.host != socket.gethostname():
        return DriverState(None, detail=f"a process of {driver.host}")
    pid = int(driver.id)
    child = _STARTED.get(pid)
    if child is not None and child.poll() is not None:
        logged = logged_exit_code(driver.log)  # the driver's own; the supervisor's when it was killed itself
        return DriverState(False, logged if logged is not None else _as_shell_code(child.returncode))
    if child is not None or _is_supervisor(pid):
        return DriverState(True)
    return DriverState(False, logged_exit_code(driver.log))


def _is_supervisor(pid: int) -> bool:
    """Whether ``pid`` is a live detached driver's supervisor (not a zombie, nor another process that reuses the pid)."""
    if not pid_alive(pid):
        return False
    proc = Path(f"/proc/{pid}")
    try:
        if proc.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
        return SUPERVISOR in proc.joinpath("cmdline").read_bytes().decode(errors="replace")
    except (OSError, IndexError):  # no /proc (macOS): trust the pid
        return True


def _as_shell_code(returncode: int) -> int:
    """A process's exit status as a shell shows it: 128 + N for one killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode
