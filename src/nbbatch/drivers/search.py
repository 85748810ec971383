"""The search's driver: asks Optuna for trials, runs each as an ordinary run, and stops those its pruner rejects.

One study per notebook of the experiment (each framework's, each notebook's), each with the search's budget of
trials. A trial is a run of the notebook with the trial's parameters (its own run id, record and folder), launched
through the experiment's backend like any other. While it runs, the driver reads its ``metrics.jsonl`` from the share
as it grows and reports every new point of the search's metric to the study; when the pruner says so, it asks the
run to stop through its marker (:class:`~nbbatch.store.runfiles.StopRequest`: the run ends ``pruned``). A run's end
is told to the study: its final metric, pruned, or failed. The decision is kept in the run's record too
(``trial``).

The study's journal (:mod:`nbbatch.search.study`) outlives the driver: started again, the driver finds the trials it
had asked for. A trial whose run is still going (on a cluster) is adopted; one whose run ended meanwhile is told;
one whose run was stopped with its driver (local runs, Ctrl-C) runs again under the same run id, from its
checkpoints. The budget stays the one given: no trial is asked for twice. A journal lost or damaged beyond reading is
rebuilt from the trials' run records when the user asks (``rebuild``: :mod:`nbbatch.search.rebuild`), and a missing
one whose trials are on the share is refused rather than started over.

Like every driver (:class:`~nbbatch.drivers.base.Driver`), it holds the experiment's lock and lease while it runs;
the manifest lists the trials' runs as they start.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from nbbatch.backends.base import Backend
from nbbatch.drivers.base import Driver, Progress
from nbbatch.errors import NbbatchError
from nbbatch.plan.runs import Plan, Run
from nbbatch.results.status import parameters_text
from nbbatch.search.rebuild import rebuild_journal, recorded_trials
from nbbatch.search.study import (
    FAILURE,
    METRIC_MISSING,
    REBUILD_FIX,
    RUN_ID,
    SearchError,
    failure_of,
    journal_path,
    open_study,
    optuna_module,
    report,
    search_fingerprint,
    study_label,
    suggest,
    trial_of,
)
from nbbatch.spec.search import Search
from nbbatch.store.jsonl import JsonlTail
from nbbatch.store.layout import run_paths
from nbbatch.store.lease import Halt
from nbbatch.store.runfiles import (
    StopRequest,
    cancel_requested,
    clear_run_cancels,
    load_records,
    read_record_or_none,
    write_record,
)
from nbbatch.store.runjson import ErrorKind, RunRecord, Status
from nbbatch.store.share import Share, poll_interval


@dataclass
class _Trial:
    """A trial whose run the driver watches."""

    number: int
    run: Run
    trial: Any  # optuna.trial.Trial
    tail: JsonlTail
    reported: int = -1  # the last step reported to the study
    attempt: int = 0  # the attempt of the run that recorded it: a later attempt's steps start again
    last_value: float | None = None
    stop_asked: bool = False
    diverged: str | None = None  # why the driver stopped it itself: its metric became nan or ±inf at a step
    thread: threading.Thread | None = None  # the launch (local runs: the whole run)
    launch_error: str | None = None
    segment: dict[str, Any] = field(default_factory=dict)  # a promoting search's: which part of the trial the run is


@dataclass
class _Study:
    """One notebook's study: its template run (fixed parameters) and the trials in flight."""

    label: str
    template: Run
    study: Any  # optuna.Study
    running: dict[int, _Trial] = field(default_factory=dict)
    metric_seen: bool = False  # a run of this study recorded the metric
    schedule: Any = None  # a promoting search's (nbbatch.search.rungs.Promotions)


class SearchDriver(Driver):
    """Runs the search of ``plan`` (an experiment with ``search:``) on ``backend``; see the module's docstring.

    It waits whatever the caller asked (it judges every run as it goes) and draws its runs as it goes (nothing to
    select with ``only``); ``force`` starts the search afresh.
    """

    def __init__(self, plan: Plan, backend: Backend, share: Share, *, source: object = None, force: bool = False,
                 wait: bool | None = None, progress: Progress = True, only: list[str] | None = None,
                 rebuild: bool = False) -> None:
        assert plan.experiment.search is not None
        _check_search_submit(wait, only, force, rebuild)
        super().__init__(plan, backend, share, source=source, force=force, wait=True, progress=progress)
        self.search: Search = plan.experiment.search
        self.fresh = force
        self.rebuild = rebuild  # the studies' journals are rebuilt from their runs' records first
        self.records: list[RunRecord] | None = None
        self.options = self.submit_options(wait=True, on_update=self.on_update())
        self.run_ids: list[str] = []  # every trial's run, in the order asked
        self.listed: set[str] = set()  # the same, to look up
        self.manifest_state = "unwritten"  # "unwritten", "behind" (run_ids gained runs since) or "written"
        # a trial trains on while its point waits to be judged: locally a read is cheap, and epochs may be short
        self.poll = poll_interval(share, local=0.2, remote=2.0)
        # how often the backend's own view is asked for (job states: a request per run on Azure ML)
        self.sync_s = backend.poll_s if backend.poll_s is not None else poll_interval(share, local=2.0, remote=10.0)
        self.parallel = 1  # trials at once: see run
        self.studies: list[_Study] = []
        self.cancelled = False  # the experiment was cancelled: see _note_cancel

    def say(self, line: str) -> None:
        """Tell what the search does (on the terminal, when it shows progress)."""
        if self.progress is True:
            print(f"nbbatch search: {line}", file=sys.stderr, flush=True)

    def write_runs(self) -> None:
        """The trials' runs so far, if some were noted since the last write: the manifest lists them as they start,
        so ``status`` and ``compare`` show them. Written once per batch of trials (a resumed study's thousands of
        trials are one write); the warning of a name reused by another experiment file is given at the first."""
        if self.manifest_state != "written" and self.run_ids:
            self.write_manifest(list(self.run_ids), warn=self.manifest_state == "unwritten")
            self.manifest_state = "written"

    def run(self, halt: Halt) -> Collection[str]:
        """The whole search; the trials' runs are the ones started and reported."""
        self.options.halt = halt
        self.parallel = max(1, self.backend.parallel_limit(self.options) or self.backend.compute().slots or 1)
        self.result.started = self.trials()
        return self.result.started

    # --- the loop ---------------------------------------------------------------------------------------

    def trials(self) -> list[str]:
        """The whole search, until every study spent its budget and every run ended; the trials' run ids."""
        optuna_module()
        for template in self.plan.runs:
            self.studies.append(self._open(template))
        try:
            for study in self.studies:
                self._stop_if_hopeless(study)  # before any run: it would fail as the ones before it did
                self._resume(study)
            self.write_runs()
            synced = 0.0
            while self._busy():
                self._launch_more()
                self.write_runs()
                for study in self.studies:
                    for trial in list(study.running.values()):
                        self._watch(study, trial)
                if time.monotonic() >= synced + self.sync_s:
                    self._note_cancel()
                    if self.backend.capabilities.detached:
                        self.backend.sync(self.experiment, self.share, [t.run.run_id for t in self._in_flight()])
                    synced = time.monotonic()
                time.sleep(self.poll)
        except KeyboardInterrupt:
            if self.backend.capabilities.detached and self._in_flight():  # they go on; a new driver adopts them
                self.say(f"interrupted: {len(self._in_flight())} trial run(s) go on in {self.backend.name}; submit "
                         "again to resume the search (it adopts them), or `nbbatch cancel` to stop them")
            else:
                self._stop_all()
            raise
        except BaseException:
            self._stop_all()
            raise
        return self.run_ids

    def _busy(self) -> bool:
        return any(s.running or self._left(s) > 0 and not self._halted() for s in self.studies)

    def _halted(self) -> bool:
        """Whether this driver must start no more runs (the experiment was cancelled, or another driver took its
        lease over)."""
        return self.cancelled or self.options.halt is not None and self.options.halt.is_set()

    def _note_cancel(self) -> bool:
        """Whether the whole experiment was cancelled (``nbbatch cancel EXPERIMENT``): the search starts no more
        trials, and those whose runs the cancel stopped stay open in the study, to run again when it resumes."""
        if not self.cancelled and cancel_requested(self.share, self.experiment):
            self.cancelled = True
            self.say("the experiment was cancelled: no more trials start; submit again to resume the search (the "
                     "trials the cancel stopped run again)")
        return self.cancelled

    def _in_flight(self) -> list[_Trial]:
        return [t for s in self.studies for t in s.running.values()]

    def _left(self, study: _Study) -> int:
        """How many trials the study may still ask for."""
        return self.search.trials - len(study.study.get_trials(deepcopy=False))

    def _launch_more(self) -> None:
        if self._halted():
            return
        for study in self.studies:
            while self._left(study) > 0 and len(self._in_flight()) < self.parallel:
                self._ask(study)

    # --- a study and its trials --------------------------------------------------------------------------

    def _open(self, template: Run) -> _Study:
        label = study_label(template.run_id)
        path, name = journal_path(self.plan.experiment.base_dir, self.experiment, label), f"{self.experiment}/{label}"
        fingerprint = search_fingerprint(self.search, template.run_id)
        if self.rebuild:
            rebuild_journal(self.search, path, name, fingerprint, self._records(), self._history, say=self.say)
        elif not self.fresh and not path.exists() and not path.is_symlink():
            told = recorded_trials(self._records(), name)
            if told:  # a journal lost (deleted, or a project copied without it): starting over would redo them
                raise SearchError(f"the search journal {path} is missing, but {len(told)} run(s) on the share "
                                  f"record trials of study `{name}`: {REBUILD_FIX}, or with --force to start the "
                                  "search afresh (a trial that draws the same parameters reuses its run)")
        study = open_study(self.search, path, name, fingerprint, fresh=self.fresh, say=self.say,
                           earlier=[search_fingerprint(self.search, template.run_id, with_budget=True)])
        return _Study(label, template, study)

    def _records(self) -> list[RunRecord]:
        """The experiment's run records (read once: a lost journal is rebuilt from them)."""
        if self.records is None:
            self.records = load_records(self.share, self.experiment)[0]
        return self.records

    def _history(self, run_id: str) -> list[dict[str, Any]]:
        """A run's metric points (its ``metrics.jsonl``)."""
        return JsonlTail(self.share, run_paths(self.experiment, run_id).metrics).read()

    def _resume(self, study: _Study) -> None:
        """The trials a previous driver asked for and never told: adopted, told, or run again."""
        state = optuna_module().trial.TrialState
        for frozen in study.study.get_trials(deepcopy=False):
            if frozen.state == state.COMPLETE and frozen.values is not None:
                study.metric_seen = True
            if frozen.state != state.RUNNING:
                self._note_run(frozen.user_attrs.get(RUN_ID))
                self._note_decision(study, frozen)
                continue
            live = trial_of(study.study, frozen.number)
            # a driver killed between asking and naming the run left some of its parameters undrawn: drawn now (those
            # drawn stay as they were), and the run named
            resumed = self._current_run(study, frozen, live)
            if resumed is None:
                continue
            run, segment = resumed
            if frozen.user_attrs.get(RUN_ID) != run.run_id:
                live.set_user_attr(RUN_ID, run.run_id)
            trial = _Trial(frozen.number, run, live, JsonlTail(self.share, run_paths(self.experiment, run.run_id).metrics),
                           segment=segment)
            self._note_run(run.run_id)
            study.running[trial.number] = trial
            record = read_record_or_none(self.share, self.experiment, run.run_id)
            stopped_with_driver = record is not None and (  # Ctrl-C, or lost with its driver or node: not its fault
                record.status == Status.CANCELLED or _failed_outside_the_notebook(record)
                or not record.final and not self.backend.in_flight(self.share, record))
            if record is None or stopped_with_driver:
                self.say(f"trial {trial.number} of {study.label}: run {run.run_id} starts again (its driver stopped)")
                self._launch(trial)
            else:
                self.say(f"trial {trial.number} of {study.label}: adopted run {run.run_id} ({record.status})")

    def _note_decision(self, study: _Study, frozen: Any) -> None:
        """A trial told to the study whose run's record does not say so (its driver was killed between telling the
        study and writing the record): the record gets the study's decision now."""
        run_id = frozen.user_attrs.get(RUN_ID)
        record = read_record_or_none(self.share, self.experiment, run_id) if run_id else None
        if record is None or record.trial is not None or not record.final:
            return
        state = frozen.state.name.lower()
        decision: dict[str, Any] = {"state": {"fail": "failed"}.get(state, state)}
        if frozen.values is not None:
            decision.update({"values": dict(zip(self.search.metrics, frozen.values, strict=True))} if self.search.multi
                            else {"value": frozen.values[0]})
        elif frozen.intermediate_values:  # pruned: where it was stopped
            step = max(frozen.intermediate_values)
            decision.update({"step": step, "value": frozen.intermediate_values[step]})
        if FAILURE in frozen.user_attrs:
            decision["reason"] = frozen.user_attrs[FAILURE]
        record.trial = {"study": study.study.study_name, "number": frozen.number, **decision}
        write_record(self.share, record)

    def _current_run(self, study: _Study, frozen: Any, live: Any) -> tuple[Run, dict[str, Any]] | None:
        """The run of a trial a previous driver left running, and its segment (none here: a trial is one run)."""
        return self.plan.trial(study.template, suggest(live, self.search)), {}

    def _ask(self, study: _Study) -> None:
        trial = study.study.ask()
        params = suggest(trial, self.search)
        run = self.plan.trial(study.template, params)
        trial.set_user_attr(RUN_ID, run.run_id)
        self._start(study, _Trial(trial.number, run, trial,
                                  JsonlTail(self.share, run_paths(self.experiment, run.run_id).metrics)), params)

    def _start(self, study: _Study, watched: _Trial, params: dict[str, Any]) -> None:
        """Watch a trial's new run, and launch it unless it ran before (its end is then told as it was) or runs."""
        run, trial = watched.run, watched.trial
        study.running[watched.number] = watched
        self._note_run(run.run_id)
        shown = parameters_text(params)
        record = read_record_or_none(self.share, self.experiment, run.run_id)
        if record is not None and record.final and record.status != Status.CANCELLED:
            self.say(f"trial {trial.number} of {study.label}: {shown} ran before as {run.run_id} ({record.status})")
            return  # its history and end are told as they are (_watch)
        if any(t.run.run_id == run.run_id for t in self._in_flight() if t is not watched):
            self.say(f"trial {trial.number} of {study.label}: {shown} is running already as {run.run_id}")
            return
        self.say(f"trial {trial.number} of {study.label}: {shown} → run {run.run_id}")
        self._launch(watched)

    def _note_run(self, run_id: str | None) -> None:
        """A trial's run, for the manifest's next write (:meth:`write_runs`)."""
        if run_id and run_id not in self.listed:
            self.run_ids.append(run_id)
            self.listed.add(run_id)
            if self.manifest_state == "written":
                self.manifest_state = "behind"

    def _launch(self, trial: _Trial) -> None:
        """Start the trial's run through the backend (in a thread: the local backend returns when the run ends)."""
        clear_run_cancels(self.share, self.experiment, [trial.run.run_id])
        options = dataclasses.replace(self.options, wait=False, force=False, earlier=[], runs_at_once=self.parallel)
        trial.tail.offset = 0

        def launch() -> None:
            try:
                self.backend.launch([trial.run], self.share, options)
            except Exception as exc:  # noqa: BLE001 - the trial fails, saying why; the search goes on
                trial.launch_error = f"{type(exc).__name__}: {exc}"

        trial.thread = threading.Thread(target=launch, name=f"trial-{trial.run.run_id}", daemon=True)
        trial.thread.start()

    # --- watching a run ----------------------------------------------------------------------------------

    def _watch(self, study: _Study, trial: _Trial) -> None:
        self._report(study, trial)
        record = read_record_or_none(self.share, self.experiment, trial.run.run_id)
        launch_done = trial.thread is None or not trial.thread.is_alive()
        if record is not None and record.final and launch_done:
            self._report(study, trial, judge=False)  # its last points (written before the record): it has ended
            self._end(study, trial, record)
        elif trial.launch_error is not None and launch_done:
            self._end(study, trial, None)

    def _report(self, study: _Study, trial: _Trial, judge: bool = True) -> None:
        if self.search.multi:  # Optuna takes no intermediate values of a multi-objective trial (nor prunes it)
            return
        metric = self.search.metric
        for point in trial.tail.read():
            if trial.stop_asked:  # the trial is decided: what the run records while it stops is not the study's
                break
            step, value, attempt = point.get("step"), point.get(metric), point.get("attempt", 0)
            if not isinstance(step, int) or isinstance(step, bool) or not isinstance(attempt, int):
                continue
            if (attempt, step) <= (trial.attempt, trial.reported):
                continue
            if not _is_number(value):  # _end says why, once; a diverged value with a pruner ends the trial now
                if judge and self.search.pruner != "none" and _diverged(value):
                    trial.diverged = (f"{metric} was {value} at step {step} (not a finite number): stopped there, "
                                      f"as the search's {self.search.pruner} pruner stops a trial that cannot win")
                    trial.reported = step
                    self._prune(study, trial)
                continue
            report(trial.trial, float(value), step)  # a step reported by an earlier attempt takes this one's value
            trial.attempt, trial.reported, trial.last_value = attempt, step, float(value)
            study.metric_seen = True
            # asked at every point, as a training loop would: points read together (short epochs) must not
            # reach a rung with a later step's value than the other trials were judged by there
            if judge and trial.trial.should_prune():
                self._prune(study, trial)

    def _prune(self, study: _Study, trial: _Trial) -> None:
        metric = self.search.metric
        trial.stop_asked = True
        reason = trial.diverged or (f"stopped at step {trial.reported} by the search's {self.search.pruner} pruner: {metric} "
                  f"{trial.last_value:.6g} is not among the {'lowest' if self.search.mode == 'min' else 'highest'} "
                  "it keeps at this step")
        self.say(f"trial {trial.number} of {study.label}: {reason}")
        request = StopRequest(Status.PRUNED, reason)
        threading.Thread(target=self.backend.cancel, args=(self.experiment, self.share, [trial.run.run_id]),
                         kwargs={"request": request}, daemon=True).start()

    def _end(self, study: _Study, trial: _Trial, record: RunRecord | None) -> None:
        state = optuna_module().trial.TrialState
        del study.running[trial.number]
        if record is not None and record.status == Status.CANCELLED and self._note_cancel():
            self.say(f"trial {trial.number} of {study.label}: run {record.run_id} cancelled with the experiment")
            return  # not told: the trial runs again when the search resumes
        if record is not None and _failed_outside_the_notebook(record):
            self.say(f"trial {trial.number} of {study.label}: run {record.run_id} failed outside its notebook "
                     f"({record.error_summary() or record.status}): the trial stays open, and runs "
                     "again when the search is submitted again")
            record.trial = {"study": study.study.study_name, "number": trial.number, **trial.segment, "state": "open",
                            "reason": "its run failed outside the notebook: it runs again on the next submit"}
            write_record(self.share, record)
            return  # not told: the trial is the notebook's to judge, not the share's or the node's
        if record is None:  # the backend refused to start it
            study.study.tell(trial.trial, state=state.FAIL)
            self.say(f"trial {trial.number} of {study.label}: its run could not start: {trial.launch_error}")
            decision: dict[str, Any] = {"state": "failed", "reason": trial.launch_error}
        elif record.status == Status.PRUNED:
            study.study.tell(trial.trial, state=state.PRUNED)
            decision = {"state": "pruned", "step": trial.reported, "value": trial.last_value,
                        **({"reason": trial.diverged} if trial.diverged else {})}
        elif record.status == Status.SUCCEEDED:
            decision = self._tell_values(study, trial, record)
        else:
            trial.trial.set_user_attr(FAILURE, failure_of(record))
            study.study.tell(trial.trial, state=state.FAIL)
            decision = {"state": "failed", "reason": f"its run {record.status}"}
            self.say(f"trial {trial.number} of {study.label}: run {record.run_id} {record.status}"
                     + (f": {record.error_summary()}" if record.error else ""))
        if record is not None:
            record.trial = {"study": study.study.study_name, "number": trial.number, **trial.segment, **decision}
            write_record(self.share, record)
        self._stop_if_hopeless(study)

    def _tell_values(self, study: _Study, trial: _Trial, record: RunRecord) -> dict[str, Any]:
        """Tell the study a succeeded run's final value of each objective; the decision, for its record. A metric
        missing, or not a finite number (a diverged run: nan, inf), fails this trial only, saying which."""
        state = optuna_module().trial.TrialState
        values = {m: record.metrics.get(m, trial.last_value if not self.search.multi else None)
                  for m in self.search.metrics}
        missing = [m for m, v in values.items() if v is None]
        wrong = [m for m, v in values.items() if v is not None and not _is_number(v)]
        if missing:
            trial.trial.set_user_attr(FAILURE, METRIC_MISSING)
            study.study.tell(trial.trial, state=state.FAIL)
            if not study.metric_seen:
                self._unknown_metric(study, record.run_id)
            decision: dict[str, Any] = {"state": "failed", "reason": f"its run recorded no value of {missing[0]}"}
        elif wrong:  # a diverged run (nan, inf), or a notebook recording text: this trial only
            study.study.tell(trial.trial, state=state.FAIL)
            decision = {"state": "failed", "reason": _not_a_number(wrong[0], values[wrong[0]])}
        else:
            numbers = [float(v) for v in values.values()]
            study.study.tell(trial.trial, numbers if self.search.multi else numbers[0])
            study.metric_seen = True
            shown = ", ".join(f"{m} {v:.6g}" for m, v in zip(values, numbers, strict=True))
            self.say(f"trial {trial.number} of {study.label}: {shown} ({record.run_id})")
            return ({"state": "complete", "values": dict(zip(values, numbers, strict=True))} if self.search.multi
                    else {"state": "complete", "value": numbers[0]})
        if wrong:
            self.say(f"trial {trial.number} of {study.label}: failed ({record.run_id}): {decision['reason']}")
        return decision

    def _stop_if_hopeless(self, study: _Study) -> None:
        """Stop the search (also before a resumed one runs anything) when no trial of ``study`` ever succeeded and
        its notebook fails whatever the parameters: a trial found the metric missing, or the first
        :data:`SAME_FAILURES` trials failed the same way (the same exception in the same cell)."""
        told = [t for t in study.study.get_trials(deepcopy=False) if t.state.is_finished()]
        if any(t.state.name != "FAIL" for t in told):
            return
        failures = [t.user_attrs.get(FAILURE) for t in told]
        if METRIC_MISSING in failures and not study.metric_seen:
            self._unknown_metric(study, told[failures.index(METRIC_MISSING)].user_attrs.get(RUN_ID, "?"))
        first = failures[:SAME_FAILURES]
        if len(first) == SAME_FAILURES and first[0] is not None and first.count(first[0]) == SAME_FAILURES:
            runs = ", ".join(str(t.user_attrs.get(RUN_ID)) for t in told[:SAME_FAILURES])
            raise SearchError(f"the first {SAME_FAILURES} trials of {study.label} all failed the same way ("
                              f"{first[0]}; runs {runs}): its notebook fails whatever the parameters, so the search "
                              "was stopped. Fix the notebook (or what it needs, such as a missing file) and submit "
                              "with --force: the search starts afresh")

    def _unknown_metric(self, study: _Study, run_id: str) -> None:
        record = read_record_or_none(self.share, self.experiment, run_id)
        metrics = record.metrics if record else {}
        recorded = sorted(k for k, v in metrics.items() if _is_number(v))
        metric = next((m for m in self.search.metrics if m not in metrics), self.search.metric)
        raise SearchError(f"search.metric `{metric}` was never recorded: run {run_id} of "
                          f"{study.label} succeeded without it (it recorded {', '.join(recorded) or 'no metrics'}). "
                          f"The notebook must call nbbatch.record(step=..., {metric}=...); or name one of "
                          "those in search.metric. The search was stopped")

    def _stop_all(self) -> None:
        """An error, or Ctrl-C of local runs: stop the runs in flight (their trials run again when the search
        resumes)."""
        trials = self._in_flight()
        if trials:
            self.backend.cancel(self.experiment, self.share, [t.run.run_id for t in trials])
        for trial in trials:
            if trial.thread is not None:
                trial.thread.join(timeout=120)


SAME_FAILURES = 3  # the first trials failing the same way that stop a search no trial of which succeeded


# Failures that say nothing of the trial's parameters: the share could not be written, the node, task, job or driver
# was lost. Such a trial stays open in the study and runs again when the search resumes.
_OUTSIDE_THE_NOTEBOOK = (ErrorKind.SHARE, ErrorKind.INFRA)


def _failed_outside_the_notebook(record: RunRecord) -> bool:
    return record.status == Status.FAILED and record.error is not None and record.error.kind in _OUTSIDE_THE_NOTEBOOK


def _is_number(value: Any) -> bool:
    """Whether ``value`` can be told to the study: a finite number (nbbatch.record keeps nan and inf as text)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _diverged(value: Any) -> bool:
    """Whether a recorded value is nan or ±inf (a float, or the text nbbatch.record keeps them as)."""
    if isinstance(value, float):
        return not math.isfinite(value)
    return isinstance(value, str) and value.strip().lower().lstrip("+-") in ("nan", "inf", "infinity")


def _not_a_number(metric: str, value: Any) -> str:
    """Why a recorded value of the search's metric is no trial's value, for people."""
    text = str(value).strip().lower().lstrip("+-")
    if isinstance(value, float) or isinstance(value, str) and text in ("nan", "inf", "infinity"):
        return f"recorded {metric} = {value}: not a finite number"
    return f"recorded {metric} = {value!r}: not a number"


def _check_search_submit(wait: bool | None, only: list[str] | None, force: bool, rebuild: bool) -> None:
    if force and rebuild:
        raise NbbatchError("--force starts the search afresh and --rebuild-search rebuilds its study from its runs' "
                           "records: give one of them")
    if wait is False:
        raise NbbatchError("a search cannot be submitted without waiting (--no-wait): its driver judges every run as "
                           "it goes and stays up until the search ends. Submit without --no-wait (with --detach if the "
                           "terminal may close); after a Ctrl-C, submit again to resume the search")
    if only:
        raise NbbatchError("--only selects runs of a planned batch, but a search draws its runs as it goes: name "
                           "the notebooks or frameworks to search in the experiment file instead")
