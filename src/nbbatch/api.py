"""The Python API the CLI and the Jupyter front are built on.

``submit`` plans and validates an experiment, skips runs that already succeeded on the share,
and hands the rest to the experiment's backend; ``status``, ``logs`` and ``cancel`` read and act on
the share. ``run_notebook`` runs one notebook papermill-style.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import NbbatchError
from .project import Project, find_project
from .runrecord import RunRecord, utc_now
from .runs import Plan, Run, plan
from .share import Share, open_share
from .spec import Experiment, load_experiment

REGISTRY_FILE = "experiments.json"  # in .nbbatch/: experiment name → share and backend, for status/logs/cancel


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
        return bool(self.records) and all(r.status == "succeeded" for r in self.records)


def _as_experiment(experiment: Experiment | str | os.PathLike[str] | dict[str, Any]) -> Experiment:
    if isinstance(experiment, Experiment):
        return experiment
    if isinstance(experiment, dict):
        return Experiment.from_dict(experiment)
    return load_experiment(experiment)


def _remember(project: Project, experiment: Experiment, share: Share) -> None:
    path = project.state_dir / REGISTRY_FILE
    try:
        known = json.loads(path.read_text()) if path.exists() else {}
    except ValueError:
        known = {}
    known[experiment.name] = {"share": share.url, "backend": experiment.backend,
                              "backend_settings": _storable_settings(experiment.backend_settings), "updated": utc_now()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(known, indent=2, default=str))
    os.replace(tmp, path)


def _storable_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """Backend settings safe to keep on disk: no secret-looking names, no Python objects (credentials, clients)."""
    from .execute import SECRET_ENV_HINTS

    kept = {}
    for key, value in settings.items():
        if any(hint in str(key).upper() for hint in SECRET_ENV_HINTS):
            continue
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        kept[key] = value
    return kept


def _lookup(experiment: str, project: Project) -> dict[str, Any]:
    path = project.state_dir / REGISTRY_FILE
    try:
        return json.loads(path.read_text()).get(experiment, {}) if path.exists() else {}
    except ValueError:
        return {}


def open_experiment_share(experiment: str, share: str | Share | None = None,
                          project: Project | None = None) -> tuple[str, Share]:
    """The experiment's name and share: an experiment file, or a name found in the project's registry."""
    project = project or find_project()
    if isinstance(share, Share):
        return experiment, share
    if experiment.endswith((".yaml", ".yml")) and Path(experiment).exists():
        spec = load_experiment(experiment)
        return spec.name, open_share(share or spec.share)
    if share:
        return experiment, open_share(share)
    known = _lookup(experiment, project)
    return experiment, open_share(known.get("share") or project.results_dir)


def _lock_path(project: Project, share: Share, experiment: str) -> Path:
    local = share.local_path(experiment)
    if local is not None:
        return local / ".lock"
    return project.state_dir / "locks" / f"{experiment}.lock"


def _past_duration(share: Share, run: Run, by_framework: dict[str, float]) -> float:
    from .execute import read_record

    try:
        record = read_record(share, run.experiment, run.run_id)
    except NbbatchError:
        record = None
    if record and record.duration_s:
        return record.duration_s
    return by_framework.get(run.framework or run.notebook_rel, float("inf"))


def order_longest_first(runs: list[Run], share: Share) -> list[Run]:
    """Runs ordered by past duration, longest (or never seen) first: shortens the makespan."""
    from .results import load_records

    records, _ = load_records(share, runs[0].experiment) if runs else ([], [])
    by_framework: dict[str, list[float]] = {}
    for rec in records:
        if rec.duration_s and rec.status == "succeeded":
            by_framework.setdefault(rec.framework or rec.notebook, []).append(rec.duration_s)
    means = {k: sum(v) / len(v) for k, v in by_framework.items()}
    return sorted(runs, key=lambda r: -_past_duration(share, r, means))


def prepare(experiment: Experiment | str | os.PathLike[str] | dict[str, Any], build_envs: bool = False,
            progress: bool = True) -> tuple[Plan, Any, Share]:
    """Load, (optionally build envs,) plan and validate: everything submit does before it starts runs."""
    from .backends import get_backend

    spec = _as_experiment(experiment)
    project = find_project(spec.base_dir)
    backend = get_backend(spec.backend, **spec.backend_settings)
    local_kernels = getattr(backend, "uses_local_kernels", True)
    if build_envs and spec.frameworks and local_kernels:
        from .envs import build_envs as build

        build(spec.frameworks, project, progress=progress)
    the_plan = plan(spec, project, check_kernels=local_kernels)
    if hasattr(backend, "check"):
        backend.check(the_plan.runs)
    share = open_share(spec.share)
    if hasattr(backend, "check_share"):  # e.g. a local-only folder on a multi-node Ray cluster
        backend.check_share(share)
    return the_plan, backend, share


def submit(experiment: Experiment | str | os.PathLike[str] | dict[str, Any], *, force: bool = False,
           build_envs: bool = False, wait: bool = True, progress: bool | Callable[[RunRecord], None] = True,
           only: list[str] | None = None) -> SubmitResult:
    """Run an experiment: plan and validate every run, skip succeeded ones (unless ``force``), run the rest.

    ``experiment`` is an :class:`Experiment`, a path to a YAML file, or the YAML's dict.
    ``progress`` is True for a live terminal table, False for none, or a callback receiving each
    :class:`RunRecord` as it changes (what the Jupyter widgets use). ``only`` restricts to run ids/prefixes.
    """
    from .backends import SubmitOptions
    from .execute import new_record, read_record, write_record
    from .lock import ExperimentLock
    from .results import load_records

    the_plan, backend, share = prepare(experiment, build_envs=build_envs, progress=progress is True)
    spec = the_plan.experiment
    project = find_project(spec.base_dir)
    runs = the_plan.runs
    if only:
        runs = [r for r in runs if any(r.run_id.startswith(o) for o in only)]
        if not runs:
            raise NbbatchError(f"--only {', '.join(only)} matches none of the {len(the_plan.runs)} planned runs")
    result = SubmitResult(spec.name, share.url, spec.backend, warnings=list(the_plan.warnings))
    _remember(project, spec, share)
    with ExperimentLock(_lock_path(project, share, spec.name), spec.name) as lock:
        if lock.recovered_from:
            gone = lock.recovered_from
            result.warnings.append(f"experiment `{spec.name}` was left locked by process {gone.get('pid')} on "
                                   f"{gone.get('host')} (since {gone.get('since')}), which is gone; took the lock over")
        share.remove(f"{spec.name}/CANCEL")
        backend.refresh(spec.name, share)
        todo = []
        for run in runs:
            record = read_record(share, run.experiment, run.run_id)
            if record and record.status == "succeeded" and not force:
                result.skipped.append(run.run_id)
                continue
            todo.append(run)
        todo = order_longest_first(todo, share)
        for run in todo:
            previous = read_record(share, run.experiment, run.run_id)
            if previous and not previous.final and previous.backend != "local" and not force:
                continue  # still queued or running on a remote backend: its record stays, the backend skips it
            write_record(share, new_record(run, spec.backend))
        _write_manifest(share, spec, the_plan)
        result.started = [r.run_id for r in todo]
        callback = progress if callable(progress) else None
        options = SubmitOptions(runs_per_gpu=spec.runs_per_gpu, max_parallel=spec.max_parallel, wait=wait,
                                on_update=callback, extra=dict(spec.backend_settings))
        if todo:
            if progress is True:
                from .progress import live_progress

                with live_progress(share, spec.name, [r.run_id for r in runs]) as on_update:
                    options.on_update = on_update
                    backend.submit(todo, share, options)
            else:
                backend.submit(todo, share, options)
    records, problems = load_records(share, spec.name)
    wanted = {r.run_id for r in runs}
    result.records = [r for r in records if r.run_id in wanted]
    result.warnings.extend(problems)
    return result


def _write_manifest(share: Share, spec: Experiment, the_plan: Plan) -> None:
    manifest = {
        "experiment": spec.name, "updated": utc_now(), "backend": spec.backend,
        "frameworks": spec.frameworks, "notebooks": [str(n.path.name) for n in spec.notebooks],
        "parameters": spec.parameters, "sweep": spec.sweep,
        "runs": [r.run_id for r in the_plan.runs],
    }
    share.write_bytes(f"{spec.name}/experiment.json", json.dumps(manifest, indent=2, default=str).encode())


def status(experiment: str, share: str | Share | None = None, refresh: bool = True) -> list[RunRecord]:
    """The run records of an experiment (a name known to this project, or an experiment file)."""
    from .backends import get_backend
    from .results import load_records

    project = find_project()
    name, the_share = open_experiment_share(experiment, share, project)
    known = _lookup(name, project)
    if refresh:
        try:
            get_backend(known.get("backend", "local"), **known.get("backend_settings", {})).refresh(name, the_share)
        except NbbatchError:
            pass
    records, problems = load_records(the_share, name)
    if not records and not problems:
        raise NbbatchError(f"experiment `{name}` has no runs in {the_share.url}; submit it with "
                           f"`nbbatch submit <experiment.yaml>` or pass --share where its results are")
    for problem in problems:
        import warnings

        warnings.warn(problem, stacklevel=2)
    return records


def logs(experiment: str, run: str, follow: bool = False, tail: int | None = None,
         share: str | Share | None = None) -> Iterator[str]:
    """A run's log (``log.txt``): the whole text, its tail, or followed until the run ends."""
    from .backends import get_backend
    from .results import follow_log, read_log, resolve_run_id

    project = find_project()
    name, the_share = open_experiment_share(experiment, share, project)
    run_id = resolve_run_id(the_share, name, run)
    known = _lookup(name, project)
    if known.get("backend", "local") != "local":
        streamed = get_backend(known["backend"], **known.get("backend_settings", {})).stream_log(
            name, the_share, run_id, follow)
        if streamed is not None:
            yield from streamed
            return
    if follow:
        yield from follow_log(the_share, name, run_id)
    else:
        yield read_log(the_share, name, run_id, tail)


def cancel(experiment: str, runs: list[str] | None = None, share: str | Share | None = None) -> list[str]:
    """Ask runs to stop (all unfinished ones by default); they end as ``cancelled`` with their partial output."""
    from .backends import get_backend
    from .results import resolve_run_id

    project = find_project()
    name, the_share = open_experiment_share(experiment, share, project)
    ids = [resolve_run_id(the_share, name, r) for r in runs] if runs else None
    known = _lookup(name, project)
    backend = get_backend(known.get("backend", "local"), **known.get("backend_settings", {}))
    return backend.cancel(name, the_share, ids)


def run_notebook(input_path: str | os.PathLike[str], output_path: str | os.PathLike[str],
                 parameters: dict[str, Any] | None = None, kernel: str | None = None, cwd: str | None = None,
                 timeout: float | None = None, cell_timeout: float | None = None, log_output: bool = True) -> Any:
    """Execute one notebook papermill-style (any notebook, any installed kernel); return the executed notebook.

    The output is written atomically as cells complete; on failure it keeps the outputs up to the failing
    cell and papermill's error marker, and :class:`papermill.PapermillExecutionError` is raised.
    """
    import sys

    import papermill  # noqa: F401 - before nbbatch.engine: papermill's entry-point scan imports it

    from . import engine
    from .errors import ValidationError
    from .notebook import inspect_notebook, validate_parameters

    find_project().activate_kernels()
    info = inspect_notebook(input_path)
    for warning in validate_parameters(info, parameters or {}):
        print(f"warning: {warning}", file=sys.stderr)
    kernel = kernel or info.kernel
    if not kernel:
        raise ValidationError(f"{Path(input_path).name} names no kernel; pass one with -k (e.g. -k python3)")
    from jupyter_client.kernelspec import KernelSpecManager

    known = KernelSpecManager().find_kernel_specs()
    if kernel not in known:
        from .errors import did_you_mean

        raise ValidationError(f"kernel `{kernel}` does not exist{did_you_mean(kernel, known)}; known kernels: "
                              f"{', '.join(sorted(known))}")
    return engine.execute_notebook_file(  # papermill.execute_notebook, with atomic writes of the output
        str(input_path), str(output_path), parameters=parameters or {}, kernel_name=kernel,
        log_output=False, stdout_file=sys.stdout if log_output else None,
        stderr_file=sys.stderr if log_output else None, execution_timeout=cell_timeout,
        kernel_cwd=cwd or str(Path(input_path).resolve().parent),
    )
