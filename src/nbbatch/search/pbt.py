"""Population-based training (Jaderberg et al. 2017): which member copies whom, and with which parameters.

A PBT search trains a population of trials in synchronous *generations*: generation g trains every member up to
``min((g + 1) × interval, max_resource)`` of the search's resource (e.g. EPOCHS), then every member pauses. Once all
living members paused at a generation that is not the last, they are ranked by their value: the bottom ``fraction``
(at least one) each *exploit* a member drawn from the top ``fraction`` (they continue from its checkpoint) and
*explore* (its parameters, perturbed); the others continue from their own checkpoint with their own parameters.

Like :mod:`nbbatch.search.rungs`, this module knows nothing of runs, Optuna or the share: the driver
(:mod:`nbbatch.drivers.pbt`) keeps every decision in the study's journal and replays it after a restart. A decision is
drawn from a random generator seeded with the search's seed plus the generation, so it is the same when drawn again.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nbbatch.spec.search import SearchParam

_TRIES = 20  # perturbations drawn for a member before it gives up copying (see Population.draw)


@dataclass(frozen=True)
class Segment:
    """A member's part of one generation: its parameters, and the member whose last run it continues from when it
    copied another (``exploits``; None: its own last run, or nothing at generation 0)."""

    params: dict[str, Any]
    exploits: int | None = None


@dataclass
class Member:
    """One member of the population: its segments decided so far (one per generation) and its value at each."""

    plan: list[Segment]
    values: dict[int, float] = field(default_factory=dict)  # by generation: the metric when it paused there
    running: bool = False  # its last segment's run is in flight
    failed: bool = False  # out of the population (its run failed)
    held: bool = False  # its run failed outside the notebook: it runs again when the search is submitted again

    @property
    def generation(self) -> int:
        """The generation of its last decided segment."""
        return len(self.plan) - 1

    @property
    def waiting(self) -> bool:
        """Whether its last decided segment waits to be launched."""
        return not self.failed and not self.running and self.generation not in self.values


class Population:
    """The PBT schedule of one study; see the module's docstring.

    ``space``: the searched parameters; ``generations``: how many; ``size``: the population (the search's trials);
    ``mode``: min or max; ``fraction``, ``perturb``, ``resample``: the pbt block's settings; ``seed``: the decisions'."""

    def __init__(self, space: Sequence[SearchParam], generations: int, size: int, mode: str, *, fraction: float,
                 perturb: Sequence[float], resample: float, seed: int) -> None:
        self.space, self.generations, self.size, self.mode = tuple(space), generations, size, mode
        self.fraction, self.perturb, self.resample, self.seed = fraction, tuple(perturb), resample, seed
        self.members: dict[int, Member] = {}

    # --- what the driver tells ---------------------------------------------------------------------------

    def join(self, number: int, params: Mapping[str, Any]) -> None:
        """A new member ``number`` drawn with ``params``; its first segment's run is launched now."""
        self.members[number] = Member([Segment(dict(params))], running=True)

    def restore(self, number: int, plan: Sequence[Segment], values: Mapping[int, float], *, running: bool,
                failed: bool) -> None:
        """A member as the study's journal left it (a driver started again)."""
        self.members[number] = Member(list(plan), dict(values), running, failed)

    def launched(self, number: int) -> Segment:
        """Member ``number``'s waiting segment is launched now; that segment."""
        member = self.members[number]
        member.running, member.held = True, False
        return member.plan[-1]

    def paused(self, number: int, value: float) -> bool:
        """Member ``number``'s run reached its generation with ``value``; whether that was the last generation."""
        member = self.members[number]
        member.running = False
        member.values[member.generation] = value
        return member.generation == self.generations - 1

    def failed(self, number: int) -> None:
        """Member ``number``'s run failed: it is out of the population."""
        member = self.members[number]
        member.running, member.failed = False, True

    def held(self, number: int) -> None:
        """Member ``number``'s run failed outside its notebook: its generation waits for it until the next submit."""
        self.members[number].held = True

    # --- what the schedule decides -----------------------------------------------------------------------

    def waiting(self) -> list[int]:
        """The members whose next segment is decided and not yet launched, in order."""
        return [n for n, m in sorted(self.members.items()) if m.waiting]

    def busy(self) -> bool:
        """Whether a run is in flight or a segment waits to be launched."""
        return any(m.running and not m.held or m.waiting for m in self.members.values())

    def living(self) -> dict[int, Member]:
        return {n: m for n, m in self.members.items() if not m.failed}

    def decide(self) -> dict[int, Segment]:
        """The next generation's segments of the members that have none yet, once every living member paused at the
        current generation (and it is not the last); else nothing. Each member's decided segment is kept."""
        living = self.living()
        if len(self.members) < self.size or not living:
            return {}
        generation = min(max(m.values, default=-1) for m in living.values())
        if generation < 0 or generation >= self.generations - 1:  # (a member at it has paused: it has its value)
            return {}
        drawn = self.draw(generation, {n: m.values[generation] for n, m in living.items()},
                          {n: m.plan[generation].params for n, m in living.items()})
        decided = {n: s for n, s in drawn.items() if living[n].generation == generation}
        for number, segment in decided.items():
            self.members[number].plan.append(segment)
        return decided

    def draw(self, generation: int, values: Mapping[int, float], params: Mapping[int, Mapping[str, Any]]
             ) -> dict[int, Segment]:
        """Every living member's segment of generation ``generation + 1``, from their ``values`` and ``params`` at
        ``generation``: the same whenever drawn again (the generator is seeded with seed + generation)."""
        rng = random.Random(self.seed + generation)
        ranked = sorted(values, key=lambda n: (-values[n] if self.mode == "max" else values[n], n))
        share = max(1, math.floor(len(ranked) * self.fraction)) if len(ranked) >= 2 else 0
        top, bottom = ranked[:share], ranked[len(ranked) - share:]
        segments = {n: Segment(dict(params[n])) for n in ranked}
        # a segment's run is known by its parameters and the run it resumes from: two alike would be one run
        taken = [(n, segments[n].params) for n in ranked if n not in bottom]
        for number in bottom:
            for _ in range(_TRIES):
                source = rng.choice(top)
                moved = self.explore(params[source], rng)
                if (source, moved) not in taken:
                    taken.append((source, moved))
                    segments[number] = Segment(moved, exploits=source)
                    break
            else:  # no perturbation differs (a space of one point, or its bounds): it continues as it is
                taken.append((number, segments[number].params))
        return segments

    def explore(self, params: Mapping[str, Any], rng: random.Random) -> dict[str, Any]:
        """``params`` perturbed: each drawn afresh with probability ``resample``, else a number times a factor of
        ``perturb`` (kept in its range, whole for randint), a choice moved to a neighbouring one."""
        moved = dict(params)
        for param in self.space:
            if param.name not in params:
                continue
            if rng.random() < self.resample:
                moved[param.name] = sample(param, rng)
            elif param.kind == "choice":
                choices = list(param.args)
                at = choices.index(params[param.name]) if params[param.name] in choices else 0
                steps = [s for s in (-1, 1) if 0 <= at + s < len(choices)]
                moved[param.name] = choices[at + rng.choice(steps)] if steps else choices[at]
            else:
                low, high = param.args
                value = min(max(params[param.name] * rng.choice(self.perturb), low), high)
                moved[param.name] = min(max(round(value), low), high) if param.kind == "randint" else float(value)
        return moved


def sample(param: SearchParam, rng: random.Random) -> Any:
    """A fresh draw of ``param`` from its distribution."""
    if param.kind == "choice":
        return rng.choice(list(param.args))
    low, high = param.args
    if param.kind == "randint":
        return rng.randint(low, high)
    if param.kind == "loguniform":
        return math.exp(rng.uniform(math.log(low), math.log(high)))
    return rng.uniform(low, high)
