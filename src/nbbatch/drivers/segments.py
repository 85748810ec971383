"""What the drivers of searches whose trials are chains of runs share: successive halving with promotions
(:mod:`nbbatch.drivers.promoting`) and population-based training (:mod:`nbbatch.drivers.pbt`).

A trial's run (a *segment*) trains to a rung of ``search.resource`` and ends; the trial pauses there until its schedule
continues it in a new run that starts from a run's checkpoints (``resume_from``). Each subclass says which trial
continues next (:meth:`SegmentedSearchDriver._next_to_continue`), how (:meth:`~SegmentedSearchDriver._continue`), and
what its schedule decides once a segment ended (:meth:`~SegmentedSearchDriver._decide`).
"""

from __future__ import annotations

from typing import Any

from nbbatch.drivers.search import SearchDriver, _Study, _Trial
from nbbatch.plan.runs import Run
from nbbatch.search.study import RUN_ID
from nbbatch.store.jsonl import JsonlTail
from nbbatch.store.layout import run_paths
from nbbatch.store.runfiles import read_record_or_none, write_record
from nbbatch.store.runjson import RunRecord

SEGMENTS = "segments"  # a trial's user attribute: its runs' ids, one per segment (a PBT member: generation), in order


class SegmentedSearchDriver(SearchDriver):
    """A :class:`SearchDriver` whose trials pause and continue; see the module's docstring."""

    def _next_to_continue(self, study: _Study) -> int | None:
        """The paused trial whose next segment starts now, or None."""
        raise NotImplementedError

    def _continue(self, study: _Study, number: int) -> None:
        """Launch trial ``number``'s next segment."""
        raise NotImplementedError

    def _decide(self, study: _Study) -> None:
        """What the schedule decides once a segment ended (also when a driver starts again)."""
        raise NotImplementedError

    def _resume(self, study: _Study) -> None:
        super()._resume(study)
        self._decide(study)  # what a driver stopped before deciding (or before telling what it decided) is decided now

    def _busy(self) -> bool:
        return any(s.running or not self._halted() and (s.schedule.busy() or self._left(s) > 0) for s in self.studies)

    def _launch_more(self) -> None:
        if self._halted():
            return
        for study in self.studies:
            while len(self._in_flight()) < self.parallel:
                number = self._next_to_continue(study)
                if number is not None:
                    self._continue(study, number)
                elif self._left(study) > 0:
                    self._ask(study)
                else:
                    break

    def _chain(self, study: _Study, live: Any, segments: list[str], run: Run, about: dict[str, Any], state: str,
               said: str) -> None:
        """Launch ``run`` as the trial's next segment after ``segments``, the last of which is marked ``state``."""
        live.set_user_attr(SEGMENTS, [*segments, run.run_id])
        live.set_user_attr(RUN_ID, run.run_id)
        self._mark(segments[-1], state=state, continued_by=run.run_id)
        self.say(said)
        self._start_segment(study, live, run, about)

    def _start_segment(self, study: _Study, live: Any, run: Run, about: dict[str, Any]) -> None:
        """Watch and launch a trial's segment (``about``: what its record's ``trial`` says of it)."""
        tail = JsonlTail(self.share, run_paths(self.experiment, run.run_id).metrics)
        self._start(study, _Trial(live.number, run, live, tail, segment=about), about.get("params", dict(live.params)))

    def _pause(self, study: _Study, trial: _Trial, record: RunRecord, value: float, attribute: str, key: int) -> None:
        """A segment that ended at its rung (not the last) with ``value``: the trial pauses there, the value kept in
        the study (user attribute ``attribute``, by ``key``) and in the run's record."""
        del study.running[trial.number]
        study.schedule.paused(trial.number, value)
        values = dict(study.study.get_trials(deepcopy=False)[trial.number].user_attrs.get(attribute, {}))
        trial.trial.set_user_attr(attribute, {**values, str(key): value})
        record.trial = {"study": study.study.study_name, "number": trial.number, **trial.segment, "state": "paused",
                        "value": value}
        write_record(self.share, record)
        self.say(f"trial {trial.number} of {study.label}: paused at {self.search.resource}={trial.segment['resource']} "
                 f"with {self.search.metric} {value:.6g} ({record.run_id})")

    def _mark(self, run_id: str | None, **fields: Any) -> None:
        """Update a segment's record (``trial``)."""
        record = read_record_or_none(self.share, self.experiment, run_id) if run_id else None
        if record is not None and record.trial is not None:
            record.trial = {**record.trial, **fields}
            write_record(self.share, record)
