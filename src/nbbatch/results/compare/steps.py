"""The runs' metric histories in the runs table: each metric's value at a step, or its best over the steps.

A run that called ``nbbatch.record(step=N, ...)`` has a ``metrics.jsonl`` in its folder (named in the
``metrics_file`` column). By default the table shows each run's latest values (run.json's
``metrics``). :func:`select_history` shows instead, for every metric that appears in a history:

- ``at_step=N``: the value of the run's last point with step ≤ N;
- ``history="best"``: the best value over the steps (up to ``at_step`` when given): the minimum for
  names that look like losses or errors (:data:`LOWER_IS_BETTER`), else the maximum; ``best`` overrides
  that per metric (``{"score": "min"}`` or ``["score=min"]``).

Each such ``metric.<name>`` column gets a ``step.<name>`` column next to it: the step its value comes
from. A run without a point for a history metric (no history, or none up to step N) shows that metric
empty, never its latest value: a value at another step would compare unlike with like. Metrics
recorded without a step are left as they are.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from nbbatch.errors import NbbatchError, did_you_mean
from nbbatch.results.compare.collect import METRIC, PARAM, _pandas, read_run_files
from nbbatch.results.history import history_metrics, history_points, metric_series
from nbbatch.store.layout import METRICS_FILE
from nbbatch.store.share import Share

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

HISTORY_MODES = ("last", "best")
BEST_MODES = ("min", "max")
STEP = "step."
# a metric whose name contains one of these is better when lower (val_loss, top1_error, mse, …)
LOWER_IS_BETTER = ("loss", "error", "err", "mse", "mae", "perplexity")


def read_histories(frame: pd.DataFrame, share: str | os.PathLike[str] | Share | None = None
                   ) -> dict[Hashable, list[dict[str, Any]]]:
    """Each run's history points (:func:`~nbbatch.results.history.history_points`) by the frame's row index.

    Reads ``<share_path>/<metrics_file>`` through ``share`` (default: the share :func:`collect` read).
    Runs without a history, or whose history cannot be read, are left out.
    """
    return {index: points for index, points in read_run_files(frame, "metrics_file", history_points, share) if points}


def default_best_mode(metric: str) -> str:
    """``min`` for a metric named like a loss or an error (:data:`LOWER_IS_BETTER`), else ``max``."""
    name = metric.removeprefix(METRIC).lower()
    return "min" if any(word in name for word in LOWER_IS_BETTER) else "max"


def parse_best_modes(items: str | Sequence[str] | Mapping[str, str] | None) -> dict[str, str]:
    """``["loss=min", "score=max,bleu=max"]`` (or a mapping) → ``{"loss": "min", ...}``; bad items raise."""
    if not items:
        return {}
    if isinstance(items, Mapping):
        pairs = [(str(k), str(v)) for k, v in items.items()]
    else:
        pairs = []
        for item in [items] if isinstance(items, str) else items:
            for part in str(item).split(","):
                if not part.strip():
                    continue
                name, sep, mode = part.partition("=")
                if not sep or not name.strip():
                    raise NbbatchError(f"cannot read the best mode `{part.strip()}`: write METRIC=min or METRIC=max "
                                       "(e.g. --best-mode score=min)")
                pairs.append((name, mode))
    modes: dict[str, str] = {}
    for name, mode in pairs:
        mode = mode.strip().lower()
        if mode not in BEST_MODES:
            raise NbbatchError(f"unknown best mode `{mode}` for `{name.strip()}`: use min or max")
        modes[name.strip().removeprefix(METRIC)] = mode
    return modes


def _check_arguments(at_step: Any, history: str, modes: Mapping[str, str]) -> None:
    if history not in HISTORY_MODES:
        raise NbbatchError(f"unknown history mode `{history}`: use last (each run's latest values) or best "
                           "(each metric's best value over the steps)")
    if at_step is not None and (isinstance(at_step, bool) or not isinstance(at_step, numbers.Integral)
                                or at_step < 0):
        raise NbbatchError(f"--at-step takes a step number ≥ 0 (an epoch or iteration), not {at_step!r}")
    if modes and history != "best":
        raise NbbatchError("--best-mode chooses how --history best picks the best value: add --history best")


def _pick(steps: list[int], values: list[float], mode: str | None) -> tuple[int, float]:
    """The (step, value) shown: the last point, or the first point holding the min/max."""
    if mode is None:
        return steps[-1], values[-1]
    candidates = [(v, i) for i, v in enumerate(values) if not math.isnan(v)]
    if not candidates:
        return steps[-1], values[-1]
    best = min(candidates) if mode == "min" else min((-v, i) for v, i in candidates)
    return steps[best[1]], values[best[1]]


def _describe(at_step: int | None, history: str, modes: Mapping[str, str]) -> str:
    if history == "best":
        by_mode = {m: sorted(n for n, v in modes.items() if v == m) for m in BEST_MODES}
        detail = "; ".join(f"{m} of {', '.join(names)}" for m, names in by_mode.items() if names)
        up_to = f" up to step {at_step}" if at_step is not None else ""
        return f"history metrics: best over the steps{up_to} ({detail})"
    return f"history metrics: value at step {at_step}"


def select_history(frame: pd.DataFrame, *, at_step: int | None = None, history: str = "last",
                   best: str | Sequence[str] | Mapping[str, str] | None = None,
                   share: str | os.PathLike[str] | Share | None = None) -> pd.DataFrame:
    """The runs table with its history metrics taken from the runs' histories (see the module docstring).

    ``history="last"`` without ``at_step`` returns ``frame`` as it is. ``best`` overrides the min/max
    choice of ``history="best"`` per metric. Raises :class:`NbbatchError` for a negative ``at_step``,
    an unknown mode, a ``best`` for a metric no history has, and when no run has a history at all.
    """
    pd = _pandas()
    overrides = parse_best_modes(best)
    _check_arguments(at_step, history, overrides)
    if history == "last" and at_step is None:
        return frame
    histories = read_histories(frame, share)
    names: list[str] = []
    for points in histories.values():
        names += [n for n in history_metrics(points) if n not in names]
    if not names:
        asked = f"--at-step {at_step}" if at_step is not None else f"--history {history}"
        raise NbbatchError(f"{asked}: none of the {len(frame)} runs has a metric history ({METRICS_FILE}, written by "
                           "nbbatch.record(step=N, ...)); without --at-step/--history compare shows the latest values")
    for name in overrides:
        if name not in names:
            raise NbbatchError(f"--best-mode {name}: no history metric `{name}`{did_you_mean(name, names)}; "
                               f"history metrics: {', '.join(names)}")
    modes = {n: overrides.get(n) or default_best_mode(n) for n in names} if history == "best" else {}
    result = frame.copy()
    for name in names:
        steps_column: list[Any] = []
        values_column: list[float] = []
        for index in frame.index:
            points = histories.get(index, [])
            if at_step is not None:
                points = [p for p in points if p["step"] <= at_step]
            steps, values = metric_series(points, name)
            if not steps:  # no point for this metric: empty, not the run's latest value
                steps_column.append(pd.NA)
                values_column.append(math.nan)
                continue
            step, value = _pick(steps, values, modes.get(name))
            steps_column.append(step)
            values_column.append(value)
        result[METRIC + name] = pd.Series(values_column, index=frame.index, dtype="float64")
        result[STEP + name] = pd.array(steps_column, dtype="Int64")
    result = result[_ordered(list(frame.columns), names)]
    result.attrs = {**frame.attrs, "history": _describe(at_step, history, modes),
                    "runs_without_history": int(len(frame) - sum(i in histories for i in frame.index))}
    return result


def _ordered(columns: list[Any], names: list[str]) -> list[Any]:
    """``columns`` with each ``step.<name>`` after its ``metric.<name>``; new metric columns after the others."""
    added = [METRIC + n for n in names if METRIC + n not in columns]
    anchors = [i for i, c in enumerate(columns) if str(c).startswith(METRIC)] or \
        [i for i, c in enumerate(columns) if str(c).startswith(PARAM) or c == "status"]
    anchor = anchors[-1] if anchors else len(columns) - 1
    order: list[Any] = []
    for column in [*columns[: anchor + 1], *added, *columns[anchor + 1:]]:
        order.append(column)
        if str(column).startswith(METRIC) and str(column)[len(METRIC):] in names:
            order.append(STEP + str(column)[len(METRIC):])
    return order


def with_step_columns(frame: pd.DataFrame, columns: Sequence[str]) -> list[str]:
    """``columns`` with each ``step.<name>`` column of ``frame`` placed after its ``metric.<name>``."""
    shown: list[str] = []
    for column in columns:
        shown.append(column)
        step = STEP + column[len(METRIC):] if column.startswith(METRIC) else None
        if step and step in frame.columns and step not in columns:
            shown.append(step)
    return shown
