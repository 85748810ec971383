"""The Python API the CLI and the Jupyter front are built on.

``submit`` plans and validates an experiment and hands it to its driver (:mod:`nbbatch.drivers`: a planned
batch's or a search's), which runs it on the experiment's backend; ``detach`` starts that driver where it outlives
the terminal. ``status``, ``logs`` and ``cancel`` read and act on the share. ``run_notebook`` runs one notebook
papermill-style.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from nbbatch.backends import Backend, SubmitOptions, get_backend
from nbbatch.drivers import SubmissionDriver, SubmitResult, search_driver
from nbbatch.drivers.base import Driver, lock_path
from nbbatch.drivers.detach import driver_state, read_driver_file, start_detached
from nbbatch.drivers.pipeline import PipelineDriver, PipelineResult, StageSubmission
from nbbatch.errors import NbbatchError, NotebookStopped, ValidationError, did_you_mean  # noqa: F401 - NbbatchError: api.NbbatchError
from nbbatch.plan.notebook import inspect_notebook, validate_parameters
from nbbatch.plan.runs import Plan, plan
from nbbatch.results.pipeline import read_pipeline_state
from nbbatch.results.status import (
    RefreshOutcome,
    StatusView,
    follow_log,
    read_log,
    refresh_records,
    resolve_run_id,
    status_view,
)
from nbbatch.spec.experiment import Experiment, load_experiment, with_parameters
from nbbatch.spec.pipeline import Pipeline, is_pipeline_file, load_pipeline, placeholder_values
from nbbatch.spec.project import Project, find_project
from nbbatch.store.drivers import DetachedDriver, DriverState
from nbbatch.store.known import check_experiment, lookup, open_experiment_share, remember
from nbbatch.store.layout import experiment_paths
from nbbatch.store.notebook_io import check_notebook_target
from nbbatch.store.runfiles import cancel_request, load_records, requester, write_cancel_markers
from nbbatch.store.runjson import RunRecord
from nbbatch.store.share import Share, open_share


def _as_experiment(experiment: Experiment | str | os.PathLike[str] | dict[str, Any]) -> Experiment:
    if isinstance(experiment, Experiment):
        return experiment
    if isinstance(experiment, dict):
        return Experiment.from_dict(experiment)
    return load_experiment(experiment)


def known_backend(name: str, project: Project, share: Share | None = None) -> Backend:
    """The backend experiment ``name`` was submitted to from this project; else, as its manifest on ``share`` says
    (a machine that only sees the share: the driver need not stay up); ``local`` when neither knows."""
    known = lookup(project, name)
    if not known and share is not None:
        with contextlib.suppress(OSError, ValueError, FileNotFoundError):
            manifest = json.loads(share.read_bytes(experiment_paths(name).manifest))
            known = {"backend": manifest.get("backend", "local"), "backend_settings": manifest.get("backend_settings") or {}}
    return get_backend(known.get("backend", "local"), **known.get("backend_settings", {}))


def prepare(experiment: Experiment | str | os.PathLike[str] | dict[str, Any], build_envs: bool = False,
            progress: bool = True, parameters: Mapping[str, Any] | None = None) -> tuple[Plan, Backend, Share]:
    """Load, (optionally build envs,) plan and validate: everything submit does before it starts runs.
    ``parameters`` are fixed for every run over the experiment's own (``-p NAME VALUE``)."""
    spec = with_parameters(_as_experiment(experiment), parameters or {})
    project = find_project(spec.base_dir)
    backend = get_backend(spec.backend, **spec.backend_settings)
    backend.prepare_environments(spec.frameworks, project, build=build_envs, progress=progress)
    the_plan = plan(spec, project, check_kernels=backend.capabilities.local_kernels)
    backend.check(the_plan.runs, submit_options(spec))
    share = open_share(spec.share)
    backend.check_share(share)  # e.g. a local-only folder on a multi-node Ray cluster
    return the_plan, backend, share


def submit(experiment: Experiment | str | os.PathLike[str] | dict[str, Any], *, force: bool = False,
           build_envs: bool = False, wait: bool | None = None, progress: bool | Callable[[RunRecord], None] = True,
           only: list[str] | None = None, parameters: Mapping[str, Any] | None = None,
           rebuild_search: bool = False) -> SubmitResult:
    """Run an experiment: plan and validate every run, skip succeeded ones (unless ``force``), run the rest.

    ``experiment`` is an :class:`Experiment`, a path to a YAML file, or the YAML's dict. ``parameters`` are fixed
    for every run over the experiment's own, as papermill's ``-p`` (a swept or searched one is refused).
    ``progress`` is True for a live terminal table, False for none, or a callback receiving each
    :class:`RunRecord` as it changes (what the Jupyter widgets use). ``only`` restricts to run ids/prefixes.
    ``wait``: return when every run is final (True) or once they are started (False); None: as the backend
    does by default (:attr:`~nbbatch.backends.base.Backend.waits_by_default`: all but slurm wait).
    The submission is its driver's (:mod:`nbbatch.drivers`): a search's, else a planned batch's.
    ``rebuild_search``: a search's studies are first rebuilt from its runs' records (a journal lost or damaged).
    """
    if isinstance(experiment, (str, os.PathLike)) and is_pipeline_file(experiment):
        raise ValidationError(f"{experiment} is a pipeline file: run it with nbbatch.submit_pipeline({str(experiment)!r})")
    the_plan, backend, share = prepare(experiment, build_envs=build_envs, progress=progress is True,
                                       parameters=parameters)
    return _driver(the_plan, rebuild_search)(the_plan, backend, share, source=experiment, force=force, wait=wait,
                                             progress=progress, only=only).submit()


def _driver(the_plan: Plan, rebuild_search: bool) -> Callable[..., Driver]:
    """The submission's driver: a search's (rebuilding its studies first if asked), else a planned batch's."""
    if the_plan.experiment.search is not None:
        return functools.partial(search_driver(the_plan.experiment.search), rebuild=rebuild_search)
    if rebuild_search:
        raise ValidationError(f"--rebuild-search rebuilds a search's study, and experiment "
                              f"`{the_plan.experiment.name}` has no `search:`")
    return SubmissionDriver


def detach(path: str | os.PathLike[str], *, force: bool = False, force_stages: Collection[str] = (),
           build_envs: bool = False, only: list[str] | None = None, rebuild_search: bool = False,
           parameters: Mapping[str, Any] | None = None) -> DetachedDriver:
    """Validate an experiment or pipeline file as :func:`submit` and :func:`submit_pipeline` do, then start its
    driver where it outlives this process and the user's logout (:mod:`nbbatch.drivers.detach`: a background
    process, a Slurm job…) and return at once with what was started. ``force_stages``: a pipeline's stages to run
    again. Refused while its earlier detached driver, or another driver, runs."""
    file = read_driver_file(path)
    flags = [*(["--force"] if force else []), *(f"--force={stage}" for stage in force_stages),
             *(f"--only={prefix}" for prefix in only or []), *(["--rebuild-search"] if rebuild_search else []),
             *(["--parameters-yaml", yaml.safe_dump(dict(parameters), default_flow_style=True, width=2**31).strip()]
               if parameters else [])]  # as YAML, the driver reads back the same types (nan, inf, None)
    if file.pipeline:  # placed by its top-level backend; its stages are checked whole first
        pipeline = load_pipeline(path)
        plan_pipeline(pipeline, build_envs=build_envs)
        project = find_project(file.path.resolve().parent)
        return start_detached(file.path, pipeline.name, get_backend(file.backend, **file.settings), project, flags,
                              lock=lock_path(project, open_share(pipeline.share), pipeline.name))
    the_plan, backend, share = prepare(path, build_envs=build_envs, parameters=parameters)
    _driver(the_plan, rebuild_search)(the_plan, backend, share, source=path, force=force, wait=True, progress=False,
                                      only=only)  # its refusals
    spec = the_plan.experiment
    project = find_project(spec.base_dir)
    remember(project, spec.name, share.url, spec.backend, backend.storable_settings(spec.backend_settings))
    return start_detached(file.path, spec.name, backend, project, flags, lock=lock_path(project, share, spec.name))


def detached_driver(name: str) -> tuple[DetachedDriver, DriverState] | None:
    """The detached driver of experiment or pipeline ``name`` in this project and how it is now; None when it
    was never submitted with ``--detach``."""
    driver = DetachedDriver.read(find_project().state_dir, name)
    return None if driver is None else (driver, driver_state(driver))


def submit_options(spec: Experiment, **more: Any) -> SubmitOptions:
    """The experiment's resources as a backend takes them."""
    return SubmitOptions.of(spec.resources, **more)


def read_status(experiment: str, share: str | Share | None = None, all_runs: bool = False) -> StatusView:
    """The runs of an experiment (a name known to this project, or an experiment file) as its share has them.

    Only reads: nothing is written and no backend is asked (:func:`refresh_runs` does that). Those of its current
    plan: the runs its last submission planned. Runs that an earlier submission planned (before a notebook, the
    sweep or the experiment file changed) are superseded: kept on the share, and read too with ``all_runs``.
    Records that could not be read are the view's ``problems``, each naming its file.
    """
    name, the_share = open_experiment_share(experiment, share)
    return status_view(the_share, name, all_runs)


def refresh_runs(experiment: str, share: str | Share | None = None) -> RefreshOutcome:
    """Ask the experiment's backend about its runs and bring their records on the share up to date (a run whose
    job or driver is gone ends as failed). A failure to ask is the outcome's ``error``, not an exception."""
    project = find_project()
    name, the_share = open_experiment_share(experiment, share, project)
    return refresh_records(lambda: known_backend(name, project, the_share), name, the_share)


def status(experiment: str, share: str | Share | None = None, refresh: bool = True,
           all_runs: bool = False) -> list[RunRecord]:
    """The run records of an experiment (see :func:`read_status`), after asking its backend about them unless
    ``refresh`` is false (:func:`refresh_runs`).

    A failed refresh and each record that could not be read are said as a warning; :func:`read_status` and
    :func:`refresh_runs` give them as values.
    """
    name, the_share = open_experiment_share(experiment, share)
    outcome = refresh_runs(name, the_share) if refresh else None
    view = status_view(the_share, name, all_runs)
    view.refresh = outcome
    for line in view.footer:
        warnings.warn(line, stacklevel=2)
    return view.records


def logs(experiment: str, run: str, follow: bool = False, tail: int | None = None,
         share: str | Share | None = None, rank: int | None = None) -> Iterator[str]:
    """A run's log (``log.txt``): the whole text, its tail, or followed until the run ends.

    ``rank``: the log of that rank of a distributed run (the run's own log is rank 0's)."""
    project = find_project()
    name, the_share = open_experiment_share(experiment, share, project)
    run_id = resolve_run_id(the_share, name, run)
    backend = known_backend(name, project, the_share)
    if backend.capabilities.log_stream and rank is None:
        streamed = backend.stream_log(name, the_share, run_id, follow)
        if streamed is not None:
            yield from streamed
            return
    if follow:
        yield from follow_log(the_share, name, run_id, rank=rank)
    else:
        yield read_log(the_share, name, run_id, tail, rank)


def cancel(experiment: str, runs: list[str] | None = None, share: str | Share | None = None) -> list[str]:
    """Ask runs to stop (all unfinished ones by default); they end as ``cancelled`` with their partial output.

    A pipeline's name cancels the pipeline: its driver starts no more stages, and its running stages are cancelled."""
    project = find_project()
    name, the_share = open_experiment_share(experiment, share, project)
    state = read_pipeline_state(the_share, name) if not runs else None
    request = cancel_request("`nbbatch cancel`", f" from {requester()}")  # the runs' records say who and when
    if state is not None:
        write_cancel_markers(the_share, name, request=request)
        return [run for stage in state["stages"].values() if stage.get("state") == "running"
                and the_share.exists(stage["experiment"]) for run in cancel(stage["experiment"], share=the_share)]
    check_experiment(the_share, name)  # a mistyped name: refused, no marker left behind
    ids = [resolve_run_id(the_share, name, r) for r in runs] if runs else None
    return known_backend(name, project, the_share).cancel(name, the_share, ids, request)


def run_notebook(input_path: str | os.PathLike[str], output_path: str | os.PathLike[str],
                 parameters: dict[str, Any] | None = None, kernel: str | None = None, cwd: str | None = None,
                 timeout: float | None = None, cell_timeout: float | None = None, log_output: bool = True) -> Any:
    """Execute one notebook papermill-style (any notebook, any installed kernel); return the executed notebook.

    The output path is checked before the notebook runs. The output is written atomically as cells complete;
    on failure it keeps the outputs up to the failing cell: with papermill's error marker and
    :class:`papermill.PapermillExecutionError` for a cell error, with :class:`~nbbatch.errors.NotebookStopped`
    when the kernel died or a cell ran past ``cell_timeout``. The kernel and every process it started are
    killed when this process dies, even by SIGKILL.
    """
    # papermill, jupyter_client and the engine take a second to import: only this command needs them, not the CLI's others
    import papermill  # noqa: F401 - before nbbatch.execute.engine: papermill's entry-point scan imports it
    from jupyter_client.kernelspec import KernelSpecManager
    from nbclient.exceptions import CellTimeoutError, DeadKernelError
    from papermill.exceptions import PapermillMissingParameterException
    from papermill.parameterize import add_builtin_parameters, parameterize_path

    from nbbatch.execute import engine

    find_project().activate_kernels()
    info = inspect_notebook(input_path)
    # nan and ±inf: papermill writes them as float('nan') in Python only
    for warning in validate_parameters(info, parameters or {}, non_finite=info.language == "python"):
        print(f"warning: {warning}", file=sys.stderr)
    kernel = kernel or info.kernel
    if not kernel:
        raise ValidationError(f"{Path(input_path).name} names no kernel; pass one with -k (e.g. -k python3)")
    known = KernelSpecManager().find_kernel_specs()
    if kernel not in known:
        raise ValidationError(f"kernel `{kernel}` does not exist{did_you_mean(kernel, known)}; known kernels: "
                              f"{', '.join(sorted(known))}")
    try:  # papermill fills `{name}` in the output path from the parameters
        target = parameterize_path(str(output_path), add_builtin_parameters(parameters))
    except PapermillMissingParameterException as exc:
        raise ValidationError(f"the output path {output_path} names a parameter that is not given ({exc}); "
                              "pass it with -p, or write a literal brace as {{ or }}") from exc
    check_notebook_target(target)  # now, not once the whole notebook has run
    kernel_groups: list[int | None] = []
    cells = [0, 0]  # the cell last completed (1-based; papermill completes a failing one too), of how many

    def on_kernel(km: Any) -> None:
        kernel_groups.append(engine.REAPER.watch(km))  # killed with this process, even by SIGKILL, as submit's

    def on_cell(done: int, total: int) -> None:
        cells[:] = [done, total]

    try:
        return engine.execute_notebook_file(  # papermill.execute_notebook, with atomic writes of the output
            str(input_path), str(output_path), parameters=parameters or {}, kernel_name=kernel,
            log_output=False, stdout_file=sys.stdout if log_output else None,
            stderr_file=sys.stderr if log_output else None, execution_timeout=cell_timeout,
            kernel_cwd=cwd or str(Path(input_path).resolve().parent), on_kernel=on_kernel, on_cell=on_cell,
        )
    except (CellTimeoutError, DeadKernelError) as exc:
        where = f"in cell {cells[0]} of {cells[1]}" if cells[0] else "before its first cell"
        why = "its kernel died (it crashed, exited, or was killed, e.g. out of memory)"
        if isinstance(exc, CellTimeoutError):
            why = f"the cell ran longer than the cell timeout ({cell_timeout:g} s)" if cell_timeout else \
                f"the kernel stopped answering ({str(exc).strip().splitlines()[0]})"
        raise NotebookStopped(f"{Path(input_path).name} stopped {where}: {why} (executed notebook with its outputs "
                              f"up to there: {target})") from exc
    finally:
        for group in kernel_groups:
            engine.REAPER.forget(group)


@dataclass
class StagePlan:
    """One stage of a pipeline as ``nbbatch plan`` shows it: its experiment (references stood in for, or as last
    resolved), its validated plan, and whether its runs have all succeeded already."""

    name: str
    experiment: Experiment
    plan: Plan
    needs: list[str]
    done: bool


def plan_pipeline(pipeline: Pipeline | str | os.PathLike[str], build_envs: bool = False) -> list[StagePlan]:
    """Check every stage of a pipeline as ``submit`` would, before anything runs: each stage's experiment is planned
    (notebooks, kernels, parameters, backend), its references by values of their type (or as the pipeline last
    resolved them, so a finished stage shows as done)."""
    spec = pipeline if isinstance(pipeline, Pipeline) else load_pipeline(pipeline)
    state = read_pipeline_state(open_share(spec.share), spec.name) or {"stages": {}}
    stages = []
    for name in spec.order():
        last = state["stages"].get(name) or {}
        values = placeholder_values(spec, name)
        resolved = {(*k.split(".", 1), "")[:2]: v["value"] for k, v in (last.get("resolved") or {}).items()}
        if resolved.keys() == values.keys():
            values = resolved
        experiment = spec.experiment(name, values)
        the_plan, _backend, share = prepare(experiment, build_envs=build_envs, progress=False)
        done = last.get("state") == "succeeded" and sorted(last.get("planned") or []) == sorted(
            r.run_id for r in the_plan.runs)
        if done and experiment.search is None:  # the runs themselves: still on the share, ended
            records = {r.run_id: r for r in load_records(share, experiment.name)[0]}
            done = all(r.run_id in records and records[r.run_id].final for r in the_plan.runs)
        stages.append(StagePlan(name, experiment, the_plan, list(spec.stages[name].needs), done))
    return stages


def submit_pipeline(pipeline: Pipeline | str | os.PathLike[str], *, force: Collection[str] = (),
                    build_envs: bool = False, progress: bool | Callable[[str], None] = True) -> PipelineResult:
    """Run a pipeline: check every stage first (:func:`plan_pipeline`), then run the stages in dependency order
    (:class:`~nbbatch.drivers.pipeline.PipelineDriver`), independent ones at the same time, each waited for.

    ``force`` names stages to run again (with every stage that needs them) although their runs succeeded.
    ``progress``: True says each stage's start and end on stderr, False nothing, a callable receives each line."""
    spec = pipeline if isinstance(pipeline, Pipeline) else load_pipeline(pipeline)
    plan_pipeline(spec, build_envs=build_envs)
    say = progress if callable(progress) else _say if progress else (lambda line: None)

    def submit_stage(experiment: Experiment, forced: bool, succeeded_before: list[str] | None) -> StageSubmission:
        the_plan, backend, share = prepare(experiment, progress=False)
        planned = [r.run_id for r in the_plan.runs]
        if not forced and succeeded_before is not None and sorted(succeeded_before) == sorted(planned):
            return StageSubmission(_unchanged_stage(the_plan, share), planned)  # its runs (failures allowed) stand
        driver = search_driver(experiment.search) if experiment.search is not None else SubmissionDriver
        result = driver(the_plan, backend, share, source=spec.source, force=forced, wait=True, progress=False).submit()
        return StageSubmission(result, planned)

    share = open_share(spec.share)
    return PipelineDriver(spec, share, submit_stage, cancel_stage=lambda name: cancel(name, share=share),
                          force=force, say=say).submit()


def _unchanged_stage(the_plan: Plan, share: Share) -> SubmitResult:
    """A stage that succeeded with the same plan: nothing runs; its runs are those the manifest last listed."""
    name = the_plan.experiment.name
    manifest = json.loads(share.read_bytes(experiment_paths(name).manifest))
    listed = set(manifest.get("runs") or [])
    records, problems = load_records(share, name)
    kept = [r for r in records if r.run_id in listed]
    return SubmitResult(name, share.url, the_plan.experiment.backend, skipped=[r.run_id for r in kept], records=kept,
                        warnings=problems)


def _say(line: str) -> None:
    print(f"nbbatch: {line}", file=sys.stderr, flush=True)
