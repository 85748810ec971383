"""The slurm backend's decisions against a Slurm double (no cluster): what it asks Slurm, what it submits, and how
it reads Slurm's answers (issue 45). tests/test_slurm_backend.py runs the same paths on a real cluster."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from nbbatch.backends.base import SubmitOptions
from nbbatch.backends.slurm import SlurmBackend, SlurmJob
from nbbatch.backends.slurm.commands import QueuedJob
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
    submitted: list[list[str]] = field(default_factory=list)

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
