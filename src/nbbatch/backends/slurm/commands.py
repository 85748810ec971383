"""Slurm's own commands (``sbatch``, ``squeue``, ``sacct``, ``scancel``, ``sinfo``, ``scontrol``), run and read.

nbbatch talks to Slurm only through its command-line tools, as a user at a login node does: no REST daemon, no
accounting database, no Python binding is needed. A refusal is raised with Slurm's own words, whole.
"""

from __future__ import annotations

import getpass
import os
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from nbbatch.errors import BackendError

UNKNOWN_JOB = "Invalid job id"  # what squeue and scontrol say of a job slurmctld does not know (any more)
COMMAND_TIMEOUT_S = 60.0  # slurmctld answers in well under a second; a minute means it is down or overloaded
TOOLS = ("sbatch", "squeue", "scancel", "sinfo")  # what the backend cannot work without
# squeue's columns: job id, array job id and task id (an array task is named by them: its %i may be the array's own
# id, as for the last task, or one cancelled while pending), state, reason, nodes
QUEUE_FORMAT = "%i|%F|%K|%T|%r|%N"
COMPLETION_LOG_TAIL = 64 * 1024 * 1024  # bytes of the job-completion log read: a run's job ended after it was queued


# What Slurm's client tools print when this machine cannot reach a cluster at all, and what to do about it.
_HINTS = (
    ("Could not establish a configuration source",
     "this machine has no Slurm configuration: set SLURM_CONF to the cluster's slurm.conf, or submit from one of its "
     "login nodes"),
    ("Unable to process configuration file",
     "Slurm cannot read its configuration: check the file SLURM_CONF names (or /etc/slurm/slurm.conf)"),
    ("Unable to contact slurm controller",
     "slurmctld does not answer: check `scontrol ping` and the controller's address in slurm.conf (SLURM_CONF)"),
    ("Munge encode failed",
     "munged is not running on this machine (or its key differs from the cluster's): start munged"),
)


def _hint(said: str) -> str:
    return next((f"\n(that means {what})" for sign, what in _HINTS if sign in said), "")


class SlurmCommandError(BackendError):
    """A Slurm command failed; its text holds the command and what Slurm printed, whole."""

    def __init__(self, message: str, stderr: str = "", returncode: int | None = None) -> None:
        super().__init__(message)
        self.stderr, self.returncode = stderr, returncode


def failed(args: Sequence[str], done: subprocess.CompletedProcess[str]) -> SlurmCommandError:
    """The error of a Slurm command that exited non-zero: the command and what Slurm printed (slurmctld down:
    "Unable to contact slurm controller (connect failure)")."""
    said = done.stderr.strip() or done.stdout.strip() or "(nothing printed)"
    return SlurmCommandError(f"`{' '.join(args[:2])}` failed (exit {done.returncode}): {said}{_hint(said)}",
                             stderr=said, returncode=done.returncode)


@dataclass(frozen=True)
class QueuedJob:
    """One line of ``squeue``: a job, or one task of a job array (``123_4``)."""

    job_id: str  # as Slurm prints it: "123", "123_4" (an array task), "123_[5-9%2]" (array tasks not started yet)
    state: str  # PENDING, RUNNING, COMPLETING, …
    reason: str  # why it is pending (Resources, Priority, QOSMaxJobsPerUserLimit, …), "None" when it runs
    nodes: str = ""


@dataclass(frozen=True)
class Partition:
    """One partition, as ``sinfo`` reports it."""

    name: str
    default: bool
    available: bool
    time_limit: str
    nodes: int
    gres: str


class Slurm:
    """The Slurm commands of this machine, run with ``env`` on top of this process's environment.

    ``env`` is where a test (or a user with several clusters) names another ``SLURM_CONF``.
    """

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self.env = {**os.environ, **(env or {})}

    def missing_tools(self) -> list[str]:
        """The Slurm client tools this machine lacks."""
        return [tool for tool in TOOLS if shutil.which(tool, path=self.env.get("PATH")) is None]

    def run(self, *args: str, stdin: str | None = None, check: bool = True,
            timeout: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        """Run one Slurm command; a :class:`SlurmCommandError` quotes it and Slurm's answer when it fails."""
        try:
            done = subprocess.run(list(args), input=stdin, capture_output=True, text=True, env=self.env,
                                  timeout=timeout, check=False)
        except FileNotFoundError as exc:
            raise SlurmCommandError(f"`{args[0]}` is not installed on this machine: submit from a machine with "
                                    "Slurm's client tools (a login node), or install them (Debian: slurm-client)") from exc
        except subprocess.TimeoutExpired as exc:
            raise SlurmCommandError(f"`{' '.join(args[:2])}` got no answer from Slurm within {timeout:g} s: is "
                                    "slurmctld up? (`scontrol ping`)") from exc
        if check and done.returncode != 0:
            raise failed(args, done)
        return done

    # --- what the cluster has ------------------------------------------------------------------------------

    def partitions(self) -> list[Partition]:
        """Every partition this user may see."""
        out = self.run("sinfo", "-h", "-o", "%P|%a|%l|%D|%G").stdout
        found: dict[str, Partition] = {}
        for line in out.splitlines():
            name, available, limit, nodes, gres = (line.split("|") + [""] * 5)[:5]
            default = name.endswith("*")
            name = name.rstrip("*")
            earlier = found.get(name)
            count = int(nodes) if nodes.isdigit() else 0
            gres_all = ",".join(g for g in ((earlier.gres if earlier else ""), gres) if g and g != "(null)")
            found[name] = Partition(name, default or bool(earlier and earlier.default), available == "up",
                                    limit, count + (earlier.nodes if earlier else 0), gres_all)
        return list(found.values())

    def node_addresses(self) -> dict[str, str]:
        """Every node's name and the address slurmctld reaches it at (``NodeAddr``)."""
        out = self.run("sinfo", "-h", "-N", "-o", "%N|%o").stdout
        return dict(line.split("|", 1) for line in out.splitlines() if "|" in line)

    def show_config(self) -> dict[str, str]:
        """``scontrol show config``'s settings (``KEY = VALUE``); :class:`SlurmCommandError` when slurmctld cannot
        be asked (what follows from "no accounting, no job-completion log" must never follow from no answer)."""
        done = self.run("scontrol", "show", "config")
        pairs = (line.partition("=") for line in done.stdout.splitlines())
        return {key.strip(): value.strip() for key, sep, value in pairs if sep and key.strip()}

    def accounting(self) -> bool:
        """Whether the cluster keeps job accounting (then ``sacct`` knows finished jobs)."""
        return self.show_config().get("AccountingStorageType", "") not in ("", "accounting_storage/none")

    def default_memory(self, partition: str | None) -> bool:
        """Whether a job without ``--mem`` gets a set amount of memory (DefMemPerCPU, DefMemPerNode or DefMemPerGPU of
        the cluster or of ``partition``), not the whole node."""
        settings = self.show_config()
        if partition:
            shown = self.run("scontrol", "show", "partition", "-o", partition, check=False).stdout
            settings |= dict(token.partition("=")[::2] for token in shown.split() if "=" in token)
        return any(settings.get(key, "UNLIMITED") not in ("", "0", "UNLIMITED", "(null)")
                   for key in ("DefMemPerCPU", "DefMemPerNode", "DefMemPerGPU"))

    def node_memory_mb(self) -> dict[str, list[int]]:
        """Each partition's nodes' memory (sinfo's RealMemory, MB)."""
        out = self.run("sinfo", "-h", "-N", "-o", "%N|%m|%P").stdout
        found: dict[str, list[int]] = {}
        for line in out.splitlines():
            _node, memory, partition = (line.split("|") + ["", ""])[:3]
            if memory.isdigit():
                found.setdefault(partition.rstrip("*"), []).append(int(memory))
        return found

    # --- jobs ----------------------------------------------------------------------------------------------

    def submit(self, args: Sequence[str], script: str) -> str:
        """``sbatch --parsable ARGS SCRIPT``: the new job's id. A refusal is raised whole."""
        out = self.run("sbatch", "--parsable", *args, script).stdout.strip()
        return out.split(";", 1)[0]  # "id;cluster" on a federation

    def test_only(self, args: Sequence[str]) -> str | None:
        """What Slurm says of a job with ``args`` without queueing it (``sbatch --test-only``): None when it would
        be accepted, else Slurm's refusal, whole."""
        done = self.run("sbatch", "--test-only", *args, "--wrap", "true", check=False)
        if done.returncode == 0:
            return None
        return done.stderr.strip() or done.stdout.strip() or f"exit {done.returncode}"

    def queue(self, job_ids: Iterable[str]) -> dict[str, QueuedJob]:
        """What ``squeue`` knows of these jobs (array tasks one per line; finished ones too, for a while), by their ids as
        Slurm prints them."""
        ids = sorted({j.split("_", 1)[0] for j in job_ids})
        if not ids:
            return {}
        # -t all: finished jobs too, while slurmctld remembers them (MinJobAge, 300 s by default)
        done = self.run("squeue", "-h", "-r", "-t", "all", "-o", QUEUE_FORMAT, "-j", ",".join(ids), check=False)
        if done.returncode != 0 and UNKNOWN_JOB not in done.stderr:  # every job gone: "Invalid job id specified"
            raise SlurmCommandError(f"`squeue` failed (exit {done.returncode}): {done.stderr.strip()}",
                                    stderr=done.stderr.strip(), returncode=done.returncode)
        return _queued_jobs(done.stdout)

    def named_jobs(self, name: str) -> dict[str, QueuedJob]:
        """This user's pending and running jobs (array tasks one per line) called ``name``, by id: one query for
        every run of an experiment."""
        done = self.run("squeue", "-h", "-r", "-u", getpass.getuser(), "-n", name, "-o", QUEUE_FORMAT)
        return _queued_jobs(done.stdout)

    def job_details(self, job_id: str, timeout: float = COMMAND_TIMEOUT_S) -> dict[str, str]:
        """``scontrol show job``'s fields of one job (or array task), while slurmctld still remembers it; {} after
        (:class:`SlurmCommandError` when slurmctld does not answer, within ``timeout``: a job it forgot is one
        thing, a slurmctld that is down another)."""
        args = ("scontrol", "show", "job", "-o", job_id)
        done = self.run(*args, check=False, timeout=timeout)
        if done.returncode != 0:
            if UNKNOWN_JOB in done.stderr:
                return {}
            raise failed(args, done)
        fields: dict[str, str] = {}
        for token in done.stdout.split():
            key, sep, value = token.partition("=")
            if sep and key not in fields:
                fields[key] = value
        return fields

    def accounted_states(self, job_ids: Iterable[str]) -> dict[str, tuple[str, str]]:
        """From ``sacct`` (clusters with accounting): each job's final state and exit code, by id."""
        ids = sorted(set(job_ids))
        if not ids:
            return {}
        done = self.run("sacct", "-n", "-P", "-X", "-o", "JobID,State,ExitCode", "-j", ",".join(ids))  # slurmdbd down:
        states = {}  # raised, never read as "no such job"
        for line in done.stdout.splitlines():
            job_id, state, exit_code = (line.split("|") + ["", ""])[:3]
            states[job_id] = (state.split()[0] if state else "", exit_code)  # "CANCELLED by 0" -> CANCELLED
        return states

    def completion_log_states(self, job_ids: Iterable[str]) -> dict[str, tuple[str, str]]:
        """From the job-completion log (``JobCompType=jobcomp/filetxt``, the file ``JobCompLoc``, where this machine can
        read it): each job's final state and exit code, by id; the last source after squeue, scontrol and sacct. An
        array task is found by its ``ArrayJobId``/``ArrayTaskId``, else (tasks that never left the array: cancelled
        while pending) under the array's own ``JobId`` on a line without them; a job's last line wins."""
        wanted = set(job_ids)
        config = self.show_config()
        if not wanted or config.get("JobCompType") != "jobcomp/filetxt" or not config.get("JobCompLoc"):
            return {}
        try:
            with open(config["JobCompLoc"], "rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - COMPLETION_LOG_TAIL))
                lines = log.read().decode(errors="replace").splitlines()
        except OSError:  # not on this machine, or not readable here
            return {}
        own: dict[str, tuple[str, str]] = {}  # by the ids a line names: "90", "84_1", and "84_*" for an array's rest
        for line in lines:
            fields = dict(token.partition("=")[::2] for token in line.split() if "=" in token)
            ended = (fields.get("JobState", ""), fields.get("ExitCode", ""))
            if "ArrayTaskId" in fields:
                own[f"{fields.get('ArrayJobId')}_{fields['ArrayTaskId']}"] = ended
            else:
                own[fields.get("JobId", "")] = own[f"{fields.get('JobId')}_*"] = ended
        found = {j: own.get(j) or own.get(f"{j.split('_', 1)[0]}_*") if "_" in j else own.get(j) for j in wanted}
        return {j: ended for j, ended in found.items() if ended is not None}

    def cancel(self, job_ids: Sequence[str], signal: str | None = None) -> str | None:
        """``scancel`` these jobs (or array tasks); None, or what Slurm said when it refused some."""
        if not job_ids:
            return None
        args = ["scancel", *([f"--signal={signal}"] if signal else []), *job_ids]
        done = self.run(*args, check=False)
        return None if done.returncode == 0 else (done.stderr.strip() or f"exit {done.returncode}")


def _queued_jobs(lines: str) -> dict[str, QueuedJob]:
    """squeue's lines (:data:`QUEUE_FORMAT`) by job id: ``ARRAY_TASK`` for an array task, else the job's own id."""
    jobs = {}
    for line in lines.splitlines():
        job_id, array_id, task_id, state, reason, nodes = (line.split("|") + [""] * 6)[:6]
        if task_id.isdigit() and array_id.isdigit():
            job_id = f"{array_id}_{task_id}"
        jobs[job_id] = QueuedJob(job_id, state, reason, nodes)
    return jobs


def find_job(queue: dict[str, QueuedJob], job_id: str) -> QueuedJob | None:
    """A job or array task in what :meth:`Slurm.queue` returned. Array tasks that never split off their array (those
    still pending, or cancelled while pending) are listed once, under the array's own id."""
    found = queue.get(job_id)
    if found is None and "_" in job_id:
        found = queue.get(job_id.split("_", 1)[0])
    return found
