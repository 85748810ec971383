"""``backend: {name: slurm, container: true}``: each run in its framework's image, started with podman on its node.

The real tests submit the Chainer digits notebook to the two-node Slurm cluster of tests/support/slurm.py, in the
Chainer image built once per session (tests/support/containers.py); both nodes are this host, so the image built
here is on every node. Skipped where not root, or without Slurm, podman, runc and mmdebstrap. The refusals are unit
tests.
"""

from __future__ import annotations

import shlex
import socket
from pathlib import Path

import nbformat
import pytest
from support.containers import BASE, chainer_experiment, containers_labelled, nothing_left, on_cluster, podman
from support.machine import REPO
from support.registry import pushed_elsewhere
from support.waiting import wait_until

from nbbatch import api
from nbbatch.backends.slurm import SlurmBackend, SlurmJob
from nbbatch.backends.slurm.script import job_launch
from nbbatch.containers.checks import NodeImages
from nbbatch.containers.node import execute_on_node
from nbbatch.errors import ContainerError, ValidationError
from nbbatch.execute.context import AttemptContext
from nbbatch.execute.launch import LaunchSpec, launch_shell_command, shell_launcher
from nbbatch.plan.runs import Run
from nbbatch.spec.resources import Distribution
from nbbatch.store.runfiles import load_records, read_record
from nbbatch.store.share import FileShare
from nbbatch.ui.cli import build_parser

LONG = {"EPOCHS": 500, "MAX_SAMPLES": 1000}  # runs until it is stopped


def _run(framework: str | None = "chainer", **fields) -> Run:
    notebook = REPO / "notebooks" / "Chainer_CIFAR.ipynb"
    return Run("r1", "e", str(notebook), "notebooks/Chainer_CIFAR.ipynb", "nbbatch-chainer", framework=framework,
               **fields)


@pytest.fixture
def no_slurm_tools_needed(monkeypatch):
    monkeypatch.setattr("nbbatch.backends.slurm.commands.Slurm.missing_tools", lambda self: [])


# --- before anything is queued ------------------------------------------------------------------------------


def test_a_run_of_no_framework_is_refused(no_slurm_tools_needed):
    with pytest.raises(ValidationError, match="belongs to no framework; list it under `frameworks:`"):
        SlurmBackend(container=True).check([_run(framework=None)])


def test_a_distributed_run_in_containers_is_not_refused(monkeypatch):
    """Its job runs one container per node (tests/test_containers_distributed.py runs one on the cluster)."""
    run = _run(distribution=Distribution("torch", nodes=2, processes_per_node=1, gpus_per_node=0))
    monkeypatch.setattr(NodeImages, "refs", lambda self, runs: {"chainer": "localhost/nbbatch/chainer:x"})
    SlurmBackend(container=True)._node_images.check([run])


def test_containers_need_no_framework_venvs_here():
    assert SlurmBackend(container=True).capabilities.local_kernels is False
    assert SlurmBackend().capabilities.local_kernels is True


def test_the_launcher_starts_each_framework_image():
    """The job's launch names every framework's image; run-one takes it; GPUs by the node's indices."""
    images = {"chainer": "localhost/nbbatch/chainer:abc", "jax": "localhost/nbbatch/jax:def"}
    launch = LaunchSpec.from_json(job_launch(_run(), "/share", "/proj", True, images).to_json())
    assert launch.container_images == images and launch.container_engine == "podman" and launch.backend == "slurm"
    assert launch.gpu_ids({"SLURM_JOB_GPUS": "2,3", "CUDA_VISIBLE_DEVICES": "0,1"}) == [2, 3]  # the node's own
    assert launch.gpu_ids({"CUDA_VISIBLE_DEVICES": "0,1"}) == [0, 1]
    venv = job_launch(_run(), "/share", "/proj", True)
    assert not venv.container_images and venv.gpu_ids({"SLURM_JOB_GPUS": "2,3", "CUDA_VISIBLE_DEVICES": "0,1"}) == [0, 1]
    assert job_launch(_run(), "/share", "/proj", False).gpu_ids({"CUDA_VISIBLE_DEVICES": "0"}) == []  # a CPU run
    command = launch_shell_command(shell_launcher("/venv/bin/python"), "/share/e/.slurm/s/specs/0.json")
    assert build_parser().parse_args(shlex.split(command)[3:]).launch == "/share/e/.slurm/s/specs/0.json"


@pytest.mark.container
def test_an_image_missing_on_the_node_fails_the_run_saying_so(podman_env, tmp_path):
    share = FileShare(tmp_path / "share")
    run = _run()
    record = execute_on_node(run, share, AttemptContext(backend="slurm", project_root=REPO), "podman",
                             {"chainer": "localhost/nbbatch/chainer:not-built-here"})
    assert record.status == "failed" and record.backend == "slurm"
    assert "is not on node" in record.error.evalue and "podman load" in record.error.evalue
    assert read_record(share, "e", "r1").status == "failed"


def test_a_node_without_the_engine_fails_the_run_naming_the_node(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no podman on this node
    share = FileShare(tmp_path / "share")
    record = execute_on_node(_run(), share, AttemptContext(backend="slurm", project_root=REPO), "podman",
                             {"chainer": "localhost/nbbatch/chainer:x"})
    assert record.status == "failed" and record.error.ename == "ContainerError"
    assert f"node {socket.gethostname()} has no podman (not on PATH)" in record.error.evalue
    assert "install podman on every node, or submit without container: true" in record.error.evalue
    assert read_record(share, "e", "r1").error.reason == f"its container could not start on node {socket.gethostname()}"


@pytest.mark.container
def test_an_image_not_built_here_is_refused_before_queueing(podman_env, no_slurm_tools_needed):
    """The image is looked for where `submit` runs; the error names the build and that every node needs it too."""
    with pytest.raises(ContainerError, match=r"nbbatch images build chainer --base localhost/none:x.*every node needs"):
        SlurmBackend(container=True, base_image="localhost/none:x").check([_run()])


# --- on the cluster -----------------------------------------------------------------------------------------


real = on_cluster(pytest.mark.slurm)  # a test on the Slurm cluster, in the Chainer image


def _experiment(tmp_path: Path, name: str, registry: str | None = None, **parameters) -> Path:
    backend = {"name": "slurm", "container": True, "base_image": BASE, "cpus": 1, "memory": "1G",
               "cancel_grace_s": 60, **({"registry": registry} if registry else {})}
    return chainer_experiment(tmp_path, name, backend, **parameters)


@real
def test_a_run_executes_in_its_image_on_a_node(slurm_cluster, chainer_image, tmp_path):
    share = tmp_path / "share"
    result = api.submit(str(_experiment(tmp_path, "slurm-ctr")), wait=True, progress=False)
    [record] = result.records
    assert record.status == "succeeded", record.error
    assert record.backend == "slurm" and record.metrics["accuracy"] > 0
    image_id = podman("image", "inspect", "--format", "{{.Id}}", chainer_image.ref).stdout.strip()
    assert record.container.engine == "podman" and record.container.image == chainer_image.ref
    assert record.container.image_id == image_id
    job = SlurmJob.read(FileShare(share), "slurm-ctr", record.run_id)
    assert LaunchSpec.from_json((share / job.spec).read_text()).container_images == {"chainer": chainer_image.ref}
    assert "in podman image " + chainer_image.ref in (share / "slurm-ctr" / record.run_id / "log.txt").read_text()
    nothing_left("slurm-ctr")


@real
def test_a_node_pulls_the_image_from_the_registry_and_runs_in_it(slurm_cluster, chainer_image, image_registry,
                                                                  tmp_path):
    """With `registry:` the job names the registry's tag, which the node lacks: its run-one pulls it, then runs."""
    registry = f"{image_registry.address}/slurm"
    with pushed_elsewhere(chainer_image, registry) as remote:
        result = api.submit(str(_experiment(tmp_path, "slurm-reg", registry=registry)), wait=True, progress=False)
        [record] = result.records
        assert record.status == "succeeded", record.error
        assert record.container.image == remote
        assert record.container.image_id == podman("image", "inspect", "--format", "{{.Id}}", remote).stdout.strip()
        job = SlurmJob.read(FileShare(tmp_path / "share"), "slurm-reg", record.run_id)
        assert f"pulling {remote} on node" in (tmp_path / "share" / job.output).read_text()
    nothing_left("slurm-reg")


@real
def test_cancel_scancel_and_sigterm_of_a_running_container_run_leave_no_container(slurm_cluster, chainer_image,
                                                                                 tmp_path):
    """``nbbatch cancel`` reaches the run inside its container through the share's cancel marker (the run ends
    itself, well within the grace before scancel); Slurm's scancel (as its time limit) ends the job, recorded as
    Slurm says; SIGTERM to the launcher alone (``scancel --batch``) makes it stop the container (SIGTERM, then
    SIGKILL), which is no process of the job (the engine's monitor runs it): without that, the container would run on
    after its job; the run inside saves its notebook so far."""
    share = tmp_path / "share"
    fs = FileShare(share)
    names = ("slurm-ctr-cancel", "slurm-ctr-scancel", "slurm-ctr-term")
    for name in names:
        api.submit(str(_experiment(tmp_path, name, **LONG)), wait=False, progress=False)
    running = {name: wait_until(lambda n=name: next((r for r in load_records(fs, n)[0]
                                                      if r.status == "running" and r.cells_done >= 2), None),
                                timeout=300, message=f"{name} running", interval=0.5) for name in names}
    for name in names:
        assert len(containers_labelled("nbbatch.experiment", name)) == 1
    jobs = {name: SlurmJob.read(fs, name, record.run_id) for name, record in running.items()}

    api.cancel("slurm-ctr-cancel", share=str(share))
    record = read_record(fs, "slurm-ctr-cancel", running["slurm-ctr-cancel"].run_id)
    assert record.status == "cancelled" and "scancel" not in (record.error.reason or ""), record.error

    slurm_cluster.run("scancel", jobs["slurm-ctr-scancel"].job_id)
    slurm_cluster.run("scancel", "--batch", "--signal=TERM", jobs["slurm-ctr-term"].job_id)
    scancelled, terminated = (_final(share, name) for name in ("slurm-ctr-scancel", "slurm-ctr-term"))
    assert scancelled.status == "cancelled", scancelled.error
    # the container is stopped with SIGTERM first: the run inside keeps its notebook so far and says why (issue 45)
    assert terminated.status == "cancelled" and "SIGTERM" in terminated.error.reason, terminated.error
    partial = nbformat.read(share / "slurm-ctr-term" / terminated.run_id / "output.ipynb", as_version=4)
    executed = [cell for cell in partial.cells if cell.get("execution_count")]
    assert len(executed) >= 2, "the cells run so far (it was running its third when stopped), kept"
    for name in names:
        nothing_left(name)


def _final(share: Path, name: str):
    [record] = wait_until(lambda: [r for r in api.status(name, share=str(share)) if r.final], timeout=120,
                          message=f"{name} final", interval=0.5)
    return record
