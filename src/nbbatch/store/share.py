"""Shares: where executed notebooks and run records go.

A share is addressed by a URL-ish string and chosen by prefix, like papermill's I/O handlers:
a plain path is a :class:`FileShare`; other schemes (``azfiles://``) are registered by their
modules, or by plug-ins through the ``nbbatch.shares`` entry-point group. Every share writes
atomically: a reader never sees half a file.
"""

from __future__ import annotations

import errno
import importlib
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Protocol, runtime_checkable

from nbbatch.artifacts import write_file_atomic
from nbbatch.errors import ShareError


@runtime_checkable
class Share(Protocol):
    """The storage protocol every share implements. Paths are ``/``-separated and relative."""

    url: str

    def write_bytes(self, path: str, data: bytes) -> None:
        """Write a whole file atomically (readers see the old file or the new one)."""

    def read_bytes(self, path: str) -> bytes:
        """Read a whole file; raise ``FileNotFoundError`` when it is absent."""

    def exists(self, path: str) -> bool:
        """Whether a file or folder exists."""

    def list(self, path: str = "") -> list[str]:
        """Names directly under a folder (sorted; empty when the folder is absent)."""

    def remove(self, path: str) -> None:
        """Remove a file or a folder tree; absent is fine."""

    def local_path(self, path: str) -> Path | None:
        """The path on this machine's file system, when the share is a local folder."""

    def remove_partial_writes(self, folder: str) -> int:
        """Delete the hidden ``.part`` files a writer killed mid-write left directly in ``folder``; how many.

        Only called where nobody else writes now (a run's folder as its attempt starts)."""


@runtime_checkable
class RangeStore(Protocol):
    """A share that can append to a file and read its tail (logs grow without re-sending them whole)."""

    def write_range(self, path: str, data: bytes, offset: int) -> None:
        """Write ``data`` at byte ``offset`` of ``path`` (growing it). Not atomic: for append-only files."""

    def read_range(self, path: str, offset: int) -> bytes:
        """The bytes of ``path`` from ``offset`` on (``b""`` past its end); ``FileNotFoundError`` when absent."""


@runtime_checkable
class LeaseStore(Protocol):
    """A share that can hold one of its files exclusively, renewably (the driver's lease, :mod:`nbbatch.store.lease`)."""

    def lease_create(self, path: str, holder: bytes) -> bool:
        """Take ``path``, writing ``holder`` into it, when nobody holds it; True when it is now ours."""

    def lease_read(self, path: str) -> tuple[bytes, float] | None:
        """The holder's bytes and the seconds since its last renewal; None when nobody holds it."""

    def lease_renew(self, path: str, holder: bytes) -> bool:
        """Renew our hold (``holder`` is what we wrote); False when it is no longer ours."""

    def lease_break(self, path: str, seen: bytes) -> bool:
        """End a stale hold whose holder is still ``seen``; False when it changed meanwhile (someone took it)."""

    def lease_release(self, path: str, holder: bytes) -> None:
        """Give our hold up (nothing when it is no longer ours)."""


def _file_mode() -> int:
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


FILE_MODE = _file_mode()


class FileShare:
    """A folder on a local or network file system (NFS, a mounted Azure Files share…)."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root).expanduser().resolve()
        self.url = str(self.root)

    def _abs(self, path: str) -> Path:
        full = (self.root / path).resolve()
        if full != self.root and self.root not in full.parents:
            raise ShareError(f"path `{path}` escapes the share {self.root}")
        return full

    def write_bytes(self, path: str, data: bytes) -> None:
        target = self._abs(path)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            write_file_atomic(target, data, FILE_MODE)  # results are meant to be read by others on the share
        except OSError as exc:
            raise self._write_error(path, exc) from exc

    def _write_error(self, path: str, exc: OSError) -> ShareError:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return ShareError(f"the share at {self.root} is out of space while writing `{path}`; the previous "
                              "version of that file (if any) is untouched. Free some space and resubmit: finished "
                              "runs are kept and skipped.")
        blocking = file_in_the_way(self._abs(path).parent)
        if blocking is not None:
            return ShareError(f"{blocking} is a file, where nbbatch needs a folder (to hold `{path}`); move or "
                              "rename that file, or give the experiment another name")
        return ShareError(f"cannot write `{path}` in the share {self.root}: {exc}")

    def read_bytes(self, path: str) -> bytes:
        return self._abs(path).read_bytes()

    def exists(self, path: str) -> bool:
        return self._abs(path).exists()

    def list(self, path: str = "") -> list[str]:
        folder = self._abs(path)
        if not folder.is_dir():
            return []
        return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))

    def remove(self, path: str) -> None:
        target = self._abs(path)
        if target.is_dir():
            shutil.rmtree(target, ignore_errors=True)
        else:
            with _suppress():
                target.unlink()

    def local_path(self, path: str) -> Path | None:
        return self._abs(path)

    def remove_partial_writes(self, folder: str) -> int:
        stale = list(self._abs(folder).glob(".*.part"))
        for path in stale:
            path.unlink(missing_ok=True)
        return len(stale)

    def refused_names(self, paths: Iterable[str]) -> dict[str, str]:
        """``{path: why}`` for the ``/``-separated paths this folder cannot hold as the same name: a backslash or a
        control character (a separator, or refused, where the folder is read over SMB or from Windows), or a name
        or path longer than its file system takes."""
        existing = next(p for p in (self.root, *self.root.parents) if p.exists())
        name_max, path_max = _pathconf(existing, "PC_NAME_MAX", 255), _pathconf(existing, "PC_PATH_MAX", 4096)
        refused = {}
        for path in paths:
            if bad := sorted(set(_UNPORTABLE.findall(path))):
                shown = " ".join(repr(c)[1:-1] if c < " " else c for c in bad)
                refused[path] = f"it holds {shown}, which a folder share does not take in names (read over SMB or " \
                                "from Windows it is a separator, or refused)"
            elif longest := max((p for p in path.split("/") if len(os.fsencode(p)) > name_max), default=None,
                                key=lambda p: len(os.fsencode(p))):
                refused[path] = f"a part of it is {len(os.fsencode(longest))} bytes long; the share's file system " \
                                f"takes at most {name_max}"
            elif len(os.fsencode(self.root / path)) >= path_max:
                refused[path] = f"its path on the share would be {len(os.fsencode(self.root / path))} bytes long; " \
                                f"the share's file system takes less than {path_max}"
        return refused

    # --- optional capabilities (see :class:`RangeStore`, :class:`LeaseStore`) ------------------------
    def write_range(self, path: str, data: bytes, offset: int) -> None:
        target = self._abs(path)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(target, os.O_WRONLY | os.O_CREAT, FILE_MODE)
            try:
                os.pwrite(fd, data, offset)
            finally:
                os.close(fd)
        except OSError as exc:
            raise ShareError(f"cannot write `{path}` in the share {self.root}: {exc}") from exc

    def read_range(self, path: str, offset: int) -> bytes:
        with open(self._abs(path), "rb") as handle:
            handle.seek(offset)
            return handle.read()

    def lease_create(self, path: str, holder: bytes) -> bool:
        target = self._abs(path)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)  # exclusive, also over NFSv3+
        except OSError as exc:
            if isinstance(exc, FileExistsError) and target.parent.is_dir():
                return False  # held
            raise self._write_error(path, exc) from exc
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(holder)
                handle.flush()
                os.fsync(handle.fileno())
        except OSError as exc:  # a full share: an empty lease left behind would lock the experiment out
            with _suppress():
                target.unlink()
            raise self._write_error(path, exc) from exc
        return True

    def lease_read(self, path: str) -> tuple[bytes, float] | None:
        target = self._abs(path)
        try:
            with open(target, "rb") as handle:
                return handle.read(), max(0.0, time.time() - os.fstat(handle.fileno()).st_mtime)
        except FileNotFoundError:
            return None

    def lease_renew(self, path: str, holder: bytes) -> bool:
        current = self.lease_read(path)
        if current is None or current[0] != holder:
            return False
        os.utime(self._abs(path))  # the file system's clock (the server's on NFS) dates the renewal
        return True

    def lease_break(self, path: str, seen: bytes) -> bool:
        target = self._abs(path)
        tomb = target.with_name(f"{target.name}.{uuid.uuid4().hex[:12]}.broken")
        try:
            os.rename(target, tomb)  # atomic: of two breakers, one moves it
        except FileNotFoundError:
            return True  # gone already: free to take
        moved = tomb.read_bytes()
        if moved != seen:  # a fresh holder took it between our look and the rename: give it back
            with _suppress():
                os.link(tomb, target)  # fails when yet another holder exists; theirs stays
            tomb.unlink()
            return False
        tomb.unlink()
        return True

    def lease_release(self, path: str, holder: bytes) -> None:
        current = self.lease_read(path)
        if current is not None and current[0] == holder:
            with _suppress():
                self._abs(path).unlink()


_UNPORTABLE = re.compile(r"[\\\x00-\x1f]")  # a backslash or a control character


def _pathconf(path: Path, name: str, default: int) -> int:
    try:
        return os.pathconf(path, name)
    except (OSError, ValueError):
        return default


def poll_interval(share: Share, local: float = 0.5, remote: float = 2.0) -> float:
    """How long to wait between two reads of ``share`` while watching it: ``local`` seconds on a folder of this
    machine (a read is a cheap stat), ``remote`` seconds on a remote share (each read is a request, often billed)."""
    return local if share.local_path("") is not None else remote


def file_in_the_way(folder: Path) -> Path | None:
    """The file at ``folder`` or above it that stops ``folder`` from being made (None: no file is in the way)."""
    for candidate in (folder, *folder.parents):
        try:
            if candidate.exists() or candidate.is_symlink():
                return None if candidate.is_dir() else candidate
        except OSError:  # a name too long to look at (ENAMETOOLONG): look at its parent
            continue
    return None


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return True


ShareFactory = Callable[[str], Share]
_SHARES: dict[str, ShareFactory] = {}


def register_share(scheme: str, factory: ShareFactory) -> None:
    """Register a share type for URLs starting with ``scheme://``."""
    _SHARES[scheme] = factory


def open_share(url: str | os.PathLike[str] | Share) -> Share:
    """Open the share a URL names: ``scheme://…`` by registry, anything else a folder."""
    if isinstance(url, Share) and not isinstance(url, (str, os.PathLike)):
        return url
    text = os.fspath(url)
    scheme, sep, _ = text.partition("://")
    if sep:
        if scheme not in _SHARES:
            _load_scheme(scheme)
        if scheme not in _SHARES:
            known = ", ".join(sorted(_SHARES) or ["(none)"])
            raise ShareError(f"no share type for `{scheme}://` (known: {known}); use a folder path or a known scheme")
        return _SHARES[scheme](text)
    return FileShare(text)


SHARE_ENTRY_POINTS = "nbbatch.shares"  # plug-ins: `scheme = "package.module:factory"`


def _load_scheme(scheme: str) -> None:
    # Importing a built-in module registers its scheme; kept lazy so `import nbbatch` stays light.
    builtin = {"azfiles": "nbbatch.store.azfiles"}
    if scheme in builtin:
        importlib.import_module(builtin[scheme])
        return
    for entry in entry_points(group=SHARE_ENTRY_POINTS):
        if entry.name == scheme:
            register_share(scheme, entry.load())
