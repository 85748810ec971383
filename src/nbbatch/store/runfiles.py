"""Run records in a share: read, write, list, and the cancel markers every executor watches."""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import socket
import threading
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from nbbatch.errors import ShareError
from nbbatch.store.layout import OUTPUT_NOTEBOOK, experiment_paths, run_paths
from nbbatch.store.runjson import DONE_STATUSES, ErrorKind, RunError, RunRecord, Status, utc_now
from nbbatch.store.share import Share


class PlannedRun(Protocol):
    """What a record is started from: the fields of a planned run (:class:`nbbatch.plan.runs.Run` has them).

    A protocol, so that the store (below the plan) needs no import of it.
    """

    @property
    def run_id(self) -> str: ...
    @property
    def experiment(self) -> str: ...
    @property
    def notebook_rel(self) -> str: ...
    @property
    def kernel(self) -> str: ...
    @property
    def framework(self) -> str | None: ...
    @property
    def recognised_as(self) -> str | None: ...
    @property
    def parameters(self) -> dict[str, Any]: ...
    @property
    def timeout_s(self) -> float | None: ...
    @property
    def world_size(self) -> int: ...
    @property
    def origins(self) -> dict[str, Any]: ...


class RecordProblem(str):
    """What is wrong with one run's record, in words (a ``str``: every footer and warning shows it as it is), with
    the run's id (its folder's name), the record's file, and whether the record could be read at all (``damaged``)
    or was read but names another run (shown under its folder's id)."""

    run_id: str
    path: str
    damaged: bool

    def __new__(cls, text: str, run_id: str, path: str, damaged: bool = True) -> RecordProblem:
        problem = super().__new__(cls, text)
        problem.run_id, problem.path, problem.damaged = run_id, path, damaged
        return problem


def _parse_record(data: bytes, experiment: str, run_id: str, source: str) -> tuple[RunRecord, RecordProblem | None]:
    """A record read from the folder of ``run_id``: a record naming another run or experiment (a copied folder, a hand
    edit) is taken as its folder's, so that nothing written for it lands in another run's folder; the mismatch is
    the problem returned."""
    record = RunRecord.from_json(data, source=source)
    if (record.run_id, record.experiment) == (run_id, experiment):
        return record, None
    named = f"run `{record.run_id}`" + (f" of experiment `{record.experiment}`" if record.experiment != experiment else "")
    problem = RecordProblem(f"{source} names {named}, not its folder's run `{run_id}` (a folder copied or renamed, "
                            f"or a hand edit?); it is shown as run `{run_id}`. Fix its `run_id` or delete it",
                            run_id, source, damaged=False)
    record.run_id, record.experiment = run_id, experiment
    return record, problem


def read_record(share: Share, experiment: str, run_id: str, rank: int | None = None) -> RunRecord | None:
    """The run's ``run.json`` (with ``rank``: that rank's), or None when it has none yet (a corrupt one raises ShareError).

    A record is always its folder's run's, whatever id it names (see :func:`load_records`, which says so)."""
    path = run_paths(experiment, run_id, rank).record
    try:
        data = share.read_bytes(path)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    return _parse_record(data, experiment, run_id, f"{share.url}/{path}")[0]


def read_record_or_none(share: Share, experiment: str, run_id: str) -> RunRecord | None:
    """Like :func:`read_record`, but a corrupt record reads as None (it is about to be replaced)."""
    try:
        return read_record(share, experiment, run_id)
    except ShareError:
        return None


def warn_damaged(problem: ShareError, consequence: str) -> None:
    """Say (a :class:`UserWarning`, one ``nbbatch: warning:`` line in the CLI) that a run's record cannot be read,
    naming its file, and what a command that reads every record did about it: one damaged record stops no other."""
    warnings.warn(f"{str(problem).rstrip('.')}; {consequence}", UserWarning, stacklevel=3)


def write_record(share: Share, record: RunRecord) -> None:
    """Write a run's ``run.json`` atomically."""
    share.write_bytes(run_paths(record.experiment, record.run_id, record.rank).record, record.to_json())


def new_record(run: PlannedRun, backend: str = "local") -> RunRecord:
    """A ``queued`` record for a run that is about to be scheduled."""
    return RunRecord(run_id=run.run_id, experiment=run.experiment, notebook=run.notebook_rel, kernel=run.kernel,
                     framework=run.framework, recognised_as=run.recognised_as,
                     parameters=dict(run.parameters), status=Status.QUEUED,
                     queued_at=utc_now(), backend=backend, timeout_s=run.timeout_s, world_size=run.world_size,
                     origins=dict(run.origins) or None)


def run_ids(share: Share, experiment: str) -> list[str]:
    """The names of the run folders of an experiment (sorted)."""
    return share.list(experiment_paths(experiment).folder)


def done_before(share: Share, experiment: str, run_id: str, record: RunRecord | None) -> tuple[bool, str | None]:
    """Whether a submission (not forced) leaves run ``run_id`` alone, by its ``record`` (None: it has none): the
    rule ``submit`` skips runs by, and ``plan`` tells them by. A run that succeeded, with its ``output.ipynb`` still on
    the share, or was pruned is done; the second value says why a run that succeeded runs again (its notebook is
    gone)."""
    if record is None or record.status not in DONE_STATUSES:
        return False, None
    if record.status == Status.SUCCEEDED and not share.exists(run_paths(experiment, run_id).notebook):
        return False, (f"run {run_id} succeeded before but its {OUTPUT_NOTEBOOK} is gone from {share.url}: "
                       "running it again")
    return True, None


def runs_done_before(share: Share, experiment: str, ids: Iterable[str]) -> list[str]:
    """Of the runs ``ids``, those a submission (not forced) skips (:func:`done_before`). Only reads: a share or an
    experiment folder that does not exist yet has none; a damaged record raises, naming its path, as submit would."""
    folders = set(run_ids(share, experiment))  # one listing, not a read per run
    return [i for i in ids if i in folders and done_before(share, experiment, i, read_record(share, experiment, i))[0]]


def load_records(share: Share, experiment: str, strict: bool = False,
                 ids: Iterable[str] | None = None) -> tuple[list[RunRecord], list[RecordProblem]]:
    """Every run record of an experiment (with ``ids``: of those runs), and the problems found, each naming its file:
    records that cannot be read (left out; with ``strict``, raised), and records naming another run (kept, as their
    folder's run)."""
    records, problems = [], []
    for run_id in run_ids(share, experiment) if ids is None else ids:
        path = run_paths(experiment, run_id).record
        source = f"{share.url}/{path}"
        try:
            data = share.read_bytes(path)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            continue
        try:
            record, mismatch = _parse_record(data, experiment, run_id, source)
        except ShareError as exc:
            if strict:
                raise
            problems.append(RecordProblem(str(exc), run_id, source))
            continue
        records.append(record)
        problems.extend([mismatch] if mismatch else [])
    return records, problems


@dataclass(frozen=True)
class StopRequest:
    """Why a run was asked to stop, as its per-run marker says: a cancel, or its search's pruner (``status``
    PRUNED), with the reason its record keeps. A cluster's own stop may also time the run out (TIMED_OUT: Slurm's
    time limit) or put it back in the queue (QUEUED: Kubernetes evicted its pod, and a new pod resumes it)."""

    status: Status = Status.CANCELLED
    reason: str = "stopped by a cancel request"
    ename: str = ""  # the error's name where the stopper has one (a cluster's time limit: "SlurmTimeLimit")
    evalue: str = ""  # what the stopper said (a cluster's own words on the job)
    by: str = ""  # a cancel's sender in short, for the one-line summary ("`nbbatch cancel`"); the reason says more
    at: str = ""  # when it was asked (UTC)

    def outcome(self, evalue: str = "", reason: str | None = None) -> tuple[Status, RunError]:
        """The status and error of a run ended by this request (``reason``: a cancel's own words, where the
        backend knows more, e.g. "cancelled before it started"). A stop by a cluster's time limit (an in-process
        request, never a marker's) ends the run ``timed_out``."""
        evalue = evalue or self.evalue
        if self.status == Status.PRUNED:
            return Status.PRUNED, RunError(self.ename or "pruned", evalue, reason=self.reason, kind=ErrorKind.PRUNED)
        if self.status == Status.TIMED_OUT:
            return Status.TIMED_OUT, RunError(self.ename or "timed_out", evalue, reason=reason or self.reason,
                                              kind=ErrorKind.TIMEOUT)
        if self.status == Status.QUEUED:  # interrupted by its cluster (an evicted pod): it runs again, not final
            return Status.QUEUED, RunError(self.ename or "interrupted", evalue, reason=self.reason, kind=ErrorKind.INFRA)
        return Status.CANCELLED, RunError(self.ename or "cancelled", evalue, reason=reason or self.reason,
                                          kind=ErrorKind.CANCELLED, stopped_by=self.by or None,
                                          stopped_at=self.at or None)


CANCEL_REQUEST = StopRequest()


def cancel_request(by: str, origin: str = "", at: str | None = None) -> StopRequest:
    """A cancel that says who asked (``by``: "`nbbatch cancel`", "SIGTERM to its driver"; ``origin``, its own
    separator first: " from user@host (pid N)") and when, in the words the run's record keeps; its summary names
    ``by`` alone (:meth:`~nbbatch.store.runjson.RunError.summary`)."""
    at = at or utc_now()
    when = at.replace("T", " ").split(".")[0].removesuffix("+00:00")
    return StopRequest(Status.CANCELLED, f"cancelled by {by}{origin} at {when} UTC", by=by, at=at)


def requester() -> str:
    """Who this process is, for a stop request: user@host (pid N)."""
    with contextlib.suppress(KeyError, OSError):
        return f"{getpass.getuser()}@{socket.gethostname()} (pid {os.getpid()})"
    return f"{socket.gethostname()} (pid {os.getpid()})"


class StopEvent(threading.Event):
    """An executor's in-process stop (its driver is stopping: Ctrl-C, SIGTERM, a share failure), with why: a running
    run stopped by it ends ``cancelled`` for :attr:`request`'s reason, as by a marker in the share."""

    request: StopRequest = CANCEL_REQUEST

    def stop(self, request: StopRequest) -> None:
        """Stop, for ``request``'s reason (the first reason given is kept)."""
        if not self.is_set():
            self.request = request
        self.set()


def write_cancel_markers(share: Share, experiment: str, ids: list[str] | None = None,
                         request: StopRequest = CANCEL_REQUEST) -> list[str]:
    """Ask unfinished runs to stop (all of the experiment's when ``ids`` is None); return the ids asked.

    Whoever executes a run (any backend) watches these markers and kills its kernel. A per-run marker holds the
    request (:func:`stop_request` reads it; earlier versions wrote a bare time, which reads as a cancel).
    """
    asked = []
    content = json.dumps({"at": request.at or utc_now(), "status": request.status.value, "reason": request.reason,
                          "by": request.by}).encode()
    if not ids:  # first: no queued run may start while the runs' own markers are written one by one
        share.write_bytes(experiment_paths(experiment).cancel, content)
    for run_id in list(ids) if ids else run_ids(share, experiment):
        try:
            record = read_record(share, experiment, run_id)
        except ShareError as exc:  # damaged: it may be running, so it is asked too, and no other run is held up
            warn_damaged(exc, f"run {run_id} was asked to stop all the same, in case it is running")
        else:
            if record is None or record.final:
                continue
        share.write_bytes(run_paths(experiment, run_id).cancel, content)
        asked.append(run_id)
    return asked


def cancel_requested(share: Share, experiment: str, run_id: str | None = None) -> bool:
    """Whether the experiment (or, with ``run_id``, that run) has been asked to stop."""
    if run_id is None:
        return share.exists(experiment_paths(experiment).cancel)
    return any(share.exists(marker) for marker in run_paths(experiment, run_id).cancel_markers)


def stop_request(share: Share, experiment: str, run_id: str) -> StopRequest | None:
    """What the run's markers ask (None: nothing): its own marker's request, else the experiment's (``nbbatch cancel``
    of them all); a marker that cannot be read (an earlier version's bare time) is a cancel."""
    paths = run_paths(experiment, run_id)
    for marker in reversed(paths.cancel_markers):  # the run's own first
        try:
            said = json.loads(share.read_bytes(marker))
            by = str(said.get("by") or "")  # earlier versions wrote no sender
            return StopRequest(Status(said["status"]), str(said["reason"]), by=by,
                               at=str(said.get("at") or "") if by else "")
        except (ShareError, OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return CANCEL_REQUEST if any(share.exists(marker) for marker in paths.cancel_markers) else None


def requested_outcome(share: Share, experiment: str, run_id: str, reason: str, evalue: str = "") -> tuple[Status, RunError]:
    """How a run stopped from outside ends (its task or job killed after a stop request): as its marker asked
    (pruned), else cancelled for ``reason``."""
    try:
        request = stop_request(share, experiment, run_id) or CANCEL_REQUEST
    except (ShareError, OSError):
        request = CANCEL_REQUEST
    return request.outcome(evalue, reason)


def stop_gang(share: Share, run: PlannedRun, attempts: int, why: dict[str, object], decide: bool) -> None:
    """Tell every node of ``run`` that its gang's attempts up to ``attempts`` are over (``why``: the stop marker's
    content, unless one is there already); ``decide``: node 0's word too, that the gang does not run again."""
    paths = run_paths(run.experiment, run.run_id)
    for attempt in range(1, attempts + 1):
        with contextlib.suppress(ShareError, OSError):
            if not share.exists(paths.gang_stop(attempt)):
                share.write_bytes(paths.gang_stop(attempt), json.dumps(why).encode())
            if decide:
                share.write_bytes(paths.gang_decision(attempt), b'{"retry": false}')


@dataclass(frozen=True)
class CancelRequests:
    """The cancel requests standing for an experiment: all of its runs, or these run ids."""

    everything: bool = False
    runs: frozenset[str] = frozenset()

    def __contains__(self, run_id: object) -> bool:
        return self.everything or run_id in self.runs


def cancel_requests(share: Share, experiment: str) -> CancelRequests:
    """Every standing cancel request of an experiment, in two share requests whatever the number of runs."""
    paths = experiment_paths(experiment)
    runs = frozenset(share.list(paths.cancel_folder))
    return CancelRequests(everything=share.exists(paths.cancel), runs=runs)


def clear_cancel(share: Share, experiment: str, run_id: str | None = None) -> None:
    """Remove the experiment's cancel marker (or, with ``run_id``, that run's)."""
    share.remove(experiment_paths(experiment).cancel if run_id is None else run_paths(experiment, run_id).cancel)


def clear_run_cancels(share: Share, experiment: str, ids: Iterable[str]) -> None:
    """Remove the cancel markers of runs about to be (re)submitted: a cancel belongs to one submission.

    Called before their ``queued`` records are written, so a cancel that reads the new record
    writes its marker after this and is never lost.
    """
    standing = set(share.list(experiment_paths(experiment).cancel_folder))
    for run_id in standing.intersection(ids):
        share.remove(run_paths(experiment, run_id).cancel)


def finalize_record(share: Share, run: PlannedRun | RunRecord, status: Status, error: RunError | None = None,
                    backend: str = "local") -> RunRecord:
    """End a run's record with ``status`` and ``error``, its duration filled in when it had started.

    The one way a run is ended from outside its executor (a run cancelled before it started, a lost
    task, a dead driver); :meth:`nbbatch.backends.base.Backend.finalize` and remote helpers call it.
    """
    record = read_record_or_none(share, run.experiment, run.run_id)
    if record is None:
        record = run if isinstance(run, RunRecord) else new_record(run, backend)
    record.status, record.error, record.ended_at = status, error, utc_now()
    if record.started_at and record.duration_s is None:
        with contextlib.suppress(ValueError):
            record.duration_s = round((datetime.fromisoformat(record.ended_at)
                                       - datetime.fromisoformat(record.started_at)).total_seconds(), 3)
    write_record(share, record)
    return record
