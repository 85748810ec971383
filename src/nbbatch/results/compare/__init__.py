"""Compare executed notebooks: one table of runs, plots, a mailable HTML report and a CI check.

:func:`collect` turns a share's experiments — or any folder of papermill outputs — into a
:class:`pandas.DataFrame` with one row per run::

    experiment, run_id, framework, notebook, kernel, status, param.<name>..., metric.<name>...,
    duration_s, gpu_ids, started_at, ended_at, host, attempts, error, telemetry.<name>...,
    output, source, share_path, telemetry_file, metrics_file

A run folder's ``run.json`` is read when present; otherwise the executed notebook itself is (its
papermill metadata and the metrics recorded with :func:`nbbatch.record`), so a run that failed
part-way shows ``failed`` with the metrics it got to record. Then :func:`filter_runs`,
:func:`sort_runs`, :func:`group_runs`, :func:`write_table`, :func:`runs_table` (rich),
the plots, :func:`write_report` and :func:`check` work on that table. :func:`select_history` shows
the metrics the runs recorded with ``step=`` at a step, or at their best, instead of their latest values.

The modules, by concern: :mod:`~nbbatch.results.compare.collect` (finding and reading runs),
:mod:`~nbbatch.results.compare.query` (filter, sort, group, CSV/JSON),
:mod:`~nbbatch.results.compare.table` (the terminal table), :mod:`~nbbatch.results.compare.steps`
(metric histories in the table), :mod:`~nbbatch.results.compare.trials` (a search's trials, one row each however
many runs a trial took), :mod:`~nbbatch.results.compare.plots`,
:mod:`~nbbatch.results.compare.importance` (which parameters matter),
:mod:`~nbbatch.results.compare.report` (HTML) and :mod:`~nbbatch.results.compare.check`. The
command line (``nbbatch compare``/``check``) is :mod:`nbbatch.ui.results_commands`.

pandas and matplotlib come with the ``compare`` extra (``pip install nbbatch[compare]``); they are
imported on first use, so importing this package is light.
"""

from __future__ import annotations

from nbbatch.results.compare.check import (
    FAILING_OUTCOMES,
    CheckResult,
    check,
    default_check_key,
    load_baseline,
    parse_tolerance,
)
from nbbatch.results.compare.collect import (
    LEADING_COLUMNS,
    LOCATION_COLUMNS,
    METRIC,
    PARAM,
    TELEMETRY,
    TRAILING_COLUMNS,
    collect,
    collect_targets,
)
from nbbatch.results.compare.importance import parameter_importance
from nbbatch.results.compare.plots import (
    default_metric,
    default_time,
    figure_png,
    leaders,
    line_styles,
    load_histories,
    load_telemetry,
    plot_gpu_telemetry,
    plot_metric_by_framework,
    plot_metric_by_step,
    plot_metric_vs_param,
    plot_metric_vs_time,
    plot_trials,
    run_labels,
    swept_parameters,
)
from nbbatch.results.compare.query import (
    filter_runs,
    group_runs,
    read_table,
    resolve_column,
    sort_runs,
    sort_search,
    write_table,
)
from nbbatch.results.compare.report import render_report, write_report
from nbbatch.results.compare.search_plots import best_trial
from nbbatch.results.compare.steps import (
    HISTORY_MODES,
    LOWER_IS_BETTER,
    STEP,
    default_best_mode,
    parse_best_modes,
    read_histories,
    select_history,
    with_step_columns,
)
from nbbatch.results.compare.table import display_columns, runs_table, terminal
from nbbatch.results.compare.trials import joined_histories, latest_segments, trials_of, trials_summary

__all__ = [
    "FAILING_OUTCOMES", "HISTORY_MODES", "LEADING_COLUMNS", "LOCATION_COLUMNS", "LOWER_IS_BETTER", "METRIC", "PARAM",
    "STEP", "TELEMETRY", "TRAILING_COLUMNS",
    "CheckResult", "best_trial", "check", "collect", "collect_targets", "default_best_mode", "default_check_key",
    "default_metric", "default_time", "display_columns", "figure_png", "filter_runs", "group_runs", "joined_histories",
    "latest_segments", "leaders", "line_styles",
    "load_baseline", "load_histories", "load_telemetry", "parameter_importance", "parse_best_modes", "parse_tolerance",
    "plot_gpu_telemetry",
    "plot_metric_by_framework", "plot_metric_by_step", "plot_metric_vs_param", "plot_metric_vs_time", "plot_trials",
    "read_histories", "read_table", "render_report", "resolve_column", "run_labels", "runs_table", "select_history",
    "sort_runs", "sort_search", "swept_parameters", "terminal", "trials_of", "trials_summary",
    "with_step_columns",
    "write_report",
    "write_table",
]
