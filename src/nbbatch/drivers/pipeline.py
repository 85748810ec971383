"""The pipeline driver: a pipeline's stages, each an ordinary experiment, started as the stages they need end.

It holds the pipeline's lock and lease as the other drivers hold an experiment's. A stage starts when every stage
it needs has succeeded: its references are resolved from those stages' records (the best run by the stage's
``select:``, a one-run stage's outputs folder, every run), and where each value came from goes into the stage's
experiment (:attr:`~nbbatch.spec.experiment.Experiment.origins`, so into every run record). Independent stages
run at the same time, each on its own backend, through the same submission as ``nbbatch submit`` of an experiment
(``submit_stage``, given by :mod:`nbbatch.api`). A stage that failed (any run failed, unless it allows failures)
or was cancelled blocks the stages that need it, named; the others go on. ``pipeline.json`` on the share says
where every stage stands; a stage's runs are skipped when they succeeded before (their ids hold their notebooks,
parameters and resolved inputs), so submitting again resumes where the pipeline stopped.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from nbbatch.drivers.base import SubmitResult, lock_path
from nbbatch.drivers.notify import Outcome, send_notifications
from nbbatch.errors import NbbatchError
from nbbatch.results.pipeline import best_record, finished, outputs_location, read_pipeline_state, run_summary
from nbbatch.results.status import summary_counts
from nbbatch.spec.experiment import Experiment
from nbbatch.spec.pipeline import Pipeline, Reference, referring_value, substitute
from nbbatch.spec.project import find_project
from nbbatch.store.known import remember
from nbbatch.store.layout import experiment_paths
from nbbatch.store.lease import ShareLease
from nbbatch.store.lock import ExperimentLock
from nbbatch.store.runfiles import cancel_requested, clear_cancel
from nbbatch.store.runjson import RunRecord, Status, utc_now
from nbbatch.store.share import Share

CANCEL_POLL_S = 1.0  # how often a waiting driver looks for the pipeline's cancel marker


@dataclass
class StageSubmission:
    """What submitting one stage gave: its experiment's result and the ids its plan had (its identity)."""

    result: SubmitResult
    planned: list[str]


# (the stage's experiment, force, the run ids of its last submission when that succeeded) → what it did
SubmitStage = Callable[[Experiment, bool, "list[str] | None"], StageSubmission]


@dataclass
class StageOutcome:
    """Where one stage stands, as ``pipeline.json`` keeps it."""

    state: str = "pending"
    experiment: str = ""
    backend: str = ""
    needs: list[str] = field(default_factory=list)
    select: dict[str, str] | None = None
    varies: list[str] = field(default_factory=list)  # the parameters its runs differ in (what `status` shows)
    runs: list[str] = field(default_factory=list)
    planned: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    best: dict[str, Any] | None = None
    resolved: dict[str, Any] = field(default_factory=dict)  # "parameters.LR" → {value, reference, stage, run}
    reason: str | None = None
    started_at: str | None = None
    ended_at: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class PipelineResult:
    """What a pipeline submission did: every stage's outcome, and what was said along the way."""

    pipeline: str
    share: str
    stages: dict[str, StageOutcome]
    warnings: list[str] = field(default_factory=list)

    @property
    def state(self) -> str:
        """The pipeline's end: cancelled if a stage was, else failed if a stage failed or was blocked, else succeeded."""
        states = {s.state for s in self.stages.values()}
        if "cancelled" in states:
            return "cancelled"
        return "failed" if states & {"failed", "blocked", "pending", "running"} else "succeeded"

    @property
    def ok(self) -> bool:
        return self.state == "succeeded"


class PipelineDriver:
    """Runs a pipeline's stages in dependency order; see the module's docstring.

    ``force`` names stages whose runs run again although they succeeded (with every stage that needs them);
    ``say`` receives one line per stage start and end.
    """

    def __init__(self, pipeline: Pipeline, share: Share, submit_stage: SubmitStage, *,
                 cancel_stage: Callable[[str], object], force: Collection[str] = (),
                 say: Callable[[str], None] = lambda line: None) -> None:
        unknown = [s for s in force if s not in pipeline.stages]
        if unknown:
            raise NbbatchError(f"--force {unknown[0]}: pipeline `{pipeline.name}` has no such stage; its stages: "
                               f"{', '.join(pipeline.stages)}")
        self.pipeline, self.share, self.submit_stage, self.cancel_stage = pipeline, share, submit_stage, cancel_stage
        self.forced = {d for s in force for d in (s, *pipeline.dependents(s))}
        self.say = say
        self.outcomes = {name: StageOutcome(experiment=pipeline.experiment_name(name), needs=list(stage.needs),
                                            select=stage.select.__dict__ if stage.select else None,
                                            backend=_backend_name(stage.data.get("backend", pipeline.backend)))
                         for name, stage in pipeline.stages.items()}
        self.result = PipelineResult(pipeline.name, share.url, self.outcomes)
        self._write = threading.Lock()
        self._submissions: dict[str, StageSubmission] = {}  # by stage: what its submission gave
        self._succeeded_before: dict[str, list[str] | None] = {}  # by stage: its runs, when it last succeeded
        self._ran = False  # whether any stage started a run (a pipeline that ran nothing notifies nobody)

    def submit(self) -> PipelineResult:
        """The whole pipeline, under its lock and lease; returns when every stage has ended or is blocked."""
        name = self.pipeline.name
        project = find_project(self.pipeline.base_dir)
        remember(project, name, self.share.url, self.outcomes[self.pipeline.order()[0]].backend, {})
        with ExperimentLock(lock_path(project, self.share, name), name) as lock, \
                ShareLease(self.share, name, command=lock.command):
            clear_cancel(self.share, name)
            last = read_pipeline_state(self.share, name) or {"stages": {}}
            self._succeeded_before = {stage: state.get("planned") for stage, state in last["stages"].items()
                                      if isinstance(state, dict) and state.get("state") == "succeeded"}
            self._save()
            with ThreadPoolExecutor(max_workers=len(self.pipeline.stages), thread_name_prefix="stage") as pool:
                try:
                    self._drive(pool)
                except BaseException:  # Ctrl-C, SIGTERM, SIGHUP (the CLI raises them here): stop every stage
                    self._cancel_running("the pipeline's driver was interrupted")
                    raise
                finally:
                    self._save()
        if self.pipeline.notify is not None and self._ran:
            self.result.warnings.extend(send_notifications(self.pipeline.notify, self._outcome()))
        return self.result

    def _outcome(self) -> Outcome:
        """How the pipeline ended, for its ``notify:``: every stage's runs counted, a line per stage."""
        counts: dict[str, int] = {}
        lines = []
        for name, outcome in self.outcomes.items():
            for status, count in outcome.counts.items():
                counts[status] = counts.get(status, 0) + count
            best = outcome.best
            select = outcome.select
            shown = f"; best {select['metric']} {best['metrics'][select['metric']]:.4g}: run {best['run_id']}" \
                if best and select and select["metric"] in best["metrics"] else ""
            lines.append(f"stage {name} {outcome.state}" + (f" ({_counts(outcome.counts)})" if outcome.counts else "")
                         + shown
                         + (f": {outcome.reason}" if outcome.reason and outcome.state != "succeeded" else ""))
        starts = [o.started_at for o in self.outcomes.values() if o.started_at]
        ends = [o.ended_at for o in self.outcomes.values() if o.ended_at]
        return Outcome("pipeline", self.pipeline.name, self.result.state,
                       f"{self.share.url.rstrip('/')}/{self.pipeline.name}", counts, lines,
                       min(starts, default=None), max(ends, default=None))

    def _drive(self, pool: ThreadPoolExecutor) -> None:
        running: dict[Future[StageSubmission], str] = {}
        cancelled = False
        while True:
            if not cancelled:
                for stage in self._ready():
                    running[pool.submit(self._start, stage)] = stage
            self._block_dependents_of_ended()
            if not running:
                return
            finished, _ = wait(list(running), timeout=CANCEL_POLL_S, return_when=FIRST_COMPLETED)
            for future in finished:
                self._finish(running.pop(future), future)
            if not cancelled and cancel_requested(self.share, self.pipeline.name):
                cancelled = True
                self._cancel_running("the pipeline was cancelled")
            if cancelled:
                for outcome in self.outcomes.values():
                    if outcome.state == "pending":
                        outcome.state, outcome.reason = "cancelled", "the pipeline was cancelled before it started"
                self._save()

    def _ready(self) -> list[str]:
        ready = []
        for name in self.pipeline.order():
            outcome = self.outcomes[name]
            if outcome.state == "pending" and all(self.outcomes[n].state == "succeeded" for n in outcome.needs):
                outcome.state, outcome.started_at = "running", utc_now()
                ready.append(name)
        if ready:
            self._save()
        return ready

    def _block_dependents_of_ended(self) -> None:
        changed = False
        for name in self.pipeline.order():
            outcome = self.outcomes[name]
            if outcome.state != "pending":
                continue
            stopped = [n for n in outcome.needs if self.outcomes[n].state in ("failed", "cancelled", "blocked")]
            if stopped:
                upstream = self.outcomes[stopped[0]]
                outcome.state = "blocked"
                outcome.reason = f"stage `{stopped[0]}` {upstream.state}" + (f": {upstream.reason}" if upstream.reason else "")
                outcome.ended_at = utc_now()
                self.say(f"stage {name}: blocked ({outcome.reason})")
                changed = True
        if changed:
            self._save()

    def _start(self, name: str) -> StageSubmission:
        """A stage thread: resolve its references, then submit its experiment and wait for it."""
        values, origins = self._resolve(name)
        experiment = self.pipeline.experiment(name, values)
        experiment.origins = origins
        outcome = self.outcomes[name]
        outcome.resolved = origins
        outcome.varies = sorted(_varied(experiment))
        self.say(f"stage {name}: started on {outcome.backend}"
                 + "".join(f"; {k} = {o['value']!r} from {o['reference']}" for k, o in origins.items()
                           if not isinstance(o["value"], list)))
        return self.submit_stage(experiment, name in self.forced, self._succeeded_before.get(name))

    def _resolve(self, name: str) -> tuple[dict[tuple[str, str], Any], dict[str, Any]]:
        """The values of a stage's references from the stages it needs (all succeeded), and where each came from."""
        values: dict[tuple[str, str], Any] = {}
        origins: dict[str, Any] = {}
        stage = self.pipeline.stages[name]
        for (key, item), refs in stage.references.items():
            resolved = {}
            for ref in refs:
                value, runs = self._value(ref)
                resolved[ref.text] = value
                origins[_where(key, item)] = {"reference": ref.text, "stage": ref.stage,
                                            "experiment": self.pipeline.experiment_name(ref.stage),
                                            "run": runs[0] if len(runs) == 1 else runs, "value": value}
            values[(key, item)] = substitute(referring_value(stage, key, item), refs, resolved)
            origins[_where(key, item)]["value"] = values[(key, item)]
        return values, origins

    def _value(self, ref: Reference) -> tuple[Any, list[str]]:
        upstream = self.outcomes[ref.stage]
        records = self._records(ref.stage)
        if ref.path == ("runs",):
            chosen = [r for r in records if finished(r)]  # a continued trial's runs: its last, complete one
            return [run_summary(self.share, r) for r in chosen], [r.run_id for r in chosen]
        if ref.path == ("outputs",):
            [record] = records  # checked when the file was read: a stage of one run
            return outputs_location(self.share, record), [record.run_id]
        select = self.pipeline.stages[ref.stage].select
        best = best_record(records, select) if select else None
        if best is None:
            raise NbbatchError(f"{ref.text}: no run of stage `{ref.stage}` succeeded with a number for "
                               f"`{select.metric if select else '?'}`"
                               + (f" within select.where ({select.describe()})" if select and select.where else "")
                               + f" ({_counts(upstream.counts)})")
        summary = run_summary(self.share, best)
        field_name = ref.path[1]
        if field_name in ("parameters", "metrics"):
            if ref.path[2] not in summary[field_name]:
                raise NbbatchError(f"{ref.text}: the best run of stage `{ref.stage}` ({best.run_id}) has no "
                                   f"{field_name[:-1]} `{ref.path[2]}`; it has {', '.join(summary[field_name]) or 'none'}")
            return summary[field_name][ref.path[2]], [best.run_id]
        return summary[field_name], [best.run_id]

    def _records(self, stage: str) -> list[RunRecord]:
        return self._submissions[stage].result.records

    def _finish(self, name: str, future: Future[StageSubmission]) -> None:
        outcome = self.outcomes[name]
        outcome.ended_at = utc_now()
        try:
            submission = future.result()
        except NbbatchError as exc:  # e.g. a resolved input that is no folder, a backend that refuses the stage
            outcome.state, outcome.reason = "failed", str(exc)
            self.say(f"stage {name}: failed before its runs started: {exc}")
            self._save()
            return
        self._submissions[name] = submission
        self._ran = self._ran or bool(submission.result.started)
        records = submission.result.records
        outcome.runs = [r.run_id for r in records]
        outcome.planned = submission.planned
        outcome.counts = summary_counts(records)
        outcome.state, outcome.reason = _stage_state(records, self.pipeline.stages[name].allow_failures)
        select = self.pipeline.stages[name].select
        best = best_record(records, select) if select else None
        outcome.best = run_summary(self.share, best) if best else None
        shown = f"; best {best.run_id} {select.metric}={best.metrics[select.metric]:.4g}" if best and select else ""
        self.say(f"stage {name}: {outcome.state} ({_counts(outcome.counts)}){shown}"
                 + (f": {outcome.reason}" if outcome.reason and outcome.state != "succeeded" else ""))
        self.result.warnings.extend(f"stage {name}: {w}" for w in submission.result.warnings)
        self._save()

    def _cancel_running(self, why: str) -> None:
        for outcome in self.outcomes.values():
            if outcome.state == "running":
                try:
                    self.cancel_stage(outcome.experiment)
                except NbbatchError:  # its experiment has no folder yet: nothing started to cancel
                    pass
                outcome.reason = why

    def _save(self) -> None:
        """Write ``pipeline.json`` (atomically, as every share write)."""
        with self._write:
            state = {"pipeline": self.pipeline.name, "updated": utc_now(), "state": self._overall(),
                     "source": str(self.pipeline.source) if self.pipeline.source else None,
                     "stages": {name: o.to_dict() for name, o in self.outcomes.items()}}
            self.share.write_bytes(experiment_paths(self.pipeline.name).pipeline_state,
                                   json.dumps(state, indent=2, default=str).encode())

    def _overall(self) -> str:
        states = {o.state for o in self.outcomes.values()}
        return "running" if states & {"pending", "running"} else self.result.state



def _stage_state(records: list[RunRecord], allow_failures: bool) -> tuple[str, str | None]:
    """A stage's end from its runs' records: cancelled, failed (unless failures are allowed and a run
    succeeded), else succeeded."""
    if not records:
        return "failed", "it has no runs"
    if any(r.status == Status.CANCELLED for r in records):
        return "cancelled", None
    failed = [r for r in records if r.status in (Status.FAILED, Status.TIMED_OUT)]
    unfinished = [r for r in records if not r.final]
    if unfinished:
        return "failed", f"run {unfinished[0].run_id} is still {unfinished[0].status.value}"
    succeeded = [r for r in records if r.status == Status.SUCCEEDED]
    if failed and not (allow_failures and succeeded):
        first = failed[0]
        why = first.error_summary() or first.status.value
        return "failed", f"run {first.run_id} {first.status.value}: {why}"
    return "succeeded", (f"{len(failed)} run(s) failed (allowed)" if failed else None)


def _counts(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no runs"


def _varied(experiment: Experiment) -> set[str]:
    combos = experiment.combinations()
    varied = {k for k in combos[0] if any(c.get(k) != combos[0][k] for c in combos)}
    return varied | ({p.name for p in experiment.search.params} if experiment.search else set())


def _where(key: str, item: str) -> str:
    """How origins name a resolved value: ``parameters.LR``, ``inputs.DATA_DIR``, or a whole key (``frameworks``)."""
    return f"{key}.{item}" if item else key


def _backend_name(backend: Any) -> str:
    return str(backend.get("name", "local")) if isinstance(backend, Mapping) else str(backend)


