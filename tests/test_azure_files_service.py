"""Azure Files as the service behaves (issue 28, items 5, 8, 9): names, throttling, credentials per account.

The real azure-storage-file-share SDK talks to tests/fakes/azure_files_server.py, which folds case, trims
trailing dots, refuses the characters the service refuses, checks Shared Key signatures, speaks OAuth with the
backup intent, and throttles on demand. Time is a fake clock: the SDK's retry sleeps advance it.
"""

from __future__ import annotations

import http.client
import random
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("azure.storage.fileshare")

from azure.ai.ml.entities import AzureFileDatastore  # noqa: E402
from azure.core.exceptions import ClientAuthenticationError, HttpResponseError, ResourceNotFoundError  # noqa: E402
from azure.core.pipeline.transport import HttpTransport  # noqa: E402
from azure.storage.fileshare import ExponentialRetry, ShareClient  # noqa: E402
from fakes.azure_files_server import ACCOUNT, FAKE_KEY, FakeAzureFiles  # noqa: E402

from nbbatch.backends.azureml.images import ensure_datastore  # noqa: E402
from nbbatch.errors import BackendError, LockedError, ShareError  # noqa: E402
from nbbatch.store import lease as lease_module  # noqa: E402
from nbbatch.store.azfiles import AzureFileShare  # noqa: E402
from nbbatch.store.lease import ShareLease  # noqa: E402
from nbbatch.store.sync import push  # noqa: E402

URL = f"azfiles://{ACCOUNT}/results/nbb"
OTHER_KEY = "b3RoZXIta2V5LWZvci10aGUtc2Vjb25kLWFjY291bnQtMDEyMzQ1Njc4OWFiY2RlZg=="


@pytest.fixture
def server(monkeypatch):
    for name in ("AZURE_STORAGE_KEY", "AZURE_STORAGE_ACCOUNT", f"AZURE_STORAGE_KEY_{ACCOUNT.upper()}"):
        monkeypatch.delenv(name, raising=False)
    with FakeAzureFiles() as fake:
        monkeypatch.setenv("NBBATCH_AZFILES_ENDPOINT", fake.endpoint)
        monkeypatch.setenv("AZURE_STORAGE_KEY", FAKE_KEY)
        yield fake


def _raw(server: FakeAzureFiles, share: str = "raw") -> ShareClient:
    server.create_share(share)
    return ShareClient.from_connection_string(server.connection_string(), share, retry_total=0)


# --- the fake is as strict as the service --------------------------------------------------------------------


def test_fake_folds_case_trims_trailing_dots_and_refuses_service_characters(server):
    client = _raw(server)
    client.get_directory_client("Cifar").create_directory()
    client.get_file_client("cifar/Model.pt").upload_file(b"one")
    assert client.get_file_client("CIFAR/model.PT").download_file().readall() == b"one"  # one file
    client.get_file_client("cifar/notes.").upload_file(b"two")  # the service drops the trailing dot
    assert server.file_names("raw") == ["Cifar/Model.pt", "Cifar/notes"]
    with pytest.raises(HttpResponseError) as err:
        client.get_file_client("cifar/epoch-12:30").upload_file(b"x")
    assert err.value.status_code == 400 and err.value.error_code == "InvalidResourceName"


def test_fake_throttles_with_retry_after_and_injects_sharing_violation(server):
    client = _raw(server)
    client.get_file_client("f").upload_file(b"x")
    server.sharing_violation(requests=1)
    with pytest.raises(HttpResponseError) as err:
        client.get_file_client("f").delete_file()
    assert (err.value.status_code, err.value.error_code) == (409, "SharingViolation")
    server.throttle(requests=1, retry_after=7)
    with pytest.raises(HttpResponseError) as err:
        client.get_file_client("f").download_file()
    assert (err.value.status_code, err.value.error_code) == (503, "ServerBusy")
    assert err.value.response.headers["Retry-After"] == "7"
    assert client.get_file_client("f").download_file().readall() == b"x"  # the next one goes through


def test_fake_checks_the_shared_key_signature(server):
    wrong = server.connection_string(OTHER_KEY)
    client = ShareClient.from_connection_string(wrong, "raw", retry_total=0)
    with pytest.raises(ClientAuthenticationError):
        client.create_share()


def _put_directory(server: FakeAzureFiles, name: str, **headers: str) -> tuple[int, str | None, str]:
    connection = http.client.HTTPConnection("127.0.0.1", server.port)
    connection.request("PUT", f"/{ACCOUNT}/raw/{name}?restype=directory",
                       headers={"Authorization": "Bearer fake-token", "x-ms-version": "2025-01-05", **headers})
    answer = connection.getresponse()
    body = answer.read().decode()
    connection.close()
    return answer.status, answer.getheader("x-ms-error-code"), body


def test_fake_speaks_oauth_only_with_the_backup_intent(server):
    """(The SDK itself sends tokens over HTTPS only, so this one speaks HTTP to the fake directly.)"""
    server.create_share("raw")
    assert _put_directory(server, "d", **{"x-ms-file-request-intent": "backup"})[0] == 201
    status, code, body = _put_directory(server, "e")
    assert (status, code) == (400, "MissingRequiredHeader")
    assert "<HeaderName>x-ms-file-request-intent</HeaderName>" in body
    assert server.dir_names("raw") == ["d"]


def _request(server: FakeAzureFiles, method: str, path: str, **headers: str) -> tuple[int, str | None]:
    connection = http.client.HTTPConnection("127.0.0.1", server.port)
    connection.request(method, f"/{ACCOUNT}/{path}", headers={"Authorization": "Bearer fake-token", **headers})
    answer = connection.getresponse()
    answer.read()
    connection.close()
    return answer.status, answer.getheader("x-ms-error-code")


def test_fake_takes_oauth_only_at_the_api_versions_that_have_it(server):
    """Files and folders from 2022-11-02 (with the backup intent), share-level calls from 2024-11-04."""
    server.create_share("raw")
    intent = {"x-ms-file-request-intent": "backup"}
    assert _request(server, "PUT", "raw/d?restype=directory", **{"x-ms-version": "2022-11-02"}, **intent)[0] == 201
    assert _request(server, "PUT", "raw/e?restype=directory", **{"x-ms-version": "2021-12-02"}, **intent) == (
        400, "InvalidAuthenticationInfo")
    assert _request(server, "PUT", "oauth?restype=share", **{"x-ms-version": "2024-08-04"}) == (
        409, "FileOAuthManagementApiRestrictedToSrp")
    assert _request(server, "PUT", "oauth?restype=share", **{"x-ms-version": "2024-11-04"})[0] == 201
    assert _request(server, "GET", "oauth?restype=share", **{"x-ms-version": "2025-11-05"})[0] == 200


@pytest.mark.parametrize(("share", "code"), [("Results", "InvalidResourceName"), ("re--sults", "InvalidResourceName"),
                                             ("-results", "InvalidResourceName"), ("re", "OutOfRangeInput"),
                                             ("r" * 64, "OutOfRangeInput"), ("my_share", "InvalidResourceName")])
def test_fake_refuses_share_names_the_service_refuses(server, share, code):
    client = ShareClient.from_connection_string(server.connection_string(), share, retry_total=0)
    with pytest.raises(HttpResponseError) as err:
        client.create_share()
    assert (err.value.status_code, err.value.error_code) == (400, code) and not server.shares
    with pytest.raises(ShareError, match=rf"names file share `{share}`, which Azure Files refuses: a share name is "
                                         r"3-63 lowercase letters.* Use e\.g\. `[a-z0-9-]{3,63}`$"):
        AzureFileShare(f"azfiles://{ACCOUNT}/{share}/nbb", retry_total=0)  # nbbatch says so before any request


@pytest.mark.parametrize(("path", "code"), [("d/CON", "InvalidResourceName"), ("lpt1/x", "InvalidResourceName"),
                                            ("d/" + "n" * 256, "OutOfRangeInput"),
                                            ("/".join(["d" * 250] * 9), "OutOfRangeInput")])
def test_fake_refuses_device_names_and_names_too_long(server, path, code):
    client = _raw(server)
    with pytest.raises(HttpResponseError) as err:
        client.get_file_client(path).upload_file(b"x")
    assert (err.value.status_code, err.value.error_code) == (400, code)
    share = AzureFileShare(URL, retry_total=0)
    with pytest.raises(ShareError, match="Rename it"):  # nbbatch refuses it first, naming the rule and a fix
        share.write_bytes(path, b"x")


# --- item 8: names ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, shown, fix", [
    ("epoch-12:30.pt", ":", "epoch-12-30.pt"),
    ("what?.txt", "?", "what-.txt"),
    ("final.", "ends with a dot", "final"),
])
def test_a_name_azure_files_refuses_is_a_clear_error(server, name, shown, fix):
    share = AzureFileShare(URL, retry_total=0)
    with pytest.raises(ShareError) as err:
        share.write_bytes(f"exp/run-1/checkpoints/{name}", b"weights")
    message = str(err.value)
    assert f"`exp/run-1/checkpoints/{name}`" in message and shown in message
    assert f"`exp/run-1/checkpoints/{fix}`" in message  # the fix: a name that works
    assert "results" not in server.shares  # refused before any request: no cut-off or renamed file


def test_push_copies_the_other_files_and_names_those_azure_files_cannot_hold(server, tmp_path):
    """Issue 45, item 22: left out and named in one warning line with the count; the rest pushed."""
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    deep = "/".join(["d" * 250] * 9 + ["deep.txt"])  # a path over Azure's 2,048 characters
    for name in ("good.txt", "epoch-12:30.ckpt", "Model.pt", "model.pt", "back\\slash.txt", "bell\x07.txt", deep):
        (outputs / name).parent.mkdir(parents=True, exist_ok=True)
        (outputs / name).write_text(name)
    share = AzureFileShare(URL, retry_total=0)
    result = push(outputs, share, "exp/run-1/outputs")
    [message] = result.warnings
    assert message.startswith(f"5 file(s) of {outputs} left out: ")
    assert "`epoch-12:30.ckpt`" in message and "`epoch-12-30.ckpt`" in message
    assert "`model.pt`" in message and "only in case" in message
    assert "e.g. `model.pt`" not in message  # no rename to suggest for a case clash
    assert "`back\\slash.txt`" in message and "`back-slash.txt`" in message and "\\x07" in message
    assert "characters long; Azure Files takes paths of at most 2048" in message
    assert "the other 2 file(s) were pushed" in message
    assert sorted(result.copied) == ["Model.pt", "good.txt"] and len(result.refused) == 5
    assert share.read_bytes("exp/run-1/outputs/good.txt") == b"good.txt"
    assert share.read_bytes("exp/run-1/outputs/Model.pt") == b"Model.pt"  # not overwritten by model.pt
    for name in ("good.txt", "Model.pt", "model.pt"):
        (outputs / name).unlink()  # only names Azure Files cannot hold are left
    with pytest.raises(ShareError, match=r"none of the 4 file\(s\) of .* was pushed"):
        push(outputs, share, "exp/run-2/outputs")


def test_experiments_differing_only_in_case_do_not_share_a_folder(server):
    share = AzureFileShare(URL, retry_total=0)
    with ShareLease(share, "Cifar"):
        pass
    share.write_bytes("Cifar/run-1/run.json", b"{}")
    with pytest.raises(ShareError, match=r"`cifar` would be the existing folder `Cifar`.*ignores case"):
        with ShareLease(AzureFileShare(URL, retry_total=0), "cifar"):
            pass
    with ShareLease(AzureFileShare(URL, retry_total=0), "Cifar"):  # the same name, same case: fine
        pass


# --- item 9: a throttled renewal keeps the lease ----------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def _throttled_renewals(server: FakeAzureFiles, monkeypatch, **share_options: Any) -> tuple[ShareLease, list[str]]:
    """Driver A holds `exp`; the share throttles every request from its first renewal (t=20 s) to t=110 s (Retry-After
    2 s). Driver B, on another machine, tries to take the experiment over once the throttling is over. Every SDK
    retry sleep advances the fake clock (and the share's Date)."""
    clock = _Clock()
    server.clock = clock
    start = clock.now
    monkeypatch.setattr(random.Random, "uniform", lambda self, low, high: (low + high) / 2)  # the SDK's jitter
    monkeypatch.setattr(lease_module.socket, "gethostname", lambda: "node-a")
    holder = ShareLease(AzureFileShare(URL, **share_options), "exp", renew_every_s=20, stale_after_s=120)
    holder._acquire()
    monkeypatch.setattr(lease_module.socket, "gethostname", lambda: "node-b")
    seen: list[str] = []

    def try_take_over() -> None:
        if seen or clock.now < start + 110:
            return
        try:
            ShareLease(AzureFileShare(URL, retry_total=0), "exp", stale_after_s=120)._acquire()
            seen.append(f"taken over at t={clock.now - start:.0f} s")
        except LockedError as exc:
            seen.append(f"refused at t={clock.now - start:.0f} s: {exc}")

    def fake_sleep(transport: Any, seconds: float) -> None:
        clock.now += seconds
        try_take_over()

    monkeypatch.setattr(HttpTransport, "sleep", fake_sleep)  # every client's transport sleeps through it
    clock.now += 20
    server.throttle(seconds=90, retry_after=2)
    while clock.now < start + 200 and not seen:
        wait = holder.renew()
        if wait is None:
            break
        clock.now += wait
        try_take_over()
    return holder, seen


def test_a_throttled_renewal_keeps_the_lease(server, monkeypatch):
    holder, seen = _throttled_renewals(server, monkeypatch)
    assert seen and seen[0].startswith("refused"), seen  # B found a live holder
    assert holder.renew() == 20 and not holder.lost.is_set()  # and A still holds it


def test_the_sdks_default_retry_loses_the_lease_to_another_driver(server, monkeypatch):
    """The before: ExponentialRetry waits 18, 24 and 42 s whatever Retry-After says, so the holder's renewal is
    still asleep when its lease turns stale."""
    holder, seen = _throttled_renewals(server, monkeypatch, retry_policy=ExponentialRetry())
    assert seen and seen[0].startswith("taken over"), seen
    assert holder.renew() is None and holder.lost.is_set()


# --- item 5: credentials per storage account ---------------------------------------------------------------------


@pytest.fixture
def second(monkeypatch):
    with FakeAzureFiles(account="acctwo", key=OTHER_KEY) as fake:
        yield fake


def test_each_storage_account_is_signed_with_its_own_key(server, second, monkeypatch):
    monkeypatch.setenv("AZURE_STORAGE_KEY_ACCTWO", OTHER_KEY)
    AzureFileShare(URL, retry_total=0).write_bytes("a.txt", b"1")  # AZURE_STORAGE_KEY: the first account's
    AzureFileShare("azfiles://acctwo/data", endpoint=second.endpoint, retry_total=0).write_bytes("b.txt", b"2")
    assert second.file_bytes("data", "b.txt") == b"2"


def test_a_key_for_another_account_is_never_used_silently(server, second, monkeypatch):
    other = "azfiles://acctwo/data"
    with pytest.raises(ShareError, match="AZURE_STORAGE_KEY_ACCTWO"):  # refused by the service: says what to set
        AzureFileShare(other, endpoint=second.endpoint, retry_total=0).write_bytes("b.txt", b"2")
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT", ACCOUNT)  # the key is named: not tried on another account
    with pytest.raises(ShareError, match="AZURE_STORAGE_KEY_ACCTWO"):
        AzureFileShare(other, endpoint=second.endpoint, retry_total=0)
    assert "data" not in second.shares  # nothing was written with the wrong key


class _Datastores:
    def __init__(self) -> None:
        self.created: list[AzureFileDatastore] = []

    def get(self, name: str) -> Any:
        raise ResourceNotFoundError("no such datastore")

    def create_or_update(self, store: AzureFileDatastore) -> AzureFileDatastore:
        self.created.append(store)
        return store


class _MLClient:
    def __init__(self) -> None:
        self.datastores = _Datastores()


def test_an_inputs_datastore_on_a_second_account_gets_that_accounts_key(server, second, monkeypatch):
    monkeypatch.setenv("NBBATCH_AZFILES_ENDPOINT", f"http://127.0.0.1:{second.port}/{{account}}")
    second.create_share("datasets")
    ml_client: Any = _MLClient()
    with pytest.raises(BackendError, match="refused the key.*AZURE_STORAGE_KEY_ACCTWO"):
        ensure_datastore(ml_client, "nbbatch_acctwo_datasets", "acctwo", "datasets")  # only the first account's key
    assert not ml_client.datastores.created
    monkeypatch.setenv("AZURE_STORAGE_KEY_ACCTWO", OTHER_KEY)
    ensure_datastore(ml_client, "nbbatch_acctwo_datasets", "acctwo", "datasets")
    (store,) = ml_client.datastores.created
    assert store.account_name == "acctwo" and store.credentials.account_key == OTHER_KEY


def test_the_docs_no_longer_say_the_key_goes_to_the_key_vault_only():
    text = (Path(__file__).parents[1] / "docs" / "azure.md").read_text()
    assert "key vault only" not in text and "Reader" in text


# --- issue 50 item 11: a SharingViolation is waited out; OAuth asks for the REST version that takes it --------------


def test_a_sharing_violation_is_retried_with_backoff_then_named(server, monkeypatch):
    """409 SharingViolation (an SMB client, e.g. a job's mount, holds the file open) passes: it is retried like a
    throttled call, within the same total wait, instead of failing the write at once."""
    monkeypatch.setattr(HttpTransport, "sleep", lambda transport, seconds: None)
    share = AzureFileShare(URL)
    share.write_bytes("exp/run/run.json", b"{}")
    server.sharing_violation(requests=2)
    share.write_bytes("exp/run/run.json", b'{"status": "ok"}')  # two refusals, then it goes through
    assert share.read_bytes("exp/run/run.json") == b'{"status": "ok"}'
    server.sharing_violation(requests=None)  # held open for good: the caller hears of it after the retries
    with pytest.raises(ShareError, match="SharingViolation"):
        share.write_bytes("exp/run/run.json", b"{}")


def test_an_oauth_client_asks_for_the_version_that_takes_oauth_on_shares():
    """Share-level calls (create, properties) take Entra ID tokens from REST version 2024-11-04 on."""
    from nbbatch.store.azfiles_client import OAUTH_API_VERSION

    class Token:
        def get_token(self, *scopes, **kwargs):  # never called: no request is sent
            raise AssertionError("no request expected")

    url = "https://acct.file.core.windows.net"
    assert OAUTH_API_VERSION == "2024-11-04"
    assert AzureFileShare("azfiles://acct/results", endpoint=url, credential=Token()).client.api_version >= OAUTH_API_VERSION
    old = AzureFileShare("azfiles://acct/results", endpoint=url, credential=Token(), api_version="2023-11-03")
    assert old.client.api_version == OAUTH_API_VERSION and old.client.file_request_intent == "backup"
    from azure.core.credentials import AzureNamedKeyCredential

    keyed = AzureFileShare("azfiles://acct/results", endpoint=url, credential=AzureNamedKeyCredential("acct", FAKE_KEY),
                           api_version="2023-11-03")
    assert keyed.client.api_version == "2023-11-03"  # a key works at any version: left as asked
