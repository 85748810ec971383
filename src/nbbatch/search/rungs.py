"""Successive halving with promotions: which paused trial of a study continues next, and which never will.

A promoting search (``search.resource``) runs each trial in segments: a run trains up to a rung (its ``resource``
parameter, e.g. EPOCHS = 1, 3, 9, 27), pauses, and when the schedule promotes it a new run of the same trial goes on
from the paused run's checkpoints to the next rung. This module decides only *which* trial and *when*; it knows
nothing of runs, Optuna or the share, so the driver (:mod:`nbbatch.drivers.search`) can replay it from a study's
journal after a restart.

- ``asha`` (asynchronous successive halving, Li et al. 2020): whenever a run slot is free, the best paused trial that is
  in the top 1/η of those that reached its rung continues (the highest rung first); else a new trial starts. Trials
  still paused when the budget is spent and nothing more can be promoted are stopped there.
- ``hyperband`` (synchronous, Li et al. 2018): the budget of trials is spread over brackets, each a successive halving
  that starts at a higher rung than the last (the last runs its trials whole). In a bracket, a rung is decided once
  every trial that reached it has paused there: the best 1/η continue (at least one), the others stop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class _Trial:
    bracket: int
    values: dict[int, float] = field(default_factory=dict)  # by rung index: the metric when it paused there
    running: int | None = None  # the rung index its run in flight trains to
    promoted: bool = False  # decided to continue to the rung after its last one, not yet launched
    settled: bool = False  # it continues no more (it reached the last rung, stopped, or failed)
    held: bool = False  # its run failed outside the notebook: it runs again when the search is submitted again

    @property
    def last(self) -> int:
        return max(self.values, default=-1)


@dataclass
class Decision:
    """A trial that continues no more: stopped (pruned) at its last rung, below the full run."""

    number: int
    rung: int  # its rung index
    value: float
    reason: str


class Promotions:
    """The schedule of one study's promoting search; see the module's docstring.

    ``rungs``: the resource at each rung (the last is a whole run); ``factor``: η (1 in η continues); ``mode``: min or
    max; ``budget``: how many trials the study may start; ``synchronous``: Hyperband's brackets (else one bracket of
    ASHA starting at rung ``first``)."""

    def __init__(self, rungs: tuple[int, ...], factor: int, mode: str, budget: int, *, synchronous: bool,
                 first: int = 0) -> None:
        self.rungs, self.factor, self.mode, self.synchronous = rungs, factor, mode, synchronous
        top = len(rungs) - 1
        self.starts = list(range(top + 1)) if synchronous else [min(first, top)]  # each bracket's first rung
        self.shares = self._allocate(budget)
        self.trials: dict[int, _Trial] = {}
        self.decided: set[tuple[int, int]] = set()  # (bracket, rung) whose promotions were decided (synchronous)

    def _allocate(self, budget: int) -> list[int]:
        """How many trials each bracket starts: Hyperband's n_s (more, cheaper trials in the brackets that start
        low), scaled to ``budget`` by largest remainder."""
        if not self.synchronous:
            return [budget]
        top = len(self.rungs) - 1
        weights = [math.ceil((top + 1) / (top - b + 1) * self.factor ** (top - b)) for b in self.starts]
        exact = [budget * w / sum(weights) for w in weights]
        shares = [math.floor(x) for x in exact]
        for b in sorted(range(len(exact)), key=lambda b: shares[b] - exact[b])[:budget - sum(shares)]:
            shares[b] += 1
        return shares

    # --- what the driver tells ---------------------------------------------------------------------------

    def start(self, number: int) -> int | None:
        """Register a new trial ``number`` in the first bracket with room; the rung index its first run trains to, or
        None when no bracket takes more trials."""
        for bracket, share in enumerate(self.shares):
            started = sum(1 for t in self.trials.values() if t.bracket == bracket)
            if started < share and (bracket, self.starts[bracket]) not in self.decided:
                rung = self.starts[bracket]
                self.trials[number] = _Trial(bracket, running=rung)
                return rung
        return None

    def can_start(self) -> bool:
        return any(sum(1 for t in self.trials.values() if t.bracket == b) < share
                   and (b, self.starts[b]) not in self.decided for b, share in enumerate(self.shares))

    def restore(self, number: int, bracket: int, values: dict[int, float], running: int | None,
                settled: bool) -> None:
        """A trial as a study's journal left it (a driver started again): its bracket, the value at each rung it
        paused at, the rung its run in flight trains to (None: paused), and whether it continues no more."""
        self.trials[number] = _Trial(bracket, dict(values), running, settled=settled)

    def paused(self, number: int, value: float) -> bool:
        """Trial ``number``'s run reached its rung with ``value``; whether that was the last rung (the trial is
        complete)."""
        trial = self.trials[number]
        rung, trial.running = trial.running, None
        assert rung is not None
        trial.values[rung] = value
        if rung == len(self.rungs) - 1:
            trial.settled = True
        return trial.settled

    def failed(self, number: int) -> None:
        """Trial ``number``'s run failed: it continues no more, and counts at no rung."""
        trial = self.trials[number]
        trial.running, trial.settled, trial.promoted = None, True, False

    def held(self, number: int) -> None:
        """Trial ``number``'s run failed outside its notebook (the share, the node): it waits, still at its rung, for
        the search's next submit, and its bracket's rung waits for it."""
        self.trials[number].held = True

    def launched(self, number: int) -> int:
        """The promoted trial ``number`` continues now; the rung index its run trains to."""
        trial = self.trials[number]
        trial.promoted, trial.running = False, trial.last + 1
        return trial.running

    # --- what the schedule decides -----------------------------------------------------------------------

    def promotion(self) -> int | None:
        """The trial to continue now (the driver then calls :meth:`launched`), or None."""
        promoted = [n for n, t in self.trials.items() if t.promoted]
        if promoted:
            return min(promoted, key=lambda n: (-self.trials[n].last, n))
        number = None if self.synchronous else self._promotable()
        if number is not None:
            self.trials[number].promoted = True
        return number

    def _promotable(self) -> int | None:
        """ASHA's next promotion: from the highest rung down, the best paused trial in the top 1/η of that rung."""
        for rung in range(len(self.rungs) - 2, self.starts[0] - 1, -1):
            for number in self._best(rung, 0):
                if self._paused_at(number, rung):
                    return number
        return None

    def _paused_at(self, number: int, rung: int) -> bool:
        trial = self.trials[number]
        return trial.last == rung and trial.running is None and not trial.settled and not trial.promoted

    def decide(self, no_more_trials: bool) -> list[Decision]:
        """Trials that will continue no more, to tell the study as pruned. Synchronous: every rung of a bracket that
        all its trials reached is decided (its best go on: :meth:`promotion`). Asynchronous: once no trial starts any
        more (``no_more_trials``), none runs and none can be promoted, every trial still paused stops there."""
        if not self.synchronous:
            if not no_more_trials or self._running() or self._promotable() is not None:
                return []
            return [self._stop(n, "the search ended and it was not among the best that reached its rung")
                    for n, t in sorted(self.trials.items()) if not t.settled and t.running is None]
        stopped: list[Decision] = []
        for bracket, start in enumerate(self.starts):
            for rung in range(start, len(self.rungs) - 1):
                if (bracket, rung) in self.decided or not self._reached(bracket, rung):
                    continue
                self.decided.add((bracket, rung))
                ranked = self._best(rung, bracket)
                keep = max(1, len(ranked) // self.factor) if ranked else 0
                for number in ranked[:keep]:  # (a driver started again decides again: those that went on are left)
                    self.trials[number].promoted |= self._paused_at(number, rung)
                stopped += [self._stop(n, f"not among the best {keep} of the {len(ranked)} trials of bracket "
                                          f"{bracket} at this rung") for n in ranked[keep:]
                            if not self.trials[n].settled]
        return stopped

    def _reached(self, bracket: int, rung: int) -> bool:
        """Whether every trial of ``bracket`` that will ever reach ``rung`` has paused there (or failed)."""
        members = [t for t in self.trials.values() if t.bracket == bracket]
        if rung == self.starts[bracket]:
            if len(members) < self.shares[bracket]:
                return False
        elif (bracket, rung - 1) not in self.decided:
            return False
        return not any(t.running == rung or t.promoted and t.last == rung - 1 for t in members)

    def _best(self, rung: int, bracket: int) -> list[int]:
        """The trials (of ``bracket``, when synchronous) that paused at ``rung``, best first: for ASHA the top 1/η of
        every trial that reached it."""
        reached = [(t.values[rung], n) for n, t in self.trials.items()
                   if rung in t.values and (not self.synchronous or t.bracket == bracket)]
        reached.sort(key=lambda vn: (-vn[0] if self.mode == "max" else vn[0], vn[1]))
        numbers = [n for _, n in reached]
        return numbers if self.synchronous else numbers[:len(numbers) // self.factor]

    def _stop(self, number: int, why: str) -> Decision:
        trial = self.trials[number]
        trial.settled, trial.promoted = True, False
        rung = trial.last
        return Decision(number, rung, trial.values[rung], f"stopped at {self.rungs[rung]}: {why}")

    def _running(self) -> bool:
        return any(t.running is not None and not t.held for t in self.trials.values())

    def busy(self) -> bool:
        """Whether a run of the schedule is in flight, or a trial waits to continue."""
        return (self._running() or any(t.promoted for t in self.trials.values())
                or not self.synchronous and self._promotable() is not None)
