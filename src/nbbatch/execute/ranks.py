"""Distributed runs: one kernel per rank, started by nbbatch itself on every node, the same on every backend.

A backend starts one *node launcher* per node (:func:`nbbatch.execute.attempts.execute_run` of a distributed run:
the local backend in a thread, Ray in a task of a placement group, Azure ML as the job's command on each
instance). It starts the node's ranks (:func:`execute_gang`), each an ordinary attempt
(:func:`nbbatch.execute.attempt.run_attempt`) of the same notebook with the torchrun environment
(:func:`nbbatch.execute.placement.rank_env`). Rank 0's files are the run's own; rank ``r``'s are in
``ranks/<r>/``. When a rank fails, every rank is stopped: on its node at once, on the other nodes through
a marker in the share (``ranks/stop-<n>.json``) that every launcher watches. Node 0 then writes the
run's record, naming the first rank that failed, and says whether the whole gang runs again
(:func:`~nbbatch.execute.attempt.retry_after`, the single runs' policy) in ``ranks/decision-<n>.json``,
which the other nodes wait for.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from dataclasses import dataclass, replace

from nbbatch.errors import NbbatchError, ShareError
from nbbatch.execute.attempt import cancel_came, failed_before_start, note_lost_attempt, retry_after, run_attempt
from nbbatch.execute.context import AttemptContext
from nbbatch.execute.folders import RunFolders
from nbbatch.execute.placement import NodePlacement, Rank, ranks_of
from nbbatch.plan.runs import Run
from nbbatch.store.layout import LOG_FILE, OUTPUT_NOTEBOOK, run_paths
from nbbatch.store.runfiles import new_record, read_record, stop_gang, write_record
from nbbatch.store.runjson import ErrorKind, RankOutcome, RunError, RunRecord, Status, utc_now
from nbbatch.store.share import Share, poll_interval

PEER_WAIT_S = 300.0  # how long node 0 waits for a silent node's ranks before it calls them lost
PORT_RETRIES = 3  # new rendezvous ports after "address already in use" (local: another process took the port)
_PORT_TAKEN = re.compile(r"address already in use|EADDRINUSE|errno 98", re.IGNORECASE)
# The errors a rank sees when another rank went away: the other rank's error is the cause.
_PEER_LOST = re.compile(r"connection (closed|reset) by peer|connection refused|broken pipe|DistBackendError|"
                        r"NCCL (error|communicator)|ncclRemoteError|third_party/gloo|ProcessGroup(Gloo|NCCL)|"
                        r"coordination service|heartbeat timeout|barrier timed out", re.IGNORECASE)


@dataclass
class _Ended:
    rank: int
    record: RunRecord
    at: float


def execute_gang(run: Run, share: Share, placement: NodePlacement, context: AttemptContext) -> RunRecord:
    """Run the ranks of the distributed ``run`` that the launcher at ``placement`` starts, until the gang ends;
    run the gang again after a kernel death (as a single run's attempt).

    Returns the run's final record on node 0, the record of this node's first rank elsewhere (its status is
    the run's). ``context.new_endpoints`` gives fresh rendezvous ports when one was taken (the local backend's).
    A gang's GPUs are its own: the context's kernel pool and GPU sharing do not apply to it.
    """
    return _Node(run, share, placement, context).execute()


class _Node:
    def __init__(self, run: Run, share: Share, placement: NodePlacement, context: AttemptContext):
        self.run, self.share, self.placement, self.context = run, share, placement, context
        self.notify = context.notify
        self.paths = run_paths(run.experiment, run.run_id)
        self.records: dict[int, RunRecord] = {}
        self.poll = poll_interval(share, local=0.25, remote=2.0)

    @property
    def coordinator(self) -> bool:
        """Node 0's launcher (with rank 0): it writes the run's record and decides whether the gang runs again."""
        return self.placement.node_rank == 0 and (self.placement.local_ranks is None or 0 in self.placement.local_ranks)

    def record_of(self, rank: Rank) -> RunRecord:
        if rank.rank not in self.records:
            backend = self.context.backend
            if rank.rank == 0:
                record = read_record(self.share, self.run.experiment, self.run.run_id) or new_record(self.run, backend)
                note_lost_attempt(record)
                record.world_size, record.ranks = self.run.world_size, []
            else:
                record = replace(new_record(self.run, backend), rank=rank.rank, world_size=self.run.world_size)
            record.container = self.context.container  # the node's launcher runs in this image (container: true)
            self.records[rank.rank] = record
        return self.records[rank.rank]

    def execute(self) -> RunRecord:
        ranks = ranks_of(self.run, self.placement, self.context.gpu_ids)
        try:
            folders = RunFolders(self.run, self.share, input_paths=self.context.input_paths,
                                 project_root=self.context.project_root)
        except NbbatchError as exc:  # e.g. an input missing on this node: its ranks fail, the other nodes stop
            return self._failed_before_start(ranks, exc)
        if self.coordinator:  # the run's own record (rank 0's) says what it continues
            own = self.record_of(next(rank for rank in ranks if rank.rank == 0))
            own.continues = own.continues or folders.continues  # also when another node copied them first
        try:
            return self._gangs(ranks, folders)
        finally:
            folders.close()

    def _failed_before_start(self, ranks: list[Rank], exc: NbbatchError) -> RunRecord:
        for rank in ranks[1:]:
            record = self.record_of(rank)
            record.attempts += 1  # what node 0 waits for: this attempt of the gang ended
            failed_before_start(self.share, record, exc, None)
        own = self.record_of(ranks[0])
        if own.rank is not None:  # the run's own record (rank 0's) counts the run's attempts as ever
            own.attempts += 1
        stop_gang(self.share, self.run, 1, {"rank": ranks[0].rank, "error": f"{exc} (node {self.placement.node_rank})"},
                  decide=self.coordinator)
        return failed_before_start(self.share, own, exc, self.notify if self.coordinator else None)

    def _gangs(self, ranks: list[Rank], folders: RunFolders) -> RunRecord:
        """Attempts of the gang until one is not run again: after a kernel death (retries left) or a taken port."""
        attempts_left, port_retries, gang = self.run.retries + 1, PORT_RETRIES, 0
        while True:
            gang += 1
            ended = self._gang(gang, ranks, folders)
            first = self._first_failure(gang, ended)
            port_taken = first is not None and self.context.new_endpoints is not None and port_retries > 0 and \
                bool(_PORT_TAKEN.search(first.error.evalue if first.error else ""))
            retry = port_taken or retry_after(first, attempts_left - 1, self._cancelled)
            if not self._decide(gang, retry):
                return self._finish(ranks, ended, first)
            if port_taken:
                port_retries -= 1
                assert self.context.new_endpoints is not None
                self.placement = replace(self.placement, endpoints=self.context.new_endpoints())
                ranks = ranks_of(self.run, self.placement, self.context.gpu_ids)
            else:
                attempts_left -= 1

    def _cancelled(self) -> bool:
        return cancel_came(self.run, self.share, self.context.cancel_event)

    def _rank_context(self, rank: Rank, stop: threading.Event) -> AttemptContext:
        """What a rank's attempt gets: the node's GPUs and the gang's stop event; only rank 0 reports its progress."""
        return replace(self.context, shared_gpu=False, gpu_env=None, kernels=None, cancel_event=stop,
                       on_update=self.context.on_update if rank.rank == 0 else None)

    def _gang(self, gang: int, ranks: list[Rank], folders: RunFolders) -> dict[int, _Ended]:
        """One attempt of every rank of this node; the first that fails stops the others (here and on other nodes)."""
        stop = threading.Event()
        ended: dict[int, _Ended] = {}
        lock = threading.Lock()
        marker = self.paths.gang_stop(gang)

        def run_rank(rank: Rank) -> None:
            record = self.record_of(rank)
            try:
                record = run_attempt(self.run, self.share, record, self._rank_context(rank, stop), folders, rank)
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
                                                               "error": record.error_summary()
                                                               }).encode())

        threads = [threading.Thread(target=run_rank, args=(r,), name=f"rank-{self.run.run_id}-{r.rank}", daemon=True)
                   for r in ranks]
        for thread in threads:
            thread.start()
        while any(t.is_alive() for t in threads):
            cancel = self.context.cancel_event
            if not stop.is_set() and (cancel is not None and cancel.is_set() or self._exists(marker)):
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
        asked = any(e.record.status in (Status.CANCELLED, Status.PRUNED) for e in ended.values())
        chosen = (cause or ([] if asked else failed) or [None])[0]  # stopped on request: lost peers are no cause
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
                    record = replace(new_record(self.run, self.context.backend), rank=rank, status=Status.FAILED,
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
        assert self.run.distribution is not None
        if self.run.distribution.nodes == 1 and self.placement.local_ranks is None:
            return retry
        path = self.paths.gang_decision(gang)
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
        assert self.run.distribution is not None
        per_node = self.run.distribution.processes_per_node
        record.ranks = [_rank_entry(e.rank, e.rank // per_node, e.record, first)
                        for e in sorted(ended.values(), key=lambda e: e.rank)]
        if first is not None:
            record.status, record.error = first.status, first.error
        else:  # a rank stopped on request: the run ends as asked (pruned before cancelled), with that rank's error
            stopped = [e.record for e in ended.values() if e.record.status in (Status.PRUNED, Status.CANCELLED)]
            stopped.sort(key=lambda r: r.status != Status.PRUNED)
            if stopped:
                record.status, record.error = stopped[0].status, record.error or stopped[0].error
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


def _rank_entry(rank: int, node: int, record: RunRecord, first: RunRecord | None) -> RankOutcome:
    """What run.json says about one rank."""
    status = str(record.status)
    error = record.error_summary() or None
    if first is not None and record.status == Status.CANCELLED and first.error is not None and first.error.rank != rank:
        status, error = "stopped", f"stopped after rank {first.error.rank} failed"
    return RankOutcome(rank=rank, node=node, host=record.host, gpus=list(record.gpu_ids), status=status, error=error)
