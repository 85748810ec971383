"""A two-node Ray cluster on loopback for the tests (the session fixture ``ray_head`` of tests/conftest.py, and
tests/test_ray_containers.py's own, whose nodes need podman's settings).

A head and a second node (``ray start``) in a temp dir of their own, each with 2 CPUs; every process they started is
stopped by PID at the end (never a plain ``ray stop``, which would stop other Ray clusters of this user). The test
module sets ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` before importing Ray, so Ray binds its servers to loopback.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

from nbbatch.execute.placement import free_port
from support.waiting import wait_until

# `ray start` of a node that joins a cluster refuses to run while RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (a check meant
# for macOS/Windows): keep the variable (servers on loopback) and lift that check, in the CLI process alone.
_RAY_CLI = """
import sys, types
import ray._private.ray_constants as constants
import ray.scripts.scripts as scripts
if sys.argv[1] == "--join":
    del sys.argv[1]
    patched = types.ModuleType("ray_constants")
    patched.__dict__.update(constants.__dict__)
    patched.ENABLE_RAY_CLUSTER = True
    scripts.ray_constants = patched
sys.argv[0] = "ray"
scripts.main()
"""


@dataclass(frozen=True)
class RayCluster:
    """The running cluster: its head's address, its temp dir, and what names its processes on their command lines."""

    address: str
    temp_dir: Path
    tags: tuple[str, ...]


@dataclass(frozen=True)
class RayHead:
    """The session's cluster (``ray_head``): its address and temp dir, its two nodes' ids, the second node's raylet
    socket (to kill that node), and what names its processes."""

    address: str
    temp_dir: Path
    head_id: str
    worker_id: str
    worker_raylet_socket: str
    tags: tuple[str, ...]

    @classmethod
    def of(cls, cluster: RayCluster, nodes: list[dict]) -> RayHead:
        """From the started cluster and ``ray.nodes()``."""
        alive = [n for n in nodes if n["Alive"]]
        head = next(n for n in alive if "node:__internal_head__" in n["Resources"])
        worker = next(n for n in alive if n is not head)
        return cls(cluster.address, cluster.temp_dir, head["NodeID"], worker["NodeID"], worker["RayletSocketName"],
                   cluster.tags)


def _ray_cli(args: list[str], env: dict[str, str], join: bool = False) -> None:
    cmd = [sys.executable, "-c", _RAY_CLI, *(["--join"] if join else []), *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    if done.returncode:
        raise RuntimeError(f"`ray {' '.join(args)}` failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def cmdline(proc: psutil.Process) -> list[str]:
    """A process's command line, or nothing when it has just exited."""
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def cluster_processes(tags: tuple[str, ...]) -> list[psutil.Process]:
    """Every process of the test's cluster: those naming its temp dir or address, and all their descendants."""
    mine = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if proc.pid not in mine and any(tag in arg for tag in tags for arg in proc.info["cmdline"] or []):
                found.update({p.pid: p for p in (proc, *proc.children(recursive=True))})
        except psutil.Error:
            continue
    return [p for pid, p in found.items() if pid not in mine]


def _stop(tags: tuple[str, ...]) -> None:
    procs = cluster_processes(tags)
    for proc in procs:
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=5)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)


STARTS = 2  # tries to start a test cluster


def ray_cluster(prefix: str, num_gpus: int = 0, env: dict[str, str] | None = None) -> Iterator[RayCluster]:
    """A module fixture's body: the cluster started (``env`` added to the nodes' environment), this process connected
    to it, and everything stopped at the end (the temp dir kept where KEEP_RAY_TMP is set, to read its logs)."""
    import ray

    node_env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0", **(env or {})}
    common = ["--node-ip-address=127.0.0.1", "--num-cpus=2", f"--num-gpus={num_gpus}", "--disable-usage-stats",
              f"--object-store-memory={100 * 2**20}"]
    for attempt in range(STARTS):  # Ray gives a raylet 30 s to register: two loaded cores may take longer, once
        temp_dir = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp" if os.path.isdir("/tmp") else None))
        port = free_port()
        address = f"127.0.0.1:{port}"
        tags = (str(temp_dir), f"--address={address}", f"--gcs-address={address}")
        try:
            _ray_cli(["start", "--head", f"--port={port}", f"--temp-dir={temp_dir}", "--include-dashboard=false",
                      f"--ray-client-server-port={free_port()}", f"--dashboard-port={free_port()}",
                      f"--dashboard-agent-listen-port={free_port()}", *common], node_env)
            _ray_cli(["start", f"--address={address}", f"--dashboard-agent-listen-port={free_port()}", *common],
                     node_env, join=True)
            break
        except RuntimeError:
            _stop(tags)
            shutil.rmtree(temp_dir, ignore_errors=True)
            if attempt == STARTS - 1:
                raise
    try:
        if ray.is_initialized():  # connected to another test cluster (the session's): that one goes on
            ray.shutdown()
        ray.init(address=address, log_to_driver=False)
        wait_until(lambda: len([n for n in ray.nodes() if n["Alive"]]) == 2, timeout=180, message="both Ray nodes",
                   interval=0.5)
        yield RayCluster(address, temp_dir, tags)
    finally:
        ray.shutdown()
        _stop(tags)
        if not os.environ.get("KEEP_RAY_TMP"):
            shutil.rmtree(temp_dir, ignore_errors=True)
