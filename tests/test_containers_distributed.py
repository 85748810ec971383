"""Distributed runs in containers, for real (podman): one container per node, the node's ranks inside it.

On the local backend the gang's nodes are simulated (``NBBATCH_SIMULATE_NODES``), so a 2-node run is two containers
of PyTorch's CPU image on this machine, its ranks meeting over the host's network: the PyTorch notebook's DDP over
gloo ends with equal weights on both ranks; a rank that fails in one container stops the other container's rank;
a cancel stops both; no container is left. On the test Slurm cluster a 2-node gang runs one container per node
(both nodes are this host, so the image built here is on each). Skipped where not root, or without podman, runc and
mmdebstrap (and Slurm for the last). Needs the PyTorch CPU image on the test base (``pytorch_image``: built once per
session: about 1.5 minutes and 1.7 GB with the CPU wheel
of torch in ``PIP_FIND_LINKS``, as here; 2.5 minutes and 5.8 GB from PyPI, whose torch brings CUDA's libraries).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import nbformat
import pytest
import yaml
from support.containers import BASE, containers_labelled, podman
from support.machine import REPO
from support.notebooks import RANK_HELLOS, make_notebook
from support.processes import kernels_of
from support.waiting import wait_until

from nbbatch import api
from nbbatch.containers.runner import container_launch, end_unfinished
from nbbatch.execute.context import AttemptContext
from nbbatch.execute.launch import LaunchSpec
from nbbatch.execute.placement import NodePlacement
from nbbatch.metrics import metrics_from_notebook
from nbbatch.plan.runs import Run
from nbbatch.spec.resources import Distribution
from nbbatch.store.runfiles import load_records, new_record, read_record, write_record
from nbbatch.store.runjson import ContainerInfo, ErrorKind, RunError, Status
from nbbatch.store.share import FileShare

pytestmark = pytest.mark.timeout(900)

# The ranks meet at the master's port (RANK_HELLOS), the ranks of different containers over the host's network.
# FAIL_RANK fails before that; SLEEP keeps the gang running.
RANKS = """\
import os, socket, time
from nbbatch import record
rank, world = int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])
if rank == FAIL_RANK:
    raise RuntimeError(f'rank {rank} fails on purpose')
""" + RANK_HELLOS + """\
print('met', flush=True)
for _ in range(int(SLEEP * 10)):
    time.sleep(0.1)
record(rank=rank, hellos=sorted(hellos))
"""
PARAMETERS = "FAIL_RANK = -1\nSLEEP = 0\nHOLD = 0"


def real(test):
    """A test that runs containers of the PyTorch image: marked container and kernel."""
    return pytest.mark.container(pytest.mark.kernel(test))


def _backend(**extra) -> dict:
    return {"name": "local", "container": True, "engine": "podman", "cpu_image": True, "base_image": BASE, **extra}


def _experiment(tmp_path: Path, name: str, backend: dict, parameters: dict) -> Path:
    """A 2-node, 1-rank-per-node torch gang of PyTorch's notebook (with ``ranks_notebook``: the small one)."""
    spec = {"experiment": name, "frameworks": ["pytorch"], "parameters": parameters,
            "resources": {"nodes": 2, "processes_per_node": 1}, "distribution": {"type": "torch"},
            "backend": backend, "share": str(tmp_path / "share")}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


class _ContainersSeen:
    """The containers of an experiment seen while it runs, by name → their ``nbbatch.node`` label."""

    def __init__(self, experiment: str) -> None:
        self.experiment, self.seen, self.done = experiment, {}, threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self.done.wait(0.3):
            listed = podman("ps", "--filter", f"label=nbbatch.experiment={self.experiment}", "--format",
                            '{{.Names}} {{index .Labels "nbbatch.node"}}', check=False).stdout
            self.seen.update(line.split(" ", 1) for line in listed.splitlines() if " " in line)

    def __enter__(self) -> _ContainersSeen:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()


def _nothing_left(name: str, run_id: str) -> None:
    wait_until(lambda: not containers_labelled("nbbatch.run", run_id), timeout=60,
               message=f"the containers of {run_id} gone", interval=0.5)
    assert kernels_of(name) == []


def _rank_metrics(folder: Path, world: int) -> list[dict]:
    return [metrics_from_notebook(nbformat.read(folder / "ranks" / str(r) / "output.ipynb", 4)) for r in range(world)]


# --- without an engine ---------------------------------------------------------------------------------------


def _gang_run(nodes: int = 2) -> Run:
    return Run("r1", "e", str(REPO / "notebooks" / "PyTorch_CIFAR.ipynb"), "notebooks/PyTorch_CIFAR.ipynb",
               "nbbatch-pytorch", framework="pytorch",
               distribution=Distribution("torch", nodes=nodes, processes_per_node=1, gpus_per_node=0))


def test_the_launch_file_tells_run_one_inside_its_node(tmp_path):
    node = NodePlacement(1, ("10.0.0.4:7000", "10.0.0.5:7001"))
    info = ContainerInfo("podman", "img", "sha256:1")
    written = container_launch(_gang_run(), tmp_path, tmp_path, AttemptContext(gpu_ids=[2]), info, node)
    read = LaunchSpec.from_json(written.to_json())
    assert read.node == node and read.fresh_ports is False and read.container == info and read.host_gpu_ids == (2,)
    alone = container_launch(_gang_run(), tmp_path, tmp_path, AttemptContext(), info, None)
    assert LaunchSpec.from_json(alone.to_json()).node is None  # a single run's
    mpi = NodePlacement(0, ("10.0.0.4:7000",), (0,))
    fresh = AttemptContext(new_endpoints=lambda: ("127.0.0.1:1",))  # the local backend's one node may pick new ports
    read = LaunchSpec.from_json(container_launch(_gang_run(), tmp_path, tmp_path, fresh, info, mpi).to_json())
    assert read.node == mpi and read.fresh_ports is True


def test_a_nodes_container_that_ended_early_ends_its_ranks_and_stops_the_gang(tmp_path):
    """Node 1's container died mid-attempt: its rank's record ends failed (node 0 need not wait for it) and the
    gang's stop marker tells node 0 to stop; node 0's own container ending so ends the run and decides no retry."""
    share, run = FileShare(tmp_path), _gang_run()
    rank1 = replace(new_record(run), rank=1, world_size=2, status=Status.RUNNING, attempts=1)
    write_record(share, rank1)
    died = RunError("ContainerFailed", "", reason="its container exited with 137", kind=ErrorKind.INFRA)
    ended = end_unfinished(share, run, NodePlacement(1, ("a:1", "b:2")), Status.FAILED, died)
    assert ended.rank == 1 and ended.status == "failed" and ended.error.rank == 1
    assert read_record(share, "e", "r1", rank=1).status == "failed" and read_record(share, "e", "r1") is None
    assert share.exists("e/r1/ranks/stop-1.json")
    record = end_unfinished(share, run, NodePlacement(0, ("a:1", "b:2")), Status.FAILED, died)
    assert record.status == "failed" and read_record(share, "e", "r1").status == "failed"
    assert json.loads(share.read_bytes("e/r1/ranks/decision-1.json")) == {"retry": False}


def test_a_finished_nodes_records_are_left_as_they_are(tmp_path):
    share, run = FileShare(tmp_path), _gang_run()
    done = replace(new_record(run), rank=1, world_size=2, status=Status.SUCCEEDED, attempts=1)
    write_record(share, done)
    ended = end_unfinished(share, run, NodePlacement(1, ("a:1", "b:2")), Status.FAILED, RunError("x", ""))
    assert ended.status == "succeeded" and not share.exists("e/r1/ranks/stop-1.json")


# --- in containers -------------------------------------------------------------------------------------------


@pytest.fixture
def ranks_notebook(tmp_path, monkeypatch):
    """PyTorch's framework with RANKS as its notebook (containers run only a framework's notebook): a project of
    its own beside the repository, with a copy of the framework's folder (the same pins, so the same image) whose
    framework.yaml names the small notebook, and the repository's Dockerfile template."""
    project = tmp_path / "project"
    folder = project / "frameworks" / "pytorch"
    shutil.copytree(REPO / "frameworks" / "pytorch", folder)
    (project / "dockerfiles").symlink_to(REPO / "dockerfiles")
    config = yaml.safe_load((folder / "framework.yaml").read_text())
    config["notebook"] = str(make_notebook(project / "ranks.ipynb", [RANKS], parameters=PARAMETERS,
                                           kernel="nbbatch-pytorch"))
    (folder / "framework.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.setenv("NBBATCH_FRAMEWORKS_DIR", str(folder.parent))


@pytest.fixture
def simulated_nodes(monkeypatch):
    monkeypatch.setenv("NBBATCH_SIMULATE_NODES", "1")


@real
def test_pytorch_ddp_over_two_containers_ends_with_equal_weights(pytorch_image, simulated_nodes, tmp_path):
    """The PyTorch notebook, 2 ranks over gloo, one per simulated node: two containers of its image, equal weights."""
    exp = _experiment(tmp_path, "ctr-ddp", _backend(), {"DATASET": "digits", "EPOCHS": 2, "MAX_SAMPLES": 400})
    with _ContainersSeen("ctr-ddp") as containers:
        (record,) = api.submit(str(exp), wait=True, progress=False).records
    assert record.status == "succeeded", record.error
    assert sorted(containers.seen.values()) == ["0", "1"], containers.seen  # one container per node
    assert record.world_size == 2 and [(r.node, r.status) for r in record.ranks] == [(0, "succeeded"), (1, "succeeded")]
    image_id = podman("image", "inspect", "--format", "{{.Id}}", pytorch_image.ref).stdout.strip()
    assert record.container.image == pytorch_image.ref and record.container.image_id == image_id
    folder = tmp_path / "share" / "ctr-ddp" / record.run_id
    rank1 = json.loads((folder / "ranks" / "1" / "run.json").read_text())
    assert rank1["container"]["image"] == pytorch_image.ref and rank1["status"] == "succeeded"
    zero, one = _rank_metrics(folder, 2)
    assert zero["world_size"] == one["world_size"] == 2
    # DDP's all-reduce kept the replicas equal across the containers; training moved them from where they started
    assert zero["weights_checksum"] == pytest.approx(one["weights_checksum"], rel=1e-6)
    assert abs(zero["weights_checksum"] - zero["initial_weights_checksum"]) > 1e-3
    assert (folder / "outputs" / "model.pt").exists()  # rank 0's files are the run's own
    _nothing_left("ctr-ddp", record.run_id)


@real
def test_a_failing_rank_stops_the_other_nodes_container(pytorch_image, ranks_notebook, simulated_nodes, tmp_path):
    """Rank 1 fails in node 1's container; rank 0 (which would sleep 10 minutes) in node 0's is stopped by the share's
    marker, and both containers are gone."""
    exp = _experiment(tmp_path, "ctr-gang-fail", _backend(), {"FAIL_RANK": 1, "SLEEP": 600})
    with _ContainersSeen("ctr-gang-fail") as containers:
        (record,) = api.submit(str(exp), wait=True, progress=False).records
    assert record.status == "failed" and record.error.rank == 1 and "fails on purpose" in record.error.summary()
    assert {r.rank: r.status for r in record.ranks} == {0: "stopped", 1: "failed"}
    assert sorted(containers.seen.values()) == ["0", "1"], containers.seen
    _nothing_left("ctr-gang-fail", record.run_id)


@real
@pytest.mark.parametrize("stop", ["cancel", "sigterm"])
def test_cancel_or_the_drivers_sigterm_stops_a_running_gang_leaving_no_container(pytorch_image, ranks_notebook,
                                                                                  simulated_nodes, tmp_path, stop):
    """``nbbatch cancel`` (through the share), or SIGTERM to ``nbbatch submit`` (as Ctrl-C): both containers go."""
    name = f"ctr-gang-{stop}"
    exp = _experiment(tmp_path, name, _backend(), {"SLEEP": 600})
    share = FileShare(tmp_path / "share")
    submit = subprocess.Popen([sys.executable, "-m", "nbbatch", "submit", str(exp), "-q"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: len(containers_labelled("nbbatch.experiment", name)) == 2, timeout=300,
                   message="a container per node", interval=0.5)
        running = wait_until(lambda: next((r for r in load_records(share, name)[0] if r.status == "running"), None),
                             timeout=300, message="the gang running", interval=0.5)
        if stop == "cancel":
            api.cancel(name, share=str(tmp_path / "share"))
        else:
            submit.send_signal(signal.SIGTERM)
        output, _ = submit.communicate(timeout=300)
    finally:
        if submit.poll() is None:
            submit.kill()
    record = read_record(share, name, running.run_id)
    assert record.status == "cancelled", (record.error, output)
    _nothing_left(name, record.run_id)


@real
@pytest.mark.slurm
def test_a_two_node_gang_on_slurm_runs_one_container_per_node(slurm_cluster, pytorch_image, ranks_notebook, tmp_path):
    """The gang job's srun starts a launcher per node; each runs its node's rank in a container of its own, and the
    ranks meet at the address node 0 published."""
    backend = {"name": "slurm", "container": True, "cpu_image": True, "base_image": BASE, "cpus": 1,
               "memory": "1G"}
    exp = _experiment(tmp_path, "slurm-ctr-gang", backend, {})
    with _ContainersSeen("slurm-ctr-gang") as containers:
        (record,) = api.submit(str(exp), wait=True, progress=False).records
    assert record.status == "succeeded", record.error
    assert record.backend == "slurm" and record.metrics["hellos"] == [1]
    assert [(r.node, r.status) for r in record.ranks] == [(0, "succeeded"), (1, "succeeded")]
    assert record.container.image == pytorch_image.ref
    assert sorted(containers.seen.values()) == ["0", "1"], containers.seen
    _nothing_left("slurm-ctr-gang", record.run_id)
