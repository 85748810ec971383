"""One driver per experiment: an advisory file lock that names its holder.

``fcntl.flock`` is released by the kernel when the holder dies, so a lock left by a killed
process is free again; its holder file is then reported as stale and replaced.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

from nbbatch.errors import LockedError, ShareError
from nbbatch.store.share import file_in_the_way

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]


class ExperimentLock:
    """Held while a process drives an experiment; ``with ExperimentLock(path, experiment):``."""

    def __init__(self, path: Path, experiment: str):
        self.path = path
        self.experiment = experiment
        self._fd: int | None = None
        self.recovered_from: dict | None = None  # the stale holder, when one was found
        self.command = _command()  # what holds it, as the user typed it

    def __enter__(self) -> ExperimentLock:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            blocking = file_in_the_way(self.path.parent)
            if blocking is not None:  # say so, rather than blame the lock file inside it
                raise ShareError(f"{blocking} is a file, where experiment `{self.experiment}` keeps its folder of "
                                 "results; move or rename that file, or give the experiment another name") from exc
            raise ShareError(f"cannot create the lock file {self.path} of experiment `{self.experiment}`: "
                             f"{exc.strerror or exc}") from exc
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise locked_error(self.experiment, holder) from None
        previous = _read_holder(fd)
        if previous:
            self.recovered_from = previous
        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": self.command}
        try:  # naming the holder is best effort (a full disk must not stop the lock, which is the flock)
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(holder).encode(), 0)
        except OSError:
            pass
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, 0)
            except OSError:
                pass
            os.close(self._fd)
            self._fd = None


def locked_error(experiment: str, holder: dict) -> LockedError:
    """What a second driver of ``experiment`` is told while ``holder`` (the lock's holder file) drives it."""
    who = (f"process {holder.get('pid')} on {holder.get('host')} (since {holder.get('since')}, "
           f"command: {holder.get('command')})") if holder else "another process"
    return LockedError(f"experiment `{experiment}` is already being run by {who}. Wait for it, follow it "
                       f"with `nbbatch status {experiment}`, or stop it with `nbbatch cancel {experiment}`.")


def lock_holder(path: Path) -> dict | None:
    """Who holds the lock at ``path`` now (its holder file; {} when it names none), or None when it is free. Only
    looks: the lock is never taken, and a stale holder file stays for the next driver to report."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # no lock file: never locked
        return None
    try:
        if fcntl is None:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a driver's LOCK_EX refuses it
        except BlockingIOError:
            return _read_holder(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _read_holder(fd: int) -> dict:
    try:
        data = os.pread(fd, 4096, 0)
        return json.loads(data) if data.strip() else {}
    except (OSError, ValueError):
        return {}


def _command() -> str:
    argv = list(sys.argv) or ["python"]
    if os.path.basename(argv[0]) == "__main__.py":  # python -m nbbatch
        argv[0] = f"python -m {os.path.basename(os.path.dirname(argv[0]))}"
    else:
        argv[0] = os.path.basename(argv[0])
    return " ".join(argv)[:200]


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this machine still exists (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
