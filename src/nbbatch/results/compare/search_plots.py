"""A search's part of the report: its best trial, the best value by trial, the parameters against the metric
(parallel coordinates), every trial's curve with the pruned runs marked where they stopped, for several objectives
the Pareto front (the first objective is the one the other figures show), and which parameters matter (also drawn
for a sweep). Each shows one point or line per trial: a trial continued over several runs by its latest segment
(:mod:`nbbatch.results.compare.trials`), its curve the segments' joined."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from nbbatch.results.compare.collect import METRIC, PARAM
from nbbatch.results.compare.plots import _figure, _numeric, run_labels
from nbbatch.results.compare.trials import latest_segments, trials_of
from nbbatch.results.history import metric_series

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd
    from matplotlib.figure import Figure

PRUNED, FINISHED, FRONT, PAUSED = "tab:red", "tab:blue", "tab:orange", "tab:gray"
STOPPED = ("pruned", "paused")  # a trial stopped at a step: for good, or until the search continues it


def _trials(frame: pd.DataFrame, metric: str) -> pd.DataFrame:
    """The search's trials (one row per trial: a continued one's latest segment, :func:`trials_of`), by trial
    number, with their metric value as ``value``."""
    if "trial" not in frame or f"{METRIC}{metric}" not in frame:
        return frame.iloc[0:0]
    trials = trials_of(frame)
    return trials.assign(value=_numeric(trials, f"{METRIC}{metric}")).sort_values("trial", kind="stable")


def best_trial(frame: pd.DataFrame, search: Mapping[str, Any]) -> dict[str, Any] | None:
    """The trial that completed with the best value of the search's metric (a continued trial by its latest
    segment): its run id (the latest segment's), trial number, value and parameters."""
    trials = _trials(frame, search["metric"])
    done = trials[(trials["status"].astype(str) == "succeeded") & trials["value"].notna()]
    if done.empty:
        return None
    row = done.loc[done["value"].idxmin() if search.get("mode", "min") == "min" else done["value"].idxmax()]
    params = {str(c).removeprefix(PARAM): _plain(row[c]) for c in frame.columns if str(c).startswith(PARAM)}
    return {"run_id": row["run_id"], "trial": int(row["trial"]), "value": float(row["value"]), "parameters": params}


def _plain(value: Any) -> Any:
    """A cell as JSON holds it: numpy's numbers as Python's."""
    return value.item() if hasattr(value, "item") and callable(value.item) else value


def plot_best_by_trial(frame: pd.DataFrame, search: Mapping[str, Any]) -> Figure | None:
    """Each finished trial's value, pruned ones at their last value (×), and the best so far as a step line."""
    metric, minimise = search["metric"], search.get("mode", "min") == "min"
    trials = _trials(frame, metric)
    if trials["value"].notna().sum() < 2:
        return None
    fig = _figure()
    ax = fig.add_subplot()
    pruned = trials["status"].astype(str) == "pruned"
    paused = trials["status"].astype(str) == "paused"
    finished = trials[~pruned & (trials["status"].astype(str) == "succeeded")]
    ax.scatter(finished["trial"], finished["value"], color=FINISHED, s=18, label="finished")
    ax.scatter(trials[pruned]["trial"], trials[pruned]["value"], color=PRUNED, marker="x", s=22,
               label="pruned (last value)")
    if paused.any():  # waiting at a rung while the search goes on
        ax.scatter(trials[paused]["trial"], trials[paused]["value"], color=PAUSED, marker="x", s=22,
                   label="paused (value at its rung)")
    best, xs, ys = math.inf if minimise else -math.inf, [], []
    for number, value in zip(finished["trial"], finished["value"], strict=True):
        if not math.isnan(value) and (value < best if minimise else value > best):
            best = value
        if not math.isinf(best):
            xs.append(number)
            ys.append(best)
    if xs:  # on to the last trial
        last = float(trials["trial"].max())
        ax.step([*xs, last], [*ys, ys[-1]], where="post", color="black", linewidth=1.2, label="best so far")
    ax.set_xlabel("trial")
    ax.set_ylabel(metric)
    ax.set_title(f"search: best {metric} by trial")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="x-small")
    return fig


def plot_parallel_coordinates(frame: pd.DataFrame, search: Mapping[str, Any]) -> Figure | None:
    """One line per trial across the searched parameters and the metric (each axis scaled to its range; a
    parameter drawn on a log scale where its values span more than two decades), coloured by the metric."""
    metric = search["metric"]
    trials = _trials(frame, metric)
    trials = trials[trials["value"].notna()]
    columns = [c for c in trials.columns if str(c).startswith(PARAM) and trials[c].astype(str).nunique() > 1]
    if len(trials) < 2 or not columns:
        return None
    axes = [_scaled(trials[c]) for c in columns] + [_scaled(trials["value"])]
    names = [str(c).removeprefix(PARAM) for c in columns] + [metric]
    ends = [_ends(trials[c]) for c in columns] + [_ends(trials["value"])]
    from matplotlib import colormaps

    fig = _figure(width=max(6.4, 1.6 * len(names)))
    ax = fig.add_subplot()
    values = trials["value"].to_numpy(dtype=float)
    low, high = values.min(), values.max()
    cmap = colormaps["viridis_r" if search.get("mode", "min") == "min" else "viridis"]
    for i, (_, row) in enumerate(trials.iterrows()):
        shade = 0.5 if high == low else (values[i] - low) / (high - low)
        pruned = str(row["status"]) in STOPPED
        ax.plot(range(len(names)), [a[i] for a in axes], color=cmap(shade), alpha=0.5 if pruned else 0.9,
                linestyle="--" if pruned else "-", linewidth=1.0)
    ax.set_xticks(range(len(names)), names)
    ax.set_yticks([])
    for x, (low_text, high_text) in enumerate(ends):  # each axis's range, at its ends
        ax.annotate(high_text, (x, 1.0), textcoords="offset points", xytext=(0, 4), ha="center", fontsize="x-small")
        ax.annotate(low_text, (x, 0.0), textcoords="offset points", xytext=(0, -10), ha="center", fontsize="x-small")
    ax.set_ylim(-0.08, 1.08)
    stopped = "pruned or paused" if (trials["status"].astype(str) == "paused").any() else "pruned"
    ax.set_title(f"search: parameters and {metric} (dashed: {stopped})")
    return fig


def _ends(series: pd.Series) -> tuple[str, str]:
    """What an axis of :func:`_scaled` shows at its bottom and top."""
    numbers = _numeric(series.to_frame("v"), "v")
    if numbers.notna().all():
        return f"{numbers.min():.3g}", f"{numbers.max():.3g}"
    names = sorted({str(v) for v in series})
    return names[0], names[-1]


def _scaled(series: pd.Series) -> list[float]:
    """A column's values on 0..1 (numbers by their range, on a log scale when positive and wide; others by rank)."""
    numbers = _numeric(series.to_frame("v"), "v")
    if numbers.notna().all():
        values = [float(v) for v in numbers]
        if min(values) > 0 and max(values) / min(values) > 100:
            values = [math.log10(v) for v in values]
        low, high = min(values), max(values)
        return [0.5 if high == low else (v - low) / (high - low) for v in values]
    order = {v: i for i, v in enumerate(sorted({str(v) for v in series}))}
    top = max(len(order) - 1, 1)
    return [order[str(v)] / top for v in series]


def plot_trial_curves(frame: pd.DataFrame, histories: Mapping[str, Sequence[Mapping[str, Any]]],
                      search: Mapping[str, Any]) -> Figure | None:
    """The search's metric by step for every trial (a continued trial's segments joined into one curve, as
    :func:`~nbbatch.results.compare.plots.load_histories` gives them); a pruned trial's curve ends in a × where it
    was stopped, a paused one's (grey) where it waits."""
    metric = search["metric"]
    trials = _trials(frame, metric)
    curves = []
    labels = run_labels(latest_segments(frame))
    for index, row in trials.iterrows():
        steps, values = metric_series(list(histories.get(labels[index], [])), metric)
        at = row.get("pruned_at")
        if steps and at is not None and not math.isnan(at) and int(at) in steps:  # what it ran after the decision
            cut = steps.index(int(at)) + 1
            steps, values = steps[:cut], values[:cut]
        if steps:
            curves.append((str(row["status"]), steps, values))
    if not any(len(steps) >= 2 for _, steps, _ in curves):
        return None
    fig = _figure()
    ax = fig.add_subplot()
    colours = {"pruned": PRUNED, "paused": PAUSED}
    for status, steps, values in curves:
        ax.plot(steps, values, color=colours.get(status, FINISHED), alpha=0.6, linewidth=1.0)
        if status in STOPPED:
            ax.scatter([steps[-1]], [values[-1]], color=colours[status], marker="x", s=24)
    paused = "; grey: paused" if any(status == "paused" for status, _, _ in curves) else ""
    ax.set_xlabel(f"step ({len(curves)} trials; red: pruned{paused})")
    ax.set_ylabel(metric)
    ax.set_title(f"search: every trial's {metric}")
    ax.grid(True, alpha=0.3)
    return fig


def plot_pareto_front(frame: pd.DataFrame, search: Mapping[str, Any]) -> Figure | None:
    """A multi-objective search's succeeded trials on its first two objectives, those on the Pareto front (the
    frame's ``pareto`` column) marked and joined in order, each labelled with its trial number."""
    objectives = search.get("objectives") or []
    if len(objectives) < 2 or "pareto" not in frame:
        return None
    (x_metric, x_mode), (y_metric, y_mode) = objectives[:2]
    trials = trials_of(frame)
    trials = trials.assign(x=_numeric(trials, f"{METRIC}{x_metric}"), y=_numeric(trials, f"{METRIC}{y_metric}"))
    trials = trials[(trials["status"].astype(str) == "succeeded") & trials["x"].notna() & trials["y"].notna()]
    if len(trials) < 2:
        return None
    front = trials[trials["pareto"].fillna(False).astype(bool)].sort_values("x", kind="stable")
    fig = _figure()
    ax = fig.add_subplot()
    ax.scatter(trials["x"], trials["y"], color=FINISHED, s=18, alpha=0.6, label="trial")
    ax.plot(front["x"], front["y"], color=FRONT, marker="o", markersize=6, linewidth=1.0,
            label=f"Pareto front ({len(front)})")
    for number, x, y in zip(front["trial"], front["x"], front["y"], strict=True):
        ax.annotate(str(int(number)), (x, y), textcoords="offset points", xytext=(4, 4), fontsize="x-small")
    ax.set_xlabel(f"{x_metric} ({'lower' if x_mode == 'min' else 'higher'} is better)")
    ax.set_ylabel(f"{y_metric} ({'lower' if y_mode == 'min' else 'higher'} is better)")
    ax.set_title(f"search: Pareto front of {x_metric} and {y_metric}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="x-small")
    return fig


def plot_importance(importance: Mapping[str, Any] | None) -> Figure | None:
    """Which parameters matter: each parameter's importance (:func:`~nbbatch.results.compare.importance.
    parameter_importance`) as a bar, the most important on top; hatched when its warning says not to trust it."""
    if not importance or not importance.get("parameters"):
        return None
    names = list(importance["parameters"])[::-1]
    values = [importance["parameters"][n] for n in names]
    fig = _figure(height=1.2 + 0.32 * len(names))
    ax = fig.add_subplot()
    bars = ax.barh(names, values, color="tab:blue", alpha=0.8, hatch="//" if importance.get("warning") else None)
    ax.bar_label(bars, labels=[f"{v:.0%}" for v in values], padding=3, fontsize="small")
    metric = importance["metric"]
    ax.set_xlabel(f"importance for {metric if isinstance(metric, str) else ' and '.join(metric)} "
                  f"({importance['evaluator']}, {importance['trials']} trials" +
                  ("; too few: see the warning)" if importance.get("warning") else ")"))
    ax.set_xlim(0, 1.15)
    ax.set_title("which parameters matter")
    ax.grid(True, axis="x", alpha=0.3)
    return fig
