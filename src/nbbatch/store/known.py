"""The experiments this project has submitted: name → share and backend (``.nbbatch/experiments.json``), and the
experiments the user submitted from any project (a per-user index: :func:`user_experiments`).

``status``, ``logs``, ``cancel``, ``compare``, ``diff`` and the widgets find an experiment's share here by its
name alone (:func:`open_experiment_share`, the one answer to "where are experiment X's results").
Only settings safe to keep on disk are stored (:meth:`nbbatch.backends.base.Backend.storable_settings`).
The file is rewritten under a short lock (``experiments.json.lock``), through a temporary file of its
own, so two submissions at once neither lose an entry nor mix their files; it is readable by its owner only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nbbatch.errors import NbbatchError, did_you_mean
from nbbatch.spec.experiment import load_experiment
from nbbatch.spec.pipeline import is_pipeline_file, load_pipeline
from nbbatch.spec.project import Project, find_project
from nbbatch.store.runjson import utc_now
from nbbatch.store.share import Share, open_share, write_file_atomic

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

REGISTRY_FILE = "experiments.json"
LOCK_WAIT_S = 30.0  # the lock is held for one read and one write: waiting longer means something is stuck
USER_INDEX_LIMIT = 200  # the user's latest experiments kept in the per-user index: it stays a few kB

_log = logging.getLogger(__name__)


def remember(project: Project, name: str, share_url: str, backend: str, settings: dict[str, Any]) -> None:
    """Record where experiment ``name`` ran (under the registry's lock, written atomically), in the project and in the
    user's index (:func:`user_experiments`)."""
    path = project.state_dir / REGISTRY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        known = _read(path)  # never rewritten when it cannot be read: it holds the other experiments' shares
        known[name] = {"share": share_url, "backend": backend, "backend_settings": settings, "updated": utc_now()}
        write_file_atomic(path, json.dumps(known, indent=2, default=str).encode())  # 0600: the owner's only
    _index_for_user(project, name, share_url)


def user_index_path() -> Path:
    """The per-user index of the experiments the user submitted, from any project: ``$XDG_STATE_HOME/nbbatch/
    experiments.json`` (default ``~/.local/state``). What ``nbbatch status`` lists from outside a project."""
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "nbbatch" / REGISTRY_FILE


def user_experiments() -> list[dict[str, str]]:
    """The user's experiments, latest submitted first: each ``name``, ``project`` (its folder), ``share`` (its URL)
    and ``updated``. Empty when there is no index, or it is damaged (the next submission sets it aside)."""
    try:
        return _user_entries(user_index_path())
    except (OSError, ValueError):
        return []


def _user_entries(path: Path) -> list[dict[str, str]]:
    """The index's well-formed entries (an entry damaged by hand is left out); ValueError when the file is damaged."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []
    entries = data.get("experiments") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError("not a JSON object with a list of experiments")
    keys = ("name", "project", "share", "updated")
    return [{k: e[k] for k in keys} for e in entries
            if isinstance(e, dict) and all(isinstance(e.get(k), str) for k in keys)]


def _index_for_user(project: Project, name: str, share_url: str) -> None:
    """Put experiment ``name`` first in the user's index (under its lock, written atomically, at most
    :data:`USER_INDEX_LIMIT` entries). It is a convenience: a failure is logged, never raised; a damaged index is
    kept beside as ``experiments.json.damaged`` and started anew."""
    path = user_index_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path):
            try:
                entries = _user_entries(path)
            except (OSError, ValueError) as exc:
                _log.warning("the index of your experiments %s cannot be read (%s): kept as %s.damaged, started anew",
                             path, exc, path.name)
                path.replace(path.with_name(path.name + ".damaged"))
                entries = []
            root = str(project.root)
            entries = [{"name": name, "project": root, "share": share_url, "updated": utc_now()},
                       *(e for e in entries if (e["name"], e["project"]) != (name, root))]
            write_file_atomic(path, json.dumps({"experiments": entries[:USER_INDEX_LIMIT]}, indent=1).encode())
    except (OSError, NbbatchError) as exc:  # a read-only home, a lock held: the submission goes on without it
        _log.warning("could not add `%s` to the index of your experiments %s: %s", name, path, exc)


def lookup(project: Project, name: str) -> dict[str, Any]:
    """What :func:`remember` stored for experiment ``name`` (empty when unknown)."""
    entry = _read(project.state_dir / REGISTRY_FILE).get(name, {})
    if not isinstance(entry, dict):
        raise _damaged(project.state_dir / REGISTRY_FILE, f"the entry of `{name}` is not a mapping")
    return entry


def project_experiments(project: Project) -> dict[str, str]:
    """Each experiment the project submitted → its share's URL (empty when the registry is missing or damaged)."""
    try:
        known = _read(project.state_dir / REGISTRY_FILE)
    except NbbatchError:
        return {}
    return {name: entry["share"] for name, entry in known.items()
            if isinstance(entry, dict) and isinstance(entry.get("share"), str)}


def _read(path: Path) -> dict[str, Any]:
    """The registry's entries (empty when there is no file); NbbatchError when it is damaged."""
    try:
        known = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise _damaged(path, str(exc)) from None
    if not isinstance(known, dict):
        raise _damaged(path, f"it is not a JSON object of experiments but a {type(known).__name__}")
    return known


def _damaged(path: Path, why: str) -> NbbatchError:
    return NbbatchError(f"{path} cannot be read ({why}); it records which share each experiment of this project "
                        "went to, and is left as it is. Repair it (a JSON object: each experiment's name → its share "
                        "and backend), or delete it: commands then find an experiment in the project's results/, or "
                        "where --share says, and the next submit records it again")


def open_experiment_share(experiment: str, share: str | os.PathLike[str] | Share | None = None,
                          project: Project | None = None) -> tuple[str, Share]:
    """The experiment's name and its share, from an experiment file or a name.

    ``share`` given: that share. Else an experiment file's own ``share``, or for a name the share it was last
    submitted to from ``project`` (default: the project around the working directory), else the project's ``results/``.
    """
    if isinstance(share, Share):
        return experiment, share
    if experiment.endswith((".yaml", ".yml")) and Path(experiment).exists():
        spec = load_pipeline(experiment) if is_pipeline_file(experiment) else load_experiment(experiment)
        return spec.name, open_share(share or spec.share)
    if share:
        return experiment, open_share(share)
    project = project or find_project()
    return experiment, open_share(lookup(project, experiment).get("share") or project.results_dir)


def check_experiment(share: Share, name: str) -> None:
    """Raise :class:`NbbatchError` unless ``share`` has a folder for experiment ``name`` (suggesting close names)."""
    where = f"{share.url.rstrip('/')}/{name}"
    if not share.exists(name):
        experiments = share.list("")
        raise NbbatchError(f"no experiment `{name}` in the share {share.url}{did_you_mean(name, experiments)}"
                           + (f"; experiments there: {', '.join(experiments[:20])}" if experiments else "")
                           + ". Check the name, or pass --share where its results are")
    if not share.list(name) and _is_file(share, name):
        raise NbbatchError(f"{where} is a file, not the folder of experiment `{name}`'s results; check the name "
                           "and the share (--share)")


def _is_file(share: Share, path: str) -> bool:
    local = share.local_path(path)
    if local is not None:
        return local.is_file()
    try:
        share.read_bytes(path)
    except (OSError, NbbatchError):  # a folder (IsADirectoryError), or gone
        return False
    return True


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold ``<path>.lock`` (``flock``, released by the kernel if this process dies) for a read-modify-write."""
    lock_path = path.with_name(path.name + ".lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if fcntl is not None:
            deadline = time.monotonic() + LOCK_WAIT_S
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise NbbatchError(f"{lock_path} has been locked by another nbbatch process for "
                                           f"{LOCK_WAIT_S:.0f} s; if none is running, delete that file") from None
                    time.sleep(0.05)
        yield
    finally:
        os.close(fd)

