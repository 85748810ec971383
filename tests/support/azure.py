"""A project the azureml backend can plan and build jobs for: a toy GPU framework and the real Dockerfile template."""

from __future__ import annotations

import shutil
from pathlib import Path

from support.machine import REPO
from support.notebooks import make_notebook


def make_toy_azure_project(project: Path, cells: list[str], parameters: str) -> Path:
    """Add framework ``toy`` (its notebook: ``cells`` after a parameters cell holding ``parameters``) to ``project``."""
    fw = project / "frameworks" / "toy"
    fw.mkdir(parents=True)
    (fw / "framework.yaml").write_text("title: Toy\nnotebook: notebooks/Toy.ipynb\ngpu: true\n"
                                       "base_image: nvidia/cuda:12.8.1-base-ubuntu24.04\n")
    (fw / "requirements.txt").write_text("numpy==2.4.6\n")
    make_notebook(project / "notebooks" / "Toy.ipynb", cells, parameters=parameters)
    (project / "dockerfiles").mkdir()
    shutil.copy(REPO / "dockerfiles" / "Dockerfile", project / "dockerfiles" / "Dockerfile")  # the real template
    return project
