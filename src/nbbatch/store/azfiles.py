"""Azure File shares as nbbatch shares: ``azfiles://<account>/<share>[/<prefix>]``.

Importing this module registers the ``azfiles`` scheme with :func:`nbbatch.store.share.register_share`
(:func:`nbbatch.store.share.open_share` imports it on first use, so ``import nbbatch`` stays free of the
Azure SDKs). The share behaves like :class:`nbbatch.store.share.FileShare`: a file is uploaded under a
hidden temporary name and then renamed over its target (the File service's rename), so a reader
sees the old file or the new one, never half of one.

Credentials, in this order:

1. ``AZURE_STORAGE_KEY`` in the environment: the account key (shared-key signing). Use it only when
   you must; the key is read from the environment when the share is opened and is never written
   to specs, notebooks, run records or logs.
2. otherwise :class:`azure.identity.DefaultAzureCredential` (``az login``, a managed identity, …),
   with ``token_intent="backup"`` as the File service requires for OAuth. The identity needs the
   *Storage File Data Privileged Contributor* role on the account.

``NBBATCH_AZFILES_ENDPOINT`` overrides the account URL (default
``https://<account>.file.core.windows.net``), e.g. for a local test server.

Beyond the :class:`~nbbatch.store.share.Share` protocol: ``write_range`` / ``read_range`` (appending
to logs without rewriting them; not atomic), and the ``lease_*`` primitives of
:mod:`nbbatch.store.lease`, built on the File service's infinite file leases: the holder's bytes are
the leased file's content, and only the lease's owner can rewrite or delete it.
"""

from __future__ import annotations

import contextlib
import email.utils
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from azure.core.credentials import AzureNamedKeyCredential
from azure.core.exceptions import (
    AzureError,
    ClientAuthenticationError,
    HttpResponseError,
    ResourceExistsError,
    ResourceModifiedError,
    ResourceNotFoundError,
    ServiceRequestError,
)
from azure.storage.fileshare import ShareClient, ShareFileClient, ShareLeaseClient

from nbbatch.errors import ShareError
from nbbatch.store.share import Share, register_share

SCHEME = "azfiles"
ENDPOINT_ENV = "NBBATCH_AZFILES_ENDPOINT"
KEY_ENV = "AZURE_STORAGE_KEY"
_READ_ATTEMPTS = 5  # downloads restarted because a writer replaced the file mid-download
MAX_RANGE = 4 * 1024 * 1024  # the File service's limit on one Put Range

__all__ = [
    "AzureFileShare",
    "AzureFilesLocation",
    "parse_azfiles_url",
    "SCHEME",
    "ENDPOINT_ENV",
    "KEY_ENV",
]


@dataclass(frozen=True)
class AzureFilesLocation:
    """The parts of an ``azfiles://<account>/<share>[/<prefix>]`` URL."""

    account: str
    share: str
    prefix: str = ""

    @property
    def url(self) -> str:
        """The normalised URL (no trailing slash)."""
        tail = f"/{self.prefix}" if self.prefix else ""
        return f"{SCHEME}://{self.account}/{self.share}{tail}"


def parse_azfiles_url(url: str) -> AzureFilesLocation:
    """Split ``azfiles://<account>/<share>[/<prefix>]``; raise :class:`ShareError` when malformed."""
    scheme, sep, rest = url.partition("://")
    if scheme != SCHEME or not sep:
        raise ShareError(f"`{url}` is not an Azure Files share URL; expected {SCHEME}://<account>/<share>[/<folder>]")
    parts = [p for p in rest.split("/") if p]
    if len(parts) < 2:
        raise ShareError(
            f"`{url}` names no file share; expected {SCHEME}://<account>/<share>[/<folder>] "
            f"(e.g. {SCHEME}://mystorageacct/nbbatch)"
        )
    if any(p in (".", "..") for p in parts):
        raise ShareError(f"`{url}` must not contain `.` or `..` segments")
    return AzureFilesLocation(parts[0], parts[1], "/".join(parts[2:]))


def _default_endpoint(account: str) -> str:
    return os.environ.get(ENDPOINT_ENV) or f"https://{account}.file.core.windows.net"


def _resolve_credential(account: str, endpoint: str) -> tuple[Any, bool]:
    """(credential, is_token_credential) per the module's order: env key, else DefaultAzureCredential."""
    key = os.environ.get(KEY_ENV)
    if key:
        return AzureNamedKeyCredential(account, key), False
    if not endpoint.lower().startswith("https://"):
        raise ShareError(
            f"the Azure Files endpoint {endpoint} is not HTTPS, where Azure AD tokens cannot be used; "
            f"set {KEY_ENV} (the storage account key) in the environment"
        )
    try:
        from azure.identity import DefaultAzureCredential
    except ImportError as exc:  # pragma: no cover - azure-identity is part of the extra
        raise ShareError(f"Azure AD sign-in needs azure-identity: pip install 'nbbatch[azure]' ({exc})") from exc
    return DefaultAzureCredential(), True


class AzureFileShare:
    """An Azure File share (or a folder in one) implementing :class:`nbbatch.store.share.Share`."""

    def __init__(
        self,
        url: str,
        *,
        endpoint: str | None = None,
        credential: Any = None,
        create_share: bool = True,
        **client_options: Any,
    ) -> None:
        """Open ``azfiles://<account>/<share>[/<prefix>]``.

        ``endpoint`` overrides the account URL (else ``NBBATCH_AZFILES_ENDPOINT``, else the public
        endpoint); ``credential`` overrides the credential search (anything ``ShareClient`` takes);
        ``create_share`` creates the file share on first write when it does not exist;
        ``client_options`` go to :class:`azure.storage.fileshare.ShareClient` (e.g.
        ``max_range_size``, ``retry_total``).
        """
        self.location = parse_azfiles_url(url)
        self.url = self.location.url
        self.endpoint = (endpoint or _default_endpoint(self.location.account)).rstrip("/")
        if credential is None:
            credential, is_token = _resolve_credential(self.location.account, self.endpoint)
        else:
            is_token = hasattr(credential, "get_token")
        if is_token:
            client_options.setdefault("token_intent", "backup")
        self._client = ShareClient(
            account_url=self.endpoint, share_name=self.location.share, credential=credential, **client_options
        )
        self._create_share = create_share
        self._known_dirs: set[str] = set()
        self._leases: dict[str, ShareLeaseClient] = {}  # full path -> the lease this object holds on it
        self._lease_seen: dict[str, tuple[bytes, str]] = {}  # full path -> (holder, ETag) lease_read last saw

    # --- properties ---------------------------------------------------------------------------
    @property
    def account(self) -> str:
        """The storage account name."""
        return self.location.account

    @property
    def share_name(self) -> str:
        """The file share's name."""
        return self.location.share

    @property
    def prefix(self) -> str:
        """The folder inside the file share this share is rooted at (``""``: the share's root)."""
        return self.location.prefix

    @property
    def client(self) -> ShareClient:
        """The underlying :class:`azure.storage.fileshare.ShareClient`."""
        return self._client

    def __repr__(self) -> str:
        return f"AzureFileShare({self.url!r})"

    # --- paths ---------------------------------------------------------------------------------
    def _full(self, path: str) -> str:
        parts = [p for p in str(path).replace("\\", "/").split("/") if p and p != "."]
        if any(p == ".." for p in parts):
            raise ShareError(f"path `{path}` escapes the share {self.url}")
        prefix = [p for p in self.prefix.split("/") if p]
        return "/".join([*prefix, *parts])

    # --- errors -------------------------------------------------------------------------------
    def _error(self, action: str, path: str, exc: AzureError) -> ShareError:
        if isinstance(exc, ClientAuthenticationError):
            hint = (f"set {KEY_ENV} to the account key, or sign in (az login) with an identity that has the "
                    "'Storage File Data Privileged Contributor' role on the storage account")
            return ShareError(f"Azure Files refused to {action} `{path}` in {self.url} (authentication): {hint}")
        if isinstance(exc, ServiceRequestError):
            return ShareError(f"cannot reach Azure Files at {self.endpoint} to {action} `{path}`: {exc.message}")
        code = getattr(exc, "error_code", None) or type(exc).__name__
        if code in ("ShareSizeLimitReached", "ShareQuotaExceeded", "InsufficientAccountPermissions"):
            return ShareError(f"the share {self.url} is full ({code}) while trying to {action} `{path}`; "
                              "raise the share's quota or free space and resubmit: finished runs are kept and skipped")
        return ShareError(f"cannot {action} `{path}` in {self.url}: {code}: {getattr(exc, 'message', exc)}")

    # --- directories --------------------------------------------------------------------------
    def _ensure_share(self) -> None:
        try:
            self._client.create_share()
        except ResourceExistsError:
            pass

    def _ensure_dir(self, full_dir: str) -> None:
        """Create ``full_dir`` and its parents (cached: a folder is created once per share object)."""
        if not full_dir or full_dir in self._known_dirs:
            return
        directory = self._client.get_directory_client(full_dir)
        try:
            directory.create_directory()
        except ResourceExistsError:
            pass
        except ResourceNotFoundError as exc:
            if getattr(exc, "error_code", None) == "ShareNotFound":
                if not self._create_share:
                    raise
                self._ensure_share()
            self._ensure_dir(full_dir.rpartition("/")[0])  # ParentNotFound: make the parents first
            try:
                directory.create_directory()
            except ResourceExistsError:
                pass
        self._known_dirs.add(full_dir)

    def _with_parents(self, parent: str, action: Any) -> Any:
        """Run ``action()``; when the share or ``parent`` folder is missing, create them and run it again."""
        try:
            self._ensure_dir(parent)
            return action()
        except ResourceNotFoundError as exc:
            self._known_dirs.clear()  # the share or a folder went away behind our back (or never existed)
            if getattr(exc, "error_code", None) == "ShareNotFound":
                if not self._create_share:
                    raise
                self._ensure_share()
            self._ensure_dir(parent)
            return action()

    # --- Share protocol -----------------------------------------------------------------------
    def write_bytes(self, path: str, data: bytes) -> None:
        """Upload ``data`` under a hidden temporary name, then rename it over ``path``."""
        full = self._full(path)
        if not path.strip("/. "):
            raise ShareError(f"cannot write the share's root folder ({self.url}) as a file")
        parent, _, name = full.rpartition("/")
        temp = f"{parent}/.{name}.{uuid.uuid4().hex[:12]}.part" if parent else f".{name}.{uuid.uuid4().hex[:12]}.part"
        try:
            self._with_parents(parent, lambda: self._upload_and_rename(temp, full, data))
        except AzureError as exc:
            self._known_dirs.discard(parent)
            try:
                self._client.get_file_client(temp).delete_file()
            except AzureError:
                pass
            raise self._error("write", path, exc) from exc

    def _upload_and_rename(self, temp: str, full: str, data: bytes) -> None:
        temp_client = self._client.get_file_client(temp)
        temp_client.upload_file(bytes(data))
        temp_client.rename_file(full, overwrite=True)

    def read_bytes(self, path: str) -> bytes:
        """Download a whole file; ``FileNotFoundError`` when it (or the share) is absent.

        A large file is downloaded in ranges; when a writer replaces it meanwhile (the SDK sees
        the ETag change) the download starts again, so the result is always one whole version.
        """
        return self._download(path, 0)

    def _download(self, path: str, offset: int) -> bytes:
        """The bytes of ``path`` from ``offset`` on, one whole version of the file (b"" past its end)."""
        full = self._full(path)
        for attempt in range(_READ_ATTEMPTS):
            try:
                return self._client.get_file_client(full).download_file(offset=offset or None).readall()
            except ResourceNotFoundError as exc:
                raise FileNotFoundError(f"{self.url}/{path}") from exc
            except ResourceExistsError as exc:  # ResourceTypeMismatch: the path is a folder
                raise IsADirectoryError(f"{self.url}/{path}") from exc
            except ResourceModifiedError as exc:  # a writer replaced the file while it was read in ranges
                if attempt + 1 == _READ_ATTEMPTS:
                    raise self._error("read", path, exc) from exc
            except HttpResponseError as exc:
                if offset and exc.status_code == 416:  # InvalidRange: offset at or past the end
                    return b""
                raise self._error("read", path, exc) from exc
            except AzureError as exc:
                raise self._error("read", path, exc) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def exists(self, path: str) -> bool:
        """Whether a file or folder exists."""
        full = self._full(path)
        try:
            if not full:
                self._client.get_share_properties()
                return True
            try:
                self._client.get_file_client(full).get_file_properties()
                return True
            except ResourceExistsError:  # ResourceTypeMismatch: a folder
                return True
            except ResourceNotFoundError:
                self._client.get_directory_client(full).get_directory_properties()
                return True
        except ResourceNotFoundError:
            return False
        except AzureError as exc:
            raise self._error("check", path, exc) from exc

    def list(self, path: str = "") -> list[str]:
        """Names directly under a folder, sorted, hidden (``.``) names left out; empty when absent."""
        full = self._full(path)
        try:
            items = self._client.get_directory_client(full).list_directories_and_files()
            return sorted(item["name"] for item in items if not item["name"].startswith("."))
        except ResourceNotFoundError:
            return []
        except AzureError as exc:
            raise self._error("list", path, exc) from exc

    def remove_partial_writes(self, folder: str) -> int:
        """Delete the hidden ``.<name>.<random>.part`` uploads left in ``folder`` by a writer that died mid-write.

        Only call it where nobody else writes now (a run's folder as its attempt starts). Returns how many.
        """
        full = self._full(folder)
        try:
            items = list(self._client.get_directory_client(full).list_directories_and_files(name_starts_with="."))
            stale = [i["name"] for i in items if not i["is_directory"] and i["name"].endswith(".part")]
            for name in stale:
                with contextlib.suppress(ResourceNotFoundError):
                    self._client.get_file_client(f"{full}/{name}" if full else name).delete_file()
        except ResourceNotFoundError:
            return 0
        except AzureError as exc:
            raise self._error("clean up", folder, exc) from exc
        return len(stale)

    def _walk(self, full_dir: str) -> Iterator[tuple[str, bool]]:
        """(path, is_directory) under ``full_dir``, children before their folder."""
        for item in self._client.get_directory_client(full_dir).list_directories_and_files():
            child = f"{full_dir}/{item['name']}" if full_dir else item["name"]
            if item["is_directory"]:
                yield from self._walk(child)
                yield child, True
            else:
                yield child, False

    def remove(self, path: str) -> None:
        """Remove a file or a folder tree; absent is fine."""
        full = self._full(path)
        try:
            try:
                self._client.get_file_client(full).delete_file()
                return
            except (ResourceNotFoundError, ResourceExistsError):  # absent, or a folder (ResourceTypeMismatch)
                pass
            try:
                entries = list(self._walk(full))
            except ResourceNotFoundError:
                return
            for child, is_dir in entries:
                if is_dir:
                    self._client.get_directory_client(child).delete_directory()
                    self._known_dirs.discard(child)
                else:
                    self._client.get_file_client(child).delete_file()
            if full:
                self._client.get_directory_client(full).delete_directory()
                self._known_dirs = {d for d in self._known_dirs if d != full and not d.startswith(full + "/")}
        except ResourceNotFoundError:
            return
        except AzureError as exc:
            raise self._error("remove", path, exc) from exc

    # --- ranges (not atomic: for append-only files such as logs) --------------------------------
    @staticmethod
    def _upload_ranges(client: ShareFileClient, data: bytes, offset: int, **kwargs: Any) -> None:
        view = memoryview(bytes(data))
        for start in range(0, len(view), MAX_RANGE):
            chunk = view[start:start + MAX_RANGE]
            client.upload_range(chunk.tobytes(), offset + start, len(chunk), **kwargs)

    def write_range(self, path: str, data: bytes, offset: int) -> None:
        """Write ``data`` at byte ``offset`` of ``path``, growing it (created when absent).

        Not atomic: for append-only files like logs, where a reader may see a shorter file. An
        ``offset`` of 0 creates (or replaces) the file; otherwise the file is resized to end at
        ``offset + len(data)`` (zero-filled when it was shorter than ``offset``, created when
        absent) and the bytes are written there, in Put Range calls of at most 4 MiB. Unlike a
        folder share's ``pwrite``, bytes past ``offset + len(data)`` do not survive.
        """
        if offset < 0:
            raise ValueError(f"offset must not be negative, not {offset}")
        full = self._full(path)
        if not path.strip("/. "):
            raise ShareError(f"cannot write the share's root folder ({self.url}) as a file")
        if offset and not data:
            return
        client = self._client.get_file_client(full)
        try:
            try:
                if offset:
                    client.resize_file(offset + len(data))
                else:
                    client.create_file(len(data))
            except ResourceNotFoundError:  # the file (offset > 0), its folder or the share is absent
                self._with_parents(full.rpartition("/")[0], lambda: client.create_file(offset + len(data)))
            self._upload_ranges(client, data, offset)
        except AzureError as exc:
            raise self._error("write", path, exc) from exc

    def read_range(self, path: str, offset: int) -> bytes:
        """The bytes of ``path`` from ``offset`` to its end (b"" when the file is not longer); FileNotFoundError when absent."""
        if offset < 0:
            raise ValueError(f"offset must not be negative, not {offset}")
        return self._download(path, offset)

    # --- leases (see nbbatch.store.lease) -------------------------------------------------------
    @staticmethod
    def _lost_lease(exc: AzureError) -> bool:
        """Whether an error is about someone else's lease (or ours gone): 409 Lease* on a lease call, 412 on a write."""
        if not isinstance(exc, HttpResponseError):
            return False
        return exc.status_code == 412 or (exc.status_code == 409 and str(exc.error_code or "").startswith("Lease"))

    def _write_holder(self, client: ShareFileClient, lease: ShareLeaseClient, holder: bytes) -> None:
        # Resize, then overwrite: when the size is unchanged (a renewal) a reader never sees zeros.
        client.resize_file(len(holder), lease=lease)
        self._upload_ranges(client, holder, 0, lease=lease)

    def lease_create(self, path: str, holder: bytes) -> bool:
        """Take ``path`` for this share object when nobody holds it, writing ``holder`` into it; True when we now hold it.

        An infinite lease on the file (created empty first when absent) is the hold; ``holder``
        is written as the file's content under it.
        """
        full = self._full(path)
        client = self._client.get_file_client(full)
        try:
            try:
                lease = client.acquire_lease()
            except ResourceNotFoundError:
                self._with_parents(full.rpartition("/")[0], lambda: client.create_file(0))
                lease = client.acquire_lease()
        except AzureError as exc:
            if self._lost_lease(exc):  # LeaseAlreadyPresent, or leased between our create and acquire
                return False
            raise self._error("lease", path, exc) from exc
        try:
            self._write_holder(client, lease, holder)
        except AzureError as exc:
            if self._lost_lease(exc):  # broken already
                return False
            try:
                lease.release()  # do not keep a hold whose holder bytes were never written
            except AzureError:
                pass
            raise self._error("lease", path, exc) from exc
        self._leases[full] = lease
        return True

    def lease_read(self, path: str) -> tuple[bytes, float] | None:
        """The holder's bytes and the seconds since it last renewed, or None when absent or not leased.

        The age is the file's last-modified time against the service's clock (the response's
        ``Date``), so clock skew between machines does not matter; this machine's clock is the
        fallback when the response has no ``Date``.
        """
        full = self._full(path)
        dates: list[str] = []

        def keep_date(pipeline_response: Any) -> None:
            date = pipeline_response.http_response.headers.get("Date")
            if date and not dates:
                dates.append(date)

        try:
            stream = self._client.get_file_client(full).download_file(raw_response_hook=keep_date)
            data = stream.readall()
        except (ResourceNotFoundError, ResourceExistsError):
            return None
        except AzureError as exc:
            raise self._error("read the lease", path, exc) from exc
        props = stream.properties
        if props.lease.state != "leased" or props.last_modified is None:
            return None
        self._lease_seen[full] = (data, props.etag)
        now = email.utils.parsedate_to_datetime(dates[0]).timestamp() if dates else time.time()
        return data, max(0.0, now - props.last_modified.timestamp())

    def lease_renew(self, path: str, holder: bytes) -> bool:
        """Renew our hold: rewrite ``holder`` under our lease (moving last-modified); False when the lease is no longer ours."""
        full = self._full(path)
        lease = self._leases.get(full)
        if lease is None:
            return False
        try:
            self._write_holder(self._client.get_file_client(full), lease, holder)
        except ResourceNotFoundError:
            self._leases.pop(full, None)
            return False
        except AzureError as exc:
            if self._lost_lease(exc):  # LeaseNotPresentWithFileOperation (broken) / LeaseIdMismatch (taken over)
                self._leases.pop(full, None)
                return False
            raise self._error("renew the lease on", path, exc) from exc
        return True

    def lease_break(self, path: str, seen: bytes) -> bool:
        """End a stale hold whose holder bytes are still ``seen``; False when they changed meanwhile.

        True also when the file is gone or no longer leased: the hold has ended anyway. When this
        object's :meth:`lease_read` saw ``seen``, a renewal since (same bytes, new ETag) also counts
        as a change. The check and the break are two calls (the File service has no conditional
        break), so a renewal between them is broken all the same; its holder finds out on its next
        :meth:`lease_renew`.
        """
        full = self._full(path)
        client = self._client.get_file_client(full)
        read = self._lease_seen.pop(full, None)
        try:
            stream = client.download_file()
            if stream.readall() != bytes(seen):
                return False
            if read is not None and read[0] == bytes(seen) and stream.properties.etag != read[1]:
                return False  # renewed since lease_read judged it stale
            ShareLeaseClient(client).break_lease()  # an infinite file lease breaks at once
        except ResourceNotFoundError:  # released: free to take
            return True
        except AzureError as exc:
            if self._lost_lease(exc):  # LeaseNotPresentWithLeaseOperation: the hold has ended already
                return True
            raise self._error("break the lease on", path, exc) from exc
        return True

    def lease_release(self, path: str, holder: bytes) -> None:
        """Give our hold up: delete the file under our lease; errors are ignored (a lease lost is fine)."""
        full = self._full(path)
        lease = self._leases.pop(full, None)
        if lease is None:
            return
        try:
            self._client.get_file_client(full).delete_file(lease=lease)
        except AzureError:
            pass

    def local_path(self, path: str) -> Path | None:
        """Always ``None``: an Azure File share is not a local folder (unless mounted, then use its path)."""
        return None

    def close(self) -> None:
        """Close the HTTP session."""
        self._client.close()


def _open(url: str) -> Share:
    return AzureFileShare(url)


register_share(SCHEME, _open)
