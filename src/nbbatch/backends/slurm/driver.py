"""A detached driver on Slurm (``nbbatch submit --detach``): the driver itself as a small CPU job.

The job asks for one CPU and the backend's ``memory``, in its ``partition``/``account``/``qos``; its batch script
(beside the log in the project's ``.nbbatch/drivers/``) runs the same ``python -m nbbatch submit FILE --wait`` with
nbbatch's Python (``python``, default: this one, on the shared file system), and Slurm's output file is the log.
A logout on the login node, or a laptop closing, changes nothing: the driver is a job like its runs.
"""

from __future__ import annotations

import shlex
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from nbbatch.backends.slurm.commands import Slurm, find_job
from nbbatch.backends.slurm.jobs import QUEUED_STATES, RUNNING_STATES
from nbbatch.errors import BackendError
from nbbatch.store.drivers import DetachedDriver, DriverState, logged_exit_code
from nbbatch.store.runjson import utc_now

if TYPE_CHECKING:
    from nbbatch.backends.slurm.backend import SlurmSettings

DRIVER_JOB = "slurm job"  # how a detached driver runs on Slurm (its record's ``how``)


def driver_job_name(name: str) -> str:
    """The name of the driver job of experiment or pipeline ``name`` (its runs' jobs are ``nbbatch-<name>``)."""
    return f"nbbatch-driver-{name}"


def start_driver_job(slurm: Slurm, settings: SlurmSettings, name: str, args: Sequence[str], log: Path, cwd: Path,
                     command: str, memory: str | None) -> DetachedDriver:
    """Queue the driver of ``name`` (``python ARGS``) as a one-CPU job whose output file is ``log``, with ``memory``
    (None: the cluster's default)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    script = log.with_suffix(".sh")
    lines = ["#!/bin/bash", f"# nbbatch: the detached driver of {name} (see docs/detach.md)", "set -u"]
    lines += [f"export {key}={shlex.quote(value)}" for key, value in sorted((settings.env or {}).items())]
    lines += [f"cd {shlex.quote(str(cwd))}", f"exec {shlex.join([settings.python or sys.executable, *args])}"]
    script.write_text("\n".join(lines) + "\n")
    options = [f"--job-name={driver_job_name(name)}", "--nodes=1", "--ntasks=1", "--cpus-per-task=1",
               *([f"--mem={memory.upper()}"] if memory else []), f"--output={log}", f"--chdir={cwd}"]
    options += [f"--{flag}={getattr(settings, flag)}" for flag in ("partition", "account", "qos")
                if getattr(settings, flag)]
    job_id = slurm.submit(options, str(script))
    return DetachedDriver(name, "slurm", DRIVER_JOB, job_id, str(log), command, utc_now(), socket.gethostname())


def driver_job_state(slurm: Slurm, driver: DetachedDriver) -> DriverState:
    """How the driver job is: pending (with Slurm's reason) or running, else ended with its exit code (the log's,
    else Slurm's while it remembers the job)."""
    try:
        seen = find_job(slurm.queue([driver.id]), driver.id)
        if seen is not None and seen.state in QUEUED_STATES:
            return DriverState(True, detail=f"pending ({seen.reason})" if seen.reason not in ("", "None") else "pending")
        if seen is not None and seen.state in RUNNING_STATES:
            return DriverState(True)
        logged = logged_exit_code(driver.log)
        details = slurm.job_details(driver.id) if logged is None else {}
    except BackendError as exc:  # Slurm cannot be asked from here
        return DriverState(None, detail=f"Slurm did not answer: {str(exc).splitlines()[0]}")
    state = details.get("JobState") or (seen.state if seen is not None else "")
    code = details.get("ExitCode", "").split(":")[0]
    return DriverState(False, logged if logged is not None else int(code) if code.isdigit() else None,
                       detail="" if state == "COMPLETED" else state)
