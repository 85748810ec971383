"""The shape every driver shares: one submission of an experiment, from its lock to its report.

:meth:`Driver.submit` holds the experiment's lock (this machine: :class:`~nbbatch.store.lock.ExperimentLock`) and
lease (the share: :class:`~nbbatch.store.lease.ShareLease`) for the whole submission, says when it took over a lock
left by a process that is gone, clears an old cancel and brings the records up to date with the backend
(:meth:`~nbbatch.backends.base.Backend.refresh`). Then :meth:`Driver.run` does what the driver is for: start its
runs, write the manifest (:meth:`Driver.write_manifest`) as it knows them, and wait for them as asked. Last, the
records of the runs it names become the :class:`SubmitResult`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nbbatch.backends.base import Backend, SubmitOptions
from nbbatch.drivers.manifest import write_manifest
from nbbatch.drivers.notify import NOT_WAITED, experiment_outcome, send_notifications
from nbbatch.plan.runs import Plan
from nbbatch.spec.project import Project, find_project
from nbbatch.store.known import remember
from nbbatch.store.layout import experiment_paths
from nbbatch.store.lease import Halt, ShareLease
from nbbatch.store.lock import ExperimentLock
from nbbatch.store.runfiles import clear_cancel, load_records
from nbbatch.store.runjson import DONE_STATUSES, RunRecord
from nbbatch.store.share import Share

Progress = bool | Callable[[RunRecord], None]  # a live terminal table, nothing, or a callback for each record


@dataclass
class SubmitResult:
    """What a submission did: the runs it started, those it skipped, and the records at return."""

    experiment: str
    share: str
    backend: str
    started: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    records: list[RunRecord] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    waited: bool = True  # whether submit waited for every run to be final
    stopped: str = ""  # why this driver stopped starting runs (its lease was lost), said last; empty when it did not

    @property
    def ok(self) -> bool:
        """Whether every run of the experiment has succeeded (or, in a search, was pruned), its driver to the end."""
        return not self.stopped and bool(self.records) and all(r.status in DONE_STATUSES for r in self.records)


class Driver(ABC):
    """One submission of a planned experiment on its backend and share; see the module's docstring.

    A subclass checks in its constructor what it cannot do (raising before anything is locked) and implements
    :meth:`run`. ``source`` is where the experiment came from (its file, for the manifest); ``force`` runs again
    what succeeded; ``wait`` is the caller's choice (None: :meth:`default_wait`); ``progress`` is True for a live
    terminal table, False for none, or a callback receiving each :class:`RunRecord` as it changes.
    """

    def __init__(self, plan: Plan, backend: Backend, share: Share, *, source: object = None, force: bool = False,
                 wait: bool | None = None, progress: Progress = True) -> None:
        self.plan, self.backend, self.share = plan, backend, share
        self.spec = plan.experiment
        self.experiment = self.spec.name
        self.source, self.force, self.progress = source, force, progress
        self.wait = self.default_wait() if wait is None else wait
        self.stored_settings = backend.storable_settings(self.spec.backend_settings)  # nothing secret: kept on disk
        self.result = SubmitResult(self.experiment, share.url, self.spec.backend, warnings=list(plan.warnings),
                                   waited=self.wait)

    def default_wait(self) -> bool:
        """Whether to wait for the runs when the caller did not say: as the backend does by default."""
        return self.backend.waits_by_default

    @abstractmethod
    def run(self, halt: Halt) -> Collection[str]:
        """Start the runs (writing the manifest with :meth:`write_manifest`) and wait for them as :attr:`wait` says;
        fill :attr:`result`'s ``started`` and ``skipped``. Return the run ids whose records the result reports.
        ``halt`` is set when the lease was lost (another driver took it over, or the experiment's folder is gone):
        start no more runs."""

    def submit(self) -> SubmitResult:
        """The whole submission: lock and lease, :meth:`run`, and the records of its runs."""
        project = find_project(self.spec.base_dir)
        result = self.result
        remember(project, self.experiment, self.share.url, self.spec.backend, self.stored_settings)
        with ExperimentLock(lock_path(project, self.share, self.experiment), self.experiment) as lock, \
                ShareLease(self.share, self.experiment, command=lock.command) as lease:
            for gone in (lock.recovered_from, lease.recovered_from):
                if gone:
                    result.warnings.append(f"experiment `{self.experiment}` was left locked by process "
                                           f"{gone.get('pid')} on {gone.get('host')} (since {gone.get('since')}), "
                                           "which is gone; took it over")
                    break
            clear_cancel(self.share, self.experiment)
            self.backend.refresh(self.experiment, self.share)
            reported = set(self.run(lease.lost))
        if lease.lost.is_set():
            result.stopped = (f"experiment `{self.experiment}`: this driver stopped starting runs: {lease.lost.reason}; "
                              "the runs it had started went on")
        records, problems = load_records(self.share, self.experiment)
        result.records = [r for r in records if r.run_id in reported]
        result.warnings.extend(problems)
        result.warnings.extend(self.notify(result))
        return result

    def notify(self, result: SubmitResult) -> list[str]:
        """Send the experiment's ``notify:`` messages when its runs have ended (not after a submission that started
        nothing); the warnings say what could not be sent."""
        notify, search = self.spec.notify, self.spec.search
        if notify is None or not result.started:
            return []
        if not result.waited:
            return [NOT_WAITED]
        if not result.records or not all(r.final for r in result.records):  # another driver took over: it tells
            return []
        outcome = experiment_outcome(self.experiment, self.share.url, result.records,
                                     search.metric if search else None, search.mode if search else "max",
                                     list(zip(search.metrics, search.modes, strict=True)) if search else ())
        return send_notifications(notify, outcome)

    def submit_options(self, **more: Any) -> SubmitOptions:
        """The experiment's resources as the backend takes them, with ``more`` of this launch."""
        return SubmitOptions.of(self.spec.resources, **more)

    def on_update(self) -> Callable[[RunRecord], None] | None:
        """The caller's callback for each changed record, if it gave one."""
        return self.progress if callable(self.progress) else None

    def write_manifest(self, run_ids: list[str], warn: bool = True) -> None:
        """Write the experiment's manifest with ``run_ids`` as its runs (:func:`~nbbatch.drivers.manifest.write_manifest`);
        with ``warn``, the result says when this name was last submitted from another experiment file."""
        said = write_manifest(self.share, self.spec, run_ids, self.source, self.stored_settings)
        if warn:
            self.result.warnings.extend(said)


def lock_path(project: Project, share: Share, experiment: str) -> Path:
    """Where the lock of an experiment (or a pipeline) is: in its folder on a folder share, else in the project."""
    local = share.local_path(experiment_paths(experiment).lock)
    if local is not None:
        return local
    return project.state_dir / "locks" / f"{experiment}.lock"

