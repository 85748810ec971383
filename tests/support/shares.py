"""The one share double of the tests: a folder share that can look remote, fail on demand and count its traffic.

It wraps :class:`~nbbatch.store.share.FileShare` rather than subclassing it, so that it offers only the
:class:`~nbbatch.store.share.Share` protocol plus the capabilities a test asks for (``ranged=True`` adds
:class:`~nbbatch.store.share.RangeStore`), the way a plug-in share would.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from nbbatch.errors import ShareError
from nbbatch.store.share import FileShare


def never_fails(path: str, method: str) -> bool:
    """The default failure rule: every call succeeds."""
    return False


class ShareDouble:
    """A folder share for tests.

    - ``failing(path, method)``: called before each call of a method in ``watched``; True makes that call raise a
      transient :class:`ShareError` (an HTTP 503, like Azure Files under load).
    - ``calls``: every watched call as (thread name, method, path).
    - ``remote``: no local path (``local_path`` returns None), as for Azure Files; ``url`` then names the share.
    - ``ranged``: offer ``write_range``/``read_range`` (appending logs), as Azure Files does.
    - ``written``/``whole_writes``: bytes written and whole-file writes, by path.
    - ``extra_listing``: names ``list(path)`` adds to what the folder holds (hostile names a remote share may list).
    """

    def __init__(self, root: Path, *, failing: Callable[[str, str], bool] = never_fails,
                 watched: Iterable[str] = ("exists", "list"), remote: bool = False, ranged: bool = False,
                 url: str | None = None, extra_listing: dict[str, list[str]] | None = None):
        self._inner = FileShare(root)
        self.url = url or self._inner.url
        self.failing = failing
        self.watched = frozenset(watched)
        self.remote = remote
        self.extra_listing = extra_listing or {}
        self.calls: list[tuple[str, str, str]] = []
        self.written: dict[str, int] = {}
        self.whole_writes: dict[str, int] = {}
        if ranged:  # instance attributes, so that isinstance(share, RangeStore) holds only when asked for
            self.write_range = self._write_range
            self.read_range = self._inner.read_range

    def _check(self, method: str, path: str) -> None:
        if method not in self.watched:
            return
        self.calls.append((threading.current_thread().name, method, path))
        if self.failing(path, method):
            raise ShareError(f"HTTP 503 ServerBusy while trying to {method} `{path}` (injected)")

    def exists(self, path: str) -> bool:
        self._check("exists", path)
        return self._inner.exists(path)

    def list(self, path: str = "") -> list[str]:
        self._check("list", path)
        return sorted({*self._inner.list(path), *self.extra_listing.get(path.strip("/"), [])})

    def write_bytes(self, path: str, data: bytes) -> None:
        self._check("write_bytes", path)
        self.written[path] = self.written.get(path, 0) + len(data)
        self.whole_writes[path] = self.whole_writes.get(path, 0) + 1
        self._inner.write_bytes(path, data)

    def read_bytes(self, path: str) -> bytes:
        self._check("read_bytes", path)
        return self._inner.read_bytes(path)

    def remove(self, path: str) -> None:
        self._check("remove", path)
        self._inner.remove(path)

    def local_path(self, path: str) -> Path | None:
        return None if self.remote else self._inner.local_path(path)

    def remove_partial_writes(self, folder: str) -> int:
        self._check("remove_partial_writes", folder)
        return self._inner.remove_partial_writes(folder)

    def _write_range(self, path: str, data: bytes, offset: int) -> None:
        self._check("write_range", path)
        self.written[path] = self.written.get(path, 0) + len(data)
        self._inner.write_range(path, data, offset)
