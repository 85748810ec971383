"""Copy an experiment's results from any share to a local folder (``nbbatch fetch``)."""

from __future__ import annotations

import os
from pathlib import Path

from nbbatch.store.share import Share


def fetch(share: Share, experiment: str, dest: Path, names: tuple[str, ...] | None = None) -> list[Path]:
    """Download every run's files (or only ``names``) to ``dest/<experiment>/<run>/``; return the paths written."""
    written = []
    for run_id in share.list(experiment):
        for name in share.list(f"{experiment}/{run_id}"):
            if names and name not in names:
                continue
            try:
                data = share.read_bytes(f"{experiment}/{run_id}/{name}")
            except (FileNotFoundError, IsADirectoryError):
                continue
            target = dest / experiment / run_id / name
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{name}.part")
            tmp.write_bytes(data)
            os.replace(tmp, target)
            written.append(target)
    return written
