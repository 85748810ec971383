"""A distributed run's nodes on Slurm: each node launcher's place in the gang, and the gang's addresses.

``srun`` starts one launcher per node of the job and tells each its ``SLURM_NODEID``, and the address of the node
it was started from (``SLURM_LAUNCH_NODE_IPADDR``: the job's first node, where the batch script runs). Node names
need not resolve between nodes, so addresses are never looked up by name: each launcher takes a free port, finds
the address by which it reaches node 0, and publishes ``address:port`` on the share; every launcher reads all of
them (node 0's first: the rendezvous of torch and JAX; all of them: TensorFlow's workers).
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Mapping

from nbbatch.errors import NbbatchError
from nbbatch.execute.placement import NodePlacement, free_port
from nbbatch.plan.runs import Run
from nbbatch.store.layout import run_paths
from nbbatch.store.share import Share, poll_interval

GANG_TIMEOUT_S = 300.0  # how long a launcher waits for every node's address


def address_towards(peer: str) -> str:
    """This machine's address on the route to ``peer`` (no packet is sent: a UDP socket only picks the route)."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((peer, 9))
        return str(probe.getsockname()[0])
    return peer


def endpoint_file(run: Run, job_id: str, node: int) -> str:
    """Where node ``node`` of job ``job_id`` publishes its address, in the run's folder on the share."""
    return run_paths(run.experiment, run.run_id).file(f".endpoint-{job_id}-{node}")


def slurm_placement(run: Run, environ: Mapping[str, str], share: Share | None = None,
                    timeout_s: float = GANG_TIMEOUT_S) -> NodePlacement | None:
    """This launcher's place in its Slurm job's gang; None outside a Slurm job step."""
    assert run.distribution is not None
    if "SLURM_NODEID" not in environ or "SLURM_JOB_ID" not in environ:
        return None
    node, nodes, job = int(environ["SLURM_NODEID"]), run.distribution.nodes, environ["SLURM_JOB_ID"]
    launch = environ.get("SLURM_LAUNCH_NODE_IPADDR") or "127.0.0.1"
    host = launch if node == 0 else address_towards(launch)
    own = f"{host}:{free_port('0.0.0.0')}"
    if nodes == 1 or share is None:
        return NodePlacement(node, (own,))
    share.write_bytes(endpoint_file(run, job, node), own.encode())
    deadline = time.monotonic() + timeout_s
    while True:
        endpoints = []
        for other in range(nodes):
            with contextlib.suppress(FileNotFoundError, OSError):
                endpoints.append(share.read_bytes(endpoint_file(run, job, other)).decode().strip())
        if len(endpoints) == nodes:
            return NodePlacement(node, tuple(endpoints))
        if time.monotonic() > deadline:
            raise NbbatchError(f"run {run.run_id} (Slurm job {job}): only {len(endpoints)} of its {nodes} nodes "
                               f"published their address on the share within {timeout_s:g} s; do all nodes see "
                               f"the share at {share.url}?")
        time.sleep(poll_interval(share, local=0.2, remote=2.0))
