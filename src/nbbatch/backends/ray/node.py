"""What runs on a Ray node: the body of a run's task, which starts ``python -m nbbatch run-one`` there.

With ``container: true`` that ``run-one`` starts the run's container (:mod:`nbbatch.containers.node`). Ray stops a
task by ending its worker, and kills the worker's child processes with SIGKILL on the way (``ray.cancel(force=True)``,
``RAY_kill_child_processes_on_worker_exit``): ``run-one`` then cannot stop its container, which is no process of the
worker (the engine's monitor runs it). So a container run's task first starts a watcher outside the worker's process
tree (:func:`watch_worker`), which stops the run's containers when the worker ends before the task does.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from nbbatch.containers.engines import find_engine
from nbbatch.containers.runner import stop_container
from nbbatch.execute.launch import LaunchSpec, launch_command, nbbatch_launcher
from nbbatch.execute.placement import free_port
from nbbatch.plan.runs import Run
from nbbatch.store.runfiles import cancel_requested, finalize_record, read_record_or_none, requested_outcome
from nbbatch.store.runjson import ErrorKind, RunError, Status
from nbbatch.store.share import open_share

NODE_ID_ENV = "NBBATCH_RAY_NODE_ID"  # set for the run (and its kernel): the Ray node it executes on
OUTPUT_TAIL = 3000  # characters of run-one's output a task returns
LAUNCH_FILE = "launch.json"  # what run-one executes, in the task's private folder
RENDEZVOUS_POLL_S = 0.5  # how often a gang's node asks the supervisor whether every node has published
STOP_GRACE_S = 60.0  # a task interrupted in its worker: how long run-one may take to stop (its container) after SIGTERM
TASK_DONE = b"done"  # what a container run's task tells its watcher when it ends by itself
# The watcher leaves the worker's process tree at once (fork; its parent exits), so Ray's SIGKILL of the worker's
# children misses it, and imports nbbatch only then.
_WATCHER = ("import os, sys\nif os.fork():\n    os._exit(0)\n"
            "from nbbatch.backends.ray.node import watch_worker\nwatch_worker(*sys.argv[1:])\n")


def execute_on_node(spec: dict[str, Any]) -> dict[str, Any]:
    """The body of a run's Ray task: run ``nbbatch run-one`` for it on this node, pinned to Ray's GPUs.

    ``spec`` is a :class:`~nbbatch.backends.ray.task.RayTaskSpec` as a dict. Returns ``{"exit_code",
    "output" (its tail), "node_id", "gpu_ids"}`` (and ``"error"`` when a gang's node could not join it). The
    subprocess dies with this worker (Linux), so a cancelled or lost task never leaves a run executing.

    A node of a distributed run (``spec["gang"]``: its ``node_rank``, the gang's ``token`` and supervisor)
    first meets the other nodes (:func:`rendezvous`), then its ``run-one`` starts this node's ranks with
    ``NBBATCH_NODE_RANK`` and ``NBBATCH_ENDPOINTS`` set.
    """
    import ray

    run = spec["run"]
    gang = spec.get("gang")
    node_id = ray.get_runtime_context().get_node_id()
    share = open_share(spec["share"])
    if cancel_requested(share, run["experiment"], run["run_id"]):
        if not gang or gang["node_rank"] == 0:  # the run's record is node 0's to write
            finalize_record(share, Run.from_dict(run), *requested_outcome(
                share, run["experiment"], run["run_id"], "cancelled before it started"), backend="ray")
        return {"exit_code": 0, "output": "cancelled before it started", "node_id": node_id, "gpu_ids": []}
    gpu_ids: list[int] = []
    if spec["num_gpus"]:
        raw = ray.get_gpu_ids()
        try:
            gpu_ids = [int(g) for g in raw]
        except (TypeError, ValueError):
            return {"exit_code": 2, "node_id": node_id, "gpu_ids": [],
                    "output": f"Ray gave GPU ids {raw!r}, which are not indices; start the node with "
                              "CUDA_VISIBLE_DEVICES holding GPU indices"}
    devices = ",".join(str(g) for g in gpu_ids)
    env = dict(os.environ)
    env.update(spec.get("env") or {})
    env.update({"CUDA_VISIBLE_DEVICES": devices, NODE_ID_ENV: node_id})
    if gang:
        try:
            env.update(rendezvous(gang, node_id))
        except GangError as exc:
            return {"exit_code": 2, "output": str(exc), "node_id": node_id, "gpu_ids": gpu_ids,
                    "error": {"ename": "GangRendezvous", "reason": str(exc)}}
    folder = private_folder(run["run_id"])  # this task's own: the spec and the notebook's copy, removed after
    in_container = bool(spec.get("container_images"))
    watcher = start_watcher(spec, env) if in_container else None
    try:
        run = _with_notebook_here(run, spec.get("project"), spec.get("notebook_source"), folder)
        launch_file = write_private(folder / LAUNCH_FILE, task_launch(spec, run, gpu_ids).to_json())
        cmd, cwd = run_one_command(spec, launch_file)
        # the worker gone (ray.cancel(force=True), a lost worker): run-one stops on SIGTERM as on every cluster,
        # saving the notebook as far as it ran (a container run's stops its container); its reaper kills the kernel
        dying = functools.partial(_die_with_parent, signal.SIGTERM)
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, preexec_fn=dying if sys.platform == "linux" else None)
        try:
            output, _ = proc.communicate()
        except BaseException:  # ray.cancel without force (KeyboardInterrupt here): the worker lives on, run-one not
            _stop(proc)
            raise
        if watcher is not None:  # run-one has ended, and its container with it
            with contextlib.suppress(OSError):
                os.write(watcher, TASK_DONE)
    finally:
        if watcher is not None:
            os.close(watcher)
        shutil.rmtree(folder, ignore_errors=True)
    return {"exit_code": proc.returncode, "output": output.decode("utf-8", "replace")[-OUTPUT_TAIL:],
            "node_id": node_id, "gpu_ids": gpu_ids}


class GangError(Exception):
    """A node of a distributed run could not meet the others."""


def rendezvous(gang: dict[str, Any], node_id: str) -> dict[str, str]:
    """Meet the other nodes of a gang: publish this node's rendezvous endpoint (its IP and a TCP port free here)
    through the experiment's supervisor, wait for every node's, and return run-one's placement variables.

    Raises :class:`GangError` when the gang is stopped, the supervisor is gone, or the other nodes do not
    publish theirs within ``gang["timeout_s"]``.
    """
    import ray
    from ray.util import get_node_ip_address

    node, nodes, timeout_s = int(gang["node_rank"]), int(gang["nodes"]), float(gang["timeout_s"])
    ip = get_node_ip_address()
    endpoint = f"{ip}:{free_port(ip)}"
    try:
        supervisor = ray.get_actor(gang["supervisor"], namespace=gang["namespace"])
        if not ray.get(supervisor.publish.remote(gang["token"], node, endpoint, node_id), timeout=60):
            raise GangError(f"node {node} of {nodes}: its gang was stopped before it could join")
        deadline, have = time.monotonic() + timeout_s, []
        while True:
            state = ray.get(supervisor.endpoints.remote(gang["token"]), timeout=60)
            if state.get("endpoints"):
                return {"NBBATCH_NODE_RANK": str(node), "NBBATCH_ENDPOINTS": ",".join(state["endpoints"])}
            if state.get("gone"):
                raise GangError(f"node {node} of {nodes}: its gang was stopped while it waited for the other nodes")
            have = state.get("have") or have
            if time.monotonic() > deadline:
                missing = sorted(set(range(nodes)) - set(have))
                raise GangError(f"node {node} of {nodes} (at {endpoint}) waited {timeout_s:g} s for the rendezvous "
                                f"endpoints of the other nodes; node(s) {', '.join(map(str, missing))} never "
                                "published theirs (their task did not start: runtime_env setup, a lost node?)")
            time.sleep(RENDEZVOUS_POLL_S)
    except GangError:
        raise
    except Exception as exc:  # noqa: BLE001 - the supervisor is gone, or did not answer
        raise GangError(f"node {node} of {nodes}: cannot reach the experiment's supervisor `{gang['supervisor']}` "
                        f"for the rendezvous ({type(exc).__name__}: {exc})") from exc


def task_launch(spec: dict[str, Any], run: dict[str, Any], gpu_ids: list[int]) -> LaunchSpec:
    """What a task's ``run-one`` executes: ``run`` on Ray's GPUs ``gpu_ids``, in its image with ``container: true``
    (the node's GPUs)."""
    return LaunchSpec(run=Run.from_dict(run), share=spec["share"], backend="ray", project=spec.get("project"),
                      gpus=tuple(gpu_ids), shared_gpu=bool(spec.get("shared_gpu")),
                      container_images=dict(spec.get("container_images") or {}),
                      container_engine=str(spec.get("container_engine") or "podman"))


def run_one_command(spec: dict[str, Any], launch_file: str | os.PathLike[str]) -> tuple[list[str], str | None]:
    """The ``python -m nbbatch run-one`` command of a task and its working directory (the project, where the node
    has it).

    The run (its parameters and ``env:``) is in ``launch_file``, never on the command line, which every
    user of the node can read (``ps``, ``/proc/<pid>/cmdline``).
    """
    project = spec.get("project")
    return (launch_command(nbbatch_launcher(sys.executable), launch_file),
            project if project and os.path.isdir(project) else None)


def start_watcher(spec: dict[str, Any], env: dict[str, str]) -> int | None:
    """Start the watcher of a container run's task (see the module's docstring); return the pipe's end this task
    holds, the run already written to it (the watcher acts when it closes without :data:`TASK_DONE`), or None when
    no watcher could start."""
    read_end, write_end = os.pipe()
    try:
        subprocess.run([sys.executable, "-c", _WATCHER, str(read_end), str(spec.get("container_engine") or "podman"),
                        spec["share"]], env=env, pass_fds=(read_end,), stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, timeout=60,
                       check=True)
        gang = spec.get("gang")
        told = {"run": spec["run"], "ends_record": not gang or int(gang["node_rank"]) == 0}  # a gang's: node 0's
        os.write(write_end, json.dumps(told).encode() + b"\n")  # the watcher reads as it comes: never blocks long
    except (OSError, subprocess.SubprocessError):
        os.close(write_end)
        return None
    finally:
        os.close(read_end)
    return write_end


def watch_worker(read_end: str, engine_name: str, share_url: str) -> None:
    """The watcher: wait until the task's worker closes the pipe; unless it said the task ended by itself, stop
    every container of the run (labels ``nbbatch.experiment``, ``nbbatch.run``) on this node, then end the run's
    record if it is not final (the run could write it until its container was gone)."""
    said = b""
    with contextlib.suppress(OSError):
        while chunk := os.read(int(read_end), 65536):  # end of file: the task ended, or its worker is gone
            said += chunk
    text, _, rest = said.partition(b"\n")
    if rest == TASK_DONE or not text:
        return
    with contextlib.suppress(Exception):
        told = json.loads(text)
        run = Run.from_dict(told["run"])
        engine = find_engine(engine_name)
        listed = engine.query("ps", "--all", "--quiet", "--filter", f"label=nbbatch.experiment={run.experiment}",
                              "--filter", f"label=nbbatch.run={run.run_id}")
        for container in listed.stdout.split():
            stop_container(engine, container)
        if not told.get("ends_record"):
            return
        share = open_share(share_url)
        record = read_record_or_none(share, run.experiment, run.run_id)
        if record is not None and not record.final:
            if cancel_requested(share, run.experiment, run.run_id):
                status, error = requested_outcome(share, run.experiment, run.run_id,
                                                  "cancelled (its Ray task was stopped, and its container)")
            else:
                status, error = Status.FAILED, RunError(
                    "RayWorkerEnded", f"the Ray worker of its task on node {socket.gethostname()} ended before the run",
                    reason="its Ray task was stopped (killed, or its worker died); its container was stopped",
                    kind=ErrorKind.INFRA)
            finalize_record(share, run, status, error, backend="ray")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop run-one as a batch scheduler does (SIGTERM: it stops its container first), then for good."""
    with contextlib.suppress(OSError):
        proc.terminate()
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()


def private_folder(run_id: str) -> Path:
    """A fresh folder only this user can enter (0700, :func:`tempfile.mkdtemp`), named after the run."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", str(run_id))[:80]
    return Path(tempfile.mkdtemp(prefix=f"nbbatch-{safe}-"))


def write_private(path: Path, text: str) -> Path:
    """Write ``text`` to a new file only this user can read (0600); refuse to follow or reuse a planted one."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
    return path


def _with_notebook_here(run: dict[str, Any], project: str | None, source: str | None, folder: Path) -> dict[str, Any]:
    """The run, pointed at a copy of its notebook in ``folder`` (private to the task) when this node has it
    neither at its path nor in the project."""
    if source is None or Path(run["notebook"]).exists() or (project and (Path(project) / run["notebook_rel"]).exists()):
        return run
    copy = write_private(folder / Path(run["notebook_rel"]).name, source)
    return {**run, "notebook": str(copy)}


def _die_with_parent(signum: int = signal.SIGKILL) -> None:  # pragma: no cover - in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signum))  # PR_SET_PDEATHSIG
