"""``backend: {name: ray, container: true}``: each run's task starts ``nbbatch run-one`` on its Ray node, which starts
the run in its framework's image with podman (the runner of local containers and of the slurm backend's).

The real tests run the Chainer digits notebook on a two-node Ray cluster on loopback (a head and a second node started
here, by PID stopped at the end), in the Chainer image built once per session (tests/support/containers.py), and a
2-node gloo DDP run of the PyTorch notebook in its CPU image, one container per node; both nodes are this host, so
the images built here are on every node. They are skipped where not root, or without podman, runc and mmdebstrap.
The refusals before anything starts are unit tests.
"""

from __future__ import annotations

import os

# Before Ray is imported: Ray then binds its servers to loopback (see tests/test_ray_backend.py).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import json  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import nbformat  # noqa: E402
import pytest  # noqa: E402
import yaml  # noqa: E402
from support.containers import (  # noqa: E402
    BASE,
    chainer_experiment,
    containers_labelled,
    nothing_left,
    on_cluster,
    podman,
)
from support.machine import REPO  # noqa: E402
from support.raycluster import ray_cluster  # noqa: E402
from support.registry import pushed_elsewhere  # noqa: E402
from support.shares import ShareDouble  # noqa: E402
from support.waiting import wait_until  # noqa: E402

from nbbatch import api  # noqa: E402
from nbbatch.backends.base import SubmitOptions  # noqa: E402
from nbbatch.backends.ray import NAMESPACE, RayBackend, supervisor_name  # noqa: E402
from nbbatch.backends.ray.node import run_one_command, task_launch  # noqa: E402
from nbbatch.errors import ContainerError, ValidationError  # noqa: E402
from nbbatch.metrics import metrics_from_notebook  # noqa: E402
from nbbatch.plan.runs import Run  # noqa: E402
from nbbatch.store.runfiles import load_records  # noqa: E402
from nbbatch.store.share import FileShare  # noqa: E402
from nbbatch.ui.cli import build_parser  # noqa: E402

LONG = {"EPOCHS": 500, "MAX_SAMPLES": 1000}  # runs until it is stopped
TAG = "localhost/nbbatch/chainer:abc"


def _run(framework: str | None = "chainer", **fields) -> Run:
    notebook = REPO / "notebooks" / "Chainer_CIFAR.ipynb"
    return Run("r1", "e", str(notebook), "notebooks/Chainer_CIFAR.ipynb", "nbbatch-chainer", framework=framework,
               **fields)


# --- before anything starts ---------------------------------------------------------------------------------


def test_the_task_starts_run_one_in_the_runs_image(tmp_path):
    """The task's launch names the run's image and the engine; run-one's parser takes it; the GPUs are Ray's."""
    backend = RayBackend(container=True, engine="podman")
    assert backend.capabilities.containers and not RayBackend().capabilities.containers
    spec = backend.task_spec(_run(), FileShare(tmp_path), SubmitOptions(), "/proj", {"chainer": TAG, "jax": "j:1"})
    assert spec.container_images == {"chainer": TAG} and spec.container_engine == "podman"
    launch = task_launch(spec.to_dict(), spec.run, [2, 3])
    assert launch.container_images == {"chainer": TAG} and launch.container_engine == "podman" and launch.gpus == (2, 3)
    cmd, _cwd = run_one_command(spec.to_dict(), tmp_path / "launch.json")
    assert build_parser().parse_args(cmd[3:]).launch == str(tmp_path / "launch.json")  # run-one's parser takes it
    plain = RayBackend().task_spec(_run(), FileShare(tmp_path), SubmitOptions(), "/proj")
    assert not task_launch(plain.to_dict(), plain.run, []).container_images


def test_a_run_of_no_framework_is_refused():
    with pytest.raises(ValidationError, match="belongs to no framework; list it under `frameworks:`"):
        RayBackend(container=True).check([_run(framework=None)])


def test_a_share_that_is_not_a_folder_is_refused(tmp_path):
    remote = ShareDouble(tmp_path, remote=True, url="azfiles://account/results")
    with pytest.raises(ContainerError, match=r"bind-mounts the share.*azfiles://account/results is not a folder"):
        RayBackend(container=True).check_share(remote)


@pytest.mark.container
def test_an_image_not_built_here_is_refused_before_submit(podman_env):
    """The image is looked for where `submit` runs; the error names the build and that every node needs it too."""
    with pytest.raises(ContainerError, match=r"nbbatch images build chainer --base localhost/none:x.*every node needs"):
        RayBackend(container=True, base_image="localhost/none:x").check([_run()])


# --- on a Ray cluster ----------------------------------------------------------------------------------------


real = on_cluster(pytest.mark.ray)  # a test on the Ray cluster, in the Chainer image


@pytest.fixture(scope="module")
def podman_ray_head(podman_env, image_registry):
    """A Ray head and a second node on 127.0.0.1 with 2 CPUs each, started with podman's settings in their
    environment (as a node's: containers.conf, and registries.conf marking the test registry insecure); the head's
    address."""
    pytest.importorskip("ray")
    for cluster in ray_cluster("nbray-ctr-"):
        yield cluster.address


def _experiment(tmp_path: Path, address: str, name: str, registry: str | None = None, **parameters) -> Path:
    backend = {"name": "ray", "address": address, "container": True, "base_image": BASE, "linger_s": 5,
               "cancel_grace_s": 60, **({"registry": registry} if registry else {})}
    return chainer_experiment(tmp_path, name, backend, **parameters)


def _final(share: Path, name: str):
    [record] = wait_until(lambda: [r for r in api.status(name, share=str(share)) if r.final], timeout=120,
                          message=f"{name} final", interval=0.5)
    return record


@real
def test_a_run_executes_in_its_image_on_a_ray_node(podman_ray_head, chainer_image, tmp_path):
    share = tmp_path / "share"
    result = api.submit(str(_experiment(tmp_path, podman_ray_head, "ray-ctr")), wait=True, progress=False)
    [record] = result.records
    assert record.status == "succeeded", record.error
    assert record.backend == "ray" and record.metrics["accuracy"] > 0
    image_id = podman("image", "inspect", "--format", "{{.Id}}", chainer_image.ref).stdout.strip()
    assert record.container.engine == "podman" and record.container.image == chainer_image.ref
    assert record.container.image_id == image_id and record.container.name.startswith("nbbatch-")
    assert "in podman image " + chainer_image.ref in (share / "ray-ctr" / record.run_id / "log.txt").read_text()
    nothing_left("ray-ctr")


@real
def test_a_node_pulls_the_image_from_the_registry_and_runs_in_it(podman_ray_head, chainer_image, image_registry, tmp_path):
    """With `registry:` the task names the registry's tag, which the node lacks: its run-one pulls it, then runs."""
    with pushed_elsewhere(chainer_image, f"{image_registry.address}/ray") as remote:
        path = _experiment(tmp_path, podman_ray_head, "ray-reg", registry=f"{image_registry.address}/ray")
        [record] = api.submit(str(path), wait=True, progress=False).records
        assert record.status == "succeeded", record.error and record.error.evalue
        assert record.container.image == remote
        assert record.container.image_id == podman("image", "inspect", "--format", "{{.Id}}", remote).stdout.strip()
    nothing_left("ray-reg")


@real
def test_cancel_and_a_killed_task_leave_no_container(podman_ray_head, chainer_image, tmp_path):
    """``nbbatch cancel`` reaches the run inside its container through the share's cancel marker (it ends itself,
    well within the grace before its task is killed). A task Ray kills (``ray.cancel(force=True)``, as the supervisor
    does past the grace) takes run-one with it by SIGKILL, before it can stop its container: the task's watcher,
    outside the worker, stops it."""
    share = tmp_path / "share"
    fs = FileShare(share)
    names = ("ray-ctr-cancel", "ray-ctr-kill")
    for name in names:
        api.submit(str(_experiment(tmp_path, podman_ray_head, name, **LONG)), wait=False, progress=False)
    running = {name: wait_until(lambda n=name: next((r for r in load_records(fs, n)[0]
                                                      if r.status == "running" and r.cells_done >= 2), None),
                                timeout=300, message=f"{name} running", interval=0.5) for name in names}
    for name in names:
        assert len(containers_labelled("nbbatch.experiment", name)) == 1

    api.cancel("ray-ctr-cancel", share=str(share))
    cancelled = _final(share, "ray-ctr-cancel")
    assert cancelled.status == "cancelled", cancelled.error

    import ray

    supervisor = ray.get_actor(supervisor_name("ray-ctr-kill", FileShare(share)), namespace=NAMESPACE)
    ray.get(supervisor.cancel.remote([running["ray-ctr-kill"].run_id], 0), timeout=60)  # no marker: Ray kills it
    killed = _final(share, "ray-ctr-kill")
    # the supervisor records the cancelled task; where the run wrote its record again before its container was
    # stopped, the watcher ends it (no cancel marker here: failed, saying the task's worker ended), and where the run
    # was still alive when the watcher stopped its container, the run records the stop itself (the SIGTERM that
    # `podman stop` gives the container's first process, its launcher)
    assert (killed.status, killed.error.ename) in {("cancelled", "cancelled"), ("failed", "RayWorkerEnded")}, \
        killed.error
    assert ("Ray task was stopped" in killed.error.reason
            or killed.error.stopped_by == "SIGTERM to its launcher"), killed.error
    for name in names:
        nothing_left(name)
        assert podman("ps", "--all", "--quiet", "--filter", f"label=nbbatch.experiment={name}",
                      "--filter", f"label=nbbatch.run={running[name].run_id}").stdout == ""


@real
def test_an_image_missing_on_the_node_fails_the_run_naming_the_node(podman_ray_head, chainer_image, tmp_path, monkeypatch):
    """Where the image is here but not on the node (faked: the submit-side lookup answers a tag nobody built), the
    node's run-one fails the run at once, naming the node; run.json and `nbbatch status` say so."""
    missing = "localhost/nbbatch/chainer:on-no-node"
    monkeypatch.setattr("nbbatch.containers.checks.framework_images", lambda engine, runs, **_: {"chainer": (missing, "")})
    share = tmp_path / "share"
    [record] = api.submit(str(_experiment(tmp_path, podman_ray_head, "ray-ctr-missing")), wait=True, progress=False).records
    assert record.status == "failed" and record.backend == "ray"
    assert f"the image {missing} is not on node {socket.gethostname()}" in record.error.evalue
    assert "its container could not start on node" in record.error.reason
    shown = subprocess.run([sys.executable, "-m", "nbbatch", "status", "ray-ctr-missing", "--share", str(share)],
                           capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "400"})
    said = " ".join(shown.stdout.split())
    assert "failed" in said and f"is not on node {socket.gethostname()}" in said, shown.stdout + shown.stderr
    nothing_left("ray-ctr-missing")


@real
def test_a_two_node_gang_runs_one_container_per_node_with_equal_weights(podman_ray_head, pytorch_image, tmp_path):
    """The PyTorch notebook, 2 ranks over gloo, one per Ray node (a STRICT_SPREAD gang): each node's task starts its
    node's container; DDP keeps the replicas equal across them; no container is left."""
    backend = {"name": "ray", "address": podman_ray_head, "container": True, "cpu_image": True, "base_image": BASE,
               "linger_s": 5}
    spec = {"experiment": "ray-ctr-ddp", "frameworks": ["pytorch"],
            "parameters": {"DATASET": "digits", "EPOCHS": 2, "MAX_SAMPLES": 400},
            "resources": {"nodes": 2, "processes_per_node": 1, "gpus_per_node": 0}, "distribution": {"type": "torch"},
            "backend": backend, "share": str(tmp_path / "share")}
    path = tmp_path / "ddp.yaml"
    path.write_text(yaml.safe_dump(spec))
    [record] = api.submit(str(path), wait=True, progress=False).records
    assert record.status == "succeeded", record.error
    assert record.world_size == 2 and [(r.node, r.status) for r in record.ranks] == [(0, "succeeded"), (1, "succeeded")]
    assert record.container.image == pytorch_image.ref and "-node0-" in record.container.name
    folder = tmp_path / "share" / "ray-ctr-ddp" / record.run_id
    assert json.loads((folder / "ranks" / "1" / "run.json").read_text())["container"]["image"] == pytorch_image.ref
    zero, one = (metrics_from_notebook(nbformat.read(folder / "ranks" / str(r) / "output.ipynb", 4)) for r in (0, 1))
    assert zero["world_size"] == one["world_size"] == 2
    assert zero["weights_checksum"] == pytest.approx(one["weights_checksum"], rel=1e-6)
    nothing_left("ray-ctr-ddp")
