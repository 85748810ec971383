"""Where a distributed run's ranks are: each node launcher's place in the gang, and each rank's environment.

nbbatch's own contract is ``NBBATCH_NODE_RANK`` / ``NBBATCH_ENDPOINTS`` (what the Ray backend sets); a
backend whose cluster names the nodes its own way reads them in its
:meth:`~nbbatch.backends.base.Backend.node_placement` hook, passed here as ``backend_placement``. One node
alone rendezvous on a free port of 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from nbbatch.errors import NbbatchError
from nbbatch.execute.affinity import CPUS_VARIABLE, CpuBlocks, format_cpu_list, node_cpu_blocks
from nbbatch.plan.runs import Run

CONTRACT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
DEFAULT_PORT = 29500  # torchrun's, where a backend names the master but not its port


@dataclass(frozen=True)
class NodePlacement:
    """Where one node launcher is in its run's gang."""

    node_rank: int
    endpoints: tuple[str, ...]  # "host:port" of every node's rendezvous, node 0's (the master) first
    local_ranks: tuple[int, ...] | None = None  # the local ranks this launcher starts (None: all; MPI: its own)


PlacementReader = Callable[[Run, Mapping[str, str]], "NodePlacement | None"]


@dataclass(frozen=True)
class Rank:
    """One rank of a distributed run, as its attempt sees it."""

    rank: int
    local_rank: int
    node_rank: int
    world_size: int
    env: Mapping[str, str]

    @property
    def files(self) -> int | None:
        """Whose files the rank writes: rank 0 the run's own (None), the others ``ranks/<rank>/``."""
        return None if self.rank == 0 else self.rank

    def describe(self) -> str:
        """The rank, for the first log line of its attempt."""
        return f", rank {self.rank} of {self.world_size} on node {self.node_rank}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (a rendezvous binds it moments later; a clash is retried)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def local_placements(run: Run) -> list[NodePlacement]:
    """Every node of ``run`` on this machine, rendezvous on free ports of 127.0.0.1 (more than one node: simulated)."""
    assert run.distribution is not None
    endpoints = tuple(f"127.0.0.1:{free_port()}" for _ in range(run.distribution.nodes))
    return [NodePlacement(n, endpoints) for n in range(len(endpoints))]


def rank_env(run: Run, placement: NodePlacement, local_rank: int,
             cpu_blocks: CpuBlocks | None = None) -> dict[str, str]:
    """The environment of one rank: torchrun's variables (also with an ``NBBATCH_`` prefix), and by type
    ``JAX_COORDINATOR_ADDRESS`` or ``TF_CONFIG``; ``NBBATCH_CPUS``, the cores the rank is pinned to (if any), and
    ``OMP_NUM_THREADS``, its share of them (or of the node's) where ranks share the node.

    ``cpu_blocks`` are every local rank's cores (:func:`~nbbatch.execute.affinity.node_cpu_blocks`); None or
    empty: none pinned.
    """
    d = run.distribution
    assert d is not None
    per_node = d.processes_per_node
    host, _, port = placement.endpoints[0].rpartition(":")
    values = dict(zip(CONTRACT, (placement.node_rank * per_node + local_rank, run.world_size, local_rank, per_node,
                                 placement.node_rank, host, port), strict=True))
    env = {name: str(value) for name, value in values.items()}
    env.update({f"NBBATCH_{name}": value for name, value in list(env.items())})
    cpu_blocks = cpu_blocks or ()
    cpus = cpu_blocks[local_rank] if local_rank < len(cpu_blocks) else frozenset()
    if cpus:
        env[CPUS_VARIABLE] = format_cpu_list(cpus)
    # Ranks that share the node's cores share them out. One process per node keeps the default, as an ordinary run:
    # JAX over 2 GPUs ran 5-10 % slower with OMP_NUM_THREADS set to every core (docs/benchmarks.md §17).
    if per_node > 1 and "OMP_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in run.env:
        sharing = sum(block == cpus for block in cpu_blocks) if cpus else per_node
        env["OMP_NUM_THREADS"] = str(max(1, (len(cpus) or os.cpu_count() or 1) // sharing))
    if d.type == "jax":
        env["JAX_COORDINATOR_ADDRESS"] = placement.endpoints[0]
    elif d.type == "tensorflow":  # one worker per node (processes_per_node is 1), each on its node's endpoint
        env["TF_CONFIG"] = json.dumps({"cluster": {"worker": list(placement.endpoints)},
                                       "task": {"type": "worker", "index": placement.node_rank}})
    return env


def _pinned_by_user(run: Run) -> bool:
    """Whether the environment or the experiment's ``env:`` says where kernels run (an empty value: unpinned)."""
    return CPUS_VARIABLE in os.environ or CPUS_VARIABLE in run.env


def placement_from_env(run: Run, environ: Mapping[str, str],
                       backend_placement: PlacementReader | None = None) -> NodePlacement:
    """This node's place in the gang: from nbbatch's own ``NBBATCH_NODE_RANK`` / ``NBBATCH_ENDPOINTS``, else
    from what ``backend_placement`` (the backend's hook) reads in ``environ``; one node alone rendezvous on
    127.0.0.1."""
    assert run.distribution is not None
    nodes = run.distribution.nodes
    if environ.get("NBBATCH_ENDPOINTS"):
        endpoints = tuple(environ["NBBATCH_ENDPOINTS"].split(","))
        node = environ.get("NBBATCH_NODE_RANK", "")
        if len(endpoints) != nodes or not node.isdigit() or int(node) >= nodes:
            raise NbbatchError(f"run {run.run_id} spans {nodes} nodes, but its launcher was given NBBATCH_NODE_RANK="
                               f"{node!r} and {len(endpoints)} endpoint(s) in NBBATCH_ENDPOINTS")
        return NodePlacement(int(node), endpoints)
    placement = backend_placement(run, environ) if backend_placement is not None else None
    if placement is not None:
        return placement
    if nodes > 1:
        raise NbbatchError(f"run {run.run_id} spans {nodes} nodes, but this node was not told its place in the gang "
                           "(no NODE_RANK/MASTER_ADDR, TF_CONFIG or OMPI_COMM_WORLD_RANK in its environment)")
    return local_placements(run)[0]


def ranks_of(run: Run, placement: NodePlacement, gpu_ids: Sequence[int] | None = None) -> list[Rank]:
    """The ranks the launcher at ``placement`` starts; ``gpu_ids`` are the node's GPUs (NVML indices, the kernels'
    ``CUDA_VISIBLE_DEVICES``), local rank ``r`` using the ``r``-th: its cores are those near it."""
    assert run.distribution is not None
    per_node = run.distribution.processes_per_node
    locals_ = placement.local_ranks if placement.local_ranks is not None else tuple(range(per_node))
    blocks = () if _pinned_by_user(run) else node_cpu_blocks(per_node, gpu_ids)  # NVML asked once for the node
    return [Rank(placement.node_rank * per_node + local, local, placement.node_rank, run.world_size,
                 rank_env(run, placement, local, blocks)) for local in locals_]
