"""Experiments: what to run (frameworks and/or notebooks × a sweep), with what resources, where.

An experiment comes from a YAML file (:func:`load_experiment`) or is built in Python
(:class:`Experiment`); both go through the same validation, so a malformed spec is one clear
error before anything runs.
"""

from __future__ import annotations

import math
import os
import re
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from nbbatch.errors import SpecError, did_you_mean
from nbbatch.spec.schema import keys as schema_keys
from nbbatch.spec.sweep import expand_sweep

_TOP_KEYS = schema_keys()
_RESOURCE_KEYS = schema_keys("resources")
AUTO = "auto"  # resources.runs_per_gpu: as many as fit in the GPU's memory
DISTRIBUTIONS = ("torch", "jax", "tensorflow", "mpi")  # distribution.type
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")


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
    gpus: int = 0
    runs_per_gpu: int | str = AUTO  # a number, or "auto": packed by memory (see nbbatch.execute.gpus)
    mps: bool = False  # the runs on a GPU share it through a CUDA MPS daemon nbbatch starts
    max_parallel: int | None = None
    distribution: str | None = None  # torch | jax | tensorflow | mpi: each run spans processes, GPUs and nodes
    nodes: int = 1
    processes_per_node: int | None = None  # None: gpus_per_node, or 1
    gpus_per_node: int | None = None  # None: gpus
    timeout: float | None = None
    cell_timeout: float | None = None
    retries: int = 0
    max_output_mb: float = 32.0  # printed output each cell keeps in output.ipynb (all of it stays in log.txt)
    backend: str = "local"
    backend_settings: dict[str, Any] = field(default_factory=dict)
    share: str = "results"
    env: dict[str, str] = field(default_factory=dict)
    base_dir: Path = field(default_factory=Path.cwd)

    def __post_init__(self) -> None:
        if isinstance(self.inputs, Mapping):  # folders relative to base_dir, also for experiments built in Python
            self.inputs = _inputs(self.inputs, Path(self.base_dir))
        self.validate()

    def validate(self) -> None:
        """Raise :class:`SpecError` naming the first mistake."""
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise SpecError(f"experiment name {self.name!r} must be 1-100 letters, digits, '-', '_' or '.', "
                            "starting with a letter or digit (it becomes a folder in the share)")
        if not self.frameworks and not self.notebooks:
            raise SpecError(f"experiment `{self.name}` runs nothing: list `frameworks:` (see `nbbatch envs list`) "
                            "and/or `notebooks:`")
        _nonneg_int("resources.gpus", self.gpus)
        _nonneg_int("retries", self.retries)
        if self.runs_per_gpu != AUTO:
            _nonneg_int("resources.runs_per_gpu", self.runs_per_gpu, minimum=1, alternative=f" or `{AUTO}`")
        self._validate_distribution()
        if not isinstance(self.mps, bool):
            raise SpecError(f"`resources.mps` must be true or false (got {reprlib.repr(self.mps)})")
        if self.mps and not self.gpus:
            raise SpecError("`resources.mps: true` shares GPUs between runs, but the runs ask for no GPU "
                            "(resources.gpus is 0): set resources.gpus ≥ 1 or drop mps")
        if self.max_parallel is not None:
            _nonneg_int("resources.max_parallel", self.max_parallel, minimum=1)
        for key, value in (("timeout", self.timeout), ("cell_timeout", self.cell_timeout)):
            if value is not None and not _positive(value):
                raise SpecError(f"`{key}` must be a positive number of seconds (got {value!r})")
        if not _positive(self.max_output_mb):
            raise SpecError(f"`max_output_mb` must be a positive number of MiB (got {self.max_output_mb!r}): what each "
                            "cell may print into output.ipynb; log.txt keeps all of it")
        if not isinstance(self.parameters, Mapping):
            raise SpecError("`parameters` must map names to values, e.g. parameters: {EPOCHS: 5}")
        for name in self.parameters:
            if not isinstance(name, str) or not name.isidentifier():
                raise SpecError(f"parameter name {name!r} is not a valid Python identifier")
        if not isinstance(self.env, Mapping):
            raise SpecError("`env` must map variable names to strings")
        _string_keys(self.sweep, "sweep")  # sweep kinds, parameter names and distributions are all names
        combos = self.combinations()
        if not combos:
            raise SpecError(f"experiment `{self.name}`: the sweep is empty")
        self._validate_inputs(combos[0])

    def _validate_distribution(self) -> None:
        _nonneg_int("resources.nodes", self.nodes, minimum=1)
        for key in ("processes_per_node", "gpus_per_node"):
            if getattr(self, key) is not None:
                _nonneg_int(f"resources.{key}", getattr(self, key), minimum=int(key == "processes_per_node"))
        if self.distribution is None:
            asked = [k for k in ("nodes", "processes_per_node", "gpus_per_node")
                     if getattr(self, k) not in (None, 1 if k == "nodes" else None)]
            if asked:
                raise SpecError(f"`resources.{asked[0]}` spreads a run over several processes, but the experiment has no "
                                f"`distribution:`; add distribution: {{type: torch}} (or {', '.join(DISTRIBUTIONS[1:])}), "
                                "or drop it (resources.gpus gives a run its GPUs)")
            return
        if self.distribution not in DISTRIBUTIONS:
            raise SpecError(f"`distribution.type` must be one of {', '.join(DISTRIBUTIONS)} "
                            f"(got {reprlib.repr(self.distribution)}){did_you_mean(str(self.distribution), DISTRIBUTIONS)}")
        if self.gpus_per_node is not None and self.gpus not in (0, self.gpus_per_node):
            raise SpecError(f"`resources.gpus: {self.gpus}` and `gpus_per_node: {self.gpus_per_node}` disagree; a "
                            "distributed run's GPUs are per node: give only gpus_per_node")
        gpus = self.gpus if self.gpus_per_node is None else self.gpus_per_node
        self.gpus = self.gpus_per_node = gpus  # what each node of a run gets, for every backend
        one_per_node = self.distribution in ("jax", "tensorflow")
        if self.processes_per_node is None:
            self.processes_per_node = 1 if one_per_node else max(gpus, 1)
        ranks = self.processes_per_node
        if one_per_node and ranks != 1:
            raise SpecError(f"distribution `{self.distribution}` runs one process per node, which drives all the node's "
                            f"GPUs (resources.processes_per_node is {ranks}); set processes_per_node: 1 and "
                            "gpus_per_node to the GPUs each node gives, or use nodes: for more processes")
        if not one_per_node and gpus and ranks != gpus:
            raise SpecError(f"`resources.processes_per_node: {ranks}` with gpus_per_node: {gpus}: each rank drives one "
                            "GPU (NCCL cannot share a GPU between ranks); make them equal")
        if self.runs_per_gpu != AUTO and self.runs_per_gpu > 1:
            raise SpecError(f"`resources.runs_per_gpu: {self.runs_per_gpu}` shares GPUs between runs, but a distributed "
                            "run's ranks need their GPUs to themselves (NCCL cannot share a GPU between processes); "
                            "drop runs_per_gpu or distribution")
        if self.mps:
            raise SpecError("`resources.mps: true` shares GPUs between runs, but a distributed run's ranks need their GPUs "
                            "to themselves; drop mps or distribution")

    def world(self) -> dict[str, Any]:
        """What a distributed run spans (``{}`` for a one-process run): type, nodes, processes and GPUs per node."""
        if self.distribution is None:
            return {}
        return {"type": self.distribution, "nodes": self.nodes, "processes_per_node": self.processes_per_node,
                "gpus_per_node": self.gpus}

    def _validate_inputs(self, parameters: Mapping[str, Any]) -> None:
        if not isinstance(self.inputs, Mapping):
            raise SpecError("`inputs` must map notebook parameters to folders, e.g. inputs: {DATA_DIR: ./data}")
        for name, where in self.inputs.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise SpecError(f"input name {name!r} must be a notebook parameter (a Python identifier)")
            if not isinstance(where, str) or not where.strip():
                raise SpecError(f"input `{name}` must be a folder path or a share URL such as "
                                f"azfiles://account/share/data (got {reprlib.repr(where)})")
            if "://" in where and any(mark in where for mark in ("?", "@", "#")):
                raise SpecError(f"input `{name}`: the URL holds a query, a user or a fragment (a SAS token?); name "
                                "only the folder (azfiles://account/share/folder): credentials come from "
                                "AZURE_STORAGE_KEY or your Azure sign-in, never from the experiment file")
            if name in parameters:
                raise SpecError(f"`{name}` is both an input and a parameter (or swept); an input sets the parameter "
                                f"to the folder's path as the run sees it: drop `{name}` from one of them")

    def combinations(self) -> list[dict[str, Any]]:
        """The parameter dicts every framework/notebook runs with (fixed parameters, then the sweep)."""
        combos = expand_sweep(self.sweep)
        for combo in combos:
            for name in combo:
                if not isinstance(name, str) or not name.isidentifier():
                    raise SpecError(f"sweep parameter name {name!r} is not a valid Python identifier")
        return [{**self.parameters, **combo} for combo in combos]

    @classmethod
    def from_dict(cls, data: Any, base_dir: Path | None = None, default_name: str | None = None) -> Experiment:
        """Build an experiment from the YAML structure; every mistake is a :class:`SpecError`."""
        if not isinstance(data, Mapping):
            raise SpecError("an experiment file must be a YAML mapping (keys like experiment, frameworks, sweep)")
        unknown = [k for k in data if k not in _TOP_KEYS]
        if unknown:
            key = str(unknown[0])
            raise SpecError(f"unknown key `{key}` in the experiment{did_you_mean(key, _TOP_KEYS)}; "
                            f"known keys: {', '.join(_TOP_KEYS)}")
        base = base_dir or Path.cwd()
        frameworks = data.get("frameworks") or []
        if isinstance(frameworks, str):
            frameworks = _all_frameworks() if frameworks == "all" else [frameworks]
        if not isinstance(frameworks, list) or not all(isinstance(f, str) for f in frameworks):
            raise SpecError("`frameworks` must be a list of framework names (or `all`)")
        resources = data.get("resources") or {}
        if not isinstance(resources, Mapping):
            raise SpecError("`resources` must be a mapping with gpus, runs_per_gpu, mps, max_parallel")
        bad = [k for k in resources if k not in _RESOURCE_KEYS]
        if bad:
            raise SpecError(f"unknown key `resources.{bad[0]}`{did_you_mean(str(bad[0]), _RESOURCE_KEYS)}; "
                            f"known: {', '.join(_RESOURCE_KEYS)}")
        timeout, cell_timeout = data.get("timeout"), data.get("cell_timeout")
        if isinstance(timeout, Mapping):
            bad = [k for k in timeout if k not in ("run", "cell")]
            if bad:
                raise SpecError(f"unknown key `timeout.{bad[0]}`; use timeout: {{run: SECONDS, cell: SECONDS}}")
            timeout, cell_timeout = timeout.get("run"), timeout.get("cell", cell_timeout)
        backend = data.get("backend", "local")
        settings: dict[str, Any] = {}
        if isinstance(backend, Mapping):
            settings = {k: v for k, v in backend.items() if k != "name"}
            backend = backend.get("name", "local")
        if not isinstance(backend, str):
            raise SpecError("`backend` must be a name (local, azureml, ray) or a mapping with `name:` and settings")
        share = data.get("share", "results")
        if not isinstance(share, (str, os.PathLike)):
            raise SpecError("`share` must be a folder path or a share URL such as azfiles://account/share")
        share = str(share)
        if "://" not in share:
            share = str((base / share).resolve())
        return cls(
            name=data.get("experiment") or default_name or "experiment",
            frameworks=list(frameworks),
            notebooks=[_notebook_entry(n, base) for n in _as_list(data.get("notebooks"), "notebooks")],
            parameters=_mapping(data.get("parameters"), "`parameters` must map names to values, e.g. parameters: {EPOCHS: 5}"),
            inputs=data.get("inputs") or {},
            sweep=dict(data.get("sweep") or {}) if isinstance(data.get("sweep") or {}, Mapping) else _bad_sweep(),
            gpus=resources.get("gpus", 0),
            runs_per_gpu=resources.get("runs_per_gpu", AUTO),
            mps=resources.get("mps", False),
            max_parallel=resources.get("max_parallel"),
            distribution=_distribution_type(data.get("distribution")),
            nodes=resources.get("nodes", 1),
            processes_per_node=resources.get("processes_per_node"),
            gpus_per_node=resources.get("gpus_per_node"),
            timeout=timeout,
            cell_timeout=cell_timeout,
            retries=data.get("retries", 0),
            max_output_mb=data.get("max_output_mb", 32.0),
            backend=backend,
            backend_settings=settings,
            share=share,
            env={str(k): str(v) for k, v in (data.get("env") or {}).items()} if isinstance(data.get("env") or {},
                                                                                            Mapping) else data["env"],
            base_dir=base,
        )


def _distribution_type(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):  # `distribution: torch`, short for {type: torch}
        return value
    if not isinstance(value, Mapping) or "type" not in value:
        raise SpecError(f"`distribution` must be {{type: torch}} (or {', '.join(DISTRIBUTIONS[1:])}); "
                        f"got {reprlib.repr(value)}")
    bad = [k for k in value if k != "type"]
    if bad:
        raise SpecError(f"unknown key `distribution.{bad[0]}`; the only key is type ({', '.join(DISTRIBUTIONS)}); "
                        "nodes, processes_per_node and gpus_per_node go under resources:")
    return value["type"]


def _inputs(value: Any, base: Path) -> dict[str, str]:
    """``inputs:`` with every folder path made absolute (relative to the experiment file); URLs kept."""
    inputs = _mapping(value, "`inputs` must map notebook parameters to folders, e.g. inputs: {DATA_DIR: ./data}")
    return {name: str((base / os.path.expanduser(where)).resolve()) if isinstance(where, str) and where.strip()
            and "://" not in where else where for name, where in inputs.items()}


def _string_keys(value: Any, where: str) -> None:
    if isinstance(value, Mapping):
        for key, inner in value.items():
            if not isinstance(key, str):
                raise SpecError(f"{where}: key {reprlib.repr(key)} must be a name (a string)")
            _string_keys(inner, f"{where}.{key}")


def _mapping(value: Any, message: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(message)
    return dict(value)


def _bad_sweep() -> dict[str, Any]:
    raise SpecError("`sweep` must be a mapping with any of grid, zip, random")


def _nonneg_int(key: str, value: Any, minimum: int = 0, alternative: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecError(f"`{key}` must be an integer ≥ {minimum}{alternative} (got {reprlib.repr(value)})")


def _as_list(value: Any, key: str) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (str, Mapping)):
        return [value]
    if not isinstance(value, list):
        raise SpecError(f"`{key}` must be a list")
    return value


def _notebook_entry(item: Any, base: Path) -> NotebookEntry:
    if isinstance(item, str):
        return NotebookEntry(_notebook_path(item, base))
    if isinstance(item, Mapping) and isinstance(item.get("path"), str):
        bad = [k for k in item if k not in ("path", "kernel", "label")]
        if bad:
            raise SpecError(f"unknown key `{bad[0]}` in a notebooks entry; use path, kernel, label")
        for key in ("kernel", "label"):
            if item.get(key) is not None and (not isinstance(item[key], str) or not item[key].strip()):
                raise SpecError(f"`{key}` of the notebooks entry {item['path']!r} must be a non-empty name "
                                f"(got {reprlib.repr(item[key])})")
        return NotebookEntry(_notebook_path(item["path"], base), item.get("kernel"), item.get("label"))
    raise SpecError(f"each `notebooks` entry is a path or {{path: ..., kernel: ...}} (got {reprlib.repr(item)})")


def _notebook_path(text: str, base: Path) -> Path:
    if not text.strip() or "\0" in text:
        raise SpecError(f"notebook path {reprlib.repr(text)} is not a file name")
    return (base / text).resolve()


def _all_frameworks() -> list[str]:
    from nbbatch.spec.frameworks import list_frameworks

    return list(list_frameworks())


def load_experiment(path: str | os.PathLike[str]) -> Experiment:
    """Read and validate an experiment YAML file."""
    path = Path(path)
    if not path.exists():
        raise SpecError(f"experiment file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise SpecError(f"{path} is not valid YAML: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise SpecError(f"{path} is not a text file: {exc}") from exc
    except (ValueError, RecursionError) as exc:  # e.g. an integer too long to read, nesting too deep
        raise SpecError(f"{path} cannot be read as an experiment: {type(exc).__name__}: {str(exc)[:200]}") from exc
    except OSError as exc:  # a folder, no permission
        raise SpecError(f"cannot read the experiment file {path}: {exc.strerror or exc}") from exc
    return Experiment.from_dict(data, base_dir=path.resolve().parent, default_name=path.stem)


def _positive(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0
