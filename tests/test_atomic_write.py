"""The one atomic write of a local file (nbbatch.artifacts.write_file_atomic, re-exported by nbbatch.store.share)."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from nbbatch import artifacts
from nbbatch.store import share as share_module
from nbbatch.store.share import FILE_MODE, write_file_atomic


def test_the_store_uses_the_lowest_layers_write():
    assert share_module.write_file_atomic is artifacts.write_file_atomic


def test_replaces_the_file_whole_with_the_mode_asked(tmp_path):
    target = tmp_path / "new" / "run.json"  # its folder is made
    write_file_atomic(target, b"v1")
    assert target.read_bytes() == b"v1" and stat.S_IMODE(target.stat().st_mode) == 0o600  # the owner's only by default
    write_file_atomic(target, b"v2", FILE_MODE)
    assert target.read_bytes() == b"v2" and stat.S_IMODE(target.stat().st_mode) == FILE_MODE
    write_file_atomic(target, b"#!/bin/sh\n", 0o755)  # exactly the mode asked, whatever the umask
    assert stat.S_IMODE(target.stat().st_mode) == 0o755
    assert sorted(p.name for p in target.parent.iterdir()) == ["run.json"]  # no temporary left


def test_syncs_the_data_before_the_rename(tmp_path, monkeypatch):
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append("replace"), real_replace(a, b))[1])
    write_file_atomic(tmp_path / "log.txt", b"data")
    assert events == ["fsync", "replace", "fsync"]  # the file, the rename, then its folder


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "output.ipynb"
    target.write_bytes(b"old")

    def no_space(a, b):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_space)
    with pytest.raises(OSError, match="No space"):
        write_file_atomic(target, b"new")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["output.ipynb"]


def test_writers_of_one_file_at_once_never_share_a_temporary(tmp_path):
    target = tmp_path / "telemetry.jsonl"
    payloads = [bytes([i]) * 100_000 for i in range(8)]
    errors: list[BaseException] = []

    def write(data: bytes) -> None:
        try:
            for _ in range(20):
                write_file_atomic(target, data)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(p,)) for p in payloads]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert target.read_bytes() in payloads  # one writer's bytes whole, never a mix
    assert [p.name for p in tmp_path.iterdir()] == [target.name]


def test_the_temporary_is_hidden_beside_the_target(tmp_path, monkeypatch):
    seen: list[Path] = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (seen.append(Path(a)), real_replace(a, b))[1])
    write_file_atomic(tmp_path / "run.json", b"{}")
    (tmp,) = seen
    assert tmp.parent == tmp_path and tmp.name.startswith(".run.json.") and tmp.name.endswith(".part")
