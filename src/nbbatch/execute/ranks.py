"""Distributed runs: one kernel per rank, started by nbbatch itself on every node, the same on every backend.

A backend starts one *node launcher* per node (:func:`execute_node`: the local backend in a thread, Ray in
a task of a placement group, Azure ML as the job's command on each instance). It starts the node's ranks,
each an ordinary attempt (:func:`nbbatch.execute.attempt._attempt`) of the same notebook with the
torchrun environment (:func:`rank_env`). Rank 0's files are the run's own; rank ``r``'s are in
``ranks/<r>/``. When a rank fails, every rank is stopped: on its node at once, on the other nodes through
a marker in the share (``ranks/stop-<n>.json``) that every launcher watches. Node 0 then writes the
run's record, naming the first rank that failed, and says whether the whole gang runs again (a kernel
died and retries are left) in ``ranks/decision-<n>.json``, which the other nodes wait for.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from nbbatch.errors import NbbatchError, ShareError
from nbbatch.plan.runs import Run
from nbbatch.store.layout import LOG_FILE, OUTPUT_NOTEBOOK, run_paths
from nbbatch.store.runfiles import new_record, read_record, write_record
from nbbatch.store.runjson import ErrorKind, RunError, RunRecord, Status, utc_now
from nbbatch.store.share import Share

CONTRACT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
DEFAULT_PORT = 29500  # torchrun's, where a backend names the master but not its port
PEER_WAIT_S = 300.0  # how long node 0 waits for a silent node's ranks before it calls them lost
PORT_RETRIES = 3  # new rendezvous ports after "address already in use" (local: another process took the port)
_PORT_TAKEN = re.compile(r"address already in use|EADDRINUSE|errno 98", re.IGNORECASE)
# The errors a rank sees when another rank went away: the other rank's error is the cause.
_PEER_LOST = re.compile(r"connection (closed|reset) by peer|connection refused|broken pipe|DistBackendError|"
                        r"NCCL (error|communicator)|ncclRemoteError|third_party/gloo|ProcessGroup(Gloo|NCCL)|"
                        r"coordination service|heartbeat timeout|barrier timed out", re.IGNORECASE)


@dataclass(frozen=True)
class NodePlacement:
    """Where one node launcher is in its run's gang."""

    node_rank: int
    endpoints: tuple[str, ...]  # "host:port" of every node's rendezvous, node 0's (the master) first
    local_ranks: tuple[int, ...] | None = None  # the local ranks this launcher starts (None: all; MPI: its own)


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
        return f", rank {self.rank} of {self.world_size} on node {self.node_rank}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (a rendezvous binds it moments later; a clash is retried)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def local_placements(run: Run) -> list[NodePlacement]:
    """Every node of ``run`` on this machine, rendezvous on free ports of 127.0.0.1 (more than one node: simulated)."""
    endpoints = tuple(f"127.0.0.1:{free_port()}" for _ in range(int(run.distribution["nodes"])))
    return [NodePlacement(n, endpoints) for n in range(len(endpoints))]


def rank_env(run: Run, placement: NodePlacement, local_rank: int) -> dict[str, str]:
    """The environment of one rank: torchrun's variables (also with an ``NBBATCH_`` prefix), and by type
    ``JAX_COORDINATOR_ADDRESS`` or ``TF_CONFIG``."""
    d = run.distribution
    per_node = int(d["processes_per_node"])
    host, _, port = placement.endpoints[0].rpartition(":")
    values = dict(zip(CONTRACT, (placement.node_rank * per_node + local_rank, run.world_size, local_rank, per_node,
                                 placement.node_rank, host, port), strict=True))
    env = {name: str(value) for name, value in values.items()}
    env.update({f"NBBATCH_{name}": value for name, value in list(env.items())})
    if "OMP_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in run.env:  # as torchrun: ranks share the cores
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // per_node))
    if d["type"] == "jax":
        env["JAX_COORDINATOR_ADDRESS"] = placement.endpoints[0]
    elif d["type"] == "tensorflow":  # one worker per node (processes_per_node is 1), each on its node's endpoint
        env["TF_CONFIG"] = json.dumps({"cluster": {"worker": list(placement.endpoints)},
                                       "task": {"type": "worker", "index": placement.node_rank}})
    return env


def placement_from_env(run: Run, environ: Mapping[str, str]) -> NodePlacement:
    """This node's place in the gang, from what the backend set: nbbatch's own ``NBBATCH_NODE_RANK`` /
    ``NBBATCH_ENDPOINTS``, Azure ML's PyTorch (``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), TensorFlow
    (``TF_CONFIG``) or MPI (``OMPI_COMM_WORLD_*``) distributions; one node alone rendezvous on 127.0.0.1."""
    nodes, per_node = int(run.distribution["nodes"]), int(run.distribution["processes_per_node"])
    if environ.get("NBBATCH_ENDPOINTS"):
        endpoints = tuple(environ["NBBATCH_ENDPOINTS"].split(","))
        node = environ.get("NBBATCH_NODE_RANK", "")
        if len(endpoints) != nodes or not node.isdigit() or int(node) >= nodes:
            raise NbbatchError(f"run {run.run_id} spans {nodes} nodes, but its launcher was given NBBATCH_NODE_RANK="
                               f"{node!r} and {len(endpoints)} endpoint(s) in NBBATCH_ENDPOINTS")
        return NodePlacement(int(node), endpoints)
    if "OMPI_COMM_WORLD_RANK" in environ:  # MPI started one process per rank: this launcher is that rank's
        rank = int(environ["OMPI_COMM_WORLD_RANK"])
        local = int(environ.get("OMPI_COMM_WORLD_LOCAL_RANK", rank % per_node))
        # Azure ML names the master "addr:port" (AZ_BATCH_MASTER_NODE), or only its address on one node
        master, _, port = (environ.get("AZ_BATCH_MASTER_NODE") or "").partition(":")
        master = master or environ.get("AZ_BATCHAI_MPI_MASTER_NODE") or environ.get("MASTER_ADDR") or "127.0.0.1"
        port = port or environ.get("MASTER_PORT") or str(DEFAULT_PORT)
        return NodePlacement(rank // per_node, (f"{master}:{port}",), (local,))
    if environ.get("TF_CONFIG") and run.distribution["type"] == "tensorflow":
        config = json.loads(environ["TF_CONFIG"])
        return NodePlacement(int(config["task"]["index"]), tuple(config["cluster"]["worker"]))
    if "MASTER_ADDR" in environ:
        node = environ.get("NODE_RANK") or environ.get("GROUP_RANK") or environ.get("RANK") or "0"
        return NodePlacement(int(node), (f"{environ['MASTER_ADDR']}:{environ.get('MASTER_PORT') or DEFAULT_PORT}",))
    if nodes > 1:
        raise NbbatchError(f"run {run.run_id} spans {nodes} nodes, but this node was not told its place in the gang "
                           "(no NODE_RANK/MASTER_ADDR, TF_CONFIG or OMPI_COMM_WORLD_RANK in its environment)")
    return local_placements(run)[0]


def _ranks(run: Run, placement: NodePlacement) -> list[Rank]:
    per_node = int(run.distribution["processes_per_node"])
    locals_ = placement.local_ranks if placement.local_ranks is not None else tuple(range(per_node))
    return [Rank(placement.node_rank * per_node + local, local, placement.node_rank, run.world_size,
                 rank_env(run, placement, local)) for local in locals_]


@dataclass
class _Ended:
    rank: int
    record: RunRecord
    at: float


def execute_node(run: Run, share: Share, placement: NodePlacement, *, gpu_ids: list[int] | None = None,
                 cancel_event: threading.Event | None = None, on_update: Callable[[RunRecord], None] | None = None,
                 backend: str = "local", project_root: Path | None = None, save_every: float = 1.0,
                 recorded_gpu_ids: list[int] | None = None, input_paths: dict[str, str] | None = None,
                 new_endpoints: Callable[[], tuple[str, ...]] | None = None) -> RunRecord:
    """Run this node's ranks of the distributed ``run`` until the gang ends; retry the gang after a kernel death.

    Returns the run's final record on node 0, the record of this node's first rank elsewhere (its status is
    the run's). ``new_endpoints`` gives fresh rendezvous ports when one was taken (the local backend's).
    """
    return _Node(run, share, placement, gpu_ids or [], cancel_event, on_update, backend, project_root, save_every,
                 recorded_gpu_ids, input_paths, new_endpoints).execute()


class _Node:
    def __init__(self, run: Run, share: Share, placement: NodePlacement, gpu_ids: list[int],
                 cancel_event: threading.Event | None, on_update: Callable[[RunRecord], None] | None, backend: str,
                 project_root: Path | None, save_every: float, recorded_gpu_ids: list[int] | None,
                 input_paths: dict[str, str] | None, new_endpoints: Callable[[], tuple[str, ...]] | None):
        self.run, self.share, self.placement, self.gpu_ids = run, share, placement, gpu_ids
        self.cancel_event, self.notify, self.backend = cancel_event, on_update or (lambda _r: None), backend
        self.project_root, self.save_every, self.recorded_gpu_ids = project_root, save_every, recorded_gpu_ids
        self.input_paths, self.new_endpoints = input_paths, new_endpoints
        self.paths = run_paths(run.experiment, run.run_id)
        self.records: dict[int, RunRecord] = {}
        self.poll = 0.25 if share.local_path("") is not None else 2.0

    @property
    def coordinator(self) -> bool:
        """Node 0's launcher (with rank 0): it writes the run's record and decides whether the gang runs again."""
        return self.placement.node_rank == 0 and (self.placement.local_ranks is None or 0 in self.placement.local_ranks)

    def record_of(self, rank: Rank) -> RunRecord:
        if rank.rank not in self.records:
            if rank.rank == 0:
                from nbbatch.execute.attempt import _note_lost_attempt

                record = read_record(self.share, self.run.experiment, self.run.run_id) or new_record(self.run, self.backend)
                _note_lost_attempt(record)
                record.world_size, record.ranks = self.run.world_size, []
            else:
                record = replace(new_record(self.run, self.backend), rank=rank.rank, world_size=self.run.world_size)
            self.records[rank.rank] = record
        return self.records[rank.rank]

    def execute(self) -> RunRecord:
        from nbbatch.execute.attempt import _failed_before_start
        from nbbatch.execute.folders import RunFolders

        ranks = _ranks(self.run, self.placement)
        try:
            folders = RunFolders(self.run, self.share, input_paths=self.input_paths, project_root=self.project_root)
        except NbbatchError as exc:  # e.g. an input missing on this node: its ranks fail, the other nodes stop
            for rank in ranks[1:]:
                record = self.record_of(rank)
                record.attempts += 1  # what node 0 waits for: this attempt of the gang ended
                _failed_before_start(self.share, record, exc, None)
            own = self.record_of(ranks[0])
            if own.rank is not None:  # the run's own record (rank 0's) counts the run's attempts as ever
                own.attempts += 1
            with contextlib.suppress(ShareError, OSError):
                self.share.write_bytes(self.paths.gang_stop(1), json.dumps(
                    {"rank": ranks[0].rank, "error": f"{exc} (node {self.placement.node_rank})"}).encode())
                if self.coordinator:
                    self.share.write_bytes(f"{self.paths.ranks}/decision-1.json", b'{"retry": false}')
            return _failed_before_start(self.share, own, exc, self.notify if self.coordinator else None)
        attempts_left, port_retries, gang = self.run.retries + 1, PORT_RETRIES, 0
        try:
            while True:
                gang += 1
                ended = self._gang(gang, ranks, folders)
                first = self._first_failure(gang, ended)
                port_taken = first is not None and self.new_endpoints is not None and port_retries > 0 and \
                    bool(_PORT_TAKEN.search(first.error.evalue if first.error else ""))
                died = first is not None and first.error is not None and first.error.kind == ErrorKind.KERNEL_DIED
                retry = port_taken or (died and attempts_left > 1 and not self._cancelled())
                retry = self._decide(gang, retry)
                if not retry:
                    return self._finish(ranks, ended, first)
                if port_taken:
                    port_retries -= 1
                    assert self.new_endpoints is not None
                    self.placement = replace(self.placement, endpoints=self.new_endpoints())
                    ranks = _ranks(self.run, self.placement)
                else:
                    attempts_left -= 1
        finally:
            folders.close()

    def _cancelled(self) -> bool:
        from nbbatch.store.runfiles import cancel_requested

        if self.cancel_event is not None and self.cancel_event.is_set():
            return True
        with contextlib.suppress(ShareError, OSError):
            return cancel_requested(self.share, self.run.experiment, self.run.run_id)
        return False

    def _gang(self, gang: int, ranks: list[Rank], folders: Any) -> dict[int, _Ended]:
        """One attempt of every rank of this node; the first that fails stops the others (here and on other nodes)."""
        from nbbatch.execute.attempt import _attempt

        stop = threading.Event()
        ended: dict[int, _Ended] = {}
        lock = threading.Lock()
        marker = self.paths.gang_stop(gang)

        def run_rank(rank: Rank) -> None:
            record = self.record_of(rank)
            notify = self.notify if rank.rank == 0 else (lambda _r: None)
            try:
                record = _attempt(self.run, self.share, record, self.gpu_ids, False, stop, notify, self.backend,
                                  self.project_root, self.save_every, None, None, self.recorded_gpu_ids, folders,
                                  rank=rank)
            except Exception as exc:  # noqa: BLE001 - e.g. the share failed: the rank failed, the others stop
                record.status, record.ended_at = Status.FAILED, utc_now()
                record.error = RunError(type(exc).__name__, str(exc), reason="nbbatch error", kind=ErrorKind.INTERNAL)
            with lock:
                ended[rank.rank] = _Ended(rank.rank, record, time.monotonic())
                first_to_fail = record.status in (Status.FAILED, Status.TIMED_OUT) and not stop.is_set()
                if record.status != Status.SUCCEEDED:
                    stop.set()
            if first_to_fail:  # the other nodes stop their ranks when they see it
                with contextlib.suppress(ShareError, OSError):
                    self.share.write_bytes(marker, json.dumps({"rank": rank.rank, "status": str(record.status),
                                                               "error": record.error.summary() if record.error else ""
                                                               }).encode())

        threads = [threading.Thread(target=run_rank, args=(r,), name=f"rank-{self.run.run_id}-{r.rank}", daemon=True)
                   for r in ranks]
        for thread in threads:
            thread.start()
        while any(t.is_alive() for t in threads):
            if not stop.is_set() and (self.cancel_event is not None and self.cancel_event.is_set()
                                      or self._exists(marker)):
                stop.set()  # each rank's watchdog kills its kernel within a tenth of a second
            for thread in threads:
                thread.join(timeout=self.poll / len(threads))
        return ended

    def _exists(self, path: str) -> bool:
        try:
            return self.share.exists(path)
        except (ShareError, OSError):
            return False

    def _first_failure(self, gang: int, ended: dict[int, _Ended]) -> RunRecord | None:
        """The rank whose failure ended the gang: of this node's, and (on node 0) of every node's."""
        if self.coordinator:
            ended.update(self._peers(gang, ended))
        failed = sorted((e for e in ended.values() if e.record.status in (Status.FAILED, Status.TIMED_OUT)),
                        key=lambda e: e.at)
        cause = [e for e in failed if not _PEER_LOST.search(e.record.error.summary() if e.record.error else "")]
        chosen = (cause or failed or [None])[0]
        if chosen is None:
            return None
        error = replace(chosen.record.error or RunError(str(chosen.record.status), ""), rank=chosen.rank)
        return replace(chosen.record, error=error)

    def _peers(self, gang: int, ended: dict[int, _Ended]) -> dict[int, _Ended]:
        """The final records of the other nodes' ranks for gang attempt ``gang`` (lost ones: failed, infra)."""
        found: dict[int, _Ended] = {}
        waiting = [r for r in range(self.run.world_size) if r not in ended]
        last_change, seen = time.monotonic(), {}
        while waiting:
            for rank in list(waiting):
                try:
                    record = read_record(self.share, self.run.experiment, self.run.run_id, rank=rank)
                except (ShareError, OSError):
                    record = None
                if record is not None and record.to_json() != seen.get(rank):
                    seen[rank], last_change = record.to_json(), time.monotonic()
                if record is not None and record.final and record.attempts >= gang:
                    found[rank] = _Ended(rank, record, time.monotonic())
                    waiting.remove(rank)
            if waiting and time.monotonic() - last_change > PEER_WAIT_S:
                for rank in waiting:
                    record = replace(new_record(self.run, self.backend), rank=rank, status=Status.FAILED,
                                     error=RunError("RankLost", f"rank {rank} reported nothing for {PEER_WAIT_S:g} s",
                                                    reason="its node was lost", kind=ErrorKind.INFRA))
                    found[rank] = _Ended(rank, record, time.monotonic())
                with contextlib.suppress(ShareError, OSError):  # the silent node stops, should it come back
                    self.share.write_bytes(self.paths.gang_stop(gang), b'{"error": "a node was lost"}')
                break
            if waiting:
                time.sleep(self.poll)
        return found

    def _decide(self, gang: int, retry: bool) -> bool:
        """Node 0 says whether the gang runs again; the other nodes wait to hear it."""
        if self.run.distribution["nodes"] == 1 and self.placement.local_ranks is None:
            return retry
        path = f"{self.paths.ranks}/decision-{gang}.json"
        if self.coordinator:
            with contextlib.suppress(ShareError, OSError):
                self.share.write_bytes(path, json.dumps({"retry": retry}).encode())
            return retry
        deadline = time.monotonic() + PEER_WAIT_S
        while time.monotonic() < deadline:
            with contextlib.suppress(ShareError, OSError, FileNotFoundError, ValueError):
                return bool(json.loads(self.share.read_bytes(path)).get("retry"))
            time.sleep(self.poll)
        return False

    def _finish(self, ranks: list[Rank], ended: dict[int, _Ended], first: RunRecord | None) -> RunRecord:
        """On node 0: the run's record (rank 0's, with every rank's outcome and the first failure) and ``ranks/0/``."""
        own = self.records[ranks[0].rank]
        if not self.coordinator:
            if first is not None:
                own.status, own.error = first.status, first.error
            return own
        record = self.records[0]
        record.world_size = self.run.world_size
        per_node = int(self.run.distribution["processes_per_node"])
        record.ranks = [_rank_entry(e.rank, e.rank // per_node, e.record, first)
                        for e in sorted(ended.values(), key=lambda e: e.rank)]
        if first is not None:
            record.status, record.error = first.status, first.error
        elif any(e.record.status == Status.CANCELLED for e in ended.values()):
            record.status = Status.CANCELLED
        self._copy_rank_zero()
        write_record(self.share, record)
        self.notify(record)
        return record

    def _copy_rank_zero(self) -> None:
        """``ranks/0/`` holds rank 0's notebook and log too, so every rank's files are in one place."""
        rank0 = self.paths.of_rank(0)
        for name in (OUTPUT_NOTEBOOK, LOG_FILE):  # through the share: written whole (atomically) or not at all
            with contextlib.suppress(ShareError, OSError):
                self.share.write_bytes(rank0.file(name), self.share.read_bytes(self.paths.file(name)))


def _rank_entry(rank: int, node: int, record: RunRecord, first: RunRecord | None) -> dict[str, Any]:
    """What run.json says about one rank."""
    status = str(record.status)
    error = record.error.summary() if record.error else None
    if first is not None and record.status == Status.CANCELLED and first.error is not None and first.error.rank != rank:
        status, error = "stopped", f"stopped after rank {first.error.rank} failed"
    return {"rank": rank, "node": node, "host": record.host, "gpus": list(record.gpu_ids), "status": status, "error": error}
