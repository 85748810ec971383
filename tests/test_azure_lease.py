"""AzureFileShare's ranges and lease primitives against the fake Azure Files server, through the real SDK client."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("azure.storage.fileshare")

from azure.core.exceptions import HttpResponseError, ResourceExistsError  # noqa: E402
from azure.storage.fileshare import ShareLeaseClient, ShareServiceClient  # noqa: E402
from fakes.azure_files_server import ACCOUNT, FAKE_KEY, FakeAzureFiles  # noqa: E402

from nbbatch.errors import ShareError  # noqa: E402
from nbbatch.store import lease as lease_module  # noqa: E402
from nbbatch.store.azfiles import MAX_RANGE, AzureFileShare  # noqa: E402
from nbbatch.store.lease import ShareLease  # noqa: E402

pytestmark = pytest.mark.azure

URL = f"azfiles://{ACCOUNT}/results/nbb"
LEASE = "exp/.driver.lease"
FULL = f"nbb/{LEASE}"  # the lease file's path in the file share


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("AZURE_STORAGE_KEY", FAKE_KEY)
    with FakeAzureFiles() as fake:
        monkeypatch.setenv("NBBATCH_AZFILES_ENDPOINT", fake.endpoint)
        yield fake


def _share() -> AzureFileShare:
    return AzureFileShare(URL, retry_total=0)


@pytest.fixture
def a(server) -> AzureFileShare:
    return _share()


@pytest.fixture
def b(server) -> AzureFileShare:
    return _share()


# --- the fake speaks the Lease File and Set File Properties protocol ----------------------------


def test_fake_file_leases_and_resize(server):
    service = ShareServiceClient.from_connection_string(server.connection_string(), retry_total=0)
    share = service.get_share_client("raw")
    share.create_share()
    file = share.get_file_client("f.bin")
    file.upload_file(b"0123456789")
    assert file.get_file_properties().lease.state == "available"

    lease = file.acquire_lease()
    props = file.get_file_properties()
    assert (props.lease.state, props.lease.status, props.lease.duration) == ("leased", "locked", "infinite")
    assert server.lease_state("raw", "f.bin") == ("leased", lease.id)
    with pytest.raises(ResourceExistsError) as err:
        file.acquire_lease()
    assert err.value.error_code == "LeaseAlreadyPresent"
    for attempt in (lambda: file.upload_range(b"x", 0, 1), lambda: file.delete_file(), lambda: file.resize_file(3),
                    lambda: file.create_file(4)):
        with pytest.raises(HttpResponseError) as err:
            attempt()
        assert (err.value.status_code, err.value.error_code) == (412, "LeaseIdMissing")
    with pytest.raises(HttpResponseError) as err:
        file.upload_range(b"x", 0, 1, lease="00000000-0000-0000-0000-000000000000")
    assert (err.value.status_code, err.value.error_code) == (412, "LeaseIdMismatchWithFileOperation")
    # Rename over a leased file needs its lease id as the destination lease.
    other = share.get_file_client("g.bin")
    other.upload_file(b"new")
    with pytest.raises(HttpResponseError) as err:
        other.rename_file("f.bin", overwrite=True)
    assert err.value.error_code == "LeaseIdMissing"
    assert file.download_file().readall() == b"0123456789"

    # Set File Properties resizes: zero-filled when growing, truncated when shrinking.
    file.resize_file(12, lease=lease)
    assert file.download_file().readall() == b"0123456789\0\0"
    file.upload_range(b"ab", 10, 2, lease=lease)
    file.resize_file(4, lease=lease)
    assert file.download_file().readall() == b"0123"

    assert ShareLeaseClient(file).break_lease() == 0
    assert server.lease_state("raw", "f.bin") == ("broken", None)
    assert file.get_file_properties().lease.state == "broken"
    with pytest.raises(HttpResponseError) as err:
        file.upload_range(b"x", 0, 1, lease=lease)
    assert (err.value.status_code, err.value.error_code) == (412, "LeaseNotPresentWithFileOperation")
    with pytest.raises(ResourceExistsError) as err:
        lease.release()
    assert err.value.error_code == "LeaseNotPresentWithLeaseOperation"
    again = file.acquire_lease()
    again.change("11111111-1111-1111-1111-111111111111")
    assert server.lease_state("raw", "f.bin") == ("leased", "11111111-1111-1111-1111-111111111111")
    again.release()
    assert server.lease_state("raw", "f.bin") == ("available", None)
    file.upload_range(b"Z", 0, 1)
    other.rename_file("f.bin", overwrite=True)
    assert file.download_file().readall() == b"new"


def test_fake_refuses_ranges_over_4_mib(server):
    service = ShareServiceClient.from_connection_string(server.connection_string(), retry_total=0)
    share = service.get_share_client("raw")
    share.create_share()
    file = share.get_file_client("big.bin")
    file.create_file(MAX_RANGE + 1)
    with pytest.raises(HttpResponseError) as err:
        file.upload_range(bytes(MAX_RANGE + 1), 0, MAX_RANGE + 1)
    assert err.value.status_code == 413


# --- write_range / read_range -------------------------------------------------------------------


def test_write_range_appends_and_read_range_tails(a, server):
    assert "results" not in server.shares  # the share and the folders are created on the first write
    log = "exp/run-1/log.txt"
    with pytest.raises(FileNotFoundError):
        a.read_range(log, 0)
    offset = 0
    parts = [b"first line\n", b"second\n", b"", b"third and last\n"]
    for part in parts:
        a.write_range(log, part, offset)
        offset += len(part)
    whole = b"".join(parts)
    assert a.read_bytes(log) == whole
    assert server.file_bytes("results", "nbb/exp/run-1/log.txt") == whole
    assert a.read_range(log, 0) == whole
    assert a.read_range(log, len(b"first line\n")) == b"second\nthird and last\n"
    assert a.read_range(log, len(whole) - 1) == b"\n"
    assert a.read_range(log, len(whole)) == b""
    assert a.read_range(log, len(whole) + 100) == b""
    a.write_range(log, b"again", 0)  # offset 0 starts the file over
    assert a.read_bytes(log) == b"again"
    a.write_range("exp/run-1/empty.txt", b"", 0)
    assert a.read_range("exp/run-1/empty.txt", 0) == b""
    with pytest.raises(FileNotFoundError):
        a.read_range("exp/run-1/missing.txt", 3)
    assert not [n for n in server.file_names("results") if n.endswith(".part")]


def test_write_range_splits_large_writes(a, server):
    log = "exp/r/log.txt"
    a.write_range(log, b"head", 0)
    big = bytes(range(256)) * (MAX_RANGE // 256) + b"tail-end"  # over 4 MiB: two Put Range calls
    before = len(server.requests)
    a.write_range(log, big, 4)
    ranges = [r for r in server.requests[before:] if r.query.get("comp") == "range"]
    assert [len(r.body) for r in ranges] == [MAX_RANGE, len(big) - MAX_RANGE]
    assert a.read_range(log, 4 + MAX_RANGE) == b"tail-end"
    assert a.read_bytes(log) == b"head" + big


def test_write_range_past_the_end_and_errors(a, server):
    a.write_range("exp/new/late.txt", b"x", 3)  # absent: created, zero-filled up to the offset
    assert a.read_bytes("exp/new/late.txt") == b"\0\0\0x"
    a.write_range("exp/new/late.txt", b"y", 6)
    assert a.read_bytes("exp/new/late.txt") == b"\0\0\0x\0\0y"
    a.write_range("exp/new/late.txt", b"", 100)  # nothing to write: unchanged
    assert a.read_bytes("exp/new/late.txt") == b"\0\0\0x\0\0y"
    with pytest.raises(ShareError):
        a.write_range("", b"x", 0)
    with pytest.raises(ValueError):
        a.write_range("exp/new/late.txt", b"x", -1)
    server.fault = lambda request: (500, "InternalError") if request.query.get("comp") == "range" else None
    with pytest.raises(ShareError, match="cannot write `exp/new/late.txt`"):
        a.write_range("exp/new/late.txt", b"z", 7)


# --- leases ---------------------------------------------------------------------------------------


def test_lease_is_exclusive_between_share_objects(a, b, server):
    assert a.lease_read(LEASE) is None
    assert a.lease_create(LEASE, b"holder-a")
    assert not b.lease_create(LEASE, b"holder-b")
    assert not a.lease_create(LEASE, b"holder-a2")  # held (by us): not taken a second time
    assert server.file_bytes("results", FULL) == b"holder-a"
    assert server.lease_state("results", FULL)[0] == "leased"
    seen = b.lease_read(LEASE)
    assert seen is not None and seen[0] == b"holder-a" and 0 <= seen[1] < 5
    # The other object cannot overwrite, append to or remove the holder.
    with pytest.raises(ShareError, match="LeaseIdMissing"):
        b.write_bytes(LEASE, b"holder-b")
    with pytest.raises(ShareError):
        b.write_range(LEASE, b"more", len(b"holder-a"))
    with pytest.raises(ShareError):
        b.remove(LEASE)
    assert not b.lease_renew(LEASE, b"holder-b")  # b holds nothing
    b.lease_release(LEASE, b"holder-b")  # nor can it give up a's hold
    assert server.file_bytes("results", FULL) == b"holder-a"
    assert not [n for n in server.file_names("results") if n.endswith(".part")]
    # Ordinary files in the same share are unaffected.
    b.write_bytes("exp/run.json", b"{}")
    assert a.read_bytes("exp/run.json") == b"{}"


def test_lease_renew_moves_the_age_back(a, b, server):
    assert a.lease_create(LEASE, b"holder-a 1")
    server.set_modified("results", FULL, time.time() - 120)
    held = b.lease_read(LEASE)
    assert held is not None and held[0] == b"holder-a 1" and held[1] >= 115
    assert a.lease_renew(LEASE, b"holder-a 2")
    held = b.lease_read(LEASE)
    assert held is not None and held[0] == b"holder-a 2" and held[1] < 5
    assert a.lease_renew(LEASE, b"a longer holder, 3")  # growing and shrinking content
    assert a.lease_renew(LEASE, b"a4")
    assert b.lease_read(LEASE)[0] == b"a4"


def test_lease_break_lets_another_take_over(a, b, server):
    assert a.lease_create(LEASE, b"holder-a")
    server.set_modified("results", FULL, time.time() - 600)
    stale = b.lease_read(LEASE)
    assert stale is not None and stale[1] >= 595
    assert b.lease_break(LEASE, stale[0])
    assert b.lease_read(LEASE) is None  # broken: nobody holds it
    assert server.lease_state("results", FULL) == ("broken", None)
    assert b.lease_create(LEASE, b"holder-b")
    assert not a.lease_renew(LEASE, b"holder-a")  # a finds out it lost the hold
    assert not a.lease_renew(LEASE, b"holder-a")
    a.lease_release(LEASE, b"holder-a")  # does not touch b's hold
    held = a.lease_read(LEASE)
    assert held is not None and held[0] == b"holder-b"
    assert b.lease_renew(LEASE, b"holder-b")


def test_lease_break_refuses_a_changed_holder(a, b, server):
    assert a.lease_create(LEASE, b"holder-a 1")
    seen = b.lease_read(LEASE)
    assert seen is not None
    assert a.lease_renew(LEASE, b"holder-a 2")  # a renewed after b looked
    assert not b.lease_break(LEASE, seen[0])
    assert server.lease_state("results", FULL)[0] == "leased"
    assert not b.lease_create(LEASE, b"holder-b")
    assert a.lease_renew(LEASE, b"holder-a 3")
    assert b.lease_break("exp/no-such.lease", b"x")  # gone: free to take


def test_lease_break_refuses_a_renewal_with_the_same_holder(a, b, server):
    assert a.lease_create(LEASE, b"holder-a")
    server.set_modified("results", FULL, time.time() - 600)
    stale = b.lease_read(LEASE)
    assert stale is not None and stale[1] >= 595
    assert a.lease_renew(LEASE, b"holder-a")  # a comes back before b breaks: same bytes, renewed
    assert not b.lease_break(LEASE, stale[0])
    assert a.lease_renew(LEASE, b"holder-a")
    fresh = b.lease_read(LEASE)
    assert fresh is not None and fresh[1] < 5


def test_lease_release_frees_it(a, b, server):
    assert a.lease_create(LEASE, b"holder-a")
    a.lease_release(LEASE, b"holder-a")
    assert FULL not in server.file_names("results")
    assert b.lease_read(LEASE) is None
    assert not a.lease_renew(LEASE, b"holder-a")
    a.lease_release(LEASE, b"holder-a")  # twice is fine
    assert b.lease_create(LEASE, b"holder-b")
    assert b.lease_read(LEASE)[0] == b"holder-b"


def test_lease_read_of_an_unleased_file(a):
    a.write_bytes(LEASE, b"left behind")
    assert a.lease_read(LEASE) is None
    assert a.lease_create(LEASE, b"holder-a")  # an unleased file can be taken
    assert a.lease_read(LEASE)[0] == b"holder-a"


def test_lease_create_makes_the_share_and_folders(server):
    share = AzureFileShare(f"azfiles://{ACCOUNT}/fresh/deep/er", retry_total=0)
    assert share.lease_create("exp/x/.lease", b"h")
    assert server.file_bytes("fresh", "deep/er/exp/x/.lease") == b"h"


def test_lease_errors_other_than_contention_raise(a, server):
    server.fault = lambda request: (500, "InternalError") if request.query.get("comp") == "lease" else None
    with pytest.raises(ShareError, match="InternalError"):
        a.lease_create(LEASE, b"holder-a")
    server.fault = None
    assert a.lease_create(LEASE, b"holder-a")


# --- partial uploads left by a writer that died ----------------------------------------------------


@pytest.mark.kernel
def test_partial_uploads_of_a_dead_writer_are_removed_when_the_run_starts_again(a, server, tmp_path):
    from support.notebooks import make_notebook

    from nbbatch.execute.attempts import execute_run
    from nbbatch.plan.runs import Run

    a.write_bytes("exp/r1/run.json.keep", b"not ours to touch")
    client = a.client.get_file_client("nbb/exp/r1/.output.ipynb.0123456789ab.part")
    client.upload_file(b'{"cells": [')  # as a driver killed mid-upload leaves it
    assert a.remove_partial_writes("exp/nothing-here") == 0

    make_notebook(tmp_path / "nb.ipynb", ["print('hi')"])
    run = Run(run_id="r1", experiment="exp", notebook=str(tmp_path / "nb.ipynb"), notebook_rel="nb.ipynb",
              kernel="python3")
    assert execute_run(run, a).status == "succeeded"
    names = server.file_names("results")
    assert not [n for n in names if n.endswith(".part")], names
    assert "nbb/exp/r1/run.json.keep" in names and "nbb/exp/r1/output.ipynb" in names


# --- issue 45, item 13: the share or the experiment's folder gone is not a takeover ----------------------------


def _gone(server: FakeAzureFiles, what: str) -> None:
    with server.lock:
        if what == "share deleted":
            del server.shares["results"]
            return
        share = server.shares["results"]  # the experiment's folder renamed (the portal, or another SMB client)
        share.dirs = {k.replace("nbb/exp", "nbb/exp-old", 1): v for k, v in share.dirs.items()}
        share.files = {k.replace("nbb/exp/", "nbb/exp-old/", 1): v for k, v in share.files.items()}


@pytest.mark.parametrize(("what", "said"), [("share deleted", f"the share {URL} is gone"),
                                            ("folder renamed", f"the experiment's folder {URL}/exp is gone")])
def test_a_share_gone_under_a_driver_is_not_a_takeover(server, monkeypatch, what, said):
    monkeypatch.setattr(lease_module, "TAKEOVER_SETTLE_S", 0.0)
    holder = ShareLease(_share(), "exp")
    holder._acquire()
    assert holder.renew() == holder.renew_every_s
    _gone(server, what)
    assert holder.renew() is None and holder.lost.is_set()
    assert holder.lost.reason.startswith(said) and "took" not in holder.lost.reason


def test_a_real_takeover_on_azure_files_still_reads_as_one(server, monkeypatch):
    holder = ShareLease(_share(), "exp")
    holder._acquire()
    server.set_modified("results", "nbb/exp/.lease", time.time() - 600)
    monkeypatch.setattr(lease_module.socket, "gethostname", lambda: "machine-b")
    ShareLease(_share(), "exp")._acquire()
    assert holder.renew() is None and holder.lost.reason == lease_module.TAKEN_OVER
