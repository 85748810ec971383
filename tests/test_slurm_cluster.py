"""The ``slurm_cluster`` fixture gives a real, working two-node Slurm cluster (tests/support/slurm.py)."""

from __future__ import annotations

import socket

import pytest
from support.processes import gone
from support.slurm import NODES, SlurmCluster, slurm_available
from support.waiting import wait_until

pytestmark = pytest.mark.slurm


def test_batch_job_runs_and_writes_its_output(slurm_cluster, tmp_path):
    job = slurm_cluster.sbatch("-o", f"{tmp_path}/out-%j.txt", "--wrap", "hostname")

    fields = slurm_cluster.wait_job_done(job)

    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0")
    assert (tmp_path / f"out-{job}.txt").read_text().strip() == socket.gethostname()


def test_job_array_runs_every_task_never_more_than_the_throttle_at_once(slurm_cluster, tmp_path):
    # Each task records when it ran; Slurm marks it running before it starts and ended after it stops, so the
    # recorded spans lie inside Slurm's and can only overlap less than the throttle allows.
    script = 'date +%s.%N > "$OUT"; echo "$SLURM_ARRAY_TASK_ID"; sleep 1; date +%s.%N >> "$OUT"'
    job = slurm_cluster.sbatch("--array=0-3%2", "-o", f"{tmp_path}/arr-%A_%a.txt", "--wrap",
                               f'OUT={tmp_path}/span-$SLURM_ARRAY_TASK_ID; {script}')

    for task in range(4):
        assert slurm_cluster.wait_job_done(f"{job}_{task}")["JobState"] == "COMPLETED"

    assert [(tmp_path / f"arr-{job}_{task}.txt").read_text().strip() for task in range(4)] == ["0", "1", "2", "3"]
    spans = [tuple(map(float, (tmp_path / f"span-{task}").read_text().split())) for task in range(4)]
    for start, _ in spans:
        assert sum(begin <= start < end for begin, end in spans) <= 2


def test_two_node_job_runs_one_task_per_node(slurm_cluster, tmp_path):
    job = slurm_cluster.sbatch("-N2", "--ntasks-per-node=1", "-o", f"{tmp_path}/out-%j.txt", "--wrap",
                               "srun bash -c 'echo $SLURM_NODEID $SLURMD_NODENAME'")

    assert slurm_cluster.wait_job_done(job)["JobState"] == "COMPLETED"
    assert sorted((tmp_path / f"out-{job}.txt").read_text().splitlines()) == ["0 node1", "1 node2"]


def test_gpus_asked_for_are_visible_to_the_job(slurm_cluster, tmp_path):
    job = slurm_cluster.sbatch("-p", "gpu", "-n1", "--gpus-per-task=1", "-o", f"{tmp_path}/out-%j.txt", "--wrap",
                               'echo "$CUDA_VISIBLE_DEVICES"')

    assert slurm_cluster.wait_job_done(job)["JobState"] == "COMPLETED"
    assert (tmp_path / f"out-{job}.txt").read_text().strip() in {"0", "1"}


def test_test_only_refuses_an_unknown_partition_by_name(slurm_cluster):
    refused = slurm_cluster.run("sbatch", "--test-only", "-p", "nosuch", "--wrap", "true", check=False)

    assert refused.returncode != 0
    assert "invalid partition specified: nosuch" in refused.stderr


@pytest.mark.parametrize(("options", "message"), [
    (["--gres=tpu:1"], "Invalid generic resource (gres) specification"),
    (["--gpus-per-node=3"], "Requested node configuration is not available"),
    (["-N", "3"], "Requested node configuration is not available"),
    (["--mem=999999"], "Requested node configuration is not available"),
])
def test_test_only_refuses_what_no_node_has(slurm_cluster, options, message):
    refused = slurm_cluster.run("sbatch", "--test-only", *options, "--wrap", "true", check=False)

    assert refused.returncode != 0
    assert message in refused.stderr


def test_finished_jobs_stay_visible_with_their_exit_code(slurm_cluster):
    job = slurm_cluster.sbatch("-o", "/dev/null", "--wrap", "exit 3")

    fields = slurm_cluster.wait_job_done(job)

    assert (fields["JobState"], fields["ExitCode"], fields["Reason"]) == ("FAILED", "3:0", "NonZeroExitCode")
    listed = slurm_cluster.run("squeue", "-h", "-t", "all", "-o", "%i|%T|%r", "-j", job).stdout.strip()
    assert listed == f"{job}|FAILED|NonZeroExitCode"


def test_stop_leaves_no_process_behind_and_a_killed_node_comes_back(tmp_path_factory):
    reason = slurm_available()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm-own"))
    try:
        cluster.start()
        killed = cluster.node_pid("node1")
        cluster.kill_node("node1")
        assert gone(killed)
        cluster.restart_node("node1")
        assert cluster.node_pid("node1") != killed
        cluster.sbatch("-N2", "-o", "/dev/null", "--wrap", "srun sleep 300")  # a job step on each node, left running
        wait_until(lambda: cluster.run("squeue", "-h", "-t", "R", "-o", "%i").stdout.strip(), timeout=60,
                   message="the sleeping job to run")
        pids = cluster.pids()
        assert len(pids) > 2 + len(NODES)  # munged, slurmctld, the slurmd's and more: slurmscriptd, the job's
    finally:
        cluster.stop()
    cluster.stop()  # idempotent

    assert [pid for pid in pids if not gone(pid)] == []
    assert cluster.pids() == []
