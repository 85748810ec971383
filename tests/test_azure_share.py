"""AzureFileShare against a fake Azure Files REST server on 127.0.0.1, through the real SDK client."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("azure.storage.fileshare")
pytest.importorskip("azure.identity")

from azure.core.credentials import AzureNamedKeyCredential  # noqa: E402
from azure.core.exceptions import ResourceExistsError, ResourceNotFoundError  # noqa: E402
from azure.storage.fileshare import ShareClient, ShareServiceClient  # noqa: E402
from fakes.azure_files_server import ACCOUNT, FAKE_KEY, FakeAzureFiles  # noqa: E402

from nbbatch.errors import ShareError  # noqa: E402
from nbbatch.store.azfiles import AzureFileShare, parse_azfiles_url  # noqa: E402
from nbbatch.store.share import Share, open_share  # noqa: E402

pytestmark = pytest.mark.azure

URL = f"azfiles://{ACCOUNT}/results/nbb"


@pytest.fixture
def server():
    with FakeAzureFiles() as fake:
        yield fake


@pytest.fixture
def share_env(server, monkeypatch):
    monkeypatch.setenv("NBBATCH_AZFILES_ENDPOINT", server.endpoint)
    monkeypatch.setenv("AZURE_STORAGE_KEY", FAKE_KEY)
    return server


@pytest.fixture
def share(share_env) -> AzureFileShare:
    opened = open_share(URL)
    assert isinstance(opened, AzureFileShare)
    return opened


def _small_ranges(**extra) -> dict:
    # Small range sizes make the SDK split uploads into several Put Range calls and downloads into ranged GETs.
    return {"max_range_size": 1024, "max_single_get_size": 1536, "max_chunk_get_size": 1024, **extra}


# --- URLs and registration ---------------------------------------------------------------------


def test_parse_url():
    loc = parse_azfiles_url("azfiles://acct/share/a/b/")
    assert (loc.account, loc.share, loc.prefix) == ("acct", "share", "a/b")
    assert loc.url == "azfiles://acct/share/a/b"
    assert parse_azfiles_url("azfiles://acct/share").prefix == ""
    for bad in ("azfiles://acct", "azfiles://acct/share/../x", "file://acct/share"):
        with pytest.raises(ShareError):
            parse_azfiles_url(bad)


def test_open_share_registers_scheme(share):
    assert isinstance(share, Share)
    assert share.url == URL
    assert share.local_path("x") is None
    assert repr(share) == f"AzureFileShare({URL!r})"


def test_import_nbbatch_stays_free_of_azure():
    code = ("import sys, nbbatch, nbbatch.store.share, nbbatch.backends, nbbatch.plan.runs, nbbatch.store.runjson; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'azure'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# --- the fake speaks the protocol the SDK expects -------------------------------------------


def test_fake_maps_errors_to_sdk_exceptions(server):
    service = ShareServiceClient.from_connection_string(server.connection_string())
    client = service.get_share_client("raw")
    client.create_share()
    with pytest.raises(ResourceExistsError):
        client.create_share()
    client.get_directory_client("d").create_directory()
    with pytest.raises(ResourceExistsError):
        client.get_directory_client("d").create_directory()
    with pytest.raises(ResourceNotFoundError):
        client.get_file_client("d/missing.txt").get_file_properties()
    with pytest.raises(ResourceNotFoundError):
        client.get_file_client("nodir/x.txt").upload_file(b"x")  # ParentNotFound
    with pytest.raises(ResourceNotFoundError):
        service.get_share_client("absent").get_directory_client("d").create_directory()  # ShareNotFound
    file = client.get_file_client("d/f.bin")
    file.upload_file(b"0123456789")
    assert file.get_file_properties().size == 10
    assert file.download_file(offset=2, length=3).readall() == b"234"
    assert all(r.headers["authorization"].startswith(f"SharedKey {ACCOUNT}:") for r in server.requests)


def test_fake_rejects_unsigned_requests(server):
    # A SAS-style URL: the SDK signs nothing and sends no Authorization header.
    client = ShareClient(account_url=server.endpoint + "?sv=2025-01-05&sig=bm90LWEtc2ln", share_name="anon",
                         retry_total=0)
    with pytest.raises(Exception) as err:
        client.create_share()
    assert "AuthenticationFailed" in str(err.value)


# --- the Share protocol -----------------------------------------------------------------------


def test_write_read_creates_parents_and_share(share, server):
    assert "results" not in server.shares
    share.write_bytes("exp/run-1/run.json", b'{"status": "queued"}')
    assert server.file_names("results") == ["nbb/exp/run-1/run.json"]
    assert share.read_bytes("exp/run-1/run.json") == b'{"status": "queued"}'
    share.write_bytes("exp/run-1/empty.txt", b"")
    assert share.read_bytes("exp/run-1/empty.txt") == b""
    share.write_bytes("exp/run-1/run.json", b'{"status": "running"}')
    assert share.read_bytes("exp/run-1/run.json") == b'{"status": "running"}'
    assert not [n for n in server.file_names("results") if n.endswith(".part")]


def test_large_file_uses_ranges(share_env):
    share = AzureFileShare(URL, **_small_ranges())
    data = bytes(range(256)) * 40  # 10 KiB: ten 1 KiB Put Range calls, ranged downloads
    share.write_bytes("exp/r/output.ipynb", data)
    ranges = [r for r in share_env.requests if r.query.get("comp") == "range"]
    assert len(ranges) == 10
    assert all(r.headers.get("x-ms-write") == "update" for r in ranges)
    before = len(share_env.requests)
    assert share.read_bytes("exp/r/output.ipynb") == data
    gets = [r for r in share_env.requests[before:] if r.method == "GET" and not r.query]
    assert len(gets) > 1 and all(("x-ms-range" in r.headers or "range" in r.headers) for r in gets)


def test_rename_is_the_commit(share, share_env):
    share.write_bytes("exp/r/log.txt", b"hello")
    renames = [r for r in share_env.requests if r.query.get("comp") == "rename"]
    assert len(renames) == 1
    rename = renames[0]
    assert rename.path.endswith("/results/nbb/exp/r/log.txt")
    assert "/.log.txt." in rename.headers["x-ms-file-rename-source"]
    assert rename.headers["x-ms-file-rename-replace-if-exists"] == "true"


def test_readers_never_see_partial_files(share_env):
    writer = AzureFileShare(URL, **_small_ranges())
    reader = AzureFileShare(URL, **_small_ranges())
    versions = [bytes([i]) * 6000 for i in range(1, 7)]
    writer.write_bytes("exp/r/output.ipynb", versions[0])
    seen: list[bytes] = []
    stop = threading.Event()

    errors: list[BaseException] = []
    first_read = threading.Event()

    def read_loop() -> None:
        try:
            while not stop.is_set():
                seen.append(reader.read_bytes("exp/r/output.ipynb"))
                first_read.set()
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)
        finally:
            first_read.set()

    thread = threading.Thread(target=read_loop)
    thread.start()
    first_read.wait(30)  # the reader is reading before the first rewrite starts
    try:
        for version in versions[1:]:
            writer.write_bytes("exp/r/output.ipynb", version)
            # Let a read finish before the next rewrite: a reader restarts a download the writer
            # replaced, up to a limit that back-to-back rewrites could otherwise exhaust.
            done, deadline = len(seen), time.monotonic() + 30
            while len(seen) <= done and not errors and thread.is_alive() and time.monotonic() < deadline:
                time.sleep(0.001)
    finally:
        stop.set()
        thread.join()
    assert not errors, f"the reader failed: {errors[0]!r}"
    assert seen, "the reader never ran"
    assert all(s in versions for s in seen), "a reader saw a partial or mixed file"
    assert reader.read_bytes("exp/r/output.ipynb") == versions[-1]


def test_failed_upload_keeps_the_old_file(share_env):
    share = AzureFileShare(URL, retry_total=0, **_small_ranges())
    share.write_bytes("exp/r/output.ipynb", b"old" * 1000)
    calls = {"n": 0}

    def fail_third_range(request):
        if request.query.get("comp") == "range":
            calls["n"] += 1
            if calls["n"] == 3:
                return 500, "InternalError"
        return None

    share_env.fault = fail_third_range
    with pytest.raises(ShareError, match="cannot write `exp/r/output.ipynb`"):
        share.write_bytes("exp/r/output.ipynb", b"new" * 2000)
    share_env.fault = None
    assert share.read_bytes("exp/r/output.ipynb") == b"old" * 1000
    assert share_env.file_names("results") == ["nbb/exp/r/output.ipynb"], "the temporary file was left behind"


def test_paths_cannot_escape(share):
    with pytest.raises(ShareError, match="escapes"):
        share.write_bytes("../other/x", b"x")
    with pytest.raises(ShareError):
        share.write_bytes("", b"x")


def test_no_share_creation_when_disabled(share_env):
    share = AzureFileShare(URL, create_share=False, retry_total=0)
    with pytest.raises(ShareError, match="ShareNotFound"):
        share.write_bytes("exp/r/run.json", b"{}")
    assert share.list("exp") == []
    assert not share.exists("")


def test_explicit_credential_and_endpoint(server, monkeypatch):
    monkeypatch.delenv("AZURE_STORAGE_KEY", raising=False)
    monkeypatch.delenv("NBBATCH_AZFILES_ENDPOINT", raising=False)
    share = AzureFileShare(f"azfiles://{ACCOUNT}/explicit", endpoint=server.endpoint,
                           credential=AzureNamedKeyCredential(ACCOUNT, FAKE_KEY))
    share.write_bytes("x.txt", b"x")
    assert server.file_bytes("explicit", "x.txt") == b"x"


def test_credentials_without_key(monkeypatch, server):
    from azure.identity import DefaultAzureCredential

    monkeypatch.delenv("AZURE_STORAGE_KEY", raising=False)
    monkeypatch.setenv("NBBATCH_AZFILES_ENDPOINT", server.endpoint)
    with pytest.raises(ShareError, match="AZURE_STORAGE_KEY"):
        AzureFileShare(URL)  # http endpoint: Azure AD tokens are not allowed over plain HTTP
    monkeypatch.delenv("NBBATCH_AZFILES_ENDPOINT")
    share = AzureFileShare("azfiles://someaccount/share")  # nothing is contacted until first use
    assert share.endpoint == "https://someaccount.file.core.windows.net"
    assert isinstance(share.client.credential, DefaultAzureCredential)
    assert share.client.file_request_intent == "backup"


def test_authentication_errors_are_actionable(share_env):
    share = AzureFileShare(URL, retry_total=0)
    share_env.fault = lambda request: (403, "AuthenticationFailed")
    with pytest.raises(ShareError) as err:
        share.write_bytes("exp/r/run.json", b"{}")
    assert "authentication" in str(err.value) and "AZURE_STORAGE_KEY" in str(err.value)
    assert FAKE_KEY not in str(err.value)


def test_unreachable_endpoint(monkeypatch):
    monkeypatch.setenv("AZURE_STORAGE_KEY", FAKE_KEY)
    with FakeAzureFiles() as gone:
        endpoint = gone.endpoint
    share = AzureFileShare(URL, endpoint=endpoint, retry_total=0, connection_timeout=2)
    with pytest.raises(ShareError, match="cannot reach Azure Files"):
        share.read_bytes("exp/r/run.json")


# --- with the rest of nbbatch ---------------------------------------------------------------


def test_fetch_from_azure_share(share, tmp_path):
    from nbbatch.store.fetch import fetch

    share.write_bytes("exp/r1/output.ipynb", b'{"cells": []}')
    share.write_bytes("exp/r1/run.json", b'{"run_id": "r1"}')
    share.write_bytes("exp/r2/log.txt", b"log")
    written = fetch(share, "exp", tmp_path)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in written) == [
        "exp/r1/output.ipynb", "exp/r1/run.json", "exp/r2/log.txt"]
    assert (tmp_path / "exp/r1/output.ipynb").read_bytes() == b'{"cells": []}'


@pytest.mark.timeout(180)
@pytest.mark.kernel
def test_local_backend_writes_to_azure_share(share_env, project, write_experiment):
    """The whole local pipeline with an Azure File share as its share: papermill output lands on Azure Files."""
    from support.notebooks import make_notebook

    from nbbatch.api import submit

    make_notebook(project / "nb.ipynb", ["import nbbatch\nprint('A is', A)", "nbbatch.record(twice=A * 2)"])
    exp = write_experiment(f"experiment: azlocal\nnotebooks: [nb.ipynb]\nparameters: {{A: 21}}\nshare: {URL}\n")
    result = submit(exp, progress=False)
    assert result.ok, [r.error for r in result.records]
    (record,) = result.records
    assert record.metrics == {"twice": 42}
    names = share_env.file_names("results")
    base = f"nbb/azlocal/{record.run_id}"
    assert {f"{base}/output.ipynb", f"{base}/run.json", f"{base}/log.txt"} <= set(names)
    assert not [n for n in names if n.endswith(".part")]
    assert "A is 21" in share_env.file_bytes("results", f"{base}/log.txt").decode()
    assert json.loads(share_env.file_bytes("results", f"{base}/run.json"))["status"] == "succeeded"
    assert FAKE_KEY.encode() not in b"".join(share_env.file_bytes("results", n) for n in names)
