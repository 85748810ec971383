"""Experiments: what to run (frameworks and/or notebooks × a sweep), with what resources, where.

An experiment comes from a YAML file (:func:`load_experiment`) or is built in Python
(:class:`Experiment`). A file's *shape* is checked by the published JSON Schema
(:func:`nbbatch.spec.schema.shape_error`); what the schema cannot say (relations between values) is
:func:`experiment_problem`, a pure function both ways of making an experiment go through, so a
malformed spec is one clear error before anything runs.
"""

from __future__ import annotations

import dataclasses
import os
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nbbatch.errors import SpecError
from nbbatch.spec.frameworks import list_frameworks
from nbbatch.spec.notify import NotifySpec, parse_notify
from nbbatch.spec.resources import AUTO, DISTRIBUTIONS, Distribution, Resources, resources_problem
from nbbatch.spec.schema import shape_error
from nbbatch.spec.search import Search, parse_search
from nbbatch.spec.sweep import expand_sweep, swept_parameters
from nbbatch.spec.yaml_loader import read_spec_file

__all__ = ["AUTO", "DISTRIBUTIONS", "Distribution", "Experiment", "NotebookEntry", "Resources", "experiment_problem",
           "load_experiment"]


@dataclass(frozen=True)
class NotebookEntry:
    """A user's own notebook and the (existing) kernel to run it in."""

    path: Path
    kernel: str | None = None  # None: the kernel named in the notebook's metadata
    label: str | None = None  # run id prefix (default: the notebook's stem)


@dataclass
class Experiment:
    """A batch of runs: (frameworks + notebooks) × (fixed parameters ⊕ sweep)."""

    name: str
    frameworks: list[str] = field(default_factory=list)
    notebooks: list[NotebookEntry] = field(default_factory=list)
    parameters: dict[str, Any] = field(default_factory=dict)
    inputs: dict[str, str] = field(default_factory=dict)  # parameter -> folder (absolute path) or share URL
    sweep: dict[str, Any] = field(default_factory=dict)
    search: Search | None = None  # an adaptive search (`search:`): its trials are proposed as the runs end
    resources: Resources = field(default_factory=Resources)  # GPUs, their sharing, what a distributed run spans
    timeout: float | None = None
    cell_timeout: float | None = None
    retries: int = 0
    max_output_mb: float = 32.0  # printed output each cell keeps in output.ipynb (all of it stays in log.txt)
    backend: str = "local"
    backend_settings: dict[str, Any] = field(default_factory=dict)
    share: str = "results"
    env: dict[str, str] = field(default_factory=dict)  # a number or true/false given here becomes text (_env_text)
    tracking: str | None = None  # mlflow | none; None: MLFLOW_TRACKING_URI in the driver's environment decides
    notify: NotifySpec | None = None  # whom to tell when the runs end (`notify:`); its secrets stay ${env:NAME}
    base_dir: Path = field(default_factory=Path.cwd)
    # a pipeline stage's: by `parameters.NAME`/`inputs.NAME`/`env.NAME`, the reference its value was resolved from
    origins: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.inputs, Mapping):  # folders relative to base_dir, also for experiments built in Python
            self.inputs = _inputs(self.inputs, Path(self.base_dir))
        if isinstance(self.env, Mapping):
            self.env = {name: _env_text(value) for name, value in self.env.items()}
        if self.search is not None and not isinstance(self.search, Search):  # the file's block, or a dict in Python
            self.search = parse_search(self.search, self.parameters, self.sweep)
        if self.notify is not None and not isinstance(self.notify, NotifySpec):  # the file's block, or a dict
            self.notify = parse_notify(self.notify)
        self.validate()

    def validate(self) -> None:
        """Raise :class:`SpecError` naming the first mistake."""
        problem = experiment_problem(self)
        if problem is not None:
            raise problem

    def world(self) -> Distribution | None:
        """What a distributed run spans (``None`` for a one-process run): type, nodes, processes and GPUs per node."""
        return self.resources.distribution

    def combinations(self) -> list[dict[str, Any]]:
        """The parameter dicts every framework/notebook runs with (fixed parameters, then the sweep)."""
        return [{**self.parameters, **combo} for combo in expand_sweep(  # refused above resources.max_runs
            self.sweep, self.resources.max_runs, len(self.frameworks) + len(self.notebooks))]

    @classmethod
    def from_dict(cls, data: Any, base_dir: Path | None = None, default_name: str | None = None) -> Experiment:
        """Build an experiment from the YAML structure; every mistake is a :class:`SpecError`."""
        wrong = shape_error(data)
        if wrong is not None:
            raise wrong
        base = base_dir or Path.cwd()
        frameworks = data.get("frameworks") or []
        if isinstance(frameworks, str):
            frameworks = list(list_frameworks()) if frameworks == "all" else [frameworks]
        notebooks = data.get("notebooks") or []
        timeout, cell_timeout = data.get("timeout"), data.get("cell_timeout")
        if isinstance(timeout, Mapping):
            timeout, cell_timeout = timeout.get("run"), timeout.get("cell", cell_timeout)
        backend = data.get("backend", "local")
        settings: dict[str, Any] = {}
        if isinstance(backend, Mapping):
            settings = {k: v for k, v in backend.items() if k != "name"}
            backend = backend.get("name", "local")
        share = str(data.get("share", "results"))
        distribution = data.get("distribution")
        return cls(
            name=data.get("experiment") or default_name or "experiment",
            frameworks=list(frameworks),
            notebooks=[_notebook_entry(n, base) for n in ([notebooks] if isinstance(notebooks, (str, Mapping)) else notebooks)],
            parameters=dict(data.get("parameters") or {}),
            inputs=data.get("inputs") or {},
            sweep=dict(data.get("sweep") or {}),
            search=data.get("search"),
            resources=Resources.of(distribution["type"] if isinstance(distribution, Mapping) else distribution,
                                   **(data.get("resources") or {})),
            timeout=timeout,
            cell_timeout=cell_timeout,
            retries=data.get("retries", 0),
            max_output_mb=data.get("max_output_mb", 32.0),
            backend=backend,
            backend_settings=settings,
            share=share if "://" in share else str((base / share).resolve()),
            env=dict(data.get("env") or {}),
            tracking=data.get("tracking"),
            notify=data.get("notify"),
            base_dir=base,
        )


def experiment_problem(experiment: Experiment) -> SpecError | None:
    """The first mistake in ``experiment``, or ``None``: the shape of its plain values by the schema (also for one
    built in Python), then what the schema cannot say. Pure: nothing is changed."""
    wrong = shape_error(_file_form(experiment))
    if wrong is not None:
        return wrong
    if not experiment.frameworks and not experiment.notebooks:
        return SpecError(f"experiment `{experiment.name}` runs nothing: list `frameworks:` (see `nbbatch envs list`) "
                         "and/or `notebooks:`")
    problem = resources_problem(experiment.resources)
    if problem is not None:
        return SpecError(problem)
    try:
        _string_keys(experiment.sweep, "sweep")  # YAML keys may be numbers, which JSON (and so the schema) cannot see
        combos = experiment.combinations()
    except SpecError as exc:
        return exc
    try:
        parse_notify(experiment.notify)  # one built in Python as a NotifySpec is checked as a file's block is
    except SpecError as exc:
        return exc
    searched = {p.name: None for p in experiment.search.params} if experiment.search else {}
    return _inputs_problem(experiment.inputs, {**combos[0], **searched})


def _file_form(experiment: Experiment) -> dict[str, Any]:
    """The experiment's plain values as an experiment file writes them, for the schema."""
    return {"experiment": experiment.name, "frameworks": experiment.frameworks, "parameters": experiment.parameters,
            "inputs": experiment.inputs, "sweep": experiment.sweep, "env": experiment.env, "retries": experiment.retries,
            "timeout": {"run": experiment.timeout, "cell": experiment.cell_timeout},
            "max_output_mb": experiment.max_output_mb,
            **({"search": experiment.search.to_dict()} if experiment.search else {}),
            **({"tracking": experiment.tracking} if experiment.tracking is not None else {})}


def _inputs_problem(inputs: Mapping[str, str], parameters: Mapping[str, Any]) -> SpecError | None:
    for name, where in inputs.items():
        if "://" in where and any(mark in where for mark in ("?", "@", "#")):
            return SpecError(f"input `{name}`: the URL holds a query, a user or a fragment (a SAS token?); name "
                             "only the folder (azfiles://account/share/folder): credentials come from "
                             "AZURE_STORAGE_KEY or your Azure sign-in, never from the experiment file")
        if name in parameters:
            return SpecError(f"`{name}` is both an input and a parameter (or swept); an input sets the parameter "
                             f"to the folder's path as the run sees it: drop `{name}` from one of them")
    return None


def _inputs(value: Mapping[str, Any], base: Path) -> dict[str, str]:
    """``inputs:`` with every folder path made absolute (relative to the experiment file); URLs kept."""
    return {name: str((base / os.path.expanduser(where)).resolve()) if isinstance(where, str) and where.strip()
            and "://" not in where else where for name, where in value.items()}


def _env_text(value: Any) -> Any:
    """An ``env:`` value as the kernel's environment gets it: true/false as YAML writes them, a number as Python
    does; anything else as it is, for the schema to refuse (a null, a list). A file's values are already its text."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value) if isinstance(value, (int, float)) else value


def _string_keys(value: Any, where: str) -> None:
    if isinstance(value, Mapping):
        for key, inner in value.items():
            if not isinstance(key, str):
                raise SpecError(f"{where}: key {reprlib.repr(key)} must be a name (a string)")
            _string_keys(inner, f"{where}.{key}")


def _notebook_entry(item: str | Mapping[str, str], base: Path) -> NotebookEntry:
    if isinstance(item, str):
        return NotebookEntry(_notebook_path(item, base))
    return NotebookEntry(_notebook_path(item["path"], base), item.get("kernel"), item.get("label"))


def _notebook_path(text: str, base: Path) -> Path:
    if not text.strip() or "\0" in text:
        raise SpecError(f"notebook path {reprlib.repr(text)} is not a file name")
    return (base / text).resolve()


def load_experiment(path: str | os.PathLike[str]) -> Experiment:
    """Read and validate an experiment YAML file."""
    path = Path(path)
    data = read_spec_file(path, "experiment")
    return Experiment.from_dict(data, base_dir=path.resolve().parent, default_name=path.stem)


def with_parameters(experiment: Experiment, values: Mapping[str, Any], given_as: str = "-p") -> Experiment:
    """``experiment`` with ``values`` fixed for every run (``nbbatch submit -p NAME VALUE``, ``submit_all(lr=0.1)``),
    over its ``parameters:``; a name its sweep or search varies is refused (``given_as`` names the flag in the error).
    Each name is then checked against the notebooks' parameters cells as the file's own are, when it is planned."""
    if not values:
        return experiment
    varied = swept_parameters(experiment.sweep)
    varied.update((param.name, "search") for param in (experiment.search.params if experiment.search else ()))
    for name in values:
        if name in varied:
            raise SpecError(f"{given_as} {name}: `{name}` is varied by {varied[name]} of experiment `{experiment.name}`; "
                            f"change its values there, or take it out there to fix one value with {given_as}")
    return dataclasses.replace(experiment, parameters={**experiment.parameters, **values})
