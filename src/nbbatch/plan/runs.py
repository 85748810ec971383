"""Runs: the concrete (notebook, kernel, parameters) units a plan is made of.

A run's id is readable and stable: ``<framework or notebook stem>-<hash>``, the hash covering the
notebook's content, the parameters and the environment's pins. The same run submitted twice is the
same run, so a succeeded one is skipped unless forced.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nbbatch.errors import ValidationError, did_you_mean
from nbbatch.plan.inputs import check_inputs, input_identities
from nbbatch.plan.notebook import NotebookInfo, inspect_notebook, validate_parameters
from nbbatch.spec.environments import require_ready
from nbbatch.spec.frameworks import Framework, bundled_frameworks, get_framework, list_frameworks
from nbbatch.spec.gpu_sharing import recognise, shared_gpu_env
from nbbatch.spec.notify import notify_warnings
from nbbatch.spec.project import find_project
from nbbatch.spec.resources import Distribution

if TYPE_CHECKING:
    from nbbatch.spec.experiment import Experiment
    from nbbatch.spec.project import Project
    from nbbatch.spec.search import Search


RunIdMaker = Callable[..., str]  # (parameters, resume_from=None) -> run id: what run_id_maker gives

_parameters_json = json.JSONEncoder(sort_keys=True, default=repr).encode  # json.dumps(…, sort_keys, default), made once


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "run"


def run_id_for(label: str, notebook_bytes: bytes, parameters: dict[str, Any], env_lock: str,
               env: dict[str, str] | None = None, gpus: int = 0, inputs: dict[str, str] | None = None,
               distribution: Distribution | None = None, resume_from: str | None = None) -> str:
    """``<label>-<10 hex>`` from everything that can change a run's result.

    That is the notebook's content, its parameters, the environment's lock, the kernel's extra
    variables (``env:``), the GPUs it asks for, where its inputs are, what a distributed run spans and
    the run whose checkpoints it starts from. ``env``, ``gpus``, ``inputs``, ``distribution`` and
    ``resume_from`` enter the hash only when set, so ids of runs without them stay what they were.
    """
    return run_id_maker(label, notebook_bytes, env_lock, env, gpus, inputs, distribution)(parameters, resume_from)


def run_id_maker(label: str, notebook_bytes: bytes, env_lock: str, env: dict[str, str] | None = None, gpus: int = 0,
                 inputs: dict[str, str] | None = None,
                 distribution: Distribution | None = None) -> RunIdMaker:
    """:func:`run_id_for` of one notebook and environment, as a function of the parameters (and the run resumed
    from, if any): what does not vary is hashed once (a sweep of 10^5 runs of a large notebook would hash it 10^5
    times)."""
    head = hashlib.sha256(notebook_bytes)
    tail = env_lock.encode()
    if env:
        tail += b"\0env" + json.dumps(env, sort_keys=True).encode()
    if gpus:
        tail += f"\0gpus={gpus}".encode()
    if inputs:
        tail += b"\0inputs" + json.dumps(inputs, sort_keys=True).encode()
    if distribution:
        tail += b"\0distribution" + json.dumps(distribution.to_dict(), sort_keys=True).encode()
    prefix = _slug(label)

    def run_id(parameters: dict[str, Any], resume_from: str | None = None) -> str:
        digest = head.copy()
        digest.update(_parameters_json(parameters).encode())
        digest.update(tail)
        if resume_from:
            digest.update(b"\0resume_from=" + resume_from.encode())
        return f"{prefix}-{digest.hexdigest()[:10]}"

    return run_id


@dataclass(frozen=True, slots=True)  # slots: a sweep of 10^5 runs holds 10^5 of them
class Run:
    """One planned execution of a notebook with parameters in a kernel."""

    run_id: str
    experiment: str
    notebook: str  # absolute path on the submitting machine
    notebook_rel: str  # relative to the project root (what remote backends resolve)
    kernel: str
    parameters: dict[str, Any] = field(default_factory=dict)
    framework: str | None = None
    gpus: int = 0  # GPUs the run asks for (0: CPU only)
    cpus: int | None = None  # cores the run asks for (resources.cpus; None: as the backend shares them out)
    timeout_s: float | None = None  # whole run
    cell_timeout_s: float | None = None  # each cell
    retries: int = 0  # extra attempts after a kernel death
    max_output_mb: float = 32.0  # printed output each cell keeps in the notebook (log.txt keeps all)
    env: dict[str, str] = field(default_factory=dict)  # variables for the kernel (on top of the kernelspec's)
    shared_gpu_env: dict[str, str] = field(default_factory=dict)  # added when the run shares its GPU
    gpu_memory_mb: int | None = None  # the framework's estimate of the GPU memory a run needs (None: unknown)
    preload: tuple[str, ...] = ()  # modules a kernel started ahead of the run imports before it is given the run
    recognised_as: str | None = None  # the framework a notebook given by path was recognised as (its kernel, imports)
    cwd: str | None = None  # kernel working directory (default: the notebook's folder)
    inputs: dict[str, str] = field(default_factory=dict)  # parameter -> folder or share URL (bound where it runs)
    distribution: Distribution | None = None  # what a distributed run spans (``gpus`` is then per node); None: one kernel
    tracking: str | None = None  # the experiment's `tracking:` (mlflow | none; None: MLFLOW_TRACKING_URI decides)
    origins: dict[str, Any] = field(default_factory=dict)  # a pipeline stage's: where each resolved value came from
    resume_from: str | None = None  # a run of the same experiment whose checkpoints this one starts from (in its id)
    keep_checkpoints: bool = False  # keep them once it succeeds (another run may start from them); not in its id

    @property
    def world_size(self) -> int:
        """How many ranks (kernels) the run has: 1 unless it is distributed."""
        return self.distribution.world_size if self.distribution else 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Run:
        return cls(**{**data, "distribution": Distribution.from_dict(data.get("distribution")),
                      "preload": tuple(data.get("preload") or ())})  # JSON gives a list

    def project_root(self) -> Path:
        """The project the run's notebook belongs to (its path minus its project-relative path)."""
        notebook, rel = Path(self.notebook), Path(self.notebook_rel)
        if notebook.is_absolute() and not rel.is_absolute() and notebook.parts[-len(rel.parts):] == rel.parts:
            return notebook.parents[len(rel.parts) - 1]
        return find_project().root

    def resolve_notebook(self, project_root: Path | None = None) -> Path:
        """The notebook on this machine: the absolute path if present, else relative to the project."""
        absolute = Path(self.notebook)
        if absolute.exists() or project_root is None:
            return absolute
        return project_root / self.notebook_rel


@dataclass(frozen=True)
class _Target:
    """One notebook of an experiment (a framework's, or one given by path) and what its runs share."""

    label: str
    notebook: Path
    kernel: str
    env_lock: str  # what stands for its environment in the run ids: the framework's pins, else the kernel's name
    framework: Framework | None  # its framework, declared or recognised (None: not known)
    declared: bool = False  # named in `frameworks:` (not recognised from a notebook given by path)


@dataclass
class Plan:
    """The validated runs of an experiment, and the warnings found while planning."""

    experiment: Experiment
    runs: list[Run]
    warnings: list[str] = field(default_factory=list)
    run_ids: dict[str, RunIdMaker] = field(default_factory=dict, repr=False)  # run id → its maker

    def trial(self, template: Run, searched: Mapping[str, Any], resume_from: str | None = None,
              keep_checkpoints: bool = False) -> Run:
        """A search's trial: ``template`` (one of :attr:`runs`, with the fixed parameters) with the parameters the
        trial drew, under its own run id. Their names and types were checked against the notebook when planning.

        ``resume_from``: the run (of this experiment) whose checkpoints the trial's run starts from, a part of its
        id; ``keep_checkpoints``: its own are kept once it succeeds, for a later run to start from."""
        parameters = {**template.parameters, **searched}
        return replace(template, parameters=parameters, resume_from=resume_from, keep_checkpoints=keep_checkpoints,
                       run_id=self.run_ids[template.run_id](parameters, resume_from))


def _known_kernels() -> dict[str, str]:
    # jupyter_client takes a second to import: only planning loads it, never `nbbatch --help` (tests/test_cli.py)
    from jupyter_client.kernelspec import KernelSpecManager

    return KernelSpecManager().find_kernel_specs()


def _search_warnings(search: Search, info: NotebookInfo) -> list[str]:
    """Check what a search can give the notebook against its parameters cell: every value a trial can draw has the
    type of one of the examples, and the resource a promoting search sets is a whole number."""
    warnings: list[str] = []
    given = [{param.name: value} for param in search.params for value in param.examples()]
    if search.resource:
        given.append({search.resource: search.rungs[-1]})
    for parameters in given:
        warnings.extend(w for w in validate_parameters(info, parameters) if w not in warnings)
    return warnings


def plan(experiment: Experiment, project: Project | None = None, check_kernels: bool = True) -> Plan:
    """Turn an experiment into runs, checking every notebook, kernel, env and parameter first.

    Raises a :class:`~nbbatch.errors.NbbatchError` describing the first problem; nothing runs.
    ``check_kernels=False`` skips local kernel/env checks (for backends that run elsewhere).
    """
    project = project or find_project(experiment.base_dir)
    project.activate_kernels()
    check_inputs(experiment.inputs)
    combos = experiment.combinations()
    kernels = _known_kernels() if check_kernels else {}
    runs: list[Run] = []
    makers: dict[str, RunIdMaker] = {}
    warnings: list[str] = []

    def notebook_rel(path: Path) -> str:
        try:
            return str(path.relative_to(project.root))
        except ValueError:
            return path.name

    targets: list[_Target] = []
    for name in experiment.frameworks:
        framework = get_framework(name, project)
        if check_kernels:
            require_ready(framework, project)
        world = experiment.resources.distribution
        if world and world.type not in framework.distribution:
            can = (f"its notebook runs as {', '.join(framework.distribution)}" if framework.distribution
                   else framework.no_distribution or f"frameworks/{name}/framework.yaml lists no `distribution:`")
            raise ValidationError(f"framework `{name}` cannot run as distribution `{world.type}`: {can}; "
                                  "drop it from this experiment or change distribution.type")
        if experiment.resources.gpus and not framework.gpu:
            raise ValidationError(f"framework `{name}` cannot use a GPU (frameworks/{name}/framework.yaml says "
                                  "gpu: false) but the experiment asks for resources.gpus: "
                                  f"{experiment.resources.gpus}; set gpus: 0 or drop `{name}`")
        targets.append(_Target(name, framework.notebook, framework.kernel_name, framework.fingerprint(), framework,
                               declared=True))
    known = list_frameworks(project) if experiment.notebooks else {}
    bundled = bundled_frameworks(known) if experiment.notebooks else {}
    for entry in experiment.notebooks:
        info = inspect_notebook(entry.path)
        kernel = entry.kernel or info.kernel
        if not kernel:
            raise ValidationError(f"{entry.path.name} names no kernel in its metadata; give one with "
                                  f"`kernel:` in the experiment (known kernels: {', '.join(sorted(kernels))})")
        targets.append(_Target(entry.label or entry.path.stem, entry.path, kernel, kernel,
                               recognise(kernel, info.imports, known) or recognise(kernel, info.imports, bundled)))

    # What every run of a target shares is computed once, and its dicts are shared by the (frozen) runs: a sweep
    # of 10^5 runs costs one parameters dict and one hash of them per run.
    env, inputs, identities = dict(experiment.env), dict(experiment.inputs), input_identities(experiment.inputs,
                                                                                              project.root)
    for target in targets:
        label, notebook, kernel, framework = target.label, target.notebook, target.kernel, target.framework
        shared_env, memory_mb = shared_gpu_env(framework), framework.gpu_memory_mb if framework else None
        framework_name = framework.name if framework and target.declared else None
        recognised_as = framework.name if framework and not target.declared else None
        info = inspect_notebook(notebook)
        if check_kernels and kernel not in kernels:
            raise ValidationError(f"kernel `{kernel}` (for {notebook.name}) does not exist{did_you_mean(kernel, kernels)}; "
                                  f"known kernels: {', '.join(sorted(kernels)) or '(none)'}. "
                                  "List them with `jupyter kernelspec list`.")
        run_id = run_id_maker(label, info.content, target.env_lock, experiment.env, experiment.resources.gpus, identities,
                              experiment.resources.distribution)
        if experiment.search:
            warnings.extend(w for w in _search_warnings(experiment.search, info) if w not in warnings)
        checked: set[tuple[str, int]] = set()  # (name, id(value)): a grid's values recur in many runs, checked once
        notebook_path, rel = str(notebook), notebook_rel(notebook)
        for params in combos:
            fresh = {name: value for name, value in params.items() if (name, id(value)) not in checked}
            if fresh or not checked:
                bound = {**fresh, **inputs}  # an input is a parameter too: its name is checked the same way
                warnings.extend(w for w in validate_parameters(info, bound) if w not in warnings)
                checked.update((name, id(value)) for name, value in fresh.items())
            runs.append(Run(
                run_id=run_id(params), experiment=experiment.name, notebook=notebook_path, notebook_rel=rel,
                kernel=kernel, parameters=params, framework=framework_name, gpus=experiment.resources.gpus,
                cpus=experiment.resources.cpus,
                timeout_s=experiment.timeout, cell_timeout_s=experiment.cell_timeout, retries=experiment.retries,
                max_output_mb=experiment.max_output_mb,
                env=env, shared_gpu_env=shared_env, gpu_memory_mb=memory_mb,
                preload=framework.preload if framework else (), recognised_as=recognised_as,
                inputs=inputs, distribution=experiment.resources.distribution, tracking=experiment.tracking,
                origins=dict(experiment.origins),
            ))
            makers[runs[-1].run_id] = run_id
    seen: dict[str, Run] = {}
    unique: list[Run] = []
    for run in runs:
        if run.run_id not in seen:
            seen[run.run_id] = run
            unique.append(run)
        else:
            warnings.append(f"run {run.run_id} appears twice in the sweep; it runs once")
    warnings.extend(notify_warnings(experiment.notify))  # said here too: the runs may take hours to reach it
    return Plan(experiment, unique, warnings, makers)
