"""One run inside its framework's image: ``nbbatch run-one`` in a container, for ``container: true`` of the
local backend (and of the slurm backend, on its nodes: :mod:`nbbatch.containers.node`).

The container sees the share read-write and the project, the notebook and any path a parameter names
read-only, all at their paths on this machine, so run.json, log.txt and the executed notebook are the
same as from a venv. It shares the host's network, PID and IPC namespaces: the image is for the
environment, not for isolation, so the run records this host and its real process ids (lost-run
detection and per-process GPU memory work as for a venv), a tracking server on localhost is reachable
and PyTorch's data loaders get the host's shared memory. Files it writes belong to the invoking user.
Cancel, the driver's Ctrl-C and a run that outlives its timeout kill the container; ``--rm`` removes it.

A distributed run has one container per node: the node's launcher (``run-one`` in the image, told its
:class:`~nbbatch.execute.placement.NodePlacement` in its launch file) starts that node's ranks inside it, as on a
venv (:mod:`nbbatch.execute.ranks`). Host network and IPC let the ranks of every container meet (gloo, NCCL's
shared memory); a failed rank stops the other containers' ranks through the share's markers. A container that
ends before its ranks did ends them with it and tells the other nodes to stop.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import nbbatch
from nbbatch.containers.engines import Engine
from nbbatch.errors import ShareError
from nbbatch.execute.context import AttemptContext, UpdateCallback
from nbbatch.execute.launch import LaunchSpec, launch_command, nbbatch_launcher
from nbbatch.execute.placement import NodePlacement, ranks_of
from nbbatch.metrics import tracking_wanted, without_tracking
from nbbatch.plan.runs import Run
from nbbatch.redact import is_secret, tracking_credentials
from nbbatch.store.runfiles import (
    finalize_record,
    new_record,
    read_record,
    read_record_or_none,
    stop_gang,
    write_record,
)
from nbbatch.store.runjson import ContainerInfo, ErrorKind, RunError, RunRecord, Status, utc_now
from nbbatch.store.share import Share

HOST_NBBATCH = "/opt/nbbatch/host"  # where the driver's own nbbatch is mounted: the run uses the same code
OUTPUT_TAIL = 3000  # characters of the container's output kept for an error
_CONTAINER_ENDED = {"error": "a node's container ended"}  # the gang's stop marker when a container ends early
STOP_GRACE_S = 10.0  # a stopped container's run-one saves its notebook within this (Slurm's KillWait: 30 s)
TIMEOUT_GRACE_S = 60.0  # past the run's own timeout (which run-one enforces) the container is killed
# Variables passed from the driver (by name: values never appear on a command line): what tunes the
# frameworks, tracks runs, or configures nbbatch. Paths of this machine's Python and Jupyter are not passed.
PASSED_PREFIXES = ("MLFLOW_", "NBBATCH_", "TF_", "XLA_", "KERAS_", "JAX_", "PYTORCH_", "TORCH_", "NCCL_", "OMP_",
                   "MKL_", "OPENBLAS_", "HF_", "LC_", "TZ", "LANG")
HOST_ONLY = {"NBBATCH_PROJECT", "NBBATCH_ENVS_DIR", "NBBATCH_JUPYTER_DIR", "NBBATCH_FRAMEWORKS_DIR"}
# The image's own folders: a parameter naming one of them (or "/", "/tmp") is not mounted over it.
SYSTEM_TOPS = {"bin", "boot", "dev", "etc", "lib", "lib32", "lib64", "libx32", "opt", "proc", "run", "sbin", "sys", "usr"}
SYSTEM_ITSELF = {Path("/"), Path("/tmp"), Path("/home"), Path("/var"), Path("/root"), Path("/mnt"), Path("/media"),
                 Path("/srv")}

_running: dict[str, Engine] = {}  # containers this process started and has not seen end
_running_lock = threading.Lock()


def passed_variables(environ: dict[str, str] | None = None, tracking: str | None = None) -> list[str]:
    """The names of the driver's variables a run's container gets (secrets only where MLflow needs them).

    ``tracking``: the run's ``tracking:``; without tracking, no MLflow URI, run or credentials, as a venv run's kernel.
    """
    environ = dict(os.environ if environ is None else environ)
    names = {n for n, v in environ.items() if n.startswith(PASSED_PREFIXES) and n not in HOST_ONLY and not is_secret(n, v)}
    if not tracking_wanted(tracking, environ):
        return sorted(without_tracking(dict.fromkeys(names, "")))
    names |= set(tracking_credentials(environ))  # only with MLFLOW_TRACKING_URI, as a venv run's kernel gets them
    return sorted(names)


def read_only_paths(run: Run, project_root: Path) -> list[Path]:
    """What a run reads besides the share: the project, its notebook and working folder, its inputs, paths its
    parameters name."""
    wanted = [project_root, Path(run.notebook).parent]
    if run.cwd:
        wanted.append(Path(run.cwd))
    for value in [*run.parameters.values(), *run.inputs.values()]:
        if isinstance(value, str) and os.path.isabs(value) and os.path.exists(value):
            wanted.append(Path(value))
    return _outermost(p for p in (w.resolve() for w in wanted if w.exists()) if not _system_folder(p))


def _system_folder(path: Path) -> bool:
    """Whether mounting ``path`` would hide the image's own files (``/``, ``/usr/…``, ``/tmp`` itself…)."""
    return path in SYSTEM_ITSELF or len(path.parts) > 1 and path.parts[1] in SYSTEM_TOPS


def _outermost(paths: Iterable[Path]) -> list[Path]:
    kept: list[Path] = []
    for path in sorted(set(paths), key=lambda p: len(p.parts)):
        if not any(path == k or k in path.parents for k in kept):
            kept.append(path)
    return kept


def container_command(engine: Engine, image: str, name: str, run: Run, share_root: Path, project_root: Path,
                      launch_file: Path, gpu_ids: list[int], labels: dict[str, str]) -> list[str]:
    """The ``run`` command of a run's container (``launch_file``: its launch, in a private folder mounted read-only)."""
    share_root = share_root.resolve()
    mounts = ["--volume", f"{share_root}:{share_root}:rw",
              "--volume", f"{launch_file.parent}:{launch_file.parent}:ro",
              "--volume", f"{Path(nbbatch.__file__).resolve().parent}:{HOST_NBBATCH}/nbbatch:ro"]
    for path in read_only_paths(run, project_root):
        if path != share_root and share_root not in path.parents:
            mounts += ["--volume", f"{path}:{path}:ro"]
    variables = ["--env", "HOME=/tmp", "--env", f"PYTHONPATH={HOST_NBBATCH}"]
    variables += [arg for n in passed_variables(tracking=run.tracking) for arg in ("--env", n)]
    return engine.command(
        "run", "--rm", "--name", name, "--network", "host", "--pid", "host", "--ipc", "host",
        *[arg for k, v in labels.items() for arg in ("--label", f"{k}={v}")],
        *engine.user_args(), "--workdir", str(project_root), *mounts, *variables, *engine.gpu_args(gpu_ids),
        image, *launch_command(nbbatch_launcher("python"), launch_file))


def container_launch(run: Run, share_root: Path, project_root: Path, context: AttemptContext,
                     container: ContainerInfo, node: NodePlacement | None) -> LaunchSpec:
    """What run-one inside the container executes: the run where the host put it; its GPUs as the container sees
    them (only its own, numbered from 0), the host's indices, sharing and image as run.json records them."""
    return LaunchSpec(run=run, share=str(share_root.resolve()), backend=context.backend, project=str(project_root),
                      gpus=tuple(range(len(context.gpu_ids))), shared_gpu=context.shared_gpu,
                      host_gpu_ids=tuple(context.gpu_ids), gpu_share=context.gpu_share, container=container,
                      node=node, fresh_ports=node is not None and context.new_endpoints is not None)


def execute_in_container(engine: Engine, run: Run, share: Share, context: AttemptContext) -> RunRecord:
    """Execute ``run`` with ``nbbatch run-one`` in a container; return its final record.

    ``context.container`` names the image (``engine``, ``image``, ``image_id``: run.json's, with the container's
    name added); its GPUs, GPU sharing, project root, cancel event and callback apply as to a kernel of this
    machine (a kernel pool and an MPS daemon's variables do not reach into the container).
    """
    share_root = share.local_path("")
    if share_root is None:
        raise RuntimeError("container runs need a share that is a folder on this machine")  # Backend.check refuses it
    project_root = context.project_root or run.project_root()
    node = context.placement if run.distribution else None  # a gang's node: its launcher runs in the container
    name = (f"nbbatch-{re.sub(r'[^a-zA-Z0-9_.-]', '-', run.run_id)[:60]}{f'-node{node.node_rank}' if node else ''}"
            f"-{uuid.uuid4().hex[:6]}")
    labels = {"nbbatch.experiment": run.experiment, "nbbatch.run": run.run_id,
              **({"nbbatch.node": str(node.node_rank)} if node else {})}
    private = Path(tempfile.mkdtemp(prefix="nbbatch-container-"))  # 0700: the run's parameters are nobody else's
    tail: collections.deque[str] = collections.deque(maxlen=200)
    try:
        if context.container is None:
            raise RuntimeError("execute_in_container needs context.container: the image to run in")
        container = replace(context.container, name=name)
        launch_file = private / "launch.json"
        launch_file.write_text(container_launch(run, Path(share_root), project_root, context, container, node).to_json())
        cmd = container_command(engine, container.image, name, run, Path(share_root), project_root, launch_file,
                                context.gpu_ids, labels)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                text=True, errors="replace")
        with _running_lock:
            _running[name] = engine
        reader = threading.Thread(target=lambda: tail.extend(proc.stdout or ()), daemon=True)
        reader.start()
        try:
            stopped = _watch(proc, engine, name, run, share, context.cancel_event or threading.Event(), context.notify)
        except BaseException:  # SIGTERM of a batch scheduler (raised by run-one's handler), Ctrl-C: not left behind
            stop_container(engine, name)
            raise
        reader.join(timeout=5)
    finally:
        with _running_lock:
            _running.pop(name, None)
        shutil.rmtree(private, ignore_errors=True)
    ended = _why_ended(engine, container.image, run, proc.returncode, stopped, "".join(tail))
    return end_unfinished(share, run, node, *ended, backend=context.backend)


def _why_ended(engine: Engine, image: str, run: Run, returncode: int | None, stopped: str,
               tail: str) -> tuple[Status, RunError]:
    """How a container that ended before its run did ends the run: cancelled, timed out, or failed."""
    output = tail.strip()[-OUTPUT_TAIL:]
    if stopped == "cancelled":
        return Status.CANCELLED, RunError("cancelled", "", reason="cancelled: its container was stopped",
                                          kind=ErrorKind.CANCELLED)
    if stopped:
        return Status.TIMED_OUT, RunError(
            "RunTimeout", output, reason=f"its container outlived the run's timeout ({run.timeout_s:g} s) by "
                                         f"{TIMEOUT_GRACE_S:g} s and was stopped", kind=ErrorKind.TIMEOUT)
    return Status.FAILED, RunError(
        "ContainerFailed", output, reason=f"its container ({engine.name}, {image}) exited with {returncode} "
                                          f"before the run ended{_hint(output)}", kind=ErrorKind.INFRA)


def end_unfinished(share: Share, run: Run, node: NodePlacement | None, status: Status, error: RunError,
                   backend: str = "local") -> RunRecord:
    """The record of ``run`` (of ``node``'s ranks: a gang's node) once its container is gone or never started:
    run-one's own when final, else ended with ``status`` and ``error``.

    A gang's node ends only its own ranks (node 0: the run's record) and tells the other nodes to stop, so they
    do not wait for ranks that are gone."""
    if node is None or _coordinator(node):
        record = read_record_or_none(share, run.experiment, run.run_id)
        if record is not None and record.final:
            return record
        if node is not None:
            stop_gang(share, run, max(1, record.attempts if record else 0), _CONTAINER_ENDED, decide=True)
        return finalize_record(share, run, status, error, backend=backend)
    records, unfinished = [], 0
    for rank in ranks_of(run, node):
        record = _rank_record(share, run, rank.rank) or replace(new_record(run, backend), rank=rank.rank,
                                                                world_size=run.world_size)
        if not record.final:  # its attempt was cut off with the container: node 0 needs its end to finish the run
            record.attempts = unfinished = max(record.attempts, 1)
            record.status, record.error, record.ended_at = status, replace(error, rank=rank.rank), utc_now()
            write_record(share, record)
        records.append(record)
    if unfinished:
        stop_gang(share, run, unfinished, _CONTAINER_ENDED, decide=False)
    return records[0]


def _rank_record(share: Share, run: Run, rank: int) -> RunRecord | None:
    try:
        return read_record(share, run.experiment, run.run_id, rank=rank)
    except (ShareError, OSError):
        return None


def _coordinator(node: NodePlacement) -> bool:
    """Whether ``node``'s launcher holds rank 0, whose record is the run's."""
    return node.node_rank == 0 and (node.local_ranks is None or 0 in node.local_ranks)


def _watch(proc: subprocess.Popen[str], engine: Engine, name: str, run: Run, share: Share,
           cancel_event: threading.Event, notify: UpdateCallback) -> str:
    """Wait for the container, passing record changes to ``notify``; kill it on cancel or past the run's timeout.

    Returns why it was stopped (``cancelled``, ``timed_out``) or an empty string."""
    deadline = time.monotonic() + run.timeout_s + TIMEOUT_GRACE_S if run.timeout_s else None
    seen: tuple[Any, ...] = ()
    stopped, killed_at = "", 0.0
    while proc.poll() is None:
        if not stopped and cancel_event.is_set():
            stopped = "cancelled"
        elif not stopped and deadline is not None and time.monotonic() > deadline:
            stopped = "timed_out"
        if stopped and time.monotonic() - killed_at > 5:  # again if the container was still being created
            stop_container(engine, name)
            killed_at = time.monotonic()
        with contextlib.suppress(Exception):
            record = read_record_or_none(share, run.experiment, run.run_id)
            state = (record.status, record.attempts, record.cells_done) if record else ()
            if record is not None and state != seen:
                seen = state
                notify(record)
        try:
            proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
    return stopped


def stop_container(engine: Engine, name: str) -> None:
    """Stop a container: SIGTERM first, so its ``run-one`` saves the notebook as far as it ran and ends the record
    (nbbatch.execute.stopsignals), SIGKILL after :data:`STOP_GRACE_S`; ``--rm`` then removes it."""
    engine.query("stop", "--time", f"{STOP_GRACE_S:g}", name, timeout=STOP_GRACE_S + 30)
    engine.query("rm", "--force", name, timeout=30)


def _hint(output: str) -> str:
    if "rlimit" in output and "operation not permitted" in output:
        return (" (the engine may not raise the container's ulimits on this machine: set default_ulimits in "
                "containers.conf, see docs/containers.md)")
    if "No module named" in output:
        return " (the image lacks a module: rebuild it with `nbbatch images build --force`)"
    return ""


@atexit.register
def _stop_leftovers() -> None:  # pragma: no cover - a driver that exits with containers still running
    with _running_lock:
        left = dict(_running)
    for name, engine in left.items():
        stop_container(engine, name)
