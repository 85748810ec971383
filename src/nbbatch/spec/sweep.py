"""Parameter sweeps: ``grid`` (product), ``zip`` (side by side) and ``random`` (sampled by seed).

A sweep is a mapping with any of the three keys; they are crossed with each other (and later with
the frameworks). Each yields a list of parameter dicts, reproducible for a given seed.

How many runs a sweep makes is counted before anything is expanded: beyond ``resources.max_runs``
(:data:`DEFAULT_MAX_RUNS` unless raised) the experiment is refused with the count, so a grid of 10^10
or ``random: {samples: 1000000000}`` is one clear error instead of a machine out of memory.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Mapping
from typing import Any

from nbbatch.errors import SpecError, did_you_mean
from nbbatch.spec.resources import Resources
from nbbatch.spec.schema import keys as schema_keys

DISTRIBUTIONS = ("uniform", "loguniform", "normal", "randint", "choice")
SWEEP_KINDS = schema_keys("sweep")
DEFAULT_MAX_RUNS: int = Resources.max_runs  # resources.max_runs when the experiment does not raise it

Expansion = tuple[int, Callable[[], list[dict[str, Any]]]]  # how many combinations, and how to make them


def _grid(spec: Any) -> Expansion:
    if not isinstance(spec, Mapping) or not spec:
        raise SpecError("sweep.grid must map parameter names to lists of values, e.g. grid: {LR: [0.01, 0.1]}")
    for name, values in spec.items():
        if not isinstance(values, list) or not values:
            raise SpecError(f"sweep.grid.{name} must be a non-empty list of values (got {values!r})")
    names = list(spec)
    return math.prod(len(spec[n]) for n in names), lambda: [
        dict(zip(names, combo, strict=True)) for combo in itertools.product(*(spec[n] for n in names))]


def _zip(spec: Any) -> Expansion:
    if not isinstance(spec, Mapping) or not spec:
        raise SpecError("sweep.zip must map parameter names to lists of equal length, e.g. zip: {LR: [0.1, 0.01], "
                        "EPOCHS: [5, 10]}")
    lengths = {}
    for name, values in spec.items():
        if not isinstance(values, list) or not values:
            raise SpecError(f"sweep.zip.{name} must be a non-empty list of values (got {values!r})")
        lengths[name] = len(values)
    if len(set(lengths.values())) != 1:
        detail = ", ".join(f"{k}: {v}" for k, v in lengths.items())
        raise SpecError(f"sweep.zip lists must have the same length ({detail})")
    names = list(spec)
    return next(iter(lengths.values())), lambda: [
        dict(zip(names, combo, strict=True)) for combo in zip(*(spec[n] for n in names), strict=True)]


def _pair(name: str, kind: str, args: Any) -> tuple[float, float]:
    if not isinstance(args, list) or len(args) != 2 or not all(isinstance(a, (int, float)) and not isinstance(a, bool)
                                                               for a in args):
        raise SpecError(f"sweep.random.{name}: `{kind}` takes two numbers, e.g. {{{kind}: [0.001, 0.1]}} (got {args!r})")
    return float(args[0]), float(args[1])


def distribution(where: str, spec: Any, known: tuple[str, ...], hint: Callable[[str], str] = lambda kind: ""
                 ) -> tuple[str, Any]:
    """``(kind, args)`` of one distribution at ``where`` (``{loguniform: [lo, hi]}``; a plain list is a choice)."""
    if isinstance(spec, list):
        spec = {"choice": spec}
    if not isinstance(spec, Mapping) or len(spec) != 1:
        raise SpecError(f"{where} must be one distribution, e.g. {{loguniform: [1.0e-4, 1.0e-1]}}; known: "
                        f"{', '.join(known)}")
    (kind, args), = spec.items()
    if kind not in known:
        raise SpecError(f"{where}: unknown distribution `{kind}`{did_you_mean(str(kind), known)}{hint(kind)}; "
                        f"known: {', '.join(known)}")
    return kind, args


def _sampler(name: str, spec: Any):
    kind, args = distribution(f"sweep.random.{name}", spec, DISTRIBUTIONS)
    if kind == "choice":
        if not isinstance(args, list) or not args:
            raise SpecError(f"sweep.random.{name}: choice takes a non-empty list")
        return lambda rng: rng.choice(args)
    low, high = _pair(name, kind, args)
    if kind == "uniform":
        if high <= low:
            raise SpecError(f"sweep.random.{name}: uniform needs low < high (got {args})")
        return lambda rng: rng.uniform(low, high)
    if kind == "loguniform":
        if not 0 < low < high:
            raise SpecError(f"sweep.random.{name}: loguniform needs 0 < low < high (got {args})")
        return lambda rng: math.exp(rng.uniform(math.log(low), math.log(high)))
    if kind == "normal":
        if high <= 0:
            raise SpecError(f"sweep.random.{name}: normal takes [mean, stddev] with stddev > 0 (got {args})")
        return lambda rng: rng.gauss(low, high)
    if low != int(low) or high != int(high) or high < low:
        raise SpecError(f"sweep.random.{name}: randint takes two integers low <= high, both included (got {args})")
    return lambda rng: rng.randint(int(low), int(high))


def _random(spec: Any) -> Expansion:
    if not isinstance(spec, Mapping):
        raise SpecError("sweep.random must be a mapping: {samples: N, seed: S, params: {NAME: {distribution: args}}}")
    unknown = set(spec) - {"samples", "seed", "params"}
    if unknown:
        key = sorted(unknown)[0]
        raise SpecError(f"sweep.random: unknown key `{key}`{did_you_mean(key, ['samples', 'seed', 'params'])}; "
                        "use samples, seed and params")
    samples = spec.get("samples")
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < 1:
        raise SpecError(f"sweep.random.samples must be a positive integer (got {samples!r})")
    seed = spec.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise SpecError(f"sweep.random.seed must be an integer (got {seed!r})")
    params = spec.get("params")
    if not isinstance(params, Mapping) or not params:
        raise SpecError("sweep.random.params must map parameter names to distributions")
    samplers = {name: _sampler(name, dist) for name, dist in params.items()}

    def draw_all() -> list[dict[str, Any]]:
        rng = random.Random(seed)
        return [{name: draw(rng) for name, draw in samplers.items()} for _ in range(samples)]

    return samples, draw_all


def swept_parameters(sweep: Mapping[str, Any] | None) -> dict[str, str]:
    """Each parameter a (valid) sweep varies, with where: ``{"LR": "sweep.grid"}``."""
    where: dict[str, str] = {}
    for kind, spec in (sweep or {}).items():
        names = spec.get("params", {}) if kind == "random" else spec
        where.update((name, f"sweep.{kind}") for name in names)
    return where


def _count(n: int) -> str:
    """``12,000``; ``about 10^40`` for a number too long to read."""
    return f"{n:,}" if n < 10**15 else f"about 10^{len(str(n)) - 1}"


def _too_many(sizes: dict[str, int], per_combination: int, total: int, max_runs: int) -> SpecError:
    factors = [f"{kind} {_count(n)}" for kind, n in sizes.items()]
    made = " × ".join(factors + ([f"{per_combination} frameworks/notebooks"] if per_combination > 1 else []))
    return SpecError(
        f"the experiment makes {_count(total)} runs ({made}), more than resources.max_runs ({max_runs:,}); nothing "
        "was expanded or started. A batch that large is usually a mistake (a grid parameter too many, a zero too many "
        "in random.samples): shrink the sweep (random: {samples: N} searches a large space in N runs), or, if you "
        f"mean it, raise the cap in the experiment file: resources: {{max_runs: {total}}}")


def _expansions(sweep: Mapping[str, Any] | None) -> dict[str, Expansion]:
    if not sweep:
        return {}
    if not isinstance(sweep, Mapping):
        raise SpecError("`sweep` must be a mapping with any of grid, zip, random")
    unknown = set(sweep) - set(SWEEP_KINDS)
    if unknown:
        key = sorted(unknown)[0]
        raise SpecError(f"sweep: unknown kind `{key}`{did_you_mean(key, SWEEP_KINDS)}; use grid, zip or random")
    return {kind: {"grid": _grid, "zip": _zip, "random": _random}[kind](sweep[kind]) for kind in SWEEP_KINDS
            if kind in sweep}


def expand_sweep(sweep: Mapping[str, Any] | None, max_runs: int = DEFAULT_MAX_RUNS,
                 per_combination: int = 1) -> list[dict[str, Any]]:
    """All parameter combinations a sweep describes (``[{}]`` for no sweep).

    Refused with a :class:`SpecError`, before anything is expanded, when the combinations times
    ``per_combination`` (the frameworks and notebooks each of them runs on) exceed ``max_runs``.
    """
    expansions = _expansions(sweep)
    total = math.prod(n for n, _expand in expansions.values()) * per_combination
    if total > max_runs:
        raise _too_many({kind: n for kind, (n, _expand) in expansions.items()}, per_combination, total, max_runs)
    combos: list[dict[str, Any]] = [{}]
    for _n, expand in expansions.values():
        part = expand()
        clash = set(part[0]) & set(combos[0])
        if clash:
            raise SpecError(f"sweep: parameter `{sorted(clash)[0]}` appears in more than one sweep kind")
        combos = [{**a, **b} for a in combos for b in part]
    return combos
