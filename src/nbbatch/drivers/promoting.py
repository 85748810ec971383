"""The driver of a search whose trials pause at rungs and continue from their checkpoints (``search.resource``).

A trial is a chain of ordinary runs, its *segments*: the first trains to the first rung of its bracket (the search
sets the notebook's ``resource`` parameter, e.g. EPOCHS = 1), the run ends and the trial pauses. When the schedule
(:mod:`nbbatch.search.rungs`) promotes it, a new run of the same trial, with the resource raised to the next rung and
``resume_from`` its last run, starts from that run's checkpoints; the notebook resumes as it does after a retry. A
trial that reaches the last rung is told to the study as complete; one the schedule stops at a rung is told pruned
there, with its value at that rung. Nothing below the driver knows about it: each segment is a run like any other.

Each segment's record says which part of the trial it is (``trial``: segment, resource, continues, continued_by,
state); the study's journal keeps each trial's bracket, segments and value at each rung, so a driver started again
rebuilds the schedule and goes on where the last one stopped.
"""

from __future__ import annotations

import contextlib
from typing import Any

from nbbatch.drivers.pbt import PbtSearchDriver
from nbbatch.drivers.search import SearchDriver, _is_number, _Study, _Trial
from nbbatch.drivers.segments import SEGMENTS, SegmentedSearchDriver
from nbbatch.errors import ShareError
from nbbatch.plan.runs import Run
from nbbatch.search.rungs import Decision, Promotions
from nbbatch.search.study import RUN_ID, SearchError, optuna_module, suggest, trial_of
from nbbatch.store.layout import run_paths
from nbbatch.store.runjson import RunRecord, Status

BRACKET = "bracket"  # a trial's user attribute: its bracket of the schedule
RUNG_VALUES = "rung_values"  # a trial's user attribute: {rung index: the metric when it paused there}


class PromotingSearchDriver(SegmentedSearchDriver):
    """A :class:`SearchDriver` whose trials pause and continue; see the module's docstring."""

    def __init__(self, *args: Any, rebuild: bool = False, **kwargs: Any) -> None:
        if rebuild:  # the records hold every segment, but not each trial's bracket: the schedule cannot be rebuilt
            raise SearchError("--rebuild-search cannot rebuild a study whose trials pause and continue yet (its "
                              "journal holds each trial's bracket and rungs): submit with --force to start the search "
                              "afresh (a run that draws the same parameters reuses its run)")
        super().__init__(*args, **kwargs)

    def _open(self, template: Run) -> _Study:
        study = super()._open(template)
        s = self.search.pruner_settings
        study.schedule = Promotions(self.search.rungs, int(s["reduction_factor"]), self.search.mode, self.search.trials,
                                    synchronous=self.search.pruner == "hyperband",
                                    first=int(s.get("min_early_stopping_rate") or 0))
        self._restore(study)
        return study

    def _restore(self, study: _Study) -> None:
        """The schedule as the study's journal left it: each trial's bracket, values at rungs, and run in flight."""
        for frozen in study.study.get_trials(deepcopy=False):
            attrs = frozen.user_attrs
            if BRACKET not in attrs:
                continue  # asked and not yet given a bracket (a driver killed in between): it is failed below
            values = {int(rung): value for rung, value in attrs.get(RUNG_VALUES, {}).items()}
            first = study.schedule.starts[attrs[BRACKET]]
            current = first + len(attrs.get(SEGMENTS, [])) - 1  # the rung its last segment trains to
            running = current if not frozen.state.is_finished() and current not in values else None
            study.schedule.restore(frozen.number, attrs[BRACKET], values, running, frozen.state.is_finished())
            for run_id in attrs.get(SEGMENTS, []):
                self._note_run(run_id)

    # --- trials and their segments -------------------------------------------------------------------

    def _left(self, study: _Study) -> int:
        return super()._left(study) if study.schedule.can_start() else 0

    def _next_to_continue(self, study: _Study) -> int | None:
        return study.schedule.promotion()

    def _current_run(self, study: _Study, frozen: Any, live: Any) -> tuple[Run, dict[str, Any]] | None:
        trial = study.schedule.trials.get(frozen.number)
        if trial is None:  # its driver stopped before giving it a bracket: it never ran
            optuna = optuna_module()
            study.study.tell(live, state=optuna.trial.TrialState.FAIL)
            return None
        if trial.running is None:
            return None  # paused at a rung: the schedule continues it or stops it
        segments = frozen.user_attrs.get(SEGMENTS, [])
        return self._segment_run(study, live, trial.running, segments[-2] if len(segments) > 1 else None,
                                 len(segments) - 1)

    def _segment_run(self, study: _Study, live: Any, rung: int, continues: str | None,
                     segment: int) -> tuple[Run, dict[str, Any]]:
        """The run of ``live``'s segment number ``segment``, training to ``rung`` from the run ``continues``."""
        params = {**suggest(live, self.search), self.search.resource: self.search.rungs[rung]}
        last = rung == len(self.search.rungs) - 1  # a paused run keeps its checkpoints, for its trial to continue
        run = self.plan.trial(study.template, params, resume_from=continues, keep_checkpoints=not last)
        about = {"segment": segment, "resource": self.search.rungs[rung], **({"continues": continues} if continues else {})}
        return run, about

    def _ask(self, study: _Study) -> None:
        live = study.study.ask()
        rung = study.schedule.start(live.number)
        assert rung is not None  # _left says whether a bracket takes more trials
        live.set_user_attr(BRACKET, study.schedule.trials[live.number].bracket)
        run, about = self._segment_run(study, live, rung, None, 0)
        live.set_user_attr(SEGMENTS, [run.run_id])
        live.set_user_attr(RUN_ID, run.run_id)
        self._start_segment(study, live, run, about)

    def _continue(self, study: _Study, number: int) -> None:
        """Launch the promoted trial ``number``'s next segment, from its last run's checkpoints."""
        rung = study.schedule.launched(number)
        live = trial_of(study.study, number)
        segments = list(study.study.get_trials(deepcopy=False)[number].user_attrs.get(SEGMENTS, []))
        run, about = self._segment_run(study, live, rung, segments[-1], len(segments))
        self._chain(study, live, segments, run, about, "promoted", f"trial {number} of {study.label}: promoted to "
                    f"{self.search.resource}={self.search.rungs[rung]}, continuing from run {segments[-1]}")

    # --- a segment's end -------------------------------------------------------------------------------

    def _end(self, study: _Study, trial: _Trial, record: RunRecord | None) -> None:
        schedule = study.schedule
        value = record.metrics.get(self.search.metric, trial.last_value) if record is not None else None
        rung = schedule.trials[trial.number].running
        succeeded = record is not None and record.status == Status.SUCCEEDED and _is_number(value)
        if not succeeded or rung == len(self.search.rungs) - 1:
            super()._end(study, trial, record)  # told (complete, failed, pruned), or left open to run again
            if study.study.get_trials(deepcopy=False)[trial.number].state.is_finished():
                schedule.paused(trial.number, float(value)) if succeeded else schedule.failed(trial.number)
            else:
                schedule.held(trial.number)
        else:
            assert record is not None and rung is not None
            self._pause(study, trial, record, float(value), RUNG_VALUES, rung)
        self._drop_copied_checkpoints(record)
        self._decide(study)

    def _drop_copied_checkpoints(self, record: RunRecord | None) -> None:
        """The checkpoints of the run a segment continued, once the segment has its own copy of them (its record's
        ``continues``): no longer needed. A paused trial's last run keeps its own, as a pruned run does."""
        copied = record.continues if record is not None else None
        if copied and copied.get("checkpoint") is not None:
            with contextlib.suppress(ShareError, OSError):
                self.share.remove(run_paths(self.experiment, copied["run_id"]).checkpoints)

    def _decide(self, study: _Study) -> None:
        """Tell the study the trials its schedule stopped (synchronously at a decided rung; asynchronously once
        nothing can run or be promoted)."""
        if self._halted():
            return
        no_more = super()._left(study) <= 0 or not study.schedule.can_start()
        for decision in study.schedule.decide(no_more_trials=no_more):
            self._stop_trial(study, decision)

    def _stop_trial(self, study: _Study, decision: Decision) -> None:
        state = optuna_module().trial.TrialState
        frozen = study.study.get_trials(deepcopy=False)[decision.number]
        study.study.tell(trial_of(study.study, decision.number), state=state.PRUNED)
        self._mark(frozen.user_attrs.get(RUN_ID), state="pruned", reason=decision.reason, value=decision.value)
        self.say(f"trial {decision.number} of {study.label}: {decision.reason}")



def search_driver(search: Any) -> type[SearchDriver]:
    """The driver of a search: population-based training's (``pruner: {pbt: ...}``), a promoting one when its trials
    pause and continue (``resource:``), else the plain one."""
    if search is not None and search.pbt:
        return PbtSearchDriver
    return PromotingSearchDriver if search is not None and search.promotes else SearchDriver

