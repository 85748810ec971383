"""Which parameters matter: Optuna's PED-ANOVA importance of each parameter for a search's metric (or a sweep's),
computed from the runs' records, so that any machine that sees the share can report it (the study's journal is not
needed).

PED-ANOVA, Optuna's default evaluator since 5.0, asks how much each parameter's values among the best trials differ
from its values among all of them. It was chosen over fANOVA because it needs nothing but Optuna (fANOVA's random
forest needs scikit-learn), has no randomness (the same runs give the same importances on every machine) and is fast
(3,000 trials in well under a second, where fANOVA took minutes: docs/benchmarks.md).
Only trials that finished with a finite value count, as Optuna counts its COMPLETE trials: pruned and failed runs
are left out, and a trial continued over several runs counts once, by its latest segment (complete, or still
paused or stopped at a rung, then left out like a pruned one). The best trials are the best 10 %, or the best 5
when that is more (PED-ANOVA's own advice: at least 5).
"""

from __future__ import annotations

import math
import numbers as number_types
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from nbbatch.results.compare.collect import METRIC, PARAM, _pandas, varies
from nbbatch.results.compare.plots import default_metric
from nbbatch.results.compare.query import resolve_column
from nbbatch.results.compare.steps import default_best_mode
from nbbatch.results.compare.trials import trials_of

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

EVALUATOR = "PED-ANOVA"
TOP_QUANTILE = 0.1  # the best 10 % ...
TOP_TRIALS = 5  # ... or the best 5 when that is more
LEAST_TRIALS = 10  # below this, or below TRIALS_PER_PARAMETER each, importances are mostly noise
TRIALS_PER_PARAMETER = 5
WIDE = 100.0  # a positive parameter whose values span more than this factor is read on a log scale


def needed_trials(parameters: int) -> int:
    """How many finished trials make the importances of ``parameters`` parameters worth reading."""
    return max(LEAST_TRIALS, TRIALS_PER_PARAMETER * parameters)


def parameter_importance(frame: pd.DataFrame, search: Mapping[str, Any] | None = None,
                         metric: str | None = None) -> dict[str, Any] | None:
    """Each varied parameter's importance for the search's metric (``search``, default ``frame.attrs["search"]``),
    or for a sweep's ``metric`` (default :func:`default_metric`, best at its min for a loss or an error).

    Returns None when there is nothing to rank (fewer than two parameters vary, or no metric); else a JSON-able
    object: ``metric``, ``mode``, ``evaluator``, ``trials`` (finished trials used), ``top`` (how many of them
    count as the best), ``parameters`` (name → importance, summing to 1, most important first) and ``warning``
    (None, or why the numbers should not be trusted).
    """
    search = search if search is not None else frame.attrs.get("search")
    if search:  # several objectives: how much each parameter matters to reach their Pareto front
        objectives = search.get("objectives") or [(search["metric"], search.get("mode", "min"))]
        metrics, modes = [str(m) for m, _ in objectives], [str(m) for _, m in objectives]
        columns = [f"{METRIC}{m}" for m in metrics]
        rows = trials_of(frame) if "trial" in frame else frame  # a continued trial once, by its latest segment
    else:
        column = resolve_column(frame, metric) if metric else default_metric(frame)
        if column is None:
            return None
        columns, modes = [column], [default_best_mode(column)]
        metrics, rows = [column.removeprefix(METRIC)], frame
    if any(c not in rows for c in columns):
        return None
    finished = _finished(rows, columns)
    names = [c for c in finished.columns if str(c).startswith(PARAM) and varies(finished[c])]
    if len(names) < 2:
        return None
    result: dict[str, Any] = {"metric": metrics[0] if len(metrics) == 1 else metrics,
                              "mode": modes[0] if len(modes) == 1 else modes, "evaluator": EVALUATOR,
                              "trials": len(finished), "top": _top(len(finished)), "parameters": {}, "warning": None}
    try:
        importances = _evaluate(finished, names, columns, modes, (search or {}).get("params") or {})
    except ImportError:
        result["warning"] = "parameter importance needs optuna: pip install 'nbbatch[search]'"
        return result
    result["parameters"] = {name.removeprefix(PARAM): round(value, 4) for name, value in importances.items()}
    result["warning"] = _warning(finished, names, search is None)
    return result


def _finished(rows: pd.DataFrame, columns: Sequence[str]) -> pd.DataFrame:
    """The runs that succeeded with a finite value of every metric (Optuna's COMPLETE trials), by run id."""
    pd = _pandas()
    done = rows[rows["status"].astype(str) == "succeeded"].copy()
    for column in columns:
        done[column] = pd.to_numeric(done[column], errors="coerce")
        done = done[done[column].map(math.isfinite).astype(bool)]  # bool even when empty: a mask, not columns
    return done.sort_values("run_id", kind="stable")  # the same runs, the same study, whatever the table's order


def _top(trials: int) -> int:
    return min(trials, max(TOP_TRIALS, math.ceil(TOP_QUANTILE * trials)))


def _warning(finished: pd.DataFrame, names: Sequence[str], sweep: bool) -> str | None:
    """Why the importances should not be trusted, in words; None when nothing says so."""
    trials, count = len(finished), len(names)
    problems = []
    if trials < needed_trials(count):
        problems.append(f"{trials} trials for {count} parameters: too few for the importances to mean much "
                        f"(read them from {needed_trials(count)} on)")
    if sweep:  # a grid crossed whole is what ANOVA was made for; parameters swept together cannot be told apart
        levels = [finished[n].astype(str).nunique() for n in names]
        combinations = len(finished[list(names)].astype(str).drop_duplicates())
        if combinations < math.prod(levels):
            problems.append(f"the parameters were not swept independently ({combinations} of the "
                            f"{math.prod(levels)} combinations ran): an importance may belong to another parameter")
    return "; ".join(problems) or None


def _evaluate(finished: pd.DataFrame, names: Sequence[str], columns: Sequence[str], modes: Sequence[str],
              space: Mapping[str, Any]) -> dict[str, float]:
    """PED-ANOVA on a study made in memory from the finished runs: parameter column → importance."""
    import optuna
    from optuna.importance import PedAnovaImportanceEvaluator, get_param_importances

    distributions = {n: _distribution(optuna, finished[n], space.get(n.removeprefix(PARAM))) for n in names}
    trials = []
    for row in finished[[*names, *columns]].to_dict(orient="records"):  # not iterrows: a Series a row is slow
        params = {n: _value(row[n], distributions[n]) for n in names if not _missing(row[n])}
        values = [float(row[c]) for c in columns]
        trials.append(optuna.trial.create_trial(params=params, distributions={n: distributions[n] for n in params},
                                                values=values))
    quantile = _top(len(trials)) / len(trials)
    if quantile >= 1.0:  # too few trials to tell the best from the rest
        return {n: 1.0 / len(names) for n in names}
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no "A new study created in memory" on the way
    try:
        study = optuna.create_study(directions=["minimize" if m == "min" else "maximize" for m in modes])
        study.add_trials(trials)
        with warnings.catch_warnings():  # optuna's own notes (experimental, equal importances): the result says it
            warnings.simplefilter("ignore")
            return get_param_importances(study, evaluator=PedAnovaImportanceEvaluator(target_quantile=quantile))
    finally:
        optuna.logging.set_verbosity(verbosity)


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _distribution(optuna: Any, values: pd.Series, declared: Any) -> Any:
    """The Optuna distribution of a parameter: the search's declared one (``{loguniform: [low, high]}``...), else
    one read from its values (numbers as a range, on a log scale when positive and wide; anything else as choices)."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    present = [v for v in values if not _missing(v)]
    numbers = [v for v in present if isinstance(v, number_types.Real) and not isinstance(v, bool)]
    kind, args = next(iter(declared.items())) if isinstance(declared, Mapping) and len(declared) == 1 else (None, None)
    if kind == "choice" or len(numbers) < len(present):
        return CategoricalDistribution(sorted({_choice(v) for v in present}, key=str))
    low, high = min(numbers), max(numbers)
    if kind in ("uniform", "loguniform", "randint") and isinstance(args, list) and len(args) == 2:
        low, high = min(low, args[0]), max(high, args[1])
    if kind == "randint" or (kind is None and all(float(v).is_integer() for v in numbers)
                             and all(isinstance(v, number_types.Integral) for v in present)):
        return IntDistribution(int(low), int(high))
    log = kind == "loguniform" or (kind is None and low > 0 and high / low > WIDE)
    return FloatDistribution(float(low), float(high), log=log)


def _choice(value: Any) -> Any:
    """A value as Optuna's choices hold it (None, bool, int, float or str)."""
    return value if isinstance(value, (bool, int, float, str)) else str(value)


def _value(value: Any, distribution: Any) -> Any:
    from optuna.distributions import CategoricalDistribution, IntDistribution

    if isinstance(distribution, CategoricalDistribution):
        return _choice(value)
    return int(value) if isinstance(distribution, IntDistribution) else float(value)
