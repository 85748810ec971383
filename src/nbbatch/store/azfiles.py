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
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from azure.core.credentials import AzureNamedKeyCredential
from azure.core.exceptions import (
    AzureError,
    ClientAuthenticationError,
    ResourceExistsError,
    ResourceModifiedError,
    ResourceNotFoundError,
    ServiceRequestError,
)
from azure.storage.fileshare import ShareClient

from nbbatch.errors import ShareError
from nbbatch.store.share import Share, register_share

SCHEME = "azfiles"
ENDPOINT_ENV = "NBBATCH_AZFILES_ENDPOINT"
KEY_ENV = "AZURE_STORAGE_KEY"
_READ_ATTEMPTS = 5  # downloads restarted because a writer replaced the file mid-download

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

    # --- Share protocol -----------------------------------------------------------------------
    def write_bytes(self, path: str, data: bytes) -> None:
        """Upload ``data`` under a hidden temporary name, then rename it over ``path``."""
        full = self._full(path)
        if not path.strip("/. "):
            raise ShareError(f"cannot write the share's root folder ({self.url}) as a file")
        parent, _, name = full.rpartition("/")
        temp = f"{parent}/.{name}.{uuid.uuid4().hex[:12]}.part" if parent else f".{name}.{uuid.uuid4().hex[:12]}.part"
        try:
            try:
                self._upload_and_rename(parent, temp, full, data)
            except ResourceNotFoundError as exc:
                # The share or a folder went away behind our back (or never existed): create and retry once.
                self._known_dirs.clear()
                if getattr(exc, "error_code", None) == "ShareNotFound":
                    if not self._create_share:
                        raise
                    self._ensure_share()
                self._upload_and_rename(parent, temp, full, data)
        except AzureError as exc:
            self._known_dirs.discard(parent)
            try:
                self._client.get_file_client(temp).delete_file()
            except AzureError:
                pass
            raise self._error("write", path, exc) from exc

    def _upload_and_rename(self, parent: str, temp: str, full: str, data: bytes) -> None:
        self._ensure_dir(parent)
        temp_client = self._client.get_file_client(temp)
        temp_client.upload_file(bytes(data))
        temp_client.rename_file(full, overwrite=True)

    def read_bytes(self, path: str) -> bytes:
        """Download a whole file; ``FileNotFoundError`` when it (or the share) is absent.

        A large file is downloaded in ranges; when a writer replaces it meanwhile (the SDK sees
        the ETag change) the download starts again, so the result is always one whole version.
        """
        full = self._full(path)
        for attempt in range(_READ_ATTEMPTS):
            try:
                return self._client.get_file_client(full).download_file().readall()
            except ResourceNotFoundError as exc:
                raise FileNotFoundError(f"{self.url}/{path}") from exc
            except ResourceExistsError as exc:  # ResourceTypeMismatch: the path is a folder
                raise IsADirectoryError(f"{self.url}/{path}") from exc
            except ResourceModifiedError as exc:
                if attempt + 1 == _READ_ATTEMPTS:
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

    def local_path(self, path: str) -> Path | None:
        """Always ``None``: an Azure File share is not a local folder (unless mounted, then use its path)."""
        return None

    def close(self) -> None:
        """Close the HTTP session."""
        self._client.close()


def _open(url: str) -> Share:
    return AzureFileShare(url)


register_share(SCHEME, _open)
