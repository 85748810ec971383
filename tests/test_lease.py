"""The driver's lease on the share (issue 13, item 6): two machines cannot drive one experiment.

"Another machine" is a :class:`ShareLease` whose holder names another host: its liveness is then
known only through its renewals, as for a real driver elsewhere on NFS or Azure Files.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time

import pytest
from support.notebooks import make_notebook

from nbbatch.api import submit
from nbbatch.errors import LockedError
from nbbatch.store import lease as lease_module
from nbbatch.store.lease import ShareLease
from nbbatch.store.share import FileShare

pytestmark = pytest.mark.timeout(120)


def other_machine(monkeypatch, share, experiment: str, **timing) -> ShareLease:
    with monkeypatch.context() as patch:
        patch.setattr(lease_module.socket, "gethostname", lambda: "machine-b")
        return ShareLease(share, experiment, **timing)


def test_a_live_lease_of_another_machine_refuses_and_a_stale_one_is_taken_over(tmp_path, monkeypatch):
    share = FileShare(tmp_path / "share")
    theirs = other_machine(monkeypatch, share, "exp", renew_every_s=0.1, stale_after_s=1.0).__enter__()
    time.sleep(1.5)  # longer than the stale time below: only their renewals keep it fresh
    with pytest.raises(LockedError, match="machine-b"):
        ShareLease(share, "exp", stale_after_s=5.0).__enter__()

    theirs._stop.set()  # machine-b is cut off: no more renewals, no release
    theirs._thread.join()
    time.sleep(1.2)
    with ShareLease(share, "exp", stale_after_s=1.0) as ours:
        assert ours.recovered_from and ours.recovered_from["host"] == "machine-b"
        assert share.lease_renew(theirs.path, theirs._holder) is False  # machine-b learns it lost it
    assert not (tmp_path / "share" / "exp" / ".lease").exists()  # released on exit


def test_the_holder_that_lost_its_lease_is_told_and_stops(tmp_path, monkeypatch):
    share = FileShare(tmp_path / "share")
    theirs = other_machine(monkeypatch, share, "exp", renew_every_s=0.1, stale_after_s=0.5)
    theirs.__enter__()
    holder = theirs._holder
    (tmp_path / "share" / "exp" / ".lease").write_bytes(b'{"token": "someone else"}')  # taken over meanwhile
    assert theirs.lost.wait(5)
    assert theirs.lost.reason == lease_module.TAKEN_OVER  # a real takeover reads as one
    theirs.__exit__(None, None, None)
    assert (tmp_path / "share" / "exp" / ".lease").read_bytes() != holder  # the new holder's lease is left alone


@pytest.mark.parametrize("vanish", ["deleted", "renamed", "deleted and made again by a run"])
def test_a_share_folder_gone_mid_run_is_not_a_takeover(tmp_path, monkeypatch, vanish):
    """Issue 45, item 13: the experiment's folder deleted or renamed under a driver halts it naming the folder."""
    monkeypatch.setattr(lease_module, "TAKEOVER_SETTLE_S", 0.05)
    share, folder = FileShare(tmp_path / "share"), tmp_path / "share" / "exp"
    with ShareLease(share, "exp", renew_every_s=0.05) as ours:
        folder.joinpath("r0").mkdir()
        if vanish == "renamed":
            folder.rename(tmp_path / "share" / "exp-old")
        else:
            shutil.rmtree(folder)
        if vanish.endswith("by a run"):
            share.write_bytes("exp/r0/run.json", b"{}")
        assert ours.lost.wait(5)
    reason = ours.lost.reason
    assert "took" not in reason and "gone" in reason, reason
    assert f"{share.url}/exp" in reason
    assert ("lease" in reason) == vanish.endswith("by a run")
    assert not (folder / ".lease").exists()


def test_the_whole_share_gone_mid_run_names_the_share(tmp_path, monkeypatch):
    monkeypatch.setattr(lease_module, "TAKEOVER_SETTLE_S", 0.05)
    share = FileShare(tmp_path / "share")
    with ShareLease(share, "exp", renew_every_s=0.05) as ours:
        (tmp_path / "share").rename(tmp_path / "unmounted")
        assert ours.lost.wait(5)
    assert ours.lost.reason == f"the share {share.url} is gone (deleted, renamed or unmounted)"
    assert not (tmp_path / "share").exists(), "nothing made the share again"


def test_a_dead_process_of_this_machine_is_taken_over_at_once(tmp_path):
    share = FileShare(tmp_path / "share")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    import socket

    holder = {"token": "t", "pid": int(dead.stdout), "host": socket.gethostname(), "since": "then"}
    share.lease_create("exp/.lease", json.dumps(holder).encode())
    with ShareLease(share, "exp") as ours:  # no waiting for the stale time
        assert ours.recovered_from["pid"] == holder["pid"]


def test_breaking_a_lease_that_changed_meanwhile_gives_it_back(tmp_path):
    share = FileShare(tmp_path / "share")
    assert share.lease_create("exp/.lease", b"old")
    assert not share.lease_create("exp/.lease", b"mine")
    (tmp_path / "share" / "exp" / ".lease").write_bytes(b"fresh")  # a new holder won the race
    assert share.lease_break("exp/.lease", b"old") is False
    assert share.lease_read("exp/.lease")[0] == b"fresh"
    assert not [p.name for p in (tmp_path / "share" / "exp").iterdir() if p.name != ".lease"]


@pytest.mark.kernel
def test_submit_holds_the_lease_while_it_drives(project, write_experiment, monkeypatch):
    make_notebook(project / "nb.ipynb", ["import pathlib, time\nwhile not pathlib.Path('release').exists():\n"
                                         "    time.sleep(0.05)"])
    exp = write_experiment("experiment: leased\nnotebooks: [nb.ipynb]\n")
    thread = threading.Thread(target=submit, args=(exp,), kwargs={"progress": False})
    thread.start()
    share = FileShare(project / "results")
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and share.lease_read("leased/.lease") is None:
            time.sleep(0.1)
        with pytest.raises(LockedError, match="already being run"):
            other_machine(monkeypatch, share, "leased").__enter__()
    finally:
        (project / "release").write_text("go")
        thread.join(60)
    assert share.lease_read("leased/.lease") is None
