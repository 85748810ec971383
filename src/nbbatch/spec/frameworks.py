"""Frameworks are data: ``frameworks/<name>/framework.yaml`` plus its pinned requirements.

Adding a framework is a folder and a notebook; nothing here knows any framework by name.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from nbbatch.errors import ValidationError, did_you_mean
from nbbatch.spec.project import Project, find_project
from nbbatch.spec.resources import DISTRIBUTIONS
from nbbatch.spec.yaml_loader import load_yaml

FRAMEWORK_FILE = "framework.yaml"
_KNOWN_KEYS = {
    "title", "notebook", "requirements", "setup_requirements", "pip_options", "kernel_env",
    "shared_gpu_env", "gpu_memory_mb", "gpu", "image", "base_image", "description", "python",
    "gpu_packages", "gpu_pip_options", "system_packages", "distribution", "imports", "preload",
}
DEFAULT_PYTHON = "3.11"  # the Python of the environments and images, unless framework.yaml says `python:`
_PACKAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # the distribution name a pin line starts with
_SYSTEM_PACKAGE = re.compile(r"[a-z0-9][a-z0-9.+-]+")  # a Debian package name
# What a distribution type needs in the framework's image: one of these `system_packages`. An mpi job's ranks are
# started by mpirun from the image (Azure ML's MpiDistribution); without one the job fails at launch, after
# the image build and the nodes were paid for.
DISTRIBUTION_PACKAGES = {"mpi": ("openmpi-bin", "mpich")}


@dataclass(frozen=True)
class Framework:
    """One framework: its notebook, pinned environment, kernel variables and GPU facts."""

    name: str
    folder: Path
    title: str
    notebook: Path
    requirements: Path
    setup_requirements: tuple[str, ...] = ()
    pip_options: tuple[str, ...] = ()
    kernel_env: dict[str, str] = field(default_factory=dict)
    shared_gpu_env: dict[str, str] = field(default_factory=dict)
    gpu_memory_mb: int | None = None  # what one run of its notebook needs on a GPU, before any run measured it
    gpu: bool = False
    image: str | None = None
    base_image: str | None = None
    description: str = ""
    python: str = DEFAULT_PYTHON
    # The GPU build of a pinned package, installed instead at the same version where GPUs are wanted (the
    # images; `nbbatch envs create --gpu`): e.g. {"tensorflow-cpu": "tensorflow[and-cuda]"}.
    gpu_packages: dict[str, str] = field(default_factory=dict)
    gpu_pip_options: tuple[str, ...] = ()  # installer options for those builds (a wheel index of their own)
    system_packages: tuple[str, ...] = ()  # Debian/Ubuntu packages of the libraries its wheels load (in images)
    # The `distribution.type`s its notebook can run as (``[torch]``), or why it runs in one process only.
    distribution: tuple[str, ...] = ()
    no_distribution: str = ""
    # The modules a notebook imports that make it one of this framework's, when given by path (all of them).
    imports: tuple[str, ...] = ()
    # What a kernel started ahead of one of its runs imports before the run is given to it (no CUDA is touched).
    preload: tuple[str, ...] = ()

    @property
    def kernel_name(self) -> str:
        """The Jupyter kernel this framework's runs use."""
        return f"nbbatch-{self.name}"

    def pinned(self) -> list[str]:
        """The requirement lines of the pins file (comments and blanks dropped)."""
        lines = []
        for raw in self.requirements.read_text().splitlines():
            line = raw.split("#", 1)[0].strip()
            if line:
                lines.append(line)
        return lines

    def fingerprint(self, gpu: bool = False) -> str:
        """A hash of everything that shapes the environment: when it changes the env is stale.

        ``gpu``: of the environment with the framework's GPU builds (``gpu_packages``)."""
        digest = hashlib.sha256()
        parts = [
            self.requirements.read_bytes(),
            "\n".join(self.setup_requirements).encode(),
            "\n".join(self.pip_options).encode(),
            repr(sorted(self.kernel_env.items())).encode(),
        ]
        if gpu:
            parts += [repr(sorted(self.gpu_packages.items())).encode(), "\n".join(self.gpu_pip_options).encode()]
        for part in parts:
            digest.update(part)
            digest.update(b"\0")
        return digest.hexdigest()[:16]

    def requirement_lines(self, gpu: bool = False) -> list[str]:
        """The pins to install: with ``gpu``, each package of ``gpu_packages`` swapped for its GPU build."""
        lines = []
        for line in self.pinned():
            name = _PACKAGE.match(line)
            build = self.gpu_packages.get(normalized(name.group(0))) if gpu and name else None
            lines.append(build + line[name.end():] if name and build else line)
        return lines


def _load(folder: Path, project: Project) -> Framework:
    source = folder / FRAMEWORK_FILE
    try:
        # its variables are text, kept as written (TF_CPP_MIN_LOG_LEVEL: 2 gives "2")
        data: dict[str, Any] = load_yaml(source.read_text(), as_written=[("kernel_env",), ("shared_gpu_env",)]) or {}
    except yaml.YAMLError as exc:
        raise ValidationError(f"{source} is not valid YAML: {exc}") from exc
    unknown = set(data) - _KNOWN_KEYS
    if unknown:
        name = sorted(unknown)[0]
        raise ValidationError(f"{source}: unknown key `{name}`{did_you_mean(name, _KNOWN_KEYS)}")
    if "notebook" not in data:
        raise ValidationError(f"{source} must name its `notebook` (a path relative to the project)")
    requirements = folder / data.get("requirements", "requirements.txt")
    if not requirements.exists():
        raise ValidationError(f"{source}: its requirements file {requirements} does not exist")
    framework = Framework(
        name=folder.name,
        folder=folder,
        title=str(data.get("title", folder.name)),
        notebook=(project.root / data["notebook"]).resolve(),
        requirements=requirements,
        setup_requirements=tuple(data.get("setup_requirements") or ()),
        pip_options=tuple(data.get("pip_options") or ()),
        kernel_env={str(k): str(v) for k, v in (data.get("kernel_env") or {}).items()},
        shared_gpu_env={str(k): str(v) for k, v in (data.get("shared_gpu_env") or {}).items()},
        gpu_memory_mb=_memory_estimate(source, data.get("gpu_memory_mb")),
        gpu=bool(data.get("gpu", False)),
        image=data.get("image"),
        base_image=data.get("base_image"),
        description=str(data.get("description", "")),
        python=str(data.get("python", DEFAULT_PYTHON)),
        gpu_packages=_gpu_packages(source, data.get("gpu_packages")),
        gpu_pip_options=tuple(str(o) for o in data.get("gpu_pip_options") or ()),
        system_packages=_system_packages(source, data.get("system_packages")),
        **_distribution(source, data.get("distribution")),
        imports=_modules(source, "imports", data.get("imports")),
        preload=_modules(source, "preload", data.get("preload")),
    )
    _check_image_offers(source, framework)
    return framework


def _check_image_offers(source: Path, framework: Framework) -> None:
    """Refuse a distribution type whose launcher the framework's image would not hold (:data:`DISTRIBUTION_PACKAGES`)."""
    for kind in framework.distribution:
        needed = DISTRIBUTION_PACKAGES.get(kind, ())
        if needed and not set(needed) & set(framework.system_packages):
            raise ValidationError(
                f"{source}: `distribution` offers `{kind}`, but the framework's image would hold no {kind.upper()}: "
                f"{kind} ranks are started by mpirun from the image, so the job would fail at launch on Azure ML. Add "
                f"`{needed[0]}` (and `openssh-client`, mpirun's way to the other nodes) to `system_packages`, or drop "
                f"`{kind}` from `distribution`")




def _distribution(source: Path, value: Any) -> dict[str, Any]:
    """``distribution: [torch, mpi]`` (the types its notebook can run as) or a sentence saying why it cannot."""
    if value is None:
        return {}
    if isinstance(value, str):
        return {"no_distribution": value.strip()}
    if not isinstance(value, list) or not all(v in DISTRIBUTIONS for v in value):
        raise ValidationError(f"{source}: `distribution` must list types of {', '.join(DISTRIBUTIONS)} "
                              f"(e.g. [torch]) or be a sentence saying why it cannot run distributed; not {value!r}")
    return {"distribution": tuple(value)}


_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def _modules(source: Path, key: str, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(n, str) and _MODULE.fullmatch(n) for n in value):
        raise ValidationError(f"{source}: `{key}` must be a list of Python module names (e.g. [torch, flax]); not {value!r}")
    return tuple(value)


def _system_packages(source: Path, value: Any) -> tuple[str, ...]:
    names = tuple(str(p) for p in value or ())
    bad = [n for n in names if not _SYSTEM_PACKAGE.fullmatch(n)]
    if not isinstance(value, (list, type(None))) or bad:
        raise ValidationError(f"{source}: `system_packages` must be a list of Debian/Ubuntu package names "
                              f"(e.g. [libquadmath0]); not {bad[0] if bad else value!r}")
    return names


def _gpu_packages(source: Path, value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ValidationError(f"{source}: `gpu_packages` must map a pinned package to its GPU build, "
                              "e.g. {tensorflow-cpu: 'tensorflow[and-cuda]'}")
    return {normalized(k): v for k, v in value.items()}


def normalized(package: str) -> str:
    """A distribution name as package indexes compare them (PEP 503): ``Tensorflow_CPU`` → ``tensorflow-cpu``."""
    return re.sub(r"[-_.]+", "-", package).lower()


def _memory_estimate(source: Path, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValidationError(f"{source}: `gpu_memory_mb` must be a whole number of MiB > 0 (got {value!r})")
    return value


def list_frameworks(project: Project | None = None) -> dict[str, Framework]:
    """All frameworks of the project, by name."""
    project = project or find_project()
    return _frameworks_in(project.frameworks_dir, project)


def _frameworks_in(folder: Path, project: Project) -> dict[str, Framework]:
    if not folder.is_dir():
        return {}
    return {sub.name: _load(sub, project) for sub in sorted(folder.iterdir()) if (sub / FRAMEWORK_FILE).exists()}


# The frameworks nbbatch ships: its source tree's frameworks/ (a link in a checkout, package data in a wheel).
BUNDLED_FRAMEWORKS_DIR = Path(__file__).resolve().parent.parent / "frameworks"


def bundled_frameworks(own: Iterable[str] = ()) -> dict[str, Framework]:
    """The frameworks nbbatch ships, but for those named ``own`` (a project's frameworks override them by name):
    a notebook given by path, in any folder, is recognised against them (their GPU memory estimate, sharing
    variables and preload) after the project's own. Their ``notebook`` is not shipped: only their profile is used."""
    own = set(own)
    folder = BUNDLED_FRAMEWORKS_DIR
    return {name: fw for name, fw in _frameworks_in(folder, Project(folder.parent)).items() if name not in own}


def get_framework(name: str, project: Project | None = None) -> Framework:
    """The framework called ``name``, or an error listing the known ones."""
    project = project or find_project()
    frameworks = list_frameworks(project)
    if name not in frameworks:
        known = ", ".join(frameworks) or f"none: {project.frameworks_dir} has no */framework.yaml"
        raise ValidationError(f"unknown framework `{name}`{did_you_mean(name, frameworks)}; known frameworks: {known}")
    return frameworks[name]
