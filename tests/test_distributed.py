"""Distributed runs on the local backend: one kernel per rank, the torchrun contract, one failed rank stops all.

The ranks here are real kernels (the test venv's ``python3``) that meet over plain TCP on
MASTER_ADDR:MASTER_PORT, so the launcher's contract is tested without a framework; the framework
notebooks' own distributed paths (PyTorch DDP over gloo) are at the end.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import nbformat
import pytest
from support.notebooks import RANK_HELLOS, make_notebook
from support.processes import kernels_of

from nbbatch.api import logs, submit
from nbbatch.backends.azureml.placement import azureml_placement
from nbbatch.backends.local import backend as local_module
from nbbatch.backends.placement import placement_reader
from nbbatch.errors import NbbatchError, SpecError, ValidationError
from nbbatch.execute.placement import CONTRACT, NodePlacement, placement_from_env, rank_env
from nbbatch.metrics import metrics_from_notebook
from nbbatch.plan.runs import Run
from nbbatch.spec.resources import Distribution, Resources
from nbbatch.store.fetch import fetch
from nbbatch.store.runfiles import write_cancel_markers
from nbbatch.store.share import FileShare
from nbbatch.ui.cli import main

pytestmark = pytest.mark.timeout(240)

# Every rank writes what it sees, then the ranks meet at the master's port (RANK_HELLOS).
RANK = """\
import json, os, socket, time
from pathlib import Path
from nbbatch import record
env = {k: v for k, v in os.environ.items() if k in CONTRACT or k.removeprefix('NBBATCH_') in CONTRACT}
env['CUDA_VISIBLE_DEVICES'] = os.environ.get('CUDA_VISIBLE_DEVICES')
rank, world = int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])
retrying = KILL_RANK >= 0 and os.path.exists('killed-once')  # before the rendezvous: the kill comes after it
(Path(os.environ['NBBATCH_OUTPUT_DIR']) / f'env-{rank}.json').write_text(json.dumps(env))
if rank == FAIL_RANK:
    raise RuntimeError(f'rank {rank} fails on purpose')
""" + RANK_HELLOS + """\
if rank == KILL_RANK and not os.path.exists('killed-once'):  # as an OOM kill would, once
    open('killed-once', 'w').close()
    os.kill(os.getpid(), 9)
time.sleep(0 if retrying else SLEEP)
record(rank=rank, world=world, hellos=sorted(hellos), master_port=port)
"""
PARAMETERS = f"CONTRACT = {CONTRACT!r}\nFAIL_RANK = -1\nKILL_RANK = -1\nSLEEP = 0\nHOLD = 0"


@pytest.fixture
def ranks_notebook(project):
    return make_notebook(project / "ranks.ipynb", [RANK], parameters=PARAMETERS)


def _experiment(write_experiment, name: str, resources: str, extra: str = "") -> object:
    return write_experiment(f"experiment: {name}\nnotebooks: [ranks.ipynb]\nresources: {resources}\n"
                            f"distribution: {{type: torch}}\n{extra}", name=f"{name}.yaml")


def _env_of(project, experiment: str, record, rank: int) -> dict:
    return json.loads((project / "results" / experiment / record.run_id / "outputs" / f"env-{rank}.json").read_text())


def _rank_notebook(project, experiment: str, record, rank: int):
    return nbformat.read(project / "results" / experiment / record.run_id / "ranks" / str(rank) / "output.ipynb", 4)


@pytest.mark.kernel
def test_every_rank_gets_the_torchrun_contract_and_its_own_files(project, ranks_notebook, write_experiment, tmp_path,
                                                                 capsys):
    exp = _experiment(write_experiment, "contract", "{processes_per_node: 3}")
    assert main(["plan", str(exp)]) == 0
    assert "distributed (torch): 1 node(s) × 3 rank(s) = 3 kernels per run, CPU ranks" in capsys.readouterr().out
    (record,) = submit(exp, progress=False).records
    assert record.status == "succeeded", record.error
    assert record.world_size == 3 and [r.rank for r in record.ranks] == [0, 1, 2]
    assert all(r.status == "succeeded" and r.host for r in record.ranks)
    assert record.metrics["hellos"] == [1, 2]  # every rank found rank 0 at MASTER_ADDR:MASTER_PORT
    envs = [_env_of(project, "contract", record, rank) for rank in range(3)]
    port = envs[0]["MASTER_PORT"]
    for rank, env in enumerate(envs):
        expected = {"RANK": str(rank), "WORLD_SIZE": "3", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "3",
                    "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        assert {k: env[k] for k in expected} == expected
        assert {k: env[f"NBBATCH_{k}"] for k in expected} == expected
        assert env["CUDA_VISIBLE_DEVICES"] == ""  # CPU ranks: no GPU
    folder = project / "results" / "contract" / record.run_id
    for rank in range(3):  # every rank's notebook and log, rank 0's also as the run's own
        notebook = nbformat.read(folder / "ranks" / str(rank) / "output.ipynb", 4)
        assert metrics_from_notebook(notebook)["rank"] == rank
        assert f"rank {rank} of 3" in (folder / "ranks" / str(rank) / "log.txt").read_text()
    assert metrics_from_notebook(nbformat.read(folder / "output.ipynb", 4))["rank"] == 0
    saved = json.loads((folder / "run.json").read_text())
    assert saved["world_size"] == 3 and len(saved["ranks"]) == 3
    assert "rank 2 of 3" in "".join(logs("contract", record.run_id, rank=2))  # nbbatch logs --rank 2
    fetched = {p.relative_to(tmp_path / "got" / "contract" / record.run_id).as_posix()
               for p in fetch(FileShare(project / "results"), "contract", tmp_path / "got")}
    assert {f"ranks/{r}/{f}" for r in (1, 2) for f in ("output.ipynb", "log.txt", "run.json")} <= fetched
    assert {"ranks/0/output.ipynb", "ranks/0/log.txt", "output.ipynb", "outputs/env-1.json"} <= fetched
    assert kernels_of("contract") == []


@pytest.mark.kernel
def test_a_rank_that_fails_before_the_rendezvous_stops_every_rank_and_is_named(project, ranks_notebook,
                                                                                 write_experiment):
    exp = _experiment(write_experiment, "onefails", "{processes_per_node: 3}",
                      "parameters: {FAIL_RANK: 1, SLEEP: 600}\n")
    (record,) = submit(exp, progress=False).records
    assert record.status == "failed"
    assert record.error.rank == 1 and record.error.ename == "RuntimeError"
    assert record.error.summary().startswith("rank 1: ") and "fails on purpose" in record.error.summary()
    # Rank 0 waits for rank 1's hello forever, rank 2 sleeps 600 s: both were stopped, not waited for.
    by_rank = {r.rank: r for r in record.ranks}
    assert by_rank[1].status == "failed" and "fails on purpose" in by_rank[1].error
    assert by_rank[0].status == by_rank[2].status == "stopped"
    assert by_rank[0].error == "stopped after rank 1 failed"
    assert kernels_of("onefails") == []


@pytest.mark.kernel
def test_a_kernel_death_in_one_rank_runs_the_whole_gang_again(project, ranks_notebook, write_experiment):
    exp = _experiment(write_experiment, "gangretry", "{processes_per_node: 2}",
                      "retries: 1\nparameters: {KILL_RANK: 1, SLEEP: 600}\n")
    (record,) = submit(exp, progress=False).records
    assert record.status == "succeeded" and record.attempts == 2
    # rank 0's first attempt (sleeping 600 s) was stopped, not waited for
    assert [e.status for e in record.attempt_log] == ["cancelled", "succeeded"]
    rank1 = json.loads((project / "results" / "gangretry" / record.run_id / "ranks" / "1" / "run.json").read_text())
    assert rank1["attempts"] == 2 and [e["kind"] for e in rank1["attempt_log"]] == ["kernel_died", None]


@pytest.mark.kernel
def test_a_cancel_stops_every_rank(project, ranks_notebook, write_experiment):
    exp = _experiment(write_experiment, "cancelgang", "{processes_per_node: 2}", "parameters: {SLEEP: 600}\n")
    share = FileShare(project / "results")

    def cancel_when_running():
        for _ in range(600):
            records = [json.loads(p.read_text()) for p in (project / "results" / "cancelgang").glob("*/run.json")]
            if records and records[0]["status"] == "running" and records[0].get("cells_done", 0) >= 1:
                write_cancel_markers(share, "cancelgang")
                return
            time.sleep(0.2)

    threading.Thread(target=cancel_when_running, daemon=True).start()
    (record,) = submit(exp, progress=False).records
    assert record.status == "cancelled"
    assert {r.status for r in record.ranks} == {"cancelled"}
    assert kernels_of("cancelgang") == []


@pytest.mark.kernel
def test_two_distributed_runs_at_once_rendezvous_on_different_ports(project, ranks_notebook, write_experiment):
    exp = _experiment(write_experiment, "twoports", "{processes_per_node: 1, max_parallel: 2}",
                      "sweep: {grid: {HOLD: [4, 5]}}\n")
    records = submit(exp, progress=False).records
    assert [r.status for r in records] == ["succeeded", "succeeded"]
    assert [r.attempts for r in records] == [1, 1]
    assert records[0].metrics["master_port"] != records[1].metrics["master_port"]


@pytest.mark.kernel
def test_a_rendezvous_port_taken_meanwhile_is_replaced(project, ranks_notebook, write_experiment, monkeypatch):
    taken = socket.create_server(("127.0.0.1", 0))  # another process got the port between its choice and the bind
    port = taken.getsockname()[1]
    real = local_module.local_placements
    calls = []

    def first_taken(run):
        calls.append(1)
        placements = real(run)
        if len(calls) == 1:
            placements = [NodePlacement(p.node_rank, (f"127.0.0.1:{port}",) + p.endpoints[1:]) for p in placements]
        return placements

    monkeypatch.setattr(local_module, "local_placements", first_taken)
    try:
        (record,) = submit(_experiment(write_experiment, "porttaken", "{processes_per_node: 2}"), progress=False).records
    finally:
        taken.close()
    assert record.status == "succeeded", record.error
    assert record.metrics["master_port"] != port and record.attempts == 2
    assert "Address already in use" in (project / "results" / "porttaken" / record.run_id / "log.txt").read_text()


@pytest.mark.kernel
def test_simulated_nodes_each_start_their_ranks_and_a_failure_crosses_nodes(project, ranks_notebook, write_experiment,
                                                                            monkeypatch):
    monkeypatch.setenv("NBBATCH_SIMULATE_NODES", "1")
    exp = _experiment(write_experiment, "twonodes", "{nodes: 2, processes_per_node: 2}",
                      "sweep: {grid: {FAIL_RANK: [-1, 3]}}\nparameters: {SLEEP: 0}\n")
    ok, failed = sorted(submit(exp, progress=False).records, key=lambda r: r.status, reverse=True)
    assert ok.status == "succeeded" and ok.world_size == 4 and ok.metrics["hellos"] == [1, 2, 3]
    envs = [_env_of(project, "twonodes", ok, rank) for rank in range(4)]
    assert [(e["RANK"], e["LOCAL_RANK"], e["NODE_RANK"]) for e in envs] == [
        ("0", "0", "0"), ("1", "1", "0"), ("2", "0", "1"), ("3", "1", "1")]
    assert len({e["MASTER_PORT"] for e in envs}) == 1
    assert failed.status == "failed" and failed.error.rank == 3  # on node 1: node 0's ranks learnt it through the share
    assert {r.rank: r.status for r in failed.ranks}[0] == "stopped"
    assert kernels_of("twonodes") == []


# --- what is refused before anything runs ---------------------------------------------------------------------


@pytest.mark.parametrize(("resources", "distribution", "message"), [
    ("{nodes: 2}", "", "has no `distribution:`"),
    ("{processes_per_node: 2}", "{type: jax}", "runs one process per node"),
    ("{gpus_per_node: 2, processes_per_node: 4}", "{type: torch}", "NCCL cannot share a GPU"),
    ("{gpus_per_node: 1, runs_per_gpu: 2}", "{type: torch}", "need their GPUs to themselves"),
    ("{gpus: 1, gpus_per_node: 2}", "{type: torch}", "disagree"),
    ("{}", "{type: horovod}", "must be one of torch, jax, tensorflow, mpi"),
    ("{}", "{type: torch, nodes: 2}", "go under resources"),
])
def test_invalid_distributed_resources_are_refused(project, ranks_notebook, write_experiment, resources, distribution,
                                                   message):
    text = f"experiment: bad\nnotebooks: [ranks.ipynb]\nresources: {resources}\n"
    exp = write_experiment(text + (f"distribution: {distribution}\n" if distribution else ""))
    with pytest.raises(SpecError, match=message):
        submit(exp, progress=False)
    assert not (project / "results").exists()


def test_a_framework_without_a_distributed_path_is_refused_with_its_reason(repo_project, monkeypatch, tmp_path):
    from nbbatch.plan.runs import plan
    from nbbatch.spec.experiment import Experiment
    from nbbatch.spec.project import Project

    monkeypatch.chdir(repo_project)
    for name, reason in (("mxnet", "retired"), ("chainer", "maintenance-only"), ("jax-flax", "runs as jax")):
        experiment = Experiment(name="x", frameworks=[name], resources=Resources.of("torch"), base_dir=tmp_path)
        with pytest.raises(ValidationError, match=f"framework `{name}` cannot run as distribution `torch`.*{reason}"):
            plan(experiment, Project(repo_project), check_kernels=False)


def test_the_local_backend_is_one_node(project, ranks_notebook, write_experiment, monkeypatch):
    monkeypatch.delenv("NBBATCH_SIMULATE_NODES", raising=False)
    exp = _experiment(write_experiment, "toomany", "{nodes: 2}")
    with pytest.raises(ValidationError, match="spans 2 nodes, but the local backend is this one machine"):
        submit(exp, progress=False)


# --- where a node launcher is in its gang ---------------------------------------------------------------------


def _run(kind: str, nodes: int = 2, per_node: int = 1) -> Run:
    return Run(run_id="r-1", experiment="e", notebook="/nb.ipynb", notebook_rel="nb.ipynb", kernel="k",
               distribution=Distribution(kind, nodes, per_node, per_node))


def test_node_placement_comes_from_each_backends_environment():
    torch_run = _run("torch", per_node=4)
    # Azure ML's PyTorchDistribution (one process per instance: RANK is the node's)
    azure = {"MASTER_ADDR": "10.0.0.4", "MASTER_PORT": "6105", "NODE_RANK": "1", "RANK": "1", "WORLD_SIZE": "2"}
    assert placement_from_env(torch_run, azure, azureml_placement) == NodePlacement(1, ("10.0.0.4:6105",))
    # nbbatch's own (Ray): every node's endpoint
    ours = {"NBBATCH_NODE_RANK": "1", "NBBATCH_ENDPOINTS": "10.0.0.4:7000,10.0.0.5:7001"}
    assert placement_from_env(torch_run, ours) == NodePlacement(1, ("10.0.0.4:7000", "10.0.0.5:7001"))
    # MPI: one launcher per rank
    mpi = {"OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_SIZE": "8",
           "AZ_BATCHAI_MPI_MASTER_NODE": "10.0.0.4"}
    assert placement_from_env(_run("mpi", per_node=4), mpi, azureml_placement) == NodePlacement(1, ("10.0.0.4:29500",), (2,))
    tf = {"TF_CONFIG": json.dumps({"cluster": {"worker": ["10.0.0.4:2222", "10.0.0.5:2222"]},
                                   "task": {"type": "worker", "index": 1}})}
    assert placement_from_env(_run("tensorflow"), tf, azureml_placement) == NodePlacement(1, ("10.0.0.4:2222", "10.0.0.5:2222"))
    with pytest.raises(NbbatchError, match="was not told its place in the gang"):
        placement_from_env(torch_run, {}, azureml_placement)
    alone = placement_from_env(_run("torch", nodes=1), {})
    assert alone.node_rank == 0 and alone.endpoints[0].startswith("127.0.0.1:")


def test_run_one_reads_a_nodes_place_through_its_backends_hook():
    torch_run = _run("torch", per_node=4)
    azure = {"MASTER_ADDR": "10.0.0.4", "MASTER_PORT": "6105", "NODE_RANK": "1"}
    assert placement_reader("azureml") is azureml_placement  # without the Azure SDK: Azure ML's images lack it
    assert placement_reader("local") is None and placement_reader("ray") is None
    # nbbatch's own variables come first; a backend without a hook knows none of Azure ML's
    ours = {**azure, "NBBATCH_NODE_RANK": "0", "NBBATCH_ENDPOINTS": "10.0.0.5:7000,10.0.0.6:7001"}
    assert placement_from_env(torch_run, ours, azureml_placement) == NodePlacement(0, ("10.0.0.5:7000", "10.0.0.6:7001"))
    with pytest.raises(NbbatchError, match="was not told its place in the gang"):
        placement_from_env(torch_run, azure, placement_reader("local"))


def test_jax_and_tensorflow_ranks_get_their_coordinator_and_cluster():
    placement = NodePlacement(1, ("10.0.0.4:7000", "10.0.0.5:7001"))
    jax = rank_env(_run("jax"), placement, 0)
    assert jax["JAX_COORDINATOR_ADDRESS"] == "10.0.0.4:7000" and jax["RANK"] == "1" and jax["WORLD_SIZE"] == "2"
    tf = json.loads(rank_env(_run("tensorflow"), placement, 0)["TF_CONFIG"])
    assert tf == {"cluster": {"worker": ["10.0.0.4:7000", "10.0.0.5:7001"]}, "task": {"type": "worker", "index": 1}}
    assert "TF_CONFIG" not in rank_env(_run("torch"), placement, 0)


# --- the framework notebooks' own distributed paths ------------------------------------------------------------


def _framework_run(tmp_path, monkeypatch, name: str, frameworks: str, resources: str, kind: str, parameters: str):
    from support.machine import REPO

    monkeypatch.setenv("NBBATCH_PROJECT", str(REPO))  # the real frameworks and their envs
    exp = tmp_path / f"{name}.yaml"
    exp.write_text(f"experiment: {name}\nframeworks: [{frameworks}]\nresources: {resources}\n"
                   f"distribution: {{type: {kind}}}\nparameters: {parameters}\nshare: results\n")
    (record,) = submit(exp, progress=False).records
    folder = tmp_path / "results" / name / record.run_id
    return record, folder


def _rank_metrics(folder, world: int) -> list[dict]:
    return [metrics_from_notebook(nbformat.read(folder / "ranks" / str(r) / "output.ipynb", 4)) for r in range(world)]


@pytest.mark.slow
def test_the_pytorch_notebook_trains_over_two_gloo_ranks_to_identical_weights(pytorch_env, tmp_path, monkeypatch):
    record, folder = _framework_run(tmp_path, monkeypatch, "ddp", "pytorch", "{processes_per_node: 2}", "torch",
                                    "{DATASET: digits, EPOCHS: 2, MAX_SAMPLES: 400}")
    assert record.status == "succeeded", record.error
    assert record.world_size == 2 and [r.status for r in record.ranks] == ["succeeded", "succeeded"]
    zero, one = _rank_metrics(folder, 2)
    assert zero["world_size"] == one["world_size"] == 2
    # DDP's all-reduce keeps the replicas equal; training moved them away from where they started
    assert zero["weights_checksum"] == pytest.approx(one["weights_checksum"], rel=1e-6)
    assert zero["initial_weights_checksum"] == pytest.approx(one["initial_weights_checksum"], rel=1e-6)
    assert abs(zero["weights_checksum"] - zero["initial_weights_checksum"]) > 1e-3
    assert record.metrics["accuracy"] > 0.5
    assert (folder / "outputs" / "model.pt").exists()  # rank 0 saved the model, once
    assert kernels_of("ddp") == []


@pytest.mark.kernel
def test_each_node_gets_its_own_gpus_and_every_rank_sees_all_of_them(project, ranks_notebook, write_experiment,
                                                                       monkeypatch):
    from nbbatch.backends.local import backend as local
    from nbbatch.backends.local.gpus import GpuInfo

    monkeypatch.setattr(local, "detect_gpus", lambda: [GpuInfo(i, f"Fake {i}", 1000) for i in range(4)])
    monkeypatch.setenv("NBBATCH_SIMULATE_NODES", "1")
    exp = _experiment(write_experiment, "gpugang", "{nodes: 2, gpus_per_node: 2}")
    (record,) = submit(exp, progress=False).records
    assert record.status == "succeeded", record.error
    # processes_per_node defaults to gpus_per_node; a rank picks cuda:LOCAL_RANK among its node's GPUs
    assert [_env_of(project, "gpugang", record, r)["CUDA_VISIBLE_DEVICES"] for r in range(4)] == \
        ["0,1", "0,1", "2,3", "2,3"]
    assert [r.gpus for r in record.ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]


@pytest.mark.kernel
def test_a_node_that_cannot_start_stops_the_gang(project, ranks_notebook, write_experiment, monkeypatch):
    """Node 1 lacks an input (here: its folders refuse), so its ranks never start; node 0's stop, not wait."""
    import threading as threads

    from nbbatch.execute import folders

    real_init = folders.RunFolders.__init__

    def node1_lacks_input(self, run, *args, **kwargs):
        if threads.current_thread().name.endswith("-1"):  # the launcher thread of simulated node 1
            raise folders.InputError("input `DATA_DIR`: the folder /data is not on node 1")
        real_init(self, run, *args, **kwargs)

    monkeypatch.setattr(folders.RunFolders, "__init__", node1_lacks_input)
    monkeypatch.setenv("NBBATCH_SIMULATE_NODES", "1")
    exp = _experiment(write_experiment, "nostart", "{nodes: 2, processes_per_node: 1}", "parameters: {SLEEP: 600}\n")
    (record,) = submit(exp, progress=False).records
    assert record.status == "failed"  # rank 0 waited for rank 1's hello (and would sleep 600 s): stopped
    assert record.error.rank == 1 and "not on node 1" in record.error.summary()
    assert kernels_of("nostart") == []


@pytest.mark.slow
def test_tensorflow_trains_over_two_cpu_workers_with_tf_config(tmp_path, monkeypatch):
    """Two simulated nodes, one TF worker each: MultiWorkerMirroredStrategy over TF_CONFIG on 127.0.0.1."""
    monkeypatch.setenv("NBBATCH_SIMULATE_NODES", "1")
    record, folder = _framework_run(tmp_path, monkeypatch, "tfworkers", "tensorflow", "{nodes: 2}", "tensorflow",
                                    "{DATASET: digits, EPOCHS: 2, MAX_SAMPLES: 400}")
    assert record.status == "succeeded", record.error
    assert record.world_size == 2 and [r.node for r in record.ranks] == [0, 1]
    zero, one = _rank_metrics(folder, 2)
    assert zero["world_size"] == one["world_size"] == 2
    assert zero["weights_checksum"] == pytest.approx(one["weights_checksum"], rel=1e-6)
    assert abs(zero["weights_checksum"] - zero["initial_weights_checksum"]) > 1e-3
    assert (folder / "outputs" / "saved_model").is_dir()  # the chief's model; the other worker's copy was discarded
