"""Shared fixtures: a throwaway project with tiny notebooks run in the test venv's `python3` kernel,
and caches of frameworks (Keras, paddle…) pointed inside the test's temp dir, never the home dir."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest_frameworks import framework_envs  # noqa: E402, F401 - the session fixture of the notebook tests


def make_notebook(path: Path, cells: list[str], parameters: str | None = "A = 1\nB = 'x'", kernel: str = "python3",
                  extra_parameter_cells: int = 0) -> Path:
    """Write a notebook whose first cell (tagged `parameters`) is ``parameters``, then ``cells``."""
    nb = nbformat.v4.new_notebook()
    if parameters is not None:
        for _ in range(1 + extra_parameter_cells):
            cell = nbformat.v4.new_code_cell(parameters)
            cell.metadata["tags"] = ["parameters"]
            nb.cells.append(cell)
    nb.cells.extend(nbformat.v4.new_code_cell(src) for src in cells)
    nb.metadata["kernelspec"] = {"name": kernel, "display_name": kernel, "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


def kernels_of(experiment: str, wait: float = 15.0) -> list[int]:
    """Processes still running for runs of ``experiment`` (kernels carry NBBATCH_EXPERIMENT), after waiting up to
    ``wait`` seconds for them to go."""
    import time

    import psutil

    deadline = time.time() + wait
    while True:
        found = []
        for process in psutil.process_iter():
            try:
                if (process.pid != os.getpid() and process.status() != psutil.STATUS_ZOMBIE
                        and process.environ().get("NBBATCH_EXPERIMENT") == experiment):
                    found.append(process.pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        if not found or time.time() > deadline:
            return found
        time.sleep(0.2)


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory, monkeypatch):
    cache = tmp_path_factory.getbasetemp() / "caches"
    for var, sub in (("KERAS_HOME", "keras"), ("MPLCONFIGDIR", "mpl"), ("XDG_CACHE_HOME", "xdg"),
                     ("IPYTHONDIR", "ipython"), ("NBBATCH_CACHE_DIR", "nbbatch")):
        (cache / sub).mkdir(parents=True, exist_ok=True)
        monkeypatch.setenv(var, str(cache / sub))


@pytest.fixture
def project(tmp_path, monkeypatch):
    """An empty nbbatch project (its own frameworks/ and .nbbatch/) as the working directory."""
    root = tmp_path / "proj"
    (root / "frameworks").mkdir(parents=True)
    (root / ".nbbatch").mkdir()
    monkeypatch.chdir(root)
    monkeypatch.delenv("NBBATCH_PROJECT", raising=False)
    return root


@pytest.fixture
def widget_project(tmp_path, monkeypatch):
    """A project folder of its own (registry, results) as the working directory, widgets in text mode, no
    submissions or refreshers left from another test."""
    from nbbatch.ui.widgets import jobs, submission

    (tmp_path / ".nbbatch").mkdir()
    monkeypatch.setenv("NBBATCH_PROJECT", str(tmp_path))
    monkeypatch.delenv("NBBATCH_WIDGETS", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(submission, "_SUBMISSIONS", {})
    monkeypatch.setattr(jobs, "_REFRESHERS", {})
    return tmp_path


@pytest.fixture
def write_experiment(project):
    def write(text: str, name: str = "exp.yaml") -> Path:
        path = project / name
        path.write_text(text)
        return path

    return write


@pytest.fixture(scope="session")
def repo_project():
    """The repository itself as the project (its frameworks/, notebooks/ and .nbbatch/envs)."""
    return REPO


@pytest.fixture(scope="session")
def pytorch_env():
    """The real `pytorch` framework env of the repository, built once per test session."""
    from nbbatch.execute.envs import build_env
    from nbbatch.spec.frameworks import get_framework
    from nbbatch.spec.project import Project

    project = Project(REPO)
    status = build_env(get_framework("pytorch", project), project)
    assert status.state == "ready"
    return status


def gpu_count() -> int:
    from nbbatch.execute.gpus import detect_gpus

    return len(detect_gpus())


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (NVML found none)")
    has_gpu = None
    for item in items:
        if "gpu" in item.keywords:
            if has_gpu is None:
                has_gpu = gpu_count() > 0
            if not has_gpu:
                item.add_marker(skip_gpu)


def chromium_path() -> str | None:
    return shutil.which("chromium") or (os.path.exists("/usr/bin/chromium") and "/usr/bin/chromium") or None
