"""Reading and creating jobs the way the service can bear: one paged list per poll instead of one read per job,
backing off as a throttled answer asks, a grace period for a job not yet visible after its create, and a create
the SDK retried reconciled with the job its first try made.

Azure Resource Manager limits reads per subscription and principal (a 429 with ``Retry-After`` past them): reading
each unfinished job once per poll meets that limit at a few hundred jobs, while listing the experiment's jobs
(``Jobs_List`` filtered by the :data:`EXPERIMENT_PROPERTY` every nbbatch job carries) costs one read per page.
"""

from __future__ import annotations

import dataclasses
import email.utils
import hashlib
import time
from collections.abc import Callable, Collection, Sequence
from datetime import datetime, timezone
from typing import Any

from azure.ai.ml import MLClient
from azure.core.exceptions import AzureError, HttpResponseError, ResourceNotFoundError

from nbbatch.backends.azureml.cluster import AzureMLCluster, ClusterSettings
from nbbatch.backends.azureml.jobs import JOB_FILE, JobState, canonical_status, job_status_text, map_job_status, reconcile
from nbbatch.backends.azureml.rules import job_name
from nbbatch.store.layout import run_paths
from nbbatch.store.runfiles import read_record_or_none, requested_outcome, write_record
from nbbatch.store.runfiles import run_ids as list_run_ids
from nbbatch.store.runjson import RunRecord, Status, utc_now
from nbbatch.store.share import Share

EXPERIMENT_PROPERTY = "nbbatch_experiment"  # a property of every job nbbatch makes: its experiment, to list by
CREATE_GRACE_S = 300.0  # a job not found this soon after its create may be one the service does not show yet
DEFAULT_BACKOFF_S = 30.0  # how long to leave the service alone after a throttled answer that names no wait
CREATE_TRIES = 5  # job names tried for one run when earlier ones are taken by finished jobs of the same run
_FINAL = ("completed", "failed", "canceled")
NEVER_CREATED = "the Azure ML job was never created (its submission failed); submit again to rerun"
NOT_VISIBLE_YET = "created in Azure ML moments ago and not visible yet"

__all__ = ["EXPERIMENT_PROPERTY", "CREATE_GRACE_S", "NEVER_CREATED", "NOT_VISIBLE_YET", "Backoff", "attempt_job_name",
           "JobPolling", "create_job", "list_jobs", "next_attempt", "not_visible_yet", "refresh_state", "throttled_for"]


def attempt_job_name(experiment: str, run_id: str, attempt: int) -> str:
    """The job name of ``run_id``'s ``attempt`` (1, 2, …): the same every time it is asked for, so a create sent again
    (by the SDK's retry, or by a resubmission after an answer that never came) names the job the first one made, and
    unique per experiment, run and attempt (job names are unique in a workspace)."""
    digest = hashlib.sha256(f"{experiment}\0{run_id}\0{attempt}".encode()).hexdigest()[:8]
    return job_name(run_id, digest)


def create_job(ml_client: MLClient, job: Any, *, experiment: str, run_id: str, attempt: int,
               before: Callable[[str, int], None] | None = None) -> tuple[Any, int]:
    """Create ``job`` as ``run_id``'s ``attempt`` (its name: :func:`attempt_job_name`); return ``(job, attempt)``.

    When the service answers that the name is taken, the job of that name is read: one this run's tags name that has
    not ended is the one an earlier try of this create made (the SDK retried a request whose answer was lost), and is
    returned; one that has ended belongs to an earlier life of the run (its ``azureml.json`` was lost), and the next
    attempt's name is tried. ``before(name, attempt)`` runs before each create (to write the name down first).
    Any other refusal is raised as it came.
    """
    for tried in range(attempt, attempt + CREATE_TRIES):
        job.name = attempt_job_name(experiment, run_id, tried)
        if before is not None:
            before(job.name, tried)
        try:
            return ml_client.jobs.create_or_update(job), tried
        except HttpResponseError as exc:
            existing = _taken_by(ml_client, exc, job.name)
            tags = getattr(existing, "tags", None) or {}
            if existing is None or tags.get("run_id") != run_id or tags.get("experiment") != experiment:
                raise
            if _status(existing) not in _FINAL:
                return existing, tried
    raise HttpResponseError(f"the job names of attempts {attempt}-{attempt + CREATE_TRIES - 1} of run {run_id} are "
                            "all taken by jobs that ended")


def _taken_by(ml_client: MLClient, exc: HttpResponseError, name: str) -> Any | None:
    """The job named ``name`` when ``exc`` says the name is taken (409, or "already exists"), else None."""
    if exc.status_code != 409 and "already exists" not in str(exc).lower():
        return None
    try:
        return ml_client.jobs.get(name)
    except AzureError:
        return None


def _status(job: Any) -> str:
    status = getattr(job, "status", None)
    return str(getattr(status, "value", status) or "").lower()


def list_jobs(ml_client: MLClient, experiment: str, names: Collection[str]) -> tuple[dict[str, Any], int]:
    """``({name: job}, pages)``: the jobs among ``names`` of ``experiment``, read in one paged list."""
    found: dict[str, Any] = {}
    pages = 0
    wanted = set(names)
    for page in ml_client.jobs.list(properties=f"{EXPERIMENT_PROPERTY}={experiment}").by_page():
        pages += 1
        found.update((job.name, job) for job in page if job is not None and job.name in wanted)
    return found, pages


def throttled_for(exc: AzureError) -> float | None:
    """Seconds to wait before asking again when ``exc`` is a throttled answer (429, 503), else None.

    The wait is the answer's ``Retry-After`` (seconds or an HTTP date; ``x-ms-retry-after-ms``/``retry-after-ms``
    first), else :data:`DEFAULT_BACKOFF_S`.
    """
    if not isinstance(exc, HttpResponseError) or exc.status_code not in (429, 503):
        return None
    headers = getattr(exc.response, "headers", None) or {}
    for name in ("x-ms-retry-after-ms", "retry-after-ms"):
        try:
            return max(0.0, float(headers[name]) / 1000)
        except (KeyError, TypeError, ValueError):
            pass
    value = headers.get("Retry-After")
    try:
        return max(0.0, float(value))
    except (TypeError, ValueError):
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return DEFAULT_BACKOFF_S


class Backoff:
    """When the service may be asked again: :meth:`wait` after a throttled answer, :meth:`ready` before asking."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.not_before = 0.0

    def wait(self, seconds: float) -> None:
        self.not_before = max(self.not_before, self.clock() + seconds)

    def ready(self) -> bool:
        return self.clock() >= self.not_before


def not_visible_yet(submitted_at: str | None, now: datetime | None = None) -> bool:
    """Whether a job created at ``submitted_at`` (ISO time) is young enough that "not found" may only mean the
    service does not show it yet (its stores are eventually consistent after a create)."""
    if not submitted_at:
        return False
    try:
        created = datetime.fromisoformat(submitted_at.replace("Z", "+00:00"))
    except ValueError:
        return False
    if created.tzinfo is None:
        created = created.replace(tzinfo=timezone.utc)
    return ((now or datetime.now(timezone.utc)) - created).total_seconds() < CREATE_GRACE_S


def next_attempt(last: JobState | None) -> int:
    """The attempt a new job of a run is, after ``last`` (its ``azureml.json``): that one again while its job was never
    seen (its create may have made it all the same: the same name finds it), else the next."""
    if last is None:
        return 1
    return max(last.attempt, 1) if last.job_status is None else last.attempt + 1


def refresh_state(ml_client: MLClient, state: JobState, listed: dict[str, Any] | None = None,
                  waiting_note: Callable[[str], str | None] | None = None) -> JobState:
    """``state`` updated from its job's status (not written): the job from ``listed`` (by name) when there, else read.

    A job not found within :data:`CREATE_GRACE_S` of its create is taken as one the service does not show yet (it
    stays active, noted so), not as gone. ``waiting_note(compute)`` says why a Queued job waits (its cluster's
    allocation errors, a resize under way).
    """
    job = (listed or {}).get(state.job_name)
    try:
        job = job or ml_client.jobs.get(state.job_name)
    except ResourceNotFoundError:
        if state.active and not_visible_yet(state.submitted_at):
            state.note = NOT_VISIBLE_YET
            return state
        note = "the Azure ML job no longer exists" if state.job_status else NEVER_CREATED
        state.job_status, state.status, state.note = None, Status.FAILED, note
        return state
    state.job_status = job_status_text(job.status)
    state.status, state.note = map_job_status(state.job_status)
    if waiting_note is not None and canonical_status(state.job_status) == "Queued" and job.compute:
        state.note = waiting_note(job.compute) or state.note
    state.studio_url = job.studio_url or state.studio_url
    state.updated_at = utc_now()
    return state


class JobPolling:
    """How the azureml backend keeps its runs' ``azureml.json`` and records up to date with their jobs (a mixin of
    :class:`~nbbatch.backends.azureml.AzureMLBackend`, which gives it ``ml_client``, ``cluster_settings`` and
    ``finalize``)."""

    ml_client: MLClient
    cluster_settings: ClusterSettings
    finalize: Callable[..., RunRecord]
    _backoff: Backoff
    _list_pages: int = 1  # pages the last list of an experiment's jobs took: listing pays off past this many jobs

    def sync(self, experiment: str, share: Share, run_ids: Sequence[str] | None = None) -> None:
        """Map the jobs' states onto the records of runs that are not final (a job that ended first ends its run),
        with the job's note (waiting for nodes, cancel requested, not responding) as the record's ``note``.

        The jobs are read in one paged list (:func:`~nbbatch.backends.azureml.polling.list_jobs`) when they are more
        than its pages, else one by one. A throttled answer (429, 503, after the SDK's retries) leaves the records
        as they are and the service alone for as long as its ``Retry-After`` asks."""
        if not self._backoff.ready():
            return
        due: list[tuple[JobState, RunRecord | None]] = []
        for run_id in run_ids if run_ids is not None else list_run_ids(share, experiment):
            state = self.job_state(share, experiment, run_id)
            if state is None:
                continue
            record = read_record_or_none(share, experiment, run_id)  # a damaged one: status names it
            if not (record is not None and record.final and state.status.final):
                due.append((state, record))
        clusters: dict[str, str | None] = {}  # one look at each cluster per sync, however many jobs wait on it
        try:
            listed = self._listed_jobs(experiment, [state.job_name for state, _ in due])
            for state, record in due:
                self._sync_run(share, state, record, clusters, listed)
        except AzureError as exc:
            wait = throttled_for(exc)
            if wait is None:
                raise
            self._backoff.wait(wait)

    def _listed_jobs(self, experiment: str, names: Sequence[str]) -> dict[str, Any] | None:
        """The jobs ``names`` from one paged list of the experiment's jobs, when that takes fewer reads than reading
        each (the last list's pages tell); None: read each."""
        if len(names) <= self._list_pages:
            return None
        listed, self._list_pages = list_jobs(self.ml_client, experiment, names)
        return listed

    def _sync_run(self, share: Share, state: JobState, record: RunRecord | None, clusters: dict[str, str | None],
                  listed: dict[str, Any] | None) -> None:
        before = (state.job_status, state.note)
        self._refresh_state(state, clusters, listed)
        if (state.job_status, state.note) != before:
            self._write_state(share, state)
        if record is None or record.final:
            return
        change = reconcile(record, state)
        if change is not None and change[0] == Status.CANCELLED and change[1] is not None:
            change = requested_outcome(share, state.experiment, record.run_id, change[1].reason or "", change[1].evalue)
        if change is not None and change[0].final:
            self.finalize(share, record, *change)
            return
        note = state.note if state.active else None
        if change is None and record.note == note:
            return
        if change is not None:
            record.status = change[0]
        record.note = note
        write_record(share, record)

    # --- job state --------------------------------------------------------------------------------
    def job_state(self, share: Share, experiment: str, run_id: str) -> JobState | None:
        """The run's ``azureml.json``, or None when it was never submitted to Azure ML."""
        try:
            return JobState.from_json(share.read_bytes(run_paths(experiment, run_id).file(JOB_FILE)))
        except (FileNotFoundError, ValueError, TypeError):
            return None

    def _write_state(self, share: Share, state: JobState) -> None:
        share.write_bytes(run_paths(state.experiment, state.run_id).file(JOB_FILE), state.to_json())

    def _noting(self, share: Share, state: JobState) -> Callable[[str, int], None]:
        """Write the job's name and attempt on the share before the job exists: when its create times out (and Azure
        ML makes it anyway), a resubmission finds this job (in_flight, sync) instead of making a second."""
        def note(name: str, attempt: int) -> None:
            state.job_name, state.attempt = name, attempt
            self._write_state(share, state)
        return note

    def _refresh_state(self, state: JobState, clusters: dict[str, str | None] | None = None,
                       listed: dict[str, Any] | None = None) -> JobState:
        """``state`` updated from its job (:func:`~nbbatch.backends.azureml.polling.refresh_state`); with ``clusters``
        (notes by cluster, filled as it goes) a Queued job's note says what its cluster reports (quota, a resize)."""
        def waiting_note(compute: str) -> str | None:
            if compute not in clusters:
                clusters[compute] = AzureMLCluster(self.ml_client, dataclasses.replace(
                    self.cluster_settings, compute=compute)).allocation().waiting_note()
            return clusters[compute]

        return refresh_state(self.ml_client, state, listed, waiting_note if clusters is not None else None)


