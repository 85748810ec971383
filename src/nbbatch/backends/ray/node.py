"""What runs on a Ray node: the body of a run's task, which starts ``python -m nbbatch run-one`` there."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from nbbatch.plan.runs import Run
from nbbatch.store.records import cancel_requested, finalize_record
from nbbatch.store.runrecord import ErrorKind, RunError, Status
from nbbatch.store.share import open_share

NODE_ID_ENV = "NBBATCH_RAY_NODE_ID"  # set for the run (and its kernel): the Ray node it executes on
OUTPUT_TAIL = 3000  # characters of run-one's output a task returns


def execute_on_node(spec: dict[str, Any]) -> dict[str, Any]:
    """The body of a run's Ray task: run ``nbbatch run-one`` for it on this node, pinned to Ray's GPUs.

    ``spec`` is a :class:`~nbbatch.backends.ray.task.RayTaskSpec` as a dict. Returns ``{"exit_code",
    "output" (its tail), "node_id", "gpu_ids"}``. The subprocess dies with this worker (Linux), so a
    cancelled or lost task never leaves a run executing.
    """
    import ray

    run = spec["run"]
    node_id = ray.get_runtime_context().get_node_id()
    share = open_share(spec["share"])
    if cancel_requested(share, run["experiment"], run["run_id"]):
        finalize_record(share, Run.from_dict(run), Status.CANCELLED,
                        RunError("cancelled", "", reason="cancelled before it started", kind=ErrorKind.CANCELLED),
                        backend="ray")
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
    project = spec.get("project")
    run = _with_notebook_here(run, project, spec.get("notebook_source"))
    env = dict(os.environ)
    env.update(spec.get("env") or {})
    env.update({"CUDA_VISIBLE_DEVICES": devices, NODE_ID_ENV: node_id})
    cmd = [sys.executable, "-m", "nbbatch", "run-one", "--spec", json.dumps(run), "--share", spec["share"],
           "--gpus", devices, "--backend", "ray"]
    cwd = None
    if project:
        cmd += ["--project", project]
        cwd = project if os.path.isdir(project) else None
    if spec.get("shared_gpu"):
        cmd.append("--shared-gpu")
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent if sys.platform == "linux" else None)
    output, _ = proc.communicate()
    return {"exit_code": proc.returncode, "output": output.decode("utf-8", "replace")[-OUTPUT_TAIL:],
            "node_id": node_id, "gpu_ids": gpu_ids}


def _with_notebook_here(run: dict[str, Any], project: str | None, source: str | None) -> dict[str, Any]:
    """The run, pointed at a copy of its notebook when this node has it neither at its path nor in the project."""
    if source is None or Path(run["notebook"]).exists() or (project and (Path(project) / run["notebook_rel"]).exists()):
        return run
    import tempfile

    folder = Path(tempfile.gettempdir()) / "nbbatch-notebooks" / run["experiment"] / run["run_id"]
    copy = folder / Path(run["notebook_rel"]).name
    folder.mkdir(parents=True, exist_ok=True)
    copy.write_text(source, encoding="utf-8")
    return {**run, "notebook": str(copy)}


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
