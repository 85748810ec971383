"""The share and the project's records under a demanding user (issue 34, items 2, 9, 10, 16, 17, 18, 22): a full share
at submit, folder modes on a shared folder, a damaged experiments.json, fetch and cancel of what is not there, symlinks
on the share, and an experiment path that is a file. No kernel starts here: every case stops before a run would."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.tmpfs import mounted_tmpfs

import nbbatch
from nbbatch.errors import LockedError, NbbatchError, ShareError
from nbbatch.execute.folders import RunFolders
from nbbatch.plan.runs import Run
from nbbatch.spec.project import Project
from nbbatch.store import share as share_module
from nbbatch.store.fetch import fetch
from nbbatch.store.known import remember
from nbbatch.store.lease import ShareLease
from nbbatch.store.share import FileShare
from nbbatch.store.sync import pull
from nbbatch.ui.cli import main

pytestmark = pytest.mark.timeout(120)

EXPERIMENT = "experiment: {name}\nnotebooks: [nb.ipynb]\nshare: {share}\n"


def _notebook(folder: Path) -> None:
    """A notebook that plans (a parameters cell, the python3 kernel); never executed here."""
    cells = [{"cell_type": "code", "metadata": {"tags": ["parameters"]}, "source": "A = 1", "outputs": [],
              "execution_count": None, "id": "p"}]
    (folder / "nb.ipynb").write_text(json.dumps({
        "cells": cells, "nbformat": 4, "nbformat_minor": 5,
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}}))


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nbbatch", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=100)


def _results(root: Path, experiment: str = "exp", runs: tuple[str, ...] = ("run-a", "run-b")) -> Path:
    """A share holding ``experiment`` with finished runs (their files, as a submit leaves them)."""
    for run in runs:
        folder = root / experiment / run
        (folder / "outputs" / "figures").mkdir(parents=True)
        (folder / "output.ipynb").write_text("{}")
        (folder / "run.json").write_text("{}")
        (folder / "outputs" / "model.bin").write_bytes(b"weights of " + run.encode())
        (folder / "outputs" / "figures" / "loss.png").write_bytes(b"png")
    return root


# --- 2. a full share at submit ------------------------------------------------------------------------

@pytest.fixture
def full_share(project):
    """A tmpfs of 1 MiB as the share, filled (root only: mount -t tmpfs); skipped where mounting is not allowed."""
    with mounted_tmpfs(project / "share", "1m") as mountpoint:
        with open(mountpoint / "filler", "wb") as filler:
            try:
                while True:
                    filler.write(b"\0" * 65536)
                    filler.flush()
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
        yield mountpoint


def test_a_full_share_at_submit_is_one_clear_error_and_the_next_submit_is_not_locked_out(project, full_share):
    _notebook(project)
    (project / "exp.yaml").write_text(EXPERIMENT.format(name="full", share="share"))
    done = _cli("submit", "exp.yaml", "-q", cwd=project)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("nbbatch: error: the share at ") and "out of space" in done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1
    assert not (full_share / "full" / ".lease").exists()  # nothing half-written is left to lock the experiment

    (full_share / "filler").unlink()  # space is freed: the experiment can be driven at once
    with ShareLease(FileShare(full_share), "full") as lease:
        assert lease.supported and (full_share / "full" / ".lease").stat().st_size > 0


def test_a_lease_that_cannot_be_written_is_removed(tmp_path, monkeypatch):
    """The same as above where no tmpfs can be mounted: the holder's write fails with ENOSPC."""
    def no_space(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    share = FileShare(tmp_path / "share")
    with monkeypatch.context() as patch:
        patch.setattr(share_module.os, "fsync", no_space)
        with pytest.raises(ShareError, match="out of space while writing `exp/.lease`"):
            ShareLease(share, "exp").__enter__()
    assert not (tmp_path / "share" / "exp" / ".lease").exists()
    with ShareLease(share, "exp"):
        pass


def test_an_empty_lease_left_by_a_crash_is_not_a_live_holder(tmp_path):
    share = FileShare(tmp_path / "share")
    lease = tmp_path / "share" / "exp" / ".lease"
    lease.parent.mkdir(parents=True)
    lease.write_bytes(b"")  # a holder being written right now: respected
    with pytest.raises(LockedError):
        ShareLease(share, "exp").__enter__()
    a_while_ago = time.time() - 30  # sooner than the 120 s after which any holder is stale
    for content in (b"", b"{not json", b"[1, 2]"):  # left by a crash between the creation and the write
        lease.write_bytes(content)
        os.utime(lease, (a_while_ago, a_while_ago))
        with ShareLease(share, "exp") as ours:
            assert not ours.recovered_from  # nobody to name in a warning
        assert not lease.exists()


# --- 22. the experiment's path is a file -----------------------------------------------------------------

def test_an_experiment_path_that_is_a_file_is_named_as_a_file(project, write_experiment):
    _notebook(project)
    (project / "results").mkdir()
    (project / "results" / "taken").write_text("not a folder")
    write_experiment(EXPERIMENT.format(name="taken", share="results"))
    with pytest.raises(NbbatchError) as caught:
        nbbatch.submit(project / "exp.yaml", progress=False)
    message = str(caught.value)
    assert message.startswith(f"{project / 'results' / 'taken'} is a file") and ".lock" not in message
    assert (project / "results" / "taken").read_text() == "not a folder"
    share = FileShare(project / "results")
    with pytest.raises(ShareError, match="taken is a file"):
        ShareLease(share, "taken").__enter__()  # the lease alone (a share without the local lock)
    with pytest.raises(NbbatchError, match="is a file, not the folder of experiment `taken`"):
        fetch(share, "taken", project / "got")


# --- 10. a damaged experiments.json ------------------------------------------------------------------------

@pytest.mark.parametrize("damage", ['{"a": {"share": "/shares/a"},}', '["a", "b"]', '"a"', '{"a": "/shares/a"}'])
def test_a_damaged_experiments_json_is_never_overwritten_and_refused_clearly(project, capsys, damage):
    registry = project / ".nbbatch" / "experiments.json"
    registry.write_text(damage)
    if not damage.startswith("{\"a\": \""):  # (a damaged entry alone: the others are still recorded)
        with pytest.raises(NbbatchError, match="experiments.json cannot be read") as caught:
            remember(Project(project), "b", str(project / "results"), "local", {})
        assert "Repair it" in str(caught.value) and "delete it" in str(caught.value)
        assert registry.read_text() == damage  # the other experiments' shares are not lost
    for command in (["status", "a"], ["cancel", "a"], ["fetch", "a", "got"]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"nbbatch: error: {registry} cannot be read") and "Traceback" not in err
    assert registry.read_text() == damage


# --- 9. folder modes and a colleague's fetch ----------------------------------------------------------------

def test_a_runs_outputs_and_checkpoints_follow_the_umask_on_a_folder_share(project):
    run = Run(run_id="modes", experiment="perm", notebook=str(project / "nb.ipynb"), notebook_rel="nb.ipynb",
              kernel="python3")
    old = os.umask(0o022)
    try:
        folders = RunFolders(run, FileShare(project / "results"))
    finally:
        os.umask(old)
    assert not folders.remote
    for folder in (folders.outputs, folders.checkpoints, folders.outputs.parent):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o755, folder


def _refuse(monkeypatch, *denied: str) -> None:
    """Files and folders of a FileShare that this user may not read (tests run as root, which chmod cannot stop)."""
    read_bytes, listing = FileShare.read_bytes, FileShare.list

    def guarded_read(self, path):
        if any(path.endswith(d) for d in denied):
            raise PermissionError(errno.EACCES, "Permission denied", str(self.root / path))
        return read_bytes(self, path)

    def guarded_list(self, path=""):
        if any(path.endswith(d) for d in denied):
            raise PermissionError(errno.EACCES, "Permission denied", str(self.root / path))
        return listing(self, path)

    monkeypatch.setattr(FileShare, "read_bytes", guarded_read)
    monkeypatch.setattr(FileShare, "list", guarded_list)


def test_fetch_leaves_out_what_it_may_not_read_and_fetches_the_rest(project, monkeypatch, capsys):
    _results(project / "results", runs=("run-a", "run-b", "run-c"))
    _refuse(monkeypatch, "run-a/outputs/model.bin", "run-b/outputs/figures", "run-c")
    assert main(["fetch", "exp", "got", "--share", "results"]) == 1
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if line.startswith("nbbatch: warning: ")]
    assert len(warnings) == 3 and "Traceback" not in captured.err
    for denied in ("run-a/outputs/model.bin", "run-b/outputs/figures", "exp/run-c"):
        assert sum(denied in w and "permission denied" in w for w in warnings) == 1, (denied, warnings)
    got = sorted(p.relative_to(project / "got").as_posix() for p in (project / "got").rglob("*") if p.is_file())
    assert got == ["exp/run-a/output.ipynb", "exp/run-a/outputs/figures/loss.png", "exp/run-a/run.json",
                   "exp/run-b/output.ipynb", "exp/run-b/outputs/model.bin", "exp/run-b/run.json"]
    assert "fetched 6 file(s) of exp into got; 3 left out" in captured.out


def test_data_pull_of_an_unreadable_file_is_one_clear_error(project, monkeypatch, capsys):
    _results(project / "results")
    _refuse(monkeypatch, "model.bin")
    assert main(["data", "pull", str(project / "results" / "exp" / "run-a" / "outputs"), "got", "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nbbatch: error: cannot read ") and "model.bin: permission denied" in err


# --- 16. fetch where it cannot write, or of an experiment the share lacks -----------------------------------

def test_fetch_into_a_file_or_of_an_unknown_experiment_is_a_clear_error(project, capsys):
    _results(project / "results", experiment="digits")
    (project / "a-file").write_text("mine")
    for dest in ("a-file", "a-file/below"):
        assert main(["fetch", "digits", dest, "--share", "results"]) == 2
        err = capsys.readouterr().err
        assert err == f"nbbatch: error: cannot fetch into {dest}: a-file is a file; name a folder (created when absent)\n"
    assert (project / "a-file").read_text() == "mine"

    assert main(["fetch", "digts", "got", "--share", "results"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nbbatch: error: no experiment `digts` in the share ") and "(did you mean `digits`?)" in err
    assert not (project / "got").exists()


# --- 17. cancel of a mistyped name ---------------------------------------------------------------------------

def test_cancel_of_an_unknown_experiment_is_refused_and_creates_nothing(project, capsys):
    (project / "results" / "digits").mkdir(parents=True)  # submitted, no run record written yet
    before = sorted(p.name for p in (project / "results").iterdir())
    assert main(["cancel", "digts"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nbbatch: error: no experiment `digts`") and "(did you mean `digits`?)" in err
    assert sorted(p.name for p in (project / "results").iterdir()) == before
    assert main(["cancel", "digits"]) == 0  # a real one is still cancelled
    assert (project / "results" / "digits" / "CANCEL").exists()


# --- 18. symlinks on the share ---------------------------------------------------------------------------------

def test_data_pull_never_follows_folder_links_nor_links_out_of_the_share(tmp_path, capsys):
    share = tmp_path / "share"
    (share / "sub").mkdir(parents=True)
    (share / "a.txt").write_text("a")
    (share / "sub" / "b.txt").write_text("b")
    (tmp_path / "secret.txt").write_text("outside")
    os.symlink(".", share / "loop")  # made 810 nested copies
    os.symlink("sub", share / "sublink")
    os.symlink("a.txt", share / "alias.txt")  # a file of the share: copied as that file, like push does
    os.symlink(tmp_path / "secret.txt", share / "out.txt")
    os.symlink("nowhere", share / "dangling")
    result = pull(FileShare(share), "", tmp_path / "got")
    assert sorted(result.copied) == ["a.txt", "alias.txt", "sub/b.txt"]
    assert sorted(p.relative_to(tmp_path / "got").as_posix() for p in (tmp_path / "got").rglob("*")) == \
        ["a.txt", "alias.txt", "sub", "sub/b.txt"]
    assert len(result.warnings) == 4 and all("is a symbolic link" in w for w in result.warnings)
    assert main(["data", "pull", str(share), str(tmp_path / "again"), "-q"]) == 0
    err = capsys.readouterr().err
    assert err.count("nbbatch: warning: ") == 4 and "loop is a symbolic link to a folder" in err
    assert "out of the share" in err and "Traceback" not in err
