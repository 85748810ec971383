"""A run's folders beyond its notebook: the inputs it reads, and its outputs and checkpoints on the share.

Where the share is a folder on this machine (a local share, an NFS mount, Azure ML's mount of the
file share), ``NBBATCH_OUTPUT_DIR`` and ``NBBATCH_CHECKPOINT_DIR`` are the run's own ``outputs/``
and ``checkpoints/`` in the share: written as the run goes, they outlive a lost node. Otherwise (an
Azure File share over HTTPS) both are folders on this machine: the checkpoints are pulled before the
first attempt, pushed while the run goes (when they changed) and after every attempt; the outputs are
pushed after every attempt. A run with ``resume_from`` starts from a copy of that run's checkpoints, unless
it has checkpoints of its own already (a retry, a resubmission). Inputs are bound to the path the run sees: a
folder here, a folder of the project on this machine, or a share URL pulled into the project's cache (unchanged
files are kept).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import os
import shutil
import socket
import tempfile
import threading
from pathlib import Path
from typing import Any

from nbbatch.artifacts import CHECKPOINT_DIR_ENV, OUTPUT_DIR_ENV, sync_tree
from nbbatch.errors import NbbatchError, ShareError
from nbbatch.plan.inputs import is_share_url
from nbbatch.plan.runs import Run
from nbbatch.spec.project import Project, find_project
from nbbatch.store.layout import run_paths
from nbbatch.store.runjson import CheckpointSummary, InputBinding
from nbbatch.store.share import Share, open_share
from nbbatch.store.sync import FileEntry, pull, push, tree_listing

PUSH_EVERY_S = 30.0  # how often changed checkpoints go to a remote share while the run goes


class InputError(NbbatchError):
    """An input of a run is not where the run executes."""


class RunFolders:
    """The inputs, outputs and checkpoints of one run, for all of its attempts in this process."""

    def __init__(self, run: Run, share: Share, *, input_paths: dict[str, str] | None = None,
                 project_root: Path | None = None, cache_dir: Path | None = None, push_every_s: float = PUSH_EVERY_S):
        self.run, self.share = run, share
        self.paths = run_paths(run.experiment, run.run_id)
        self.inputs = {name: resolve_input(run, name, location, input_paths or {}, project_root, cache_dir)
                       for name, location in run.inputs.items()}
        self.outputs, self.checkpoints, self.remote = run_folders(run, share)
        if self.remote:
            shutil.rmtree(self.outputs.parent, ignore_errors=True)  # left by a process of this pid long gone
            self.outputs.parent.mkdir(mode=0o700)  # the run's files, not for other users of the machine
        for folder in (self.outputs, self.checkpoints):  # on the share: the umask's mode, like the run's other files
            folder.mkdir(parents=True, exist_ok=True)
        if self.remote and share.exists(self.paths.checkpoints):
            pull(share, self.paths.checkpoints, self.checkpoints)
        self.copied = False  # whether this process copied run.resume_from's checkpoints (the first start)
        # run.json's `continues` (None: the run continues no other)
        self.continues: dict[str, Any] | None = self._continue(run.resume_from) if run.resume_from else None
        self._push_every = push_every_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pushed: tuple[Any, ...] | None = None
        self._lock = threading.Lock()

    @property
    def env(self) -> dict[str, str]:
        """What the kernel's environment gets: ``NBBATCH_OUTPUT_DIR`` and ``NBBATCH_CHECKPOINT_DIR``."""
        return folder_env(self.run, self.share)

    @property
    def parameters(self) -> dict[str, str]:
        """Each input's parameter with its folder's path here."""
        return {name: bound.path for name, bound in self.inputs.items()}

    def checkpoint_summary(self) -> CheckpointSummary | None:
        """What an attempt resumes from (files, bytes, the newest file), or None when there is no checkpoint."""
        files = [p for p in self.checkpoints.rglob("*") if p.is_file() and not _hidden(p, self.checkpoints)]
        if not files:
            return None
        newest = max(files, key=lambda p: p.stat().st_mtime_ns)
        return CheckpointSummary(files=len(files), bytes=sum(p.stat().st_size for p in files),
                                 latest=newest.relative_to(self.checkpoints).as_posix())

    def resuming(self, checkpoint: CheckpointSummary | None) -> str:
        """What the first line of an attempt's log says of the checkpoint it resumes from, and of the run it
        continues: a notebook that left no checkpoint there is told, as it starts from scratch."""
        continued = self.continues if self.copied else None
        if checkpoint is None:
            if continued is None or continued["checkpoint"] is not None:
                return ""
            return (f"\n=== nbbatch: warning: run {continued['run_id']}, which this run continues, left no checkpoint "
                    f"in {CHECKPOINT_DIR_ENV}: this run starts from scratch (does the notebook save its checkpoints "
                    "there, and resume from them?)")
        of_run = f" of run {continued['run_id']}" if continued and continued["checkpoint"] == dataclasses.asdict(
            checkpoint) else ""
        return f", resuming from {checkpoint.latest} ({checkpoint.files} checkpoint file(s){of_run})"

    def _continue(self, source: str) -> dict[str, Any]:
        """Start from a copy of run ``source``'s checkpoints (never changed), unless this run has its own already: a
        retry, a resubmission, another node of a gang that copied them first goes on from those. run.json's
        ``continues``: the source, and the checkpoint the run starts from (None: none, it starts from scratch)."""
        own = self.checkpoint_summary()
        if own is not None:
            return {"run_id": source, "checkpoint": dataclasses.asdict(own)}
        source_path = run_paths(self.run.experiment, source).checkpoints
        try:
            if self.remote:  # copied to this machine; the run's save pushes them to its own checkpoints
                if self.share.exists(source_path):
                    pull(self.share, source_path, self.checkpoints)
            else:
                source_folder = self.share.local_path(source_path)
                if source_folder is not None and source_folder.is_dir():
                    _copy_into(source_folder, self.checkpoints)
        except (OSError, shutil.Error) as exc:
            raise ShareError(f"cannot copy the checkpoints of run {source} (which run {self.run.run_id} continues): "
                             f"{exc}") from exc
        self.copied = True
        copied = self.checkpoint_summary()
        return {"run_id": source, "checkpoint": dataclasses.asdict(copied) if copied is not None else None}

    # --- while an attempt runs ---------------------------------------------------------------------

    def start(self) -> None:
        """On a remote share: push changed checkpoints every ``push_every_s`` until :meth:`stop`."""
        if not self.remote or self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._push_loop, name=f"nbbatch-checkpoints-{self.run.run_id}",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _push_loop(self) -> None:
        while not self._stop.wait(self._push_every):
            with contextlib.suppress(NbbatchError, OSError):  # the next round, or the attempt's end, tries again
                self._push_checkpoints()

    def _push_checkpoints(self) -> None:
        with self._lock:
            seen = _snapshot(self.checkpoints)
            if seen != self._pushed:
                _push_whole(self.checkpoints, self.share, self.paths.checkpoints)
                self._pushed = seen

    # --- after an attempt ----------------------------------------------------------------------------

    def save(self) -> list[FileEntry]:
        """Bring the outputs (and checkpoints) to the share when it is remote, else flush them where they are (a
        mounted share uploads on ``fsync``: the record written next must not name files still on their way); the
        outputs' listing for run.json."""
        if self.remote:
            self._push_checkpoints()
            _push_whole(self.outputs, self.share, self.paths.outputs)
        else:
            sync_tree(self.outputs)
        return tree_listing(self.outputs)

    def close(self) -> None:
        self.stop()
        if self.remote:
            shutil.rmtree(self.outputs.parent, ignore_errors=True)


def _push_whole(folder: Path, share: Share, prefix: str) -> None:
    """Push a run's folder; a file the share cannot hold by name fails the attempt, naming it (the others are copied)."""
    pushed = push(folder, share, prefix, delete=True)
    if pushed.refused:
        raise ShareError(pushed.warnings[-1])


def run_folders(run: Run, share: Share) -> tuple[Path, Path, bool]:
    """(outputs, checkpoints, remote): the run's folders in the share, or on this machine when the share is remote.

    The same for the same run and process, so a kernel started ahead of the run gets the same environment.
    """
    paths = run_paths(run.experiment, run.run_id)
    outputs, checkpoints = share.local_path(paths.outputs), share.local_path(paths.checkpoints)
    if outputs is not None and checkpoints is not None:
        return outputs, checkpoints, False
    scratch = Path(tempfile.gettempdir(), f"nbbatch-{os.getpid()}-{run.run_id}")
    return scratch / "outputs", scratch / "checkpoints", True


def folder_env(run: Run, share: Share) -> dict[str, str]:
    """``NBBATCH_OUTPUT_DIR`` and ``NBBATCH_CHECKPOINT_DIR`` of a run's kernel."""
    outputs, checkpoints, _ = run_folders(run, share)
    return {OUTPUT_DIR_ENV: str(outputs), CHECKPOINT_DIR_ENV: str(checkpoints)}


def _copy_into(source: Path, dest: Path) -> None:
    """Copy the folder ``source`` into ``dest`` (on the same share) so that a copy half done is never taken for a
    checkpoint: into a hidden folder of ``dest`` first (hidden names are not checkpoints), then each entry renamed
    into place. An entry already there (another node of a gang copied it first) stays."""
    staging = dest / f".continue-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        shutil.copytree(source, staging, ignore=shutil.ignore_patterns(".*"))
        for entry in sorted(staging.iterdir()):
            if not (dest / entry.name).exists():
                with contextlib.suppress(OSError):  # another node moved the same entry in meanwhile
                    entry.rename(dest / entry.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)  # a checkpoint being written


def _snapshot(folder: Path) -> tuple[Any, ...]:
    return tuple(sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns)
                        for p in folder.rglob("*") if p.is_file() and not _hidden(p, folder)))


def resolve_input(run: Run, name: str, location: str, given: dict[str, str], project_root: Path | None,
                  cache_dir: Path | None) -> InputBinding:
    """Where input ``name`` is for the run here (raises :class:`InputError`)."""
    if name in given:  # the backend mounted it (Azure ML's ro_mount)
        return InputBinding(location, given[name])
    if is_share_url(location):
        return InputBinding(location, str(_pulled(name, location, cache_dir, project_root)))
    folder = Path(location)
    if folder.is_dir():
        return InputBinding(location, str(folder))
    if project_root is not None:  # the same folder of the project, cloned elsewhere (a Ray node's `project:`)
        with contextlib.suppress(ValueError):
            here = project_root / folder.relative_to(run.project_root())
            if here.is_dir():
                return InputBinding(location, str(here))
    raise InputError(f"input `{name}`: the folder {location} is not on {socket.gethostname()}, where the run "
                     "executes; put it on the share (`nbbatch data push <folder> <share URL>`) and name that URL "
                     "in `inputs:`, or make the folder visible at the same path on every node")


def _pulled(name: str, url: str, cache_dir: Path | None, project_root: Path | None) -> Path:
    """A copy of the share folder ``url`` in the cache, brought up to date (one puller at a time per machine)."""
    share = open_share(url)
    local = share.local_path("")
    if local is not None:
        return local
    cache = cache_dir or (Project(project_root) if project_root else find_project()).cache_dir
    folder = cache / "inputs" / hashlib.sha256(url.encode()).hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # runs starting together on one machine pull once, not over each other
        try:
            pull(share, "", folder, delete=True)
        except NbbatchError as exc:
            raise InputError(f"input `{name}`: cannot bring {url} to this machine: {exc}") from exc
    return folder
