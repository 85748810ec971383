"""The experiments this project has submitted: name → share and backend (``.nbbatch/experiments.json``).

``status``, ``logs``, ``cancel``, ``compare``, ``diff`` and the widgets find an experiment's share here by its
name alone (:func:`open_experiment_share`, the one answer to "where are experiment X's results").
Only settings safe to keep on disk are stored (:meth:`nbbatch.backends.base.Backend.storable_settings`).
The file is rewritten under a short lock (``experiments.json.lock``), through a temporary file of its
own, so two submissions at once neither lose an entry nor mix their files; it is readable by its owner only.
"""

from __future__ import annotations

import contextlib
import json
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


def remember(project: Project, name: str, share_url: str, backend: str, settings: dict[str, Any]) -> None:
    """Record where experiment ``name`` ran (under the registry's lock, written atomically)."""
    path = project.state_dir / REGISTRY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        known = _read(path)  # never rewritten when it cannot be read: it holds the other experiments' shares
        known[name] = {"share": share_url, "backend": backend, "backend_settings": settings, "updated": utc_now()}
        write_file_atomic(path, json.dumps(known, indent=2, default=str).encode())  # 0600: the owner's only


def lookup(project: Project, name: str) -> dict[str, Any]:
    """What :func:`remember` stored for experiment ``name`` (empty when unknown)."""
    entry = _read(project.state_dir / REGISTRY_FILE).get(name, {})
    if not isinstance(entry, dict):
        raise _damaged(project.state_dir / REGISTRY_FILE, f"the entry of `{name}` is not a mapping")
    return entry


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

