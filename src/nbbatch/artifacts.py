"""Where a notebook puts what it makes: ``output_dir()`` for results, ``checkpoint_dir()`` to resume.

Kernel side (light: the standard library only). nbbatch gives every run two folders through the
environment:

* ``NBBATCH_OUTPUT_DIR``: what the notebook writes here (a trained model, figures) lands in
  ``<share>/<experiment>/<run id>/outputs/``, is listed in run.json and comes back with ``nbbatch fetch``;
* ``NBBATCH_CHECKPOINT_DIR``: kept across the attempts of one run (``<run id>/checkpoints/``), so an
  attempt after a kernel death, a lost node or a preempted VM continues from the last checkpoint
  (removed once the run succeeds).

Outside nbbatch (a notebook opened by hand) ``output_dir()`` is ``./outputs`` and ``checkpoint_dir()``
is None: nothing to resume from, nothing kept. Write checkpoints with :func:`atomic_path`, so a kernel
killed mid-write leaves the previous checkpoint whole. :func:`write_file_atomic` is the same write for bytes
in hand, and the one every part of nbbatch uses for local files (the lowest layer, so the kernel side can too).
:class:`BackgroundWriter` does such writes in a thread of their own, so that training goes on while a checkpoint
is written.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

OUTPUT_DIR_ENV = "NBBATCH_OUTPUT_DIR"
CHECKPOINT_DIR_ENV = "NBBATCH_CHECKPOINT_DIR"
DEFAULT_OUTPUT_DIR = "outputs"  # outside nbbatch, relative to the notebook's working directory


def output_dir() -> Path:
    """The folder for the run's results (created): ``NBBATCH_OUTPUT_DIR``, else ``./outputs``."""
    folder = Path(os.environ.get(OUTPUT_DIR_ENV) or DEFAULT_OUTPUT_DIR)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def checkpoint_dir() -> Path | None:
    """The folder kept across the run's attempts (created), or None outside nbbatch (do not checkpoint)."""
    value = os.environ.get(CHECKPOINT_DIR_ENV)
    if not value:
        return None
    folder = Path(value)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def checkpoint_path(name: str) -> Path | None:
    """``checkpoint_dir() / name``, or None outside nbbatch."""
    folder = checkpoint_dir()
    return folder / name if folder is not None else None


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary path beside ``target`` to write to; renamed over ``target`` when the block ends without error.

    ``with atomic_path(ckpt) as tmp: torch.save(state, tmp)``: a reader (or the next attempt) sees the
    old file or the new one, never half of one. The temporary name keeps ``target``'s suffix, for
    savers that choose a format by it (Keras' ``.keras``). A folder (a TensorFlow SavedModel) works too:
    the old folder is moved aside, the new one renamed in, then the old one removed.
    """
    with _replaced_whole(Path(target), keep_suffix=True) as tmp:
        yield tmp


class BackgroundWriter:
    """Writes files in one background thread, one at a time and in the order asked, each through :func:`atomic_path`.

    ``writer.write(ckpt, lambda tmp: torch.save(state, tmp))`` returns at once: the next epoch trains while
    the file is written. ``state`` must be a copy that training does not change (tensors copied to the host).
    A write waits for the one before it; :meth:`wait` waits for the last, and raises the error of a failed write
    (so does the next :meth:`write`). Call :meth:`wait` before the notebook relies on the file being there.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nbbatch-writer")
        self._last: Future[None] | None = None

    def write(self, target: str | os.PathLike[str], write: Callable[[Path], object]) -> None:
        """Have ``write(tmp)`` write ``target``'s new content to ``tmp`` in the background; renamed over ``target``
        when it returns."""
        self.wait()
        self._last = self._pool.submit(self._write, Path(target), write)

    def wait(self) -> None:
        """Wait until the last write is done (renamed into place); raise its error if it failed."""
        last, self._last = self._last, None
        if last is not None:
            last.result()

    @staticmethod
    def _write(target: Path, write: Callable[[Path], object]) -> None:
        with atomic_path(target) as tmp:
            write(tmp)


def write_file_atomic(target: str | os.PathLike[str], data: bytes, mode: int = 0o600) -> None:
    """Replace ``target`` by ``data`` with permissions ``mode`` (the owner's only unless told otherwise).

    The one atomic write of a local file, for the driver and the kernel alike: a reader sees the old file
    or the new one, never half of one, and the new one survives a crash of the machine once this returns.
    """
    with _replaced_whole(Path(target), keep_suffix=False) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.fchmod(fd, mode)  # exactly ``mode``, whatever the umask
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)


@contextlib.contextmanager
def _replaced_whole(target: Path, keep_suffix: bool) -> Iterator[Path]:
    """A fresh hidden ``.<name>.<random>.part`` beside ``target`` (plus ``target``'s suffix with ``keep_suffix``)
    to write; when the block ends without error it is synced and renamed over ``target``; otherwise removed.

    The name is random so that two writers of one target never share a temporary file; beside the target
    so that the rename stays on one file system (atomic).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    suffix = f".part{target.suffix}" if keep_suffix else ".part"
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=suffix)
    os.close(fd)
    os.unlink(name)  # savers that refuse to overwrite find no file; the name stays ours (random, hidden)
    tmp = Path(name)
    try:
        yield tmp
        if tmp.is_dir() and target.is_dir():
            old = tmp.with_name(tmp.name + ".old")
            os.replace(target, old)  # a folder cannot be renamed over a folder that has files
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            fsync_path(tmp)  # the data is on disk before the name points at it
            os.replace(tmp, target)
        fsync_path(target.parent)  # and the rename itself survives a crash of the machine
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()


def sync_tree(folder: str | os.PathLike[str]) -> None:
    """Flush every file under ``folder``, then the folder itself: on a share mounted through FUSE (Azure ML's data
    runtime) ``fsync`` is what uploads a file's pending writes, so a record written after this names files that
    are there, not still on their way."""
    for parent, _, names in os.walk(folder):
        for name in names:
            fsync_path(Path(parent, name))
        fsync_path(Path(parent))


def fsync_path(path: Path) -> None:
    """Flush ``path`` (a file or a folder) to disk; nothing where the file system cannot (some network ones)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
