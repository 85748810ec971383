"""Azure ML job states and what they mean for run records (``azureml.json`` next to each run's files)."""

from __future__ import annotations

import dataclasses
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from azure.ai.ml import MpiDistribution, PyTorchDistribution, TensorFlowDistribution
from azure.ai.ml.entities import Command

from nbbatch.errors import BackendError
from nbbatch.execute.launch import LOG_ECHO_ENV, LaunchSpec
from nbbatch.spec.resources import Distribution
from nbbatch.store.runjson import ErrorKind, RunError, RunRecord, Status

JOB_FILE = "azureml.json"  # in the run's folder: run_paths(experiment, run_id).file(JOB_FILE)
# The data runtime's mount settings nbbatch relies on, in every job's environment (Microsoft Learn, "Access data in a
# job", *Available mount settings*); whether they hold live is what `make azure-smoke` measures (docs/azure.md).
MOUNT_SETTINGS = {
    # getattr answers are cached for ever by default: the job would never see the cancel marker the driver writes
    "DATASET_MOUNT_ATTRIBUTE_CACHE_TTL": "5000",  # milliseconds
    # unmount waits 30 s by default for pending flushes, then drops them: a large output written at the run's end
    # (the runner fsyncs its outputs and record before it exits, see RunFolders.save) gets 10 minutes
    "DATASET_UNMOUNT_TIMEOUT_SECONDS": "600",
}
RUN_FILES = "nbbatch-runs"  # in the job's code snapshot: one <run id>.json per run, what its launch's run_file names

_QUEUED = ("NotStarted", "Queued", "Preparing", "Provisioning", "Starting")
_RUNNING = ("Running", "Finalizing")
# CancelRequested is not an end: the job may still complete or fail before the cancel lands (the service moves it
# to Canceled, Completed or Failed), so the run stays active, with this note, until the service says which.
CANCEL_REQUESTED = "CancelRequested"
_NOTED = {
    "NotResponding": "Azure ML reports the job as not responding (node lost or hung); it may recover",
    "Paused": "the job is paused in Azure ML",
    CANCEL_REQUESTED: "cancel requested in Azure ML; the job may still finish before it stops",
}
_FINAL = {"Completed": Status.SUCCEEDED, "Failed": Status.FAILED, "Canceled": Status.CANCELLED}
# The states in which the service refuses a cancel: the job's command has ended (Finalizing: its outputs are being
# collected) or the job has (Azure/azureml-assets#2496).
ENDED = ("Finalizing", *_FINAL)
_LOWER = {name.lower(): name for name in (*_QUEUED, *_RUNNING, *_NOTED, *_FINAL)}


def map_job_status(status: str | None) -> tuple[Status, str | None]:
    """An Azure ML job status as ``(nbbatch status, note)``.

    NotStarted/Queued/Preparing/Provisioning/Starting → queued; Running/Finalizing → running;
    Completed → succeeded; Failed → failed; Canceled → cancelled; NotResponding/Paused/CancelRequested →
    running (still active: a job whose cancel was requested may yet complete), with a note saying so.
    Unknown states are kept as queued with a note.
    """
    text = canonical_status(status)
    if text in _QUEUED:
        return Status.QUEUED, None
    if text in _RUNNING:
        return Status.RUNNING, None
    if text in _NOTED:
        return Status.RUNNING, _NOTED[text]
    if text in _FINAL:
        return _FINAL[text], None
    return Status.QUEUED, f"unknown Azure ML job status {text!r}"


def canonical_status(status: Any) -> str:
    """A job status as the service spells it (``CANCEL_REQUESTED`` and ``cancelrequested`` → ``CancelRequested``)."""
    text = str(getattr(status, "value", status) or "NotStarted")
    return _LOWER.get(text.replace("_", "").lower(), text)


def refused_job_error(job_name: str, reason: str, status_code: int | None) -> RunError:
    """The error of a run whose job Azure ML refused to create (``reason``: the service's answer, whole).

    A 4xx names something of the job to fix (a name, a setting); a 5xx is the service's own trouble.
    """
    fix = ("fix what Azure ML names and submit again" if status_code is not None and status_code < 500 else
           "Azure ML failed to take it; submit again")
    return RunError("AzureMLJobRefused", f"Azure ML refused to create job {job_name} (HTTP {status_code}): {reason}",
                    reason=f"the run never started: {fix}", kind=ErrorKind.INFRA)


def job_status_text(status: Any) -> str:
    """A job's status as the SDK gives it (an enum or text), as text."""
    value = getattr(status, "value", status)
    return str(value) if value is not None else "NotStarted"


@dataclass(frozen=True)
class JobLaunch:
    """What one run's job hands ``run-one``: ``spec`` on the command line, with ``bindings`` (the entries whose
    ``${{…}}`` Azure ML replaces), and its run in a file of the job's code snapshot (a run's parameters have no bound,
    and Linux holds one argument to 128 KiB: ``MAX_ARG_STRLEN``)."""

    spec: LaunchSpec
    bindings: frozenset[str]

    @property
    def run_file(self) -> str:
        """The run's file, relative to the code snapshot (the job's working directory)."""
        return f"{RUN_FILES}/{self.spec.run.run_id}.json"

    def write_run_file(self, code: str | os.PathLike[str]) -> str:
        """Write the run's file into the code snapshot ``code``; return its relative path (the same bytes every time,
        so a snapshot written for every run before the first job is uploaded once)."""
        target = Path(code, self.run_file)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(self.spec.run_json() + "\n", encoding="utf-8")
        return self.run_file


@dataclass
class JobState:
    """What nbbatch knows of one run's Azure ML job (stored as ``azureml.json`` in the run's folder)."""

    run_id: str
    job_name: str
    experiment: str
    studio_url: str | None = None
    job_status: str | None = None
    status: Status = Status.QUEUED  # the job status mapped onto nbbatch's
    note: str | None = None
    submitted_at: str | None = None
    updated_at: str | None = None
    attempt: int = 0  # the run's jobs so far, this one included (its name: polling.attempt_job_name); 0: unknown

    def __post_init__(self) -> None:
        self.status = Status(self.status)

    @property
    def active(self) -> bool:
        """Whether the job was last seen queued or running."""
        return self.status in (Status.QUEUED, Status.RUNNING)

    def to_json(self) -> bytes:
        return (json.dumps(dataclasses.asdict(self), indent=2) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes) -> JobState:
        values = json.loads(data)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})


def reconcile(record: RunRecord, state: JobState) -> tuple[Status, RunError | None] | None:
    """What a job's state means for a record that is not final: ``(status, error)``, or None (no change).

    The executor's own record wins: a failed or cancelled job only fills in an error the record lacks.
    """
    if state.status == Status.RUNNING and record.status == Status.QUEUED and state.job_status != CANCEL_REQUESTED:
        return Status.RUNNING, None  # (a cancel requested says nothing of whether the job had started)
    if not state.status.final:
        return None
    error = record.error
    if error is None and state.status == Status.FAILED:
        where = f" ({state.studio_url})" if state.studio_url else ""
        reason = state.note or "the job ended before the run finished: see `nbbatch logs --follow` or the studio"
        error = RunError("AzureMLJobFailed", f"Azure ML job {state.job_name} failed{where}", reason=reason,
                         kind=ErrorKind.INFRA)
    if error is None and state.status == Status.CANCELLED:
        error = RunError("Cancelled", f"Azure ML job {state.job_name}", reason="cancelled in Azure ML",
                         kind=ErrorKind.CANCELLED)
    return state.status, error


def job_distribution(
    distribution: Distribution | None,
) -> tuple[int, PyTorchDistribution | TensorFlowDistribution | MpiDistribution | None]:
    """``(instance_count, distribution)`` of the command job of a run spanning ``distribution`` (``Run.distribution``).

    Every node runs one nbbatch node launcher (the job's ``run-one`` command), which starts that node's ranks:

    * torch, jax: ``PyTorchDistribution`` with one process per instance; Azure ML sets ``MASTER_ADDR``,
      ``MASTER_PORT``, ``NODE_RANK`` (and ``WORLD_SIZE``/``RANK`` counting launchers, i.e. nodes, not ranks);
    * tensorflow: ``TensorFlowDistribution`` with one worker per node; Azure ML sets ``TF_CONFIG``;
    * mpi: ``MpiDistribution`` with one MPI process per rank (``processes_per_node`` per node), each running the
      command for its own rank; mpirun sets ``OMPI_COMM_WORLD_RANK``, ``…_LOCAL_RANK``, ``…_SIZE``.

    An ordinary run (``None``): one instance, no distribution.
    """
    if not distribution:
        return 1, None
    kind, nodes = distribution.type, distribution.nodes
    if kind in ("torch", "jax"):
        return nodes, PyTorchDistribution(process_count_per_instance=1)
    if kind == "tensorflow":
        return nodes, TensorFlowDistribution(worker_count=nodes, parameter_server_count=0)
    if kind == "mpi":
        return nodes, MpiDistribution(process_count_per_instance=distribution.processes_per_node)
    raise BackendError(f"distribution `{kind}` has no Azure ML job form (torch, jax, tensorflow or mpi)")


def runtime_environment() -> dict[str, str]:
    """The variables of every job's runtime: the mount settings, and run-one's echo of the run's log to the job's own
    stream (which ``nbbatch logs -f`` follows: the mount may show log.txt's new lines late)."""
    return {**MOUNT_SETTINGS, LOG_ECHO_ENV: "1"}


def job_yaml(job: Command) -> str:
    """A command job as the YAML ``az ml job create --file`` (and ``azure.ai.ml.load_job``) reads."""
    stream = io.StringIO()
    # A `command()` builder dumps as a pipeline node; its job form is what a job YAML file holds.
    job._to_job().dump(stream)  # noqa: SLF001 - the SDK's own conversion, not exposed publicly
    return stream.getvalue()
