"""The slurm backend against a real two-node Slurm cluster on this machine (tests/support/slurm.py).

Runs execute tiny notebooks in the test venv's ``python3`` kernel (the project's framework environments are not
needed): each prints the Slurm node it ran on. Both nodes are this host, so the share (a folder of the test's
temp dir) is seen by every node, as a cluster's shared file system is.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.notebooks import make_notebook
from support.waiting import wait_until

from nbbatch import api
from nbbatch.backends import get_backend
from nbbatch.backends.slurm import SlurmBackend, SlurmJob
from nbbatch.backends.slurm.commands import TOOLS
from nbbatch.backends.slurm.jobs import slurm_time, time_limit_minutes
from nbbatch.errors import BackendError, NbbatchError
from nbbatch.store.runfiles import load_records, read_record
from nbbatch.store.share import FileShare

pytestmark = [pytest.mark.slurm, pytest.mark.kernel, pytest.mark.timeout(300)]

PROBE = """\
import os, time
print(f"NODE={os.environ.get('SLURMD_NODENAME')} JOB={os.environ.get('SLURM_JOB_ID')}", flush=True)
time.sleep(SLEEP)
"""

# A rank says where it is, then proves the rendezvous without torch: rank 0 listens on MASTER_ADDR:MASTER_PORT and
# every other rank connects there; FAIL_RANK raises on purpose (after the others are waiting).
RANKS = """\
import json, os, socket, time
seen = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
                                       "SLURMD_NODENAME")}
print("PLACE=" + json.dumps(seen), flush=True)
rank, world = int(seen["RANK"]), int(seen["WORLD_SIZE"])
if rank == FAIL_RANK:
    time.sleep(2)
    raise RuntimeError(f"rank {rank} fails on purpose")
master = (seen["MASTER_ADDR"], int(seen["MASTER_PORT"]))
if rank == 0:
    server = socket.create_server(master)
    server.settimeout(120)
    for _ in range(world - 1):
        conn, _addr = server.accept()
        conn.sendall(b"hello")
        conn.close()
else:
    for _ in range(600):
        try:
            with socket.create_connection(master, timeout=5) as conn:
                assert conn.recv(5) == b"hello"
            break
        except OSError:
            time.sleep(0.2)
time.sleep(SLEEP)
"""

# Resumes from its checkpoint: step 1 writes it and then waits long (the test kills its node); a resumed run
# finds step 1 done and finishes at once.
RESUMING = """\
import os, time
from nbbatch.artifacts import checkpoint_path
mark = checkpoint_path("step.txt")
done = int(mark.read_text()) if mark is not None and mark.exists() else 0
print(f"NODE={os.environ.get('SLURMD_NODENAME')} RESUMED_FROM={done}", flush=True)
if done == 0:
    mark.write_text("1")
    print("CHECKPOINTED", flush=True)
    time.sleep(SLEEP)
"""


@pytest.fixture
def slurm(slurm_cluster, project):
    make_notebook(project / "probe.ipynb", [PROBE], parameters="SEED = 0\nSLEEP = 0.5")
    make_notebook(project / "ranks.ipynb", [RANKS], parameters="SEED = 0\nFAIL_RANK = -1\nSLEEP = 0.0")
    make_notebook(project / "resuming.ipynb", [RESUMING], parameters="SEED = 0\nSLEEP = 600.0")
    return slurm_cluster


def experiment(name: str, share: Path, notebook: str = "probe.ipynb", seeds: int = 1, **extra) -> dict:
    backend = {"name": "slurm", "cpus": 1, "memory": "256M", "cancel_grace_s": 5, **extra.pop("backend", {})}
    return {"experiment": name, "notebooks": [{"path": notebook, "kernel": "python3"}],
            "parameters": extra.pop("parameters", {}), "sweep": {"grid": {"SEED": list(range(seeds))}},
            "backend": backend, "share": str(share), **extra}


def gang(name: str, share: Path, **extra) -> dict:
    return experiment(name, share, "ranks.ipynb", resources={"nodes": 2, "processes_per_node": 1, "gpus_per_node": 0},
                      distribution={"type": "torch"}, **extra)


def succeeded(result: api.SubmitResult) -> list[str]:
    return sorted(r.run_id for r in result.records if r.status == "succeeded")


def printed(share: Path, experiment_name: str, run_id: str, what: str) -> list[str]:
    log = share / experiment_name / run_id / "log.txt"
    return re.findall(rf"\b{what}=(\S+)", log.read_text()) if log.exists() else []


def final_records(name: str, share: Path, count: int, timeout: float = 180) -> list:
    """The experiment's records once ``count`` are final, read through api.status (which asks Slurm)."""
    def all_final():
        records = api.status(name, share=str(share))
        return records if len(records) == count and all(r.final for r in records) else None
    return wait_until(all_final, timeout=timeout, message=f"{name}: {count} final runs")


# --- the job's shape ----------------------------------------------------------------------------------------


def test_time_limit_leaves_room_for_every_attempt():
    """--time covers (retries + 1) attempts of timeout.run plus each one's start, and the launcher's margin."""
    from nbbatch.plan.runs import Run

    run = Run("r", "e", "/p/n.ipynb", "n.ipynb", "python3", timeout_s=900, retries=2)
    assert time_limit_minutes(run) == 56  # 3 × (900 + 120) + 300 = 3360 s
    assert slurm_time(56) == "0-00:56:00" and slurm_time(24 * 60 + 1) == "1-00:01:00"
    assert time_limit_minutes(Run("r", "e", "/p/n.ipynb", "n.ipynb", "python3")) is None


def test_bad_settings_are_refused_when_the_backend_is_made():
    with pytest.raises(NbbatchError, match="memory: lots"):
        get_backend("slurm", memory="lots")
    with pytest.raises(NbbatchError, match="time_limit: soon"):
        get_backend("slurm", time_limit="soon")
    with pytest.raises(BackendError, match="partiton.*did you mean `partition`"):
        get_backend("slurm", partiton="gpu")
    with pytest.raises(NbbatchError, match="`--array=0-3`, an option nbbatch sets itself.*max_parallel"):
        get_backend("slurm", extra_sbatch=["--exclusive", "--array=0-3"])
    with pytest.raises(NbbatchError, match="`-J`.*finds its jobs by that name"):
        get_backend("slurm", extra_sbatch=["-J", "mine"])


# --- runs on the cluster ------------------------------------------------------------------------------------


def test_a_sweep_runs_as_one_job_array_at_most_max_parallel_at_once(slurm, project, tmp_path):
    """Six runs are one job array throttled to 2 (%2): all succeed, spread over the nodes, never more than 2 at once."""
    share = tmp_path / "share"
    result = api.submit(experiment("sweep", share, seeds=6, backend={"max_parallel": 2}), wait=True, progress=False)
    assert succeeded(result) == sorted(result.started) and len(result.started) == 6
    records, _ = load_records(FileShare(share), "sweep")
    jobs = {SlurmJob.read(FileShare(share), "sweep", r.run_id).job_id for r in records}
    arrays = {j.split("_")[0] for j in jobs}
    assert len(arrays) == 1 and len(jobs) == 6, jobs  # one array, a task per run
    scripts = list((share / "sweep" / ".slurm").glob("*/batch-0.sh"))
    assert len(scripts) == 1 and "run-one" in scripts[0].read_text()
    spans = sorted((r.started_at, r.ended_at) for r in records)
    most = max(sum(1 for s, e in spans if s <= start < e) for start, _ in spans)
    assert most <= 2, spans
    nodes = {printed(share, "sweep", r.run_id, "NODE")[0] for r in records}
    assert nodes <= {"node1", "node2"} and nodes


def test_a_distributed_run_spans_two_nodes_and_its_ranks_meet(slurm, project, tmp_path):
    share = tmp_path / "share"
    result = api.submit(gang("gang", share), wait=True, progress=False)
    assert succeeded(result) == result.started and len(result.started) == 1
    run_id = result.started[0]
    record = read_record(FileShare(share), "gang", run_id)
    assert record.world_size == 2 and [r.status for r in record.ranks] == ["succeeded", "succeeded"]
    places = [line for log in (share / "gang" / run_id).glob("**/log.txt")
              for line in re.findall(r"PLACE=(.*)", log.read_text())]
    nodes = {json.loads(p)["RANK"]: json.loads(p)["SLURMD_NODENAME"] for p in places}
    assert sorted(nodes) == ["0", "1"] and sorted(nodes.values()) == ["node1", "node2"], places  # a node per launcher
    job = SlurmJob.read(FileShare(share), "gang", run_id)
    assert "_" not in job.job_id  # a job of its own, not an array task


def test_a_failing_rank_stops_the_gang(slurm, project, tmp_path):
    share = tmp_path / "share"
    result = api.submit(gang("gangfail", share, parameters={"FAIL_RANK": 1, "SLEEP": 600.0}), wait=True, progress=False)
    record = read_record(FileShare(share), "gangfail", result.started[0])
    assert record.status == "failed" and record.error.rank == 1
    assert "fails on purpose" in record.error.evalue


def test_the_driver_may_go_away_and_status_follows_the_jobs(slurm, project, tmp_path, monkeypatch):
    """`submit` in a process that is killed once the runs are queued: the jobs go on, and `status` from another
    process (this one) reads their end from the share and Slurm."""
    share = tmp_path / "share"
    spec = project / "away.yaml"
    spec.write_text(yaml.safe_dump(experiment("away", share, seeds=2, parameters={"SLEEP": 3.0})))
    driver = subprocess.Popen([sys.executable, "-m", "nbbatch", "submit", "--wait", str(spec)], cwd=project,
                              stdout=subprocess.DEVNULL, stderr=(tmp_path / "driver.txt").open("w"))
    try:
        wait_until(lambda: len(list((share / "away").glob("*/slurm.json"))) == 2 or driver.poll() is not None, timeout=120,
                   message="both runs queued in Slurm")
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    assert len(list((share / "away").glob("*/slurm.json"))) == 2, (tmp_path / "driver.txt").read_text()
    elsewhere = tmp_path / "elsewhere"  # another machine: a project that never submitted `away`, the same share
    (elsewhere / "frameworks").mkdir(parents=True)
    (elsewhere / ".nbbatch").mkdir()
    monkeypatch.chdir(elsewhere)
    records = final_records("away", share, 2)
    assert [r.status for r in records] == ["succeeded", "succeeded"]


def test_submit_returns_once_the_jobs_are_queued(slurm, project, tmp_path):
    """On Slurm, submit does not wait unless asked: the jobs outlive it."""
    share = tmp_path / "share"
    result = api.submit(experiment("queued", share, parameters={"SLEEP": 2.0}), progress=False)
    assert not result.waited and len(result.started) == 1
    assert SlurmJob.read(FileShare(share), "queued", result.started[0]) is not None
    [record] = final_records("queued", share, 1)
    assert record.status == "succeeded"


def test_cancel_stops_a_pending_and_a_running_run(slurm, project, tmp_path):
    share = tmp_path / "share"
    api.submit(experiment("stop", share, seeds=2, parameters={"SLEEP": 600.0}, backend={"max_parallel": 1}),
               wait=False, progress=False)
    fs = FileShare(share)
    running = wait_until(lambda: next((r for r in load_records(fs, "stop")[0] if r.status == "running"), None),
                         timeout=120, message="one run running")
    pending = next(r for r in load_records(fs, "stop")[0] if r.run_id != running.run_id)
    def throttled() -> str | None:  # Slurm may first say Priority or None, then names the array's throttle
        api.status("stop", share=str(share))
        note = read_record(fs, "stop", pending.run_id).note or ""
        return note if "JobArrayTaskLimit" in note else None

    assert "max_parallel" in wait_until(throttled, timeout=60, message="the pending run's note")
    api.cancel("stop", share=str(share))
    records = final_records("stop", share, 2, timeout=60)
    assert {r.status for r in records} == {"cancelled"}
    assert wait_until(lambda: not slurm.run("squeue", "-h", "-n", "nbbatch-stop").stdout.strip(), timeout=60,
                      message="no job left")


def test_slurms_time_limit_ends_a_run_as_timed_out(slurm, project, tmp_path):
    """A run whose job hits Slurm's --time (1 minute here, enforced after about 81 s) is timed_out, saying so, with its
    notebook as far as it ran."""
    share = tmp_path / "share"
    api.submit(experiment("late", share, parameters={"SLEEP": 600.0}, backend={"time_limit": 1}),
               wait=False, progress=False)
    [record] = final_records("late", share, 1, timeout=240)
    assert record.status == "timed_out" and record.error.ename == "SlurmTimeLimit", record.error
    # run-one got Slurm's SIGTERM and kept the notebook as far as it ran (issue 45 item 3)
    assert "NODE=node" in (share / "late" / record.run_id / "output.ipynb").read_text()
    assert record.error.reason.startswith("stopped by Slurm's time limit (SIGTERM)") and record.error.cell_index


def test_a_lost_node_is_resubmitted_and_resumes_from_its_checkpoint(slurm, project, tmp_path):
    """The node daemon and the run's processes die mid-run: Slurm fails the job (NODE_FAIL after SlurmdTimeout), the
    run is submitted again (retries: 1) and resumes from the checkpoint it wrote."""
    share = tmp_path / "share"
    api.submit(experiment("lost", share, "resuming.ipynb", retries=1), wait=False, progress=False)
    fs = FileShare(share)
    first = wait_until(lambda: next((r for r in load_records(fs, "lost")[0]
                                     if "CHECKPOINTED" in (share / "lost" / r.run_id / "log.txt").read_text()), None)
                       if list((share / "lost").glob("*/log.txt")) else None, timeout=120, message="checkpointed")
    node = printed(share, "lost", first.run_id, "NODE")[0]
    job = SlurmJob.read(fs, "lost", first.run_id)
    slurm.kill_node(node)
    try:
        _kill_job_processes(first.pid)
        [record] = final_records("lost", share, 1, timeout=240)
    finally:
        slurm.restart_node(node)
    assert record.status == "succeeded", record.error
    again = SlurmJob.read(fs, "lost", first.run_id)
    assert again.resubmits == 1 and again.job_id != job.job_id
    assert printed(share, "lost", first.run_id, "RESUMED_FROM")[-1] == "1"


def _kill_job_processes(launcher_pid: int | None) -> None:
    """What a dead node takes with it: the run's launcher and its kernel (slurmd is already gone)."""
    import psutil

    if not launcher_pid:
        return
    try:
        launcher = psutil.Process(launcher_pid)
    except psutil.NoSuchProcess:
        return
    for process in [*launcher.children(recursive=True), launcher]:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


# --- bad input, before anything is queued ---------------------------------------------------------------------


def test_an_unknown_partition_is_refused_naming_the_ones_there(slurm, project, tmp_path):
    with pytest.raises(BackendError, match=r"partition `gpus` does not exist \(did you mean `gpu`\?\)"):
        api.submit(experiment("nopart", tmp_path / "share", backend={"partition": "gpus"}), progress=False)
    assert not (tmp_path / "share" / "nopart").exists() or not list((tmp_path / "share" / "nopart").glob("*/run.json"))


def test_slurms_own_refusal_is_shown_whole_before_queueing(slurm, project, tmp_path):
    """More GPUs per node than any node has: Slurm's --test-only says why, and nothing is queued."""
    share = tmp_path / "share"
    with pytest.raises(BackendError, match="Slurm says: .*(Requested node configuration is not available)"):
        api.submit(experiment("toowide", share, resources={"gpus": 3}), progress=False)
    assert not slurm.run("squeue", "-h", "-t", "all", "-n", "nbbatch-toowide").stdout.strip()


def test_missing_slurm_tools_are_named(project, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    make_notebook(project / "probe.ipynb", [PROBE], parameters="SEED = 0\nSLEEP = 0.5")
    with pytest.raises(BackendError, match="lacks sbatch, squeue, scancel, sinfo.*slurm-client"):
        api.submit(experiment("notools", tmp_path / "share"), progress=False)


def test_a_machine_that_reaches_no_slurm_is_told_what_to_set(project, tmp_path, monkeypatch):
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in TOOLS:  # Slurm's own words where no slurm.conf is found (sinfo on a machine outside any cluster)
        (tools / tool).write_text("#!/bin/sh\necho 'sinfo: fatal: Could not establish a configuration source' >&2\n"
                                  "exit 1\n")
        (tools / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    make_notebook(project / "probe.ipynb", [PROBE], parameters="SEED = 0\nSLEEP = 0.5")
    with pytest.raises(BackendError, match="Could not establish a configuration source\n.*set SLURM_CONF"):
        api.submit(experiment("noconf", tmp_path / "share"), progress=False)


def test_a_share_only_this_machine_sees_is_refused(project, tmp_path, monkeypatch):
    monkeypatch.setattr("nbbatch.backends.slurm.commands.Slurm.node_addresses", lambda self: {"gpu01": "10.1.2.3"})
    monkeypatch.setattr("nbbatch.backends.sharedfs.filesystem_type", lambda path: "ext4")
    backend = SlurmBackend()
    with pytest.raises(BackendError, match="gpu01 are other machines.*shared_folder: true"):
        backend.check_share(FileShare(tmp_path / "share"))
    SlurmBackend(shared_folder=True).check_share(FileShare(tmp_path / "share"))  # declared shared: accepted
    monkeypatch.setattr("nbbatch.backends.sharedfs.filesystem_type", lambda path: "nfs4")
    backend.check_share(FileShare(tmp_path / "share"))  # on NFS: accepted


def test_secret_in_env_is_refused(project, tmp_path):
    with pytest.raises(BackendError, match="looks like a secret"):
        SlurmBackend(env={"HF_TOKEN": "hf_abcdefghijklmnopqrstuvwxyz123456"}).check_secrets()


def test_a_pending_jobs_reason_reaches_status(slurm, project, tmp_path):
    """A job Slurm holds (here: a begin time an hour away) shows why in the run's note."""
    share = tmp_path / "share"
    api.submit(experiment("held", share, backend={"extra_sbatch": ["--begin=now+1hour"]}), wait=False, progress=False)
    try:
        [record] = wait_until(lambda: [r for r in api.status("held", share=str(share)) if "BeginTime" in (r.note or "")]
                              or None, timeout=60, message="a note naming BeginTime")
        assert record.note.startswith("waiting for its start time") and record.status == "queued"
    finally:
        api.cancel("held", share=str(share))
    [record] = final_records("held", share, 1, timeout=60)
    assert record.status == "cancelled"


def test_env_reaches_the_kernel_through_the_batch_script(slurm, project, tmp_path):
    share = tmp_path / "share"
    make_notebook(project / "env.ipynb", ["import os\nprint('GREETING=' + os.environ.get('GREETING', 'none'))"],
                  parameters="SEED = 0")
    result = api.submit(experiment("env", share, "env.ipynb", backend={"env": {"GREETING": "hello-slurm"}}),
                        wait=True, progress=False)
    assert succeeded(result) == result.started
    assert printed(share, "env", result.started[0], "GREETING") == ["hello-slurm"]
    assert os.environ.get("GREETING") is None


def test_a_time_above_the_partitions_limit_is_refused(slurm, project, tmp_path):
    """Slurm accepts a job whose --time is above its partition's MaxTime (without EnforcePartLimits) and leaves it
    pending forever; nbbatch refuses it, saying what made the time so long."""
    share = tmp_path / "share"
    with pytest.raises(BackendError, match=r"needs a 67-minute Slurm job .*partition `gpu` allows at most 1:00:00"):
        api.submit(experiment("long", share, timeout={"run": 3600}, backend={"partition": "gpu"}), progress=False)
    with pytest.raises(BackendError, match=r"the backend's time_limit.*partition `gpu`"):
        api.submit(experiment("long", share, backend={"partition": "gpu", "time_limit": "2:00:00"}), progress=False)
    assert not slurm.run("squeue", "-h", "-t", "all", "-n", "nbbatch-long").stdout.strip()


@pytest.mark.slow
def test_the_pytorch_notebook_trains_over_two_slurm_nodes_to_identical_weights(slurm_cluster, pytorch_env, tmp_path,
                                                                               monkeypatch):
    """A 2-node gloo DDP run of the PyTorch notebook: one launcher per Slurm node, ranks meet at node 0's address
    (published on the share), and end with equal weights."""
    import nbformat
    from support.machine import REPO

    from nbbatch.metrics import metrics_from_notebook

    monkeypatch.setenv("NBBATCH_PROJECT", str(REPO))  # the real frameworks and their envs
    monkeypatch.chdir(tmp_path)
    exp = {"experiment": "slurmddp", "frameworks": ["pytorch"], "distribution": {"type": "torch"},
           "resources": {"nodes": 2, "processes_per_node": 1, "gpus_per_node": 0},
           "parameters": {"DATASET": "digits", "EPOCHS": 2, "MAX_SAMPLES": 400},
           "backend": {"name": "slurm", "cpus": 1, "memory": "2G"}, "share": str(tmp_path / "share")}
    (tmp_path / "ddp.yaml").write_text(yaml.safe_dump(exp))
    (record,) = api.submit(tmp_path / "ddp.yaml", wait=True, progress=False).records
    assert record.status == "succeeded", record.error
    folder = tmp_path / "share" / "slurmddp" / record.run_id
    zero, one = (metrics_from_notebook(nbformat.read(folder / "ranks" / str(r) / "output.ipynb", 4)) for r in (0, 1))
    assert zero["world_size"] == one["world_size"] == 2
    assert zero["weights_checksum"] == pytest.approx(one["weights_checksum"], rel=1e-6)
    assert abs(zero["weights_checksum"] - zero["initial_weights_checksum"]) > 1e-3
    assert [(r.rank, r.node) for r in record.ranks] == [(0, 0), (1, 1)]  # a rank on each node of the job


def test_a_run_gets_the_gpus_slurm_gives_its_job(slurm, project, tmp_path):
    """resources.gpus asks Slurm for GRES GPUs; the kernel sees those Slurm chose (CUDA_VISIBLE_DEVICES), recorded."""
    share = tmp_path / "share"
    make_notebook(project / "cvd.ipynb", ["import os\nprint('CVD=' + os.environ.get('CUDA_VISIBLE_DEVICES', 'unset'))"],
                  parameters="SEED = 0")
    result = api.submit(experiment("gres", share, "cvd.ipynb", resources={"gpus": 2}), wait=True, progress=False)
    [record] = result.records
    assert record.status == "succeeded", record.error
    assert printed(share, "gres", record.run_id, "CVD") == ["0,1"] and record.gpu_ids == [0, 1]


def test_the_runs_own_timeout_comes_before_slurms(slurm, project, tmp_path):
    share = tmp_path / "share"
    result = api.submit(experiment("ownlimit", share, parameters={"SLEEP": 600.0}, timeout={"run": 8}), wait=True,
                        progress=False)
    [record] = result.records
    assert record.status == "timed_out" and record.error.ename != "SlurmTimeLimit", record.error
    job = slurm.job(SlurmJob.read(FileShare(share), "ownlimit", record.run_id).job_id)
    assert job["TimeLimit"] == "00:08:00"  # 8 s + 120 s for the attempt + 300 s for the launcher = 428 s: 8 minutes


def test_an_unknown_gpu_type_is_refused_with_slurms_words(slurm, project, tmp_path):
    with pytest.raises(BackendError, match=r"gpus-per-node=tpu9:1\).*Slurm says: allocation failure: Requested node "
                                           r"configuration is not available.*GPUs there: gpu:2"):
        api.submit(experiment("tpu", tmp_path / "share", resources={"gpus": 1}, backend={"gpu_type": "tpu9"}),
                   progress=False)


def test_a_job_sbatch_refuses_at_submit_fails_only_its_runs_with_slurms_answer(slurm, project, tmp_path, monkeypatch):
    """Should sbatch refuse what --test-only accepted, the runs of that job fail with Slurm's answer, whole."""
    monkeypatch.setattr("nbbatch.backends.slurm.commands.Slurm.test_only", lambda self, args: None)
    share = tmp_path / "share"
    result = api.submit(experiment("refused", share, seeds=2, backend={"extra_sbatch": ["--gres=tpu:1"]}),
                        progress=False)
    assert [r.status for r in result.records] == ["failed", "failed"]
    error = result.records[0].error
    assert error.ename == "SlurmRefused" and "Invalid generic resource (gres) specification" in error.evalue


def test_submitting_again_leaves_runs_in_flight_to_their_jobs(slurm, project, tmp_path):
    share = tmp_path / "share"
    spec = experiment("again", share, seeds=2, parameters={"SLEEP": 600.0})
    first = api.submit(spec, progress=False)
    fs = FileShare(share)
    jobs = {i: SlurmJob.read(fs, "again", i).job_id for i in first.started}
    try:
        again = api.submit(spec, progress=False)
        assert sorted(again.started) == sorted(first.started)
        assert {i: SlurmJob.read(fs, "again", i).job_id for i in first.started} == jobs  # not queued twice
    finally:
        api.cancel("again", share=str(share))
    assert {r.status for r in final_records("again", share, 2, timeout=60)} == {"cancelled"}


def test_a_forced_submission_stops_the_runs_earlier_jobs_first(slurm, project, tmp_path):
    """`submit --force` restarts runs in flight: their earlier jobs are cancelled before the new ones are queued, so
    no run's files are written by two jobs; a pending array task cancelled this way is found under its array's id."""
    share = tmp_path / "share"
    spec = experiment("forced", share, seeds=3, parameters={"SLEEP": 600.0}, backend={"max_parallel": 1})
    first = api.submit(spec, progress=False)
    fs = FileShare(share)
    old = {i: SlurmJob.read(fs, "forced", i).job_id for i in first.started}
    wait_until(lambda: any(r.status == "running" for r in load_records(fs, "forced")[0]), timeout=120,
               message="a run running")
    try:
        again = api.submit(spec, force=True, progress=False)
        assert sorted(again.started) == sorted(old)
        new = {i: SlurmJob.read(fs, "forced", i).job_id for i in old}
        assert all(new[i] != old[i] for i in old) and len({j.split("_")[0] for j in new.values()}) == 1
        ended = {j.split("_")[0] for j in old.values()}
        states = slurm.run("squeue", "-h", "-r", "-t", "all", "-o", "%T", "-j", ",".join(ended)).stdout.split()
        assert states and set(states) <= {"CANCELLED"}, states  # every earlier job, running or pending, ended first
    finally:
        api.cancel("forced", share=str(share))
    assert {r.status for r in final_records("forced", share, 3, timeout=60)} == {"cancelled"}


def test_array_tasks_are_found_also_where_squeue_names_them_by_the_array():
    """squeue lists array tasks that never split off (pending, or cancelled while pending) once, under the array's
    id (``33|33|N/A``): such a task is found there, not taken for a job Slurm forgot (a lost run)."""
    from nbbatch.backends.slurm.commands import _queued_jobs, find_job

    queue = _queued_jobs("33|33|N/A|CANCELLED|JobArrayTaskLimit|\n33_0|33|0|COMPLETED|None|node2\n"
                         "34|34|N/A|RUNNING|None|node1\n")
    assert find_job(queue, "33_0").state == "COMPLETED"
    assert find_job(queue, "33_5").state == "CANCELLED"
    assert find_job(queue, "34").state == "RUNNING" and find_job(queue, "35_1") is None


def test_another_machine_sees_how_slurm_ended_the_jobs(slurm, project, tmp_path, monkeypatch):
    """Jobs ended by Slurm alone (an admin's scancel): from a machine that only sees the share, `status` asks Slurm
    (the backend named in the share's manifest) and ends both runs, the running and the pending one, as cancelled."""
    share = tmp_path / "share"
    api.submit(experiment("admin", share, seeds=2, parameters={"SLEEP": 600.0}, backend={"max_parallel": 1}),
               progress=False)
    fs = FileShare(share)
    wait_until(lambda: any(r.status == "running" for r in load_records(fs, "admin")[0]), timeout=120,
               message="a run running")
    slurm.run("scancel", "-n", "nbbatch-admin")
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "frameworks").mkdir(parents=True)
    (elsewhere / ".nbbatch").mkdir()
    monkeypatch.chdir(elsewhere)
    records = final_records("admin", share, 2, timeout=60)
    assert [r.status for r in records] == ["cancelled", "cancelled"], [r.error for r in records]
    assert {r.error.reason for r in records} == {"cancelled in Slurm (scancel)"}


# --- Slurm ending jobs by itself (issue 45) -------------------------------------------------------------------

TWO_CELLS = ['print("FIRST CELL DONE", flush=True)',
             'import time\nprint("IN SECOND CELL", flush=True)\ntime.sleep(SLEEP)\nprint("NEVER")']


def test_a_job_scancelled_mid_cell_keeps_the_cells_run_so_far(slurm, project, tmp_path):
    """A hand `scancel` of a running job (Slurm's SIGTERM to every process of the job, the kernel too, SIGKILL after
    KillWait): run-one saves the notebook as far as it ran, the stopped cell marked, and ends the run cancelled, saying
    Slurm stopped it. Before, run-one died at once and output.ipynb never appeared."""
    make_notebook(project / "two.ipynb", TWO_CELLS, parameters="SEED = 0\nSLEEP = 600.0")
    share = tmp_path / "share"
    api.submit(experiment("scancelled", share, "two.ipynb"), progress=False)
    fs = FileShare(share)
    running = wait_until(lambda: next((r for r in load_records(fs, "scancelled")[0] if "IN SECOND CELL" in
                                       (share / "scancelled" / r.run_id / "log.txt").read_text(errors="replace")),
                                      None) if list((share / "scancelled").glob("*/log.txt")) else None,
                         timeout=120, message="the second cell running")
    slurm.run("scancel", SlurmJob.read(fs, "scancelled", running.run_id).job_id)
    [record] = final_records("scancelled", share, 1, timeout=60)
    assert record.status == "cancelled", record.error
    assert record.error.reason == "cancelled in Slurm (scancel)" and record.error.cell_index is not None, record.error
    notebook = (share / "scancelled" / record.run_id / "output.ipynb").read_text()
    assert "FIRST CELL DONE" in notebook and "IN SECOND CELL" in notebook and "NEVER" not in notebook.replace(
        'print(\\"NEVER\\")', "")
    assert "nbbatch stopped this run: cancelled in Slurm (scancel)" in notebook


def test_a_pending_run_scancelled_by_hand_is_cancelled_never_submitted_again(slurm, project, tmp_path):
    """Issue 45 item 1 on the real cluster: with retries left, a pending array task cancelled by hand ends its run
    cancelled (Slurm says how the job ended), and is never submitted again; the other run is untouched."""
    share = tmp_path / "share"
    api.submit(experiment("handcancel", share, seeds=2, parameters={"SLEEP": 8.0}, retries=1,
                          backend={"max_parallel": 1}), progress=False)
    fs = FileShare(share)
    running = wait_until(lambda: next((r for r in load_records(fs, "handcancel")[0] if r.status == "running"), None),
                         timeout=120, message="one run running")
    pending = next(r for r in load_records(fs, "handcancel")[0] if r.run_id != running.run_id)
    job = SlurmJob.read(fs, "handcancel", pending.run_id)
    slurm.run("scancel", job.job_id)
    records = {r.run_id: r for r in final_records("handcancel", share, 2, timeout=120)}
    assert records[pending.run_id].status == "cancelled", records[pending.run_id].error
    assert records[running.run_id].status == "succeeded", records[running.run_id].error
    again = SlurmJob.read(fs, "handcancel", pending.run_id)
    assert (again.job_id, again.resubmits) == (job.job_id, 0)
    wait_until(lambda: not slurm.run("squeue", "-h", "-n", "nbbatch-handcancel").stdout.strip(), timeout=60,
               message="the other run's job to end")
    assert SlurmJob.read(fs, "handcancel", pending.run_id).resubmits == 0  # no later refresh submitted it again


def test_status_while_slurmctld_does_not_answer_says_so_once_and_changes_nothing(slurm, project, tmp_path, monkeypatch,
                                                                                  capsys):
    """Issue 45 item 11: slurmctld unreachable (here: this process's Slurm commands pointed at a port where none
    listens, which Slurm's commands answer as for a stopped slurmctld, "Unable to contact slurm controller", after
    their MessageTimeout). `status` says once that Slurm could not be asked, with Slurm's own line, shows the records
    as last known, `--check` fails, and no run is called lost or submitted again."""
    from nbbatch.ui.cli import main

    share = tmp_path / "share"
    api.submit(experiment("noctld", share, seeds=2, parameters={"SLEEP": 600.0}, retries=1,
                          backend={"max_parallel": 1}), progress=False)
    fs = FileShare(share)
    wait_until(lambda: {r.status for r in load_records(fs, "noctld")[0]} == {"running", "queued"}, timeout=120,
               message="one run running, one queued")
    jobs = {i: SlurmJob.read(fs, "noctld", i).job_id for i in (r.run_id for r in load_records(fs, "noctld")[0])}
    down = tmp_path / "down.conf"
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    down.write_text(slurm.conf.read_text().replace(f"SlurmctldPort={slurm.ctld_port}",
                                                   f"SlurmctldPort={free.getsockname()[1]}"))
    free.close()
    try:
        monkeypatch.setenv("SLURM_CONF", str(down))
        capsys.readouterr()
        checked = main(["status", "noctld", "--share", str(share), "--check"])
        out, err = capsys.readouterr()
        plain = main(["status", "noctld", "--share", str(share), "--json"])
        _, err_json = capsys.readouterr()
        monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
        after = {r.run_id: r for r in load_records(fs, "noctld")[0]}
    finally:
        monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
        api.cancel("noctld", share=str(share))
    assert checked != 0 and plain == 0
    for said in (err, err_json):
        assert said.count("Unable to contact slurm controller") == 1, said
        assert "could not ask the `slurm` backend" in said and "may be behind" in said
    assert sorted(r.status for r in after.values()) == ["queued", "running"], [r.error for r in after.values()]
    assert {i: SlurmJob.read(fs, "noctld", i).job_id for i in after} == jobs  # nothing submitted again
