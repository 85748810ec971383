"""The slurm backend's decisions against a Slurm double (no cluster): what it asks Slurm, what it submits, and how
it reads Slurm's answers (issue 45). tests/test_slurm_backend.py runs the same paths on a real cluster."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from nbbatch.backends.base import SubmitOptions
from nbbatch.backends.slurm import SlurmBackend, SlurmJob
from nbbatch.backends.slurm.commands import Partition, QueuedJob, Slurm
from nbbatch.errors import BackendError
from nbbatch.plan.runs import Run
from nbbatch.store.runfiles import new_record, read_record, write_record
from nbbatch.store.share import FileShare

pytestmark = pytest.mark.timeout(60)


@dataclass
class SlurmDouble:
    """What the backend asks Slurm, answered from fields a test sets; ``submitted`` keeps every sbatch's options."""

    queued: dict[str, QueuedJob] = field(default_factory=dict)  # what squeue lists
    details: dict[str, dict[str, str]] = field(default_factory=dict)  # scontrol show job, by job id
    config: dict[str, str] = field(default_factory=dict)  # scontrol show config
    node_memory: dict[str, list[int]] = field(default_factory=lambda: {"debug": [8000, 8000]})  # sinfo's %m
    cluster_default_memory: bool = False  # DefMemPerCPU or DefMemPerNode set
    refusal: str | None = None  # what sbatch --test-only says
    completed: dict[str, tuple[str, str]] = field(default_factory=dict)  # the job-completion log: state, exit code
    submitted: list[list[str]] = field(default_factory=list)
    tested: list[list[str]] = field(default_factory=list)

    def missing_tools(self) -> list[str]:
        return []

    def partitions(self) -> list[Partition]:
        return [Partition("debug", True, True, "infinite", 2, "gpu:2")]

    def default_memory(self, partition: str | None) -> bool:
        return self.cluster_default_memory

    def node_memory_mb(self) -> dict[str, list[int]]:
        return dict(self.node_memory)

    def completion_log_states(self, job_ids) -> dict[str, tuple[str, str]]:
        return {j: self.completed[j] for j in job_ids if j in self.completed}

    def test_only(self, args) -> str | None:
        self.tested.append(list(args))
        return self.refusal

    def submit(self, args, script: str) -> str:
        self.submitted.append(list(args))
        return str(100 + len(self.submitted))

    def queue(self, job_ids) -> dict[str, QueuedJob]:
        return dict(self.queued)

    def named_jobs(self, name: str) -> dict[str, QueuedJob]:
        return dict(self.queued)

    def job_details(self, job_id: str) -> dict[str, str]:
        return self.details.get(job_id, {})

    def accounting(self) -> bool:
        return False

    def show_config(self) -> dict[str, str]:
        return dict(self.config)


def _runs(project: Path, count: int, retries: int = 1) -> list[Run]:
    notebook = project / "probe.ipynb"
    notebook.write_text("{}")
    return [Run(f"probe-{i}", "exp", str(notebook), "probe.ipynb", "python3", parameters={"SEED": i}, retries=retries)
            for i in range(count)]


def _submitted(project: Path, tmp_path: Path, count: int, max_parallel: int | None,
               **settings) -> tuple[SlurmBackend, SlurmDouble, FileShare, list[Run]]:
    """``count`` runs submitted as one array (their queued records written), Slurm a double."""
    backend = SlurmBackend(max_parallel=max_parallel, **settings)
    backend.slurm = slurm = SlurmDouble()
    share = FileShare(tmp_path / "share")
    runs = _runs(project, count)
    for run in runs:
        write_record(share, new_record(run, "slurm"))
    backend.start(runs, share, SubmitOptions())
    return backend, slurm, share, runs


def test_a_lost_run_submitted_again_keeps_to_max_parallel(project, tmp_path):
    """max_parallel: 1, two runs in one array (%1); the running one's job is lost: its new job, a job of its own
    beside the array, waits (singleton) until no job of the experiment runs, so never two at once."""
    backend, slurm, share, runs = _submitted(project, tmp_path, 2, 1)
    assert [a for a in slurm.submitted[0] if a.startswith("--array")] == ["--array=0-1%1"]
    first = SlurmJob.read(share, "exp", runs[0].run_id)
    assert first.max_parallel == 1
    slurm.queued = {"101_1": QueuedJob("101_1", "PENDING", "JobArrayTaskLimit")}  # task 0's job is gone
    backend.sync("exp", share)
    again = SlurmJob.read(share, "exp", runs[0].run_id)
    assert again.job_id != first.job_id and again.resubmits == 1 and again.max_parallel == 1
    assert "--dependency=singleton" in slurm.submitted[1], slurm.submitted[1]
    assert read_record(share, "exp", runs[0].run_id).status == "queued"


def test_a_lost_run_without_a_limit_is_submitted_again_at_once(project, tmp_path):
    backend, slurm, share, runs = _submitted(project, tmp_path, 1, None)
    backend.sync("exp", share)
    assert len(slurm.submitted) == 2 and not any(a.startswith("--dependency") for a in slurm.submitted[1])


def _memory(args: list[str]) -> list[str]:
    return [a for a in args if a.startswith("--mem")]


def test_without_a_memory_setting_a_run_asks_what_the_partitions_nodes_have(project, tmp_path):
    """Nodes of 8000 MB, no DefMemPerCPU: 8G would be refused, so a run asks 8000M (not the whole node by leaving
    --mem out); nodes of 64 GB: 8G."""
    _backend, slurm, _share, _runs = _submitted(project, tmp_path, 1, None)
    assert _memory(slurm.submitted[0]) == ["--mem=8000M"]
    backend = SlurmBackend()
    backend.slurm = big = SlurmDouble(node_memory={"debug": [65536]})
    backend.start(_runs_of(project), FileShare(tmp_path / "big"), SubmitOptions())
    assert _memory(big.submitted[0]) == ["--mem=8G"]


def test_where_the_cluster_gives_jobs_memory_a_run_asks_none(project, tmp_path):
    backend = SlurmBackend()
    backend.slurm = slurm = SlurmDouble(cluster_default_memory=True)
    backend.check(_runs_of(project))
    backend.start(_runs_of(project), FileShare(tmp_path / "share"), SubmitOptions())
    assert not _memory(slurm.tested[0]) and not _memory(slurm.submitted[0])


def test_a_memory_slurm_refuses_is_compared_with_the_nodes_and_the_setting_named(project, tmp_path):
    backend = SlurmBackend(memory="8G")
    backend.slurm = SlurmDouble(refusal="sbatch: error: Memory specification can not be satisfied")
    with pytest.raises(BackendError, match=r"Slurm says: sbatch: error: Memory specification can not be satisfied\. "
                                           r"The backend setting `memory: 8G` asks 8192 MB per node, but the nodes of "
                                           r"partition `debug` have at most 8000 MB \(sinfo\): set `memory` to at most "
                                           r"8000M"):
        backend.check(_runs_of(project))


def _runs_of(project: Path) -> list[Run]:
    return _runs(project, 1)


def test_a_pending_run_scancelled_by_hand_ends_cancelled_and_is_never_submitted_again(project, tmp_path):
    """squeue and scontrol no longer know the pending task, there is no accounting: the job-completion log says
    CANCELLED, so the run is cancelled (by Slurm, outside nbbatch), not lost, and not resubmitted (retries: 1)."""
    backend, slurm, share, runs = _submitted(project, tmp_path, 2, 1)
    slurm.queued = {"101_0": QueuedJob("101_0", "RUNNING", "None")}
    slurm.completed = {"101_1": ("CANCELLED", "0:0")}
    backend.sync("exp", share)
    record = read_record(share, "exp", runs[1].run_id)
    assert record.status == "cancelled" and record.error.reason == "cancelled in Slurm (scancel)", record.error
    assert len(slurm.submitted) == 1 and SlurmJob.read(share, "exp", runs[1].run_id).resubmits == 0


def test_the_job_completion_log_is_read_for_jobs_and_array_tasks(tmp_path, monkeypatch):
    """jobcomp/filetxt's lines (Slurm 22.05): a job by JobId, an array task by ArrayJobId and ArrayTaskId, and tasks
    that never left their array (cancelled together while pending) by the array's JobId on a line without them; the
    last line of a job wins; no log, or another plug-in: nothing."""
    log = tmp_path / "jobcomp.txt"
    log.write_text(
        "JobId=84 UserId=root(0) Name=nbbatch-e JobState=CANCELLED Partition=debug DerivedExitCode=0:0 ExitCode=0:0\n"
        "JobId=85 UserId=root(0) Name=nbbatch-e JobState=CANCELLED ArrayJobId=84 ArrayTaskId=1 ExitCode=0:15\n"
        "JobId=86 UserId=root(0) Name=nbbatch-e JobState=COMPLETED ArrayJobId=86 ArrayTaskId=2 ExitCode=0:0\n"
        "JobId=90 UserId=root(0) Name=x JobState=FAILED ExitCode=1:0\n"
        "JobId=90 UserId=root(0) Name=x JobState=TIMEOUT ExitCode=0:1\n")
    config = {"JobCompType": "jobcomp/filetxt", "JobCompLoc": str(log)}
    monkeypatch.setattr(Slurm, "show_config", lambda self: dict(config))
    found = Slurm().completion_log_states(["84_1", "84_4", "86_2", "86_0", "90", "85_0", "91"])
    assert found == {"84_1": ("CANCELLED", "0:15"), "84_4": ("CANCELLED", "0:0"), "86_2": ("COMPLETED", "0:0"),
                     "90": ("TIMEOUT", "0:1")}
    config["JobCompType"] = "jobcomp/none"
    assert Slurm().completion_log_states(["90"]) == {}
    config.update(JobCompType="jobcomp/filetxt", JobCompLoc=str(tmp_path / "elsewhere.txt"))
    assert Slurm().completion_log_states(["90"]) == {}


@pytest.mark.parametrize(("fields", "status", "reason"), [
    ({"JobState": "COMPLETING", "Reason": "TimeLimit"}, "timed_out", "stopped by Slurm's time limit (SIGTERM)"),
    ({"JobState": "TIMEOUT", "Reason": "TimeLimit"}, "timed_out", "stopped by Slurm's time limit (SIGTERM)"),
    ({"JobState": "COMPLETING", "Reason": "None"}, "cancelled", "cancelled in Slurm (scancel)"),
    ({"JobState": "CANCELLED", "Reason": "None"}, "cancelled", "cancelled in Slurm (scancel)"),
    ({"JobState": "PREEMPTED", "Reason": "Preempted"}, "cancelled", "stopped by Slurm (SIGTERM: scancel, its time"),
    (None, "cancelled", "stopped by Slurm (SIGTERM: scancel, its time"),  # slurmctld did not answer
])
def test_a_launcher_stopped_by_slurm_asks_slurm_why(monkeypatch, fields, status, reason):
    """The node stop hook (issue 45 item 3): Slurm's SIGTERM is its time limit or a scancel, as scontrol says."""
    import signal

    from nbbatch.backends.slurm.commands import SlurmCommandError
    from nbbatch.backends.slurm.jobs import slurm_stop_request

    def details(self, job_id, timeout=60.0):
        assert job_id == "7_1" and timeout <= 5
        if fields is None:
            raise SlurmCommandError("`scontrol show` got no answer from Slurm within 3 s")
        return fields
    monkeypatch.setattr(Slurm, "job_details", details)
    environ = {"SLURM_JOB_ID": "9", "SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "1"}

    request = slurm_stop_request(signal.SIGTERM, environ)

    assert request.status == status and request.reason.startswith(reason) and "job 7_1" in request.evalue
    assert slurm_stop_request(signal.SIGTERM, {}) is None  # not in a Slurm job: the signal's own words


def _fake_scontrol(tmp_path: Path, says: str) -> Slurm:
    """Slurm's commands where ``scontrol`` exits 1 saying ``says`` (as a real one does with slurmctld down)."""
    folder = tmp_path / "bin"
    folder.mkdir(exist_ok=True)
    tool = folder / "scontrol"
    tool.write_text(f"#!/bin/sh\necho '{says}' >&2\nexit 1\n")
    tool.chmod(0o755)
    import os

    return Slurm(env={"PATH": f"{folder}:{os.environ['PATH']}"})


def test_slurm_that_does_not_answer_is_never_a_job_it_forgot(tmp_path):
    """Issue 45 item 11: `scontrol` with slurmctld down exits 1 ("Unable to contact slurm controller"), as it does for
    a job slurmctld forgot ("Invalid job id specified"). Only the latter is "no such job"; the former raises, so a
    refresh says Slurm could not be asked instead of ending runs as lost (or submitting them again)."""
    from nbbatch.backends.slurm.commands import SlurmCommandError

    down = _fake_scontrol(tmp_path, "slurm_load_jobs error: Unable to contact slurm controller (connect failure)")
    with pytest.raises(SlurmCommandError, match="Unable to contact slurm controller"):
        down.job_details("5_1")
    with pytest.raises(SlurmCommandError, match="Unable to contact slurm controller"):
        down.accounting()
    with pytest.raises(SlurmCommandError, match="Unable to contact slurm controller"):
        down.completion_log_states(["5_1"])
    assert _fake_scontrol(tmp_path, "slurm_load_jobs error: Invalid job id specified").job_details("5_1") == {}


def test_a_refresh_slurm_does_not_answer_leaves_the_runs_as_they_were(project, tmp_path):
    """squeue answered (the job is gone from it), then slurmctld went away: the refresh fails, saying so; the run is
    not lost, not submitted again, and its record is as it was."""
    from nbbatch.backends.slurm.commands import SlurmCommandError
    from nbbatch.results.status import refresh_records

    backend, slurm, share, runs = _submitted(project, tmp_path, 1, None)

    def down(job_id: str, timeout: float = 60.0) -> dict[str, str]:
        raise SlurmCommandError("`scontrol show` failed (exit 1): slurm_load_jobs error: Unable to contact slurm "
                                "controller (connect failure)")
    slurm.job_details = down
    outcome = refresh_records(lambda: backend, "exp", share)
    assert "Unable to contact slurm controller" in outcome.note and "may be behind" in outcome.note
    assert len(slurm.submitted) == 1 and read_record(share, "exp", runs[0].run_id).status == "queued"
    assert SlurmJob.read(share, "exp", runs[0].run_id).resubmits == 0
