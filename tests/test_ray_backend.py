"""The ray backend on a real two-node Ray cluster on loopback, both nodes declaring two fake GPUs.

The cluster is the session's (``ray_head`` in tests/conftest.py): a head and a second node (``ray start``) in a
temp dir of their own, every process they started stopped by PID at the end (never a plain ``ray stop``, which
would stop other Ray clusters of this user). Runs execute a tiny notebook in the test venv's ``python3`` kernel that prints
its ``CUDA_VISIBLE_DEVICES`` and Ray node; the last test kills the second node's raylet mid-run.
"""

from __future__ import annotations

import os

# Before Ray is imported: with this, Ray binds its servers to loopback (127.0.0.1) rather than to
# every interface; the driver (this process) and the head read it at import/start.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import yaml  # noqa: E402

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

from support.notebooks import make_notebook  # noqa: E402
from support.raycluster import cluster_processes, cmdline  # noqa: E402
from support.shares import ShareDouble  # noqa: E402

from nbbatch import api  # noqa: E402
from nbbatch.backends import get_backend  # noqa: E402
from nbbatch.backends.ray import NAMESPACE, RayBackend, gpu_request, supervisor_name  # noqa: E402
from nbbatch.errors import BackendError  # noqa: E402
from nbbatch.spec.resources import Distribution  # noqa: E402
from nbbatch.store.runfiles import (  # noqa: E402
    load_records,  # noqa: E402
    read_record,
    write_record,
)
from nbbatch.store.runjson import RunRecord  # noqa: E402
from nbbatch.store.share import FileShare  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

NOTEBOOK_BODY = """\
import os, time
node = os.environ.get("NBBATCH_RAY_NODE_ID", "")
print(f"CVD={os.environ.get('CUDA_VISIBLE_DEVICES')!r} NODE={node}", flush=True)
time.sleep(HEAD_SLEEP if node == HEAD else SLEEP)
"""
LINE = re.compile(r"CVD='([^']*)' NODE=(\w+)")

# A rank of a distributed run says where it is, then (torch-free) proves the rendezvous: rank 0 listens on
# MASTER_ADDR:MASTER_PORT, every other rank connects there, and they swap which Ray node each is on.
RANK_BODY = """\
import json, os, socket, time
import nbbatch
seen = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR",
                                       "MASTER_PORT", "NBBATCH_RAY_NODE_ID", "CUDA_VISIBLE_DEVICES")}
seen["hostname"] = socket.gethostname()
print("PLACE=" + json.dumps(seen), flush=True)
rank, world = int(seen["RANK"]), int(seen["WORLD_SIZE"])
if rank == FAIL_RANK:
    raise RuntimeError(f"rank {rank} fails on purpose")
master = (seen["MASTER_ADDR"], int(seen["MASTER_PORT"]))
me = json.dumps({"rank": rank, "node": seen["NBBATCH_RAY_NODE_ID"]}).encode()
heard = []
if rank == 0:
    with socket.create_server(master) as server:
        server.settimeout(45)
        for _ in range(world - 1):
            conn, _ = server.accept()
            with conn:
                conn.settimeout(15)
                heard.append(json.loads(conn.recv(4096)))
                conn.sendall(me)
else:
    deadline = time.monotonic() + 45
    while True:
        try:
            conn = socket.create_connection(master, timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    with conn:
        conn.settimeout(15)
        conn.sendall(me)
        heard.append(json.loads(conn.recv(4096)))
print("HEARD=" + json.dumps(heard), flush=True)
nbbatch.record(rank=rank, heard=len(heard))
time.sleep(SLEEP)
"""


@pytest.fixture
def cluster(ray_head):
    """The session's Ray cluster (tests/conftest.py: a head and a second node on 127.0.0.1, 2 CPUs and 2 fake GPUs
    each)."""
    return ray_head


def _experiment(name: str, share: Path, address: str, gpus: int = 0, seeds: int = 1, **extra) -> dict:
    backend = {"name": "ray", "address": address, "linger_s": 5, "cancel_grace_s": 5, **extra.pop("backend", {})}
    return {"experiment": name, "notebooks": [{"path": "probe.ipynb", "kernel": "python3"}],
            "parameters": extra.pop("parameters", {}), "sweep": {"grid": {"SEED": list(range(seeds))}},
            "resources": {"gpus": gpus, **extra.pop("resources", {})}, "backend": backend, "share": str(share), **extra}


@pytest.fixture
def probe(project):
    make_notebook(project / "probe.ipynb", [NOTEBOOK_BODY], parameters="SEED = 0\nSLEEP = 2.0\nHEAD = ''\nHEAD_SLEEP = 0.5")
    return project


@pytest.fixture
def ranks(project):
    make_notebook(project / "probe.ipynb", [RANK_BODY], parameters="SEED = 0\nFAIL_RANK = -1\nSLEEP = 0.0")
    return project


def _gang(name: str, share: Path, address: str, nodes: int = 2, per_node: int = 1, **extra) -> dict:
    return _experiment(name, share, address, resources={"nodes": nodes, "processes_per_node": per_node,
                                                          "gpus_per_node": 0},
                       distribution={"type": "torch"}, **extra)


def _said(log: Path, what: str) -> object:
    found = re.findall(rf"^{what}=(.*)$", log.read_text(), re.MULTILINE)
    assert found, f"{log} has no {what}= line"
    return json.loads(found[-1])


def _gangs_left(run_id: str) -> list[dict]:
    """The run's placement groups that Ray still holds (not REMOVED)."""
    return [g for g in ray.util.placement_group_table().values()
            if str(g.get("name", "")).startswith(f"nbbatch-gang:{run_id}:") and g.get("state") != "REMOVED"]


def _gang_ended(address: str, share: Path, record: RunRecord, timeout: float = 300) -> RunRecord:
    """The run's record once its gang's node 0 task has ended (the supervisor no longer has it in flight).

    Rank 0's attempt writes a final status to run.json before node 0's launcher has heard from the other
    nodes and written the run's outcome (its ``ranks``, the first failure), so ``submit`` can return early.
    """
    backend, deadline = RayBackend(address), time.monotonic() + timeout
    while backend.in_flight(FileShare(share), record):
        assert time.monotonic() < deadline, "the gang's node 0 task did not end"
        time.sleep(0.3)
    return read_record(FileShare(share), record.experiment, record.run_id)


def _all_gone(run_id: str, timeout: float = 20) -> None:
    """Its placement group removed and no `run-one` of it left, within ``timeout``."""
    deadline = time.monotonic() + timeout
    while (_gangs_left(run_id) or _run_one_processes(run_id)) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert not _gangs_left(run_id), f"placement group left: {_gangs_left(run_id)}"
    assert not _run_one_processes(run_id), "a run-one process outlived its gang"


def _wait_final(share: Path, experiment: str, timeout: float = 120) -> list[RunRecord]:
    from nbbatch.store.runfiles import load_records

    deadline = time.monotonic() + timeout
    while True:
        records, _ = load_records(FileShare(share), experiment)
        if records and all(r.final for r in records):
            return records
        if time.monotonic() > deadline:
            raise AssertionError(f"runs not final after {timeout} s: {[(r.run_id, r.status) for r in records]}")
        time.sleep(0.5)


def _placement(share: Path, record: RunRecord) -> tuple[str, str]:
    """(CUDA_VISIBLE_DEVICES, Ray node id) the kernel printed (its last attempt)."""
    found = LINE.findall((share / record.experiment / record.run_id / "log.txt").read_text())
    assert found, f"{record.run_id} printed no CVD line"
    return found[-1]


def _overlap(a: RunRecord, b: RunRecord) -> bool:
    return a.started_at < b.ended_at and b.started_at < a.ended_at


def _run_one_processes(run_id: str) -> list[psutil.Process]:
    out = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            cmdline = proc.info["cmdline"] or []
            if "run-one" in cmdline and any(run_id in arg for arg in cmdline):
                out.append(proc)
        except psutil.Error:
            continue
    return out


# --- without a cluster --------------------------------------------------------------------------


def test_import_nbbatch_never_imports_ray():
    code = ("import sys, nbbatch, nbbatch.backends, nbbatch.api, nbbatch.ui.cli; "
            "nbbatch.backends.get_backend; print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_gpu_request_fractions():
    assert gpu_request(0, 1) == (0.0, False)
    assert gpu_request(1, 1) == (1.0, False)
    assert gpu_request(1, 2) == (0.5, True)
    assert gpu_request(1, 3) == (0.3333, True)  # three fit on one GPU at Ray's 1e-4 granularity
    assert gpu_request(2, 2) == (2.0, False)  # multi-GPU runs never share


def test_a_node_without_the_notebook_runs_the_submitters_copy(tmp_path):
    from nbbatch.backends.ray.node import _with_notebook_here, private_folder

    run = {"run_id": "nb-1", "experiment": "e", "notebook": str(tmp_path / "gone" / "nb.ipynb"),
           "notebook_rel": "notebooks/nb.ipynb"}
    folder = private_folder("nb-1")
    try:
        moved = _with_notebook_here(run, str(tmp_path / "no-project"), '{"cells": []}', folder)
        assert Path(moved["notebook"]).read_text() == '{"cells": []}' and moved["run_id"] == "nb-1"
        # in a folder of the task's own (not a predictable /tmp path another user could plant or swap)
        assert Path(moved["notebook"]).parent == folder and (folder.stat().st_mode & 0o777) == 0o700
        assert (Path(moved["notebook"]).stat().st_mode & 0o777) == 0o600
        another = private_folder("nb-1")
        assert another != folder
        another.rmdir()
    finally:
        shutil.rmtree(folder)
    (tmp_path / "proj" / "notebooks").mkdir(parents=True)
    (tmp_path / "proj" / "notebooks" / "nb.ipynb").write_text("{}")
    assert _with_notebook_here(run, str(tmp_path / "proj"), "{}", tmp_path) is run  # the node's project has it


def _plain_run(tmp_path: Path, **changes):
    from nbbatch.plan.runs import Run

    return Run(**{"run_id": "nb-0123456789", "experiment": "e", "notebook": str(tmp_path / "gone" / "nb.ipynb"),
                  "notebook_rel": "nb.ipynb", "kernel": "python3", **changes})


def test_the_run_travels_to_run_one_in_a_private_file_not_on_its_command_line(tmp_path, monkeypatch):
    """`ps` on a node shows run-one's command line to every user: the run's parameters and env are not on it."""
    from types import SimpleNamespace

    import nbbatch.backends.ray.node as node
    from nbbatch.backends import SubmitOptions

    marker = f"run-data-{os.getpid()}-{time.monotonic_ns()}"
    run = _plain_run(tmp_path, parameters={"NOTE": marker + "-param"}, env={"RUN_SETTING": marker + "-env"})
    share = FileShare(tmp_path / "results")
    spec = RayBackend(env={"NODE_SETTING": marker + "-node"}).task_spec(run, share, SubmitOptions(), None)
    spec.notebook_source = '{"cells": []}'  # this "node" lacks the notebook: the submitter's copy goes along
    seen = {}

    class FakeProc:
        returncode = 0

        def __init__(self, cmd, env=None, **kwargs):
            spec_file = Path(cmd[cmd.index("run-one") + 1])
            seen.update(cmd=cmd, env=env, spec_file=spec_file, spec=json.loads(spec_file.read_text())["run"],
                        file_mode=spec_file.stat().st_mode & 0o777, folder_mode=spec_file.parent.stat().st_mode & 0o777)
            seen["notebook"] = Path(seen["spec"]["notebook"])
            seen["notebook_in_folder"] = seen["notebook"].parent == spec_file.parent and seen["notebook"].exists()

        def communicate(self):
            return b"ok", None

    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: "ab" * 28))
    monkeypatch.setattr(node.subprocess, "Popen", FakeProc)
    result = node.execute_on_node(spec.to_dict())
    assert result["exit_code"] == 0
    assert marker not in " ".join(seen["cmd"]) and "run-one" in seen["cmd"]
    assert seen["spec"]["parameters"]["NOTE"] == marker + "-param" and seen["spec"]["env"]["RUN_SETTING"] == marker + "-env"
    assert seen["env"]["NODE_SETTING"] == marker + "-node"  # the backend's env: in run-one's environment
    assert (seen["file_mode"], seen["folder_mode"]) == (0o600, 0o700) and seen["notebook_in_folder"]
    assert run.run_id in str(seen["spec_file"])  # `ps` still tells which run a process is
    assert not seen["spec_file"].parent.exists(), "the task's private folder outlived it"

    cmd, _cwd = node.run_one_command(spec.to_dict(), "/private/launch.json")
    assert marker not in " ".join(cmd)


def test_secret_env_is_refused_before_anything_runs(probe, tmp_path):
    share = tmp_path / "results"
    value = f"planted-{os.getpid()}-{time.monotonic_ns()}"
    unreachable = "127.0.0.1:1"  # the refusal comes before any connection to a cluster
    for backend, env in (({"env": {"AZURE_STORAGE_KEY": value}}, {}),
                         ({"runtime_env": {"env_vars": {"HF_TOKEN": value}}}, {}),
                         ({"env": {"DATABASE_URL": f"postgres://u:{value}@h/db"}}, {}),
                         ({}, {"MYSQL_PWD": value})):
        with pytest.raises(BackendError, match="looks like a secret") as caught:
            api.submit(_experiment("secret", share, unreachable, backend=backend, env=env), progress=False)
        message = str(caught.value)
        assert value not in message and "ray start" in message and "Nothing was started" in message
    assert not share.exists()
    assert all(value.encode() not in p.read_bytes() for p in probe.rglob("*") if p.is_file())
    RayBackend(env={"KERAS_BACKEND": "jax"}).check_secrets([_plain_run(tmp_path, env={"DATA": "x"})])  # plain: fine


def test_ray_retries_follow_the_experiments_retries(tmp_path):
    from nbbatch.backends import SubmitOptions

    share = FileShare(tmp_path / "results")
    spec = RayBackend().task_spec
    assert spec(_plain_run(tmp_path), share, SubmitOptions(), None).max_retries == 0  # `retries: 0`: one attempt
    assert spec(_plain_run(tmp_path, retries=2), share, SubmitOptions(), None).max_retries == 2
    assert RayBackend(max_retries=5).task_spec(_plain_run(tmp_path), share, SubmitOptions(), None).max_retries == 5


def test_unknown_setting_is_named():
    with pytest.raises(BackendError, match="did you mean `num_cpus`"):
        get_backend("ray", num_cpu=2)


def _nodes(*addresses: str) -> list[dict]:
    return [{"NodeID": f"{i:02d}" * 28, "Alive": True, "NodeManagerAddress": a,
             "Resources": {"CPU": 4.0, "GPU": 2.0, **({"node:__internal_head__": 1.0} if i == 0 else {})}}
            for i, a in enumerate(addresses)]


def test_a_gang_larger_than_the_cluster_is_refused_before_anything_runs(tmp_path, monkeypatch):
    from nbbatch.errors import ValidationError

    monkeypatch.setattr(RayBackend, "_alive_nodes", lambda self: _nodes("10.0.0.4", "10.0.0.5"))
    dist = {"type": "torch", "nodes": 3, "processes_per_node": 1, "gpus_per_node": 0}
    run = _plain_run(tmp_path, distribution=Distribution(**dist))
    with pytest.raises(ValidationError, match="spans 3 nodes") as caught:
        RayBackend("10.0.0.4:6379").check([run])
    assert "2 alive node(s)" in str(caught.value) and "autoscaling: true" in str(caught.value)
    RayBackend("10.0.0.4:6379", autoscaling=True).check([run])  # the autoscaler may add the third
    RayBackend("10.0.0.4:6379").check([_plain_run(tmp_path, distribution=Distribution(**{**dist, "nodes": 2}))])
    # enough nodes, but not enough of them with the GPUs each node of the run asks for
    big = _plain_run(tmp_path, gpus=4, distribution=Distribution(**{**dist, "nodes": 2, "gpus_per_node": 4}))
    monkeypatch.setattr(RayBackend, "_alive_nodes", lambda self: [*_nodes("10.0.0.4", "10.0.0.5"), {
        "NodeID": "ff" * 28, "Alive": True, "NodeManagerAddress": "10.0.0.6", "Resources": {"CPU": 8.0, "GPU": 4.0}}])
    with pytest.raises(ValidationError, match="only 1 of the 3 alive node"):
        RayBackend("10.0.0.4:6379").check([big])
    # the node's task asks for whole GPUs and never for a Ray retry (the launchers retry the whole gang)
    from nbbatch.backends import SubmitOptions
    from nbbatch.backends.ray.task import gang_bundles

    spec = RayBackend(num_cpus=2, gang_timeout_s=30).task_spec(big, FileShare(tmp_path), SubmitOptions(), None)
    assert (spec.num_gpus, spec.max_retries, spec.shared_gpu, spec.gang_timeout_s) == (4.0, 0, False, 30.0)
    assert gang_bundles(spec.to_dict()) == [{"CPU": 2.0, "GPU": 4.0}] * 2


def test_local_folder_share_refused_on_a_multi_host_cluster(probe, tmp_path, monkeypatch):
    monkeypatch.setattr(RayBackend, "_alive_nodes", lambda self: _nodes("10.0.0.4", "10.0.0.5"))
    monkeypatch.setattr(RayBackend, "_local_addresses", lambda self: {"127.0.0.1", "10.0.0.4"})
    monkeypatch.setattr("nbbatch.backends.sharedfs.filesystem_type", lambda path: "ext4")
    share = tmp_path / "results"
    with pytest.raises(BackendError) as caught:
        RayBackend("10.0.0.4:6379").check_share(FileShare(share))
    message = str(caught.value)
    assert "shared_folder: true" in message and "azfiles://" in message and "10.0.0.5" in message
    RayBackend("10.0.0.4:6379", shared_folder=True).check_share(FileShare(share))  # the user says it is mounted

    remote = ShareDouble(tmp_path / "remote", remote=True, url="azfiles://account/share")
    RayBackend("10.0.0.4:6379").check_share(remote)  # reachable from every node

    # through submit: refused before any run record is written
    with pytest.raises(BackendError, match="shared_folder"):
        api.submit(_experiment("refused", share, "10.0.0.4:6379", seeds=2), progress=False)
    assert not list(share.glob("refused/*/run.json"))

    monkeypatch.setattr(RayBackend, "_alive_nodes", lambda self: _nodes("127.0.0.1", "127.0.0.1"))
    RayBackend("127.0.0.1:6379").check_share(FileShare(share))  # all nodes on this machine: fine


# --- on the cluster -----------------------------------------------------------------------------


def test_compute_lists_the_nodes(cluster):
    compute = RayBackend(cluster.address).compute()
    assert compute.backend == "ray"
    assert len(compute.nodes) == 2 and all(n["state"] == "alive" for n in compute.nodes)
    assert sorted(n["gpus"] for n in compute.nodes) == [2, 2] and sum(n["cpus"] for n in compute.nodes) == 4
    assert [n["head"] for n in compute.nodes].count(True) == 1
    assert len(compute.gpus) == 4 and len({g["node"] for g in compute.gpus}) == 2
    assert compute.slots == 4


def test_gpu_runs_are_pinned_to_distinct_devices_and_resume_skips_them(cluster, probe, tmp_path):
    share = tmp_path / "results"
    started = time.monotonic()
    result = api.submit(_experiment("pin", share, cluster.address, gpus=1, seeds=4), progress=False)
    print(f"4 one-GPU runs on 2 nodes: {time.monotonic() - started:.1f} s")
    assert result.ok, [(r.run_id, r.status, r.error) for r in result.records]
    placements = {}
    for record in result.records:
        cvd, node = _placement(share, record)
        assert record.backend == "ray" and len(record.gpu_ids) == 1
        assert cvd == str(record.gpu_ids[0])
        placements[record.run_id] = (node, cvd)
    assert {node for node, _ in placements.values()} == {cluster.head_id, cluster.worker_id}
    deadline = time.monotonic() + 20  # a run's record is final a moment before its task ends
    while left := [p for r in result.records for p in Path(tempfile.gettempdir()).glob(f"nbbatch-{r.run_id}-*")]:
        assert time.monotonic() < deadline, f"tasks left their private folders: {left}"
        time.sleep(0.3)
    for a in result.records:
        for b in result.records:
            if a is not b and _overlap(a, b):
                assert placements[a.run_id] != placements[b.run_id], "two concurrent runs got the same GPU"

    # status, logs and resume work as on the local backend
    assert {r.status for r in api.status("pin")} == {"succeeded"}
    assert "CVD=" in "".join(api.logs("pin", result.records[0].run_id))
    again = api.submit(_experiment("pin", share, cluster.address, gpus=1, seeds=4), progress=False)
    assert sorted(again.skipped) == sorted(placements) and again.started == []

    # the experiment's supervisor actor leaves once idle (linger_s: 5)
    deadline = time.monotonic() + 30
    while supervisor_name("pin", FileShare(share)) in {a["name"] for a in ray.util.list_named_actors(True)}:
        assert time.monotonic() < deadline, "the idle supervisor did not leave"
        time.sleep(0.5)


def test_runs_per_gpu_share_a_device_and_cpu_runs_see_none(cluster, probe, tmp_path):
    share = tmp_path / "results"
    head_only = {"resources": {"node:__internal_head__": 0.01}}
    started = time.monotonic()
    api.submit(_experiment("halves", share, cluster.address, gpus=1, seeds=2, resources={"runs_per_gpu": 2},
                           parameters={"SLEEP": 8.0}, backend=head_only), wait=False, progress=False)
    # both half-GPU runs hold the head's CPUs before the CPU runs arrive, so a loaded machine cannot serialise them
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        records = load_records(FileShare(share), "halves")[0]
        if len(records) == 2 and all(r.status in ("running", "succeeded") for r in records):
            break
        time.sleep(0.3)
    # the CPU runs through the command line: `submit --no-wait` returns and its runs go on without it
    (probe / "cpu.yaml").write_text(yaml.safe_dump(_experiment("cpu", share, cluster.address, gpus=0, seeds=2)))
    cli = subprocess.run([sys.executable, "-m", "nbbatch.ui.cli", "submit", "cpu.yaml", "--no-wait", "-q"], cwd=probe,
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    halves = _wait_final(share, "halves")
    cpu = _wait_final(share, "cpu")
    print(f"2 half-GPU runs + 2 CPU runs: {time.monotonic() - started:.1f} s")
    assert {r.status for r in halves + cpu} == {"succeeded"}, [(r.run_id, r.status, r.error) for r in halves + cpu]
    a, b = halves
    assert _placement(share, a) == _placement(share, b), "runs_per_gpu: 2 runs should share one GPU of the head"
    assert _overlap(a, b), "the two half-GPU runs should have run at the same time"
    assert _placement(share, a)[1] == cluster.head_id
    for record in cpu:
        assert _placement(share, record)[0] == "" and record.gpu_ids == []


def test_cancel_stops_running_and_queued_runs(cluster, probe, tmp_path):
    share = tmp_path / "results"
    # each run takes both GPUs of the head: one runs, the other waits in Ray's queue
    exp = _experiment("cancel", share, cluster.address, gpus=2, seeds=2, parameters={"SLEEP": 300.0},
                      env={"RUN_SETTING": "run-marker"},
                      backend={"resources": {"node:__internal_head__": 0.01}, "env": {"NODE_SETTING": "node-marker"}})
    api.submit(exp, wait=False, progress=False)
    deadline = time.monotonic() + 90
    running = None
    while running is None:
        assert time.monotonic() < deadline, "no run started"
        for run_dir in share.glob("cancel/*/log.txt"):
            if "CVD=" in run_dir.read_text():
                running = run_dir.parent.name
        time.sleep(0.3)
    for proc in _run_one_processes(running):  # what `ps` shows every user of the node
        line = " ".join(cmdline(proc))
        assert "run-marker" not in line and "node-marker" not in line and " run-one " in line
        spec_file = Path(line.split(" run-one ", 1)[1].split(" ", 1)[0])
        assert spec_file.stat().st_mode & 0o777 == 0o600 and spec_file.parent.stat().st_mode & 0o777 == 0o700
    followed: list[str] = []
    follower = threading.Thread(target=lambda: followed.extend(api.logs("cancel", running, follow=True)), daemon=True)
    follower.start()
    started = time.monotonic()
    asked = api.cancel("cancel")
    assert running in asked and len(asked) == 2
    records = _wait_final(share, "cancel", timeout=60)
    print(f"cancel took {time.monotonic() - started:.1f} s")
    assert {r.status for r in records} == {"cancelled"}, [(r.run_id, r.status, r.error) for r in records]
    by_id = {r.run_id: r for r in records}
    assert by_id[running].error.reason.startswith("cancelled by `nbbatch cancel` from ")  # who, and when
    assert (share / "cancel" / running / "output.ipynb").exists()  # partial output kept
    follower.join(timeout=15)
    assert not follower.is_alive() and "CVD=" in "".join(followed)
    deadline = time.monotonic() + 15
    while _run_one_processes(running) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _run_one_processes(running), "the cancelled run's process is still alive"


def test_refresh_fails_a_run_whose_task_is_gone(cluster, tmp_path):
    share = FileShare(tmp_path / "results")
    record = RunRecord(run_id="nb-0000000001", experiment="lost", notebook="probe.ipynb", kernel="python3",
                       status="running", attempts=1, queued_at="2020-01-01T00:00:00.000+00:00",
                       started_at="2020-01-01T00:00:01.000+00:00", backend="ray")
    write_record(share, record)
    RayBackend(cluster.address).refresh("lost", share)
    after = read_record(share, "lost", record.run_id)
    assert after.status == "failed" and after.error.ename == "RayTaskLost" and "resubmit" in after.error.reason


def test_an_input_on_the_share_reaches_the_runs_on_the_nodes(cluster, project, tmp_path):
    """The Ray task carries the run's inputs; the node binds the parameter to the share's folder."""
    share = tmp_path / "results"
    (share / "data").mkdir(parents=True)
    (share / "data" / "x.txt").write_text("41")
    make_notebook(project / "probe.ipynb", [
        "import os, nbbatch\nprint('NODE=' + os.environ['NBBATCH_RAY_NODE_ID'])\n"
        "nbbatch.record(x=int(open(os.path.join(DATA_DIR, 'x.txt')).read()) + 1, where=DATA_DIR)",
    ], parameters="SEED = 0\nDATA_DIR = 'data'")
    exp = _experiment("inputs", share, cluster.address, gpus=2, seeds=2, inputs={"DATA_DIR": str(share / "data")})
    result = api.submit(exp, wait=True, progress=False)
    assert {r.status for r in result.records} == {"succeeded"}
    assert [r.metrics["x"] for r in result.records] == [42, 42]
    assert {r.metrics["where"] for r in result.records} == {str(share / "data")}
    assert all(r.inputs["DATA_DIR"].path == str(share / "data") for r in result.records)


def test_a_distributed_run_spans_two_ray_nodes_as_one_world(cluster, ranks, tmp_path):
    share = tmp_path / "results"
    started = time.monotonic()
    result = api.submit(_gang("gang", share, cluster.address), progress=False)
    print(f"a 2-node gang: {time.monotonic() - started:.1f} s (submit saw {result.records[0].status}, "
          f"{len(result.records[0].ranks)} rank entries)")
    record = _gang_ended(cluster.address, share, result.records[0])
    assert record.status == "succeeded", record.error
    folder = share / "gang" / record.run_id
    saved = json.loads((folder / "run.json").read_text())
    assert saved["world_size"] == 2 and [r["rank"] for r in saved["ranks"]] == [0, 1]
    assert all(r["status"] == "succeeded" for r in saved["ranks"]), saved["ranks"]
    assert (folder / "ranks" / "1" / "output.ipynb").exists()
    places = [_said(folder / "log.txt", "PLACE"), _said(folder / "ranks" / "1" / "log.txt", "PLACE")]
    assert [(p["RANK"], p["WORLD_SIZE"], p["NODE_RANK"], p["LOCAL_RANK"]) for p in places] == \
        [("0", "2", "0", "0"), ("1", "2", "1", "0")]
    assert {p["NBBATCH_RAY_NODE_ID"] for p in places} == {cluster.head_id, cluster.worker_id}  # one rank per node
    assert len({(p["MASTER_ADDR"], p["MASTER_PORT"]) for p in places}) == 1  # one world
    assert all(p["CUDA_VISIBLE_DEVICES"] == "" for p in places)  # gpus_per_node: 0
    # they reached each other at MASTER_ADDR:MASTER_PORT, each hearing the other's node
    heard = [_said(folder / "log.txt", "HEARD"), _said(folder / "ranks" / "1" / "log.txt", "HEARD")]
    assert heard == [[{"rank": 1, "node": places[1]["NBBATCH_RAY_NODE_ID"]}],
                     [{"rank": 0, "node": places[0]["NBBATCH_RAY_NODE_ID"]}]]
    _all_gone(record.run_id)


def test_a_failed_rank_on_another_node_fails_the_gang_and_is_named(cluster, ranks, tmp_path):
    share = tmp_path / "results"
    started = time.monotonic()
    # rank 1 fails at once; rank 0 would wait 45 s for it at the rendezvous, then sleep 600 s
    result = api.submit(_gang("gangfail", share, cluster.address, parameters={"FAIL_RANK": 1, "SLEEP": 600.0}),
                        progress=False)
    record = _gang_ended(cluster.address, share, result.records[0])
    took = time.monotonic() - started
    print(f"a 2-node gang whose rank 1 fails: {took:.1f} s (submit saw {result.records[0].status}): "
          f"{record.error.summary()}")
    assert record.status == "failed" and record.error.rank == 1, record.error
    assert "rank 1" in record.error.summary() and "fails on purpose" in record.error.summary()
    by_rank = {r.rank: r for r in record.ranks}  # rank 0 (waiting, then sleeping 600 s) was stopped, not waited for
    assert by_rank[0].status == "stopped" and by_rank[1].status == "failed"
    _all_gone(record.run_id)


@pytest.mark.timeout(480)
def test_cancel_stops_every_node_of_a_gang(cluster, ranks, tmp_path):
    share = tmp_path / "results"
    api.submit(_gang("gangcancel", share, cluster.address, parameters={"SLEEP": 600.0}), wait=False, progress=False)
    deadline = time.monotonic() + 240  # two kernels start and meet: minutes on two cores shared with other work
    while not any("HEARD=" in log.read_text() for log in share.glob("gangcancel/*/ranks/1/log.txt")):
        assert time.monotonic() < deadline, "the gang did not start"
        time.sleep(0.3)
    started = time.monotonic()
    assert len(api.cancel("gangcancel")) == 1
    (record,) = _wait_final(share, "gangcancel", timeout=60)
    record = _gang_ended(cluster.address, share, record)
    print(f"gang cancelled in {time.monotonic() - started:.1f} s: {record.error.summary() if record.error else ''}")
    assert record.status == "cancelled", record.error
    assert {r.status for r in record.ranks} == {"cancelled"}, record.ranks
    _all_gone(record.run_id)


def test_a_gang_the_cluster_cannot_place_fails_after_the_gang_timeout(cluster, ranks, tmp_path):
    share = tmp_path / "results"
    started = time.monotonic()
    # three nodes on a two-node cluster: with `autoscaling: true` it is submitted, and Ray never places it
    result = api.submit(_gang("toobig", share, cluster.address, nodes=3,
                              backend={"autoscaling": True, "gang_timeout_s": 3}), progress=False)
    took = time.monotonic() - started
    (record,) = result.records
    print(f"a gang that cannot be placed: failed in {took:.1f} s: {record.error.summary()}")
    assert record.status == "failed" and record.error.ename == "GangTimeout", record.error
    reason = record.error.reason
    assert "could not give 3 nodes with 0 GPU(s)" in reason and "STRICT_SPREAD" in reason and "within 3 s" in reason
    assert "2 alive node(s)" in reason and "gang_timeout_s" in reason
    assert record.started_at is None  # no rank ever started
    _all_gone(record.run_id)


@pytest.mark.timeout(480)
def test_a_node_lost_mid_run_stops_the_gang_and_is_named(cluster, ranks, tmp_path):
    share = tmp_path / "results"
    api.submit(_gang("ganglost", share, cluster.address, parameters={"SLEEP": 600.0}), wait=False, progress=False)
    # two kernels start and meet: seconds on an idle machine, minutes on two cores shared with other work
    deadline, launcher = time.monotonic() + 240, None
    while launcher is None:  # node 1's `run-one`, once its rank has met rank 0
        assert time.monotonic() < deadline, "the gang did not start"
        for log in share.glob("ganglost/*/ranks/1/log.txt"):
            if "HEARD=" in log.read_text():
                launcher = next((p for p in _run_one_processes(log.parents[2].name)
                                 if p.environ().get("NBBATCH_NODE_RANK") == "1"), None)
        time.sleep(0.3)
    run_id = next(share.glob("ganglost/*/ranks")).parent.name
    worker = launcher.parent()  # the Ray worker running node 1's task: as if its node went away
    started = time.monotonic()
    worker.kill()
    (record,) = _wait_final(share, "ganglost", timeout=300)
    record = _gang_ended(cluster.address, share, record)
    print(f"node 1's worker killed → run final in {time.monotonic() - started:.1f} s: {record.error.summary()}")
    assert record.status == "failed", record.error
    assert "node 1" in record.error.reason and "the other nodes were stopped" in record.error.reason, record.error
    _all_gone(run_id)


def test_node_death_mid_run_retries_on_the_head(cluster, probe, tmp_path):
    """Kill the second node's raylet while a run executes there: it is retried on the head (or failed with why)."""
    share = tmp_path / "results"
    # two runs taking both GPUs of a node each: one per node; the head's finishes at once, the other sleeps
    exp = _experiment("victim", share, cluster.address, gpus=2, seeds=2, retries=1,
                      parameters={"SLEEP": 300.0, "HEAD": cluster.head_id, "HEAD_SLEEP": 6.0})
    api.submit(exp, wait=False, progress=False)
    deadline = time.monotonic() + 90
    victim = None
    while victim is None:
        assert time.monotonic() < deadline, "no run started on the second node"
        for log in share.glob("victim/*/log.txt"):
            if f"NODE={cluster.worker_id}" in log.read_text():
                victim = log.parent.name
        time.sleep(0.3)
    supervisor = ray.get_actor(supervisor_name("victim", FileShare(share)), namespace=NAMESPACE)
    assert ray.get(supervisor.node_id.remote()) == cluster.head_id  # it must outlive worker nodes
    raylet = next(p for p in cluster_processes(cluster.tags)
                  if f"--raylet_socket_name={cluster.worker_raylet_socket}" in " ".join(cmdline(p)))
    started = time.monotonic()
    raylet.kill()
    records = _wait_final(share, "victim", timeout=120)
    print(f"node killed → runs final in {time.monotonic() - started:.1f} s")
    by_id = {r.run_id: r for r in records}
    lost = by_id[victim]
    assert all(r.status not in ("running", "queued") for r in records)
    if lost.status == "succeeded":  # retried by Ray on the head
        assert lost.attempts == 2 and _placement(share, lost)[1] == cluster.head_id
        assert [e.status for e in lost.attempt_log] == ["lost", "succeeded"]  # an infrastructure failure
        assert f"NODE={cluster.worker_id}" in (share / "victim" / victim / "log.txt").read_text()
    else:
        assert lost.status == "failed" and "node" in lost.error.reason, lost.error
    deadline = time.monotonic() + 15
    while _run_one_processes(victim) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _run_one_processes(victim), "a run-one process outlived its task"
    json.dumps(RayBackend(cluster.address).compute().nodes)  # what the setup_cluster widget shows, a node down
