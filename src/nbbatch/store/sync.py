"""Copy a folder tree to a share and back (``nbbatch data push | pull``), skipping unchanged files, resumable.

:func:`push` keeps a manifest in the synced folder on the share, ``<prefix>/.nbbatch-sync.json``::

    {"version": 1, "files": {"<name>": {"bytes": <size>, "sha256": "<hex>"}}}

A file is uploaded only when its entry differs in size or checksum, or the share has lost the file. Each
upload is atomic (:meth:`~nbbatch.store.share.Share.write_bytes`), and an entry is added only after its file
is written; entries of files about to be overwritten or deleted are taken out first. So every entry of the
share's manifest is true of the share at any moment (unless something else writes there), and a push cut
off at any point, even killed outright, uploads again at most the files copied since its last manifest write
(every :data:`MANIFEST_INTERVAL` seconds, after the last file, and on an error).

:func:`pull` downloads what the manifest lists, verifying each file's checksum; a folder without a manifest
(uploaded by another tool) is listed and downloaded whole, files whose local copy has the same bytes left
untouched.

Names are ``/``-separated paths relative to the synced folder; a name that is absolute, holds ``..`` or
empty parts is refused, so neither a hostile manifest nor a hostile share listing writes outside ``dest``.
Two pushes to the same folder at the same time are not coordinated (the last manifest written wins); a
pull's checksum check catches the mix.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nbbatch.errors import ShareError
from nbbatch.store.azfiles_names import suggest
from nbbatch.store.share import FILE_MODE, Share, write_file_atomic

__all__ = ["FileEntry", "SyncResult", "MANIFEST", "MANIFEST_INTERVAL", "tree_listing", "push", "pull"]

MANIFEST = ".nbbatch-sync.json"  # hidden: Share.list leaves it out
MANIFEST_VERSION = 1
MANIFEST_INTERVAL = 5.0  # seconds between manifest writes while copying: the most work a killed push loses
CHUNK = 1024 * 1024  # hashing reads files in chunks of this size
_TEMP = re.compile(r"^\..*\.part")  # `.<name>.<random>.part`: a write in progress (write_file_atomic, Azure Files)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class FileEntry:
    """One file of a synced tree: its ``/``-separated name relative to the folder, size and SHA-256."""

    name: str
    bytes: int
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        """``{"name", "bytes", "sha256"}``."""
        return {"name": self.name, "bytes": self.bytes, "sha256": self.sha256}


@dataclass
class SyncResult:
    """What a :func:`push` or :func:`pull` did; names are relative to the synced folder, sorted."""

    copied: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # unchanged: already there with the same bytes
    removed: list[str] = field(default_factory=list)  # deleted at the destination (``delete=True``)
    bytes_copied: int = 0
    files: list[FileEntry] = field(default_factory=list)  # push: the source's files; pull: the share's
    unreadable: list[str] = field(default_factory=list)  # pull: share paths left out, not readable (skip_unreadable)
    refused: dict[str, str] = field(default_factory=dict)  # push: names the share cannot hold, left out -> why
    warnings: list[str] = field(default_factory=list)  # what was left out, and why (one line each)


# --- names --------------------------------------------------------------------------------------------


def _bad_name(name: str) -> bool:
    """Whether ``name`` is not a plain relative ``/``-separated path (it could steer a write elsewhere)."""
    return (not isinstance(name, str) or not name or name.startswith("/") or "\\" in name or "\0" in name
            or re.match(r"^[A-Za-z]:", name) is not None
            or any(part in ("", ".", "..") for part in name.split("/")))


def _clean_prefix(prefix: str) -> str:
    """The folder on the share as ``a/b`` (no empty or ``.`` parts); ShareError for ``..``."""
    parts = [p for p in str(prefix or "").replace("\\", "/").split("/") if p and p != "."]
    if ".." in parts:
        raise ShareError(f"the folder `{prefix}` on the share must not contain `..`: name a folder inside the share, "
                         "e.g. `datasets/mnist`")
    return "/".join(parts)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix and name else prefix or name


def _where(share: Share, path: str) -> str:
    return f"{share.url.rstrip('/')}/{path}" if path else share.url


# --- the local tree -----------------------------------------------------------------------------------


def _skipped_name(filename: str) -> bool:
    return filename == MANIFEST or _TEMP.match(filename) is not None


def _raise_walk_error(exc: OSError) -> None:
    # os.walk skips unreadable folders silently by default: a push would then miss files without a word.
    raise ShareError(f"cannot read the folder {exc.filename}: {exc.strerror or exc}")


def _walk_files(folder: Path) -> Iterator[tuple[str, Path]]:
    """(name, path) of every regular file under ``folder``, symlinks to files followed, linked folders not entered."""
    for root, dirs, files in os.walk(folder, onerror=_raise_walk_error):  # followlinks=False: no cycles, no surprise trees
        dirs.sort()
        base = Path(root)
        for filename in sorted(files):
            path = base / filename
            if _skipped_name(filename) or not path.is_file():  # is_file: not a dangling link, FIFO or socket
                continue
            yield path.relative_to(folder).as_posix(), path


def _hash_file(path: Path) -> tuple[int, str]:
    """(size, sha256) of a file, read in chunks (a file of any size in constant memory)."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def tree_listing(folder: Path) -> list[FileEntry]:
    """Every regular file under ``folder`` with its size and SHA-256, sorted by name.

    Left out: hidden temporary ``.*.part*`` files (writes in progress) and sync manifests. A symlink to a
    file counts as that file, wherever it points (the content is copied under the link's name, like
    ``cp -L``); a symlink to a folder is not entered (no cycles, no unexpected trees), nor are dangling
    links, FIFOs and sockets. A name holding a backslash is kept as it is; :func:`push` leaves it out, naming it.
    """
    folder = Path(folder)
    entries = []
    for name, path in _walk_files(folder):
        try:
            size, digest = _hash_file(path)
        except OSError as exc:
            raise ShareError(f"cannot read {path}: {exc.strerror or exc}") from exc
        entries.append(FileEntry(name, size, digest))
    return sorted(entries, key=lambda e: e.name)


def _same_local(path: Path, entry: FileEntry) -> bool:
    """Whether ``path`` is a file holding exactly ``entry``'s bytes (the checksum only when the size matches)."""
    try:
        return path.is_file() and path.stat().st_size == entry.bytes and _hash_file(path)[1] == entry.sha256
    except OSError:
        return False  # unreadable: write it again (a real problem then shows as a write error)


def _write_local(dest: Path, name: str, data: bytes) -> None:
    target = dest / name
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write_file_atomic(target, data, FILE_MODE)  # a reader (or a crash) never sees half a file
    except OSError as exc:
        raise ShareError(f"cannot write {target}: {exc.strerror or exc}") from exc


def _delete_local(dest: Path, keep: set[str], visible_only: bool, left_out: Sequence[str] = ()) -> list[str]:
    """Delete files under ``dest`` not in ``keep`` nor ``left_out`` (files or folders the pull could not read or
    follow), with ``visible_only`` hidden ones kept too; prune emptied folders."""
    removed = []
    if not dest.is_dir():
        return removed
    for name, path in list(_walk_files(dest)):
        if name in keep or (visible_only and any(p.startswith(".") for p in name.split("/"))) \
                or any(name == gone or name.startswith(gone + "/") for gone in left_out):
            continue
        try:
            path.unlink()
        except OSError as exc:
            raise ShareError(f"cannot delete {path}: {exc.strerror or exc}") from exc
        removed.append(name)
        folder = path.parent
        while folder != dest and dest in folder.parents:
            try:
                folder.rmdir()  # only when empty
            except OSError:
                break
            folder = folder.parent
    return sorted(removed)


def _check_overlap(local: Path, share: Share, prefix: str, verb: str) -> None:
    """Refuse a local folder and a share folder (a FileShare) that hold one another: a copy would feed on itself."""
    there = share.local_path(prefix)
    if there is None:
        return
    here, there = local.resolve(), Path(there).resolve()
    if here == there or here in there.parents or there in here.parents:
        raise ShareError(f"cannot {verb}: {local} and the share folder {there} hold one another; "
                         "pick a folder outside the other")


# --- the manifest -------------------------------------------------------------------------------------


def _read_manifest(share: Share, prefix: str) -> dict[str, FileEntry] | None:
    """The manifest's entries by name; None when there is none. ShareError when it is malformed or hostile."""
    path = _join(prefix, MANIFEST)
    where = _where(share, path)
    try:
        raw = share.read_bytes(path)
    except (FileNotFoundError, NotADirectoryError):  # NotADirectoryError: the prefix is a file (told later)
        return None
    except IsADirectoryError as exc:
        raise ShareError(f"{where} is a folder, where nbbatch keeps its sync manifest; remove or rename it") from exc
    fix = f"delete {where} (the next push then uploads everything again)"
    try:
        doc = json.loads(raw)
        version, files = doc["version"], doc["files"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ShareError(f"the sync manifest {where} is not valid ({exc}); {fix}") from exc
    if version != MANIFEST_VERSION:
        raise ShareError(f"the sync manifest {where} has version {version!r}, this nbbatch reads version "
                         f"{MANIFEST_VERSION}; upgrade nbbatch, or {fix}")
    if not isinstance(files, dict):
        raise ShareError(f"the sync manifest {where} is not valid (`files` is not a mapping); {fix}")
    entries = {}
    for name, item in files.items():
        if _bad_name(name):
            raise ShareError(f"the sync manifest {where} lists `{name}`, which is not a relative file name "
                             f"(absolute, `..` or empty parts): refused, nothing is written outside the destination; {fix}")
        size = item.get("bytes") if isinstance(item, dict) else None
        digest = item.get("sha256") if isinstance(item, dict) else None
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 \
                or not isinstance(digest, str) or not _SHA256.match(digest):
            raise ShareError(f"the sync manifest {where} has a malformed entry for `{name}`; {fix}")
        entries[name] = FileEntry(name, size, digest)
    return entries


def _write_manifest(share: Share, prefix: str, entries: dict[str, FileEntry]) -> None:
    doc = {"version": MANIFEST_VERSION,
           "files": {n: {"bytes": e.bytes, "sha256": e.sha256} for n, e in sorted(entries.items())}}
    share.write_bytes(_join(prefix, MANIFEST), json.dumps(doc, indent=1, sort_keys=True).encode())


class _OnShare:
    """Whether files exist on the share: one ``list()`` per folder rather than a request per file."""

    def __init__(self, share: Share, prefix: str) -> None:
        self.share, self.prefix = share, prefix
        self.folders: dict[str, set[str]] = {}

    def __contains__(self, name: str) -> bool:
        folder, _, base = name.rpartition("/")
        if base.startswith("."):  # list() leaves hidden names out: ask for this one
            return self.share.exists(_join(self.prefix, name))
        if folder not in self.folders:
            self.folders[folder] = set(self.share.list(_join(self.prefix, folder)))
        return base in self.folders[folder]


# --- push ---------------------------------------------------------------------------------------------


def push(source: Path, share: Share, prefix: str = "", *, delete: bool = False,
         progress: Progress | None = None) -> SyncResult:
    """Copy the folder ``source`` to ``prefix`` in ``share``, uploading only new or changed files.

    A file is skipped when the share's manifest lists it with the same size and SHA-256 and the share still
    has it. With ``delete``, files the manifest lists that ``source`` no longer has are removed from the
    share (files the manifest does not list are never touched; entries leave the manifest before their files
    go, so a push cut off while removing may leave a few unlisted files). Without ``delete`` those files stay,
    and listed. ``progress(name, done_bytes, total_bytes)`` is called once with name ``""`` and 0 done
    before the first upload, then after each uploaded file (bytes of uploads only). ``result.files`` is the
    source's tree as uploaded. Raises :class:`ShareError` for a missing source, a source that is a file, a
    prefix with ``..``, a share that fails, or a source none of whose files the share can hold by name.

    A file whose name the share cannot hold (a backslash, a control character, a name or path too long, a name
    Azure Files refuses, one that differs from another only in case there) is left out: ``result.refused`` names
    each with why, and one line of ``result.warnings`` says how many, which, and a name that works.
    """
    source = Path(source).expanduser()
    if not source.exists():
        raise ShareError(f"cannot push {source}: no such folder; check the path (the folder of files to copy)")
    if not source.is_dir():
        raise ShareError(f"cannot push {source}: it is a file, not a folder; put it in a folder and push that")
    prefix = _clean_prefix(prefix)
    _check_overlap(source, share, prefix, "push")
    listing = tree_listing(source)
    refused = _share_refuses(share, prefix, [e.name for e in listing])  # copied none of them; told at the end
    refused.update({e.name: SEPARATOR_IN_NAME for e in listing if _bad_name(e.name)})
    old = _read_manifest(share, prefix) or {}
    on_share = _OnShare(share, prefix)
    todo = [e for e in listing if e.name not in refused and not (old.get(e.name) == e and e.name in on_share)]
    todo_names = {e.name for e in todo}
    names = {e.name for e in listing}
    result = SyncResult(skipped=[e.name for e in listing if e.name not in todo_names])
    files = {e.name: e for e in listing}
    manifest = dict(old)
    stale = [e.name for e in todo if e.name in manifest]
    if stale:  # about to be overwritten: out of the manifest first, so it never lists a file's new bytes as old
        for name in stale:
            del manifest[name]
        _write_manifest(share, prefix, manifest)
    gone = sorted(n for n in old if n not in names) if delete else []
    total = sum(e.bytes for e in todo)
    done = 0
    dirty = False
    last_write = time.monotonic()
    if todo and progress:
        progress("", 0, total)
    try:
        for entry in todo:
            # The whole file in memory, once: Share.write_bytes takes bytes (atomic per file). Hashing
            # these bytes again records what was really uploaded, should the file have changed since listed.
            try:
                data = (source / entry.name).read_bytes()
            except OSError as exc:
                raise ShareError(f"cannot read {source / entry.name}: {exc.strerror or exc} "
                                 "(did it change during the push? push again)") from exc
            sent = FileEntry(entry.name, len(data), hashlib.sha256(data).hexdigest())
            try:
                share.write_bytes(_join(prefix, entry.name), data)
            except ShareError as exc:
                if (why := _name_refused_by(exc)) is None:
                    raise
                refused[entry.name] = why  # a file system that tells only when asked (an SMB or NFS mount)
                continue
            del data
            manifest[entry.name] = files[entry.name] = sent  # only now that the file is written
            dirty = True
            result.copied.append(entry.name)
            result.bytes_copied += sent.bytes
            done += sent.bytes
            if progress:
                progress(entry.name, done, max(total, done))
            if time.monotonic() - last_write >= MANIFEST_INTERVAL:
                _write_manifest(share, prefix, manifest)
                dirty, last_write = False, time.monotonic()
        for name in gone:  # out of the manifest before the share loses them: it never lists a missing file
            del manifest[name]
        if dirty or gone:
            _write_manifest(share, prefix, manifest)
            dirty = False
        for name in gone:  # after the uploads: a push cut off early has lost nothing
            share.remove(_join(prefix, name))
            result.removed.append(name)
    except BaseException:
        if dirty:  # keep what was copied, so a rerun skips it
            try:
                _write_manifest(share, prefix, manifest)
            except Exception:  # noqa: BLE001 - the share is failing: the error at hand says why
                pass
        raise
    result.files = sorted(files.values(), key=lambda e: e.name)
    if refused:
        _tell_refused(result, refused, len(listing), source, share, prefix)
    return result


def _tell_refused(result: SyncResult, refused: dict[str, str], listed: int, source: Path, share: Share,
                  prefix: str) -> None:
    """Name the files left out because the share cannot hold their names (a warning), or fail when none was pushed."""
    result.refused = dict(sorted(refused.items()))
    reasons = "; ".join(f"`{name}`: {why}" + (f" (e.g. `{suggest(name)}`)" if suggest(name) != name else "")
                        for name, why in result.refused.items())  # a case clash has no name to suggest
    if len(refused) == listed:
        raise ShareError(f"none of the {listed} file(s) of {source} was pushed: {_where(share, prefix)} "
                         f"cannot hold their names: {reasons}. Rename them and push again")
    result.warnings.append(f"{len(refused)} file(s) of {source} left out: {_where(share, prefix)} cannot hold their "
                           f"names: {reasons}. Rename them and push again; the other "
                           f"{listed - len(refused)} file(s) were pushed")


SEPARATOR_IN_NAME = "it holds a backslash (or starts like a drive, `C:`), which shares take as a separator"
_NAME_ERRNOS = (errno.ENAMETOOLONG, errno.EILSEQ, errno.EINVAL)  # what a file system answers for a name it cannot hold


def _name_refused_by(exc: ShareError) -> str | None:
    """Why the share refused a file's name, when ``exc`` (a write's error) is about its name; None otherwise."""
    cause = exc.__cause__
    if isinstance(cause, OSError) and cause.errno in _NAME_ERRNOS:
        return f"the share's file system refused the name ({cause.strerror})"
    return None


def _share_refuses(share: Share, prefix: str, names: list[str]) -> dict[str, str]:
    """``{name: why}`` for the names ``share`` cannot hold (Azure Files' naming rules; nothing on a folder share)."""
    check = getattr(share, "refused_names", None)
    if check is None:
        return {}
    full = {_join(prefix, name): name for name in names}
    return {full[path]: why for path, why in check(list(full)).items()}


# --- pull ---------------------------------------------------------------------------------------------


def pull(share: Share, prefix: str, dest: Path, *, delete: bool = False,
         progress: Progress | None = None, skip_unreadable: bool = False) -> SyncResult:
    """Copy the folder ``prefix`` of ``share`` to the local folder ``dest`` (created when absent).

    With a sync manifest (written by :func:`push`), each listed file whose local copy is missing or
    differs in size or SHA-256 is downloaded, its checksum verified (:class:`ShareError` naming the file on
    a mismatch) and written atomically. Without one (a folder uploaded by another tool) the folder is
    listed recursively and every file downloaded; a local file with the same bytes is not rewritten and
    counts as skipped (sizes alone are not trusted: a rewritten file often keeps its size). Hidden files are
    not listed by shares, so they are not pulled then. On a folder share, symlinks are never followed out of
    the share nor into folders (no loops, no trees from elsewhere): a link to a file of the share comes as
    that file, any other link is left out with a line in ``result.warnings``. With ``delete``, local files the
    share lacks are deleted (without a manifest, hidden local files stay). A file or folder the share refuses to
    read (permissions) is a :class:`ShareError`, or with ``skip_unreadable`` left out, named in
    ``result.unreadable`` and ``result.warnings``. ``progress`` as for :func:`push`; ``total_bytes`` is 0
    (unknown) without a manifest. Raises :class:`ShareError` when nothing is at ``prefix``.
    """
    prefix = _clean_prefix(prefix)
    dest = Path(dest).expanduser()
    if dest.exists() and not dest.is_dir():
        raise ShareError(f"cannot pull into {dest}: it is a file; name a folder (created when absent)")
    _check_overlap(dest, share, prefix, "pull")
    result = SyncResult()
    try:
        manifest = _read_manifest(share, prefix)
    except PermissionError as exc:
        _denied(share, prefix, exc, skip_unreadable, result)
        return result
    if manifest is None:
        return _pull_unlisted(share, prefix, dest, delete, progress, result, skip_unreadable)
    where = _where(share, prefix)
    entries = sorted(manifest.values(), key=lambda e: e.name)
    result.files = entries
    todo = []
    for entry in entries:
        if _same_local(dest / entry.name, entry):
            result.skipped.append(entry.name)
        else:
            todo.append(entry)
    total = sum(e.bytes for e in todo)
    if todo and progress:
        progress("", 0, total)
    for entry in todo:
        try:
            data = share.read_bytes(_join(prefix, entry.name))
        except PermissionError as exc:
            _denied(share, _join(prefix, entry.name), exc, skip_unreadable, result)
            continue
        except (FileNotFoundError, IsADirectoryError) as exc:
            raise ShareError(f"`{entry.name}` is listed in the sync manifest of {where} but is not a file there; "
                             "push the folder again (nbbatch data push), then pull") from exc
        digest = hashlib.sha256(data).hexdigest()
        if len(data) != entry.bytes or digest != entry.sha256:
            raise ShareError(f"`{entry.name}` in {where} does not match its sync manifest ({len(data)} bytes, "
                             f"sha256 {digest[:12]}…; expected {entry.bytes} bytes, {entry.sha256[:12]}…): it was "
                             "changed after the last push, or damaged; push it again, then pull")
        _write_local(dest, entry.name, data)
        result.copied.append(entry.name)
        result.bytes_copied += len(data)
        if progress:
            progress(entry.name, result.bytes_copied, total)
    if delete:
        result.removed = _delete_local(dest, set(manifest), visible_only=False)
    return result


def _denied(share: Share, path: str, exc: OSError, skip: bool, result: SyncResult) -> None:
    """A file or folder of the share we may not read: a ShareError, or (``skip``) noted in ``result``."""
    where = _where(share, path)
    if not skip:
        raise ShareError(f"cannot read {where}: permission denied; ask its owner to make it readable "
                         "(chmod -R a+rX), or pull as a user who may read it") from exc
    result.unreadable.append(path)
    result.warnings.append(f"{where} is not readable (permission denied): left out")


def _pull_unlisted(share: Share, prefix: str, dest: Path, delete: bool, progress: Progress | None,
                   result: SyncResult, skip_unreadable: bool) -> SyncResult:
    """Pull a folder that has no sync manifest: list it, download every file, rewrite those that differ."""
    where = _where(share, prefix)
    try:
        top = share.list(prefix)
    except PermissionError as exc:
        _denied(share, prefix, exc, skip_unreadable, result)
        return result
    if not top:
        if not share.exists(prefix):
            raise ShareError(f"nothing at {where}: check the URL and folder, or push there first "
                             f"(nbbatch data push FOLDER {where})")
        if prefix:
            try:
                share.read_bytes(prefix)
            except (FileNotFoundError, IsADirectoryError):
                pass  # an empty folder
            else:
                raise ShareError(f"{where} is a file; pull names a folder (its parent, say)")
    seen: dict[str, FileEntry] = {}
    walk = _ShareWalk(share, prefix, result, skip_unreadable)
    for name, data in walk.files("", top):
        entry = FileEntry(name, len(data), hashlib.sha256(data).hexdigest())
        seen[name] = entry
        if _same_local(dest / name, entry):
            result.skipped.append(name)
            continue
        _write_local(dest, name, data)
        result.copied.append(name)
        result.bytes_copied += entry.bytes
        if progress:
            progress(name, result.bytes_copied, 0)
    result.files = sorted(seen.values(), key=lambda e: e.name)
    if delete:  # hidden names: list() never shows them, so the share may well have them; nor what was left out
        result.removed = _delete_local(dest, set(seen), visible_only=True, left_out=walk.left_out)
    return result


class _ShareWalk:
    """Every file under a share's folder, depth first in name order, links and unreadable entries left out."""

    def __init__(self, share: Share, prefix: str, result: SyncResult, skip_unreadable: bool) -> None:
        self.share, self.prefix, self.result, self.skip_unreadable = share, prefix, result, skip_unreadable
        self.links = share.local_path(prefix)  # on a folder share: where to look for symlinks (never followed)
        self.left_out: list[str] = []  # names (files or folders) not pulled: a local copy of them is not deleted

    def files(self, rel: str, children: list[str]) -> Iterator[tuple[str, bytes]]:
        """(name, bytes) of every file under ``prefix/rel``.

        Reading each name first tells files from folders with the Share protocol alone: a folder raises
        IsADirectoryError (a FileShare, Azure Files) or FileNotFoundError (some servers), and is then listed.
        """
        share, prefix = self.share, self.prefix
        for child in children:
            if _bad_name(child) or "/" in child:
                raise ShareError(f"{_where(share, _join(prefix, rel))} lists an entry named `{child}`, which is "
                                 "not a file name: refused, nothing is written outside the destination")
            name = _join(rel, child)
            refusal = _link_refusal(self.links / name, share.local_path("")) if self.links is not None else None
            if refusal:
                self._leave_out(name, f"{_where(share, _join(prefix, name))} is a symbolic link {refusal}: "
                                      "not followed, left out")
                continue
            try:
                data = share.read_bytes(_join(prefix, name))
            except PermissionError as exc:
                _denied(share, _join(prefix, name), exc, self.skip_unreadable, self.result)
                self.left_out.append(name)
                continue
            except (IsADirectoryError, FileNotFoundError):
                try:
                    below = share.list(_join(prefix, name))  # empty: an empty folder, or a file gone meanwhile
                except PermissionError as exc:
                    _denied(share, _join(prefix, name), exc, self.skip_unreadable, self.result)
                    self.left_out.append(name)
                    continue
                yield from self.files(name, below)
                continue
            yield name, data

    def _leave_out(self, name: str, warning: str) -> None:
        self.left_out.append(name)
        self.result.warnings.append(warning)


def _link_refusal(path: Path, root: Path | None) -> str | None:
    """Why the symlink ``path`` on the folder share ``root`` is not followed; None when it is no symlink, or ends at a
    file inside the share (that file is copied then, like ``cp -L``)."""
    if not path.is_symlink():
        return None
    target = path.resolve()
    if root is None or not (target == root or root in target.parents):
        return f"to {target}, out of the share"
    if target.is_dir():
        return "to a folder (it may loop, or bring a tree from elsewhere)"
    return None if target.is_file() else "that leads to no file"
