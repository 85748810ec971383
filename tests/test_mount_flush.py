"""What a run writes to a share mounted through FUSE (Azure ML's data runtime) reaches storage while it goes and before
its record says it ended: such a mount may upload a held-open file's writes only on ``fsync`` or close."""

from __future__ import annotations

import io
import os

import pytest

from nbbatch.execute import live
from nbbatch.execute.folders import RunFolders
from nbbatch.execute.live import LogSink, StreamedFile
from nbbatch.plan.runs import Run
from nbbatch.store.share import FileShare


@pytest.fixture
def synced(monkeypatch):
    """The paths ``os.fsync`` was called on (by the file descriptor's link in /proc)."""
    seen: list[str] = []
    real = os.fsync

    def fsync(fd):
        seen.append(os.path.realpath(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return seen


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_the_outputs_on_a_mounted_share_are_flushed_before_the_listing_for_the_record(tmp_path, synced):
    share = FileShare(tmp_path / "share")
    run = Run("r1", "e", str(tmp_path / "nb.ipynb"), "nb.ipynb", "python3")
    folders = RunFolders(run, share)
    (folders.outputs / "deep").mkdir(parents=True)
    (folders.outputs / "model.bin").write_bytes(b"x" * 1000)
    (folders.outputs / "deep" / "last.bin").write_bytes(b"y")
    synced.clear()
    listing = folders.save()
    assert {e.name for e in listing} == {"model.bin", "deep/last.bin"}
    assert {str((folders.outputs / "model.bin").resolve()), str((folders.outputs / "deep" / "last.bin").resolve()),
            str(folders.outputs.resolve())} <= set(synced)


def test_the_shares_own_log_is_flushed_when_it_grew_at_most_every_few_seconds(tmp_path, synced, monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(live.time, "monotonic", clock)
    local = tmp_path / "share" / "e" / "r1" / "log.txt"
    local.parent.mkdir(parents=True)
    stream = StreamedFile(FileShare(tmp_path / "share"), "e/r1/log.txt", local, remote=False, fresh=True)
    stream.push()
    assert synced == [], "nothing written yet: nothing to flush"
    stream.append(b"epoch 1\n")
    clock.now += StreamedFile.FLUSH_EVERY_S
    stream.push()
    assert synced == [str(local.resolve())]
    stream.append(b"epoch 2\n")
    stream.push()
    assert len(synced) == 1, "not again within FLUSH_EVERY_S"
    stream.push(final=True)
    assert len(synced) == 2, "the last lines are flushed at the end whatever the time"
    stream.push(final=True)
    assert len(synced) == 2, "unchanged: not flushed again"


def test_the_log_sink_flushes_its_own_handle_and_echoes_to_the_jobs_stream(tmp_path, synced, monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(live.time, "monotonic", clock)
    echo = io.StringIO()
    sink = LogSink(tmp_path / "log.txt", echo=echo)
    sink.write("cell 1\n")
    assert synced == [] and echo.getvalue() == "cell 1\n"
    clock.now += LogSink.FLUSH_EVERY_S
    sink.write("cell 2\n")
    assert synced == [str((tmp_path / "log.txt").resolve())]
    sink.close()
    assert (tmp_path / "log.txt").read_text() == echo.getvalue() == "cell 1\ncell 2\n"
    quiet = LogSink(tmp_path / "quiet.txt")
    quiet.write("only in the file\n")
    quiet.close()
