"""The ``nbbatch`` command line: submit | status | logs | cancel | run | run-one | envs | plan | fetch | …

Every user mistake is one paragraph on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

import nbbatch.ui.skip_iri_grammar  # noqa: F401 - first of nbbatch's imports: before any of them imports jsonschema
from nbbatch import __version__, api
from nbbatch.backends import node_stop_hook
from nbbatch.backends.cluster import add_common_arguments, run_cluster_command
from nbbatch.backends.placement import placement_reader
from nbbatch.containers.node import execute_on_node
from nbbatch.drivers.detach import driver_line, started_line
from nbbatch.errors import NbbatchError, NotebookStopped, ValidationError
from nbbatch.execute.envs import build_envs, register_user_kernel, registered_user_kernel, remove_env
from nbbatch.execute.launch import RUN_ONE, RUN_ONE_NOT_DONE, RUN_ONE_REQUEUED, read_launch
from nbbatch.execute.placement import placement_from_env
from nbbatch.execute.stopsignals import SignalStop, stopped_by_signals
from nbbatch.results.progress import StatusReads, abandoned_runs, table_title, watch_status
from nbbatch.results.status import (
    REFRESH_EVERY_S,
    StatusView,
    search_of,
    status_json_rows,
    status_table,
    summary_counts,
)
from nbbatch.spec.environments import list_envs
from nbbatch.spec.frameworks import get_framework, list_frameworks
from nbbatch.spec.pipeline import is_pipeline_file
from nbbatch.spec.project import find_project
from nbbatch.spec.schema import experiment_schema
from nbbatch.store.fetch import FetchWarning, fetch
from nbbatch.store.known import open_experiment_share
from nbbatch.store.layout import run_paths
from nbbatch.store.runfiles import run_ids
from nbbatch.store.runjson import DONE_STATUSES, RunRecord, Status, cell_label, plain_traceback
from nbbatch.store.share import open_share
from nbbatch.ui.data_commands import add_data_parser
from nbbatch.ui.images_commands import add_images_parser
from nbbatch.ui.parameter_options import add_parameter_options, parameters_of
from nbbatch.ui.pipeline_commands import (
    file_after_force,
    forced_stages,
    pipeline_status,
    plan_pipeline_command,
    stage_experiment,
    submit_pipeline_command,
)
from nbbatch.ui.plan_command import PLAN_ROWS, print_plan
from nbbatch.ui.results_commands import add_results_parsers
from nbbatch.ui.status_list import status_of_all


def _console() -> Console:
    return Console()


def _warning(text: str) -> Text:
    """``warning: <text>`` for rich, the text (run data, names, paths) never read as markup."""
    return Text.assemble(("warning:", "yellow"), " ", text)


def cmd_submit(args: argparse.Namespace) -> int:
    file_after_force(args)
    stages, force = forced_stages(args)
    pipeline = is_pipeline_file(args.experiment)
    parameters = _experiment_parameters(args, pipeline)
    if stages and not pipeline:
        raise NbbatchError(f"--force {stages[0]}: {args.experiment} is an experiment, not a pipeline: `--force` "
                           "alone reruns its succeeded runs")
    if pipeline and args.rebuild_search:
        raise NbbatchError(f"--rebuild-search is for an experiment file with `search:`, and {args.experiment} is a "
                           "pipeline (a stage's search is not rebuilt: --force STAGE runs it afresh)")
    if args.detach:  # validated here, then its driver goes where the backend puts drivers: one line, at once
        print(started_line(api.detach(args.experiment, force=force, force_stages=stages, build_envs=args.build_envs,
                                      only=args.only, parameters=parameters,
                                      rebuild_search=args.rebuild_search)))
        return 0
    if pipeline:
        return submit_pipeline_command(args, _console())
    wait = True if args.wait else False if args.no_wait else None  # None: as the backend does (slurm: no wait)
    result = api.submit(args.experiment, force=force, build_envs=args.build_envs, wait=wait,
                        progress=not args.quiet, only=args.only, parameters=parameters,
                        rebuild_search=args.rebuild_search)
    console = _console()
    for warning in result.warnings:
        console.print(_warning(warning))
    if result.skipped:
        console.print(f"skipped {len(result.skipped)} run(s) that already succeeded (use --force to rerun)")
    counts = summary_counts(result.records)
    console.print(Text.assemble("experiment ", (result.experiment, "bold"), ": ",
                                ", ".join(f"{n} {s}" for s, n in sorted(counts.items())),
                                f" — results in {result.share}/{result.experiment}"))
    if result.stopped:  # the lease was lost: the last line says why no more runs started
        console.print(_warning(result.stopped))
        return 1
    if not result.waited:  # the runs go on; one that already failed (its job refused) fails the command
        return 1 if any(r.status == Status.FAILED for r in result.records) else 0
    return 0 if result.ok else 1


SHARE_OPTION_HELP = "the share (default: where it was submitted from this project)"


def _experiment_parameters(args: argparse.Namespace, pipeline: bool) -> dict[str, Any]:
    """``-p``/``-r``/``-y``/``-f`` of ``submit`` and ``plan``: an experiment's, refused for a pipeline file."""
    parameters = parameters_of(args)
    if parameters and pipeline:
        raise NbbatchError(f"-p {next(iter(parameters))}: {args.experiment} is a pipeline; set a stage's parameters "
                           "in the file (stages: NAME: parameters:)")
    return parameters


def cmd_plan(args: argparse.Namespace) -> int:
    parameters = _experiment_parameters(args, is_pipeline_file(args.experiment))
    if is_pipeline_file(args.experiment):
        return plan_pipeline_command(args, _console())
    the_plan, _backend, share = api.prepare(args.experiment, parameters=parameters)
    console = _console()  # the table fits the width as `status` does; run data is Text, never read as markup
    print_plan(the_plan, share, console, as_json=args.json, all_rows=args.all)
    if args.json:
        return 0
    runs = the_plan.runs
    for name, location in the_plan.experiment.inputs.items():
        console.print(Text(f"input {name} ← {location}"), soft_wrap=True)
    for notebook, framework in dict.fromkeys((r.notebook_rel, r.recognised_as) for r in runs if r.recognised_as):
        console.print(Text(f"{notebook}: recognised as framework `{framework}` (by its kernel or imports): its GPU "
                           "sharing settings, memory estimate and preload apply"), soft_wrap=True)
    world = the_plan.experiment.world()
    if world:  # every run is a gang of ranks
        gpus = f", {world.gpus_per_node} GPU(s) per node" if world.gpus_per_node else ", CPU ranks"
        console.print(Text(f"distributed ({world.type}): {world.nodes} node(s) × {world.processes_per_node} "
                           f"rank(s) = {world.nodes * world.processes_per_node} kernels per run{gpus}"))
    for warning in the_plan.warnings:
        console.print(_warning(warning))
    return 0


def _interval(text: str) -> float:
    """``--interval``: a positive number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def cmd_status(args: argparse.Namespace) -> int:
    if args.experiment is None:
        return status_of_all(args, _console())
    name, share = open_experiment_share(args.experiment, args.share)  # once: every read and refresh use it
    detached = None if args.json or args.stage else api.detached_driver(name)
    if detached is not None:  # submitted with --detach: how its driver is, first (it may have started no run yet)
        print(driver_line(*detached))
    if args.stage is None and (shown := pipeline_status(args, name, share, _console())) is not None:
        return shown
    name = stage_experiment(name, args.stage)
    said: list[str] = []

    def say_footer(view: StatusView) -> None:  # a watch reads again and again: each line is said once
        for line in view.footer:
            if line not in said:
                said.append(line)
                print(f"nbbatch: warning: {line}", file=sys.stderr)

    def stuck(records: list[RunRecord]) -> list[RunRecord]:
        return abandoned_runs(share, name, records)

    if detached is not None and not any(share.exists(run_paths(name, i).record) for i in run_ids(share, name)):
        print(f"no run of `{name}` is recorded yet")
        return 0 if detached[1].running is not False else 1
    load = StatusReads(lambda: api.read_status(name, share, all_runs=args.all),
                       None if args.no_refresh else lambda: api.refresh_runs(name, share), REFRESH_EVERY_S)
    search = search_of(share, name)  # a search's runs: best first, as `compare` shows them
    if args.watch and not args.json:
        view = watch_status(load, name, interval=args.interval, console=_console(), stuck=stuck,
                            say_footer=say_footer, search=search)
    else:
        view = load()
        while args.watch and not all(r.final for r in view.records) and not stuck(view.records):
            say_footer(view)  # for scripts: wait quietly, then the JSON of the final state
            time.sleep(args.interval)
            view = load()
    records = view.records
    abandoned = stuck(records) if args.watch else []
    if abandoned:  # a watch would wait forever: say why it stops
        print(f"nbbatch: warning: {len(abandoned)} run(s) of `{name}` are still queued, but no `nbbatch submit` "
              "will start them (it was killed); submit the experiment again to run them", file=sys.stderr)
    if args.json:
        print(json.dumps(status_json_rows(view, search), indent=2, default=str))
    elif not args.watch:
        _console().print(status_table(records, title=table_title(name, records), search=search))
    if args.json or not args.watch:
        say_footer(view)  # the table's footer (a live table draws its own)
    current = view.refresh is None or view.refresh.error is None  # the backend answered (or was not asked)
    return 0 if all(r.status in DONE_STATUSES for r in records) and not view.problems and current or not args.check else 1


def cmd_status_interruptible(args: argparse.Namespace) -> int:
    """``nbbatch status``; Ctrl-C while watching ends it quietly (130), no run is touched."""
    try:
        return cmd_status(args)
    except KeyboardInterrupt as exc:
        with contextlib.suppress(OSError):  # after SIGHUP the terminal may be gone
            print(file=sys.stderr)
        return 128 + exc.signum if isinstance(exc, Terminated) else 130


def cmd_logs(args: argparse.Namespace) -> int:
    for chunk in api.logs(args.experiment, args.run, follow=args.follow, tail=args.tail, share=args.share, rank=args.rank):
        sys.stdout.write(chunk)
        sys.stdout.flush()
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    with warnings.catch_warnings(record=True) as caught:  # a run the backend could not cancel: one line each, with why
        warnings.simplefilter("always", UserWarning)
        asked = api.cancel(args.experiment, args.runs or None, share=args.share)
    print(f"asked {len(asked)} run(s) to stop: {', '.join(asked)}" if asked else "no unfinished runs to cancel")
    for problem in dict.fromkeys(str(w.message) for w in caught if issubclass(w.category, UserWarning)):
        print(f"nbbatch: warning: {problem}", file=sys.stderr)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    # papermill takes over a second to import: only this command loads it (run_notebook needs it anyway)
    from papermill.exceptions import PapermillExecutionError

    try:
        api.run_notebook(args.input, args.output, parameters_of(args), kernel=args.kernel, cwd=args.cwd,
                         cell_timeout=args.cell_timeout, log_output=not args.quiet)
    except PapermillExecutionError as exc:  # the kernel's traceback, then one line naming the cell as the others do
        print(plain_traceback(exc.traceback) or "", file=sys.stderr)
        cell = cell_label(getattr(exc, "cell_number", None), exc.source) or "a cell"
        print(f"{Path(args.input).name} failed in {cell}: {exc.ename}: {exc.evalue} "
              f"(executed notebook with its outputs: {args.output})", file=sys.stderr)
        return 1
    except NotebookStopped as exc:  # the kernel died, or a cell timed out: as a failing cell, one line
        print(exc, file=sys.stderr)
        return exc.exit_code
    return 0


def cmd_run_one(args: argparse.Namespace) -> int:
    launch = read_launch(args.launch)
    run = launch.run
    project = find_project(launch.project) if launch.project else find_project()
    project.activate_kernels()
    share = open_share(launch.share)
    # a node of a gang: placed by the launcher that started this container, else where it is by nbbatch's own
    # variables or those its backend's cluster set
    node = launch.node or (placement_from_env(run, os.environ, placement_reader(launch.backend, share))
                           if run.distribution else None)
    # SIGTERM (a cluster stopping the job, task, container or pod), SIGINT, SIGHUP: the run stops as by a cancel,
    # keeping the notebook as far as it ran; the backend's hook says why (Slurm's: scancel or its time limit)
    stop = SignalStop(node_stop_hook(launch.backend))
    context = dataclasses.replace(launch.attempt_context(project.root, node, os.environ), cancel_event=stop)
    with stopped_by_signals(stop):
        if launch.container_images:  # a cluster's node: the run in its framework's image (its own signal handling)
            record = execute_on_node(run, share, context, launch.container_engine, launch.container_images)
        else:
            from nbbatch.execute.attempts import execute_run  # the notebook runtime: only the commands that run one load

            record = execute_run(run, share, context)
    print(f"{record.run_id}: {record.status}" + (f" ({record.error_summary()})" if record.error else ""))
    # what a cluster does next by the exit code: nothing (done, or recorded as not done), or run it again (requeued:
    # Kubernetes' next pod of the index resumes it)
    return 0 if record.status in DONE_STATUSES else RUN_ONE_REQUEUED if record.status == Status.QUEUED else RUN_ONE_NOT_DONE


def cmd_envs(args: argparse.Namespace) -> int:
    if args.action == "list":
        envs = list_envs()  # their folders share one parent: said once under the table, so it fits 80 columns
        folders = sorted({str(Path(env.path).parent) for env in envs})
        table = Table(title="framework environments", caption=f"in {', '.join(folders)}" if folders else None)
        for col in ("framework", "state", "kernel", "pins", "built (UTC)"):
            table.add_column(col, overflow="fold")
        style = {"ready": "green", "stale": "yellow", "missing": "red"}
        for env in envs:  # the pins' fingerprint to 8 characters, as git shortens a hash; the build to the minute
            built = (env.built_at or "").replace("T", " ")[:16]
            cells = [Text(str(cell)) for cell in (env.framework, env.state, env.kernel, env.fingerprint[:8], built)]
            cells[1].stylize(style[env.state])
            table.add_row(*cells)
        _console().print(table)
        return 0
    names = args.names or []
    if args.all or names == ["all"]:
        names = list(list_frameworks())
    if not names:
        raise NbbatchError(f"name the framework(s) to {args.action}, or --all")
    if args.action == "create":
        statuses = build_envs(names, force=args.force, parallel=args.parallel, gpu=args.gpu)
        for env in statuses:
            print(f"{env.framework}: {env.state} (kernel {env.kernel})")
        _user_kernels([env.framework for env in statuses if env.state == "ready"], register=args.user)
        return 0
    for name in names:
        framework = get_framework(name)
        registered = registered_user_kernel(framework)
        remove_env(framework)
        print(f"removed the environment and kernel of {name}" + (f" (and its copy in {registered})" if registered else ""))
    return 0


def _user_kernels(names: list[str], register: bool) -> None:
    """Register the kernels of ``names`` for the user (``--user``), else say once how a plain ``jupyter lab`` sees them."""
    frameworks = [get_framework(name) for name in names]
    if register:
        for framework in frameworks:
            print(f"{framework.name}: kernel {framework.kernel_name} registered for your user in "
                  f"{register_user_kernel(framework)}")
        return
    hidden = [f.name for f in frameworks if registered_user_kernel(f) is None]
    if hidden:
        print(f"a plain `jupyter lab` does not list these kernels: start it as "
              f"`JUPYTER_PATH={find_project().jupyter_dir} jupyter lab`, or register them for your user with "
              f"`nbbatch envs create {' '.join(hidden)} --user`")


def cmd_fetch(args: argparse.Namespace) -> int:
    name, share = open_experiment_share(args.experiment, args.share)
    with warnings.catch_warnings(record=True) as caught:  # files it could not read: one line each, the rest came
        warnings.simplefilter("always", FetchWarning)
        copied = fetch(share, name, Path(args.dest))
    left_out = [str(w.message) for w in caught if issubclass(w.category, FetchWarning)]
    for problem in left_out:
        print(f"nbbatch: warning: {problem}", file=sys.stderr)
    print(f"fetched {len(copied)} file(s) of {name} into {args.dest}"
          + (f"; {len(left_out)} left out (see the warnings)" if left_out else ""))
    return 1 if left_out else 0


def cmd_cluster(args: argparse.Namespace) -> int:
    return run_cluster_command(args)


def cmd_schema(args: argparse.Namespace) -> int:
    text = json.dumps(experiment_schema(), indent=2) + "\n"
    if args.output:
        target = Path(args.output)
        try:
            target.write_text(text)
        except OSError as exc:  # a missing folder, a folder named as the file, permissions
            fix = (f"its folder {target.parent} does not exist: create it first (mkdir -p {target.parent})"
                   if not target.parent.is_dir() else "choose another path")
            raise ValidationError(f"cannot write the schema to {target}: {exc.strerror or exc}; {fix}") from exc
    else:
        sys.stdout.write(text)
    return 0


EXAMPLES = """examples:
  nbbatch submit experiments/digits.yaml   run each notebook × parameters
  nbbatch submit sweep.yaml -p EPOCHS 1    the same, with EPOCHS=1 in every run
  nbbatch status digits                    one line per run, as it goes
  nbbatch compare digits --report r.html   metrics table, plots, HTML report

`nbbatch COMMAND --help` for a command's options; docs/ has the rest."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nbbatch", description="Run parameterized notebooks as a batch.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES)
    parser.add_argument("--version", action="version", version=f"nbbatch {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_batch_parsers(sub)
    _add_run_parsers(sub)
    _add_setup_parsers(sub)
    add_images_parser(sub)
    add_data_parser(sub)
    add_results_parsers(sub)
    return parser


def _add_batch_parsers(sub: argparse._SubParsersAction) -> None:
    """An experiment's commands: submit, plan, status, logs, cancel, fetch."""

    p = sub.add_parser("submit", help="plan, validate and run an experiment")
    p.add_argument("experiment", nargs="?", help="experiment or pipeline YAML file")
    p.add_argument("--force", nargs="?", const=True, action="append", metavar="STAGE",
                   help="rerun runs that already succeeded; of a pipeline: --force STAGE reruns that stage and "
                        "every stage that needs it (repeatable), --force alone every stage")
    p.add_argument("--build-envs", action="store_true", help="build missing or stale framework environments first")
    p.add_argument("--rebuild-search", action="store_true", help="a search: rebuild its study from its runs' records "
                                                                 "first (its journal lost or damaged; kept beside)")
    waiting = p.add_mutually_exclusive_group()
    waiting.add_argument("--wait", action="store_true", help="return when every run is final (the default, except "
                                                              "on slurm)")
    waiting.add_argument("--no-wait", action="store_true", help="return once submitted (remote backends)")
    waiting.add_argument("--detach", action="store_true",
                         help="validate, then start the driver where it outlives the terminal and your logout (a "
                              "background process; on slurm a CPU job) and return at once; `nbbatch status` follows it")
    p.add_argument("--only", action="append", metavar="RUN", help="only runs whose id starts with RUN")
    p.add_argument("-q", "--quiet", action="store_true", help="no live progress table")
    add_parameter_options(p, "set in every run over the file's own; not a swept one")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("plan", help="show the runs an experiment would start, after validation (a dry run)")
    p.add_argument("experiment", help="experiment or pipeline YAML file")
    p.add_argument("--json", action="store_true", help="every planned run as JSON (id, notebook, kernel, parameters, and `skip`: "
                                                            "whether submit will skip it as already succeeded)")
    add_parameter_options(p, "as submit -p would set it")
    p.add_argument("--all", action="store_true", help=f"list every run (default: the first {PLAN_ROWS})")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("status", help="table of runs: varying parameters, status, duration, metrics, error")
    p.add_argument("experiment", nargs="?", help="experiment or pipeline name (or its YAML file); none: list the "
                                                  "experiments of the share (here: the project's; elsewhere: yours)")
    p.add_argument("stage", nargs="?", help="of a pipeline: this stage's runs (default: the table of its stages)")
    p.add_argument("--share", help=SHARE_OPTION_HELP)
    p.add_argument("--json", action="store_true", help="every field of every run as JSON (for scripts)")
    p.add_argument("--check", action="store_true", help="exit 1 unless every run of the current plan succeeded")
    p.add_argument("--all", action="store_true",
                   help="also the runs of earlier submissions (superseded by a later plan: a notebook, the sweep "
                        "or the experiment file changed); by default only the last submission's runs are shown")
    p.add_argument("-w", "--watch", action="store_true",
                   help="redraw the table until every run has ended (with --json: wait, then print)")
    p.add_argument("--interval", type=_interval, default=2.0, metavar="SECONDS",
                   help="how often --watch reads the runs again (default: 2); it asks the backend about them "
                        f"every {REFRESH_EVERY_S:.0f} s, not at each read")
    p.add_argument("--no-refresh", action="store_true",
                   help="only read the share: do not ask the backend (Slurm, Ray, Azure ML, a local driver) about "
                        "the runs first, so nothing is written, and a run whose job is gone stays as recorded")
    p.set_defaults(func=cmd_status_interruptible)

    p = sub.add_parser("logs", help="a run's output (log.txt); -f follows it")
    p.add_argument("experiment", help="experiment name (or its YAML file)")
    p.add_argument("run", help="run id or a unique prefix")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing what the run writes until it ends")
    p.add_argument("--tail", type=int, metavar="N", help="only the last N lines")
    p.add_argument("--rank", type=int, help="the log of that rank of a distributed run (default: rank 0's)")
    p.add_argument("--share", help=SHARE_OPTION_HELP)
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser("cancel", help="stop runs (all unfinished ones by default)")
    p.add_argument("experiment", help="experiment name (or its YAML file)")
    p.add_argument("runs", nargs="*", metavar="RUN", help="run ids or unique prefixes (default: every unfinished run)")
    p.add_argument("--share", help=SHARE_OPTION_HELP)
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser("fetch", help="copy an experiment's executed notebooks and run records to a folder")
    p.add_argument("experiment", help="experiment name (or its YAML file)")
    p.add_argument("dest", help="the local folder to copy into (created when absent)")
    p.add_argument("--share", help=SHARE_OPTION_HELP)
    p.set_defaults(func=cmd_fetch)


def _add_run_parsers(sub: argparse._SubParsersAction) -> None:
    """One notebook (papermill-style) and one planned run (what every backend's node calls)."""
    p = sub.add_parser("run", help="run one notebook, papermill-style: nbbatch run in.ipynb out.ipynb -p lr 0.1")
    p.add_argument("input", help="the notebook to run")
    p.add_argument("output", help="where the executed notebook is written (also when a cell fails)")
    p.add_argument("-k", "--kernel", help="kernel name (default: the notebook's)")
    p.add_argument("--cwd", help="working directory of the kernel (default: the notebook's folder)")
    p.add_argument("--cell-timeout", type=_interval, metavar="SECONDS",
                   help="stop a cell that runs longer than this many seconds")
    p.add_argument("-q", "--quiet", action="store_true", help="do not echo the notebook's output")
    add_parameter_options(p, "the notebook's")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser(RUN_ONE)  # internal (what every backend's node calls), left out of `nbbatch --help`
    p.add_argument("launch", metavar="LAUNCH",
                   help="the run's launch, as its backend wrote it: a launch file, or the launch JSON itself")
    p.set_defaults(func=cmd_run_one)


def _add_setup_parsers(sub: argparse._SubParsersAction) -> None:
    """What runs need: framework environments, a backend's managed cluster, the experiment file's schema."""
    p = sub.add_parser("envs", help="framework environments: create | list | remove")
    p.add_argument("action", choices=["create", "list", "remove"], help="build, list or remove environments")
    p.add_argument("names", nargs="*", metavar="FRAMEWORK", help="frameworks (frameworks/ lists them)")
    p.add_argument("--all", action="store_true", help="every framework (list: also those not built)")
    p.add_argument("--force", action="store_true", help="rebuild even if ready")
    p.add_argument("--parallel", type=int, metavar="N", help="builds at once (default: CPU count)")
    p.add_argument("--user", action="store_true",
                   help="create: also register the kernels in your Jupyter data dir, so a plain `jupyter lab` lists "
                        "them (as `ipykernel install --user`); `envs remove` unregisters them")
    variant = p.add_mutually_exclusive_group()
    variant.add_argument("--gpu", action="store_true", default=None,
                         help="install the framework's GPU builds (framework.yaml gpu_packages), as its image does")
    variant.add_argument("--cpu", dest="gpu", action="store_false", help="install the pins as they are (the default)")
    p.set_defaults(func=cmd_envs)

    p = sub.add_parser("cluster", help="a backend's managed cluster (Azure ML's): create | status | scale | delete")
    add_common_arguments(p)
    p.add_argument("options", nargs=argparse.REMAINDER,
                   help="the backend's cluster options (--name, --max-nodes…): `nbbatch cluster ACTION --help` lists them")
    p.set_defaults(func=cmd_cluster)

    p = sub.add_parser("schema", help="print the experiment file's JSON Schema (for editors that validate YAML)")
    p.add_argument("-o", "--output", help="write it to this file instead")
    p.set_defaults(func=cmd_schema)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``nbbatch`` console script."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "names") and not any(e.startswith("-") for e in extra):
        args.names = [*args.names, *extra]  # `images build --cpu pytorch`: names after options
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    # run-one handles its stop signals itself (cmd_run_one): the run's record says why it stopped
    previous = _terminate_like_ctrl_c() if args.command != RUN_ONE else {}
    try:
        return int(args.func(args) or 0)
    except NbbatchError as exc:
        print(f"nbbatch: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:  # `nbbatch status --json | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the flush at exit does not fail again
        return 128 + getattr(signal, "SIGPIPE", 13)
    except KeyboardInterrupt as exc:
        signum = exc.signum if isinstance(exc, Terminated) else signal.SIGINT
        hung_up = signum == getattr(signal, "SIGHUP", None)
        with contextlib.suppress(OSError):  # after SIGHUP the terminal may be gone
            print(f"nbbatch: {'the terminal closed (SIGHUP)' if hung_up else 'interrupted'}; unfinished runs were "
                  "cancelled, finished results are kept" + (
                      "; to keep a batch running after you log out, start it with `nbbatch submit --detach …` "
                      "(or under nohup, or inside tmux or screen)" if hung_up else ""), file=sys.stderr)
        return 128 + signum
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a batch scheduler, a container stop) or SIGHUP (the terminal or ssh session closed):
    handled like Ctrl-C, so no run is left ``running``."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _terminate_like_ctrl_c() -> dict[int, Any]:
    """Make Ctrl-C, SIGTERM and SIGHUP stop the command the same way; return the handlers they replaced.

    The first of them raises :class:`KeyboardInterrupt` (:class:`Terminated` for SIGTERM and SIGHUP) in the main
    thread: the runs not started are cancelled, the running ones' kernels killed, and every record says so. A
    later one must not cut that short (it would leave runs ``running``): it only says that nbbatch is stopping.
    A signal ignored when nbbatch started (``nohup``, a background job) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    stopping: list[int] = []

    def handler(signum: int, frame: object) -> None:
        stopping.append(signum)
        if len(stopping) == 1:
            raise KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)
        if len(stopping) == 2:  # os.write: print() may be in the middle of a write of the main thread
            with contextlib.suppress(OSError):
                os.write(2, f"nbbatch: already stopping: the running runs are being recorded as cancelled "
                            f"(their kernels are killed); this takes a moment (`kill -9 {os.getpid()}` would end it at "
                            "once, leaving them for the next `nbbatch status` to mark failed)\n".encode())

    stop_signals = [getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)]
    return {signum: signal.signal(signum, handler) for signum in stop_signals
            if signal.getsignal(signum) is not signal.SIG_IGN}


if __name__ == "__main__":
    sys.exit(main())
