"""``.nbbatch/experiments.json``: rewritten under a lock through a temporary file of its own, readable by its owner."""

from __future__ import annotations

import multiprocessing
import stat
from pathlib import Path

import pytest

from nbbatch.spec.project import Project
from nbbatch.store.known import REGISTRY_FILE, lookup, open_experiment_share, remember
from nbbatch.store.share import FileShare

pytestmark = pytest.mark.timeout(120)

WRITERS, WRITES = 6, 15


def _writer(root: str, index: int) -> None:
    project = Project(Path(root))
    for i in range(WRITES):
        remember(project, f"exp-{index}", f"/shares/{index}", "local", {"round": i})


def test_concurrent_submissions_keep_every_experiment(tmp_path):
    """Writers at once each record their own experiment: none is lost, none fails on another's temporary file."""
    context = multiprocessing.get_context("fork")
    procs = [context.Process(target=_writer, args=(str(tmp_path), i)) for i in range(WRITERS)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
    assert [proc.exitcode for proc in procs] == [0] * WRITERS  # a writer whose temporary file was taken fails
    project = Project(tmp_path)
    for i in range(WRITERS):
        assert lookup(project, f"exp-{i}")["backend_settings"] == {"round": WRITES - 1}, f"exp-{i} was lost"
    registry = project.state_dir / REGISTRY_FILE
    assert stat.S_IMODE(registry.stat().st_mode) == 0o600
    assert sorted(p.name for p in registry.parent.iterdir()) == [REGISTRY_FILE, REGISTRY_FILE + ".lock"]


def test_an_experiments_share_is_found_by_its_name(project):
    """The one answer to "where are experiment X's results": the share given, else where X was last submitted
    from this project, else the project's results/."""
    remember(Project(project), "sweep", str(project / "elsewhere"), "local", {})
    name, share = open_experiment_share("sweep")
    assert name == "sweep" and share.local_path("") == project / "elsewhere"
    assert open_experiment_share("never-submitted")[1].local_path("") == Project(project).results_dir
    assert open_experiment_share("sweep", str(project / "given"))[1].local_path("") == project / "given"
    given = FileShare(project / "mine")
    assert open_experiment_share("sweep", given) == ("sweep", given)
