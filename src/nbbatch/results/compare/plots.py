"""Plots of the runs table (matplotlib, through a bare :class:`~matplotlib.figure.Figure`), metric histories and GPU telemetry."""

from __future__ import annotations

import io
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from nbbatch.execute.telemetry import read_series
from nbbatch.results.compare.collect import METRIC, PARAM, _pandas, read_run_files
from nbbatch.results.compare.query import _numeric_columns, resolve_column
from nbbatch.results.compare.steps import read_histories
from nbbatch.results.history import metric_series
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
    """``param.*`` columns with more than one value among the runs, numeric ones first."""
    swept = [c for c in frame.columns if str(c).startswith(PARAM) and frame[c].astype(str).nunique() > 1]
    return sorted(swept, key=lambda c: (_numeric(frame, c).notna().sum() != frame[c].notna().sum(), c))


def _label(column: str) -> str:
    return column.removeprefix(METRIC).removeprefix(PARAM)


def _groups(frame: pd.DataFrame) -> Iterable[tuple[str, pd.DataFrame]]:
    key = frame["framework"].fillna(frame["notebook"]).fillna("runs").astype(str)
    for name in sorted(key.unique()):
        yield name, frame[key == name]


def plot_metric_vs_time(frame: pd.DataFrame, metric: str | None = None, time: str | None = None) -> Figure | None:
    """Scatter of a metric (default accuracy) against training time, one colour per framework.

    ``time`` defaults to :func:`default_time`. Returns None when no run has both values.
    """
    metric = resolve_column(frame, metric) if metric else default_metric(frame)
    if metric is None:
        return None
    time = resolve_column(frame, time) if time else default_time(frame)
    data = frame.assign(_x=_numeric(frame, time), _y=_numeric(frame, metric)).dropna(subset=["_x", "_y"])
    if data.empty:
        return None
    fig = _figure()
    ax = fig.add_subplot()
    for name, group in _groups(data):
        ax.scatter(group["_x"], group["_y"], label=name, s=40, alpha=0.85)
    ax.set_xlabel(f"{_label(time)} (s)" if not _label(time).endswith("_s") else _label(time))
    ax.set_ylabel(_label(metric))
    ax.set_title(f"{_label(metric)} vs. {_label(time)} by framework")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", title="framework")
    return fig


def plot_metric_vs_param(frame: pd.DataFrame, metric: str | None = None, param: str | None = None) -> Figure | None:
    """A metric against a swept parameter, one line per framework (mean over other parameters).

    ``param`` defaults to the first swept parameter (:func:`swept_parameters`), on a log axis when its
    values are positive and span a factor of 20 or more (learning rates, batch sizes). Returns None
    without a metric or a swept parameter.
    """
    metric = resolve_column(frame, metric) if metric else default_metric(frame)
    if param:
        param = resolve_column(frame, param)
    else:
        swept = swept_parameters(frame)
        param = swept[0] if swept else None
    if metric is None or param is None:
        return None
    data = frame.assign(_y=_numeric(frame, metric)).dropna(subset=["_y"])
    if data.empty:
        return None
    numeric_x = _numeric(data, param)
    categorical = numeric_x.isna().any()
    data = data.assign(_x=data[param].astype(str) if categorical else numeric_x)
    fig = _figure()
    ax = fig.add_subplot()
    for name, group in _groups(data):
        points = group.groupby("_x", sort=True)["_y"].mean()
        ax.plot(list(points.index), list(points.values), marker="o", label=name)
    if not categorical:
        positive = numeric_x[numeric_x > 0]
        if len(positive) == len(numeric_x) and positive.max() / positive.min() >= 20:
            ax.set_xscale("log")
    ax.set_xlabel(_label(param))
    ax.set_ylabel(_label(metric))
    ax.set_title(f"{_label(metric)} vs. {_label(param)}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", title="framework")
    return fig


def _run_label(frame: pd.DataFrame, row: pd.Series) -> str:
    """How a run is named in a legend: its run id, with the experiment when the frame holds several."""
    if frame["experiment"].nunique() > 1:
        return f"{row['experiment']}/{row['run_id']}"
    return str(row["run_id"])


def load_histories(frame: pd.DataFrame, share: str | os.PathLike[str] | Share | None = None
                   ) -> dict[str, list[dict[str, Any]]]:
    """The metric histories of the runs that have one: ``{run label: points}`` (labels as :func:`load_telemetry`'s).

    Reads each run's ``metrics.jsonl`` (see :func:`~nbbatch.results.compare.steps.read_histories`).
    """
    return {_run_label(frame, frame.loc[index]): points for index, points in read_histories(frame, share).items()}


_MAX_LEGEND = 20  # more runs than this: a legend would hide the curves


def plot_metric_by_step(histories: Mapping[str, Sequence[Mapping[str, Any]]], metric: str) -> Figure | None:
    """``<metric> by step``: one line per run of :func:`load_histories`, x = step.

    Returns None when no run has two points of ``metric`` (nothing to draw a curve of).
    """
    curves = {label: metric_series(list(points), metric) for label, points in histories.items()}
    curves = {label: curve for label, curve in curves.items() if curve[0]}
    if not any(len(steps) >= 2 for steps, _ in curves.values()):
        return None
    from matplotlib.ticker import MaxNLocator

    fig = _figure()
    ax = fig.add_subplot()
    for label, (steps, values) in curves.items():
        # markers only while they stay apart; a one-point run is then still visible
        ax.plot(steps, values, label=label, linewidth=1.2, marker="o" if len(steps) <= 30 else None, markersize=3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step" if len(curves) <= _MAX_LEGEND else f"step ({len(curves)} runs)")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} by step")
    ax.grid(True, alpha=0.3)
    if len(curves) <= _MAX_LEGEND:
        ax.legend(fontsize="x-small", ncol=1 if len(curves) <= 10 else 2, title="run", title_fontsize="x-small")
    return fig


def load_telemetry(frame: pd.DataFrame, share: str | os.PathLike[str] | Share | None = None
                   ) -> dict[str, list[dict[str, Any]]]:
    """The telemetry series of the runs that have one: ``{run label: samples}`` (see :mod:`nbbatch.execute.telemetry`).

    Reads ``<run folder>/telemetry.jsonl`` (or an older run's ``telemetry.json``, or a ``.csv``) through
    ``share`` (default: the share :func:`collect` read). Unreadable series are skipped.
    """
    return {_run_label(frame, frame.loc[index]): samples
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
    util_ax.legend(fontsize="x-small", loc="upper right")
    return fig


def figure_png(fig: Figure) -> bytes:
    """A figure as PNG bytes (Agg renderer)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()
