"""The Python API the CLI and the Jupyter front are built on.

``submit`` plans and validates an experiment, skips runs that already succeeded on the share,
and hands the rest to the experiment's backend; ``status``, ``logs`` and ``cancel`` read and act on
the share. ``run_notebook`` runs one notebook papermill-style.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nbbatch.backends import Backend, SubmitOptions, get_backend
from nbbatch.errors import NbbatchError, NotebookStopped, ValidationError, did_you_mean
from nbbatch.plan.notebook import inspect_notebook, validate_parameters
from nbbatch.plan.runs import Plan, plan
from nbbatch.results.progress import live_progress
from nbbatch.results.status import (
    RefreshOutcome,
    StatusView,
    follow_log,
    read_log,
    refresh_records,
    resolve_run_id,
    status_view,
)
from nbbatch.search.driver import run_search
from nbbatch.spec.experiment import Experiment, load_experiment
from nbbatch.spec.project import Project, find_project
from nbbatch.store.known import check_experiment, lookup, open_experiment_share, remember
from nbbatch.store.layout import experiment_paths
from nbbatch.store.lease import ShareLease
from nbbatch.store.lock import ExperimentLock
from nbbatch.store.notebook_io import check_notebook_target
from nbbatch.store.runfiles import clear_cancel, load_records
from nbbatch.store.runjson import DONE_STATUSES, RunRecord, utc_now
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
    waited: bool = True  # whether submit waited for every run to be final

    @property
    def ok(self) -> bool:
        """Whether every run of the experiment has succeeded (or, in a search, was pruned)."""
        return bool(self.records) and all(r.status in DONE_STATUSES for r in self.records)


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
           build_envs: bool = False, wait: bool | None = None, progress: bool | Callable[[RunRecord], None] = True,
           only: list[str] | None = None) -> SubmitResult:
    """Run an experiment: plan and validate every run, skip succeeded ones (unless ``force``), run the rest.

    ``experiment`` is an :class:`Experiment`, a path to a YAML file, or the YAML's dict.
    ``progress`` is True for a live terminal table, False for none, or a callback receiving each
    :class:`RunRecord` as it changes (what the Jupyter widgets use). ``only`` restricts to run ids/prefixes.
    ``wait``: return when every run is final (True) or once they are started (False); None: as the backend
    does by default (:attr:`~nbbatch.backends.base.Backend.waits_by_default`: all but slurm wait).
    """
    the_plan, backend, share = prepare(experiment, build_envs=build_envs, progress=progress is True)
    spec = the_plan.experiment
    if spec.search is not None:
        _check_search_submit(wait, only)
        wait = True  # the driver judges every run as it goes: it stays up until the search ends
    if wait is None:
        wait = backend.waits_by_default
    project = find_project(spec.base_dir)
    runs = the_plan.runs
    if only:
        runs = [r for r in runs if any(r.run_id.startswith(o) for o in only)]
        if not runs:
            raise NbbatchError(f"--only {', '.join(only)} matches none of the {len(the_plan.runs)} planned runs")
    result = SubmitResult(spec.name, share.url, spec.backend, warnings=list(the_plan.warnings), waited=wait)
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
        if spec.search is not None:
            result.started = _search(the_plan, backend, share, experiment, result, force, progress, lease.lost)
            records, problems = load_records(share, spec.name)
            result.records = [r for r in records if r.run_id in set(result.started)]
            result.warnings.extend(problems)
            return result
        outcome = backend.triage(runs, share, force=force)
        result.skipped = outcome.skipped
        result.warnings.extend(outcome.notes)
        result.started = [*outcome.started, *outcome.in_flight]
        result.warnings.extend(_write_manifest(share, spec, [r.run_id for r in the_plan.runs], experiment,
                                               backend.storable_settings(spec.backend_settings)))
        options = submit_options(spec, wait=wait, force=force, on_update=progress if callable(progress) else None,
                                 halt=lease.lost)
        starting = set(outcome.started)
        todo = [r for r in runs if r.run_id in starting]
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


def _check_search_submit(wait: bool | None, only: list[str] | None) -> None:
    if wait is False:
        raise NbbatchError("a search cannot be submitted without waiting (--no-wait): its driver judges every run as "
                           "it goes and stays up until the search ends. Submit without --no-wait (in tmux or with "
                           "nohup if the terminal may close); after a Ctrl-C, submit again to resume the search")
    if only:
        raise NbbatchError("--only selects runs of a planned batch, but a search draws its runs as it goes: name "
                           "the notebooks or frameworks to search in the experiment file instead")


def _search(the_plan: Plan, backend: Backend, share: Share, source: object, result: SubmitResult, force: bool,
            progress: bool | Callable[[RunRecord], None], halt: Any) -> list[str]:
    """Run the experiment's search (:mod:`nbbatch.search`); the trials' runs. The manifest lists them as they start,
    so ``status`` and ``compare`` show them; ``force`` starts the search afresh."""
    spec = the_plan.experiment
    settings = backend.storable_settings(spec.backend_settings)
    options = submit_options(spec, wait=True, on_update=progress if callable(progress) else None, halt=halt)
    noted: list[str] = []

    def on_runs(run_ids: list[str]) -> None:
        if not noted:  # the first time: the warning of a name reused by another experiment file
            result.warnings.extend(_write_manifest(share, spec, run_ids, source, settings))
            noted.append("written")
        else:
            _write_manifest(share, spec, run_ids, source, settings)

    def say(line: str) -> None:
        if progress is True:
            print(f"nbbatch search: {line}", file=sys.stderr, flush=True)

    return list(run_search(the_plan, backend, share, options, say, on_runs, fresh=force))


def submit_options(spec: Experiment, **more: Any) -> SubmitOptions:
    """The experiment's resources as a backend takes them."""
    return SubmitOptions.of(spec.resources, **more)


def _write_manifest(share: Share, spec: Experiment, run_ids: list[str], source: object = None,
                    backend_settings: dict[str, Any] | None = None) -> list[str]:
    """Write the submission's manifest, ``<experiment>/experiment.json``: its ``runs`` are the experiment's
    current plan (what ``status``, ``compare`` and ``check`` show). Return a warning when the last submission
    under this name came from another experiment file: its runs are superseded by this one's."""
    path = experiment_paths(spec.name).manifest
    manifest = {
        "experiment": spec.name, "updated": utc_now(), "backend": spec.backend,
        "backend_settings": backend_settings or {},  # nothing secret (Backend.storable_settings)
        # the experiment file (None for one built in Python): tells a reused name from an edited file
        "source": str(Path(source).resolve()) if isinstance(source, (str, os.PathLike)) else None,
        "frameworks": spec.frameworks, "notebooks": [str(n.path.name) for n in spec.notebooks],
        "parameters": spec.parameters, "sweep": spec.sweep,
        **({"search": spec.search.to_dict()} if spec.search else {}),
        "runs": list(run_ids),
    }
    try:
        previous = json.loads(share.read_bytes(path))
    except (OSError, ValueError, UnicodeDecodeError, NbbatchError):
        previous = None
    share.write_bytes(path, json.dumps(manifest, indent=2, default=str).encode())
    if not isinstance(previous, dict) or not isinstance(previous.get("runs"), list):
        return []
    if previous.get("source") and manifest["source"]:
        reused = previous["source"] != manifest["source"]
    else:  # a file or a submission without a known path: another experiment if it runs other notebooks
        reused = [previous.get("frameworks"), previous.get("notebooks")] != [spec.frameworks, manifest["notebooks"]]
    if not reused:
        return []
    return [f"experiment name `{spec.name}` was last submitted to {share.url} from {_submitted_from(previous)} (at "
            f"{previous.get('updated')}); this submission from {_submitted_from(manifest)} reuses the name and "
            f"replaces its plan: "
            f"`nbbatch status {spec.name}` and `nbbatch compare {spec.name}` now show this submission's "
            f"{len(manifest['runs'])} run(s), and the earlier runs stay on the share (shown with --all). If they "
            f"are different experiments, give one of the files its own `experiment:` name"]


def _submitted_from(manifest: dict[str, Any]) -> str:
    """Where a manifest's submission came from, for people: its experiment file, else what it ran."""
    if manifest.get("source"):
        return str(manifest["source"])
    ran = [str(n) for key in ("frameworks", "notebooks") if isinstance(manifest.get(key), list) for n in manifest[key]]
    return f"an experiment built in Python (running {', '.join(ran)})"


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
    """Ask runs to stop (all unfinished ones by default); they end as ``cancelled`` with their partial output."""
    project = find_project()
    name, the_share = open_experiment_share(experiment, share, project)
    check_experiment(the_share, name)  # a mistyped name: refused, no marker left behind
    ids = [resolve_run_id(the_share, name, r) for r in runs] if runs else None
    return known_backend(name, project, the_share).cancel(name, the_share, ids)


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
