"""The ``framework_envs`` session fixture: framework environments built once per test session.

tests/conftest.py imports it (``from support.frameworks import framework_envs  # noqa: F401``).
The first test that asks for it builds, two at a time, the environments of every framework that the
session's collected tests name in a ``framework`` parameter (``@pytest.mark.parametrize("framework",
...)``), then makes their kernels visible to jupyter_client. Environments that are already built from
their current pins are reused (``build_env`` is idempotent). A failed build fails only the tests of that
framework, with the path of its build log.

``NBBATCH_TEST_FRAMEWORKS=pytorch,jax-flax`` limits the slow notebook tests to those frameworks.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest

from nbbatch.backends.local.cores import THREAD_VARIABLES
from nbbatch.errors import NbbatchError
from nbbatch.execute.envs import build_env, env_status
from nbbatch.spec.frameworks import Framework, list_frameworks
from nbbatch.spec.project import Project
from support.machine import REPO

BUILD_PARALLEL = 2  # the test machines have two cores, and pip is CPU-bound


def one_thread_each() -> dict[str, str]:
    """What a kernel's environment gets so that it starts one compute thread: the tests run several kernels at once
    on CI's two cores, and a kernel that sizes its pools to every core runs about 1.6 times slower beside the others
    (the PyTorch notebook on digits: 59 s with its own pools, 36 s with one thread, on a loaded 2-core machine). The
    thread variables nbbatch sets for a CPU run's share of the cores, and XLA's Eigen pool (JAX) off."""
    return {**{name: "1" for name in THREAD_VARIABLES}, "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"}


def selected_frameworks(all_names: Iterable[str]) -> list[str]:
    """The frameworks the slow notebook tests cover: all, or those in NBBATCH_TEST_FRAMEWORKS."""
    names = sorted(all_names)
    wanted = [n.strip() for n in os.environ.get("NBBATCH_TEST_FRAMEWORKS", "").split(",") if n.strip()]
    return [n for n in names if n in wanted] if wanted else names


@contextmanager
def env_build_lock() -> Iterator[None]:
    """Hold the repository's env-build lock: parallel test processes (pytest-xdist) build the shared framework
    envs one after the other, and a later one finds them built (``build_env`` is idempotent)."""
    lock = REPO / ".nbbatch" / "test-env-build.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released by the OS if this process dies
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@dataclass
class FrameworkEnvs:
    """Built environments by framework name; ``kernel(name)`` fails the test if its build failed."""

    project: Project
    frameworks: dict[str, Framework]
    errors: dict[str, str] = field(default_factory=dict)

    def build(self, names: Iterable[str]) -> None:
        todo = [n for n in dict.fromkeys(names) if n in self.frameworks and n not in self.errors]

        def one(name: str) -> None:
            try:
                build_env(self.frameworks[name], self.project)
            except NbbatchError as exc:
                self.errors[name] = str(exc)

        with env_build_lock(), ThreadPoolExecutor(max_workers=BUILD_PARALLEL) as pool:
            list(pool.map(one, todo))

    def framework(self, name: str) -> Framework:
        if name not in self.frameworks:
            pytest.fail(f"no framework `{name}` in {self.project.frameworks_dir}")
        if name in self.errors:
            pytest.fail(self.errors[name])
        status = env_status(self.frameworks[name], self.project)
        if status.state != "ready":
            self.build([name])
            if name in self.errors:
                pytest.fail(self.errors[name])
        return self.frameworks[name]

    def kernel(self, name: str) -> str:
        return self.framework(name).kernel_name


@pytest.fixture(scope="session")
def framework_envs(request) -> FrameworkEnvs:
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("NBBATCH_FRAMEWORKS_DIR", raising=False)
        project = Project(REPO)
        frameworks = list_frameworks(project)
    envs = FrameworkEnvs(project, frameworks)
    needed = []
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if callspec and "framework_envs" in getattr(item, "fixturenames", ()):
            name = callspec.params.get("framework")
            if isinstance(name, str):
                needed.append(name)
    envs.build(needed)
    project.activate_kernels()  # JUPYTER_PATH for this process and the kernels it starts
    return envs
