"""The Ray backend: each run is a Ray task that executes ``nbbatch run-one`` on whichever node Ray picks.

A run asks Ray for ``num_gpus`` = its GPUs (``1/runs_per_gpu`` when several runs share one GPU) and
``num_cpus`` (setting, default 1). On the node, the task starts ``python -m nbbatch run-one`` as a
subprocess with ``CUDA_VISIBLE_DEVICES`` set from :func:`ray.get_gpu_ids` (empty for CPU runs); the
notebook runs in that node's framework kernel, found through the project's Jupyter path, so the
framework environments need no Ray. Outputs go to the share, which every node must see.

The tasks are owned by one small detached actor per experiment and share (the *supervisor*), so
they outlive the submitting process (``submit --no-wait``, a closed notebook), and ``status`` and
``cancel`` from another process can reach them. The supervisor records a final status for any task
that ended without one (node lost, task cancelled before it started, ``nbbatch`` missing on a node)
and leaves by itself once it has been idle for ``linger_s``.

Settings (the experiment's ``backend:`` mapping)::

    backend:
      name: ray
      address: auto            # or host:6379, or ray://head:10001
      num_cpus: 1              # CPUs each run asks for
      max_retries: null        # Ray retries after a node/worker death (default: the experiment's retries + 1)
      shared_folder: false     # true: a folder share is mounted at the same path on every node
      project: null            # the project's path on the nodes (default: the submitting project's path)
      resources: {}            # extra Ray resources each run asks for, e.g. {"accelerator_type:A100": 0.01}
      env: {}                  # environment variables for run-one (and so the kernel) on the nodes
      runtime_env: null        # a Ray runtime_env for the run tasks
      autoscaling: false       # true: do not refuse runs that no current node can hold
      cancel_grace_s: 15       # how long a cancelled run may take to stop itself before its task is killed
      linger_s: 60             # how long an idle supervisor waits for more runs before it leaves

``import nbbatch`` never imports Ray: this module imports it only when a method needs the cluster.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

from nbbatch.backends.base import Compute, SubmitOptions
from nbbatch.errors import BackendError, ValidationError
from nbbatch.plan.runs import Run
from nbbatch.store.layout import CANCEL_MARKER
from nbbatch.store.records import new_record, read_record, write_cancel_markers, write_record
from nbbatch.store.runrecord import RunError, RunRecord, utc_now
from nbbatch.store.share import Share, open_share

NAMESPACE = "nbbatch"
NODE_ID_ENV = "NBBATCH_RAY_NODE_ID"  # set for the run (and its kernel): the Ray node it executes on
FRESH_S = 60.0  # a non-final record younger than this may still be on its way to a supervisor: leave it
NETWORK_FILESYSTEMS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "glusterfs",
                       "fuse.blobfuse", "fuse.blobfuse2", "fuse.gcsfuse", "fuse.s3fs", "fuse.cephfs",
                       "fuse.glusterfs", "fuse.juicefs", "fuse.sshfs", "fuse.lustre", "azurefile")
_OUTPUT_TAIL = 3000


def supervisor_name(experiment: str, share: Share | str) -> str:
    """The Ray actor name of the supervisor of ``experiment`` on ``share`` (namespace :data:`NAMESPACE`)."""
    url = share if isinstance(share, str) else share.url
    return f"nbbatch:{experiment}:{hashlib.sha1(url.encode()).hexdigest()[:10]}"


def gpu_request(gpus: int, runs_per_gpu: int) -> tuple[float, bool]:
    """Ray's ``num_gpus`` for a run asking ``gpus`` GPUs, and whether it shares its GPU with other runs.

    One-GPU runs with ``runs_per_gpu`` > 1 ask for ``1/runs_per_gpu`` (rounded down to Ray's 1e-4
    granularity, so ``runs_per_gpu`` of them fit on one GPU); anything else asks for whole GPUs.
    """
    if gpus == 1 and runs_per_gpu > 1:
        return math.floor(10_000 / runs_per_gpu) / 10_000, True
    return float(gpus), False


@dataclass
class RayTaskSpec:
    """Everything the supervisor needs to start one run's Ray task (plain data: it travels to the cluster)."""

    run: dict[str, Any]
    share: str
    project: str | None
    num_gpus: float
    num_cpus: float
    shared_gpu: bool
    max_retries: int
    resources: dict[str, float] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    runtime_env: dict[str, Any] | None = None
    notebook_source: str | None = None  # the notebook, for nodes that do not have it at its path

    @property
    def run_id(self) -> str:
        return str(self.run["run_id"])

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class RayBackend:
    """Execute runs as Ray tasks on a Ray cluster (``backend: {name: ray, address: ...}``)."""

    name: ClassVar[str] = "ray"
    uses_local_kernels: ClassVar[bool] = False  # kernels live on the cluster's nodes, not here

    def __init__(self, address: str = "auto", num_cpus: float = 1, max_retries: int | None = None,
                 shared_folder: bool = False, project: str | None = None, resources: dict[str, float] | None = None,
                 env: dict[str, str] | None = None, runtime_env: dict[str, Any] | None = None,
                 autoscaling: bool = False, cancel_grace_s: float = 15.0, linger_s: float = 60.0,
                 poll_s: float | None = None, **unknown: Any):
        if unknown:
            from nbbatch.errors import did_you_mean

            key = sorted(unknown)[0]
            raise BackendError(f"unknown ray backend setting `{key}`{did_you_mean(key, _SETTINGS)}; "
                               f"known: {', '.join(_SETTINGS)}")
        if isinstance(num_cpus, bool) or not isinstance(num_cpus, (int, float)) or num_cpus < 0:
            raise BackendError(f"ray backend: `num_cpus` must be a number ≥ 0 (got {num_cpus!r})")
        if max_retries is not None and (isinstance(max_retries, bool) or not isinstance(max_retries, int)
                                        or max_retries < 0):
            raise BackendError(f"ray backend: `max_retries` must be an integer ≥ 0 (got {max_retries!r})")
        self.address = str(address or "auto")
        self.num_cpus = num_cpus
        self.max_retries = max_retries
        self.shared_folder = bool(shared_folder)
        self.project = project
        self.resources = dict(resources or {})
        self.env = {str(k): str(v) for k, v in (env or {}).items()}
        self.runtime_env = runtime_env
        self.autoscaling = bool(autoscaling)
        self.cancel_grace_s = float(cancel_grace_s)
        self.linger_s = float(linger_s)
        self.poll_s = poll_s

    # --- the cluster ------------------------------------------------------------------------------

    def connect(self) -> Any:
        """Connect this process to the cluster (once) and return the ``ray`` module."""
        try:
            import ray
        except ImportError as exc:  # pragma: no cover - the registry reports the missing extra first
            raise BackendError(f"the `ray` backend needs its extra: pip install 'nbbatch[ray]' ({exc})") from exc
        if not ray.is_initialized():
            try:
                ray.init(address=self.address, log_to_driver=False, logging_level=logging.WARNING)
            except Exception as exc:  # noqa: BLE001 - ConnectionError, RuntimeError, ValueError… all mean the same
                raise BackendError(
                    f"cannot connect to the Ray cluster at `{self.address}`: {exc}. Start one (`ray start --head`) "
                    "or set the experiment's `backend: {name: ray, address: HOST:6379}` (or ray://HOST:10001)"
                ) from exc
        return ray

    def nodes(self) -> list[dict[str, Any]]:
        """The cluster's nodes as Ray reports them (alive and dead)."""
        return list(self.connect().nodes())

    def _alive_nodes(self) -> list[dict[str, Any]]:
        return [n for n in self.nodes() if n.get("Alive")]

    def compute(self) -> Compute:
        """The cluster's nodes, their CPUs/GPUs, and how many runs can execute at once."""
        ray = self.connect()
        nodes = self.nodes()
        hostnames = [n.get("NodeManagerHostname") or n.get("NodeManagerAddress") for n in nodes]
        out_nodes, gpus = [], []
        for node, hostname in zip(nodes, hostnames, strict=True):
            resources = node.get("Resources") or {}
            node_id = node.get("NodeID", "")
            name = hostname if hostnames.count(hostname) == 1 else f"{hostname} ({node_id[:8]})"
            n_gpus = resources.get("GPU", 0)
            accelerator = next((k.split(":", 1)[1] for k in resources if k.startswith("accelerator_type:")), None)
            out_nodes.append({
                "name": name, "state": "alive" if node.get("Alive") else "dead", "cpus": resources.get("CPU", 0),
                "gpus": n_gpus, "node_id": node_id, "address": node.get("NodeManagerAddress"),
                "head": "node:__internal_head__" in resources, "memory_gb": round(resources.get("memory", 0) / 2**30, 1),
                "accelerator": accelerator,
            })
            if node.get("Alive"):
                gpus.extend({"index": i, "name": accelerator or "GPU", "memory_mb": None, "node": name}
                            for i in range(int(n_gpus)))
        alive = [n for n in out_nodes if n["state"] == "alive"]
        cpus = sum(n["cpus"] for n in alive)
        slots = int(cpus // self.num_cpus) if self.num_cpus else max(len(gpus), 1)
        details: dict[str, Any] = {"address": self.address, "ray_version": ray.__version__}
        with contextlib.suppress(Exception):
            details["available"] = dict(ray.available_resources())
            details["total"] = dict(ray.cluster_resources())
        return Compute(backend=self.name, gpus=gpus, nodes=out_nodes, slots=max(slots, 1), details=details)

    def check(self, runs: Sequence[Run]) -> None:
        """Refuse runs that no node of the cluster can hold (unless ``autoscaling``), before anything starts."""
        if not runs or self.autoscaling:
            return
        alive = self._alive_nodes()
        need_gpus = max(r.gpus for r in runs)

        def fits(node: dict[str, Any]) -> bool:
            res = node.get("Resources") or {}
            return (res.get("GPU", 0) >= need_gpus and res.get("CPU", 0) >= self.num_cpus
                    and all(res.get(k, 0) >= v for k, v in self.resources.items()))

        if not any(fits(n) for n in alive):
            largest = max((n.get("Resources", {}).get("GPU", 0) for n in alive), default=0)
            extra = f" and {self.resources}" if self.resources else ""
            raise ValidationError(
                f"runs ask for {need_gpus} GPU(s) and {self.num_cpus:g} CPU(s){extra} each, but no node of the Ray "
                f"cluster at `{self.address}` has that (largest: {largest:g} GPU(s), {len(alive)} node(s) alive); "
                "lower resources.gpus, or set `autoscaling: true` in the backend settings when the cluster adds "
                "nodes on demand")

    def check_share(self, share: Share) -> None:
        """Raise :class:`BackendError` when ``share`` is a folder that only this machine sees.

        A folder share is accepted when every alive node runs on this machine, when the folder is on a
        network file system (NFS, SMB/CIFS, blobfuse…), or with the setting ``shared_folder: true``.
        """
        if self.shared_folder:
            return
        local = share.local_path("")
        if local is None:  # azfiles:// and other remote shares are reachable from every node
            return
        fs_type = filesystem_type(local)
        if fs_type and fs_type.startswith(NETWORK_FILESYSTEMS):
            return
        alive = self._alive_nodes()
        addresses = sorted({str(n.get("NodeManagerAddress")) for n in alive})
        if len(alive) <= 1 and (not addresses or set(addresses) <= self._local_addresses()):
            return
        if set(addresses) <= self._local_addresses():
            return
        raise BackendError(
            f"the share {share.url} is a folder on this machine ({fs_type or 'local file system'}), but the Ray "
            f"cluster at `{self.address}` has {len(alive)} node(s) on {', '.join(addresses)}, which cannot see it. "
            "Use a share every node can reach: an `azfiles://ACCOUNT/SHARE` share, or a folder mounted at the same "
            "path on every node (NFS, Azure Files…) and set `shared_folder: true` in the experiment's "
            "`backend:` settings. Nothing was started.")

    def _local_addresses(self) -> set[str]:
        addresses = {"127.0.0.1", "::1", "localhost"}
        with contextlib.suppress(OSError):
            addresses.add(socket.gethostbyname(socket.gethostname()))
        with contextlib.suppress(Exception):
            import ray

            if ray.is_initialized() and not _client_mode(ray):
                addresses.add(ray.util.get_node_ip_address())
        return addresses

    # --- the supervisor ---------------------------------------------------------------------------

    def _supervisor(self, experiment: str, share: Share, create: bool = False) -> Any:
        """The experiment's supervisor actor handle, or None when there is none (and ``create`` is False)."""
        ray = self.connect()
        name = supervisor_name(experiment, share)
        if not create:
            try:
                return ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                return None
        options: dict[str, Any] = {"name": name, "namespace": NAMESPACE, "lifetime": "detached", "get_if_exists": True,
                                   "num_cpus": 0, "max_concurrency": 16, "max_restarts": 0}
        head = next((n["NodeID"] for n in self._alive_nodes() if "node:__internal_head__" in n.get("Resources", {})),
                    None)
        if head:  # on the head: worker nodes come and go (and take their actors along); soft affinity is ignored
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # for zero-CPU actors

            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(head, soft=False)
        env_vars = {**self.env, **dict((self.runtime_env or {}).get("env_vars") or {})}
        if env_vars:  # e.g. the share's credentials: the supervisor writes run records too
            options["runtime_env"] = {"env_vars": env_vars}
        return ray.remote(RunSupervisor).options(**options).remote(experiment, share.url, self.linger_s)

    def task_spec(self, run: Run, share: Share, options: SubmitOptions, project: str | None) -> RayTaskSpec:
        """How one run asks Ray for resources and what its task executes."""
        num_gpus, shared = gpu_request(run.gpus, options.runs_per_gpu)
        max_retries = self.max_retries if self.max_retries is not None else run.retries + 1
        source = None
        with contextlib.suppress(OSError):
            source = Path(run.notebook).read_text(encoding="utf-8")
        return RayTaskSpec(run=run.to_dict(), share=share.url, project=project, num_gpus=num_gpus,
                           num_cpus=self.num_cpus, shared_gpu=shared, max_retries=max_retries,
                           resources=dict(self.resources), env=dict(self.env), runtime_env=self.runtime_env,
                           notebook_source=source)

    # --- the Backend protocol ---------------------------------------------------------------------

    def submit(self, runs: Sequence[Run], share: Share, options: SubmitOptions) -> None:
        """Start every run as a Ray task; with ``options.wait``, return when every run is final."""
        if not runs:
            return
        ray = self.connect()
        experiment = runs[0].experiment
        try:
            self.check_share(share)
        except BackendError as exc:
            for run in runs:  # the queued records written for this submission: say why nothing ran
                _finish(share, run, "cancelled", RunError("NotStarted", str(exc), reason="the share is not shared"))
            raise
        self.check(runs)
        project = self.project or _project_root(runs[0])
        specs = [self.task_spec(run, share, options, project).to_dict() for run in runs]
        for run in runs:  # an explicit (re)submission overrides a cancel left over from before
            share.remove(f"{experiment}/{run.run_id}/{CANCEL_MARKER}")
        deadline = time.monotonic() + 60
        while True:  # a supervisor that is just leaving refuses: start a new one
            supervisor = self._supervisor(experiment, share, create=True)
            try:
                accepted = ray.get(supervisor.submit.remote(specs, options.max_parallel), timeout=60)
            except ray.exceptions.RayActorError:
                accepted = None
            if accepted is not None:
                break
            if time.monotonic() > deadline:
                raise BackendError(f"the Ray supervisor of `{experiment}` did not accept the runs within 60 s")
            time.sleep(0.5)
        if options.wait:
            self._wait(runs, share, supervisor, options)

    def _wait(self, runs: Sequence[Run], share: Share, supervisor: Any, options: SubmitOptions) -> None:
        notify = options.on_update or (lambda _r: None)
        poll = self.poll_s or (0.5 if share.local_path("") is not None else 2.0)
        seen: dict[str, tuple[Any, ...]] = {}
        pending = {r.run_id for r in runs}
        experiment = runs[0].experiment
        last_check = time.monotonic()
        try:
            while pending:
                for run_id in sorted(pending):
                    record = read_record(share, experiment, run_id)
                    if record is None:
                        continue
                    key = (record.status, record.attempts, record.cells_done, record.ended_at)
                    if seen.get(run_id) != key:
                        seen[run_id] = key
                        notify(record)
                    if record.final:
                        pending.discard(run_id)
                if pending and time.monotonic() - last_check > 10:
                    last_check = time.monotonic()
                    if self._sweep(supervisor) is None:  # the supervisor is gone: nothing will finish these runs
                        self.refresh(experiment, share, fresh_s=0)
                        continue
                if pending:
                    time.sleep(poll)
        except KeyboardInterrupt:
            self.cancel(experiment, share, sorted(pending))
            end = time.monotonic() + self.cancel_grace_s + 30
            while pending and time.monotonic() < end:
                pending = {i for i in pending if not ((r := read_record(share, experiment, i)) and r.final)}
                time.sleep(poll)
            raise

    def _sweep(self, supervisor: Any) -> dict[str, Any] | None:
        ray = self.connect()
        try:
            return dict(ray.get(supervisor.sweep.remote(), timeout=60))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return None

    def refresh(self, experiment: str, share: Share, fresh_s: float = FRESH_S) -> None:
        """Check the share is visible from the cluster, then finalize runs whose Ray task ended without a record.

        Raises :class:`BackendError` (before a submission writes anything) when the share is a folder the
        cluster's nodes cannot see. A ``queued``/``running`` run whose task is gone (its supervisor left
        or the cluster restarted) is marked ``failed`` with the reason; records younger than ``fresh_s``
        seconds are left alone (a submission may be handing them to Ray).
        """
        self.check_share(share)
        open_runs = []
        for run_id in share.list(experiment):
            with contextlib.suppress(Exception):
                record = read_record(share, experiment, run_id)
                if record is not None and not record.final and record.backend == self.name:
                    open_runs.append(record)
        if not open_runs:
            return
        supervisor = self._supervisor(experiment, share)
        states = self._sweep(supervisor) if supervisor is not None else None
        for record in open_runs:
            if states is not None and states.get(record.run_id, {}).get("active"):
                continue
            current = read_record(share, experiment, record.run_id)  # the sweep may have finalized it
            if current is None or current.final or _age_s(current) < fresh_s:
                continue
            why = ("its Ray supervisor does not know it" if states is not None else
                   f"no nbbatch supervisor for `{experiment}` is left on the Ray cluster at `{self.address}`")
            current.status, current.ended_at = "failed", utc_now()
            current.error = RunError("RayTaskLost", f"{why} (the cluster restarted, or its task was lost)",
                                     reason="its Ray task is gone; resubmit to rerun")
            write_record(share, current)

    def cancel(self, experiment: str, share: Share, run_ids: Sequence[str] | None = None) -> list[str]:
        """Write CANCEL markers (the run's kernel is stopped and its partial output kept), then cancel Ray tasks.

        Queued runs' tasks are cancelled at once; a running run gets ``cancel_grace_s`` seconds to stop
        itself before its task is killed (``ray.cancel(force=True)``).
        """
        asked = write_cancel_markers(share, experiment, run_ids)
        if asked:
            try:
                supervisor = self._supervisor(experiment, share)
                if supervisor is not None:
                    ray = self.connect()
                    ray.get(supervisor.cancel.remote(asked, self.cancel_grace_s), timeout=60)
            except Exception:  # noqa: BLE001 - the markers alone stop running runs and unstarted tasks
                pass
        return asked

    def stream_log(self, experiment: str, share: Share, run_id: str, follow: bool = False) -> Iterator[str] | None:
        """Logs are read from the share's ``log.txt``, which every node writes to."""
        return None


_SETTINGS = ("address", "num_cpus", "max_retries", "shared_folder", "project", "resources", "env", "runtime_env",
             "autoscaling", "cancel_grace_s", "linger_s", "poll_s")


# --- what runs on the cluster ---------------------------------------------------------------------


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
        """Finalize tasks that ended, and report every known run: ``{run_id: {"active", "node_id"}}``."""
        self._reap(timeout=0)
        with self._lock:
            return {rid: {"active": not t.done, "started": t.ref is not None, "node_id": t.node_id}
                    for rid, t in self._tasks.items()}

    def cancel(self, run_ids: list[str], grace_s: float) -> list[str]:
        """Cancel runs: unstarted ones now, running ones (their CANCEL marker is written) after ``grace_s``."""
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
                    _finish(self.share, Run.from_dict(task.spec["run"]), "cancelled",
                            RunError("cancelled", "", reason="cancelled before it started"))
                    continue
                record = _read(self.share, self.experiment, run_id)
                if record is None or record.status == "queued":
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
        import ray

        run = Run.from_dict(task.spec["run"])
        status, error = None, None
        try:
            result = ray.get(task.ref)
        except ray.exceptions.TaskCancelledError:
            status = "cancelled"
            error = RunError("cancelled", "", reason="cancelled (its Ray task was stopped)")
        except Exception as exc:  # noqa: BLE001 - every way a task can die becomes the run's recorded reason
            status, error = "failed", _error_for_task(exc, task.spec["max_retries"])
        else:
            task.node_id = result.get("node_id")
            if result.get("exit_code"):
                output = result.get("output", "").strip()
                status = "failed"
                error = RunError("RunOneFailed", output[-_OUTPUT_TAIL:],
                                 reason=f"`nbbatch run-one` exited with {result['exit_code']} on Ray node "
                                        f"{str(result.get('node_id'))[:8]}" + _hint(output))
        try:
            if status is not None:
                record = _read(self.share, run.experiment, run.run_id)
                if record is None or not record.final:
                    _finish(self.share, run, status, error)
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


def execute_on_node(spec: dict[str, Any]) -> dict[str, Any]:
    """The body of a run's Ray task: run ``nbbatch run-one`` for it on this node, pinned to Ray's GPUs.

    Returns ``{"exit_code", "output" (its tail), "node_id", "gpu_ids"}``. The subprocess dies with this
    worker (Linux), so a cancelled or lost task never leaves a run executing.
    """
    import ray

    run = spec["run"]
    node_id = ray.get_runtime_context().get_node_id()
    share = open_share(spec["share"])
    markers = (f"{run['experiment']}/{CANCEL_MARKER}", f"{run['experiment']}/{run['run_id']}/{CANCEL_MARKER}")
    if any(share.exists(m) for m in markers):
        _finish(share, Run.from_dict(run), "cancelled", RunError("cancelled", "", reason="cancelled before it started"))
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
    return {"exit_code": proc.returncode, "output": output.decode("utf-8", "replace")[-_OUTPUT_TAIL:],
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


# --- helpers --------------------------------------------------------------------------------------


def filesystem_type(path: str | os.PathLike[str]) -> str | None:
    """The file system type of the mount holding ``path`` (from /proc/mounts), or None when unknown."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    target = Path(path).resolve()
    while not target.exists() and target != target.parent:
        target = target.parent
    best, best_type = "", None
    for line in mounts:
        parts = line.split()
        if len(parts) < 3:
            continue
        mount_point = parts[1].replace("\\040", " ")
        if (str(target) == mount_point or str(target).startswith(mount_point.rstrip("/") + "/")) \
                and len(mount_point) >= len(best):
            best, best_type = mount_point, parts[2]
    return best_type


def _client_mode(ray: Any) -> bool:
    with contextlib.suppress(Exception):
        return bool(ray.util.client.ray.is_connected())
    return False


def _project_root(run: Run) -> str | None:
    from nbbatch.spec.project import find_project

    with contextlib.suppress(Exception):
        return str(find_project(Path(run.notebook).parent).root)
    return None


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _read(share: Share, experiment: str, run_id: str) -> RunRecord | None:
    try:
        return read_record(share, experiment, run_id)
    except Exception:  # noqa: BLE001 - a corrupt record is replaced by the final one
        return None


def _finish(share: Share, run: Run, status: str, error: RunError | None) -> RunRecord:
    record = _read(share, run.experiment, run.run_id) or new_record(run, "ray")
    record.status, record.error, record.ended_at = status, error, utc_now()
    if record.started_at and record.duration_s is None:
        with contextlib.suppress(ValueError):
            record.duration_s = round((datetime.fromisoformat(record.ended_at)
                                       - datetime.fromisoformat(record.started_at)).total_seconds(), 3)
    write_record(share, record)
    return record


def _age_s(record: RunRecord) -> float:
    stamp = record.started_at or record.queued_at
    if not stamp:
        return float("inf")
    with contextlib.suppress(ValueError):
        return (datetime.fromisoformat(utc_now()) - datetime.fromisoformat(stamp)).total_seconds()
    return float("inf")


def _error_for_task(exc: BaseException, max_retries: int) -> RunError:
    kind = type(exc).__name__
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    retried = f"after {max_retries} Ray retr{'y' if max_retries == 1 else 'ies'}" if max_retries else "with no Ray retry"
    if kind in ("WorkerCrashedError", "NodeDiedError", "ActorDiedError", "LocalRayletDiedError") \
            or "node" in first.lower() and "dead" in first.lower():
        return RunError(kind, first[:2000], reason=f"the Ray node or worker running it died; gave up {retried}")
    if kind == "OutOfMemoryError":
        return RunError(kind, first[:2000], reason=f"Ray's memory monitor killed it; gave up {retried}")
    if "RuntimeEnv" in kind:
        return RunError(kind, first[:2000], reason="Ray could not set up the runtime_env for the run")
    return RunError(kind, first[:2000], reason="its Ray task failed" + _hint(str(exc)))


def _hint(output: str) -> str:
    if "No module named 'nbbatch'" in output or "No module named nbbatch" in output:
        return " (nbbatch is not installed in the Python that runs Ray on that node: pip install 'nbbatch[ray]' there)"
    if "is not installed where the run executed" in output:
        return " (build the framework environments on every node: `nbbatch envs create --all` in the node image)"
    return ""
