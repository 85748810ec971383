"""The backend base class: where runs execute, and the lifecycle every backend shares.

A backend only decides *where* ``nbbatch run-one`` (:func:`nbbatch.execute.attempts.execute_run`) runs, handing
it a :class:`~nbbatch.execute.launch.LaunchSpec` (:func:`~nbbatch.execute.launch.launch_command`, never run-one's
arguments); the execution itself and the share layout are the same everywhere. :class:`Backend` owns what is the
same for all of them, in the manner of jupyter-scheduler's ``ExecutionManager``:

* settings, declared once as the frozen dataclass :attr:`Backend.Settings` and validated once when the
  backend is made (:mod:`nbbatch.backends.settings`: unknown names get "did you mean", values are checked
  before anything starts, secrets are never echoed);
* :meth:`Backend.triage`: skip runs that already succeeded (unless forced) or are still in flight; then
  :meth:`~Backend.launch` orders the rest longest-first, writes their ``queued`` records,
  starts them (:meth:`~Backend.start`) and waits until final when asked (:meth:`~Backend.wait`); a driver
  (:mod:`nbbatch.drivers`) calls them in turn;
* :meth:`Backend.parallel_limit`: the one rule for how many runs execute at once;
* :meth:`Backend.finalize`: the one way a backend ends a run's record;
* :meth:`Backend.refresh`: bring records up to date with the backend's own view (:meth:`~Backend.sync`)
  and fail runs whose execution is gone (:meth:`~Backend.lost_runs`);
* :meth:`Backend.start_driver` / :meth:`~Backend.driver_state`: where ``submit --detach`` puts the driver itself
  (a background process by default; Slurm: a CPU job) and how it is;
* :attr:`Backend.capabilities`: what the backend can do, so front ends ask instead of branching on names.

A subclass implements :meth:`~Backend.compute` and :meth:`~Backend.start`, and overrides the hooks it needs.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from nbbatch.backends.detached import process_state, start_process
from nbbatch.backends.settings import NoSettings, Setting, setting_table, settings_values, validated
from nbbatch.errors import BackendError
from nbbatch.execute.envs import build_envs
from nbbatch.plan.runs import Run
from nbbatch.redact import is_secret, without_secrets
from nbbatch.spec.resources import Resources
from nbbatch.store.drivers import DetachedDriver, DriverState
from nbbatch.store.layout import run_paths
from nbbatch.store.lease import Halt
from nbbatch.store.runfiles import (
    CANCEL_REQUEST,
    StopRequest,
    clear_run_cancels,
    done_before,
    finalize_record,
    load_records,
    new_record,
    read_record,
    read_record_or_none,
    run_ids,
    write_cancel_markers,
    write_record,
)
from nbbatch.store.runjson import DONE_STATUSES, RunError, RunRecord, Status
from nbbatch.store.share import Share, poll_interval

if TYPE_CHECKING:
    from nbbatch.execute.placement import NodePlacement
    from nbbatch.spec.project import Project

UpdateCallback = Callable[[RunRecord], None]
QUEUED_FIRST = 32  # queued records written before any run starts; the rest are written while the first runs go
QUEUED_WRITERS = 8  # queued records written at once (each write waits on the disk or the network, not the CPU)

_log = logging.getLogger(__name__)


def guarded(on_update: UpdateCallback | None) -> UpdateCallback:
    """``on_update`` made harmless to the runs it reports on: a display never changes a record.

    The callback gets a copy of each record, and an exception it raises is logged (a warning, once per
    callback, with its traceback) and swallowed, so it never reaches an attempt or :meth:`Backend.finalize`
    and never replaces a run's real status or error. ``None`` gives a callback that does nothing.
    """
    if on_update is None:
        return _ignore
    if getattr(on_update, "_nbbatch_guarded", False):
        return on_update
    warned = [False]

    def notify(record: RunRecord) -> None:
        try:
            on_update(copy.deepcopy(record))
        except Exception:  # noqa: BLE001 - a broken display must not fail the run it shows
            if not warned[0]:
                warned[0] = True
                _log.warning("the progress display failed on run %s; the runs go on and their records are "
                             "not affected (further failures of this display are not reported)",
                             record.run_id, exc_info=True)

    notify._nbbatch_guarded = True  # type: ignore[attr-defined]
    notify.__wrapped__ = on_update  # type: ignore[attr-defined]
    return notify


def _ignore(_record: RunRecord) -> None:
    pass


@dataclass
class Compute:
    """What a backend has to run on."""

    backend: str
    gpus: list[dict[str, Any]] = field(default_factory=list)  # {"index", "name", "memory_mb", "node"?}
    nodes: list[dict[str, Any]] = field(default_factory=list)  # {"name", "state", "cpus", "gpus"}
    slots: int = 1  # runs that can execute at once
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class SubmitOptions:
    """How to run a batch (from the experiment's resources and the command line)."""

    runs_per_gpu: int | str = 1  # or "auto": packed by memory (backends that place runs on GPU slots)
    mps: bool = False  # share each GPU through a CUDA MPS daemon the backend starts
    max_parallel: int | None = None  # None: as many as the compute allows
    # How many runs the caller keeps going at once over its launches (a search's trials, each launched alone):
    # what each CPU run's share of a machine's cores is worked out from. None: the batch's own runs.
    runs_at_once: int | None = None
    wait: bool = True  # block until every run is final (detached backends may return at once)
    force: bool = False  # rerun runs that already succeeded, restart runs still in flight
    on_update: UpdateCallback | None = None  # called on every status change
    halt: Halt | None = None  # set when this driver must start no more runs (its lease was lost: its reason says why)
    earlier: list[RunRecord] = field(default_factory=list)  # the experiment's records before this launch (what ran before)
    _guarded: UpdateCallback | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def of(cls, resources: Resources, **more: Any) -> SubmitOptions:
        """The options of an experiment's :class:`~nbbatch.spec.resources.Resources` (and ``more`` of the launch)."""
        return cls(runs_per_gpu=resources.runs_per_gpu, mps=resources.mps, max_parallel=resources.max_parallel, **more)

    @property
    def guarded_update(self) -> UpdateCallback:
        """:attr:`on_update` through :func:`guarded` (one wrapper while it stays the same callback, so its failure
        is reported once): what a backend calls, so a display never changes a record."""
        if self._guarded is None or getattr(self._guarded, "__wrapped__", None) is not self.on_update:
            self._guarded = guarded(self.on_update)
        return self._guarded


@dataclass
class SubmitOutcome:
    """What :meth:`Backend.triage` decided for the runs it was given."""

    started: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # already succeeded
    in_flight: list[str] = field(default_factory=list)  # still queued or running in the backend: left alone
    notes: list[str] = field(default_factory=list)  # why a run that looked done is started again


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do. Front ends (CLI, widgets) ask these instead of branching on a backend's name."""

    cancel: bool = True  # stops running runs (their partial output is kept)
    log_stream: bool = False  # streams logs of its own (image build, node setup) beyond the share's log.txt
    gpus: bool = True  # gives runs GPUs
    multi_node: bool = False  # runs on several machines
    local_kernels: bool = True  # runs use this machine's kernels: their framework environments must be ready here
    detached: bool = False  # runs outlive the submitting process (``submit --no-wait`` returns at once)
    gpu_slots: bool = False  # places runs on this machine's GPU slots: runs_per_gpu and max_parallel are its knobs
    managed_cluster: bool = False  # has a cluster nbbatch creates, resizes and deletes (``backend.cluster``: a
    # backends.cluster.ManagedCluster; ``nbbatch cluster`` and the form's button use it)
    containers: bool = False  # runs execute inside the frameworks' images (``nbbatch images``)
    parallel_limit: bool = True  # holds a batch to max_parallel runs at once (else only a search's driver does)


class Backend(ABC):
    """Where runs execute. Register a subclass with :func:`nbbatch.backends.register_backend`."""

    name: ClassVar[str]
    capabilities: ClassVar[Capabilities] = Capabilities()
    Settings: ClassVar[type] = NoSettings  # a frozen dataclass: one field per setting (see nbbatch.backends.settings)
    settings: Any  # the validated Settings instance: read ``self.settings.max_parallel``
    settings_hint: ClassVar[str] = ""  # added to the unknown-setting error (e.g. where else a key belongs)
    poll_s: float | None = None  # how often :meth:`wait` reads the records (None: by the share's kind)
    _queued: QueuedRecords | None = None  # the queued records :meth:`launch` is writing
    heartbeat_s: ClassVar[float] = 10.0  # how often :meth:`wait` calls :meth:`heartbeat`
    waits_by_default: ClassVar[bool] = True  # whether ``submit`` waits for the runs unless told (``--wait``/``--no-wait``)

    def __init__(self, settings: Any = None, /, **values: Any) -> None:
        """Configure from a :attr:`Settings` instance and/or settings by name (the experiment's ``backend:``
        mapping); values given by name replace the instance's. A :class:`BackendError` names the first mistake."""
        given = {**(settings_values(settings) if settings is not None else {}), **values}
        self.settings = self.validate_settings(given)

    # --- settings ------------------------------------------------------------------------------------

    @classmethod
    def setting_table(cls) -> dict[str, Setting]:
        """Every setting of this backend, by name (from :attr:`Settings`)."""
        return setting_table(cls.Settings)

    @classmethod
    def validate_settings(cls, settings: Mapping[str, Any]) -> Any:
        """The :attr:`Settings` of these values (defaults filled in); a :class:`BackendError` names the first mistake.

        Values are never echoed for secret-looking names: a mistaken setting may hold a key.
        """
        return validated(cls.Settings, cls.name, settings, cls.settings_hint)

    @classmethod
    def form_settings(cls) -> dict[str, Setting]:
        """The settings a form (``setup_cluster``) shows, by name."""
        return {k: s for k, s in cls.setting_table().items() if s.label and not s.python_only}

    @classmethod
    def storable_settings(cls, settings: Mapping[str, Any]) -> dict[str, Any]:
        """Settings safe to keep on disk: nothing that looks secret at any depth, no Python objects.

        A setting (or an entry nested in one, ``env: {AZURE_STORAGE_KEY: …}``, ``[{DATABASE_URL: …}]``) is
        left out when :func:`nbbatch.redact.is_secret` flags its name or value; so are credentials and
        clients (``python_only`` settings, values that are not plain JSON).
        """
        table = cls.setting_table()
        kept = {}
        for key, value in settings.items():
            setting = table.get(key)
            if is_secret(key, value) or (setting is not None and setting.python_only):
                continue
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                continue
            kept[key] = without_secrets(value)
        return kept

    # --- what each backend implements ---------------------------------------------------------------

    @abstractmethod
    def compute(self) -> Compute:
        """The GPUs/nodes this backend can use."""

    @abstractmethod
    def start(self, runs: Sequence[Run], share: Share, options: SubmitOptions) -> None:
        """Start ``runs`` (their ``queued`` records are written); each writes its files to the share.

        A backend that is not :attr:`Capabilities.detached` returns when every run is final.
        """

    def check(self, runs: Sequence[Run], options: SubmitOptions | None = None) -> None:
        """Refuse runs this backend cannot place, before anything starts (raise a :class:`NbbatchError`).

        Subclasses call this first: it refuses what only a backend with :attr:`Capabilities.gpu_slots` does."""
        if options is not None and options.mps and not self.capabilities.gpu_slots:
            raise BackendError(f"resources.mps: nbbatch starts a CUDA MPS daemon only for the GPUs of this machine "
                               f"(backend `local`); on `{self.name}` turn MPS on on the nodes themselves, and drop "
                               "resources.mps from the experiment")

    def check_share(self, share: Share) -> None:
        """Refuse a share the backend's runs cannot reach, before anything starts."""
        return None

    def prepare_environments(self, frameworks: Sequence[str], project: Project, build: bool = False,
                             progress: bool = True) -> None:
        """Before planning: build the frameworks' missing environments when ``build`` (``submit --build-envs``).

        By default these are this machine's venvs, for a backend whose runs use :attr:`Capabilities.local_kernels`."""
        if build and frameworks and self.capabilities.local_kernels:
            build_envs(frameworks, project, progress=progress)

    @classmethod
    def node_placement(cls, run: Run, environ: Mapping[str, str], share: Share | None = None) -> NodePlacement | None:
        """Where this node is in a distributed run's gang, from the variables the backend's cluster set (read by
        ``nbbatch run-one`` on the node, after nbbatch's own ``NBBATCH_NODE_RANK``/``NBBATCH_ENDPOINTS``); None: not set.

        ``share`` is the experiment's, should the nodes exchange their addresses through it. run-one finds the hook
        through the registry (:func:`nbbatch.backends.node_placement_hook`)."""
        return None

    def in_flight(self, share: Share, record: RunRecord) -> bool:
        """Whether an unfinished run is still queued or running in this backend (so it is not started twice)."""
        return False

    def sync(self, experiment: str, share: Share, run_ids: Sequence[str] | None = None) -> None:
        """Bring run records up to date with the backend's own view of its runs (e.g. job states)."""
        return None

    def lost_runs(self, experiment: str, share: Share, records: Sequence[RunRecord]) -> dict[str, RunError]:
        """Of this backend's unfinished runs, those whose execution is gone, with why (they are marked failed)."""
        return {}

    def heartbeat(self, experiment: str, share: Share, pending: Sequence[str]) -> None:
        """Called every :attr:`heartbeat_s` while :meth:`wait` waits (e.g. to notice a lost supervisor)."""
        return None

    def interrupted(self, experiment: str, share: Share, pending: Sequence[str]) -> None:
        """Ctrl-C while :meth:`wait` waits: by default the runs go on in the backend (only the waiting stops)."""
        return None

    def cancel(self, experiment: str, share: Share, run_ids: Sequence[str] | None = None,
               request: StopRequest = CANCEL_REQUEST) -> list[str]:
        """Cancel runs (all unfinished ones when ``run_ids`` is None); return the ids asked to stop. ``request``
        says why (a search's pruner: the runs end ``pruned``)."""
        return write_cancel_markers(share, experiment, list(run_ids) if run_ids else None, request)

    def stream_log(self, experiment: str, share: Share, run_id: str, follow: bool = False) -> Iterator[str] | None:
        """Stream a run's log from the backend; ``None`` means: read ``log.txt`` from the share."""
        return None

    # --- a detached driver (``nbbatch submit --detach``) ------------------------------------------------

    def start_driver(self, name: str, args: Sequence[str], log: Path, cwd: Path, command: str) -> DetachedDriver:
        """Start the driver of ``name`` (``python ARGS``, nbbatch's interpreter) where it outlives the user's
        logout, its output to ``log``; return how it was started. By default a background process of this machine
        in a session of its own (:mod:`nbbatch.backends.detached`); a batch system may run it as a job instead."""
        return start_process(name, self.name, args, log, cwd, command)

    @classmethod
    def driver_state(cls, driver: DetachedDriver) -> DriverState:
        """How a driver this backend started (:meth:`start_driver`) is now: running, or ended with its exit code."""
        return process_state(driver)

    # --- the lifecycle every backend shares ---------------------------------------------------------

    def parallel_limit(self, options: SubmitOptions) -> int | None:
        """At most how many runs of a submission execute at once (see :func:`parallel_limit`); None: as many as the
        compute has room for."""
        return parallel_limit(options.max_parallel, getattr(self.settings, "max_parallel", None))

    def triage(self, runs: Sequence[Run], share: Share, force: bool = False) -> SubmitOutcome:
        """Which runs to start: not those that already succeeded or were pruned (unless ``force``), nor those still in
        flight."""
        outcome = SubmitOutcome()
        folders = set(run_ids(share, runs[0].experiment)) if runs else set()  # one listing, not a read per run
        for run in runs:
            # a corrupt record stops here, naming its path
            record = read_record(share, run.experiment, run.run_id) if run.run_id in folders else None
            done, note = done_before(share, run.experiment, run.run_id, record) if not force else (False, None)
            if note:
                outcome.notes.append(note)
            if done:
                outcome.skipped.append(run.run_id)
            elif record is not None and not record.final and not force and self.in_flight(share, record):
                outcome.in_flight.append(run.run_id)
            else:
                outcome.started.append(run.run_id)
        return outcome

    def launch(self, runs: Sequence[Run], share: Share, options: SubmitOptions) -> None:
        """Start ``runs`` longest-first with fresh ``queued`` records; with ``options.wait``, return when all are final."""
        if not runs:
            return
        self.check_share(share)
        self.check(runs, options)
        options.earlier, _problems = load_records(share, runs[0].experiment)  # before the queued records replace them
        todo = order_longest_first(runs, options.earlier)
        clear_run_cancels(share, todo[0].experiment, [r.run_id for r in todo])  # before the queued records
        notify = options.guarded_update
        fresh = {r.run_id: options.force or r.status in DONE_STATUSES for r in options.earlier}
        self._queued = queued = QueuedRecords(share, self.name, todo, fresh, notify)
        try:
            queued.write(todo[:QUEUED_FIRST])
            if self.capabilities.gpu_slots:  # the local scheduler claims each run as it starts it (claim_queued)
                queued.write_in_background(todo[QUEUED_FIRST:])
            else:  # a cluster's start() hands over every run at once: each has its queued record first
                queued.write(todo[QUEUED_FIRST:])
            self.start(todo, share, options)
        finally:
            late_error = queued.finish()
            self._queued = None
        if late_error is not None:  # the runs wrote their own records since: what they say stands
            _log.warning("writing the queued records in the background failed: %s", late_error)
        if options.wait and self.capabilities.detached:
            self.wait(todo[0].experiment, share, [r.run_id for r in todo], notify)

    def claim_queued(self, run_id: str) -> None:
        """Called by a :meth:`start` that starts runs one at a time, as it starts (or ends) each: the run's queued
        record, when not written yet, is left to its executor, so it never overwrites a newer one."""
        if self._queued is not None:
            self._queued.claim(run_id)

    def finalize(self, share: Share, run: Run | RunRecord, status: Status, error: RunError | None = None,
                 notify: UpdateCallback | None = None) -> RunRecord:
        """End a run's record with ``status`` and ``error`` (see :func:`~nbbatch.store.runfiles.finalize_record`)."""
        self.claim_queued(run.run_id)  # a queued record written late must not replace this one
        record = finalize_record(share, run, status, error, self.name)
        if notify is not None:
            guarded(notify)(record)
        return record

    def refresh(self, experiment: str, share: Share) -> None:
        """Bring the share's records up to date: the backend's own view first, then fail runs that are lost."""
        self.sync(experiment, share)
        records, _problems = load_records(share, experiment)
        open_runs = [r for r in records if not r.final and r.backend == self.name]
        if open_runs:
            for run_id, error in self.lost_runs(experiment, share, open_runs).items():
                current = read_record_or_none(share, experiment, run_id)
                if current is not None and not current.final:
                    self.finalize(share, current, Status.FAILED, error)

    def wait(self, experiment: str, share: Share, run_ids: Sequence[str],
             on_update: UpdateCallback | None = None) -> None:
        """Poll until every run in ``run_ids`` is final, reporting each change through ``on_update``."""
        notify = guarded(on_update)
        poll = self.poll_s if self.poll_s is not None else poll_interval(share)
        seen: dict[str, tuple[Any, ...]] = {}
        pending = list(run_ids)
        last_beat = time.monotonic()
        try:
            while pending:
                self.sync(experiment, share, pending)
                for run_id in list(pending):
                    record = read_record(share, experiment, run_id)
                    if record is None:
                        continue
                    key = (record.status, record.attempts, record.cells_done, record.ended_at)
                    if seen.get(run_id) != key:
                        seen[run_id] = key
                        notify(record)
                    if record.final:
                        pending.remove(run_id)
                if pending and time.monotonic() - last_beat > self.heartbeat_s:
                    last_beat = time.monotonic()
                    self.heartbeat(experiment, share, pending)
                if pending:
                    time.sleep(poll)
        except KeyboardInterrupt:
            self.interrupted(experiment, share, pending)
            raise


class QueuedRecords:
    """The ``queued`` records of a launch, written :data:`QUEUED_WRITERS` at a time and, past the first runs, in
    the background while those runs go: 10^5 records take a minute to write, the first runs should not wait.

    Each run's record is written once, by whoever comes first: this writer, or whoever starts or ends the run
    and :meth:`claims <claim>` it first (its executor then writes the record from scratch). A run that ran
    before has its old outputs cleared (and its checkpoints when ``fresh``) either way.
    """

    def __init__(self, share: Share, backend: str, runs: Sequence[Run], fresh: Mapping[str, bool],
                 notify: UpdateCallback) -> None:
        self.share, self.backend, self.notify = share, backend, notify
        self.runs = {r.run_id: r for r in runs}
        self.fresh = fresh  # run id -> clear its checkpoints too; only runs that ran before are in it
        self.handled: set[str] = set()  # written, or claimed
        self.writing: set[str] = set()
        self.changed = threading.Condition()
        self.stopped = False
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None

    def _take(self, run_id: str) -> bool:
        with self.changed:
            while run_id in self.writing:
                self.changed.wait()
            if run_id in self.handled or self.stopped:
                return False
            self.writing.add(run_id)
            return True

    def _done(self, run_id: str) -> None:
        with self.changed:
            self.writing.discard(run_id)
            self.handled.add(run_id)
            self.changed.notify_all()

    def _clear_earlier(self, run: Run) -> None:
        if run.run_id in self.fresh:
            clear_run_folders(self.share, run, fresh=self.fresh[run.run_id])

    def _write_one(self, run: Run) -> None:
        if not self._take(run.run_id):
            return
        try:
            self._clear_earlier(run)
            record = new_record(run, self.backend)
            write_record(self.share, record)
            self.notify(record)
        finally:
            self._done(run.run_id)

    def claim(self, run_id: str) -> None:
        """The run starts or ends now: its queued record is not written any more (it waits for one being written)."""
        run = self.runs.get(run_id)
        if run is None or not self._take(run_id):
            return
        try:
            self._clear_earlier(run)
        finally:
            self._done(run_id)

    def write(self, runs: Sequence[Run]) -> None:
        """Write these runs' records (in order, a few at once); the first error is raised."""
        with ThreadPoolExecutor(QUEUED_WRITERS, thread_name_prefix="queued") as pool:
            for start in range(0, len(runs), QUEUED_WRITERS * 4):  # a few futures at a time, not 10^5
                list(pool.map(self._write_one, runs[start:start + QUEUED_WRITERS * 4]))
                if self.stopped:
                    return

    def write_in_background(self, runs: Sequence[Run]) -> None:
        """:meth:`write` in a thread; :meth:`finish` returns its error."""
        def write() -> None:
            try:
                self.write(runs)
            except BaseException as exc:  # noqa: BLE001 - raised again by finish()
                self.error = exc
                with self.changed:
                    self.stopped = True  # the runs' executors write their own records (or meet the same error)

        self.thread = threading.Thread(target=write, name="queued-records", daemon=True)
        self.thread.start()

    def finish(self) -> BaseException | None:
        """Stop writing (when the start ended early), wait for the writes in flight; the background writer's error."""
        with self.changed:
            self.stopped = True
        if self.thread is not None:
            self.thread.join()
        return self.error


def parallel_limit(experiment: int | None, backend: int | None) -> int | None:
    """The one rule for ``max_parallel``, the same on every backend: the experiment's ``resources.max_parallel`` and
    the backend's own ``max_parallel`` setting are both limits, so the smaller wins when both are given; None when
    neither is."""
    return min((k for k in (experiment, backend) if isinstance(k, int) and k > 0), default=None)


def order_longest_first(runs: Sequence[Run], records: Sequence[RunRecord]) -> list[Run]:
    """Runs ordered by past duration (from the experiment's ``records``), longest (or never seen) first:
    shortens the makespan."""
    if not runs:
        return []
    by_id = {r.run_id: r for r in records}
    by_framework: dict[str, list[float]] = {}
    for rec in records:
        if rec.duration_s and rec.status == Status.SUCCEEDED:
            by_framework.setdefault(rec.framework or rec.notebook, []).append(rec.duration_s)
    means = {k: sum(v) / len(v) for k, v in by_framework.items()}

    def past(run: Run) -> float:
        record = by_id.get(run.run_id)
        if record and record.duration_s:
            return record.duration_s
        return means.get(run.framework or run.notebook_rel, float("inf"))

    return sorted(runs, key=lambda r: -past(r))


__all__ = ["Backend", "Capabilities", "Compute", "Setting", "SubmitOptions", "SubmitOutcome", "guarded",
           "order_longest_first", "parallel_limit"]


def clear_run_folders(share: Share, run: Run, fresh: bool) -> None:
    """Before a run starts again: its old outputs go; its checkpoints too when it starts ``fresh`` (forced, or
    rerunning a succeeded run), else the new attempt resumes from them (a run that failed or was lost)."""
    paths = run_paths(run.experiment, run.run_id)
    share.remove(paths.outputs)
    share.remove(paths.ranks)  # a distributed run's gang markers and ranks' files are of one launch
    if fresh:
        share.remove(paths.checkpoints)
