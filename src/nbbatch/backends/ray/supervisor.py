"""The supervisor: the detached Ray actor that owns an experiment's run tasks, and how their endings are recorded."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from nbbatch.backends.ray.node import OUTPUT_TAIL, execute_on_node
from nbbatch.plan.runs import Run
from nbbatch.store.records import finalize_record, read_record_or_none
from nbbatch.store.runrecord import ErrorKind, RunError, RunRecord, Status
from nbbatch.store.share import Share, open_share

NAMESPACE = "nbbatch"


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

    def sweep(self) -> dict[str, dict[str, Any]]:
        """Finalize tasks that ended, and report every known run: ``{run_id: {"active", "started", "node_id"}}``."""
        self._reap(timeout=0)
        with self._lock:
            return {rid: {"active": not t.done, "started": t.ref is not None, "node_id": t.node_id}
                    for rid, t in self._tasks.items()}

    def cancel(self, run_ids: list[str], grace_s: float) -> list[str]:
        """Cancel runs: unstarted ones now, running ones (their cancel marker is written) after ``grace_s``."""
        import ray

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
                    finalize_record(self.share, Run.from_dict(task.spec["run"]), Status.CANCELLED,
                                    RunError("cancelled", "", reason="cancelled before it started",
                                             kind=ErrorKind.CANCELLED), backend="ray")
                    continue
                record = read_record_or_none(self.share, self.experiment, run_id)
                if record is None or record.status == Status.QUEUED:
                    ray.cancel(task.ref, force=True)
                    task.killed = True
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
                task.ref = _remote_execute().options(**options).remote(spec)

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
                        if not any(not t.done for t in self._tasks.values()) and not self._backlog:
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
        """Finalize ended tasks and kill cancelled ones past their grace; True while any task is in flight."""
        import ray

        with self._lock:
            active = {t.ref: t for t in self._tasks.values() if t.ref is not None and not t.done}
        if not active:
            with self._lock:
                return bool(self._backlog)
        ready, _ = ray.wait(list(active), num_returns=len(active), timeout=timeout, fetch_local=True)
        for ref in ready:
            task = active[ref]
            with self._lock:
                if task.claimed:
                    continue
                task.claimed = True
            self._finalize(task)
        now = time.monotonic()
        with self._lock:
            for task in active.values():
                if not task.done and task.cancel_at is not None and now >= task.cancel_at and not task.killed:
                    ray.cancel(task.ref, force=True)
                    task.killed = True
        return True

    def _finalize(self, task: _Task) -> None:
        """Record a final status for a task that ended without its run recording one."""
        import ray

        run = Run.from_dict(task.spec["run"])
        try:
            result: dict[str, Any] = {}
            error = None
            try:
                result = ray.get(task.ref)
            except ray.exceptions.TaskCancelledError:
                error = RunError("cancelled", "", reason="cancelled (its Ray task was stopped)",
                                 kind=ErrorKind.CANCELLED)
            except Exception as exc:  # noqa: BLE001 - every way a task can die becomes the run's recorded reason
                error = task_error(exc, task.spec["max_retries"])
            else:
                task.node_id = result.get("node_id")
            record = read_record_or_none(self.share, run.experiment, run.run_id)
            if error is None and result.get("exit_code"):
                error = run_one_error(result, record)
            if error is not None and (record is None or not record.final):
                status = Status.CANCELLED if error.kind == ErrorKind.CANCELLED else Status.FAILED
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


def _hint(output: str, no_kernel: bool = False) -> str:
    if "No module named 'nbbatch'" in output or "No module named nbbatch" in output:  # Python's words, not ours
        return " (nbbatch is not installed in the Python that runs Ray on that node: pip install 'nbbatch[ray]' there)"
    if no_kernel:
        return " (build the framework environments on every node: `nbbatch envs create --all` in the node image)"
    return ""
