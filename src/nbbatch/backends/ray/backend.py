"""The driver side of the Ray backend: settings, the cluster, the share check, and talking to the supervisor."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from nbbatch.backends.base import Backend, Capabilities, Compute, SubmitOptions
from nbbatch.backends.ray.supervisor import NAMESPACE, RunSupervisor, supervisor_name
from nbbatch.backends.ray.task import RayTaskSpec, gpu_request
from nbbatch.backends.settings import setting
from nbbatch.backends.sharedfs import local_addresses, on_network_filesystem, record_age_s
from nbbatch.containers.checks import (
    NodeImages,
    refuse_image_settings_without_container,
)
from nbbatch.errors import BackendError, ContainerError, ValidationError
from nbbatch.plan.runs import Run
from nbbatch.redact import is_secret
from nbbatch.spec.project import Project, find_project
from nbbatch.store.runfiles import CANCEL_REQUEST, StopRequest, read_record, read_record_or_none
from nbbatch.store.runjson import ErrorKind, RunError, RunRecord, Status
from nbbatch.store.share import Share, poll_interval

FRESH_S = 60.0  # a non-final record younger than this may still be on its way to a supervisor: leave it


@dataclass(frozen=True)
class RaySettings:
    """The ray backend's settings (the experiment's ``backend:`` mapping; see :mod:`nbbatch.backends.ray`)."""

    address: str = field(default="auto", metadata=setting(label="address"))  # auto, HOST:6379 or ray://HOST:10001
    num_cpus: int | float = field(default=1, metadata=setting(minimum=0))  # CPUs each run asks for
    max_retries: int | None = field(default=None, metadata=setting(minimum=0))  # Ray retries after a node/worker death
    shared_folder: bool = False  # a folder share is mounted at the same path on every node
    project: str | None = None  # the project's path on the nodes
    resources: dict[str, float] | None = None  # extra Ray resources each run asks for
    env: dict[str, str] | None = None  # environment variables for run-one (and so the kernel) on the nodes
    runtime_env: dict[str, Any] | None = None  # a Ray runtime_env for the run tasks
    autoscaling: bool = False  # do not refuse runs that no current node can hold
    cancel_grace_s: float = field(default=15.0, metadata=setting(minimum=0))  # before a cancelled run's task is killed
    linger_s: float = field(default=60.0, metadata=setting(minimum=0))  # how long an idle supervisor waits for more runs
    gang_timeout_s: float = field(default=300.0, metadata=setting(minimum=1))  # a distributed run's nodes, all at once
    poll_s: float | None = field(default=None, metadata=setting(minimum=0))  # how often waiting reads the records
    container: bool = False  # each run in its framework's image on its node (the image on every node)
    engine: str = field(default="podman", metadata=setting(choices=("podman", "docker")))  # with container: the nodes'
    cpu_image: bool = False  # with container: the frameworks' CPU images (as `nbbatch images build --cpu`)
    base_image: str | None = None  # with container: the images built on this base (as `nbbatch images build --base`)
    registry: str | None = None  # with container: nodes pull REGISTRY/nbbatch-<fw>:<fingerprint> (`nbbatch images push`)

    def __post_init__(self) -> None:
        if not self.address:  # an empty address means Ray's own lookup, as `auto` does
            object.__setattr__(self, "address", "auto")
        for name in ("base_image", "registry"):  # a form's empty field
            if getattr(self, name) == "":
                object.__setattr__(self, name, None)

    @property
    def run_env(self) -> dict[str, str]:
        """``env`` as the variables a run gets (names and values as text)."""
        return {str(k): str(v) for k, v in (self.env or {}).items()}


class RayBackend(Backend):
    """Execute runs as Ray tasks on a Ray cluster (``backend: {name: ray, address: ...}``)."""

    name: ClassVar[str] = "ray"
    capabilities: ClassVar[Capabilities] = Capabilities(
        cancel=True, log_stream=False, gpus=True, multi_node=True, local_kernels=False, detached=True,
        gpu_slots=False, managed_cluster=False)
    Settings: ClassVar[type] = RaySettings
    settings: RaySettings

    def __init__(self, address: str | RaySettings | None = None, /, **values: Any) -> None:
        """The experiment's ``backend:`` settings (see :class:`RaySettings`); ``RayBackend("HOST:6379")`` names
        the address. Mistakes raise BackendError."""
        if isinstance(address, str):
            values = {"address": address, **values}
            address = None
        super().__init__(address, **values)
        refuse_image_settings_without_container(self.settings)
        if self.settings.container:
            self.capabilities = dataclasses.replace(self.capabilities, containers=True)
        self._node_images = NodeImages(self.name, self.settings.engine, self.settings.cpu_image,
                                       self.settings.base_image, self.settings.registry, "Nothing was started.")

    @property
    def poll_s(self) -> float | None:  # type: ignore[override]
        """How often waiting reads the records (None: by the share's kind)."""
        return self.settings.poll_s or None

    # --- the cluster ------------------------------------------------------------------------------

    def connect(self) -> Any:
        """Connect this process to the cluster (once) and return the ``ray`` module."""
        try:
            import ray
        except ImportError as exc:  # pragma: no cover - the registry reports the missing extra first
            raise BackendError(f"the `ray` backend needs its extra: pip install 'nbbatch[ray]' ({exc})") from exc
        if not ray.is_initialized():
            try:
                ray.init(address=self.settings.address, log_to_driver=False, logging_level=logging.WARNING)
            except Exception as exc:  # noqa: BLE001 - ConnectionError, RuntimeError, ValueError… all mean the same
                raise BackendError(
                    f"cannot connect to the Ray cluster at `{self.settings.address}`: {exc}. Start one (`ray start --head`) "
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
        slots = int(cpus // self.settings.num_cpus) if self.settings.num_cpus else max(len(gpus), 1)
        details: dict[str, Any] = {"address": self.settings.address, "ray_version": ray.__version__}
        with contextlib.suppress(Exception):
            details["available"] = dict(ray.available_resources())
            details["total"] = dict(ray.cluster_resources())
        return Compute(backend=self.name, gpus=gpus, nodes=out_nodes, slots=max(slots, 1), details=details)

    def check(self, runs: Sequence[Run], options: SubmitOptions | None = None) -> None:
        """Refuse secrets in ``env``, and runs that no node can hold (unless ``autoscaling``), before anything starts."""
        super().check(runs, options)
        self.check_secrets(runs)
        if self.settings.container:
            self._node_images.check(runs)
        if not runs or self.settings.autoscaling:
            return
        alive = self._alive_nodes()
        need_gpus = max(r.gpus for r in runs)

        def fits(node: dict[str, Any], gpus: float = need_gpus) -> bool:
            res = node.get("Resources") or {}
            return (res.get("GPU", 0) >= gpus and res.get("CPU", 0) >= self.settings.num_cpus
                    and all(res.get(k, 0) >= v for k, v in (self.settings.resources or {}).items()))

        gang = max((r for r in runs if r.distribution), key=lambda r: (r.distribution.nodes, r.gpus), default=None)
        if gang is not None and gang.distribution.nodes > len(alive):
            raise ValidationError(
                f"run {gang.run_id} spans {gang.distribution.nodes} nodes (resources.nodes, one Ray node each), but "
                f"the Ray cluster at `{self.settings.address}` has {len(alive)} alive node(s); lower resources.nodes, add "
                "nodes, or set `autoscaling: true` in the backend settings when the cluster adds nodes on demand")
        if gang is not None and gang.distribution.nodes > (large := sum(1 for n in alive if fits(n, gang.gpus))):
            raise ValidationError(
                f"run {gang.run_id} spans {gang.distribution.nodes} nodes with {gang.gpus} GPU(s) and "
                f"{self.settings.num_cpus:g} CPU(s) each, but only {large} of the {len(alive)} alive node(s) of the Ray cluster "
                f"at `{self.settings.address}` have that; lower resources.nodes or gpus_per_node, or set `autoscaling: true`")
        if not any(fits(n) for n in alive):
            largest = max((n.get("Resources", {}).get("GPU", 0) for n in alive), default=0)
            extra = f" and {self.settings.resources}" if self.settings.resources else ""
            raise ValidationError(
                f"runs ask for {need_gpus} GPU(s) and {self.settings.num_cpus:g} CPU(s){extra} each, but no node of the Ray "
                f"cluster at `{self.settings.address}` has that (largest: {largest:g} GPU(s), {len(alive)} node(s) alive); "
                "lower resources.gpus, or set `autoscaling: true` in the backend settings when the cluster adds "
                "nodes on demand")

    def check_secrets(self, runs: Sequence[Run] = ()) -> None:
        """Refuse a secret (by name or value) in ``env``, ``runtime_env.env_vars`` or a run's ``env:``.

        They would travel with the supervisor actor (its ``runtime_env``, shown by Ray's state API and
        dashboard), with each run's task, and into ``.nbbatch/``. Credentials belong in the environment
        of the Ray nodes themselves (``ray start`` under them, the pod's secret), which every run inherits.
        """
        runtime_vars = dict((self.settings.runtime_env or {}).get("env_vars") or {})
        places = [("the ray backend setting `env`", self.settings.run_env),
                  ("the ray backend setting `runtime_env.env_vars`", runtime_vars),
                  *((f"the `env:` of run {run.run_id}", run.env) for run in runs)]
        for where, variables in places:
            secret = sorted(str(k) for k, v in variables.items() if is_secret(k, v))
            if secret:
                raise BackendError(
                    f"{where} holds `{secret[0]}`, which looks like a secret (by its name or value); on Ray it "
                    "would be visible in the supervisor's runtime_env (Ray's state API and dashboard), in the run's "
                    "task and in .nbbatch/experiments.json. Remove it from the experiment and set it in the "
                    "environment of the Ray nodes instead (export it before `ray start` on every node, or from a "
                    "Kubernetes secret in the pod spec): runs inherit the node's environment, and nbbatch keeps "
                    "secret-looking variables out of the notebook's kernel. Nothing was started.")

    def check_share(self, share: Share) -> None:
        """Raise :class:`BackendError` when ``share`` is a folder that only this machine sees (with ``container:
        true``, :class:`ContainerError` when it is no folder at all: the containers bind-mount it).

        A folder share is accepted when every alive node runs on this machine, when the folder is on a
        network file system (NFS, SMB/CIFS, blobfuse…), or with the setting ``shared_folder: true``.
        """
        local = share.local_path("")
        if self.settings.container and local is None:
            raise ContainerError(
                f"container: true bind-mounts the share into each run's container on its Ray node, so the share must "
                f"be a folder, at the same path on every node; {share.url} is not a folder. Mount it on every node "
                "(blobfuse, NFS…), name that folder as `share:` and set `shared_folder: true`, or run without "
                "containers. Nothing was started.")
        if self.settings.shared_folder:
            return
        if local is None:  # azfiles:// and other remote shares are reachable from every node
            return
        network, fs_type = on_network_filesystem(local)
        if network:
            return
        alive = self._alive_nodes()
        addresses = sorted({str(n.get("NodeManagerAddress")) for n in alive})
        if set(addresses) <= self._local_addresses():  # no node elsewhere (a single-machine cluster)
            return
        raise BackendError(
            f"the share {share.url} is a folder on this machine ({fs_type or 'local file system'}), but the Ray "
            f"cluster at `{self.settings.address}` has {len(alive)} node(s) on {', '.join(addresses)}, which cannot see it. "
            "Use a share every node can reach: an `azfiles://ACCOUNT/SHARE` share, or a folder mounted at the same "
            "path on every node (NFS, Azure Files…) and set `shared_folder: true` in the experiment's "
            "`backend:` settings. Nothing was started.")

    # --- container: true ------------------------------------------------------------------------------------

    def prepare_environments(self, frameworks: Sequence[str], project: Project, build: bool = False,
                             progress: bool = True) -> None:
        """``submit --build-envs``: with ``container: true`` the images on this machine (each node needs its own copy);
        the venvs are the nodes' own."""
        if not self.settings.container:
            return super().prepare_environments(frameworks, project, build, progress)
        if build:
            self._node_images.build(frameworks, project, progress)

    def _local_addresses(self) -> set[str]:
        more = []
        with contextlib.suppress(Exception):
            import ray

            if ray.is_initialized() and not _client_mode(ray):
                more.append(ray.util.get_node_ip_address())
        return local_addresses(more)

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
        env_vars = {**self.settings.run_env, **dict((self.settings.runtime_env or {}).get("env_vars") or {})}
        if env_vars:  # never credentials (check_secrets): the supervisor reads them from the head's environment
            options["runtime_env"] = {"env_vars": env_vars}
        return ray.remote(RunSupervisor).options(**options).remote(experiment, share.url, self.settings.linger_s)

    def _states(self, experiment: str, share: Share) -> dict[str, dict[str, Any]] | None:
        """What the experiment's supervisor knows of its runs (see ``RunSupervisor.sweep``); None: it is gone."""
        supervisor = self._supervisor(experiment, share)
        if supervisor is None:
            return None
        ray = self.connect()
        try:
            return dict(ray.get(supervisor.sweep.remote(), timeout=60))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return None

    def task_spec(self, run: Run, share: Share, options: SubmitOptions, project: str | None,
                  images: Mapping[str, str] | None = None) -> RayTaskSpec:
        """How one run asks Ray for resources and what its task executes (``images``: framework → image tag, with
        ``container: true``)."""
        num_gpus, shared = gpu_request(run.gpus, options.runs_per_gpu)
        # the experiment's `retries: 0` means no second run of the notebook, after a kernel or a worker death alike
        max_retries = self.settings.max_retries if self.settings.max_retries is not None else run.retries
        if run.distribution:  # a gang: whole GPUs per node, and no Ray retry (its launchers retry the gang)
            num_gpus, shared, max_retries = float(run.gpus), False, 0
        source = None
        with contextlib.suppress(OSError):
            source = Path(run.notebook).read_text(encoding="utf-8")
        given = self.settings
        in_image = {run.framework: images[run.framework]} if images and run.framework in images else {}
        return RayTaskSpec(run=run.to_dict(), share=share.url, project=project, num_gpus=num_gpus,
                           num_cpus=given.num_cpus, shared_gpu=shared, max_retries=max_retries,
                           resources=dict(given.resources or {}), env=given.run_env, runtime_env=given.runtime_env,
                           notebook_source=source, gang_timeout_s=given.gang_timeout_s, container_images=in_image,
                           container_engine=given.engine if in_image else None)

    # --- the Backend hooks --------------------------------------------------------------------------

    def start(self, runs: Sequence[Run], share: Share, options: SubmitOptions) -> None:
        """Hand every run to the experiment's supervisor, which starts them as Ray tasks (and outlives us)."""
        self.check_secrets(runs)  # also for callers that skip launch()'s check()
        ray = self.connect()
        experiment = runs[0].experiment
        project = self.settings.project or _project_root(runs[0])
        images = self._node_images.refs(runs) if self.settings.container else None
        specs = [self.task_spec(run, share, options, project, images).to_dict() for run in runs]
        deadline = time.monotonic() + 60
        while True:  # a supervisor that is just leaving refuses: start a new one
            supervisor = self._supervisor(experiment, share, create=True)
            try:
                accepted = ray.get(supervisor.submit.remote(specs, self.parallel_limit(options)), timeout=60)
            except ray.exceptions.RayActorError:
                accepted = None
            if accepted is not None:  # runs already in flight there are left to their tasks
                return
            if time.monotonic() > deadline:
                raise BackendError(f"the Ray supervisor of `{experiment}` did not accept the runs within 60 s")
            time.sleep(0.5)

    def in_flight(self, share: Share, record: RunRecord) -> bool:
        """Whether the experiment's supervisor still has the run's task (then it is not started again)."""
        states = self._states(record.experiment, share)
        return bool(states and states.get(record.run_id, {}).get("active"))

    def refresh(self, experiment: str, share: Share) -> None:
        """Check the share is visible from the cluster, then finalize runs whose Ray task ended without a record.

        Raises :class:`BackendError` when the share is a folder the cluster's nodes cannot see.
        """
        self.check_share(share)
        super().refresh(experiment, share)

    def lost_runs(self, experiment: str, share: Share, records: Sequence[RunRecord]) -> dict[str, RunError]:
        """Runs whose task is gone: their supervisor left (the cluster restarted) or does not know them.

        Records younger than :data:`FRESH_S` seconds are left alone (a submission may be handing them to Ray).
        """
        return self._lost(experiment, share, records, self._states(experiment, share), FRESH_S)

    def heartbeat(self, experiment: str, share: Share, pending: Sequence[str]) -> None:
        """While waiting: when the supervisor is gone, nothing will finish the pending runs; fail them now."""
        if self._states(experiment, share) is not None:
            return
        records = {i: r for i in pending if (r := read_record_or_none(share, experiment, i)) is not None}
        for run_id, error in self._lost(experiment, share, list(records.values()), None, fresh_s=0).items():
            self.finalize(share, records[run_id], Status.FAILED, error)

    def _lost(self, experiment: str, share: Share, records: Sequence[RunRecord],
              states: dict[str, dict[str, Any]] | None, fresh_s: float) -> dict[str, RunError]:
        lost = {}
        why = ("its Ray supervisor does not know it" if states is not None else
               f"no nbbatch supervisor for `{experiment}` is left on the Ray cluster at `{self.settings.address}`")
        for record in records:
            if states is not None and states.get(record.run_id, {}).get("active"):
                continue
            current = read_record_or_none(share, experiment, record.run_id)  # the sweep may have finalized it
            if current is None or current.final or record_age_s(current) < fresh_s:
                continue
            lost[record.run_id] = RunError("RayTaskLost", f"{why} (the cluster restarted, or its task was lost)",
                                           reason="its Ray task is gone; resubmit to rerun", kind=ErrorKind.INFRA)
        return lost

    def interrupted(self, experiment: str, share: Share, pending: Sequence[str]) -> None:
        """Ctrl-C while waiting: cancel the pending runs and give them ``cancel_grace_s`` + 30 s to be final."""
        self.cancel(experiment, share, sorted(pending))
        poll = self.poll_s or poll_interval(share)
        left = set(pending)
        end = time.monotonic() + self.settings.cancel_grace_s + 30
        while left and time.monotonic() < end:
            left = {i for i in left if not ((r := read_record(share, experiment, i)) and r.final)}
            time.sleep(poll)

    def cancel(self, experiment: str, share: Share, run_ids: Sequence[str] | None = None,
               request: StopRequest = CANCEL_REQUEST) -> list[str]:
        """Write the cancel markers (the run's kernel is stopped, its partial output kept), then cancel Ray tasks.

        Queued runs' tasks are cancelled at once; a running run gets ``cancel_grace_s`` seconds to stop
        itself before its task is killed (``ray.cancel(force=True)``).
        """
        asked = super().cancel(experiment, share, run_ids, request)
        if asked:
            try:
                supervisor = self._supervisor(experiment, share)
                if supervisor is not None:
                    ray = self.connect()
                    ray.get(supervisor.cancel.remote(asked, self.settings.cancel_grace_s), timeout=60)
            except Exception:  # noqa: BLE001 - the markers alone stop running runs and unstarted tasks
                pass
        return asked


# --- helpers --------------------------------------------------------------------------------------


def _client_mode(ray: Any) -> bool:
    with contextlib.suppress(Exception):
        return bool(ray.util.client.ray.is_connected())
    return False


def _project_root(run: Run) -> str | None:
    with contextlib.suppress(Exception):
        return str(find_project(Path(run.notebook).parent).root)
    return None
