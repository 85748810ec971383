"""Fixtures and hooks only; helpers live in tests/support/ (``from support.notebooks import make_notebook``).

Every test runs with its framework caches inside the session's temp dir, never the home dir. A test that starts a
Jupyter kernel must carry the ``kernel`` marker, so that the unit tier (``make test-unit``) stays fast: one that
does not fails, saying so.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from jupyter_client.manager import KernelManager
from support.containers import build_chainer_image, build_pytorch_image, podman_session
from support.cputime import CpuTimes
from support.frameworks import env_build_lock, framework_envs  # noqa: F401 - framework_envs: a session fixture
from support.machine import REPO, gpu_count
from support.processes import TEST_SESSION_VAR
from support.raycluster import RayHead, ray_cluster
from support.registry import registry_session
from support.slurm import SlurmCluster, slurm_available

from nbbatch.execute.envs import build_env
from nbbatch.spec.frameworks import get_framework
from nbbatch.spec.project import Project

# The markers of tests that need an extra, and the modules that extra installs: skipped without them, so that the
# unit tier passes on `pip install -e '.[test]'` alone.
EXTRA_MARKERS = {"azure": ("azure.ai.ml", "azure.identity", "azure.storage.fileshare"),
                 "compare": ("pandas", "matplotlib", "nbdime", "jinja2")}
NOT_UNIT_TIERS = ("kernel", "slow", "browser", "ray", "container", "slurm")  # the markers `make test-unit` deselects
REFUSED_KERNELS = pytest.StashKey[list]()
UNMARKED_KERNEL = "this test starts a Jupyter kernel: mark it `kernel` (pytest.mark.kernel) so the unit tier skips it"


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory, monkeypatch):
    cache = tmp_path_factory.getbasetemp() / "caches"
    for var, sub in (("KERAS_HOME", "keras"), ("MPLCONFIGDIR", "mpl"), ("XDG_CACHE_HOME", "xdg"),
                     ("IPYTHONDIR", "ipython"), ("NBBATCH_CACHE_DIR", "nbbatch")):
        (cache / sub).mkdir(parents=True, exist_ok=True)
        monkeypatch.setenv(var, str(cache / sub))
    monkeypatch.setenv(TEST_SESSION_VAR, str(tmp_path_factory.getbasetemp()))  # see support.processes.kernels_of
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))  # each test's own per-user index


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Fail a test of the unit tier (no ``kernel`` marker, nor one of the tiers that `make test-unit` leaves out
    anyway) that launches a kernel, from its fixtures of any scope or its body: at once, and at teardown when the
    launch was in a background thread (see ``_kernel_launches_refused``). Kernels that a subprocess starts (the
    CLI) are not seen here: those tests are marked by hand."""
    if any(item.get_closest_marker(tier) for tier in NOT_UNIT_TIERS):
        return (yield)
    refused: list[str] = []
    item.stash[REFUSED_KERNELS] = refused

    async def refuse(self, kernel_cmd, **kw):
        refused.append(" ".join(map(str, kernel_cmd[:3])))
        pytest.fail(UNMARKED_KERNEL, pytrace=False)  # a BaseException: no `except Exception` of nbbatch's hides it

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(KernelManager, "_async_launch_kernel", refuse)
        return (yield)


@pytest.fixture(autouse=True)
def _kernel_launches_refused(request):
    """Fail the test at teardown when it launched a kernel without the marker (see pytest_runtest_protocol)."""
    yield
    refused = request.node.stash.get(REFUSED_KERNELS, [])
    if refused:
        pytest.fail(f"{UNMARKED_KERNEL} (it launched {refused[0]})", pytrace=False)


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
    from nbbatch.ui.widgets import jobs, submission  # the widgets extra

    (tmp_path / ".nbbatch").mkdir()
    monkeypatch.setenv("NBBATCH_PROJECT", str(tmp_path))
    monkeypatch.delenv("NBBATCH_WIDGETS", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(submission, "_SUBMISSIONS", {})
    monkeypatch.setattr(jobs, "_REFRESHERS", {})
    return tmp_path


@pytest.fixture
def write_experiment(project):
    """Write an experiment YAML into the project; returns its path."""
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
    project = Project(REPO)
    with env_build_lock():
        status = build_env(get_framework("pytorch", project), project)
    assert status.state == "ready"
    return status


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A real two-node Slurm cluster (munged, slurmctld, slurmd node1 and node2) for the whole session; skipped where
    not root or without Debian's slurm and munge. SLURM_CONF points at it for the rest of the session (set once
    here, not per test), so every sbatch/squeue the code under test runs talks to this cluster."""
    reason = slurm_available()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
            yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def _ray_session(tmp_path_factory):
    """The Ray cluster of :func:`ray_head`, started once per test session."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray is imported: servers on loopback
    ray = pytest.importorskip("ray")
    home = tmp_path_factory.mktemp("ray-home")
    env = {}
    for var in ("IPYTHONDIR", "MPLCONFIGDIR", "XDG_CACHE_HOME", "JUPYTER_RUNTIME_DIR"):  # kernels write here
        (home / var).mkdir(parents=True)
        env[var] = str(home / var)
    for started in ray_cluster("nbray-", num_gpus=2, env=env):
        yield RayHead.of(started, ray.nodes())


@pytest.fixture
def ray_head(_ray_session):
    """A real two-node Ray cluster on loopback (a head and a second node, 2 CPUs and 2 fake GPUs each: see
    support.raycluster), started once per session; this process is connected to it (again, when a module's own
    cluster took the connection meanwhile)."""
    import ray

    if not ray.is_initialized():
        ray.init(address=_ray_session.address, log_to_driver=False)
    return _ray_session


@pytest.fixture(scope="session")
def podman_env(tmp_path_factory):
    """Podman usable here: runc, ulimits this machine allows, and the Debian base image imported (support.containers);
    skipped where not root or without podman, runc and mmdebstrap."""
    yield from podman_session(tmp_path_factory)


@pytest.fixture(scope="session")
def chainer_image(podman_env):
    """The Chainer image, built by the CLI as a user builds it: once per session, for every test file."""
    return build_chainer_image()


@pytest.fixture(scope="session")
def image_registry(tmp_path_factory):
    """A registry on 127.0.0.1 (Debian's docker-registry), insecure for podman (support.registry); skipped where not
    root or without docker-registry."""
    yield from registry_session(tmp_path_factory)


@pytest.fixture(scope="session")
def pytorch_image(podman_env):
    """PyTorch's CPU image on the test base (distributed runs in containers): once per session."""
    return build_pytorch_image()


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


# Session fixtures that start something heavy and shared (podman's image store, a registry, a Slurm cluster, a Ray
# head): under pytest-xdist every test that uses one runs in the same worker, so each is started once per test
# session. A test whose fixture reaches one through request.getfixturevalue (the contract suites' harnesses), which
# fixturenames do not show, carries the group's marker instead (MARKED_GROUPS).
SHARED_FIXTURE_GROUPS = (({"podman_env", "chainer_image", "pytorch_image", "image_registry"}, "podman"),
                         ({"slurm_cluster"}, "slurm"), ({"ray_head", "_ray_session"}, "ray"))
# Tests that reach a cluster through request.getfixturevalue (the contract suites' harnesses), or podman's image
# store without its fixtures, by their marker.
MARKED_GROUPS = {"container": "podman", "slurm": "slurm", "ray": "ray"}


def _xdist_group(item: pytest.Item) -> str | None:
    """The worker group of a test: its heavy session fixture's (by the fixtures it names, else by its marker), else its
    file's when it uses a module fixture (so that starts once), else none (any worker)."""
    used = set(getattr(item, "fixturenames", ()))
    for fixtures, group in SHARED_FIXTURE_GROUPS:
        if used & fixtures:
            return group
    for marker, group in MARKED_GROUPS.items():
        if item.get_closest_marker(marker):
            return group
    definitions = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    if any(d.scope == "module" for defs in definitions.values() for d in defs):
        return item.nodeid.split("::")[0]
    return None


class _GroupsTakeEffect:
    """Fails the run at collection when pytest-xdist's ``loadgroup`` cannot see the groups: it marks a grouped test by
    rewriting its node id, which pytest 9.2 no longer reads, and then every heavy group silently spreads over every
    worker (two Slurm clusters, a registry test removing the image a Ray test runs in)."""

    @pytest.hookimpl(trylast=True)  # after pytest-xdist's worker hook has marked the node ids
    def pytest_collection_modifyitems(self, config, items):
        if not getattr(config.option, "loadgroup", False):  # set in pytest-xdist's workers only
            return
        for item in items:
            if (mark := item.get_closest_marker("xdist_group")) and "@" not in item.nodeid.rpartition("]")[2]:
                raise pytest.UsageError(f"pytest-xdist did not group {item.nodeid} ({mark.args[0]}): this pytest and "
                                        "pytest-xdist do not work together; install the versions pyproject.toml pins")


def pytest_configure(config):
    config.pluginmanager.register(_GroupsTakeEffect(), "nbbatch-xdist-groups")
    config.pluginmanager.register(CpuTimes(), "nbbatch-cpu-times")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (`--dist loadgroup`)
def pytest_collection_modifyitems(config, items):
    """Skip `gpu` tests without a GPU and tests of an extra without it; give each test its xdist group, and put the
    heavy groups first: each runs in one worker, one test after another, so they must start at once (the other
    workers share out the rest meanwhile)."""
    heavy = [group for _fixtures, group in SHARED_FIXTURE_GROUPS]
    groups = {}
    for item in items:
        if group := _xdist_group(item):
            item.add_marker(pytest.mark.xdist_group(group))
        groups[item.nodeid] = group
    items.sort(key=lambda item: heavy.index(groups[item.nodeid]) if groups[item.nodeid] in heavy else len(heavy))
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU (NVML found none)")
    missing = {marker: pytest.mark.skip(reason=f"needs the {marker} extra: pip install 'nbbatch[{marker}]'")
               for marker, modules in EXTRA_MARKERS.items() if not all(map(_installed, modules))}
    has_gpu = None
    for item in items:
        if "gpu" in item.keywords:
            if has_gpu is None:
                has_gpu = gpu_count() > 0
            if not has_gpu:
                item.add_marker(skip_gpu)
        for marker, skip in missing.items():
            if marker in item.keywords:
                item.add_marker(skip)
