"""Copy an experiment's results from any share to a local folder (``nbbatch fetch``)."""

from __future__ import annotations

import warnings
from pathlib import Path

from nbbatch.errors import NbbatchError, ShareError
from nbbatch.store.known import check_experiment
from nbbatch.store.layout import LOG_FILE, OUTPUT_NOTEBOOK, OUTPUTS_FOLDER, RANKS_FOLDER, RUN_RECORD, run_paths
from nbbatch.store.share import FILE_MODE, Share, file_in_the_way, write_file_atomic
from nbbatch.store.sync import pull


class FetchWarning(UserWarning):
    """A file of the share that :func:`fetch` could not copy (unreadable, a link out of the share); the rest came."""


def fetch(share: Share, experiment: str, dest: Path, names: tuple[str, ...] | None = None) -> list[Path]:
    """Download every run's files (or only ``names``) to ``dest/<experiment>/<run>/``; return the paths written.

    A run's ``outputs/`` folder comes whole (files already there unchanged are kept); its ``checkpoints/`` stay
    on the share: they are for resuming the run, not results. A distributed run's ``ranks/<rank>/`` bring
    each rank's notebook, log and record. A file or folder of the share that cannot be read (another user's,
    not readable by others) is left out with a :class:`FetchWarning` naming it; the rest is fetched. Raises
    :class:`NbbatchError` for an experiment the share does not have, or a ``dest`` that cannot be a folder.
    """
    if not _plain_name(experiment):
        raise NbbatchError(f"`{experiment}` is not an experiment name (a path was given?); pass the name, e.g. "
                           f"`nbbatch fetch digits ./out`, or the experiment's YAML file")
    check_experiment(share, experiment)
    _make_folder(Path(dest), Path(dest) / experiment)
    written = []
    for run_id in share.list(experiment):
        if not _plain_name(run_id):
            continue  # never a run of ours; and it must not steer the copy outside `dest`
        for name in _listing(share, f"{experiment}/{run_id}"):
            if (names and name not in names) or not _plain_name(name):
                continue
            if name == OUTPUTS_FOLDER:
                written.extend(_fetch_outputs(share, run_paths(experiment, run_id).outputs, dest / experiment / run_id))
            elif name == RANKS_FOLDER:
                ranks = run_paths(experiment, run_id).ranks
                for rank in (r for r in _listing(share, ranks) if r.isdigit()):
                    for file in (OUTPUT_NOTEBOOK, LOG_FILE, RUN_RECORD):
                        written.extend(_fetch_file(share, f"{ranks}/{rank}/{file}",
                                                   dest / experiment / run_id / RANKS_FOLDER / rank / file))
            else:
                written.extend(_fetch_file(share, f"{experiment}/{run_id}/{name}", dest / experiment / run_id / name))
    return written


def _make_folder(dest: Path, folder: Path) -> None:
    blocking = file_in_the_way(folder)
    if blocking is not None:
        raise NbbatchError(f"cannot fetch into {dest}: {blocking} is a file; name a folder (created when absent)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise NbbatchError(f"cannot fetch into {dest}: cannot create {exc.filename or folder} "
                           f"({exc.strerror or exc}); name a folder you may write") from exc


def _listing(share: Share, path: str) -> list[str]:
    try:
        return share.list(path)
    except PermissionError:
        warnings.warn(f"{_where(share, path)} is not readable (permission denied): its files are not fetched; ask "
                      "its owner to make it readable (chmod -R a+rX)", FetchWarning, stacklevel=3)
        return []


def _fetch_file(share: Share, path: str, target: Path) -> list[Path]:
    try:
        data = share.read_bytes(path)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return []
    except (PermissionError, ShareError) as exc:  # ShareError: a link out of the share
        reason = "permission denied" if isinstance(exc, PermissionError) else str(exc)
        warnings.warn(f"{_where(share, path)} is not fetched: {reason}", FetchWarning, stacklevel=3)
        return []
    _make_folder(target.parent, target.parent)
    try:
        write_file_atomic(target, data, FILE_MODE)
    except OSError as exc:
        raise NbbatchError(f"cannot write {target}: {exc.strerror or exc}") from exc
    return [target]


def _fetch_outputs(share: Share, folder: str, run_dest: Path) -> list[Path]:
    target = run_dest / OUTPUTS_FOLDER
    result = pull(share, folder, target, skip_unreadable=True)
    for warning in result.warnings:
        warnings.warn(warning, FetchWarning, stacklevel=3)
    return [target / name for name in result.copied]


def _where(share: Share, path: str) -> str:
    return f"{share.url.rstrip('/')}/{path}"


def _plain_name(name: str) -> bool:
    """One path component: no separator, not `.`/`..`, not absolute (on any system)."""
    return bool(name) and name not in (".", "..") and not any(sep in name for sep in ("/", "\\", ":"))
