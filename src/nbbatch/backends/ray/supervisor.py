"""The supervisor: the detached Ray actor that owns an experiment's run tasks, and how their endings are recorded."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from nbbatch.backends.ray.node import OUTPUT_TAIL, execute_on_node
from nbbatch.backends.ray.task import gang_bundles, gang_size
from nbbatch.plan.runs import Run
from nbbatch.store.runfiles import finalize_record, read_record_or_none, requested_outcome
from nbbatch.store.runjson import ErrorKind, RunError, RunRecord, Status
from nbbatch.store.share import Share, open_share

NAMESPACE = "nbbatch"
PEER_END_GRACE_S = 60.0  # a gang's node ended: node 0 has this long to end the run before the gang is stopped
STOPPED_GRACE_S = 30.0  # a stopped gang's node 0 task has this long to end before its run is finalized anyway


def supervisor_name(experiment: str, share: Share | str) -> str:
    """The Ray actor name of the supervisor of ``experiment`` on ``share`` (namespace :data:`NAMESPACE`)."""
    url = share if isinstance(share, str) else share.url
    return f"nbbatch:{experiment}:{hashlib.sha1(url.encode()).hexdigest()[:10]}"


@dataclass
class _Task:
    spec: dict[str, Any]
    ref: Any = None
    cancel_at: float | None = None
    killed: bool = False
    claimed: bool = False  # being finalized
    done: bool = False  # finalized: its record is final
    node_id: str | None = None
    gang: _Gang | None = None  # a distributed run's nodes (``ref`` is node 0's task)
    error: RunError | None = None  # why the supervisor stopped the run (its gang), recorded when it ends


@dataclass
class _Gang:
    """The Ray tasks of a distributed run: one node launcher per bundle of a STRICT_SPREAD placement group."""

    task: _Task
    token: str  # this gang's id (a resubmitted run gets a new gang)
    group: Any  # the placement group
    timeout_s: float
    deadline: float  # when the group must be ready
    refs: list[Any] = field(default_factory=list)  # node i's task
    ended: dict[int, Any] = field(default_factory=dict)  # node rank -> how its task ended
    endpoints: dict[int, str] = field(default_factory=dict)  # node rank -> "ip:port" it published
    where: dict[int, str] = field(default_factory=dict)  # node rank -> its Ray node id
    ready: bool = False
    stop_at: float | None = None  # a node ended before node 0: stop the gang then, with ``stop_error``
    stop_error: RunError | None = None
    stopped_at: float | None = None  # every task was cancelled (and the group removed)
    removed: bool = False

    @property
    def nodes(self) -> int:
        return len(self.refs)

    def name_of(self, node: int) -> str:
        where = self.where.get(node)
        endpoint = self.endpoints.get(node, "").rpartition(":")[0]
        return f"node {node}" + (f" (Ray node {where[:8]}" + (f" at {endpoint}" if endpoint else "") + ")"
                                 if where else "")


class RunSupervisor:
    """The detached Ray actor that owns an experiment's run tasks (one per experiment and share).

    It launches tasks (keeping at most ``max_parallel`` in flight), notices tasks that end, writes a
    final record for those that ended without one, forwards cancellations, and leaves when idle.
    """

    def __init__(self, experiment: str, share_url: str, linger_s: float = 60.0):
        self.experiment, self.share_url, self.linger_s = experiment, share_url, linger_s
        self._share: Share | None = None
        self._lock = threading.RLock()
        self._tasks: dict[str, _Task] = {}
        self._backlog: list[_Task] = []
        self._gangs: dict[str, _Gang] = {}  # token -> gang, until its placement group is removed
        self._max_parallel: int | None = None
        self._closing = False
        self._idle_since = time.monotonic()
        threading.Thread(target=self._loop, name="nbbatch-supervisor", daemon=True).start()

    @property
    def share(self) -> Share:
        if self._share is None:
            self._share = open_share(self.share_url)
        return self._share

    def submit(self, specs: list[dict[str, Any]], max_parallel: int | None = None) -> list[str] | None:
        """Start (or queue) runs; None when this supervisor is leaving (ask a new one)."""
        with self._lock:
            if self._closing:
                return None
            self._max_parallel = max_parallel
            accepted = []
            for spec in specs:
                run_id = spec["run"]["run_id"]
                current = self._tasks.get(run_id)
                if current is not None and not current.done:
                    continue  # already in flight (a forced resubmission): its task carries on
                task = _Task(spec)
                self._tasks[run_id] = task
                self._backlog.append(task)
                accepted.append(run_id)
            self._launch()
            return accepted

    def node_id(self) -> str:
        """The Ray node this supervisor lives on."""
        import ray

        return str(ray.get_runtime_context().get_node_id())

    def publish(self, token: str, node_rank: int, endpoint: str, node_id: str) -> bool:
        """A gang's node says where its rendezvous listens ("ip:port"); False: the gang is gone (stop)."""
        with self._lock:
            gang = self._gangs.get(token)
            if gang is None or gang.stopped_at is not None:
                return False
            gang.endpoints[int(node_rank)], gang.where[int(node_rank)] = endpoint, node_id
            return True

    def endpoints(self, token: str) -> dict[str, Any]:
        """A gang's endpoints once every node published one (``{"endpoints": [...]}``, node 0's first);
        ``{"endpoints": None, "have": [...]}`` while some are missing; ``{"gone": True}``: the gang was stopped."""
        with self._lock:
            gang = self._gangs.get(token)
            if gang is None or gang.stopped_at is not None:
                return {"gone": True, "endpoints": None}
            if len(gang.endpoints) < gang.nodes:
                return {"endpoints": None, "have": sorted(gang.endpoints)}
            return {"endpoints": [gang.endpoints[i] for i in range(gang.nodes)]}

    def sweep(self) -> dict[str, dict[str, Any]]:
        """Finalize tasks that ended, and report every known run: ``{run_id: {"active", "started", "node_id"}}``."""
        self._reap(timeout=0)
        with self._lock:
            return {rid: {"active": not t.done, "started": t.ref is not None, "node_id": t.node_id}
                    for rid, t in self._tasks.items()}

    def cancel(self, run_ids: list[str], grace_s: float) -> list[str]:
        """Cancel runs: unstarted ones now, running ones (their cancel marker is written) after ``grace_s``."""
        cancelled = []
        with self._lock:
            for run_id in run_ids:
                task = self._tasks.get(run_id)
                if task is None or task.done:
                    continue
                cancelled.append(run_id)
                if task.ref is None:  # still in the backlog: never reaches Ray
                    self._backlog.remove(task)
                    task.done = True
                    finalize_record(self.share, Run.from_dict(task.spec["run"]), *requested_outcome(
                        self.share, self.experiment, run_id, "cancelled before it started"), backend="ray")
                    continue
                record = read_record_or_none(self.share, self.experiment, run_id)
                if record is None or record.status == Status.QUEUED:
                    self._kill(task)
                else:
                    task.cancel_at = time.monotonic() + grace_s
        return cancelled

    def _launch(self) -> None:
        with self._lock:
            while self._backlog:
                in_flight = sum(1 for t in self._tasks.values() if t.ref is not None and not t.done)
                if self._max_parallel and in_flight >= self._max_parallel:
                    return
                task = self._backlog.pop(0)
                spec = task.spec
                options: dict[str, Any] = {"num_cpus": spec["num_cpus"], "num_gpus": spec["num_gpus"],
                                           "max_retries": spec["max_retries"], "retry_exceptions": False,
                                           "name": f"nbbatch-run:{spec['run']['run_id']}"}
                if spec.get("resources"):
                    options["resources"] = spec["resources"]
                if spec.get("runtime_env"):
                    options["runtime_env"] = spec["runtime_env"]
                if gang_size(spec):
                    try:
                        self._launch_gang(task, options)
                    except Exception as exc:  # noqa: BLE001 - e.g. Ray refused the placement group: the run fails
                        for gang in [g for g in self._gangs.values() if g.task is task]:
                            self._stop_gang(gang, None)  # its tasks started so far, and its group
                        task.done = True
                        finalize_record(self.share, Run.from_dict(spec["run"]), Status.FAILED,
                                        RunError(type(exc).__name__, str(exc)[:2000], kind=ErrorKind.INFRA,
                                                 reason="Ray could not start the run's nodes as a gang"),
                                        backend="ray")
                else:
                    task.ref = _remote_execute().options(**options).remote(spec)

    def _launch_gang(self, task: _Task, options: dict[str, Any]) -> None:
        """Start a distributed run: a STRICT_SPREAD placement group of one bundle per node (all or nothing),
        and one node launcher task in each bundle, told its node rank and how to meet the others."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        spec, token = task.spec, uuid.uuid4().hex[:12]
        group = ray.util.placement_group(gang_bundles(spec), strategy="STRICT_SPREAD",
                                         name=f"nbbatch-gang:{spec['run']['run_id']}:{token}")
        timeout_s = float(spec.get("gang_timeout_s") or 300.0)
        gang = _Gang(task, token, group, timeout_s, time.monotonic() + timeout_s)
        self._gangs[token] = gang  # from here on its group is removed, whatever happens
        # a gang cannot restart one node alone (the launchers retry the whole gang after a kernel death); each
        # task asks for what its bundle holds (its CPUs, GPUs and extra resources)
        options = {**options, "max_retries": 0}
        for node in range(gang_size(spec)):
            node_spec = {**spec, "gang": {"token": token, "node_rank": node, "nodes": gang_size(spec),
                                          "supervisor": supervisor_name(self.experiment, self.share_url),
                                          "namespace": NAMESPACE, "timeout_s": timeout_s}}
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=node)
            gang.refs.append(_remote_execute().options(
                **{**options, "name": f"nbbatch-run:{spec['run']['run_id']}:node{node}"},
                scheduling_strategy=strategy).remote(node_spec))
        task.gang, task.ref = gang, gang.refs[0]

    def _loop(self) -> None:
        while True:
            try:
                busy = self._reap(timeout=0.5)
                self._launch()
                now = time.monotonic()
                if busy:
                    self._idle_since = now
                elif now - self._idle_since > self.linger_s:
                    with self._lock:
                        if not any(not t.done for t in self._tasks.values()) and not self._backlog \
                                and not self._gangs:
                            self._closing = True
                    if self._closing:
                        self._leave()
                        return
                if not busy:
                    time.sleep(0.5)
            except Exception:  # noqa: BLE001 - the loop must survive a share hiccup
                logging.getLogger(__name__).exception("nbbatch supervisor loop")
                time.sleep(2)

    def _leave(self) -> None:
        import ray

        try:  # a graceful exit: Ray ends the actor after this, with no "worker died" report
            ray.get_runtime_context().current_actor.__ray_terminate__.remote()
        except Exception:  # noqa: BLE001
            os._exit(0)

    def _reap(self, timeout: float) -> bool:
        """Finalize ended tasks, watch gangs, kill cancelled runs past their grace; True while anything is in flight."""
        import ray

        with self._lock:
            active = {t.ref: t for t in self._tasks.values() if t.ref is not None and not t.done}
            peers = {ref: (g, node) for g in self._gangs.values() if g.stopped_at is None
                     for node, ref in enumerate(g.refs) if node and node not in g.ended}
        if not active and not peers:
            with self._lock:
                return bool(self._backlog or self._gangs)
        waiting = [*active, *peers]
        ready, _ = ray.wait(waiting, num_returns=len(waiting), timeout=timeout, fetch_local=True)
        for ref in ready:
            if ref in peers:
                self._peer_ended(*peers[ref])
        for ref in ready:
            task = active.get(ref)
            if task is None:
                continue
            with self._lock:
                if task.claimed:
                    continue
                task.claimed = True
            self._finalize(task)
        self._watch_gangs()
        now = time.monotonic()
        with self._lock:
            for task in active.values():
                if not task.done and task.cancel_at is not None and now >= task.cancel_at and not task.killed:
                    self._kill(task)
        return True

    def _kill(self, task: _Task) -> None:
        """Stop a run's task now (``ray.cancel(force=True)``): every node's, for a gang."""
        import ray

        task.killed = True
        if task.gang is not None:
            self._stop_gang(task.gang, None)
        else:
            ray.cancel(task.ref, force=True)

    # --- gangs --------------------------------------------------------------------------------------

    def _peer_ended(self, gang: _Gang, node: int) -> None:
        """Node ``node`` (not 0) of a gang ended: a lost node stops the gang now; a launcher that ended leaves
        node 0 :data:`PEER_END_GRACE_S` to end the run (it learns of failures through the share)."""
        import ray

        try:
            result = ray.get(gang.refs[node])
        except Exception as exc:  # noqa: BLE001 - a node or worker died, the task was cancelled…
            gang.ended[node] = exc
            if isinstance(exc, ray.exceptions.TaskCancelledError) and gang.task.killed:
                return
            base = task_error(exc, 0)
            error = RunError(base.ename, base.evalue, reason=f"{gang.name_of(node)} of the run's {gang.nodes} "
                             f"stopped: {base.reason}; the other nodes were stopped", kind=ErrorKind.INFRA)
            self._stop_gang(gang, error)
            return
        gang.ended[node] = result
        gang.where.setdefault(node, str(result.get("node_id") or ""))
        if result.get("error"):  # it could not join the gang (rendezvous): no run is coming
            self._stop_gang(gang, _result_error(result, f"{gang.name_of(node)} of the run's {gang.nodes}"))
            return
        what = (f"its `nbbatch run-one` exited with {result['exit_code']}" if result.get("exit_code")
                else "it ended")
        with self._lock:
            if gang.stop_at is None:
                gang.stop_at = time.monotonic() + PEER_END_GRACE_S
                gang.stop_error = RunError(
                    "GangNodeEnded", str(result.get("output", ""))[-OUTPUT_TAIL:],
                    reason=f"{gang.name_of(node)} of the run's {gang.nodes} ended ({what}), but node 0 did not end "
                           f"the run within {PEER_END_GRACE_S:g} s; the gang was stopped", kind=ErrorKind.INFRA)

    def _stop_gang(self, gang: _Gang, error: RunError | None) -> None:
        """Cancel every node's task of a gang (force) and remove its placement group; ``error`` is the run's."""
        import ray

        with self._lock:
            if gang.stopped_at is not None:
                return
            gang.stopped_at = time.monotonic()
            if error is not None and gang.task.error is None and not gang.task.done:
                gang.task.error = error
            gang.task.killed = True
        for node, ref in enumerate(gang.refs):
            if node not in gang.ended:
                with contextlib.suppress(Exception):
                    ray.cancel(ref, force=True)
        self._remove_group(gang)

    def _remove_group(self, gang: _Gang) -> None:
        import ray

        with self._lock:
            if gang.removed:
                return
            gang.removed = True
        try:
            ray.util.remove_placement_group(gang.group)
        except Exception:  # noqa: BLE001 - already gone with its creator, or the GCS hiccuped
            logging.getLogger(__name__).warning("could not remove the placement group of gang %s", gang.token,
                                                exc_info=True)

    def _watch_gangs(self) -> None:
        """Gangs whose group did not come in time, that outlived their node 0, or that ended: stop, finalize, remove."""
        now = time.monotonic()
        with self._lock:
            gangs = list(self._gangs.values())
        for gang in gangs:
            task = gang.task
            if not gang.ready and gang.stopped_at is None:
                with contextlib.suppress(Exception):
                    gang.ready = bool(gang.group.wait(timeout_seconds=0))
                if not gang.ready and now >= gang.deadline:
                    self._stop_gang(gang, self._gang_timeout_error(gang))
            if gang.stop_at is not None and now >= gang.stop_at and not task.done:
                self._stop_gang(gang, gang.stop_error)
            if task.done and gang.stopped_at is None and len(gang.ended) < gang.nodes - 1:
                with self._lock:  # node 0 ended the run: the others follow within the grace, or are stopped
                    gang.stop_at = min(gang.stop_at or float("inf"), now + PEER_END_GRACE_S)
                if now >= gang.stop_at:
                    self._stop_gang(gang, None)
            if gang.stopped_at is not None and not task.done and now - gang.stopped_at > STOPPED_GRACE_S:
                with self._lock:  # its node 0 task never reported its end: record the gang's
                    claimed, task.claimed = task.claimed, True
                if not claimed:
                    self._finalize(task, ended=False)
            if task.done and (gang.stopped_at is not None or len(gang.ended) >= gang.nodes - 1):
                self._remove_group(gang)
                with self._lock:
                    self._gangs.pop(gang.token, None)

    def _gang_timeout_error(self, gang: _Gang) -> RunError:
        import ray

        spec = gang.task.spec
        gpus, cpus = float(spec["num_gpus"]), float(spec["num_cpus"])
        alive = [n for n in ray.nodes() if n.get("Alive")]
        fit = [n for n in alive if all((n.get("Resources") or {}).get(k, 0) >= v for k, v in gang_bundles(spec)[0].items())]
        return RunError(
            "GangTimeout", f"placement group {gang.group.id.hex()[:12]}: {gang.nodes} bundles "
                           f"{gang_bundles(spec)[0]} not reserved",
            reason=f"the Ray cluster could not give {gang.nodes} nodes with {gpus:g} GPU(s) and {cpus:g} CPU(s) each at "
                   f"once (STRICT_SPREAD) within {gang.timeout_s:g} s; it has {len(alive)} alive node(s), {len(fit)} of "
                   "them that large (other runs may hold them). Lower resources.nodes or gpus_per_node, add nodes, or "
                   "raise the ray backend's gang_timeout_s", kind=ErrorKind.INFRA)

    def _finalize(self, task: _Task, ended: bool = True) -> None:
        """Record a final status for a task that ended without its run recording one."""
        import ray

        run = Run.from_dict(task.spec["run"])
        try:
            result: dict[str, Any] = {}
            error = None
            try:
                if not ended:  # its task never said how it ended
                    error = RunError("cancelled", "", reason="cancelled (its Ray task was stopped)",
                                     kind=ErrorKind.CANCELLED)
                else:
                    result = ray.get(task.ref)
            except ray.exceptions.TaskCancelledError:
                error = RunError("cancelled", "", reason="cancelled (its Ray task was stopped)",
                                 kind=ErrorKind.CANCELLED)
            except Exception as exc:  # noqa: BLE001 - every way a task can die becomes the run's recorded reason
                error = task_error(exc, task.spec["max_retries"] if task.gang is None else 0)
                if task.gang is not None:
                    error.reason = f"{task.gang.name_of(0)} of the run's {task.gang.nodes}: {error.reason}"
            else:
                task.node_id = result.get("node_id")
            record = read_record_or_none(self.share, run.experiment, run.run_id)
            if error is None and result.get("error"):
                error = _result_error(result, "node 0" if task.gang is not None else "the run's task")
            if task.gang is not None and error is not None:  # node 0 is gone: the other nodes cannot go on
                self._stop_gang(task.gang, None)
            elif error is None and result.get("exit_code"):
                error = run_one_error(result, record)
            if task.error is not None and (error is not None or record is None or not record.final):
                error = task.error  # the supervisor stopped the run's gang, and this is why
            if error is not None and (record is None or not record.final):
                status = Status.FAILED
                if error.kind == ErrorKind.CANCELLED:  # stopped on request: as the marker asked (pruned, cancelled)
                    status, error = requested_outcome(self.share, run.experiment, run.run_id, error.reason or "")
                finalize_record(self.share, run, status, error, backend="ray")
        finally:
            with self._lock:
                task.done = True


_REMOTE_EXECUTE: Any = None


def _remote_execute() -> Any:
    global _REMOTE_EXECUTE
    if _REMOTE_EXECUTE is None:
        import ray

        _REMOTE_EXECUTE = ray.remote(execute_on_node)
    return _REMOTE_EXECUTE


# --- why a task ended badly -------------------------------------------------------------------------


def run_one_error(result: dict[str, Any], record: RunRecord | None) -> RunError:
    """The error of a task whose ``nbbatch run-one`` exited non-zero without a final record."""
    output = result.get("output", "").strip()
    no_kernel = record is not None and record.error is not None and record.error.kind == ErrorKind.NO_KERNEL
    return RunError("RunOneFailed", output[-OUTPUT_TAIL:],
                    reason=f"`nbbatch run-one` exited with {result['exit_code']} on Ray node "
                           f"{str(result.get('node_id'))[:8]}" + _hint(output, no_kernel),
                    kind=ErrorKind.NO_KERNEL if no_kernel else ErrorKind.INFRA)


def task_error(exc: BaseException, max_retries: int) -> RunError:
    """The error of a task that Ray reports as failed (node or worker death, OOM kill, runtime_env…)."""
    kind = type(exc).__name__
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    retried = f"after {max_retries} Ray retr{'y' if max_retries == 1 else 'ies'}" if max_retries else "with no Ray retry"
    if kind in ("WorkerCrashedError", "NodeDiedError", "ActorDiedError", "LocalRayletDiedError") \
            or "node" in first.lower() and "dead" in first.lower():
        reason = f"the Ray node or worker running it died; gave up {retried}"
    elif kind == "OutOfMemoryError":
        reason = f"Ray's memory monitor killed it; gave up {retried}"
    elif "RuntimeEnv" in kind:
        reason = "Ray could not set up the runtime_env for the run"
    else:
        reason = "its Ray task failed" + _hint(str(exc))
    return RunError(kind, first[:2000], reason=reason, kind=ErrorKind.INFRA)


def _result_error(result: dict[str, Any], who: str) -> RunError:
    """The error of a node task that ended before ``run-one`` (it could not join its gang)."""
    error = result["error"]
    return RunError(str(error.get("ename") or "GangRendezvous"), str(result.get("output", ""))[-OUTPUT_TAIL:],
                    reason=f"{who}: {error.get('reason') or 'it could not join the gang'}", kind=ErrorKind.INFRA)


def _hint(output: str, no_kernel: bool = False) -> str:
    if "No module named 'nbbatch'" in output or "No module named nbbatch" in output:  # Python's words, not ours
        return " (nbbatch is not installed in the Python that runs Ray on that node: pip install 'nbbatch[ray]' there)"
    if no_kernel:
        return " (build the framework environments on every node: `nbbatch envs create --all` in the node image)"
    return ""
