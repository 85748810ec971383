"""The HTML report: one self-contained page (plots embedded as PNG) rendered from ``templates/report.html.j2``."""

from __future__ import annotations

import base64
import numbers
import os
import posixpath
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from nbbatch import __version__
from nbbatch.results.compare.importance import parameter_importance
from nbbatch.results.compare.pbt_plots import pbt_caption, pbt_members, plot_pbt_schedule
from nbbatch.results.compare.plots import (
    figure_png,
    group_title,
    leaders,
    load_histories,
    load_telemetry,
    plot_gpu_telemetry,
    plot_metric_by_framework,
    plot_metric_by_step,
    plot_metric_vs_param,
    plot_metric_vs_time,
)
from nbbatch.results.compare.search_plots import (
    best_trial,
    plot_best_by_trial,
    plot_importance,
    plot_parallel_coordinates,
    plot_pareto_front,
    plot_trial_curves,
)
from nbbatch.results.compare.steps import with_step_columns
from nbbatch.results.compare.table import _cell_text, column_header, display_columns
from nbbatch.results.compare.trials import has_segments, trials_of
from nbbatch.results.history import history_metrics
from nbbatch.results.render import render_template
from nbbatch.results.status import format_duration, format_metric
from nbbatch.store.runjson import utc_now
from nbbatch.store.share import FILE_MODE, Share, write_file_atomic

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

MAX_HISTORY_FIGURES = 16  # one figure per history metric, up to this many; the rest are named


def _history_builds(frame: pd.DataFrame, share: str | os.PathLike[str] | Share | None
                    ) -> tuple[list[tuple[str, Any]], list[str]]:
    """A ``<metric> by step`` figure builder per history metric, and the metrics left out for the cap. A search's
    metric has its own figure (every trial's curve, the pruned ones marked): not this one too."""
    histories = load_histories(frame, share)
    searched = (frame.attrs.get("search") or {}).get("metric")
    names: list[str] = []
    for points in histories.values():
        names += [n for n in history_metrics(points) if n not in names and n != searched]
    # a metric with fewer than two points in every run draws no curve: it takes no place in the cap
    drawable = [n for n in names if any(sum(n in p for p in points) >= 2 for points in histories.values())]
    builds = [(f"{n} by step", lambda n=n: plot_metric_by_step(histories, n)) for n in drawable[:MAX_HISTORY_FIGURES]]
    return builds, drawable[MAX_HISTORY_FIGURES:]


def _href(output: str | None, report_dir: Path) -> str | None:
    if not output or not isinstance(output, str):
        return None
    if "://" in output:
        return output
    try:
        relative = os.path.relpath(output, report_dir)
    except ValueError:  # another drive on Windows
        return Path(output).as_uri()
    return quote(relative.replace(os.sep, "/"))


def render_report(frame: pd.DataFrame, report_path: str | os.PathLike[str], *, metric: str | None = None,
                  time: str | None = None, param: str | None = None, title: str | None = None,
                  share: str | os.PathLike[str] | Share | None = None) -> str:
    """The report's HTML: summary, plots as embedded PNG, the runs with links to their notebooks, errors.

    Links are relative to ``report_path``'s folder. ``metric``/``time``/``param`` choose the plots'
    axes (defaults: accuracy, :func:`default_time`, the first swept parameter). Each metric the runs
    recorded with ``step=`` gets a ``<metric> by step`` figure (up to :data:`MAX_HISTORY_FIGURES`).
    """
    return render_template("report.html.j2", **report_context(frame, report_path, metric=metric, time=time,
                                                                param=param, title=title, share=share))


def report_context(frame: pd.DataFrame, report_path: str | os.PathLike[str], *, metric: str | None = None,
                   time: str | None = None, param: str | None = None, title: str | None = None,
                   share: str | os.PathLike[str] | Share | None = None) -> dict[str, Any]:
    """What ``report.html.j2`` (and each stage of a pipeline's report) shows of ``frame``'s runs; see
    :func:`render_report`."""
    report_dir = Path(report_path).resolve().parent
    figures = []
    by_framework = plot_metric_by_framework(frame, metric)
    history_builds, not_plotted = _history_builds(frame, share)
    search = frame.attrs.get("search")
    by_param = ("Metric vs. swept parameter", lambda: plot_metric_vs_param(frame, metric, param))
    search_builds = [("Pareto front", lambda: plot_pareto_front(frame, search)),
                     ("best by trial", lambda: plot_best_by_trial(frame, search)),
                     ("parameters", lambda: plot_parallel_coordinates(frame, search)), by_param,
                     ("curves", lambda: plot_trial_curves(frame, load_histories(frame, share), search)),
                     (pbt_caption(search), lambda: plot_pbt_schedule(frame, search))
                     ] if search else [by_param]
    for caption, build in (
        *search_builds,
        ("Accuracy vs. training time", lambda: plot_metric_vs_time(frame, metric, time)),
        *history_builds,
        ("GPU utilisation over time", lambda: plot_gpu_telemetry(load_telemetry(frame, share))),
    ):
        fig = build()
        if fig is not None:
            figures.append(_embedded(fig, caption))
    columns = with_step_columns(frame, display_columns(frame))  # step.<name>: where a history value is from
    rows = []
    for _, row in frame.iterrows():
        rows.append({
            "cells": [{"column": c, "text": _cell_text(row[c]),
                       "numeric": isinstance(row[c], numbers.Number) and not isinstance(row[c], bool)}
                      for c in columns],
            "href": _href(row.get("output"), report_dir),
            "link": posixpath.basename(str(row.get("output")).replace("\\", "/")) if row.get("output") else "",
            "status": _cell_text(row.get("status")),
        })
    failures = [
        {"run": f"{row['experiment']}/{row['run_id']}", "error": _cell_text(row.get("error")),
         "href": _href(row.get("output"), report_dir), "status": _cell_text(row.get("status"))}
        for _, row in frame.iterrows() if row.get("status") not in ("succeeded", "pruned") and _cell_text(row.get("error"))
    ]
    best = best_trial(frame, search) if search else None
    importance = parameter_importance(frame, metric=None if search else metric)
    importance_figure = plot_importance(importance)
    counts = frame["status"].value_counts(dropna=False) if len(frame) else {}
    experiments = sorted({str(e) for e in frame.get("experiment", [])})
    return dict(
        title=title or f"nbbatch report: {', '.join(experiments) or 'runs'}",
        generated=utc_now(),
        version=__version__,
        experiments=experiments,
        total=len(frame),
        counts=[(str(k), int(v)) for k, v in dict(counts).items()],
        figures=figures,
        not_plotted=not_plotted,
        search=search,
        best=best,
        continued=_continued(frame) if search else None,
        pbt=pbt_members(frame, search) if search else None,
        pareto=_front(frame),
        best_parameters=[f"{k}={format_metric(v)}" for k, v in best["parameters"].items()] if best else [],
        importance=importance,
        importance_figure=_embedded(importance_figure, "which parameters matter") if importance_figure else None,
        leaders=_leaders(frame, metric, report_dir) if by_framework is not None else [],
        leaders_by=group_title(frame) if by_framework is not None else None,
        leaders_figure=_embedded(by_framework, "by framework") if by_framework is not None else None,
        order=frame.attrs.get("order"),
        selection=frame.attrs.get("history"),
        headers=[column_header(c, frame.columns) for c in columns],
        rows=rows,
        failures=failures,
    )


def _continued(frame: pd.DataFrame) -> dict[str, int] | None:
    """How many trials and how many of their runs a search whose trials continue over several runs has; None when
    each trial is one run."""
    if not has_segments(frame):
        return None
    trials = trials_of(frame)
    return {"trials": len(trials), "runs": int(frame["trial"].notna().sum()),
            "paused": int((trials["status"].astype(str) == "paused").sum())}


def _front(frame: pd.DataFrame) -> list[int]:
    """The trial numbers on a multi-objective search's Pareto front (its ``pareto`` column), in order."""
    if "pareto" not in frame:
        return []
    # str(): the column holds bools (numpy's where every run is a trial) and None for a run that is no trial
    # a set: every segment of a continued trial is marked alike
    return sorted({int(t) for t, on in zip(frame["trial"], frame["pareto"], strict=True) if str(on) == "True"})


WIDE_FIGURE_IN = 8.0  # a figure wider than this (panels side by side) gets a row of its own, at its own size


def _embedded(fig: Any, caption: str) -> dict[str, Any]:
    """A figure as the template shows it: its title (the alt text), its PNG (base64) and whether it is wide."""
    titles = [ax.get_title(loc) for ax in fig.axes for loc in ("center", "left")]
    return {"title": next((t for t in titles if t), caption), "png": base64.b64encode(figure_png(fig)).decode("ascii"),
            "wide": fig.get_figwidth() > WIDE_FIGURE_IN}


def _leaders(frame: pd.DataFrame, metric: str | None, report_dir: Path) -> list[dict[str, Any]]:
    """The best run of each framework, best first, as the report's first table shows them."""
    hrefs = {row["run_id"]: _href(row.get("output"), report_dir) for _, row in frame.iterrows()}
    return [{**row, "value": format_metric(row["value"]), "time": format_duration(row["time"]),
             "href": hrefs.get(row["run_id"])} for row in leaders(frame, metric)]


def write_report(frame: pd.DataFrame, path: str | os.PathLike[str], **options: Any) -> Path:
    """Write :func:`render_report` to ``path`` (one self-contained HTML file; mail it as it is)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomic(target, render_report(frame, target, **options).encode("utf-8"), FILE_MODE)
    return target
