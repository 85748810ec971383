"""The Python API the CLI and the Jupyter front are built on.

``submit`` plans and validates an experiment, skips runs that already succeeded on the share,
and hands the rest to the experiment's backend; ``status``, ``logs`` and ``cancel`` read and act on
the share. ``run_notebook`` runs one notebook papermill-style.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nbbatch.backends import Backend, SubmitOptions, get_backend
from nbbatch.errors import NbbatchError, ValidationError, did_you_mean
from nbbatch.plan.notebook import inspect_notebook, validate_parameters
from nbbatch.plan.runs import Plan, plan
from nbbatch.results.progress import live_progress
from nbbatch.results.status import follow_log, read_log, resolve_run_id
from nbbatch.spec.experiment import Experiment, load_experiment
from nbbatch.spec.project import Project, find_project
from nbbatch.store.known import lookup, open_experiment_share, remember
from nbbatch.store.layout import experiment_paths
from nbbatch.store.lease import ShareLease
from nbbatch.store.lock import ExperimentLock
from nbbatch.store.runfiles import clear_cancel, load_records
from nbbatch.store.runjson import RunRecord, Status, utc_now
from nbbatch.store.share import Share, open_share


@dataclass
class SubmitResult:
    """What a submission did: the runs it started, those it skipped, and the records at return."""

    experiment: str
    share: str
    backend: str
    started: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    records: list[RunRecord] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether every run of the experiment has succeeded."""
        return bool(self.records) and all(r.status == Status.SUCCEEDED for r in self.records)


def _as_experiment(experiment: Experiment | str | os.PathLike[str] | dict[str, Any]) -> Experiment:
    if isinstance(experiment, Experiment):
        return experiment
    if isinstance(experiment, dict):
        return Experiment.from_dict(experiment)
    return load_experiment(experiment)


def _lock_path(project: Project, share: Share, experiment: str) -> Path:
    local = share.local_path(experiment_paths(experiment).lock)
    if local is not None:
        return local
    return project.state_dir / "locks" / f"{experiment}.lock"


def known_backend(name: str, project: Project) -> Backend:
    """The backend experiment ``name`` was submitted to from this project (``local`` when unknown)."""
    known = lookup(project, name)
    return get_backend(known.get("backend", "local"), **known.get("backend_settings", {}))


def prepare(experiment: Experiment | str | os.PathLike[str] | dict[str, Any], build_envs: bool = False,
            progress: bool = True) -> tuple[Plan, Backend, Share]:
    """Load, (optionally build envs,) plan and validate: everything submit does before it starts runs."""
    spec = _as_experiment(experiment)
    project = find_project(spec.base_dir)
    backend = get_backend(spec.backend, **spec.backend_settings)
    backend.prepare_environments(spec.frameworks, project, build=build_envs, progress=progress)
    the_plan = plan(spec, project, check_kernels=backend.capabilities.local_kernels)
    backend.check(the_plan.runs, submit_options(spec))
    share = open_share(spec.share)
    backend.check_share(share)  # e.g. a local-only folder on a multi-node Ray cluster
    return the_plan, backend, share


def submit(experiment: Experiment | str | os.PathLike[str] | dict[str, Any], *, force: bool = False,
           build_envs: bool = False, wait: bool = True, progress: bool | Callable[[RunRecord], None] = True,
           only: list[str] | None = None) -> SubmitResult:
    """Run an experiment: plan and validate every run, skip succeeded ones (unless ``force``), run the rest.

    ``experiment`` is an :class:`Experiment`, a path to a YAML file, or the YAML's dict.
    ``progress`` is True for a live terminal table, False for none, or a callback receiving each
    :class:`RunRecord` as it changes (what the Jupyter widgets use). ``only`` restricts to run ids/prefixes.
    """
    the_plan, backend, share = prepare(experiment, build_envs=build_envs, progress=progress is True)
    spec = the_plan.experiment
    project = find_project(spec.base_dir)
    runs = the_plan.runs
    if only:
        runs = [r for r in runs if any(r.run_id.startswith(o) for o in only)]
        if not runs:
            raise NbbatchError(f"--only {', '.join(only)} matches none of the {len(the_plan.runs)} planned runs")
    result = SubmitResult(spec.name, share.url, spec.backend, warnings=list(the_plan.warnings))
    remember(project, spec.name, share.url, spec.backend, backend.storable_settings(spec.backend_settings))
    with ExperimentLock(_lock_path(project, share, spec.name), spec.name) as lock, \
            ShareLease(share, spec.name, command=lock.command) as lease:
        for gone in (lock.recovered_from, lease.recovered_from):
            if gone:
                result.warnings.append(f"experiment `{spec.name}` was left locked by process {gone.get('pid')} on "
                                       f"{gone.get('host')} (since {gone.get('since')}), which is gone; took it over")
                break
        clear_cancel(share, spec.name)
        backend.refresh(spec.name, share)
        outcome = backend.triage(runs, share, force=force)
        result.skipped = outcome.skipped
        result.warnings.extend(outcome.notes)
        result.started = [*outcome.started, *outcome.in_flight]
        _write_manifest(share, spec, the_plan)
        options = submit_options(spec, wait=wait, force=force, on_update=progress if callable(progress) else None,
                                 halt=lease.lost)
        todo = [r for r in runs if r.run_id in set(outcome.started)]
        if todo and progress is True:
            with live_progress(share, spec.name, [r.run_id for r in runs]) as on_update:
                options.on_update = on_update
                backend.launch(todo, share, options)
        elif todo:
            backend.launch(todo, share, options)
        if outcome.in_flight and wait and backend.capabilities.detached:
            backend.wait(spec.name, share, outcome.in_flight, options.on_update)
    records, problems = load_records(share, spec.name)
    wanted = {r.run_id for r in runs}
    result.records = [r for r in records if r.run_id in wanted]
    result.warnings.extend(problems)
    return result


def submit_options(spec: Experiment, **more: Any) -> SubmitOptions:
    """The experiment's resources as a backend takes them."""
    return SubmitOptions.of(spec.resources, **more)


def _write_manifest(share: Share, spec: Experiment, the_plan: Plan) -> None:
    manifest = {
        "experiment": spec.name, "updated": utc_now(), "backend": spec.backend,
        "frameworks": spec.frameworks, "notebooks": [str(n.path.name) for n in spec.notebooks],
        "parameters": spec.parameters, "sweep": spec.sweep,
        "runs": [r.run_id for r in the_plan.runs],
    }
    share.write_bytes(experiment_paths(spec.name).manifest, json.dumps(manifest, indent=2, default=str).encode())


def status(experiment: str, share: str | Share | None = None, refresh: bool = True) -> list[RunRecord]:
    """The run records of an experiment (a name known to this project, or an experiment file)."""
    project = find_project()
    name, the_share = open_experiment_share(experiment, share, project)
    if refresh:
        try:
            known_backend(name, project).refresh(name, the_share)
        except NbbatchError:
            pass
    records, problems = load_records(the_share, name)
    if not records and not problems:
        raise NbbatchError(f"experiment `{name}` has no runs in {the_share.url}; submit it with "
                           f"`nbbatch submit <experiment.yaml>` or pass --share where its results are")
    for problem in problems:
        warnings.warn(problem, stacklevel=2)
    return records


def logs(experiment: str, run: str, follow: bool = False, tail: int | None = None,
         share: str | Share | None = None, rank: int | None = None) -> Iterator[str]:
    """A run's log (``log.txt``): the whole text, its tail, or followed until the run ends.

    ``rank``: the log of that rank of a distributed run (the run's own log is rank 0's)."""
    project = find_project()
    name, the_share = open_experiment_share(experiment, share, project)
    run_id = resolve_run_id(the_share, name, run)
    backend = known_backend(name, project)
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
    """Ask runs to stop (all unfinished ones by default); they end as ``cancelled`` with their partial output."""
    project = find_project()
    name, the_share = open_experiment_share(experiment, share, project)
    ids = [resolve_run_id(the_share, name, r) for r in runs] if runs else None
    return known_backend(name, project).cancel(name, the_share, ids)


def run_notebook(input_path: str | os.PathLike[str], output_path: str | os.PathLike[str],
                 parameters: dict[str, Any] | None = None, kernel: str | None = None, cwd: str | None = None,
                 timeout: float | None = None, cell_timeout: float | None = None, log_output: bool = True) -> Any:
    """Execute one notebook papermill-style (any notebook, any installed kernel); return the executed notebook.

    The output is written atomically as cells complete; on failure it keeps the outputs up to the failing
    cell and papermill's error marker, and :class:`papermill.PapermillExecutionError` is raised.
    """
    # papermill, jupyter_client and the engine take a second to import: only this command needs them, not the CLI's others
    import papermill  # noqa: F401 - before nbbatch.execute.engine: papermill's entry-point scan imports it
    from jupyter_client.kernelspec import KernelSpecManager

    from nbbatch.execute import engine

    find_project().activate_kernels()
    info = inspect_notebook(input_path)
    for warning in validate_parameters(info, parameters or {}):
        print(f"warning: {warning}", file=sys.stderr)
    kernel = kernel or info.kernel
    if not kernel:
        raise ValidationError(f"{Path(input_path).name} names no kernel; pass one with -k (e.g. -k python3)")
    known = KernelSpecManager().find_kernel_specs()
    if kernel not in known:
        raise ValidationError(f"kernel `{kernel}` does not exist{did_you_mean(kernel, known)}; known kernels: "
                              f"{', '.join(sorted(known))}")
    return engine.execute_notebook_file(  # papermill.execute_notebook, with atomic writes of the output
        str(input_path), str(output_path), parameters=parameters or {}, kernel_name=kernel,
        log_output=False, stdout_file=sys.stdout if log_output else None,
        stderr_file=sys.stderr if log_output else None, execution_timeout=cell_timeout,
        kernel_cwd=cwd or str(Path(input_path).resolve().parent),
    )
