"""``nbbatch submit FILE --detach``: the driver outlives the terminal.

The detached driver is the ordinary one: ``nbbatch submit FILE --wait`` run again, for an experiment, a search or
a pipeline alike, where the user's logout does not reach it. Where that is, is the backend's choice
(:meth:`~nbbatch.backends.base.Backend.start_driver`: a background process of this machine by default, a CPU job on
Slurm). It runs under this module's supervisor (``python -m nbbatch.drivers.detach submit FILE …``), which passes
stop signals on and ends the log with the driver's exit code. What was started is recorded in the project's state
folder (:class:`~nbbatch.store.drivers.DetachedDriver`), which ``nbbatch status NAME`` reads for its driver line.

Of the file only its top-level ``backend:`` and name (``experiment:`` or ``pipeline:``, else the file's stem) are
read here; validating the rest is the caller's (:func:`nbbatch.api.detach`).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from nbbatch.backends import Backend, backend_class
from nbbatch.backends.detached import SUPERVISOR
from nbbatch.errors import BackendError, LockedError, SpecError
from nbbatch.spec.project import Project
from nbbatch.spec.yaml_loader import load_yaml
from nbbatch.store.drivers import DetachedDriver, DriverState, driver_log_path, exit_line, last_error_line
from nbbatch.store.lock import lock_holder, locked_error

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")  # as an experiment's (experiment.schema.json)
WIDTH = 80  # the driver line of `nbbatch status` fits a terminal this wide


@dataclass(frozen=True)
class DriverFile:
    """What ``--detach`` reads of an experiment or pipeline file: its name, kind and top-level backend."""

    path: Path
    name: str
    pipeline: bool
    backend: str = "local"
    settings: dict[str, Any] = field(default_factory=dict)


def read_driver_file(path: str | os.PathLike[str]) -> DriverFile:
    """The file's name and top-level ``backend:``. A file that is not a YAML mapping is taken for an experiment,
    whose own validation then says what is wrong with it, as ``submit`` does."""
    path = Path(path)
    try:
        data = load_yaml(path.read_text(), as_written=[("backend", "env")])
    except (OSError, ValueError, yaml.YAMLError):  # missing, not UTF-8, not YAML: the experiment's loader says so
        data = None
    if not isinstance(data, Mapping):
        return DriverFile(path, path.stem, pipeline=False)
    backend = data.get("backend") or "local"
    settings = {k: v for k, v in backend.items() if k != "name"} if isinstance(backend, Mapping) else {}
    name = str(backend.get("name", "local")) if isinstance(backend, Mapping) else str(backend)
    return DriverFile(path, str(data.get("pipeline") or data.get("experiment") or path.stem), "pipeline" in data,
                      name, settings)


def driver_state(driver: DetachedDriver) -> DriverState:
    """How ``driver`` is now, as the backend that started it tells (every backend's way when it cannot load here)."""
    try:
        backend = backend_class(driver.backend)
    except BackendError:  # e.g. its extra is not installed on this machine
        backend = Backend
    return backend.driver_state(driver)


def start_detached(file: Path, name: str, backend: Backend, project: Project, submit_args: Sequence[str] = (),
                   lock: Path | None = None) -> DetachedDriver:
    """Start ``nbbatch submit FILE --wait SUBMIT_ARGS`` where ``backend`` puts drivers, and record it.

    Refused, in one line, while an earlier detached driver of ``name`` lives, or while another driver holds the
    experiment's ``lock`` (its path, when the caller knows it)."""
    if not _NAME.match(name):  # it names the driver's files; a pipeline's name is not checked before this
        raise SpecError(f"the name `{name}` of {file} must be 1-100 letters, digits, '-', '_' or '.', starting with a "
                        "letter or digit")
    earlier = DetachedDriver.read(project.state_dir, name)
    if earlier is not None and driver_state(earlier).running:
        raise LockedError(f"`{name}` already has a detached driver: {_where(earlier)}, started "
                          f"{_when(earlier.started)}. Follow it with `nbbatch status {name}`, or stop it with "
                          f"`nbbatch cancel {name}`")
    holder = lock_holder(lock) if lock is not None else None
    if holder is not None:
        raise locked_error(name, holder)
    inner = ["submit", str(file.resolve()), "--wait", "-q", *submit_args]
    driver = backend.start_driver(name, ["-m", SUPERVISOR, *inner], driver_log_path(project.state_dir, name),
                                  Path.cwd(), f"nbbatch {shlex.join(inner)}")
    driver.write(project.state_dir)
    return driver


def started_line(driver: DetachedDriver) -> str:
    """What ``submit --detach`` says once the driver is started."""
    return (f"started the driver of `{driver.name}` as {_where(driver)}; its log: {_short(driver.log)}; follow it "
            f"with `nbbatch status {driver.name}`")


def driver_line(driver: DetachedDriver, state: DriverState) -> str:
    """One line (at most :data:`WIDTH` characters, but for a long log path) on how a detached driver is."""
    log = f" (log {_short(driver.log)})"
    detail = f" {state.detail}" if state.detail else ""
    if state.running:
        doing = state.detail if state.detail.startswith("pending") else f"running{detail}"
        return f"driver: {_where(driver, host=False)} {doing} since {_when(driver.started)}{log}"
    if state.running is None:
        return f"driver: {_where(driver)}{detail}, not seen from here{log}"
    if state.exit_code is None:
        return f"driver: ended{detail or ' (killed?)'}, no exit code in its log{log}"
    if state.exit_code == 0:
        return f"driver: ended, exit 0{log}"
    head = f"driver: failed{detail}, exit {state.exit_code}"
    error = last_error_line(driver.log).removeprefix("nbbatch: error: ")
    room = WIDTH - len(head) - len(log) - 2
    if error and room > 10:
        head += ": " + (error if len(error) <= room else error[:room - 1] + "…")
    return head + log


def _where(driver: DetachedDriver, host: bool = True) -> str:
    return f"{driver.how} {driver.id}" + (f" on {driver.host}" if host else "")


def _when(started: str) -> str:
    """An ISO-8601 time as this machine's local time, short: ``14:02`` today, else ``05-01 14:02``."""
    try:
        moment = datetime.fromisoformat(started.replace("Z", "+00:00")).astimezone()
    except ValueError:
        return started
    return moment.strftime("%H:%M" if moment.date() == datetime.now().astimezone().date() else "%m-%d %H:%M")


def _short(path: str) -> str:
    """``path`` relative to the working directory when it is inside it."""
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return path


def supervise(args: Sequence[str]) -> int:
    """Run ``python -m nbbatch ARGS`` (the driver), pass SIGINT, SIGTERM and SIGHUP on to it, and end the output (the
    log) with its exit code (:func:`~nbbatch.store.drivers.exit_line`); return that code."""
    child = subprocess.Popen([sys.executable, "-m", "nbbatch", *args])

    def forward(signum: int, _frame: object) -> None:
        child.send_signal(signum)

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) is not signal.SIG_IGN:  # nohup's SIGHUP stays ignored, as the driver's
            signal.signal(signum, forward)
    code = child.wait()
    code = 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell says
    print(exit_line(code), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(supervise(sys.argv[1:]))
