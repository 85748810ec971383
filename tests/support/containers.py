"""Podman for the tests that run framework images for real (``-m container``): one setup and one Chainer image build
per test session, shared by every test file (the ``podman_env`` and ``chainer_image`` fixtures of tests/conftest.py).

The image's base is a Debian 12 minbase with Python 3.11 made by mmdebstrap (no registry is reachable in CI); its
tarball is kept between test runs. Podman's settings for such a machine (runc; the ulimits it may set) go in a
private CONTAINERS_CONF, set for the whole session (and so for the Slurm jobs the tests submit: sbatch passes the
environment on).
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from nbbatch.containers.images import ImageSpec, image_spec
from nbbatch.spec.frameworks import list_frameworks
from nbbatch.spec.project import Project
from support.machine import REPO
from support.processes import kernels_of
from support.waiting import wait_until

BASE = "localhost/nbbatch-test-base:bookworm"  # Debian 12 minbase with Python 3.11, made by mmdebstrap
BASE_TARBALL = REPO / ".nbbatch" / "test-cache" / "base-bookworm.tar"  # kept between test runs
MIRROR = "http://deb.debian.org/debian"


def on_cluster(cluster: pytest.MarkDecorator) -> Callable[[Callable], Callable]:
    """The marks of a test that runs containers on a cluster (``cluster``: pytest.mark.ray or .slurm)."""
    def marked(test: Callable) -> Callable:
        for mark in (cluster, pytest.mark.container, pytest.mark.kernel, pytest.mark.timeout(600)):
            test = mark(test)
        return test
    return marked


def chainer_experiment(tmp_path: Path, name: str, backend: dict, **parameters) -> Path:
    """An experiment file of the Chainer digits notebook (one short run) on ``backend``, its share in ``tmp_path``."""
    spec = {"experiment": name, "frameworks": ["chainer"],
            "parameters": {"DATASET": "digits", "EPOCHS": 1, "MAX_SAMPLES": 200, **parameters},
            "backend": backend, "share": str(tmp_path / "share")}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def nothing_left(experiment: str) -> None:
    """No container and no kernel of ``experiment`` is left (containers are removed within a minute)."""
    wait_until(lambda: not containers_labelled("nbbatch.experiment", experiment), timeout=60,
               message=f"the containers of {experiment} gone", interval=0.5)
    assert kernels_of(experiment) == []


def podman_missing() -> str:
    """Why the real image tests cannot run here, or an empty string when they can."""
    if os.geteuid() != 0:
        return "needs root (rootful podman; mmdebstrap --mode=root)"
    absent = [tool for tool in ("podman", "runc", "mmdebstrap") if not shutil.which(tool)]
    return f"needs {', '.join(absent)} (apt-get install podman runc mmdebstrap)" if absent else ""


def podman(*args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run ``podman`` with these arguments, its output captured; with ``check``, a failure says what podman said."""
    done = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited with {done.returncode}: {(done.stderr or done.stdout)[-2000:]}")
    return done


def nbbatch_cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """Run the ``nbbatch`` command line of this venv, its output captured."""
    return subprocess.run([sys.executable, "-m", "nbbatch", *args], capture_output=True, text=True, timeout=timeout)


def containers_labelled(label: str, value: str) -> list[str]:
    """The names of the containers (running or not) carrying ``label=value``."""
    done = podman("ps", "--all", "--filter", f"label={label}={value}", "--format", "{{.Names}}")
    return done.stdout.split()


def podman_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The ``podman_env`` fixture: podman usable here (runc, ulimits this machine allows, the Debian base image
    imported), the repository as the project; yields the containers.conf. Skips with the reason where it cannot."""
    if why := podman_missing():
        pytest.skip(why)
    nofile_soft, nofile_hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    nproc = 32768 if nproc == resource.RLIM_INFINITY else min(nproc, 32768)
    conf = tmp_path_factory.mktemp("podman") / "containers.conf"
    conf.write_text(f'[containers]\ndefault_ulimits = ["nofile={nofile_soft}:{nofile_hard}", "nproc={nproc}:{nproc}"]\n'
                    '[engine]\nruntime = "runc"\nevents_logger = "file"\n')
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CONTAINERS_CONF", str(conf))
        patch.setenv("NBBATCH_PROJECT", str(REPO))
        for name in ("NBBATCH_FRAMEWORKS_DIR", "NBBATCH_ENVS_DIR", "NBBATCH_JUPYTER_DIR"):
            patch.delenv(name, raising=False)
        if podman("image", "exists", BASE, check=False).returncode != 0:
            if not BASE_TARBALL.is_file():
                BASE_TARBALL.parent.mkdir(parents=True, exist_ok=True)
                part = BASE_TARBALL.with_suffix(".part")
                subprocess.run(["mmdebstrap", "--variant=minbase", "--include=python3,ca-certificates,libgomp1",
                                "--mode=root", "--format=tar", "bookworm", str(part), MIRROR],
                               check=True, capture_output=True, timeout=900)
                part.rename(BASE_TARBALL)
            podman("import", str(BASE_TARBALL), BASE)
        yield conf


def build_chainer_image() -> ImageSpec:
    """The ``chainer_image`` fixture: the Chainer image on the test base, built by the CLI as a user builds it."""
    spec = image_spec(list_frameworks(Project(REPO))["chainer"], REPO / "dockerfiles", base=BASE)
    done = nbbatch_cli("images", "build", "chainer", "--base", BASE, "--engine", "podman", "-q")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"chainer: ready ({spec.ref}" in done.stdout
    return spec


def build_pytorch_image() -> ImageSpec:
    """The ``pytorch_image`` fixture: PyTorch's CPU image (``--cpu``: the pins as the venv has them) on the test base,
    with the Debian packages framework.yaml asks for (``system_packages``, installed by the build), for distributed
    runs in containers. The folders of PIP_FIND_LINKS go in as its wheelhouse (``--find-links``): where one holds
    torch's CPU wheel, the image takes it instead of PyPI's Linux wheel and its 4 GB of CUDA libraries."""
    spec = image_spec(list_frameworks(Project(REPO))["pytorch"], REPO / "dockerfiles", gpu=False, base=BASE)
    wheelhouse = [arg for folder in os.environ.get("PIP_FIND_LINKS", "").split()
                  if Path(folder).is_dir() and any(Path(folder).glob("*.whl")) for arg in ("--find-links", folder)]
    done = nbbatch_cli("images", "build", "pytorch", "--cpu", "--base", BASE, "--engine", "podman", "-q",
                       *wheelhouse, timeout=1800)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"pytorch: ready ({spec.ref}" in done.stdout
    return spec
