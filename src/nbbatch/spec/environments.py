"""Framework environments as the plan sees them: where each lives and whether it is built from the current pins.

Reading this needs nothing but the files (the marker nbbatch writes into an env it built), so the plan can
refuse a stale env before anything runs; building envs is :mod:`nbbatch.execute.envs`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nbbatch.errors import EnvironmentNotReady
from nbbatch.spec.frameworks import Framework, list_frameworks
from nbbatch.spec.project import Project, find_project

__all__ = ["MARKER", "EnvStatus", "env_path", "env_python", "env_status", "kernel_dir", "list_envs", "require_ready"]

MARKER = "nbbatch-env.json"


@dataclass(frozen=True)
class EnvStatus:
    """The state of one framework's environment."""

    framework: str
    state: str  # ready | stale | missing
    path: Path
    kernel: str
    fingerprint: str
    built_fingerprint: str | None = None
    built_at: str | None = None
    gpu: bool = False  # built with the framework's GPU builds (``nbbatch envs create --gpu``)

    @property
    def fix_command(self) -> str:
        return f"nbbatch envs create {self.framework}"


def env_path(framework: Framework, project: Project) -> Path:
    return project.envs_dir / framework.name


def env_python(path: Path) -> Path:
    return path / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def kernel_dir(framework: Framework, project: Project) -> Path:
    return project.jupyter_dir / "kernels" / framework.kernel_name


def env_status(framework: Framework, project: Project | None = None) -> EnvStatus:
    """Whether ``framework``'s env is built from its current pins."""
    project = project or find_project()
    path = env_path(framework, project)
    marker = path / MARKER
    built: dict[str, Any] = {}
    if marker.exists():
        try:
            built = json.loads(marker.read_text())
        except ValueError:
            built = {}
    fingerprint = framework.fingerprint(gpu=bool(built.get("gpu")))  # an env built with --gpu stays one
    if not built or not env_python(path).exists() or not (kernel_dir(framework, project) / "kernel.json").exists():
        state = "missing"
    elif built.get("fingerprint") != fingerprint:
        state = "stale"
    else:
        state = "ready"
    return EnvStatus(framework.name, state, path, framework.kernel_name, fingerprint,
                     built.get("fingerprint"), built.get("built_at"), bool(built.get("gpu")))


def list_envs(project: Project | None = None) -> list[EnvStatus]:
    """The env status of every framework in the project."""
    project = project or find_project()
    return [env_status(fw, project) for fw in list_frameworks(project).values()]


def require_ready(framework: Framework, project: Project) -> EnvStatus:
    """Raise a clear error naming the fix when ``framework``'s env is not ready."""
    status = env_status(framework, project)
    if status.state == "missing":
        raise EnvironmentNotReady(
            f"the environment for framework `{framework.name}` is not built ({status.path}). "
            f"Build it with `{status.fix_command}`, or pass --build-envs to submit."
        )
    if status.state == "stale":
        raise EnvironmentNotReady(
            f"the environment for framework `{framework.name}` is stale: its pins changed since it was built "
            f"({status.built_fingerprint} → {status.fingerprint}). Rebuild it with `{status.fix_command}`, "
            "or pass --build-envs to submit."
        )
    return status
