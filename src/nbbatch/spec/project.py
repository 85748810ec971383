"""Where a project keeps things: framework data, environments, kernels, results.

The project root is ``NBBATCH_PROJECT`` when set, else the nearest folder holding ``frameworks/`` or
``.nbbatch/``: from the experiment file's folder up, then from the working directory up; everything
nbbatch creates stays inside it, never in the user's home.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Project:
    """Paths of one nbbatch project."""

    root: Path

    @property
    def frameworks_dir(self) -> Path:
        return Path(os.environ.get("NBBATCH_FRAMEWORKS_DIR") or self.root / "frameworks")

    @property
    def state_dir(self) -> Path:
        return self.root / ".nbbatch"

    @property
    def envs_dir(self) -> Path:
        return Path(os.environ.get("NBBATCH_ENVS_DIR") or self.state_dir / "envs")

    @property
    def jupyter_dir(self) -> Path:
        """The project-local Jupyter data dir whose ``kernels/`` holds the framework kernels."""
        return Path(os.environ.get("NBBATCH_JUPYTER_DIR") or self.state_dir / "jupyter")

    @property
    def cache_dir(self) -> Path:
        """Downloads kept between commands (uv's binary for the images)."""
        return Path(os.environ.get("NBBATCH_CACHE_DIR") or self.state_dir / "cache")

    @property
    def results_dir(self) -> Path:
        return self.root / "results"

    def activate_kernels(self) -> None:
        """Make the project's kernels visible to jupyter_client in this process (and its children)."""
        path = str(self.jupyter_dir)
        current = [p for p in os.environ.get("JUPYTER_PATH", "").split(os.pathsep) if p]
        if path not in current:
            os.environ["JUPYTER_PATH"] = os.pathsep.join([path, *current])


def find_project(start: str | os.PathLike[str] | None = None) -> Project:
    """The project that ``start`` (default: the working directory) belongs to."""
    if os.environ.get("NBBATCH_PROJECT"):
        return Project(Path(os.environ["NBBATCH_PROJECT"]).resolve())
    here = Path(start or os.getcwd()).resolve()
    # An experiment file kept outside any project belongs to the project the command runs in.
    for origin in (here, Path.cwd().resolve()) if start else (here,):
        for folder in (origin, *origin.parents):
            if (folder / "frameworks").is_dir() or (folder / ".nbbatch").is_dir():
                return Project(folder)
    return Project(here)
