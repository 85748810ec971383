"""The driver of a population-based training search (``pruner: {pbt: ...}``).

Each member of the population is one Optuna trial: its parameters in the study are its initial draw (the sampler's),
and it is told complete at the end with its final value, or failed (out of the population) when a run of it fails.
A member trains in segments, one ordinary run per generation (the search sets the notebook's ``resource`` parameter,
e.g. EPOCHS = 3, 6, 9); every segment's points are reported to the study as its intermediate values (the steps go
on from segment to segment). When the whole population paused at a generation, the schedule
(:mod:`nbbatch.search.pbt`) decides the next: a member that exploits another continues from that member's last run
(``resume_from``) with perturbed parameters; the others from their own. A segment's run has the segment's actual
parameters, so its run id differs when they do.

Each segment's record says which part of the member it is (``trial``: segment, resource, continues, continued_by,
state, value, params, and ``exploited: {trial, run_id}`` when it copied another member); the study's journal keeps each
member's decided schedule (its parameters and source at each generation), its runs and its value at each generation,
so a driver started again replays every decision instead of drawing it again.
"""

from __future__ import annotations

import random
from typing import Any

from nbbatch.drivers.search import _is_number, _Study, _Trial
from nbbatch.drivers.segments import SEGMENTS, SegmentedSearchDriver
from nbbatch.plan.runs import Run
from nbbatch.search.pbt import Population, Segment
from nbbatch.search.study import RUN_ID, SearchError, optuna_module, suggest, trial_of
from nbbatch.spec.search import SEED_LIMIT
from nbbatch.store.runjson import RunRecord, Status

SCHEDULE = "pbt_schedule"  # a member's user attribute: [{params, exploits, continues}], one per decided generation
VALUES = "generation_values"  # a member's user attribute: {generation: the metric when it paused there}
SEED = "pbt_seed"  # the study's user attribute: the decisions' seed, when the search gives none


class PbtSearchDriver(SegmentedSearchDriver):
    """A :class:`SearchDriver` of population-based training; see the module's docstring."""

    def __init__(self, *args: Any, rebuild: bool = False, **kwargs: Any) -> None:
        if rebuild:  # the records hold every segment, but rebuilding the population's decisions from them is not done
            raise SearchError("--rebuild-search cannot rebuild a population-based training study yet (its journal "
                              "holds each member's decisions): submit with --force to start the search afresh (a "
                              "segment that draws the same parameters reuses its run)")
        super().__init__(*args, **kwargs)

    def _open(self, template: Run) -> _Study:
        study = super()._open(template)
        s = self.search.pruner_settings
        seed = self.search.seed
        if seed is None:  # drawn once per study and kept, so that a decision drawn again is the same
            seed = study.study.user_attrs.get(SEED)
            if seed is None:
                seed = random.randrange(SEED_LIMIT)
                study.study.set_user_attr(SEED, seed)
        study.schedule = Population(self.search.params, len(self.search.rungs), self.search.trials, self.search.mode,
                                    fraction=float(s["fraction"]), perturb=s["perturb"],
                                    resample=float(s["resample"]), seed=int(seed))
        self._restore(study)
        return study

    def _restore(self, study: _Study) -> None:
        """The population as the study's journal left it: each member's schedule, values and run in flight."""
        state = optuna_module().trial.TrialState
        for frozen in study.study.get_trials(deepcopy=False):
            attrs = frozen.user_attrs
            if SCHEDULE not in attrs:
                continue  # asked and never given its parameters (a driver killed in between): failed by _current_run
            plan = [Segment(dict(s["params"]), s.get("exploits")) for s in attrs[SCHEDULE]]
            values = {int(g): float(v) for g, v in attrs.get(VALUES, {}).items()}
            segments = attrs.get(SEGMENTS, [])
            running = not frozen.state.is_finished() and len(segments) == len(plan) and len(plan) - 1 not in values
            study.schedule.restore(frozen.number, plan, values, running=running, failed=frozen.state == state.FAIL)
            for run_id in segments:
                self._note_run(run_id)

    # --- members and their segments ------------------------------------------------------------------

    def _next_to_continue(self, study: _Study) -> int | None:
        waiting = study.schedule.waiting()
        return waiting[0] if waiting else None

    def _current_run(self, study: _Study, frozen: Any, live: Any) -> tuple[Run, dict[str, Any]] | None:
        member = study.schedule.members.get(frozen.number)
        if member is None:  # its driver stopped before it was given its parameters: it never ran
            study.study.tell(live, state=optuna_module().trial.TrialState.FAIL)
            # a member of the population all the same, out of it: the generations wait for the whole population
            study.schedule.restore(frozen.number, [Segment({})], {}, running=False, failed=True)
            return None
        if not member.running:
            return None  # paused, or its next segment waits to be launched
        return self._segment_run(study, frozen.number, member.generation)

    def _segment_run(self, study: _Study, number: int, generation: int) -> tuple[Run, dict[str, Any]]:
        """The run of member ``number``'s segment of ``generation``, and what its record says of it."""
        entry = self._schedule(study, number)[generation]
        params = {**entry["params"], self.search.resource: self.search.rungs[generation]}
        continues = entry.get("continues")
        last = generation == len(self.search.rungs) - 1  # a paused run keeps its checkpoints, for the next generation
        run = self.plan.trial(study.template, params, resume_from=continues, keep_checkpoints=not last)
        about: dict[str, Any] = {"segment": generation, "resource": self.search.rungs[generation],
                                 "params": dict(entry["params"])}
        if continues:
            about["continues"] = continues
        if entry.get("exploits") is not None:
            about["exploited"] = {"trial": entry["exploits"], "run_id": continues}
        return run, about

    def _schedule(self, study: _Study, number: int) -> list[dict[str, Any]]:
        return list(study.study.get_trials(deepcopy=False)[number].user_attrs.get(SCHEDULE, []))

    def _segments(self, study: _Study, number: int) -> list[str]:
        return list(study.study.get_trials(deepcopy=False)[number].user_attrs.get(SEGMENTS, []))

    def _ask(self, study: _Study) -> None:
        live = study.study.ask()
        params = suggest(live, self.search)
        live.set_user_attr(SCHEDULE, [{"params": params, "exploits": None}])
        study.schedule.join(live.number, params)
        run, about = self._segment_run(study, live.number, 0)
        live.set_user_attr(SEGMENTS, [run.run_id])
        live.set_user_attr(RUN_ID, run.run_id)
        self._start_segment(study, live, run, about)

    def _continue(self, study: _Study, number: int) -> None:
        """Launch member ``number``'s decided segment of the next generation."""
        segment = study.schedule.launched(number)
        live = trial_of(study.study, number)
        segments = self._segments(study, number)
        generation = len(segments)
        run, about = self._segment_run(study, number, generation)
        how = (f"copies trial {segment.exploits} (run {about['continues']}) with {about['params']}"
               if segment.exploits is not None else f"continues from run {segments[-1]}")
        self._chain(study, live, segments, run, about, "continued", f"trial {number} of {study.label}: generation "
                    f"{generation} ({self.search.resource}={self.search.rungs[generation]}) {how}")

    # --- a segment's end -------------------------------------------------------------------------------

    def _end(self, study: _Study, trial: _Trial, record: RunRecord | None) -> None:
        schedule = study.schedule
        value = record.metrics.get(self.search.metric, trial.last_value) if record is not None else None
        member = schedule.members[trial.number]
        succeeded = record is not None and record.status == Status.SUCCEEDED and _is_number(value)
        reached = float(value) if succeeded else float("nan")  # type: ignore[arg-type]
        if not succeeded or member.generation == schedule.generations - 1:
            super()._end(study, trial, record)  # told (complete, failed), or left open to run again
            frozen = study.study.get_trials(deepcopy=False)[trial.number]
            if not frozen.state.is_finished():
                schedule.held(trial.number)
            elif frozen.state == optuna_module().trial.TrialState.COMPLETE:
                schedule.paused(trial.number, reached)
            else:
                schedule.failed(trial.number)
        else:
            assert record is not None
            self._pause(study, trial, record, reached, VALUES, member.generation)
        self._decide(study)

    def _decide(self, study: _Study) -> None:
        """Keep the next generation's decisions in the journal, once the whole population paused (they are launched
        by :meth:`_launch_more`)."""
        if self._halted():
            return
        for number, segment in study.schedule.decide().items():
            generation = study.schedule.members[number].generation
            source = number if segment.exploits is None else segment.exploits
            continues = self._segments(study, source)[generation - 1]
            entry = {"params": segment.params, "exploits": segment.exploits, "continues": continues}
            trial_of(study.study, number).set_user_attr(SCHEDULE, [*self._schedule(study, number), entry])
