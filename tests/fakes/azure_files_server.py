"""A fake Azure Files REST endpoint on 127.0.0.1, for the real azure-storage-file-share client.

It speaks the part of the File service REST API that :class:`nbbatch.store.azfiles.AzureFileShare`
uses — shares, directories (create, properties, list, delete), files (create, Put Range of at most
4 MiB, Set File Properties with ``x-ms-content-length`` (resize: zero-filled when growing, truncated
when shrinking), Get Properties, ranged Get, rename, delete) and Lease File (``PUT ?comp=lease``:
acquire, release, change and break of infinite leases) — in memory, and answers errors the way the
service does: a status code, an ``x-ms-error-code`` header and an XML ``<Error>`` body, so the SDK
raises ``ResourceNotFoundError`` / ``ResourceExistsError`` / ``HttpResponseError``. Signatures are not
verified, but every request must carry a ``SharedKey`` ``Authorization`` header and an ``x-ms-version``.

Leases are enforced like the service does: a leased file refuses create-over, Put Range, Set
Properties, delete and being renamed over (or away) unless the request carries the matching lease
id (``x-ms-lease-id``; ``x-ms-destination-lease-id`` / ``x-ms-source-lease-id`` for rename): 412
``LeaseIdMissing`` / ``LeaseIdMismatchWithFileOperation``, and 412 ``LeaseNotPresentWithFileOperation``
for a lease id sent to an unleased file. Acquiring a leased file is 409 ``LeaseAlreadyPresent``; a
break ends an infinite lease at once (state ``broken``), after which the file can be acquired again.
Properties and downloads carry ``x-ms-lease-state`` / ``x-ms-lease-status`` / ``x-ms-lease-duration``.

Strict where the service is (issues 28, 50): names are case-preserving but case-insensitive (``Cifar/x`` and
``cifar/x`` are one file), trailing dots of a name are trimmed (unless ``x-ms-allow-trailing-dot: true``),
``" \\ : | < > * ?``, control characters or a device name (``CON``, ``LPT1`` …) in a name are 400
``InvalidResourceName``, a name part over 255 characters or a path over 2,048 is 400 ``OutOfRangeInput``, and so is a
share name that is not 3-63 lowercase letters, digits and single hyphens (or ``InvalidResourceName``). Requests are
signed: a ``SharedKey`` signature is checked against the account's key (:data:`FAKE_KEY` unless
``keys`` says otherwise) with the SDK's own signing code, and OAuth (``Bearer``) is taken for files and
folders only with ``x-ms-file-request-intent: backup`` and API version 2022-11-02 or later, for share-level calls
only from 2024-11-04 (409 ``FileOAuthManagementApiRestrictedToSrp`` before). A test can throttle (:meth:`FakeAzureFiles.throttle`:
503 ``ServerBusy`` with ``Retry-After``) or inject any error (:meth:`FakeAzureFiles.inject`, e.g. 409
``SharingViolation``) for N requests or a time window of :attr:`FakeAzureFiles.clock`, which also stamps
``Date`` and last-modified times (a test may replace it with a fake clock).

Start it with ``with FakeAzureFiles() as server: ...``; :attr:`FakeAzureFiles.endpoint` is the
account URL (``http://127.0.0.1:PORT/devstoreaccount1``).
"""

from __future__ import annotations

import contextlib
import email.utils
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit
from xml.sax.saxutils import escape

from azure.core.pipeline import PipelineContext, PipelineRequest
from azure.core.rest import HttpRequest

# The SDK's own Shared Key signing, to check a request's signature as the service does (test code only).
from azure.storage.fileshare._shared.authentication import SharedKeyCredentialPolicy

ACCOUNT = "devstoreaccount1"
# Not a real key: any base64 string signs requests; the fake does not check signatures.
FAKE_KEY = "ZmFrZS1rZXktZm9yLW5iYmF0Y2gtdGVzdHMtb25seS0wMTIzNDU2Nzg5YWJjZGVm"


# What the service answers (texts quoted from its responses in public issues): a name with a refused character,
# e.g. kubernetes-sigs/azurefile-csi-driver#600 and MicrosoftDocs/azure-docs#53384; OAuth without the intent
# header, Azure/azure-sdk-for-net#36365; throttling, Azure/azure-sdk-for-go#22139 and microsoft/vscode-azurestorage#502;
# an SMB client's open handle, the File service error codes table (SharingViolation, 409).
INVALID_NAME = (400, "InvalidResourceName", "The specifed resource name contains invalid characters.")  # sic
SERVER_BUSY = (503, "ServerBusy", "The server is busy.")
SHARING_VIOLATION = (409, "SharingViolation", "The specified resource is in use by an SMB client.")
MISSING_HEADER = (400, "MissingRequiredHeader", "An HTTP header that's mandatory for this request is not specified.")
AUTH_FAILED = (403, "AuthenticationFailed", "Server failed to authenticate the request. Make sure the value of "
               "Authorization header is formed correctly including the signature.")
_INVALID_CHARS = re.compile(r'["\\:|<>*?\x00-\x1f]')
# Microsoft's "Naming and referencing shares, directories, files, and metadata": a share name is 3-63 lowercase
# letters, digits and hyphens, starting and ending with a letter or digit, no two hyphens in a row ("If you attempt
# to create a share, directory, or file with a name that violates naming rules, the request fails with status code
# 400"); a name part is at most 255 characters, a path at most 2,048; the device names below are not allowed as file
# or directory names. The service's codes: InvalidResourceName for a refused name (above), OutOfRangeInput for a
# length past its limits, in the words of the Storage error codes table (learn.microsoft.com, "Common REST API error
# codes": "The specified resource name length is not within the permissible limits.").
SHARE_NAME = re.compile(r"(?=.{3,63}$)[a-z0-9](?:[a-z0-9]|-(?=[a-z0-9]))*")
NAME_TOO_LONG = (400, "OutOfRangeInput", "The specified resource name length is not within the permissible limits.")
RESERVED_NAMES = frozenset({"CON", "PRN", "AUX", "NUL", "CLOCK$", *(f"COM{i}" for i in range(1, 10)),
                            *(f"LPT{i}" for i in range(1, 10))})
MAX_PART, MAX_PATH = 255, 2048
# OAuth (a Bearer token): file and directory operations from API version 2022-11-02, share-level ones (create,
# properties, delete of a share) from 2024-11-04 (learn.microsoft.com, "Access Azure file shares using Microsoft Entra
# ID with Azure Files OAuth over REST", Limitations). Older share-level calls are refused as the service answered in
# the azure-sdk-for-js recordings (409 FileOAuthManagementApiRestrictedToSrp, at x-ms-version 2022-11-02); an older
# file call as the storage front end answers a scheme its version lacks (MicrosoftDocs/azure-docs#95050: "Authentication
# scheme Bearer is not supported in this version."; the code is ours).
OAUTH_FILES_VERSION, OAUTH_SHARES_VERSION = "2022-11-02", "2024-11-04"
OAUTH_SHARE_REFUSED = (409, "FileOAuthManagementApiRestrictedToSrp", "This API does not support bearer tokens. For "
                       "OAuth, use the Storage Resource Provider APIs instead. Learn more: https://aka.ms/azurefiles/restapi.")
OAUTH_VERSION_REFUSED = (400, "InvalidAuthenticationInfo", "Authentication scheme Bearer is not supported in this version.")


@dataclass
class _File:
    data: bytearray
    modified: str
    path: str = ""  # as created (the service keeps the case a name was created with)
    etag: str = field(default_factory=lambda: f'"0x{uuid.uuid4().hex[:16].upper()}"')
    lease: str | None = None  # the active lease's id
    lease_state: str = "available"  # available | leased | broken

    def touch(self, now: float) -> None:
        self.etag = f'"0x{uuid.uuid4().hex[:16].upper()}"'
        self.modified = email.utils.formatdate(now, usegmt=True)


@dataclass
class _Share:
    """Folders and files keyed by their case-folded path (the service ignores case), keeping the case they were made with."""

    dirs: dict[str, str] = field(default_factory=lambda: {"": ""})  # folded path -> path as created
    files: dict[str, _File] = field(default_factory=dict)  # folded path -> file

    def shown(self, key: str) -> str:
        """The path of folded ``key`` as created, its folders' case included."""
        parent, _, name = key.rpartition("/")
        item = self.files.get(key)
        own = (item.path if item is not None else self.dirs.get(key, key)).rpartition("/")[2] or name
        return f"{self.dirs.get(parent, parent)}/{own}" if parent else own


@dataclass
class _Injected:
    """An error the test asks for: for ``left`` more requests (None: any number) until ``until`` on the fake's clock."""

    status: int
    code: str
    message: str
    headers: dict[str, str]
    match: Callable[[Request], bool] | None
    left: int | None
    until: float | None


@dataclass
class Request:
    """One request the fake received (for assertions)."""

    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes


class FakeAzureFiles:
    """An in-memory Azure Files account served over HTTP on 127.0.0.1 (an ephemeral port)."""

    def __init__(self, account: str = ACCOUNT, key: str = FAKE_KEY) -> None:
        self.account = account
        self.key = key  # the account key a SharedKey signature must be made with
        self.shares: dict[str, _Share] = {}
        self.requests: list[Request] = []
        # A test hook: return (status, error code) to fail a request the way the service would.
        self.fault: Callable[[Request], tuple[int, str] | None] | None = None
        self.clock: Callable[[], float] = time.time  # stamps Date and last-modified; injected windows use it
        self.injected: list[_Injected] = []
        self.lock = threading.RLock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # lifecycle -------------------------------------------------------------------------
    def start(self) -> FakeAzureFiles:
        fake = self

        class Handler(_Handler):
            server_state = fake

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), name="fake-azure-files", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakeAzureFiles:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        assert self._server is not None, "start() the fake first"
        return int(self._server.server_address[1])

    @property
    def endpoint(self) -> str:
        """The account URL the SDK is given (path-style, as for the storage emulator)."""
        return f"http://127.0.0.1:{self.port}/{self.account}"

    def connection_string(self, key: str = FAKE_KEY) -> str:
        return (f"DefaultEndpointsProtocol=http;AccountName={self.account};AccountKey={key};"
                f"FileEndpoint={self.endpoint}")

    # errors on demand ---------------------------------------------------------------------
    def inject(self, status: int, code: str, message: str = "", *, requests: int | None = None,
               seconds: float | None = None, match: Callable[[Request], bool] | None = None,
               headers: dict[str, str] | None = None) -> None:
        """Answer matching requests with this error: the next ``requests`` of them, or all for ``seconds`` of the clock."""
        until = self.clock() + seconds if seconds is not None else None
        with self.lock:
            self.injected.append(_Injected(status, code, message or code, dict(headers or {}), match, requests, until))

    def throttle(self, *, requests: int | None = None, seconds: float | None = None, retry_after: float = 1,
                 match: Callable[[Request], bool] | None = None) -> None:
        """Answer 503 ServerBusy with ``Retry-After`` (seconds), as the service does over its limits."""
        status, code, message = SERVER_BUSY
        self.inject(status, code, message, requests=requests, seconds=seconds, match=match,
                    headers={"Retry-After": f"{retry_after:g}"})

    def sharing_violation(self, *, requests: int | None = 1, match: Callable[[Request], bool] | None = None) -> None:
        """Answer 409 SharingViolation, as when an SMB client (a job's mount) holds the file open."""
        status, code, message = SHARING_VIOLATION
        self.inject(status, code, message, requests=requests, match=match)

    def _injected_for(self, request: Request) -> _Injected | None:
        now = self.clock()
        self.injected = [i for i in self.injected if (i.left is None or i.left > 0) and (i.until is None or now < i.until)]
        for item in self.injected:
            if item.match is None or item.match(request):
                if item.left is not None:
                    item.left -= 1
                return item
        return None

    def now_http(self) -> str:
        return email.utils.formatdate(self.clock(), usegmt=True)

    # direct access for tests ------------------------------------------------------------
    def create_share(self, name: str) -> None:
        with self.lock:
            self.shares.setdefault(name, _Share())

    def file_names(self, share: str) -> list[str]:
        """The share's files, as created (case kept)."""
        with self.lock:
            return sorted(self.shares[share].shown(k) for k in self.shares[share].files)

    def dir_names(self, share: str) -> list[str]:
        """The share's folders, as created (case kept)."""
        with self.lock:
            return sorted(self.shares[share].shown(k) for k in self.shares[share].dirs if k)

    def _file(self, share: str, path: str) -> _File:
        return self.shares[share].files[_key(path)]

    def file_bytes(self, share: str, path: str) -> bytes:
        with self.lock:
            return bytes(self._file(share, path).data)

    def lease_state(self, share: str, path: str) -> tuple[str, str | None]:
        """(lease state, active lease id) of a file."""
        with self.lock:
            item = self._file(share, path)
            return item.lease_state, item.lease

    def set_modified(self, share: str, path: str, when: float) -> None:
        """Set a file's last-modified time (a POSIX timestamp), e.g. to age a lease holder."""
        with self.lock:
            self._file(share, path).modified = email.utils.formatdate(when, usegmt=True)

    def modified(self, share: str, path: str) -> float:
        """A file's last-modified time (a POSIX timestamp)."""
        with self.lock:
            return email.utils.parsedate_to_datetime(self._file(share, path).modified).timestamp()


class _Error(Exception):
    def __init__(self, status: int, code: str, message: str = "", headers: dict[str, str] | None = None, *,
                 details: dict[str, str] | None = None):
        super().__init__(message or code)
        self.status, self.code, self.message, self.headers = status, code, message or code, headers or {}
        self.details = details or {}


_RANGE = re.compile(r"bytes=(\d+)-(\d*)")
MAX_RANGE = 4 * 1024 * 1024  # the service's limit on one Put Range


def _check_lease(item: _File | None, request: Request, header: str = "x-ms-lease-id") -> None:
    """Refuse a write to ``item`` unless it carries the active lease's id (412, as the service does)."""
    given = request.headers.get(header)
    lease = item.lease if item is not None else None
    if lease is None:
        if given:
            raise _Error(412, "LeaseNotPresentWithFileOperation", "there is currently no lease on the file")
        return
    if not given:
        raise _Error(412, "LeaseIdMissing", "there is currently a lease on the file and no lease ID was specified")
    if given != lease:
        raise _Error(412, "LeaseIdMismatchWithFileOperation", "the lease ID specified did not match the file's lease")


class _Handler(BaseHTTPRequestHandler):
    server_state: FakeAzureFiles
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out as separate writes: avoid delayed-ACK stalls

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet test output
        return None

    # dispatch -----------------------------------------------------------------------------
    def do_PUT(self) -> None:
        self._dispatch()

    def do_GET(self) -> None:
        self._dispatch()

    def do_HEAD(self) -> None:
        self._dispatch()

    def do_DELETE(self) -> None:
        self._dispatch()

    def _dispatch(self) -> None:
        parts = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        fake = self.server_state
        segments = [unquote(s) for s in parts.path.split("/") if s]
        request = Request(self.command, parts.path, query, {k.lower(): v for k, v in self.headers.items()}, body)
        with fake.lock:
            fake.requests.append(request)
            try:
                if not segments or segments[0] != fake.account:
                    raise _Error(400, "InvalidUri", f"expected /{fake.account}/... in {parts.path}")
                if len(segments) < 2:
                    raise _Error(400, "InvalidUri", "no share in the URL")
                share_name = segments[1]
                path = _trim("/".join(segments[2:]), request)
                self._check_auth(request, bool(path) or query.get("restype") == "directory")  # who asks, first
                if not SHARE_NAME.fullmatch(share_name):
                    raise _Error(*(NAME_TOO_LONG if not 3 <= len(share_name) <= 63 else INVALID_NAME))
                injected = fake.fault(request) if fake.fault else None
                if injected:
                    raise _Error(injected[0], injected[1], "injected by the test")
                asked = fake._injected_for(request)
                if asked is not None:
                    raise _Error(asked.status, asked.code, asked.message, dict(asked.headers))
                status, headers, payload = self._handle(request, share_name, path)
            except _Error as err:
                status, headers = err.status, {"x-ms-error-code": err.code, **err.headers}
                detail = "".join(f"<{k}>{escape(v)}</{k}>" for k, v in err.details.items())
                payload = (f'<?xml version="1.0" encoding="utf-8"?><Error><Code>{err.code}</Code>'
                           f"<Message>{escape(err.message)}</Message>{detail}</Error>").encode()
                headers["Content-Type"] = "application/xml"
        self._reply(status, headers, payload)

    def date_time_string(self, timestamp: float | None = None) -> str:
        """The response's ``Date`` (send_response writes it): the fake's clock, as the service's clock."""
        return self.server_state.now_http()

    def _reply(self, status: int, headers: dict[str, str], payload: bytes) -> None:
        self.send_response(status)
        base = {"x-ms-request-id": str(uuid.uuid4()), "x-ms-version": self.headers.get("x-ms-version", "")}
        for key, value in {**base, **headers}.items():
            self.send_header(key, value)
        if "Content-Length" not in headers:
            self.send_header("Content-Length", str(len(payload)))
        with contextlib.suppress(ConnectionError):  # a client that gave up (its timeout) reads no answer
            self.end_headers()
            if self.command != "HEAD" and payload:
                self.wfile.write(payload)

    def _check_auth(self, request: Request, data_operation: bool) -> None:
        """A valid Shared Key signature, or a Bearer token with the backup intent for files and folders."""
        auth = request.headers.get("authorization", "")
        if not request.headers.get("x-ms-version"):
            raise _Error(400, "MissingRequiredHeader", "x-ms-version is required")
        if auth.startswith("Bearer ") and auth[7:].strip():
            version = request.headers["x-ms-version"]
            if version < OAUTH_FILES_VERSION:
                raise _Error(*OAUTH_VERSION_REFUSED)
            if not data_operation and version < OAUTH_SHARES_VERSION:
                raise _Error(*OAUTH_SHARE_REFUSED)
            if data_operation and request.headers.get("x-ms-file-request-intent", "").lower() != "backup":
                raise _Error(*MISSING_HEADER, details={"HeaderName": "x-ms-file-request-intent"})
            return
        if not auth.startswith("SharedKey ") or ":" not in auth:
            raise _Error(403, "AuthenticationFailed", "a SharedKey or Bearer Authorization header is required")
        if auth != self._signature(request):
            raise _Error(*AUTH_FAILED)

    def _signature(self, request: Request) -> str:
        """The Authorization header the account's key makes for this request (the SDK's own algorithm)."""
        fake = self.server_state
        headers = {k: v for k, v in request.headers.items() if k != "authorization"}
        http_request = HttpRequest(request.method, f"http://127.0.0.1:{fake.port}{self.path}", headers=headers)
        pipeline_request = PipelineRequest(http_request, PipelineContext(None))
        SharedKeyCredentialPolicy(fake.account, fake.key).on_request(pipeline_request)
        return str(http_request.headers["Authorization"])

    # operations ----------------------------------------------------------------------------
    def _handle(self, request: Request, share_name: str, path: str) -> tuple[int, dict[str, str], bytes]:
        fake = self.server_state
        q = request.query
        method = request.method
        if q.get("restype") == "share" and not path:
            if q.get("comp"):
                raise _Error(400, "UnsupportedHttpVerb", f"the fake does not implement share {method} {q}")
            if method == "PUT":
                if share_name in fake.shares:
                    raise _Error(409, "ShareAlreadyExists", f"share {share_name} exists")
                fake.shares[share_name] = _Share()
                return 201, _props(), b""
            share = self._share(share_name)
            if method in ("GET", "HEAD"):
                return 200, _props(), b""
            if method == "DELETE":
                del fake.shares[share_name]
                return 202, {}, b""
        share = self._share(share_name)
        if q.get("restype") == "directory":
            if q.get("comp") == "list" and method == "GET":
                return self._list(share, share_name, path, q)
            if method == "PUT" and not q.get("comp"):
                return self._create_directory(share, path)
            if method in ("GET", "HEAD") and not q.get("comp"):
                if _key(path) not in share.dirs:
                    raise _Error(404, "ResourceNotFound", f"directory {path} does not exist")
                return 200, _props(), b""
            if method == "DELETE":
                return self._delete_directory(share, path)
        if q.get("comp") == "range" and method == "PUT":
            return self._put_range(share, path, request)
        if q.get("comp") == "rename" and method == "PUT":
            return self._rename(share, share_name, path, request)
        if q.get("comp") == "lease" and method == "PUT" and not q.get("restype"):
            return self._lease(share, path, request)
        if q.get("comp") == "properties" and method == "PUT" and not q.get("restype"):
            return self._set_properties(share, path, request)
        if not q.get("comp") and not q.get("restype"):
            if method == "PUT" and request.headers.get("x-ms-type", "").lower() == "file":
                return self._create_file(share, path, request)
            if method == "HEAD":
                return self._file_properties(share, path, request)
            if method == "GET":
                return self._download(share, path, request)
            if method == "DELETE":
                item = self._existing(share, path)
                _check_lease(item, request)
                del share.files[_key(path)]
                return 202, {}, b""
        raise _Error(400, "UnsupportedHttpVerb", f"the fake does not implement {method} {request.path} {q}")

    def _share(self, name: str) -> _Share:
        try:
            return self.server_state.shares[name]
        except KeyError:
            raise _Error(404, "ShareNotFound", f"share {name} does not exist") from None

    @staticmethod
    def _existing(share: _Share, path: str) -> _File:
        item = share.files.get(_key(path))
        if item is None:
            raise _Error(404, "ResourceNotFound", f"file {path} does not exist")
        return item

    @staticmethod
    def _parent(path: str) -> str:
        return path.rpartition("/")[0]

    def _now(self) -> float:
        return self.server_state.clock()

    def _create_directory(self, share: _Share, path: str) -> tuple[int, dict[str, str], bytes]:
        _check_name(path)
        key = _key(path)
        if key in share.dirs or key in share.files:
            raise _Error(409, "ResourceAlreadyExists", f"{path} exists")
        if _key(self._parent(path)) not in share.dirs:
            raise _Error(404, "ParentNotFound", f"the parent of {path} does not exist")
        share.dirs[key] = path
        return 201, _props(), b""

    def _delete_directory(self, share: _Share, path: str) -> tuple[int, dict[str, str], bytes]:
        key = _key(path)
        if key not in share.dirs or not path:
            raise _Error(404, "ResourceNotFound", f"directory {path} does not exist")
        prefix = key + "/"
        if any(d.startswith(prefix) for d in share.dirs) or any(f.startswith(prefix) for f in share.files):
            raise _Error(409, "DirectoryNotEmpty", f"directory {path} is not empty")
        del share.dirs[key]
        return 202, {}, b""

    def _list(self, share: _Share, share_name: str, path: str, q: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        key = _key(path)
        if key not in share.dirs:
            raise _Error(404, "ResourceNotFound", f"directory {path} does not exist")
        prefix = key + "/" if key else ""
        entries: list[tuple[str, str, int]] = []
        for d, shown in share.dirs.items():
            if d and d.startswith(prefix) and "/" not in d[len(prefix):]:
                entries.append((shown.rpartition("/")[2], "Directory", 0))
        for f, item in share.files.items():
            if f.startswith(prefix) and "/" not in f[len(prefix):]:
                entries.append((item.path.rpartition("/")[2], "File", len(item.data)))
        entries = sorted(e for e in entries if e[0].startswith(q.get("prefix", "")))
        start = int(q.get("marker") or 0)
        limit = int(q.get("maxresults") or 5000)
        page, rest = entries[start:start + limit], entries[start + limit:]
        next_marker = str(start + limit) if rest else ""
        items = []
        for name, kind, size in page:
            props = f"<Content-Length>{size}</Content-Length>" if kind == "File" else ""
            items.append(f"<{kind}><Name>{escape(name)}</Name><Properties>{props}</Properties></{kind}>")
        xml = (f'<?xml version="1.0" encoding="utf-8"?><EnumerationResults '
               f'ServiceEndpoint="{escape(self.server_state.endpoint)}/" ShareName="{escape(share_name)}" '
               f'DirectoryPath="{escape(path)}"><Entries>{"".join(items)}</Entries>'
               f"<NextMarker>{next_marker}</NextMarker></EnumerationResults>")
        return 200, {"Content-Type": "application/xml"}, xml.encode()

    def _create_file(self, share: _Share, path: str, request: Request) -> tuple[int, dict[str, str], bytes]:
        _check_name(path)
        key = _key(path)
        if _key(self._parent(path)) not in share.dirs:
            raise _Error(404, "ParentNotFound", f"the parent of {path} does not exist")
        if key in share.dirs:
            raise _Error(409, "ResourceAlreadyExists", f"{path} is a directory")
        size = int(request.headers.get("x-ms-content-length", "-1"))
        if size < 0:
            raise _Error(400, "MissingRequiredHeader", "x-ms-content-length is required")
        old = share.files.get(key)
        _check_lease(old, request)
        new = _File(bytearray(size), email.utils.formatdate(self._now(), usegmt=True), old.path if old else path)
        if old is not None:  # creating over a file keeps its lease (and the case it was created with)
            new.lease, new.lease_state = old.lease, old.lease_state
        share.files[key] = new
        return 201, _props(new), b""

    def _put_range(self, share: _Share, path: str, request: Request) -> tuple[int, dict[str, str], bytes]:
        item = self._existing(share, path)
        match = _RANGE.fullmatch(request.headers.get("x-ms-range") or request.headers.get("range") or "")
        if not match or not match.group(2):
            raise _Error(400, "InvalidHeaderValue", "a range bytes=start-end is required")
        start, end = int(match.group(1)), int(match.group(2))
        _check_lease(item, request)
        if end >= len(item.data) or end < start:
            raise _Error(416, "InvalidRange", f"range {start}-{end} is outside the file ({len(item.data)} bytes)")
        if end - start + 1 > MAX_RANGE:
            raise _Error(413, "RequestBodyTooLarge", f"a range is at most {MAX_RANGE} bytes")
        if request.headers.get("x-ms-write", "update") == "clear":
            item.data[start:end + 1] = bytes(end - start + 1)
        else:
            if len(request.body) != end - start + 1:
                raise _Error(400, "InvalidHeaderValue", "the body length does not match the range")
            item.data[start:end + 1] = request.body
        item.touch(self._now())
        return 201, _props(item), b""

    def _rename(self, share: _Share, share_name: str, path: str, request: Request) -> tuple[int, dict[str, str], bytes]:
        source_url = request.headers.get("x-ms-file-rename-source")
        if not source_url:
            raise _Error(400, "MissingRequiredHeader", "x-ms-file-rename-source is required")
        source_parts = [unquote(s) for s in urlsplit(source_url).path.split("/") if s]
        # The source may be a full URL (…/account/share/path) or a share-relative path.
        if len(source_parts) >= 2 and source_parts[0] == self.server_state.account:
            if source_parts[1] != share_name:
                raise _Error(400, "InvalidHeaderValue", "rename across shares is not supported")
            source = "/".join(source_parts[2:])
        else:
            source = "/".join(source_parts)
        source = _trim(source, request, "x-ms-source-allow-trailing-dot")
        _check_name(path)
        source_key, key = _key(source), _key(path)
        if source_key not in share.files:
            raise _Error(404, "ResourceNotFound", f"rename source {source} does not exist")
        if _key(self._parent(path)) not in share.dirs:
            raise _Error(404, "ParentNotFound", f"the parent of {path} does not exist")
        if key in share.dirs:
            raise _Error(409, "ResourceAlreadyExists", f"{path} is a directory")
        replace = request.headers.get("x-ms-file-rename-replace-if-exists", "false").lower() == "true"
        if key in share.files and not replace:
            raise _Error(409, "ResourceAlreadyExists", f"{path} exists")
        _check_lease(share.files[source_key], request, "x-ms-source-lease-id")
        if key != source_key:
            _check_lease(share.files.get(key), request, "x-ms-destination-lease-id")
        kept = share.files[key].path if key in share.files and key != source_key else path
        item = share.files.pop(source_key)
        item.path = kept
        share.files[key] = item
        item.touch(self._now())
        return 200, _props(item), b""

    def _set_properties(self, share: _Share, path: str, request: Request) -> tuple[int, dict[str, str], bytes]:
        item = self._existing(share, path)
        _check_lease(item, request)
        if "x-ms-content-length" in request.headers:
            size = int(request.headers["x-ms-content-length"])
            if size < 0:
                raise _Error(400, "InvalidHeaderValue", "x-ms-content-length must not be negative")
            if size < len(item.data):
                del item.data[size:]
            else:
                item.data.extend(bytes(size - len(item.data)))
        item.touch(self._now())
        return 200, _props(item), b""

    def _lease(self, share: _Share, path: str, request: Request) -> tuple[int, dict[str, str], bytes]:
        item = self._existing(share, path)
        action = request.headers.get("x-ms-lease-action", "").lower()
        given = request.headers.get("x-ms-lease-id")
        proposed = request.headers.get("x-ms-proposed-lease-id")
        headers = {"ETag": item.etag, "Last-Modified": item.modified}
        if action == "acquire":
            if request.headers.get("x-ms-lease-duration") != "-1":
                raise _Error(400, "InvalidHeaderValue", "file leases are infinite: x-ms-lease-duration must be -1")
            if item.lease is not None and item.lease != proposed:
                raise _Error(409, "LeaseAlreadyPresent", "there is already a lease present")
            item.lease, item.lease_state = proposed or str(uuid.uuid4()), "leased"
            return 201, {**headers, "x-ms-lease-id": item.lease}, b""
        if action not in ("release", "change", "break"):
            raise _Error(400, "InvalidHeaderValue", f"unsupported x-ms-lease-action {action!r} for a file")
        if action != "break" and not given:
            raise _Error(400, "MissingRequiredHeader", "x-ms-lease-id is required")
        if item.lease is None:
            raise _Error(409, "LeaseNotPresentWithLeaseOperation", "there is currently no lease on the file")
        if given and given != item.lease:
            raise _Error(409, "LeaseIdMismatchWithLeaseOperation", "the lease ID specified did not match the file's lease")
        if action == "release":
            item.lease, item.lease_state = None, "available"
            return 200, headers, b""
        if action == "change":
            if not proposed:
                raise _Error(400, "MissingRequiredHeader", "x-ms-proposed-lease-id is required")
            item.lease = proposed
            return 200, {**headers, "x-ms-lease-id": proposed}, b""
        item.lease, item.lease_state = None, "broken"  # an infinite lease breaks at once
        return 202, {**headers, "x-ms-lease-time": "0"}, b""

    @staticmethod
    def _check_read_lease(item: _File, request: Request) -> None:
        # Reads need no lease; a lease id sent with one must still match.
        if request.headers.get("x-ms-lease-id"):
            _check_lease(item, request)

    def _file_properties(self, share: _Share, path: str, request: Request) -> tuple[int, dict[str, str], bytes]:
        item = self._existing(share, path)
        self._check_read_lease(item, request)
        headers = {**_props(item), **_lease_headers(item)}
        headers.update({"Content-Length": str(len(item.data)), "x-ms-type": "File",
                        "Content-Type": "application/octet-stream"})
        return 200, headers, b""

    def _download(self, share: _Share, path: str, request: Request) -> tuple[int, dict[str, str], bytes]:
        item = self._existing(share, path)
        self._check_read_lease(item, request)
        size = len(item.data)
        headers = {**_props(item), **_lease_headers(item)}
        headers.update({"x-ms-type": "File", "Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"})
        spec = request.headers.get("x-ms-range") or request.headers.get("range")
        if not spec:
            return 200, headers, bytes(item.data)
        match = _RANGE.fullmatch(spec)
        if not match:
            raise _Error(400, "InvalidHeaderValue", f"bad range {spec}")
        start = int(match.group(1))
        end = int(match.group(2)) if match.group(2) else size - 1
        if start >= size:
            raise _Error(416, "InvalidRange", "the range is not satisfiable",
                         {"Content-Range": f"bytes */{size}"})
        end = min(end, size - 1)
        headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        return 206, headers, bytes(item.data[start:end + 1])


def _key(path: str) -> str:
    """A path as the service compares it: names are case-insensitive."""
    return path.casefold()


def _trim(path: str, request: Request, header: str = "x-ms-allow-trailing-dot") -> str:
    """The path as the service takes it: a name's trailing dots dropped unless the request asks to keep them."""
    if request.headers.get(header, "").lower() == "true":
        return path
    return "/".join(part.rstrip(".") or part for part in path.split("/"))


def _check_name(path: str) -> None:
    """400 InvalidResourceName for a name with a character the service refuses or a device name; 400 OutOfRangeInput
    for a name part over 255 characters or a path over 2,048."""
    parts = path.split("/")
    if _INVALID_CHARS.search(path) or any(part.upper() in RESERVED_NAMES for part in parts):
        raise _Error(*INVALID_NAME)
    if len(path) > MAX_PATH or any(len(part) > MAX_PART for part in parts):
        raise _Error(*NAME_TOO_LONG)


def _props(item: _File | None = None) -> dict[str, str]:
    now = email.utils.formatdate(usegmt=True)
    return {
        "ETag": item.etag if item else f'"0x{uuid.uuid4().hex[:16].upper()}"',
        "Last-Modified": item.modified if item else now,
        "x-ms-request-server-encrypted": "true",
        "x-ms-file-attributes": "Archive" if item else "Directory",
        "x-ms-file-creation-time": "2024-01-01T00:00:00.0000000Z",
        "x-ms-file-last-write-time": "2024-01-01T00:00:00.0000000Z",
        "x-ms-file-change-time": "2024-01-01T00:00:00.0000000Z",
        "x-ms-file-permission-key": "1234567890*1234567890",
        "x-ms-file-id": "13835128424026341376",
        "x-ms-file-parent-id": "0",
    }


def _lease_headers(item: _File) -> dict[str, str]:
    headers = {"x-ms-lease-state": item.lease_state, "x-ms-lease-status": "locked" if item.lease else "unlocked"}
    if item.lease:
        headers["x-ms-lease-duration"] = "infinite"
    return headers
