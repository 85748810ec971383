"""What a run shows while it goes: its streamed files and its record, kept current on the share.

A run appends to three files as it executes: ``log.txt`` (the kernel's output, through a :class:`LogSink`),
``metrics.jsonl`` (each ``nbbatch.record(step=...)`` point) and ``telemetry.jsonl`` (GPU samples). Each is a
:class:`StreamedFile`: written in the run folder itself when the share is a mounted folder, else in a
scratch folder and mirrored to the share (only the new bytes where the share can append, see
:class:`~nbbatch.store.share.RangeStore`; the whole file at most every 30 s otherwise).

:class:`LiveRecord` rewrites ``run.json`` when something a viewer shows changed (cell progress, the
latest metrics, GPU use), at most once every ``every`` seconds and never later than that after a
change, from a background thread, so ``nbbatch status`` and the widgets see a run's progress while
it goes without a write per cell or per point.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from nbbatch.artifacts import fsync_path
from nbbatch.errors import ShareError
from nbbatch.store.runfiles import write_record
from nbbatch.store.runjson import RunRecord
from nbbatch.store.share import RangeStore, Share

log = logging.getLogger(__name__)


_LOG_CHUNK = 1 << 20  # characters


class StreamedFile:
    """A file a run appends to while it goes, at ``path`` in ``share``, written locally at ``local``.

    ``remote`` says whether ``local`` is a scratch copy that :meth:`push` mirrors to the share (else it
    is the share's file itself). ``fresh``: the run's earlier file is replaced (a first attempt);
    otherwise the new lines follow it (a retry continues the same log and history).
    """

    WHOLE_EVERY_S = 30.0
    FLUSH_EVERY_S = 5.0  # the share's own file: flushed at most this often (a mount uploads appends on fsync)

    def __init__(self, share: Share, path: str, local: Path, *, remote: bool, fresh: bool):
        self.share, self.path, self.local, self.remote = share, path, local, remote
        self.ranged = remote and isinstance(share, RangeStore)
        self.offset: int | None = None if fresh else 0  # None: the first push replaces the share's file
        self._last_whole = 0.0
        self._flushed: tuple[int, float] = (0, 0.0)  # (size, when) at the last flush of the share's own file
        self._lock = threading.Lock()
        if fresh:
            local.unlink(missing_ok=True)
        elif remote:  # the earlier attempts' lines come first
            with contextlib.suppress(FileNotFoundError):
                local.write_bytes(share.read_bytes(path))
            self.offset = local.stat().st_size if local.exists() else 0

    def append(self, data: bytes) -> None:
        """Add complete lines (a reader never takes a half line: see :func:`nbbatch.store.jsonl.parse_jsonl`)."""
        with self._lock, open(self.local, "ab") as handle:
            handle.write(data)

    def push(self, final: bool = False) -> None:
        """Bring the share's copy up to date: a remote share's by writing it, the share's own file by flushing it
        when it grew (a share mounted through FUSE, as Azure ML's data runtime mounts one, may upload appended lines
        only on ``fsync`` or close: without it the driver would see a running job's log only once it ended)."""
        if not self.remote:
            self._flush(final)
            return
        with self._lock:
            if not self.local.exists():
                if final and self.offset is None:  # nothing this time: an earlier submission's file goes
                    with contextlib.suppress(FileNotFoundError):
                        self.share.remove(self.path)
                return
            if self.ranged and self.offset is not None:
                with open(self.local, "rb") as handle:
                    handle.seek(self.offset)
                    chunk = handle.read()
                if chunk:
                    self.share.write_range(self.path, chunk, self.offset)  # type: ignore[attr-defined]
                    self.offset += len(chunk)
                return
            if final or self.ranged or time.monotonic() - self._last_whole >= self.WHOLE_EVERY_S:
                data = self.local.read_bytes()
                self.share.write_bytes(self.path, data)
                self.offset, self._last_whole = len(data), time.monotonic()


    def _flush(self, final: bool) -> None:
        with self._lock:
            try:
                size = self.local.stat().st_size
            except FileNotFoundError:
                return
            flushed_size, flushed_at = self._flushed
            if size == flushed_size or (not final and time.monotonic() - flushed_at < self.FLUSH_EVERY_S):
                return
            self._flushed = (size, time.monotonic())
        fsync_path(self.local)  # outside the lock: an upload through a mount must not hold up the run's appends


class LogSink(io.TextIOBase):
    """A text stream the kernel's stdout/stderr go to: a local file, synced to remote shares.

    A write that fails (the share is full) never breaks the run's execution: the sink keeps the first
    error in ``error`` and stops writing; the run is then failed with it. The file is flushed to storage (``fsync``)
    at most every :attr:`FLUSH_EVERY_S`: a share mounted through FUSE (Azure ML's data runtime) may upload what a
    held-open file was given only then. With ``echo`` (run-one's stdout where ``NBBATCH_LOG_ECHO`` is set: a job
    whose own log stream is what ``nbbatch logs -f`` follows) every line goes there too.
    """

    FLUSH_EVERY_S = 5.0

    def __init__(self, path: Path, echo: IO[str] | None = None):
        self.path, self.echo = path, echo
        self.error: OSError | None = None
        self._lock = threading.Lock()
        self._handle: IO[str] | None = None
        self._synced_at = time.monotonic()
        try:
            self._handle = open(path, "a", encoding="utf-8", errors="replace")
        except OSError as exc:
            self.error = exc

    def write(self, text: str) -> int:  # type: ignore[override]
        with self._lock:
            if self._handle is not None and self.error is None:
                try:
                    for start in range(0, len(text), _LOG_CHUNK):  # encoded a slice at a time, not as one copy
                        self._handle.write(text[start:start + _LOG_CHUNK])
                    self._handle.flush()
                    if time.monotonic() - self._synced_at >= self.FLUSH_EVERY_S:
                        os.fsync(self._handle.fileno())
                        self._synced_at = time.monotonic()
                except OSError as exc:
                    self.error = exc
            if self.echo is not None:
                with contextlib.suppress(OSError, ValueError):  # a closed or broken stdout loses the echo only
                    self.echo.write(text)
                    self.echo.flush()
        return len(text)

    def close(self) -> None:
        with self._lock:
            if self._handle is not None:
                with contextlib.suppress(OSError):
                    self._handle.close()
        super().close()


class LiveRecord:
    """Keeps a running record on the share current; mutate the record only inside ``with live.lock``.

    ``summary`` (the GPU sampler's live summary) is read at each write; ``streams`` are pushed with it.
    :meth:`stop` ends the background writes; the caller then writes the final record itself.
    GPU use alone (no other change) rewrites the record at most every :attr:`TELEMETRY_EVERY_S`.
    """

    TELEMETRY_EVERY_S = 10.0

    def __init__(self, share: Share, record: RunRecord, notify: Callable[[RunRecord], None],
                 streams: Sequence[StreamedFile] = (), every: float = 2.0):
        self.share, self.record, self.notify, self.streams, self.every = share, record, notify, list(streams), every
        self.lock = threading.RLock()
        self.summary: Callable[[], dict[str, Any]] | None = None
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="nbbatch-live-record", daemon=True)
        self._warned = False
        self._last_write = time.monotonic()

    def start(self) -> LiveRecord:
        self._thread.start()
        return self

    def changed(self) -> None:
        """Something shown changed: the record is written within ``every`` seconds."""
        self._dirty.set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            self.push_streams()
            gpu_due = self.summary is not None and time.monotonic() - self._last_write >= self.TELEMETRY_EVERY_S
            if self._dirty.is_set() or gpu_due:
                self._dirty.clear()
                self._write()

    def push_streams(self, final: bool = False) -> None:
        """Push every stream; on the last push (``final``) a share error is raised, before it only logged."""
        for stream in self.streams:
            try:
                stream.push(final)
            except ShareError as exc:
                if final:
                    raise
                self._warn(exc)

    def _write(self) -> None:
        self._last_write = time.monotonic()
        with self.lock:
            if self.summary is not None:
                with contextlib.suppress(Exception):
                    self.record.telemetry = self.summary()
            snapshot = RunRecord.from_dict(self.record.to_dict())
        try:
            write_record(self.share, snapshot)
        except ShareError as exc:  # the next change tries again; the final write decides the run's fate
            self._warn(exc)
            return
        self.notify(snapshot)

    def _warn(self, exc: BaseException) -> None:
        if not self._warned:
            self._warned = True
            log.warning("the share did not take a live update of run %s: %s", self.record.run_id, exc)
