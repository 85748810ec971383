"""Searches (``search:``): an adaptive sweep whose trials an Optuna sampler proposes and a pruner stops early.

This module reads and checks the experiment's ``search:`` block before anything runs; it imports no Optuna (the driver,
:mod:`nbbatch.search`, does). Every mistake the block can hold is refused here, naming the key and the fix: an unknown
sampler or pruner, a distribution its sampler cannot draw (CMA-ES and QMC draw numbers only), a grid that is no list
of choices, a budget too small for the pruner to ever stop a run, a bound or a setting Optuna would refuse, several
objectives with a sampler or pruner that cannot judge them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nbbatch.errors import SpecError, did_you_mean
from nbbatch.metrics import POINT_KEYS
from nbbatch.spec.sweep import distribution

SAMPLERS = ("tpe", "random", "grid", "cmaes", "qmc", "nsga2")
PRUNERS = ("none", "median", "percentile", "asha", "hyperband", "pbt")
DISTRIBUTIONS = ("uniform", "loguniform", "randint", "choice")
MODES = ("min", "max")
_NUMERIC_ONLY = ("cmaes", "qmc")  # samplers that draw numbers only
_SINGLE_OBJECTIVE = ("cmaes",)  # Optuna's samplers that judge one objective only (CmaEsSampler raises on several)
# Each pruner's settings and their defaults (Optuna's own defaults, under nbbatch's names).
PRUNER_SETTINGS: dict[str, dict[str, Any]] = {
    "none": {},
    "median": {"startup_trials": 5, "warmup_steps": 0, "interval_steps": 1},
    "percentile": {"percentile": 25.0, "startup_trials": 5, "warmup_steps": 0, "interval_steps": 1},
    "asha": {"min_resource": 1, "max_resource": None, "reduction_factor": 3, "min_early_stopping_rate": 0},
    "hyperband": {"min_resource": 1, "max_resource": None, "reduction_factor": 3},
    # population-based training (nbbatch's own schedule, :mod:`nbbatch.search.pbt`): checked by _check_pbt
    "pbt": {"interval": None, "max_resource": None, "fraction": 0.25, "perturb": [0.8, 1.2], "resample": 0.25},
}
_PBT_SAMPLERS = ("random", "tpe", "qmc")  # the initial population's draw
# The least value of each whole-number setting: what Optuna's pruners accept (they raise ValueError in the driver,
# after the lock is taken, on anything less). `percentile` is any number from 0 to 100, both included.
LEAST_SETTING = {"interval": 1, "startup_trials": 0, "warmup_steps": 0, "interval_steps": 1, "min_resource": 1, "max_resource": 1,
                 "reduction_factor": 2, "min_early_stopping_rate": 0}
SETTING_LIMIT = 2**31 - 1  # the most a pruner's whole-number setting may be (far above any budget of trials or steps)
SEED_LIMIT = 2**32  # a sampler's seed seeds numpy's RandomState: 0 ≤ seed < 2**32


@dataclass(frozen=True)
class SearchParam:
    """One searched parameter: ``kind`` (uniform, loguniform, randint, choice) and its arguments."""

    name: str
    kind: str
    args: tuple[Any, ...]

    @property
    def numeric(self) -> bool:
        return self.kind != "choice"

    def examples(self) -> tuple[Any, ...]:
        """A value of each type this parameter can take (every choice; a range's low end)."""
        return self.args if self.kind == "choice" else (self.args[0],)


@dataclass(frozen=True)
class Search:
    """An experiment's ``search:``: which metric to optimise, how many trials, the sampler, the pruner, the space.

    ``metric`` and ``mode`` are the first objective; ``metrics`` and ``modes`` every objective (one, or several for a
    multi-objective study: ``metric: [accuracy, train_seconds]``, ``mode: [max, min]``)."""

    metric: str
    mode: str
    trials: int
    params: tuple[SearchParam, ...]
    sampler: str = "tpe"
    seed: int | None = None
    pruner: str = "none"
    pruner_settings: dict[str, Any] = field(default_factory=dict)
    more_objectives: tuple[tuple[str, str], ...] = ()  # the objectives after the first: (metric, mode) each
    resource: str | None = None  # the parameter a paused trial's next run raises (promotions); None: pruned runs stop

    @property
    def promotes(self) -> bool:
        """Whether trials pause at rungs and the promoted ones continue from their checkpoints (``resource:``)."""
        return self.resource is not None

    @property
    def pbt(self) -> bool:
        """Whether the search is population-based training (``pruner: {pbt: ...}``)."""
        return self.pruner == "pbt"

    @property
    def rungs(self) -> tuple[int, ...]:
        """The values of :attr:`resource` at which a promoting search pauses its trials, the last the full run's:
        min_resource × reduction_factor^k below max_resource, then max_resource (e.g. 1, 3, 9, 27). PBT's: each
        generation's, interval × (g + 1) up to max_resource (e.g. 3, 6, 9)."""
        s = self.pruner_settings
        if self.pbt:
            interval, most = int(s["interval"]), int(s["max_resource"])
            return tuple(min(interval * g, most) for g in range(1, -(-most // interval) + 1))
        least, most, factor = int(s["min_resource"]), int(s["max_resource"]), int(s["reduction_factor"])
        steps = [least]
        while steps[-1] * factor < most:
            steps.append(steps[-1] * factor)
        return tuple(steps if steps[-1] == most else [*steps, most])

    @property
    def metrics(self) -> tuple[str, ...]:
        """Every objective's metric, the first one first."""
        return (self.metric, *(m for m, _ in self.more_objectives))

    @property
    def modes(self) -> tuple[str, ...]:
        """Every objective's mode (min or max), in the order of :attr:`metrics`."""
        return (self.mode, *(m for _, m in self.more_objectives))

    @property
    def multi(self) -> bool:
        """Whether the search has several objectives (an Optuna multi-objective study: no pruner, a Pareto front)."""
        return bool(self.more_objectives)

    @property
    def grid_size(self) -> int:
        """How many points the grid sampler has (every choice crossed)."""
        return math.prod(len(p.args) for p in self.params)

    def describe(self) -> str:
        """One line for people: what is searched and how."""
        space = "; ".join(f"{p.name} {p.kind} {list(p.args)}" for p in self.params)
        goal = ", ".join(f"{mode}imising {metric}" for metric, mode in zip(self.metrics, self.modes, strict=True))
        return (f"up to {self.trials} trials each, {goal}: {space}; sampler {self.sampler}"
                f"{'' if self.seed is None else f' (seed {self.seed})'}, pruner {self.pruner}")

    def to_dict(self) -> dict[str, Any]:
        """The block as an experiment file writes it (stored in the share's manifest)."""
        several = self.multi  # one objective is written as before (a study's fingerprint stays the same)
        settings = {k: v for k, v in self.pruner_settings.items()  # asha's max_resource only where it was given
                    if not (self.pruner == "asha" and k == "max_resource" and v is None)}
        return {"metric": list(self.metrics) if several else self.metric,
                "mode": list(self.modes) if several else self.mode, "trials": self.trials, "sampler": self.sampler,
                "seed": self.seed, "pruner": {self.pruner: settings} if settings else self.pruner,
                "params": {p.name: {p.kind: list(p.args)} for p in self.params},
                **({"resource": self.resource} if self.resource else {})}


def parse_search(data: Any, fixed: Mapping[str, Any] | None = None, sweep: Mapping[str, Any] | None = None) -> Search:
    """The ``search:`` block checked whole (``fixed``: the experiment's ``parameters:``; ``sweep``: its ``sweep:``),
    or :class:`SpecError` naming the first mistake and its fix."""
    if not isinstance(data, Mapping):
        raise SpecError("`search` must be a mapping: {metric: NAME, mode: min|max, trials: N, params: {...}}")
    known = ("metric", "mode", "trials", "sampler", "seed", "pruner", "params", "resource")
    for key in data:
        if key not in known:
            raise SpecError(f"search: unknown key `{key}`{did_you_mean(str(key), known)}; use {', '.join(known)}")
    if sweep:
        raise SpecError("an experiment has `search:` or `sweep:`, not both: a search proposes its own parameters. "
                        "Move fixed values to `parameters:` and searched ones to search.params")
    objectives = _objectives(data.get("metric"), data.get("mode"))
    trials = data.get("trials")
    if not isinstance(trials, int) or isinstance(trials, bool) or trials < 1:
        raise SpecError(f"search.trials must be a positive integer: the budget of runs (got {trials!r})")
    params = _params(data.get("params"), fixed or {})
    sampler, seed = _sampler(data.get("sampler", "tpe"), data.get("seed"))
    pruner, settings = _pruner(data.get("pruner", "none"))
    (metric, mode), *more = objectives
    if pruner == "pbt" and data.get("resource") is None:
        raise SpecError("search.pruner pbt trains its population in generations of search.resource: add resource "
                        "(the notebook parameter that sets how far a run trains, e.g. resource: EPOCHS)")
    resource = _resource(data.get("resource"), pruner, settings, fixed or {}, params)
    search = Search(metric, mode, trials, params, sampler, seed, pruner, settings, tuple(more), resource)
    _check_fit(search)
    return search


def _objectives(metrics: Any, modes: Any) -> list[tuple[str, str]]:
    """The search's objectives, (metric, mode) each: one metric and mode, or two lists of the same length."""
    several = isinstance(metrics, list)
    names = metrics if several else [metrics]
    if several and (len(names) < 2 or not isinstance(modes, list) or len(modes) != len(names)):
        raise SpecError("several objectives are two lists of the same length, each of at least two: search.metric "
                        f"[accuracy, train_seconds] and search.mode [max, min] (got metric {metrics!r}, mode {modes!r})")
    for name in names:
        if not isinstance(name, str) or not name.isidentifier() or name in POINT_KEYS:
            raise SpecError("search.metric must name a metric the notebook records with nbbatch.record(step=..., "
                            f"NAME=...) (got {name!r}" + (f": `{name}` is a key of every point, no metric" if
                                                          name in POINT_KEYS else "") + ")")
    if len(set(names)) != len(names):
        raise SpecError(f"search.metric names a metric twice ({metrics!r}): each objective is another metric")
    given = modes if several else [modes]
    for name, mode in zip(names, given, strict=True):
        if mode not in MODES:
            raise SpecError(f"search.mode must be min or max: whether a lower or a higher {name} is better "
                            f"(got {mode!r})" + (" (several metrics take a list of modes, one each)"
                                                 if isinstance(modes, list) != several else ""))
    return list(zip(names, given, strict=True))


def _params(data: Any, fixed: Mapping[str, Any]) -> tuple[SearchParam, ...]:
    if not isinstance(data, Mapping) or not data:
        raise SpecError("search.params must map parameter names to distributions, e.g. "
                        "{LR: {loguniform: [1.0e-4, 1.0e-1]}, BATCHSIZE: {choice: [32, 64]}}")
    params = []
    for name, spec in data.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise SpecError(f"search.params: `{name}` is not a parameter name")
        if name in fixed:
            raise SpecError(f"parameter `{name}` is both in `parameters:` and searched in search.params: keep it in "
                            "one of them")
        params.append(_param(name, spec))
    return tuple(params)


def _param(name: str, spec: Any) -> SearchParam:
    where = f"search.params.{name}"
    kind, args = distribution(where, spec, DISTRIBUTIONS,
                              lambda kind: " (a search samples bounded ranges: use uniform)" if kind == "normal" else "")
    if kind == "choice":
        if not isinstance(args, list) or not args:
            raise SpecError(f"{where}: choice takes a non-empty list of values")
        if any(not isinstance(v, (str, int, float, bool)) and v is not None
               or isinstance(v, float) and not math.isfinite(v) for v in args):
            raise SpecError(f"{where}: choice values must be finite numbers, strings, booleans or null (got {args!r})")
        if len(set(args)) != len(args):  # Optuna finds a choice by ==: 1, 1.0 and true are one value to it
            raise SpecError(f"{where}: choice values must differ (got {args!r}; 1, 1.0 and true are one value)")
        return SearchParam(name, kind, tuple(args))
    if (not isinstance(args, list) or len(args) != 2
            or not all(isinstance(a, (int, float)) and not isinstance(a, bool) and math.isfinite(a) for a in args)):
        raise SpecError(f"{where}: `{kind}` takes two finite numbers [low, high] (got {args!r})")
    low, high = args
    if kind == "randint":
        if low != int(low) or high != int(high) or high <= low:
            raise SpecError(f"{where}: randint takes two integers low < high, both included (got {args})")
        return SearchParam(name, kind, (int(low), int(high)))
    if high <= low or (kind == "loguniform" and low <= 0):
        need = "0 < low < high" if kind == "loguniform" else "low < high"
        raise SpecError(f"{where}: {kind} needs {need} (got {args})")
    if not math.isfinite(float(high) - float(low)):  # Optuna's samplers draw low + u * (high - low)
        raise SpecError(f"{where}: {kind} [{low}, {high}] is wider than a float can hold: narrow it (or use "
                        "loguniform for a range over many orders of magnitude)")
    return SearchParam(name, kind, (float(low), float(high)))


def _sampler(data: Any, seed: Any) -> tuple[str, int | None]:
    if not isinstance(data, str) or data not in SAMPLERS:
        raise SpecError(f"search.sampler: unknown sampler `{data}`{did_you_mean(str(data), SAMPLERS)}; use one of "
                        f"{', '.join(SAMPLERS)}")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < SEED_LIMIT):
        raise SpecError(f"search.seed must be a whole number from 0 to {SEED_LIMIT - 1} (got {seed!r})")
    return data, seed


def _pruner(data: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(data, str):
        name, given = data, {}
    elif isinstance(data, Mapping) and len(data) == 1:
        (name, given), = data.items()
        given = {} if given is None else given
    else:
        raise SpecError("search.pruner is a name (none, median, percentile, asha, hyperband) or one name with its "
                        "settings, e.g. {hyperband: {min_resource: 1, max_resource: 27, reduction_factor: 3}} or "
                        "{pbt: {interval: 3, max_resource: 27}}")
    if name not in PRUNERS:
        raise SpecError(f"search.pruner: unknown pruner `{name}`{did_you_mean(str(name), PRUNERS)}; use one of "
                        f"{', '.join(PRUNERS)}")
    if not isinstance(given, Mapping):
        raise SpecError(f"search.pruner.{name} takes a mapping of settings (got {given!r})")
    defaults = PRUNER_SETTINGS[name]
    for key, value in given.items():
        if key not in defaults:
            raise SpecError(f"search.pruner.{name}: unknown setting `{key}`{did_you_mean(str(key), list(defaults))}; "
                            f"{name} takes {', '.join(defaults) or 'no settings'}")
        if name != "pbt":
            _check_setting(name, key, value)
    settings = {**defaults, **given}
    if name == "pbt":
        _check_pbt(settings)
    if name == "hyperband" and settings["max_resource"] is None:
        raise SpecError("search.pruner.hyperband needs max_resource: the last step a run reaches (e.g. its EPOCHS), "
                        "so the brackets can be laid out before any run")
    return name, settings


def _resource(name: Any, pruner: str, settings: dict[str, Any], fixed: Mapping[str, Any],
              params: tuple[SearchParam, ...]) -> str | None:
    """``search.resource``: the notebook parameter (its EPOCHS) a promoting search sets for each run of a trial."""
    if name is None:
        if pruner == "asha" and settings["max_resource"] is not None:
            raise SpecError("search.pruner.asha.max_resource is for trials that pause and continue: add "
                            "search.resource (the parameter the search raises at each rung, e.g. EPOCHS), or drop "
                            "max_resource")
        return None
    if not isinstance(name, str) or not name.isidentifier():
        raise SpecError(f"search.resource names the notebook parameter that sets how far a run trains, e.g. "
                        f"resource: EPOCHS (got {name!r})")
    if pruner not in ("asha", "hyperband", "pbt"):
        raise SpecError(f"search.resource pauses trials at the rungs of a successive-halving schedule: use pruner asha "
                        f"or hyperband with it (got pruner {pruner}), or drop resource")
    if name in fixed or name in {p.name for p in params}:
        raise SpecError(f"parameter `{name}` is search.resource, which the search sets for each run (up to "
                        f"max_resource): remove it from {'parameters:' if name in fixed else 'search.params'}")
    if settings["max_resource"] is None:
        raise SpecError(f"search.pruner.{pruner} needs max_resource with search.resource: the {name} of a trial "
                        "that is never stopped (e.g. {asha: {min_resource: 1, max_resource: 27}})")
    if pruner != "pbt" and settings["max_resource"] < settings["min_resource"]:
        raise SpecError(f"search.pruner.{pruner}.max_resource must be ≥ min_resource ({settings['min_resource']}): "
                        f"the {name} of a trial that is never stopped")
    return name


def _check_pbt(settings: dict[str, Any]) -> None:
    """Population-based training's settings: whole-number generations, the share that exploits, the perturbations."""
    where = "search.pruner.pbt"
    needs = {"interval": "the resource each generation trains, between two exploits (e.g. interval: 3)",
             "max_resource": "the resource every member reaches at the end (e.g. its EPOCHS: max_resource: 27)"}
    for key, what in needs.items():
        if settings[key] is None:
            raise SpecError(f"{where} needs {key}: {what}")
        _check_setting("pbt", key, settings[key])
    if settings["max_resource"] < settings["interval"]:
        raise SpecError(f"{where}.max_resource must be ≥ interval ({settings['interval']}): at least one generation")
    fraction, perturb, resample = settings["fraction"], settings["perturb"], settings["resample"]
    if not _real(fraction) or not 0 < fraction <= 0.5:
        raise SpecError(f"{where}.fraction must be a number above 0 and at most 0.5: the share of the population that "
                        f"copies the best members (got {fraction!r})")
    if (not isinstance(perturb, list) or not perturb
            or not all(_real(f) and 0 < f < float("inf") for f in perturb) or all(f == 1 for f in perturb)):
        raise SpecError(f"{where}.perturb must be a list of positive factors, not all 1, a copied parameter is "
                        f"multiplied by one of (e.g. [0.8, 1.2]; got {perturb!r})")
    if not _real(resample) or not 0 <= resample <= 1:
        raise SpecError(f"{where}.resample must be a probability from 0 to 1: how often a copied parameter is drawn "
                        f"afresh instead of perturbed (got {resample!r})")


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_setting(pruner: str, key: str, value: Any) -> None:
    """A pruner's setting as Optuna will take it: a whole number from its least value, or a percentile."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if key == "percentile":
        if not number or not 0 <= value <= 100:
            raise SpecError(f"search.pruner.percentile.percentile must be a number from 0 to 100, both included "
                            f"(got {value!r})")
        return
    if not number or isinstance(value, int) and value > SETTING_LIMIT or isinstance(value, float) and not (
            math.isfinite(value) and value == int(value) and value <= SETTING_LIMIT) or value < LEAST_SETTING[key]:
        raise SpecError(f"search.pruner.{pruner}.{key} must be a whole number from {LEAST_SETTING[key]} to "
                        f"{SETTING_LIMIT} (got {value!r})")


def brackets(search: Search) -> int:
    """How many Hyperband brackets the pruner's settings make (1 for the other pruners)."""
    if search.pruner != "hyperband":
        return 1
    s = search.pruner_settings
    return math.floor(math.log(s["max_resource"] / s["min_resource"], s["reduction_factor"])) + 1


def smallest_budget(search: Search) -> int:
    """The fewest trials with which the pruner can stop any run: below that, every run goes to its end."""
    s = search.pruner_settings
    if search.pruner in ("median", "percentile"):
        return int(s["startup_trials"]) + 1
    if search.pruner == "asha":
        return int(s["reduction_factor"])
    if search.pruner == "hyperband":
        return brackets(search) * int(s["reduction_factor"])
    return 1


def _check_fit(search: Search) -> None:
    if search.multi:
        _check_objectives(search)
    if search.sampler in _NUMERIC_ONLY:
        words = [p.name for p in search.params if not p.numeric]
        if words:
            label = {"cmaes": "CMA-ES", "qmc": "QMC"}[search.sampler]
            raise SpecError(f"search.sampler {search.sampler}: {label} draws numbers only, and "
                            f"{', '.join(f'`{w}`' for w in words)} {'is a choice' if len(words) == 1 else 'are choices'}"
                            ": use sampler tpe or random, or a numeric range (uniform, loguniform, randint)")
    if search.sampler == "grid":
        ranges = [p.name for p in search.params if p.kind != "choice"]
        if ranges:
            raise SpecError(f"search.sampler grid walks lists of values, and {', '.join(f'`{r}`' for r in ranges)} "
                            "is a range: give it as {choice: [...]}, or use sampler tpe or random")
        if search.trials > search.grid_size:
            raise SpecError(f"search.trials is {search.trials}, but the grid has {search.grid_size} points: set "
                            f"trials: {search.grid_size} (a grid runs each point once)")
    if search.pruner == "hyperband" and search.pruner_settings["max_resource"] < search.pruner_settings["min_resource"]:
        raise SpecError("search.pruner.hyperband.max_resource must be a whole number ≥ min_resource "
                        f"({search.pruner_settings['min_resource']}): the last step a run reaches")
    if search.pbt:
        if search.sampler not in _PBT_SAMPLERS:
            raise SpecError(f"search.sampler {search.sampler}: population-based training draws its first population "
                            f"with {', '.join(_PBT_SAMPLERS)}, then perturbs it: use one of those")
        if search.trials < 2:
            raise SpecError(f"search.trials is {search.trials}, the population of pbt: at least 2, so that one "
                            "member can copy a better one (e.g. trials: 8)")
    least = smallest_budget(search)
    if search.trials < least:
        raise SpecError(f"search.trials is {search.trials}, below what pruner {search.pruner} needs to ever stop a run "
                        f"({least}: {_why_budget(search)}): raise trials to {least} or more, or use pruner: none")


def _why_budget(search: Search) -> str:
    s = search.pruner_settings
    if search.pruner in ("median", "percentile"):
        return f"it compares with the {s['startup_trials']} trials it lets finish first (startup_trials)"
    if search.pruner == "asha":
        return f"a rung keeps 1 in {s['reduction_factor']} runs (reduction_factor)"
    return (f"{brackets(search)} brackets (log base {s['reduction_factor']} of max_resource/min_resource, plus one), "
            f"each keeping 1 in {s['reduction_factor']} runs")


def _check_objectives(search: Search) -> None:
    """Several objectives as Optuna judges them: no pruner (a multi-objective trial reports no intermediate value),
    and a sampler that weighs several values."""
    if search.pruner != "none":
        raise SpecError(f"search.pruner {search.pruner}: Optuna's pruners judge one objective, and this search has "
                        f"{len(search.metrics)} ({', '.join(search.metrics)}): use pruner: none, or search one metric")
    if search.sampler in _SINGLE_OBJECTIVE:
        raise SpecError(f"search.sampler {search.sampler} optimises one objective, and this search has "
                        f"{len(search.metrics)} ({', '.join(search.metrics)}): use sampler tpe (the default), nsga2, "
                        "random or qmc")
