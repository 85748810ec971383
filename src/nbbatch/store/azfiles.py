"""Azure File shares as nbbatch shares: ``azfiles://<account>/<share>[/<prefix>]``.

Importing this module registers the ``azfiles`` scheme with :func:`nbbatch.store.share.register_share`
(:func:`nbbatch.store.share.open_share` imports it on first use, so ``import nbbatch`` stays free of the
Azure SDKs). The share behaves like :class:`nbbatch.store.share.FileShare`: a file is uploaded under a
hidden temporary name and then renamed over its target (the File service's rename), so a reader
sees the old file or the new one, never half of one.

Credentials are per storage account (:mod:`nbbatch.store.azfiles_client`): ``AZURE_STORAGE_KEY_<ACCOUNT>``,
else ``AZURE_STORAGE_KEY`` for the account in ``AZURE_STORAGE_ACCOUNT`` (or any, when that is unset), else
:class:`azure.identity.DefaultAzureCredential` with ``token_intent="backup"`` (the identity needs the
*Storage File Data Privileged Contributor* role on the account). Keys are read from the environment when the
share is opened and never written to specs, notebooks, run records or logs. Requests the service throttles
are retried as its ``Retry-After`` asks, for at most :data:`~nbbatch.store.azfiles_client.MAX_RETRY_WAIT_S`.

Names are checked against Azure Files' rules before they are written (:mod:`nbbatch.store.azfiles_names`):
a refused character, a trailing dot or a device name is a :class:`ShareError` naming the file and a name
that works, and a lease's folders must not exist under another case (Azure Files ignores case).

``NBBATCH_AZFILES_ENDPOINT`` overrides the account URL (default
``https://<account>.file.core.windows.net``; ``{account}`` in it is replaced), e.g. for a local test server.

Beyond the :class:`~nbbatch.store.share.Share` protocol: ``write_range`` / ``read_range`` (appending
to logs without rewriting them; not atomic), and the ``lease_*`` primitives of
:mod:`nbbatch.store.lease` (in :mod:`nbbatch.store.azfiles_lease`), built on the File service's infinite
file leases: the holder's bytes are the leased file's content, and only the lease's owner can rewrite or delete it.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
from nbbatch.store.azfiles_client import (
    ENDPOINT_ENV,
    KEY_ENV,
    OAUTH_API_VERSION,
    default_endpoint,
    key_hint,
    resolve_credential,
    retry_policy,
)
from nbbatch.store.azfiles_lease import AzureFilesLeases
from nbbatch.store.azfiles_names import check_name, check_share_name, refused_names
from nbbatch.store.share import Share, register_share

SCHEME = "azfiles"
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


class AzureFileShare(AzureFilesLeases):
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
        ``max_range_size``, ``retry_total``, or another ``retry_policy`` than
        :class:`~nbbatch.store.azfiles_client.ThrottleRetry`).
        """
        self.location = parse_azfiles_url(url)
        check_share_name(self.location.share, url)  # before any request: the service's answer names no rule
        self.url = self.location.url
        self.endpoint = (endpoint or default_endpoint(self.location.account)).rstrip("/")
        if credential is None:
            credential, is_token = resolve_credential(self.location.account, self.endpoint)
        else:
            is_token = hasattr(credential, "get_token")
        if is_token:
            client_options.setdefault("token_intent", "backup")
        retry_policy(client_options)
        self._client = ShareClient(
            account_url=self.endpoint, share_name=self.location.share, credential=credential, **client_options
        )
        if is_token and self._client.api_version < OAUTH_API_VERSION:  # "YYYY-MM-DD" strings order as dates
            self._client = self._oauth_client(credential, client_options)
        self._create_share = create_share
        self._known_dirs: set[str] = set()
        self._leases: dict[str, ShareLeaseClient] = {}  # full path -> the lease this object holds on it
        self._lease_seen: dict[str, tuple[bytes, str]] = {}  # full path -> (holder, ETag) lease_read last saw

    def _oauth_client(self, credential: Any, client_options: dict[str, Any]) -> ShareClient:
        """A client at :data:`OAUTH_API_VERSION`: older versions refuse OAuth on share-level calls."""
        try:
            return ShareClient(account_url=self.endpoint, share_name=self.location.share, credential=credential,
                               **{**client_options, "api_version": OAUTH_API_VERSION})
        except ValueError as exc:  # an SDK that does not know the version
            raise ShareError(f"signing in to Azure Files with Azure AD needs its REST version {OAUTH_API_VERSION}, "
                             "which this azure-storage-file-share does not speak: pip install "
                             "'azure-storage-file-share>=12.18' (or use a storage key)") from exc

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

    def _writable(self, path: str) -> str:
        """The full path of ``path``, once Azure Files' naming rules allow it (a ShareError naming the fix otherwise)."""
        full = self._full(path)
        check_name(str(path).strip("/"), self.url)
        return full

    def refused_names(self, paths: Iterable[str]) -> dict[str, str]:
        """``{path: why}`` for the paths this share would refuse, or fold into another of ``paths`` (case)."""
        return refused_names(paths)

    def _check_case(self, full: str) -> None:
        """Refuse ``full`` when one of its folders exists under another case: Azure Files would make them one folder."""
        parts = full.split("/")[:-1]
        for depth, part in enumerate(parts):
            parent = "/".join(parts[:depth])
            try:
                names = [item["name"] for item in self._client.get_directory_client(parent).list_directories_and_files()]
            except ResourceNotFoundError:
                return  # nothing there yet: the folders are created with this case
            except AzureError as exc:
                raise self._error("list", parent, exc) from exc
            twin = next((n for n in names if n != part and n.casefold() == part.casefold()), None)
            if twin is not None:
                raise ShareError(
                    f"the folder `{part}` would be the existing folder `{twin}` on {self.url}: Azure Files ignores "
                    f"case in names, so both would share one folder and its files (an experiment's folder is named "
                    f"after the experiment). Use `{twin}` exactly to continue it, or a name that differs by more than case")
            if part not in names:
                return

    # --- errors -------------------------------------------------------------------------------
    def _error(self, action: str, path: str, exc: AzureError) -> ShareError:
        if isinstance(exc, ClientAuthenticationError):
            hint = key_hint(self.account)
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
        full = self._writable(path)
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
        full = self._writable(path)
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

    def local_path(self, path: str) -> Path | None:
        """Always ``None``: an Azure File share is not a local folder (unless mounted, then use its path)."""
        return None

    def close(self) -> None:
        """Close the HTTP session."""
        self._client.close()


def _open(url: str) -> Share:
    return AzureFileShare(url)


register_share(SCHEME, _open)
