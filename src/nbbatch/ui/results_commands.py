"""``nbbatch compare``, ``nbbatch check`` and ``nbbatch diff``: their arguments and handlers.

:mod:`nbbatch.ui.cli` registers them with :func:`add_results_parsers`; each handler returns the exit status. The work is done by
:mod:`nbbatch.results.compare` and :mod:`nbbatch.results.diff`.
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import Any

from nbbatch.errors import NbbatchError
from nbbatch.results.compare import (
    FAILING_OUTCOMES,
    best_trial,
    check,
    collect_targets,
    display_columns,
    filter_runs,
    group_runs,
    load_baseline,
    parameter_importance,
    parse_tolerance,
    runs_table,
    select_history,
    sort_runs,
    sort_search,
    terminal,
    trials_summary,
    with_step_columns,
    write_report,
    write_table,
)
from nbbatch.results.compare.pipeline_report import write_pipeline_report
from nbbatch.results.pipeline import read_pipeline_state, stage_rows, stage_table
from nbbatch.store.known import open_experiment_share
from nbbatch.store.share import Share

# how a message holding run data, names or paths is printed: as it is, never read as rich markup
_PLAIN = {"markup": False, "emoji": False, "highlight": False}


def add_results_parsers(sub: Any) -> None:
    """Register ``nbbatch compare | diff | check`` on the top-level subparsers ``sub``."""
    p = sub.add_parser("compare", help="table of runs (parameters, metrics) from a share or any papermill outputs; "
                                       "sort/filter/group, CSV/JSON, HTML report with plots")
    add_compare_arguments(p)
    p.set_defaults(func=cli_compare)
    p = sub.add_parser("diff", help="diff two executed notebooks (parameters, metrics, sources, outputs) with nbdime")
    add_diff_arguments(p)
    p.set_defaults(func=cli_diff)
    p = sub.add_parser("check", help="exit 1 when a metric moved beyond tolerance from a baseline (for CI)")
    add_check_arguments(p)
    p.set_defaults(func=cli_check)


def add_compare_arguments(parser: argparse.ArgumentParser, share_option: bool = True) -> None:
    """The arguments of ``nbbatch compare``."""
    parser.add_argument("targets", nargs="*", metavar="EXPERIMENT|PATH",
                        help="experiments in the share, or folders/.ipynb files of executed notebooks "
                             "(default: every experiment in the share)")
    if share_option:
        parser.add_argument("--share", default=None, help="the share (default: the project's results/ folder)")
    parser.add_argument("--all", dest="all_runs", action="store_true",
                        help="also the runs of earlier submissions of an experiment (superseded by a later plan); "
                             "by default only its last submission's runs are shown")
    parser.add_argument("--where", action="append", default=[], metavar="COND",
                        help="keep runs matching COND, e.g. param.LR=0.1, framework=pytorch,keras, "
                             "metric.accuracy>=0.9, status!=failed (repeatable: all must hold)")
    parser.add_argument("--sort", default=None, metavar="COLS",
                        help="sort by columns, comma-separated; NAME:desc (or --sort=-NAME) for descending, "
                             "e.g. --sort metric.accuracy:desc")
    parser.add_argument("--group-by", default=None, metavar="COLS",
                        help="one row per group (e.g. framework or param.LR) with counts and mean metrics")
    parser.add_argument("--agg", default="mean", choices=["mean", "median", "min", "max", "sum", "std"],
                        help="how --group-by aggregates metrics (default: mean)")
    parser.add_argument("--columns", default=None, metavar="COLS",
                        help="columns to show, comma-separated (default: ids, status, swept parameters, metrics)")
    parser.add_argument("--csv", default=None, metavar="FILE", help="also write the table as CSV")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the table as JSON")
    parser.add_argument("--report", default=None, metavar="FILE.html",
                        help="write a self-contained HTML report with plots and links to the notebooks")
    parser.add_argument("--metric", default=None, help="the metric the plots show (default: accuracy)")
    parser.add_argument("--time", default=None,
                        help="the x axis of the metric-vs-time plot (default: metric.train_seconds, else duration_s)")
    parser.add_argument("--param", default=None, help="the swept parameter of the metric-vs-parameter plot")
    parser.add_argument("--title", default=None, help="the report's title")
    history = parser.add_argument_group("metric histories (metrics recorded with nbbatch.record(step=N, ...))")
    history.add_argument("--at-step", type=int, default=None, metavar="N",
                         help="show each history metric at step N: the value of the run's last point with step <= N "
                              "(empty for a run without one); other metrics are unchanged")
    history.add_argument("--history", default="last", choices=["last", "best"],
                         help="last (default): each run's latest values; best: each history metric's best value "
                              "over the steps (up to --at-step when given): min for names with loss, error, err, "
                              "mse, mae or perplexity in them, else max")
    history.add_argument("--best-mode", action="append", default=[], metavar="METRIC=min|max",
                         help="with --history best: whether METRIC is best at its min or its max "
                              "(repeatable or comma-separated), e.g. --best-mode score=min")


def cli_compare(args: argparse.Namespace) -> int:
    """``nbbatch compare``: print the runs table; write CSV/JSON/report as asked (of a pipeline: its stages, and one
    report of all of them)."""
    console = terminal()
    if len(args.targets) == 1 and (pipeline := _pipeline_target(args.targets[0], getattr(args, "share", None))):
        name, share, state = pipeline
        console.print(stage_table(name, state, stage_rows(share, state)))
        if args.report:
            path = write_pipeline_report(share, name, args.report, metric=args.metric, time=args.time,
                                         param=args.param)
            console.print(f"wrote {path}", **_PLAIN)
        else:
            console.print(f"one stage's runs: nbbatch compare {name}.STAGE", **_PLAIN)
        return 0
    frame = collect_targets(args.targets, getattr(args, "share", None), all_runs=args.all_runs)
    if frame.attrs.get("superseded"):
        console.print(f"{frame.attrs['superseded']} run(s) of earlier submissions not shown (--all shows them)",
                      style="dim", **_PLAIN)
    # history values first, so that --where, --sort and --group-by see them
    frame = select_history(frame, at_step=args.at_step, history=args.history, best=args.best_mode,
                           share=getattr(args, "share", None))
    if frame.attrs.get("runs_without_history"):
        console.print(f"{frame.attrs['runs_without_history']} of {len(frame)} runs have no metric history: "
                      "their history metrics are empty", style="yellow", **_PLAIN)
    if args.where:
        total = len(frame)
        frame = filter_runs(frame, args.where)
        if not len(frame):
            console.print(f"none of the {total} runs matches {' and '.join(args.where)}", style="yellow", **_PLAIN)
    search = frame.attrs.get("search")
    if args.sort:
        frame = sort_runs(frame, args.sort)
    elif search:  # a search's runs: the finished ones best first by what it optimised, then the pruned ones
        frame = sort_search(frame, search)
    shown = group_runs(frame, args.group_by, args.agg) if args.group_by else frame
    if args.csv:
        console.print(f"wrote {write_table(shown, args.csv)}", **_PLAIN)
    if args.json:  # a search's: an object, with the search, its trials (one each, however many runs it took), the
        # best of them and which parameters matter beside its runs
        about = {"search": search, "trials": trials_summary(frame, search["metric"]),
                 "best": best_trial(frame, search), "importance": parameter_importance(frame)} if search else None
        console.print(f"wrote {write_table(shown, args.json, about)}", **_PLAIN)
    columns = [c for c in args.columns.split(",") if c.strip()] if args.columns else None
    if args.group_by:
        console.print(runs_table(shown, columns=columns or [str(c) for c in shown.columns],
                                 title=f"{len(frame)} runs by {args.group_by}"))
    else:
        title = f"{len(shown)} runs" + (f" — {frame.attrs['history']}" if frame.attrs.get("history") else "")
        console.print(runs_table(shown, columns=columns or with_step_columns(shown, display_columns(shown)),
                                 title=title))
    if args.report:
        path = write_report(frame, args.report, metric=args.metric, time=args.time, param=args.param,
                            title=args.title, share=getattr(args, "share", None))
        console.print(f"wrote {path}", **_PLAIN)
    return 0


def _pipeline_target(target: str, share: str | None) -> tuple[str, Share, dict[str, Any]] | None:
    """A ``compare`` target that is a pipeline (its file, or its name in its share): its name, share and state."""
    if Path(target).exists() and not target.endswith((".yaml", ".yml")):
        return None  # a folder of notebooks
    with contextlib.suppress(NbbatchError):
        name, opened = open_experiment_share(target, share)
        state = read_pipeline_state(opened, name)
        if state is not None:
            return name, opened, state
    return None


def add_check_arguments(parser: argparse.ArgumentParser, share_option: bool = True) -> None:
    """The arguments of ``nbbatch check``."""
    parser.add_argument("experiment", metavar="EXPERIMENT|PATH", help="the runs to check")
    parser.add_argument("--baseline", required=True, metavar="EXPERIMENT|FILE",
                        help="an experiment in the share, a folder of runs, or a table (.csv/.json from compare)")
    if share_option:
        parser.add_argument("--share", default=None, help="the share (default: the project's results/ folder)")
    parser.add_argument("--metric", action="append", required=True,
                        help="metric to check (repeatable or comma-separated)")
    parser.add_argument("--tolerance", default=None,
                        help="allowed change: absolute (0.02) or relative with %% (2%%); default 0")
    parser.add_argument("--rel-tolerance", type=float, default=None,
                        help="allowed relative change (0.05 = 5%% of the baseline); the larger allowance wins")
    parser.add_argument("--direction", choices=["both", "decrease", "increase"], default="both",
                        help="which moves fail: both (default), decrease (e.g. accuracy) or increase (e.g. loss)")
    parser.add_argument("--key", default=None,
                        help="columns matching runs to baseline runs, comma-separated "
                             "(default: framework + swept parameters)")
    parser.add_argument("--where", action="append", default=[], metavar="COND",
                        help="check only runs matching COND (applied to both sides)")
    parser.add_argument("--require-all", action="store_true", help="fail when a baseline run was not run")
    parser.add_argument("--csv", default=None, metavar="FILE", help="also write the check table as CSV")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the check table as JSON")


def cli_check(args: argparse.Namespace) -> int:
    """``nbbatch check``: print the check table; 0 when every metric is within tolerance, else 1."""
    console = terminal()
    share = getattr(args, "share", None)
    current = collect_targets([args.experiment], share)
    baseline = load_baseline(args.baseline, share)
    if args.where:
        current = filter_runs(current, args.where)
        baseline = filter_runs(baseline, args.where)
    abs_tol, rel_tol = parse_tolerance(args.tolerance)
    if args.rel_tolerance is not None:
        rel_tol = args.rel_tolerance
    metrics = [m for item in args.metric for m in item.split(",") if m.strip()]
    result = check(current, baseline, metrics, tolerance=abs_tol, rel_tolerance=rel_tol,
                   key=[k for k in args.key.split(",") if k.strip()] if args.key else None,
                   direction=args.direction, require_all=args.require_all)
    for path in (args.csv, args.json):
        if path:
            write_table(result.table, path)
    table = runs_table(result.table, columns=[str(c) for c in result.table.columns],
                       title=f"{args.experiment} vs. {args.baseline}")
    for index, row in enumerate(result.table.itertuples(index=False)):
        if row.outcome in FAILING_OUTCOMES:
            table.row_styles[index] = "red"
    console.print(table)
    console.print(result.summary(), style="green" if result.passed else "red", **_PLAIN)
    return result.exit_code


def add_diff_arguments(parser: argparse.ArgumentParser, share_option: bool = True) -> None:
    """The arguments of ``nbbatch diff``."""
    parser.add_argument("run_a", metavar="RUN_A", help="a .ipynb file, a run folder, or <experiment>/<run id>")
    parser.add_argument("run_b", metavar="RUN_B", help="the run to compare it with")
    if share_option:
        parser.add_argument("--share", default=None, help="the share (default: the project's results/ folder)")
    parser.add_argument("--html", default=None, metavar="FILE.html", help="also write the diff as an HTML page")
    parser.add_argument("--no-sources", dest="sources", action="store_false", help="leave cell sources out")
    parser.add_argument("--no-outputs", dest="outputs", action="store_false", help="leave cell outputs out")
    parser.add_argument("--metadata", action="store_true", help="include notebook and cell metadata")
    parser.add_argument("--details", action="store_true",
                        help="include what changes on every execution: timings, execution counts, cell ids")
    parser.add_argument("--color", dest="color", action="store_const", const=True, default=None,
                        help="colour the terminal diff even when not writing to a terminal")
    parser.add_argument("--no-color", dest="color", action="store_const", const=False, help="no colours")


def cli_diff(args: argparse.Namespace) -> int:
    """``nbbatch diff``: print the diff of two runs' notebooks; write HTML with --html. Always 0."""
    # nbformat (and with it jsonschema) takes longer to import than the rest of the command line: only `diff` loads it
    from nbbatch.results.diff import diff_runs

    result = diff_runs(args.run_a, args.run_b, getattr(args, "share", None), sources=args.sources,
                       outputs=args.outputs, metadata=args.metadata, details=args.details)
    result.print(color=args.color)
    if args.html:
        print(f"wrote {result.write_html(args.html)}")
    return 0
