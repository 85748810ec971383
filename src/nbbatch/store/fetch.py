"""Copy an experiment's results from any share to a local folder (``nbbatch fetch``)."""

from __future__ import annotations

from pathlib import Path

from nbbatch.errors import NbbatchError
from nbbatch.store.share import FILE_MODE, Share, write_file_atomic


def fetch(share: Share, experiment: str, dest: Path, names: tuple[str, ...] | None = None) -> list[Path]:
    """Download every run's files (or only ``names``) to ``dest/<experiment>/<run>/``; return the paths written."""
    if not _plain_name(experiment):
        raise NbbatchError(f"`{experiment}` is not an experiment name (a path was given?); pass the name, e.g. "
                           f"`nbbatch fetch digits ./out`, or the experiment's YAML file")
    written = []
    for run_id in share.list(experiment):
        if not _plain_name(run_id):
            continue  # never a run of ours; and it must not steer the copy outside `dest`
        for name in share.list(f"{experiment}/{run_id}"):
            if (names and name not in names) or not _plain_name(name):
                continue
            try:
                data = share.read_bytes(f"{experiment}/{run_id}/{name}")
            except (FileNotFoundError, IsADirectoryError):
                continue
            target = dest / experiment / run_id / name
            target.parent.mkdir(parents=True, exist_ok=True)
            write_file_atomic(target, data, FILE_MODE)
            written.append(target)
    return written


def _plain_name(name: str) -> bool:
    """One path component: no separator, not `.`/`..`, not absolute (on any system)."""
    return bool(name) and name not in (".", "..") and not any(sep in name for sep in ("/", "\\", ":"))
