"""Detached drivers: what ``nbbatch submit FILE --detach`` started, kept in the project's state folder.

``<state>/drivers/<name>.json`` says how the driver of experiment (or pipeline) ``name`` was started (a process of
this machine, a Slurm job, …), its pid or job id, host, log and command; it is written atomically by the submitting
process once the driver is started. ``<state>/drivers/<name>.log`` is the driver's output; its supervisor
(:mod:`nbbatch.drivers.detach`) ends it with :func:`exit_line`, so the log alone says how the driver ended.
"""

from __future__ import annotations

import json
import re
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path

from nbbatch.artifacts import write_file_atomic

DRIVERS_DIR = "drivers"  # in the project's state folder
PROCESS = "process"  # how a driver runs: a background process of ``host`` (the default of every backend)
_EXIT = re.compile(r"^nbbatch: the detached driver exited with code (-?\d+)\s*$")
_ERROR = re.compile(r"error|exception|traceback|killed", re.IGNORECASE)
LOG_TAIL_BYTES = 16384  # what is read of a log for its exit line and last error


@dataclass
class DetachedDriver:
    """How the driver of ``name`` was started; see the module's docstring."""

    name: str  # the experiment or pipeline
    backend: str  # whose :meth:`~nbbatch.backends.base.Backend.driver_state` tells how it is
    how: str  # PROCESS, or the backend's own kind ("slurm job")
    id: str  # the pid, or the job id
    log: str
    command: str  # as the user would type it
    started: str  # ISO-8601 UTC
    host: str = field(default_factory=lambda: socket.gethostname())

    def write(self, state_dir: Path) -> Path:
        """Write this record (atomically) as ``<state_dir>/drivers/<name>.json``; return its path."""
        path = driver_record_path(state_dir, self.name)
        write_file_atomic(path, json.dumps(asdict(self), indent=2).encode())
        return path

    @classmethod
    def read(cls, state_dir: Path, name: str) -> DetachedDriver | None:
        """The record of ``name``'s detached driver; None when there is none (or it cannot be read)."""
        try:
            data = json.loads(driver_record_path(state_dir, name).read_text(encoding="utf-8"))
            return cls(**{key: str(data[key]) for key in cls.__dataclass_fields__ if key in data})
        except (OSError, ValueError, TypeError):
            return None


@dataclass(frozen=True)
class DriverState:
    """How a detached driver is now. ``running`` is None when this machine cannot tell (another host's process)."""

    running: bool | None
    exit_code: int | None = None  # once ended, when known
    detail: str = ""  # the backend's word for it: "pending (Priority)", "TIMEOUT", …


def driver_record_path(state_dir: Path, name: str) -> Path:
    return state_dir / DRIVERS_DIR / f"{name}.json"


def driver_log_path(state_dir: Path, name: str) -> Path:
    return state_dir / DRIVERS_DIR / f"{name}.log"


def exit_line(code: int) -> str:
    """The last line of a detached driver's log, written by its supervisor."""
    return f"nbbatch: the detached driver exited with code {code}"


def _tail(log: str | Path) -> list[str]:
    try:
        with open(log, "rb") as handle:
            handle.seek(0, 2)
            handle.seek(max(0, handle.tell() - LOG_TAIL_BYTES))
            return handle.read().decode(errors="replace").splitlines()
    except OSError:
        return []


def logged_exit_code(log: str | Path) -> int | None:
    """The exit code the log's last line records; None while the driver runs, or when it was killed outright."""
    lines = [line for line in _tail(log) if line.strip()]
    found = _EXIT.match(lines[-1]) if lines else None
    return int(found.group(1)) if found else None


def last_error_line(log: str | Path) -> str:
    """The log's last line that names an error (else its last line), without the supervisor's exit line."""
    lines = [line.strip() for line in _tail(log) if line.strip() and not _EXIT.match(line)]
    return next((line for line in reversed(lines) if _ERROR.search(line)), lines[-1] if lines else "")
