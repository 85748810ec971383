"""Copy an experiment's results from any share to a local folder (``nbbatch fetch``)."""

from __future__ import annotations

from pathlib import Path

from nbbatch.errors import NbbatchError
from nbbatch.store.layout import LOG_FILE, OUTPUT_NOTEBOOK, OUTPUTS_FOLDER, RANKS_FOLDER, RUN_RECORD, run_paths
from nbbatch.store.share import FILE_MODE, Share, write_file_atomic
from nbbatch.store.sync import pull


def fetch(share: Share, experiment: str, dest: Path, names: tuple[str, ...] | None = None) -> list[Path]:
    """Download every run's files (or only ``names``) to ``dest/<experiment>/<run>/``; return the paths written.

    A run's ``outputs/`` folder comes whole (files already there unchanged are kept); its ``checkpoints/`` stay
    on the share: they are for resuming the run, not results. A distributed run's ``ranks/<rank>/`` bring
    each rank's notebook, log and record.
    """
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
            if name == OUTPUTS_FOLDER:
                written.extend(_fetch_outputs(share, run_paths(experiment, run_id).outputs, dest / experiment / run_id))
            elif name == RANKS_FOLDER:
                ranks = run_paths(experiment, run_id).ranks
                for rank in (r for r in share.list(ranks) if r.isdigit()):
                    for file in (OUTPUT_NOTEBOOK, LOG_FILE, RUN_RECORD):
                        written.extend(_fetch_file(share, f"{ranks}/{rank}/{file}",
                                                   dest / experiment / run_id / RANKS_FOLDER / rank / file))
            else:
                written.extend(_fetch_file(share, f"{experiment}/{run_id}/{name}", dest / experiment / run_id / name))
    return written


def _fetch_file(share: Share, path: str, target: Path) -> list[Path]:
    try:
        data = share.read_bytes(path)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return []
    target.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomic(target, data, FILE_MODE)
    return [target]


def _fetch_outputs(share: Share, folder: str, run_dest: Path) -> list[Path]:
    target = run_dest / OUTPUTS_FOLDER
    result = pull(share, folder, target)
    return [target / name for name in result.copied]


def _plain_name(name: str) -> bool:
    """One path component: no separator, not `.`/`..`, not absolute (on any system)."""
    return bool(name) and name not in (".", "..") and not any(sep in name for sep in ("/", "\\", ":"))
