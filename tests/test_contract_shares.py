"""The share contract: what every built-in share does, written once and run over each of them (like optuna's storage
tests over every storage): a folder, Azure Files (the fake REST server, through the real SDK), and the memory share
of tests/support/plugins.py (a plug-in's share, found by its entry point).

The one fixture, ``harness``, yields a :class:`ShareHarness` per share: how to open it (again, as another machine
would), how to leave what a writer killed mid-write leaves, and how to make a lease look old. A new share joins the
contract with one more ``pytest.param`` in ``harness`` and the few lines that make its harness.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from support.plugins import SHARE_SCHEME, MemoryShare, install_plugins

import nbbatch.store.share
from nbbatch.plan.runs import Run
from nbbatch.store.lease import ShareLease
from nbbatch.store.runfiles import load_records, new_record, read_record, write_record
from nbbatch.store.runjson import RunError, Status
from nbbatch.store.share import LeaseStore, Share, open_share

pytestmark = pytest.mark.timeout(120)

PARTIAL = ".output.ipynb.0123456789ab.part"  # what write_bytes leaves when its writer dies before the rename
LEASE = "exp/.lease"


@dataclass
class ShareHarness:
    """A share under test and what the contract needs to do to it from outside."""

    url: str
    leave_partial_write: Callable[[str, bytes], None]  # a writer killed mid-write left this hidden file
    age: Callable[[str, float], None] | None = None  # make a file look this many seconds old (shares with leases)

    def open(self) -> Share:
        """The share, opened by its URL (each call a new object: another process's view of the same files)."""
        return open_share(self.url)


def _folder(tmp_path, monkeypatch) -> Iterator[ShareHarness]:
    root = tmp_path / "share"

    def leave(path: str, data: bytes) -> None:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)

    def age(path: str, seconds: float) -> None:
        then = time.time() - seconds
        os.utime(root / path, (then, then))

    yield ShareHarness(str(root), leave, age)


def _azure_files(tmp_path, monkeypatch) -> Iterator[ShareHarness]:
    from fakes.azure_files_server import ACCOUNT, FAKE_KEY, FakeAzureFiles

    with FakeAzureFiles() as server:
        monkeypatch.setenv("NBBATCH_AZFILES_ENDPOINT", server.endpoint)
        monkeypatch.setenv("AZURE_STORAGE_KEY", FAKE_KEY)
        url = f"azfiles://{ACCOUNT}/results/nbb"

        def leave(path: str, data: bytes) -> None:  # its folder exists: the writer made it
            open_share(url).client.get_file_client(f"nbb/{path}").upload_file(data)

        def age(path: str, seconds: float) -> None:
            server.set_modified("results", f"nbb/{path}", time.time() - seconds)

        yield ShareHarness(url, leave, age)


def _memory(tmp_path, monkeypatch) -> Iterator[ShareHarness]:
    monkeypatch.syspath_prepend(str(install_plugins(tmp_path / "site")))
    monkeypatch.setattr(nbbatch.store.share, "_SHARES", {})
    monkeypatch.setattr(MemoryShare, "_by_url", {})
    url = f"{SHARE_SCHEME}://contract-{uuid.uuid4().hex[:8]}"

    def leave(path: str, data: bytes) -> None:
        MemoryShare(url).files[path] = data

    yield ShareHarness(url, leave)


SHARES = {"folder": _folder, "azure-files": _azure_files, "memory": _memory}


@pytest.fixture(params=[pytest.param("folder"), pytest.param("azure-files", marks=pytest.mark.azure),
                        pytest.param("memory")])
def harness(request, tmp_path, monkeypatch) -> Iterator[ShareHarness]:
    """Each built-in share, ready and empty."""
    yield from SHARES[request.param](tmp_path, monkeypatch)


# --- files ---------------------------------------------------------------------------------------------------


def test_a_file_written_is_read_back_whole_by_another_opening(harness):
    share, other = harness.open(), harness.open()
    share.write_bytes("exp/run-1/run.json", b'{"status": "queued"}')  # its folders are made as needed
    assert other.read_bytes("exp/run-1/run.json") == b'{"status": "queued"}'
    share.write_bytes("exp/run-1/run.json", b'{"status": "running"}')
    assert other.read_bytes("exp/run-1/run.json") == b'{"status": "running"}'
    share.write_bytes("exp/run-1/empty.txt", b"")
    assert other.read_bytes("exp/run-1/empty.txt") == b""
    with pytest.raises(FileNotFoundError):
        other.read_bytes("exp/run-1/nothing.json")
    assert share.url == other.url


def test_list_exists_and_remove_see_files_and_folders(harness):
    share = harness.open()
    share.write_bytes("exp/b/run.json", b"{}")
    share.write_bytes("exp/a/run.json", b"{}")
    share.write_bytes("exp/a/sub/deep.txt", b"x")
    share.write_bytes("exp/experiment.json", b"{}")
    assert share.list("exp") == ["a", "b", "experiment.json"]
    assert share.list("exp/a") == ["run.json", "sub"]
    assert share.list("missing") == [] and share.list("") == ["exp"]
    assert share.exists("exp") and share.exists("exp/a/run.json") and share.exists("exp/a/sub")
    assert not share.exists("exp/zzz") and not share.exists("exp/a/run.json/x")
    share.remove("exp/b/run.json")
    assert not share.exists("exp/b/run.json")
    share.remove("exp/a")  # a whole tree
    assert not share.exists("exp/a") and not share.exists("exp/a/sub/deep.txt")
    assert "a" not in share.list("exp") and "experiment.json" in share.list("exp")
    share.remove("exp/never-there")  # absent is fine
    share.remove("exp")
    assert share.list("") == []
    share.write_bytes("exp/a/again.txt", b"folders come back after a remove")
    assert harness.open().read_bytes("exp/a/again.txt").startswith(b"folders")


def test_local_path_is_none_or_the_file_itself(harness):
    share = harness.open()
    share.write_bytes("exp/r/log.txt", b"hello")
    local = share.local_path("exp/r/log.txt")
    assert local is None or local.read_bytes() == b"hello"
    if local is not None:  # a folder on this machine: what nbbatch writes there is what the share reads
        local.write_bytes(b"changed")
        assert share.read_bytes("exp/r/log.txt") == b"changed"


def test_partial_writes_of_a_dead_writer_are_hidden_and_removed(harness):
    share = harness.open()
    share.write_bytes("exp/r1/output.ipynb", b"{}")
    share.write_bytes("exp/r1/run.json.keep", b"not ours to touch")
    harness.leave_partial_write(f"exp/r1/{PARTIAL}", b'{"cells": [')
    assert PARTIAL not in share.list("exp/r1")  # a listing never shows a writer's temporary file
    assert share.remove_partial_writes("exp/nothing-here") == 0
    assert share.remove_partial_writes("exp/r1") == 1
    assert share.remove_partial_writes("exp/r1") == 0
    assert share.read_bytes("exp/r1/run.json.keep") == b"not ours to touch"
    assert share.read_bytes("exp/r1/output.ipynb") == b"{}"


def test_a_reader_never_sees_a_file_half_written(harness):
    writer, reader = harness.open(), harness.open()
    versions = [bytes([i]) * 200_000 for i in range(1, 6)]
    writer.write_bytes("exp/r/output.ipynb", versions[0])
    seen: list[bytes] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def read_loop() -> None:
        try:
            while not stop.is_set():
                seen.append(reader.read_bytes("exp/r/output.ipynb"))
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    thread = threading.Thread(target=read_loop)
    thread.start()
    try:
        for version in versions[1:]:
            done = len(seen)
            writer.write_bytes("exp/r/output.ipynb", version)
            wait_for_a_read = time.monotonic() + 30  # a read of each version, so the writes interleave with reads
            while len(seen) <= done and thread.is_alive() and time.monotonic() < wait_for_a_read:
                time.sleep(0.001)
    finally:
        stop.set()
        thread.join()
    assert not errors, f"the reader failed: {errors[0]!r}"
    assert seen and all(s in versions for s in seen), "a reader saw a partial or mixed file"
    assert reader.read_bytes("exp/r/output.ipynb") == versions[-1]


# --- run records ---------------------------------------------------------------------------------------------


def test_run_records_round_trip_and_a_corrupt_one_is_named(harness):
    share = harness.open()
    runs = [Run(run_id=f"r-{i}", experiment="contract", notebook="nb.ipynb", notebook_rel="nb.ipynb",
                kernel="python3", parameters={"A": i}) for i in (1, 2)]
    for run in runs:
        write_record(share, new_record(run, "local"))
    done = read_record(share, "contract", "r-2")
    done.status, done.metrics = Status.FAILED, {"loss": 0.5}
    done.error = RunError("ValueError", "bad", cell_index=2, reason="the notebook raised")
    write_record(share, done)
    share.write_bytes("contract/r-3/run.json", b"{not json")
    other = harness.open()
    records, problems = load_records(other, "contract")
    by_id = {r.run_id: r for r in records}
    assert sorted(by_id) == ["r-1", "r-2"]
    assert by_id["r-1"].status == Status.QUEUED and by_id["r-1"].parameters == {"A": 1}
    assert by_id["r-2"].metrics == {"loss": 0.5} and by_id["r-2"].error == done.error
    assert len(problems) == 1 and "contract/r-3/run.json" in problems[0]
    assert read_record(other, "contract", "r-9") is None


# --- leases (a share that offers them: one driver per experiment) ----------------------------------------------


def _leases(harness: ShareHarness) -> tuple[LeaseStore, LeaseStore]:
    share = harness.open()
    if not isinstance(share, LeaseStore):
        assert not ShareLease(share, "exp").supported  # a share without leases: the driver's lease is skipped
        pytest.skip(f"{harness.url.split(':')[0]} offers no leases")
    return share, harness.open()


def test_a_lease_is_exclusive_renewable_and_released(harness):
    a, b = _leases(harness)
    assert a.lease_read(LEASE) is None
    assert a.lease_create(LEASE, b"holder-a")
    assert not b.lease_create(LEASE, b"holder-b")
    held = b.lease_read(LEASE)
    assert held is not None and held[0] == b"holder-a" and 0 <= held[1] < 60
    harness.age(LEASE, 600)
    assert a.lease_renew(LEASE, b"holder-a") and b.lease_read(LEASE)[1] < 60  # a renewal makes it young again
    assert not b.lease_renew(LEASE, b"holder-b")  # b holds nothing
    b.lease_release(LEASE, b"holder-b")  # nor can it give up a's hold
    assert b.lease_read(LEASE)[0] == b"holder-a"
    a.lease_release(LEASE, b"holder-a")
    assert b.lease_read(LEASE) is None and not a.lease_renew(LEASE, b"holder-a")
    a.lease_release(LEASE, b"holder-a")  # twice is fine
    assert b.lease_create(LEASE, b"holder-b") and a.lease_read(LEASE)[0] == b"holder-b"


def test_a_stale_lease_is_broken_by_one_taker_only(harness):
    a, b = _leases(harness)
    c = harness.open()
    assert a.lease_create(LEASE, b"holder-a")
    harness.age(LEASE, 600)
    stale = b.lease_read(LEASE)
    assert stale is not None and stale[0] == b"holder-a" and stale[1] >= 590
    assert c.lease_break(LEASE, stale[0]) and c.lease_create(LEASE, b"holder-c")  # c was quicker than b
    assert not b.lease_break(LEASE, stale[0])  # the holder changed since b looked: c's hold stands
    assert not b.lease_create(LEASE, b"holder-b") and b.lease_read(LEASE)[0] == b"holder-c"
    assert not a.lease_renew(LEASE, b"holder-a")  # a learns it lost it
    a.lease_release(LEASE, b"holder-a")  # and leaves c's hold alone
    assert c.lease_renew(LEASE, b"holder-c")
    assert b.lease_break("exp/no-such.lease", b"x")  # gone: free to take
