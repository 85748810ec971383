"""Slurm jobs and what their states mean for run records (``slurm.json`` next to each run's files)."""

from __future__ import annotations

import json
import math
import os
import signal
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from nbbatch.backends.slurm.commands import Slurm, SlurmCommandError
from nbbatch.plan.runs import Run
from nbbatch.store.layout import run_paths
from nbbatch.store.runfiles import StopRequest
from nbbatch.store.runjson import ErrorKind, RunError, Status
from nbbatch.store.share import Share

JOB_FILE = "slurm.json"  # in the run's folder: run_paths(experiment, run_id).file(JOB_FILE)
STOP_QUESTION_S = 3.0  # a launcher told to stop asks Slurm why at most this long (KillWait is 30 s by default)
STARTUP_S = 120.0  # per attempt, past the run's own timeout: the kernel's start and the notebook's writes
JOB_MARGIN_S = 300.0  # per job: the launcher's start on the node and its last writes to the share

QUEUED_STATES = ("PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING", "SUSPENDED")
RUNNING_STATES = ("RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING")
LOST_REASONS = ("JobLaunchFailure", "NodeDown", "NodeFail")  # a job that ended with these lost its node
# Why a job waits, in words (squeue's %r); the others are shown as Slurm names them.
PENDING_REASONS = {
    "Resources": "waiting for free nodes, GPUs or memory",
    "Priority": "waiting: jobs of higher priority go first",
    "JobArrayTaskLimit": "waiting: max_parallel runs are running",
    "Dependency": "waiting for another job",
    "BeginTime": "waiting for its start time",
    "ReqNodeNotAvail": "the nodes it may use are down, drained or reserved",
    "PartitionTimeLimit": "its --time is above the partition's limit: it will never start (lower timeout.run or "
                          "set time_limit)",
    "PartitionNodeLimit": "it asks for more nodes than the partition allows: it will never start",
    "QOSMaxJobsPerUserLimit": "held by the QOS's limit on jobs per user",
    "AssocGrpGRES": "held by the account's GPU limit",
    "AssocMaxJobsLimit": "held by the account's job limit",
    "launch failed requeued held": "Slurm could not start it on a node and holds it",
}


@dataclass
class SlurmJob:
    """The Slurm job (or array task) of one run, kept next to its files so any machine seeing the share finds it."""

    job_id: str  # "123_4" for a task of job array 123, "125" for a job of its own
    submission: str  # the submission's folder on the share: its batch script, runs' launches and Slurm's output files
    output: str  # Slurm's output file of this job (the launcher's own stdout and stderr), on the share
    submitted_at: str
    spec: str = ""  # the run as submitted (what a resubmission runs again), on the share
    python: str = ""  # nbbatch's Python and the project on the nodes: a resubmission from another machine keeps them
    project: str = ""
    resubmits: int = 0  # times the run was submitted again after its node or job was lost
    max_parallel: int | None = None  # its submission's limit (the array's %K): a resubmission keeps to it too

    @classmethod
    def read(cls, share: Share, experiment: str, run_id: str) -> SlurmJob | None:
        """The run's job, or None when it has none (never submitted to Slurm) or its file is unreadable."""
        path = run_paths(experiment, run_id).file(JOB_FILE)
        try:
            data = json.loads(share.read_bytes(path))
            return cls(**{k: data[k] for k in ("job_id", "submission", "output", "submitted_at", "spec", "python", "project")
                          if k in data},
                       resubmits=int(data.get("resubmits", 0)),
                       max_parallel=limit if isinstance(limit := data.get("max_parallel"), int) else None)
        except (FileNotFoundError, OSError, ValueError, TypeError, KeyError):
            return None

    def write(self, share: Share, experiment: str, run_id: str) -> None:
        share.write_bytes(run_paths(experiment, run_id).file(JOB_FILE), json.dumps(asdict(self), indent=1).encode())


def time_limit_minutes(run: Run) -> int | None:
    """The ``--time`` a run's job needs: every attempt's ``timeout.run`` and start, and the launcher's margin.

    None when the run has no timeout (the partition's default limit applies). Slurm's limit is the backstop: the
    run's own watchdog ends an attempt first and records why.
    """
    if not run.timeout_s:
        return None
    return math.ceil(((run.retries + 1) * (run.timeout_s + STARTUP_S) + JOB_MARGIN_S) / 60)


def slurm_time(minutes: int) -> str:
    """Minutes as Slurm's ``days-hours:minutes:00``."""
    days, rest = divmod(minutes, 24 * 60)
    return f"{days}-{rest // 60:02d}:{rest % 60:02d}:00"


def minutes_of(limit: str) -> int | None:
    """A Slurm time (``90``, ``1:30:00``, ``2-00:00:00``, ``infinite``) in minutes; None when unlimited or unreadable."""
    text = limit.strip().lower()
    days, _, rest = text.rpartition("-") if "-" in text else ("", "", text)
    parts = rest.split(":")
    if not days.isdigit() and days or not all(p.isdigit() for p in parts) or len(parts) > 3:
        return None
    numbers = [int(p) for p in parts]
    if days or len(parts) == 3:  # [days-]hours:minutes:seconds (days-hours and days-hours:minutes too)
        numbers += [0] * (3 - len(numbers))
        hours, minutes, seconds = numbers
    elif len(parts) == 2:  # minutes:seconds
        hours, (minutes, seconds) = 0, numbers
    else:  # minutes
        hours, minutes, seconds = 0, numbers[0], 0
    return int(days or 0) * 24 * 60 + hours * 60 + minutes + (1 if seconds else 0)


def pending_note(reason: str) -> str | None:
    """A pending job's reason (squeue's ``%r``) in words, with Slurm's own name; None while Slurm gives none (a job
    that has just been queued)."""
    words = PENDING_REASONS.get(reason)
    if reason in ("None", ""):
        return None
    return f"{words} (Slurm: {reason})" if words else f"pending in Slurm: {reason}"


def ended_job_outcome(state: str, exit_code: str, job: SlurmJob, output_tail: str) -> tuple[Status, RunError]:
    """The status of a run whose job ended without the run writing a final record, from the job's final ``state``.

    The run's own record wins whenever it is final; this is for a job that Slurm stopped (time limit, cancel,
    node failure, memory) or whose launcher died before it could write one.
    """
    said = f"; its output on the share ({job.output}) ends with: {output_tail}" if output_tail else ""
    if state == "TIMEOUT":
        return Status.TIMED_OUT, RunError(
            "SlurmTimeLimit", f"Slurm ended job {job.job_id} at its time limit{said}",
            reason="Slurm's time limit ended the job before the run's own timeout did: raise time_limit, or lower "
                   "timeout.run and retries", kind=ErrorKind.TIMEOUT)
    if state.startswith("CANCELLED"):
        return Status.CANCELLED, RunError("cancelled", f"job {job.job_id} was cancelled in Slurm{said}",
                                          reason="cancelled in Slurm (scancel)", kind=ErrorKind.CANCELLED)
    if state == "OUT_OF_MEMORY":
        return Status.FAILED, RunError(
            "SlurmOutOfMemory", f"job {job.job_id} ran out of the memory Slurm gave it{said}",
            reason="the job used more memory than it asked for: raise the backend's `memory` setting",
            kind=ErrorKind.KERNEL_DIED)
    if state in ("NODE_FAIL", "BOOT_FAIL", "PREEMPTED"):
        return Status.FAILED, lost_error(job, f"Slurm reports {state} for job {job.job_id}{said}")
    return Status.FAILED, RunError(
        "SlurmJobEnded", f"job {job.job_id} ended ({state or 'state unknown'}, exit {exit_code or '?'}) before the "
                         f"run wrote its final record{said}",
        reason="its launcher on the node stopped early (is nbbatch's Python, the project and the share reachable "
               "from the nodes?)", kind=ErrorKind.INFRA)


def lost_error(job: SlurmJob, why: str) -> RunError:
    """The error of a run whose job is gone (its node failed, or Slurm no longer knows it)."""
    return RunError("SlurmJobLost", why, reason="lost: its Slurm job is gone without an end (node failure, or the "
                                                "job was purged); resubmit to rerun", kind=ErrorKind.INFRA)


def slurm_stop_request(signum: int, environ: Mapping[str, str] | None = None) -> StopRequest | None:
    """Why Slurm stopped this node's job (the node stop hook: ``nbbatch run-one`` got ``signum``): ``scontrol show
    job`` says whether its time limit (reason ``TimeLimit``) or a ``scancel`` (``CANCELLED``, or ``COMPLETING`` with
    no reason: the state of a job being killed) did; Slurm's own words when it says neither; None outside a job."""
    environ = os.environ if environ is None else environ
    array, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    job_id = f"{array}_{task}" if array and task else environ.get("SLURM_JOB_ID")
    if not job_id:
        return None
    name = signal.Signals(signum).name
    try:
        fields = Slurm().job_details(job_id, timeout=STOP_QUESTION_S)
    except SlurmCommandError:  # no scontrol here, or slurmctld did not answer in time: the signal alone
        fields = {}
    state, why = fields.get("JobState", ""), fields.get("Reason", "")
    said = f"job {job_id}: JobState={state or '?'} Reason={why or '?'}" if fields else \
        f"job {job_id}: slurmctld did not say how it ended within {STOP_QUESTION_S:g} s"
    if state == "TIMEOUT" or why == "TimeLimit":
        return StopRequest(Status.TIMED_OUT, f"stopped by Slurm's time limit ({name}): raise time_limit, or lower "
                                             "timeout.run and retries", "SlurmTimeLimit", said)
    # scontrol names a job being killed COMPLETING, whatever ended it; a cancel leaves its reason None
    if state.startswith("CANCELLED") or state == "COMPLETING" and why in ("None", ""):
        return StopRequest(Status.CANCELLED, "cancelled in Slurm (scancel)", evalue=said)
    return StopRequest(Status.CANCELLED, f"stopped by Slurm ({name}: scancel, its time limit, or preemption)",
                       evalue=said)
