"""Plots of the runs table (matplotlib, through a bare :class:`~matplotlib.figure.Figure`), metric histories and GPU telemetry."""

from __future__ import annotations

import io
import os
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from nbbatch.execute.telemetry import read_series
from nbbatch.results.compare.collect import METRIC, PARAM, _pandas, read_run_files, varies
from nbbatch.results.compare.query import _numeric_columns, resolve_column
from nbbatch.results.compare.steps import default_best_mode, read_histories
from nbbatch.results.compare.trials import joined_histories, latest_segments
from nbbatch.results.history import metric_series
from nbbatch.results.status import format_metric, order_value
from nbbatch.store.share import Share

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd
    from matplotlib.figure import Figure


def _figure(width: float = 6.4, height: float = 4.2) -> Figure:
    # A bare Figure renders with the Agg canvas and touches no pyplot state (safe in a Jupyter session).
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def _numeric(frame: pd.DataFrame, column: str) -> pd.Series:
    return _pandas().to_numeric(frame[column], errors="coerce")


def default_metric(frame: pd.DataFrame) -> str | None:
    """``metric.accuracy`` if present, else the first numeric metric column (None without one)."""
    if f"{METRIC}accuracy" in frame:
        return f"{METRIC}accuracy"
    numeric = _numeric_columns(frame, (METRIC,))
    return numeric[0] if numeric else None


def default_time(frame: pd.DataFrame) -> str:
    """The training-time column: ``metric.train_seconds`` when the notebooks record it, else ``duration_s``."""
    for name in ("train_seconds", "training_seconds", "train_time", "train_time_s"):
        if f"{METRIC}{name}" in frame and _numeric(frame, f"{METRIC}{name}").notna().any():
            return f"{METRIC}{name}"
    return "duration_s"


def swept_parameters(frame: pd.DataFrame) -> list[str]:
    """``param.*`` columns with more than one value among the runs (:func:`~nbbatch.results.compare.collect.varies`):
    those every run has first, numeric ones (not booleans) first, then by name."""
    def numeric(column: str) -> bool:
        present = frame[column].dropna()
        return not present.map(lambda v: isinstance(v, bool)).any() and \
            _numeric(frame, column).notna().sum() == len(present)

    swept = [c for c in frame.columns if str(c).startswith(PARAM) and varies(frame[c])]
    return sorted(swept, key=lambda c: (bool(frame[c].isna().any()), not numeric(c), c))


def _label(column: str) -> str:
    return column.removeprefix(METRIC).removeprefix(PARAM)


def _group_key(frame: pd.DataFrame) -> pd.Series:
    return frame["framework"].fillna(frame["notebook"]).fillna("runs").astype(str)


def _groups(frame: pd.DataFrame) -> Iterable[tuple[str, pd.DataFrame]]:
    key = _group_key(frame)
    for name in sorted(key.unique()):
        yield name, frame[key == name]


def group_title(frame: pd.DataFrame) -> str:
    """What tells the groups apart: ``framework``, or ``notebook`` for plain notebooks (known by their name)."""
    framework = frame["framework"].astype(str)
    plain = (framework == frame["notebook"].astype(str).str.removesuffix(".ipynb")) & \
        (frame["kernel"].astype(str) != "nbbatch-" + framework)
    return "notebook" if plain.all() else "framework"


LINE_STYLES = ("-", "--", ":", "-.")


def line_styles(count: int) -> list[dict[str, str]]:
    """``count`` distinct (colour, line style) pairs: the ten tab colours, then again dashed, dotted, dash-dotted."""
    from matplotlib import colormaps

    colours = [colormaps["tab10"](i) for i in range(10)]
    return [{"color": colours[i % 10], "linestyle": LINE_STYLES[(i // 10) % len(LINE_STYLES)]} for i in range(count)]


def _legend_outside(ax: Any, title: str | None = None, count: int = 1) -> None:
    """The legend beside the axes, never over the data; below them, in columns, when it is long (the figure grows
    for it, and the constrained layout makes room)."""
    labels = ax.get_legend_handles_labels()[1]
    if count <= 12 and max((len(label) for label in labels), default=0) <= 32:
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize="x-small", title=title,
                  title_fontsize="x-small")
        return
    columns = 3 if max(len(label) for label in labels) <= 32 else 2
    ax.figure.set_figheight(ax.figure.get_figheight() + 0.17 * -(-count // columns) + 0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), borderaxespad=0.0, fontsize="x-small", title=title,
              title_fontsize="x-small", ncol=columns)


def _log_if_wide(ax: Any, values: pd.Series) -> None:
    positive = values[values > 0]
    if len(values) and len(positive) == len(values) and positive.max() / positive.min() >= 20:
        ax.set_xscale("log")


def plot_metric_vs_time(frame: pd.DataFrame, metric: str | None = None, time: str | None = None) -> Figure | None:
    """Scatter of a metric (default accuracy) against training time, one colour per framework.

    ``time`` defaults to :func:`default_time`. Returns None when no run has both values. One framework (or one
    plain notebook): one colour and no legend.
    """
    metric = resolve_column(frame, metric) if metric else default_metric(frame)
    if metric is None:
        return None
    time = resolve_column(frame, time) if time else default_time(frame)
    data = frame.assign(_x=_numeric(frame, time), _y=_numeric(frame, metric)).dropna(subset=["_x", "_y"])
    if data.empty:
        return None
    groups = list(_groups(data))
    several = len(groups) > 1
    fig = _figure(width=7.6 if several else 6.4)
    ax = fig.add_subplot()
    for name, group in groups:
        ax.scatter(group["_x"], group["_y"], label=name, s=40, alpha=0.85)
    ax.set_xlabel(f"{_label(time)} (s)" if not _label(time).endswith("_s") else _label(time))
    ax.set_ylabel(_label(metric))
    ax.set_title(f"{_label(metric)} vs. {_label(time)}" + (f" by {group_title(data)}" if several else ""))
    ax.grid(True, alpha=0.3)
    if several:
        _legend_outside(ax, group_title(data), len(groups))
    return fig


MAX_SERIES = 10  # more combinations of the other parameters than this: their median and spread, labelled so


def plot_metric_vs_param(frame: pd.DataFrame, metric: str | None = None, param: str | None = None) -> Figure | None:
    """A metric against a swept parameter, never averaged unsaid.

    One line per combination of the other swept parameters (and framework, when the runs have several), labelled
    by them (``PENALTY=l1``): every point is a value a run reached. With more than :data:`MAX_SERIES` such
    combinations, per framework the median over them with a min–max band and every run as a dot, labelled and
    titled so. A search's trials (runs with a ``trial``) are a scatter instead (:func:`plot_trials`).

    ``param`` defaults to the first swept parameter (:func:`swept_parameters`), on a log axis when its
    values are positive and span a factor of 20 or more (learning rates, batch sizes). Returns None
    without a metric or a swept parameter.
    """
    search = frame.attrs.get("search")
    if "trial" in frame and frame["trial"].notna().any():
        return plot_trials(frame, metric or (search or {}).get("metric"), param)
    metric = resolve_column(frame, metric) if metric else default_metric(frame)
    swept = swept_parameters(frame)
    param = resolve_column(frame, param) if param else (swept[0] if swept else None)
    if metric is None or param is None:
        return None
    data = frame.assign(_y=_numeric(frame, metric)).dropna(subset=["_y"])
    if data.empty:
        return None
    numeric_x = _numeric(data, param)
    categorical = numeric_x.isna().any()
    data = data.assign(_x=data[param].map(lambda v: str(v) if _pandas().notna(v) else "(unset)")
                       if categorical else numeric_x)
    others = [c for c in swept_parameters(data) if c != param]
    several = _group_key(data).nunique() > 1
    series: dict[tuple[Any, ...], list[Hashable]] = {}
    for index, row in data.iterrows():
        # a run without one of the other parameters (set only for some runs) is a series of its own
        key = ((_group_key(data)[index],) if several else ()) + \
            tuple(None if not _pandas().notna(row[c]) else row[c] for c in others)
        series.setdefault(key, []).append(index)
    fig = _figure(width=7.6)
    ax = fig.add_subplot()
    # the series' labels name the other parameters (PENALTY=l1): a legend title names only the framework
    legend_title = group_title(data) if several and not others else None
    if len(series) > MAX_SERIES:
        _draw_spread(ax, data, others)
        ax.set_title(f"{_label(metric)} vs. {_label(param)} (median over {', '.join(_label(c) for c in others)})")
    else:
        keys = sorted(series, key=lambda k: [order_value(v) for v in k])
        for key, style in zip(keys, line_styles(len(keys)), strict=True):
            group = data.loc[series[key]]
            label = ", ".join([*([str(key[0])] if several else []),
                               *(f"{_label(c)}={'(unset)' if v is None else format_metric(v)}"
                                 for c, v in zip(others, key[several:], strict=True))])
            _draw_series(ax, group, label or None, style)
        ax.set_title(f"{_label(metric)} vs. {_label(param)}")
    if not categorical:
        _log_if_wide(ax, numeric_x)
    ax.set_xlabel(_label(param))
    ax.set_ylabel(_label(metric))
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[1]:
        _legend_outside(ax, legend_title, len(ax.get_legend_handles_labels()[1]))
    return fig


def _draw_series(ax: Any, group: pd.DataFrame, label: str | None, style: Mapping[str, Any]) -> None:
    """One combination's runs by x. Runs alike in every swept parameter (repeats) are each a dot, and the line
    joins their mean, said in the label."""
    by_x = group.groupby("_x", sort=True)["_y"]
    repeats = int(by_x.size().max())
    if repeats > 1:
        ax.scatter(group["_x"], group["_y"], color=style["color"], s=14, alpha=0.5)
        label = f"{label or 'runs'} (line: mean of up to {repeats} repeats)"
    points = by_x.mean()
    ax.plot(list(points.index), list(points.values), marker="o", label=label, **style)


def _draw_spread(ax: Any, data: pd.DataFrame, others: Sequence[str]) -> None:
    """Per framework: every run as a dot, the median over the other parameters as a line, min–max as a band."""
    names = ", ".join(_label(c) for c in others)
    groups = list(_groups(data))
    for (name, group), style in zip(groups, line_styles(len(groups)), strict=True):
        stats = group.groupby("_x", sort=True)["_y"].agg(["median", "min", "max", "size"])
        xs = list(stats.index)
        ax.scatter(group["_x"], group["_y"], color=style["color"], s=10, alpha=0.35)
        ax.fill_between(xs, list(stats["min"]), list(stats["max"]), color=style["color"], alpha=0.15)
        prefix = f"{name}: " if len(groups) > 1 else ""
        ax.plot(xs, list(stats["median"]), marker="o", color=style["color"],
                label=f"{prefix}median over {names} ({int(stats['size'].max())} runs per point; band: min–max)")


def plot_trials(frame: pd.DataFrame, metric: str | None = None, param: str | None = None) -> Figure | None:
    """A search's trials: the metric against each searched parameter (or ``param``), one dot per trial coloured by
    its trial number (a colour bar), pruned (or paused) ones as ×; a trial continued over several runs once, at its
    latest segment's value. No line: a search draws its points where it chose them."""
    frame = latest_segments(frame)
    metric = resolve_column(frame, metric) if metric else default_metric(frame)
    params = [resolve_column(frame, param)] if param else swept_parameters(frame)[:4]
    if metric is None or not params:
        return None
    data = frame.assign(_y=_numeric(frame, metric), _trial=_numeric(frame, "trial")).dropna(subset=["_y", "_trial"])
    if data.empty:
        return None
    fig = _figure(width=max(6.4, 3.4 * len(params) + 1.2), height=4.0)
    axes = fig.subplots(1, len(params), sharey=True, squeeze=False)[0]
    pruned = data["status"].astype(str).isin(["pruned", "paused"])
    low, high = float(data["_trial"].min()), float(data["_trial"].max())
    dots = None
    for ax, column in zip(axes, params, strict=True):
        x = _numeric(data, column)
        x = data[column].astype(str) if x.isna().any() else x
        for subset, marker in ((~pruned, "o"), (pruned, "x")):
            if subset.any():
                dots = ax.scatter(x[subset], data["_y"][subset], c=data["_trial"][subset], cmap="viridis",
                                  vmin=low, vmax=high, marker=marker, s=26,
                                  **({"edgecolors": "none"} if marker == "o" else {}))
        if _pandas().api.types.is_numeric_dtype(x):
            _log_if_wide(ax, x)
        ax.set_xlabel(_label(column))
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel(_label(metric))
    axes[0].set_title(f"{_label(metric)} vs. " + ", ".join(_label(c) for c in params)
                      + ((" (×: pruned or paused)" if (data["status"].astype(str) == "paused").any() else
                          " (×: pruned)") if pruned.any() else ""), loc="left")
    fig.colorbar(dots, ax=list(axes), label="trial", pad=0.02)
    return fig


def plot_metric_by_framework(frame: pd.DataFrame, metric: str | None = None) -> Figure | None:
    """The best value of a metric per framework (or notebook), best on top, each bar with its value; None with
    fewer than two frameworks. What a reader of the demo wants first."""
    rows = leaders(frame, metric)
    if len(rows) < 2:
        return None
    fig = _figure(height=0.9 + 0.32 * len(rows))
    ax = fig.add_subplot()
    names = [r["name"] for r in rows][::-1]
    values = [r["value"] for r in rows][::-1]
    bars = ax.barh(names, values, color="tab:blue", alpha=0.8)
    ax.bar_label(bars, labels=[format_metric(v) for v in values], padding=3, fontsize="small")
    metric_name = _label(rows[0]["metric"])
    ax.set_xlabel(metric_name)
    ax.set_title(f"{metric_name} by {group_title(frame)}")
    ax.margins(x=0.15)
    ax.grid(True, axis="x", alpha=0.3)
    return fig


def leaders(frame: pd.DataFrame, metric: str | None = None) -> list[dict[str, Any]]:
    """Per framework (or notebook) its best run that succeeded, by ``metric`` (default :func:`default_metric`; the
    lowest for a loss or an error), best first: ``name``, ``metric``, ``value``, ``run_id``, ``time``
    (:func:`default_time`), ``runs`` (how many it was the best of)."""
    metric = resolve_column(frame, metric) if metric else default_metric(frame)
    if metric is None:
        return []
    time = default_time(frame)
    data = frame.assign(_y=_numeric(frame, metric), _t=_numeric(frame, time)).dropna(subset=["_y"])
    data = data[data["status"].astype(str) == "succeeded"]  # a failed run's metric is where it stopped
    lowest = default_best_mode(metric) == "min"
    rows = []
    for name, group in _groups(data):
        best = group.loc[group["_y"].idxmin() if lowest else group["_y"].idxmax()]
        rows.append({"name": name, "metric": metric, "value": float(best["_y"]), "run_id": best["run_id"],
                     "time": None if best["_t"] != best["_t"] else float(best["_t"]), "runs": len(group)})
    return sorted(rows, key=lambda r: r["value"], reverse=not lowest)


def run_labels(frame: pd.DataFrame) -> dict[Hashable, str]:
    """How each run is named in a legend, by the frame's row index: the swept parameters that tell it apart
    (``BATCH=64, LR=0.01``), after its framework when the runs have several and its experiment when the frame
    holds several; its run id when nothing differs (or to tell apart runs alike in all of these)."""
    swept = swept_parameters(frame)
    several = _group_key(frame).nunique() > 1 if len(frame) else False
    experiments = frame["experiment"].nunique() > 1
    labels: dict[Hashable, str] = {}
    for index, row in frame.iterrows():
        parts = [", ".join(f"{_label(c)}={format_metric(row[c])}" for c in swept if _pandas().notna(row[c]))]
        if several:
            parts.insert(0, str(_group_key(frame)[index]))
        labels[index] = ", ".join(p for p in parts if p) or str(row["run_id"])
    counts: dict[str, int] = {}
    for label in labels.values():
        counts[label] = counts.get(label, 0) + 1
    for index, label in labels.items():
        if counts[label] > 1 and label != frame.loc[index, "run_id"]:
            labels[index] = f"{label} ({frame.loc[index, 'run_id']})"
        if experiments:
            labels[index] = f"{frame.loc[index, 'experiment']}/{labels[index]}"
    return labels


def load_histories(frame: pd.DataFrame, share: str | os.PathLike[str] | Share | None = None
                   ) -> dict[str, list[dict[str, Any]]]:
    """The metric histories of the runs that have one: ``{run label: points}`` (labels: :func:`run_labels`).

    Reads each run's ``metrics.jsonl`` (see :func:`~nbbatch.results.compare.steps.read_histories`). A search's trial
    continued over several runs is one history, its segments' points in segment order, under one label (:func:`
    ~nbbatch.results.compare.trials.joined_histories`).
    """
    labels = run_labels(latest_segments(frame))
    return {labels[index]: points for index, points in joined_histories(frame, read_histories(frame, share)).items()}


_MAX_LEGEND = 24  # more runs than this: a legend would be longer than the plot


def plot_metric_by_step(histories: Mapping[str, Sequence[Mapping[str, Any]]], metric: str) -> Figure | None:
    """``<metric> by step``: one line per run of :func:`load_histories`, x = step, each run its own colour and line
    style (:func:`line_styles`), the legend beside the axes.

    Returns None when no run has two points of ``metric`` (nothing to draw a curve of).
    """
    curves = {label: metric_series(list(points), metric) for label, points in histories.items()}
    curves = {label: curve for label, curve in curves.items() if curve[0]}
    if not any(len(steps) >= 2 for steps, _ in curves.values()):
        return None
    from matplotlib.ticker import MaxNLocator

    fig = _figure(width=7.6)
    ax = fig.add_subplot()
    for (label, (steps, values)), style in zip(curves.items(), line_styles(len(curves)), strict=True):
        # markers only while they stay apart; a one-point run is then still visible
        ax.plot(steps, values, label=label, linewidth=1.3, marker="o" if len(steps) <= 30 else None, markersize=3,
                **style)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step" if len(curves) <= _MAX_LEGEND else f"step ({len(curves)} runs)")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} by step")
    ax.grid(True, alpha=0.3)
    if len(curves) <= _MAX_LEGEND:
        _legend_outside(ax, "run", len(curves))
    return fig


def load_telemetry(frame: pd.DataFrame, share: str | os.PathLike[str] | Share | None = None
                   ) -> dict[str, list[dict[str, Any]]]:
    """The telemetry series of the runs that have one: ``{run label: samples}`` (labels: :func:`run_labels`; the
    series: :mod:`nbbatch.execute.telemetry`).

    Reads ``<run folder>/telemetry.jsonl`` (or an older run's ``telemetry.json``, or a ``.csv``) through
    ``share`` (default: the share :func:`collect` read). Unreadable series are skipped.
    """
    labels = run_labels(frame)
    return {labels[index]: samples
            for index, samples in read_run_files(frame, "telemetry_file", read_series, share) if samples}


def plot_gpu_telemetry(series: Mapping[str, Sequence[Mapping[str, Any]]]) -> Figure | None:
    """GPU utilisation (%) and memory used (MB) over time, one line per run (and GPU, when a run has several)."""
    if not any(series.values()):
        return None
    fig = _figure(height=6.0)
    util_ax, mem_ax = fig.subplots(2, 1, sharex=True)
    for label, samples in series.items():
        by_gpu: dict[Any, list[Mapping[str, Any]]] = {}
        for sample in samples:
            by_gpu.setdefault(sample.get("gpu"), []).append(sample)
        for gpu, points in by_gpu.items():
            name = label if len(by_gpu) == 1 else f"{label} gpu{gpu}"
            t = [p.get("t") for p in points]
            line = util_ax.plot(t, [p.get("util_pct") for p in points], label=name)[0]
            mem_ax.plot(t, [p.get("memory_mb") for p in points], color=line.get_color(), label=name)
    util_ax.set_ylabel("GPU utilisation (%)")
    util_ax.set_ylim(0, 105)
    mem_ax.set_ylabel("GPU memory used (MB)")
    mem_ax.set_xlabel("time since the run started (s)")
    util_ax.set_title("GPU utilisation over time")
    mem_ax.set_title("GPU memory used over time", fontsize="medium")
    for ax in (util_ax, mem_ax):
        ax.grid(True, alpha=0.3)
    _legend_outside(util_ax, "run", len(util_ax.get_lines()))
    return fig


def figure_png(fig: Figure) -> bytes:
    """A figure as PNG bytes (Agg renderer)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()
