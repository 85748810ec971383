"""The ``azureml`` backend: each run is an Azure ML command job on a GPU compute cluster.

This is deep_bait's Batch AI flow on today's service (Azure ML, SDK v2 ``azure-ai-ml``):

* a **cluster** (:class:`AzureMLCluster`): an ``AmlCompute`` cluster that scales between
  ``min_nodes`` and ``max_nodes`` VMs of ``vm_size`` (dedicated or low-priority);
* an **environment** per framework: an Azure ML ``Environment`` named ``nbbatch-<framework>``,
  built by Azure ML from ``dockerfiles/<framework>/`` (the Docker build context), versioned by
  the framework's pins fingerprint and reused while the pins are unchanged;
* a **job** per run: a ``command`` job whose code is a snapshot of the run's notebooks, the
  frameworks' data and nbbatch's own source, and whose command is ``nbbatch run-one`` — the same
  executor every backend uses — writing ``output.ipynb``, ``run.json`` and ``log.txt`` to the
  experiment's Azure File share, mounted into the job through an Azure ML datastore.

The job name, its studio URL and the last job state seen are kept next to the run's files in
``<experiment>/<run id>/azureml.json``; :meth:`AzureMLBackend.refresh` maps job states onto run
records (:func:`map_job_status`). Settings (the ``backend:`` mapping of the experiment file) are
the keyword arguments of :class:`AzureMLBackend`.

The workspace comes from the settings (``subscription_id``, ``resource_group``, ``workspace``),
else from ``AZURE_SUBSCRIPTION_ID`` / ``AZURE_RESOURCE_GROUP`` / ``AZUREML_WORKSPACE``, else from an
Azure ML ``config.json`` (searched from the working directory up, or ``config:``). Credentials are
:class:`azure.identity.DefaultAzureCredential`'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import queue
import re
import shlex
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from azure.ai.ml import MLClient, Output, command
from azure.ai.ml.entities import (
    AccountKeyConfiguration,
    AmlCompute,
    AzureFileDatastore,
    BuildContext,
    Command,
    Environment,
)
from azure.core.exceptions import AzureError, HttpResponseError, ResourceNotFoundError

from nbbatch.backends.base import Compute, SubmitOptions
from nbbatch.errors import BackendError, did_you_mean
from nbbatch.plan.runs import Run
from nbbatch.store.runrecord import FINAL_STATUSES, RunError, RunRecord, utc_now
from nbbatch.store.share import Share

if TYPE_CHECKING:
    from nbbatch.store.azfiles import AzureFilesLocation

__all__ = [
    "AzureMLBackend",
    "AzureMLCluster",
    "ClusterSettings",
    "ClusterStatus",
    "JobState",
    "map_job_status",
    "connect",
    "framework_environment",
    "ensure_environment",
    "ensure_datastore",
    "build_code_snapshot",
    "job_yaml",
    "cli_cluster",
    "JOB_FILE",
]

JOB_FILE = "azureml.json"
CANCEL_MARKER = "CANCEL"  # the executor's marker (nbbatch.store.layout.CANCEL_MARKER), checked between cells
KEY_ENV = "AZURE_STORAGE_KEY"
DEFAULT_CLUSTER = "nbbatch-gpu"
DEFAULT_VM_SIZE = "Standard_NC4as_T4_v3"
DEFAULT_LAUNCHER = 'PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" python -m nbbatch'

# --- job states -------------------------------------------------------------------------------

_QUEUED = ("NotStarted", "Queued", "Preparing", "Provisioning", "Starting")
_RUNNING = ("Running", "Finalizing")
_NOTED = {
    "NotResponding": "Azure ML reports the job as not responding (node lost or hung); it may recover",
    "Paused": "the job is paused in Azure ML",
}
_FINAL = {"Completed": "succeeded", "Failed": "failed", "Canceled": "cancelled", "CancelRequested": "cancelled"}
_LOWER = {name.lower(): name for name in (*_QUEUED, *_RUNNING, *_NOTED, *_FINAL)}


def map_job_status(status: str | None) -> tuple[str, str | None]:
    """An Azure ML job status as ``(nbbatch status, note)``.

    NotStarted/Queued/Preparing/Provisioning/Starting → queued; Running/Finalizing → running;
    Completed → succeeded; Failed → failed; Canceled/CancelRequested → cancelled;
    NotResponding/Paused → running, with a note saying so. Unknown states are kept as queued with
    a note.
    """
    text = str(getattr(status, "value", status) or "NotStarted")
    key = text.replace("_", "").lower()
    if key in _LOWER:
        text = _LOWER[key]
    if text in _QUEUED:
        return "queued", None
    if text in _RUNNING:
        return "running", None
    if text in _NOTED:
        return "running", _NOTED[text]
    if text in _FINAL:
        return _FINAL[text], None
    return "queued", f"unknown Azure ML job status {text!r}"


@dataclass
class JobState:
    """What nbbatch knows of one run's Azure ML job (stored as ``azureml.json`` in the run's folder)."""

    run_id: str
    job_name: str
    experiment: str
    studio_url: str | None = None
    job_status: str | None = None
    status: str = "queued"  # the job status mapped onto nbbatch's
    note: str | None = None
    submitted_at: str | None = None
    updated_at: str | None = None

    def to_json(self) -> bytes:
        return (json.dumps(dataclasses.asdict(self), indent=2) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes) -> JobState:
        values = json.loads(data)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})


def _job_status_text(status: Any) -> str:
    value = getattr(status, "value", status)
    return str(value) if value is not None else "NotStarted"


# --- workspace --------------------------------------------------------------------------------


def connect(
    *,
    subscription_id: str | None = None,
    resource_group: str | None = None,
    workspace: str | None = None,
    config: str | os.PathLike[str] | None = None,
    credential: Any = None,
    **client_kwargs: Any,
) -> MLClient:
    """An :class:`MLClient` for the workspace the settings, the environment or ``config.json`` name."""
    subscription_id = subscription_id or os.environ.get("AZURE_SUBSCRIPTION_ID")
    resource_group = resource_group or os.environ.get("AZURE_RESOURCE_GROUP")
    workspace = workspace or os.environ.get("AZUREML_WORKSPACE")
    if credential is None:
        from azure.identity import DefaultAzureCredential

        credential = DefaultAzureCredential()
    if subscription_id and resource_group and workspace and config is None:
        return MLClient(credential, subscription_id, resource_group, workspace, **client_kwargs)
    try:
        return MLClient.from_config(credential, path=str(config) if config else None, **client_kwargs)
    except Exception as exc:  # the SDK raises its own ValidationException when no config.json is found
        raise BackendError(
            "the azureml backend needs a workspace: set `subscription_id`, `resource_group` and `workspace` "
            "under `backend:` in the experiment file, or AZURE_SUBSCRIPTION_ID, AZURE_RESOURCE_GROUP and "
            "AZUREML_WORKSPACE, or download the workspace's config.json (Azure ML studio → workspace → "
            f"Download config file) into the project ({exc})"
        ) from exc


# --- clusters ---------------------------------------------------------------------------------

_TIERS = ("dedicated", "low_priority")


@dataclass
class ClusterSettings:
    """How a compute cluster is sized: VM size, node range, priority tier, idle time before scale-down."""

    name: str = DEFAULT_CLUSTER
    vm_size: str = DEFAULT_VM_SIZE
    min_nodes: int = 0
    max_nodes: int = 2
    tier: str = "dedicated"
    idle_time_before_scale_down: int = 1800  # seconds

    def __post_init__(self) -> None:
        tier = self.tier.replace("-", "_").lower()
        tier = {"lowpriority": "low_priority", "low": "low_priority", "spot": "low_priority"}.get(tier, tier)
        if tier not in _TIERS:
            raise BackendError(f"cluster tier `{self.tier}` is not one of {', '.join(_TIERS)}")
        self.tier = tier
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9-]{1,31}", self.name):
            raise BackendError(f"cluster name `{self.name}` must be 2-32 letters, digits or '-', starting with a letter")
        if not (0 <= int(self.min_nodes) <= int(self.max_nodes)) or int(self.max_nodes) < 1:
            raise BackendError(f"cluster nodes must satisfy 0 <= min_nodes <= max_nodes and max_nodes >= 1 "
                               f"(got min_nodes={self.min_nodes}, max_nodes={self.max_nodes})")
        self.min_nodes, self.max_nodes = int(self.min_nodes), int(self.max_nodes)
        self.idle_time_before_scale_down = int(self.idle_time_before_scale_down)

    def to_compute(self) -> AmlCompute:
        """The ``AmlCompute`` entity these settings describe."""
        return AmlCompute(
            name=self.name,
            size=self.vm_size,
            min_instances=self.min_nodes,
            max_instances=self.max_nodes,
            tier=self.tier,
            idle_time_before_scale_down=self.idle_time_before_scale_down,
        )


@dataclass
class ClusterStatus:
    """A cluster's state: size, node counts by state, nodes, errors."""

    name: str
    exists: bool
    vm_size: str | None = None
    tier: str | None = None
    min_nodes: int | None = None
    max_nodes: int | None = None
    idle_time_before_scale_down: int | None = None
    provisioning_state: str | None = None
    allocation_state: str | None = None
    current_nodes: int | None = None
    target_nodes: int | None = None
    nodes_by_state: dict[str, int] = field(default_factory=dict)
    nodes: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        """A few lines of text, like deep_bait's ``print_cluster_status``."""
        if not self.exists:
            return f"cluster {self.name}: does not exist (nbbatch cluster create)"
        counts = ", ".join(f"{state} {n}" for state, n in sorted(self.nodes_by_state.items()) if n) or "no nodes"
        lines = [
            f"cluster {self.name}: {self.vm_size} × {self.min_nodes}–{self.max_nodes} nodes ({self.tier}), "
            f"provisioning {self.provisioning_state or '?'}, allocation {self.allocation_state or '?'}",
            f"  nodes: {self.current_nodes if self.current_nodes is not None else '?'} "
            f"(target {self.target_nodes if self.target_nodes is not None else '?'}): {counts}",
        ]
        for node in self.nodes:
            job = f" running {node['job']}" if node.get("job") else ""
            lines.append(f"  - {node['name']}: {node['state']}{job}")
        lines.extend(f"  error: {err}" for err in self.errors)
        return "\n".join(lines)


def _enum_text(value: Any) -> str | None:
    if value is None:
        return None
    return str(getattr(value, "value", value))


class AzureMLCluster:
    """Create, inspect, resize and delete one AmlCompute cluster."""

    def __init__(self, ml_client: MLClient, settings: ClusterSettings):
        self.ml_client = ml_client
        self.settings = settings

    @property
    def name(self) -> str:
        return self.settings.name

    def _get(self) -> AmlCompute | None:
        try:
            found = self.ml_client.compute.get(self.name)
        except ResourceNotFoundError:
            return None
        if not isinstance(found, AmlCompute):
            raise BackendError(f"compute `{self.name}` exists but is a {type(found).__name__}, not a compute cluster; "
                               "choose another `compute:` name")
        return found

    def create(self, wait: bool = True) -> ClusterStatus:
        """Create the cluster if it does not exist (an existing one is left as it is)."""
        if self._get() is None:
            try:
                poller = self.ml_client.compute.begin_create_or_update(self.settings.to_compute())
                if wait:
                    poller.result()
            except HttpResponseError as exc:
                raise BackendError(f"cannot create cluster `{self.name}` ({self.settings.vm_size}): {_message(exc)}. "
                                   "Check the VM size is offered in the workspace's region and that the "
                                   "subscription has quota for its family (docs/azure.md)") from exc
        return self.status()

    def ensure(self) -> ClusterStatus:
        """The cluster's status, creating it first when missing."""
        return self.create(wait=True)

    def status(self) -> ClusterStatus:
        """Size, provisioning and allocation state, nodes by state, errors."""
        compute = self._get()
        if compute is None:
            return ClusterStatus(self.name, exists=False)
        status = ClusterStatus(
            name=self.name,
            exists=True,
            vm_size=compute.size,
            tier=compute.tier,
            min_nodes=compute.min_instances,
            max_nodes=compute.max_instances,
            idle_time_before_scale_down=compute.idle_time_before_scale_down,
            provisioning_state=_enum_text(compute.provisioning_state),
        )
        if compute.provisioning_errors:
            status.errors.append(f"provisioning: {compute.provisioning_errors}")
        self._add_allocation(status)
        nodes = list(self.ml_client.compute.list_nodes(self.name))
        for node in nodes:
            state = _enum_text(_node_field(node, "node_state", "nodeState")) or "unknown"
            status.nodes.append({"name": _node_field(node, "node_id", "nodeId"), "state": state,
                                 "job": _node_field(node, "run_id", "runId"),
                                 "private_ip": _node_field(node, "private_ip_address", "privateIpAddress")})
            status.nodes_by_state[state] = status.nodes_by_state.get(state, 0) + 1
        return status

    def _add_allocation(self, status: ClusterStatus) -> None:
        # The SDK's AmlCompute entity drops the allocation state, node counts and resize errors
        # (quota errors show up there), so read them from the service's own compute resource.
        try:
            rest = self.ml_client.compute._operation.get(  # noqa: SLF001 - not exposed by the entity
                self.ml_client.resource_group_name, self.ml_client.workspace_name, self.name
            )
            props = rest.properties.properties
        except (AttributeError, TypeError, AzureError):
            return
        if props is None:
            return
        status.allocation_state = _enum_text(getattr(props, "allocation_state", None))
        status.current_nodes = getattr(props, "current_node_count", None)
        status.target_nodes = getattr(props, "target_node_count", None)
        counts = getattr(props, "node_state_counts", None)
        if counts is not None:
            for state in ("idle", "running", "preparing", "unusable", "leaving", "preempted"):
                value = getattr(counts, f"{state}_node_count", None)
                if value:
                    status.nodes_by_state.setdefault(f"{state} (count)", value)
        for err in getattr(props, "errors", None) or []:
            detail = getattr(err, "error", err)
            status.errors.append(f"{getattr(detail, 'code', '')}: {getattr(detail, 'message', detail)}".strip(": "))

    def scale(self, min_nodes: int | None = None, max_nodes: int | None = None, wait: bool = True) -> ClusterStatus:
        """Change the node range (e.g. ``max_nodes=0``-like pause: ``min_nodes=0`` lets it scale to zero)."""
        compute = self._get()
        if compute is None:
            raise BackendError(f"cluster `{self.name}` does not exist; create it first (nbbatch cluster create)")
        new_min = compute.min_instances if min_nodes is None else int(min_nodes)
        new_max = compute.max_instances if max_nodes is None else int(max_nodes)
        if not (0 <= new_min <= new_max) or new_max < 1:
            raise BackendError(f"cannot scale `{self.name}` to min {new_min}, max {new_max}: "
                               "need 0 <= min_nodes <= max_nodes and max_nodes >= 1")
        compute.min_instances, compute.max_instances = new_min, new_max
        poller = self.ml_client.compute.begin_update(compute)
        if wait:
            poller.result()
        self.settings.min_nodes, self.settings.max_nodes = new_min, new_max
        return self.status()

    def delete(self, wait: bool = True) -> bool:
        """Delete the cluster (its nodes stop billing); False when it did not exist."""
        if self._get() is None:
            return False
        poller = self.ml_client.compute.begin_delete(self.name)
        if wait:
            poller.result()
        return True


def _node_field(node: Any, name: str, wire_name: str) -> Any:
    # azure-ai-ml 1.35 fills AmlComputeNodeInfo from the REST model's as_dict(), whose keys are the
    # wire's camelCase names, leaving the documented attributes None; read either.
    value = getattr(node, name, None)
    return value if value is not None else vars(node).get(wire_name)


def _message(exc: BaseException) -> str:
    text = getattr(exc, "message", None) or str(exc)
    return " ".join(str(text).split())[:500]


# --- environments -----------------------------------------------------------------------------


def framework_environment(framework: Any, dockerfiles_dir: Path, build_dir: Path | None = None) -> Environment:
    """The Azure ML environment of a framework: built from ``dockerfiles/<name>/``, versioned by its pins.

    With ``build_dir`` the Docker build context is staged there: the files of ``dockerfiles/<name>/``
    plus the framework's folder as ``frameworks/<name>/``, so a Dockerfile can
    ``COPY frameworks/<name>/requirements.txt`` and install the very pins the local environments use.
    """
    context = Path(dockerfiles_dir) / framework.name
    if not (context / "Dockerfile").is_file():
        raise BackendError(
            f"framework `{framework.name}` has no Docker build context {context}/Dockerfile; the azureml backend "
            f"builds its image from there (or name an existing Azure ML environment under `environments:`)"
        )
    path = context
    if build_dir is not None:
        shutil.copytree(context, build_dir, ignore=_IGNORE, dirs_exist_ok=True)
        shutil.copytree(framework.folder, build_dir / "frameworks" / framework.name, ignore=_IGNORE,
                        dirs_exist_ok=True)
        path = build_dir
    return Environment(
        name=f"nbbatch-{framework.name}",
        version=framework.fingerprint(),
        build=BuildContext(path=str(path), dockerfile_path="Dockerfile"),
        description=f"nbbatch {framework.title} environment (kernel {framework.kernel_name})",
        tags={"nbbatch": "1", "framework": framework.name, "kernel": framework.kernel_name},
    )


def ensure_environment(ml_client: MLClient, framework: Any, dockerfiles_dir: Path) -> Environment:
    """The framework's environment: reused when its name and version (the pins) exist, else registered.

    Registering uploads the staged build context; Azure ML builds the image on first use (a job waits
    in Preparing meanwhile) and keeps it in the workspace's container registry.
    """
    wanted = framework_environment(framework, dockerfiles_dir)
    try:
        return ml_client.environments.get(wanted.name, version=wanted.version)
    except ResourceNotFoundError:
        pass
    with tempfile.TemporaryDirectory(prefix="nbbatch-image-") as tmp:
        staged = framework_environment(framework, dockerfiles_dir, build_dir=Path(tmp) / "context")
        try:
            return ml_client.environments.create_or_update(staged)
        except HttpResponseError as exc:
            raise BackendError(f"cannot register environment {staged.name}:{staged.version}: "
                               f"{_message(exc)}") from exc


# --- datastores -------------------------------------------------------------------------------


def _datastore_name_for(account: str, share: str) -> str:
    return re.sub(r"[^a-z0-9_]", "_", f"nbbatch_{account}_{share}".lower())[:255]


def ensure_datastore(ml_client: MLClient, name: str, account: str, share: str) -> None:
    """Check the Azure ML datastore ``name`` points at the file share; register it when missing.

    Registering needs the storage account key in ``AZURE_STORAGE_KEY`` once (Azure ML keeps it in the
    workspace's key vault; nbbatch writes it nowhere). Without it, say how to register it by hand.
    """
    try:
        found = ml_client.datastores.get(name)
    except ResourceNotFoundError:
        found = None
    if found is not None:
        if not isinstance(found, AzureFileDatastore):
            raise BackendError(f"datastore `{name}` exists but is a {type(found).__name__}, not an Azure File "
                               "datastore; name another with `datastore:`")
        if (found.account_name, found.file_share_name) != (account, share):
            raise BackendError(f"datastore `{name}` points at {found.account_name}/{found.file_share_name}, "
                               f"not the experiment's share {account}/{share}; name another with `datastore:`")
        return
    key = os.environ.get(KEY_ENV)
    if not key:
        raise BackendError(
            f"the workspace has no datastore `{name}` for the file share {account}/{share}. Register it once "
            f"with `az ml datastore create --file <yaml>` (type: azure_file, name: {name}, account_name: {account}, "
            f"file_share_name: {share}, credentials.account_key; see docs/azure.md), or set {KEY_ENV} for this "
            "command and nbbatch registers it (the key goes to the workspace's key vault only)"
        )
    ml_client.datastores.create_or_update(
        AzureFileDatastore(
            name=name, account_name=account, file_share_name=share,
            description="nbbatch results share", credentials=AccountKeyConfiguration(account_key=key),
        )
    )


# --- code snapshot ----------------------------------------------------------------------------

_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.pyo", ".ipynb_checkpoints")


def _project_root_of(run: Run) -> Path:
    notebook, rel = Path(run.notebook), Path(run.notebook_rel)
    if notebook.is_absolute() and not rel.is_absolute() and notebook.parts[-len(rel.parts):] == rel.parts:
        return notebook.parents[len(rel.parts) - 1]
    from nbbatch.spec.project import find_project

    return find_project().root


def build_code_snapshot(runs: Sequence[Run], dest: Path, project_root: Path | None = None) -> Path:
    """Copy what a job needs into ``dest``: nbbatch's source, the frameworks' data, the runs' notebooks.

    The layout mirrors the project (``src/nbbatch/``, ``frameworks/<name>/``, each notebook at its
    project-relative path), so ``run-one`` resolves notebooks the same way as on this machine.
    The content is deterministic, so Azure ML reuses an upload when nothing changed.
    """
    import nbbatch

    dest.mkdir(parents=True, exist_ok=True)
    shutil.copytree(Path(nbbatch.__file__).parent, dest / "src" / "nbbatch", ignore=_IGNORE, dirs_exist_ok=True)
    frameworks = sorted({r.framework for r in runs if r.framework})
    for run in runs:
        rel = Path(run.notebook_rel)
        if rel.is_absolute() or ".." in rel.parts:
            raise BackendError(f"notebook {run.notebook_rel} of run {run.run_id} is outside the project; the "
                               "azureml backend ships the project's notebooks only: move it into the project")
        root = project_root or _project_root_of(run)
        source = run.resolve_notebook(root)
        if not source.is_file():
            raise BackendError(f"notebook {run.notebook_rel} of run {run.run_id} is missing from {root}")
        target = dest / run.notebook_rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
    if frameworks:
        from nbbatch.spec.frameworks import list_frameworks
        from nbbatch.spec.project import Project

        root = project_root or _project_root_of(runs[0])
        known = list_frameworks(Project(root))
        for name in frameworks:
            if name in known:
                shutil.copytree(known[name].folder, dest / "frameworks" / name, ignore=_IGNORE, dirs_exist_ok=True)
    return dest


# --- the backend ------------------------------------------------------------------------------

_SETTINGS = {
    "subscription_id", "resource_group", "workspace", "config", "compute", "vm_size", "min_nodes", "max_nodes",
    "tier", "idle_time_before_scale_down", "create_cluster", "datastore", "environments", "dockerfiles",
    "poll_seconds", "shm_size", "launcher", "share_mode", "ml_client", "credential", "client_kwargs",
}


class AzureMLBackend:
    """Runs each planned run as an Azure ML command job; see the module docstring."""

    name: ClassVar[str] = "azureml"
    uses_local_kernels: ClassVar[bool] = False  # kernels live in the framework images

    def __init__(
        self,
        *,
        subscription_id: str | None = None,
        resource_group: str | None = None,
        workspace: str | None = None,
        config: str | None = None,
        compute: str = DEFAULT_CLUSTER,
        vm_size: str = DEFAULT_VM_SIZE,
        min_nodes: int = 0,
        max_nodes: int = 2,
        tier: str = "dedicated",
        idle_time_before_scale_down: int = 1800,
        create_cluster: bool = True,
        datastore: str | None = None,
        environments: Mapping[str, str] | None = None,
        dockerfiles: str | None = None,
        poll_seconds: float = 30.0,
        shm_size: str | None = None,
        launcher: str = DEFAULT_LAUNCHER,
        share_mode: str = "mount",
        ml_client: MLClient | None = None,
        credential: Any = None,
        client_kwargs: Mapping[str, Any] | None = None,
        **unknown: Any,
    ) -> None:
        """Configure from the experiment's ``backend:`` settings (all optional).

        ``compute`` names the cluster (created on first submit unless ``create_cluster: false``)
        sized by ``vm_size``, ``min_nodes``, ``max_nodes``, ``tier`` (dedicated | low_priority) and
        ``idle_time_before_scale_down`` (seconds). ``datastore`` names the workspace datastore of
        the experiment's file share (default ``nbbatch_<account>_<share>``). ``environments`` maps a
        framework (or ``"*"``) to an existing Azure ML environment (``azureml:name:version``)
        instead of building ``dockerfiles/<framework>/``. ``share_mode`` is ``mount`` (the share is
        the job's rw_mount output) or ``direct`` (the job opens ``azfiles://`` itself with the
        cluster's managed identity). ``ml_client``/``credential``/``client_kwargs`` are for Python
        callers and tests.
        """
        if unknown:
            bad = sorted(unknown)[0]
            raise BackendError(f"unknown azureml backend setting `{bad}`{did_you_mean(bad, _SETTINGS)}; "
                               f"known: {', '.join(sorted(_SETTINGS - {'ml_client', 'credential', 'client_kwargs'}))}")
        if share_mode not in ("mount", "direct"):
            raise BackendError(f"share_mode `{share_mode}` must be `mount` or `direct`")
        self.cluster_settings = ClusterSettings(compute, vm_size, min_nodes, max_nodes, tier,
                                                idle_time_before_scale_down)
        self.workspace_settings = {"subscription_id": subscription_id, "resource_group": resource_group,
                                   "workspace": workspace, "config": config}
        self.create_cluster = bool(create_cluster)
        self.datastore = datastore
        self.environments = dict(environments or {})
        self.dockerfiles = Path(dockerfiles) if dockerfiles else None
        self.poll_seconds = float(poll_seconds)
        self.shm_size = shm_size
        self.launcher = launcher
        self.share_mode = share_mode
        self._credential = credential
        self._client_kwargs = dict(client_kwargs or {})
        self._ml_client = ml_client
        self._environment_refs: dict[str, str] = {}

    # --- connections ------------------------------------------------------------------------
    @property
    def ml_client(self) -> MLClient:
        """The workspace client (connected on first use)."""
        if self._ml_client is None:
            self._ml_client = connect(credential=self._credential, **self.workspace_settings, **self._client_kwargs)
        return self._ml_client

    @property
    def cluster(self) -> AzureMLCluster:
        """The compute cluster these settings name."""
        return AzureMLCluster(self.ml_client, self.cluster_settings)

    # --- Backend protocol ---------------------------------------------------------------------
    def compute(self) -> Compute:
        """The cluster's nodes (all of them count as slots: one run per node)."""
        status = self.cluster.status()
        nodes = [{"name": n["name"], "state": n["state"], "cpus": None, "gpus": None} for n in status.nodes]
        return Compute(backend=self.name, nodes=nodes, slots=self.cluster_settings.max_nodes,
                       details={"cluster": status.to_dict(), "summary": status.summary()})

    def check(self, runs: Sequence[Run]) -> None:
        """Fail before anything starts when a run has no environment to run in."""
        for run in runs:
            self._environment_for(run, register=False)

    def submit(self, runs: Sequence[Run], share: Share, options: SubmitOptions) -> None:
        """Submit one command job per run (skipping succeeded runs and runs whose job is still active)."""
        from nbbatch.store.records import new_record, read_record, write_record

        location = _azure_files_location(share)
        force = bool(options.extra.get("force", False))
        todo: list[Run] = []
        for run in runs:
            record = read_record(share, run.experiment, run.run_id)
            if record is not None and record.status == "succeeded" and not force:
                continue
            state = self.job_state(share, run.experiment, run.run_id)
            if state is not None and state.status in ("queued", "running") and not force:
                if self._refresh_state(state) in ("queued", "running"):
                    continue  # its job is still in flight: do not start it twice
            todo.append(run)
        if not todo:
            return
        for run in todo:
            self._environment_for(run, register=False)
        if self.create_cluster:
            self.cluster.ensure()
        elif not self.cluster.status().exists:
            raise BackendError(f"cluster `{self.cluster_settings.name}` does not exist and create_cluster is false; "
                               "create it with `nbbatch cluster create`")
        datastore = self.datastore or _datastore_name_for(location.account, location.share)
        if self.share_mode == "mount":
            ensure_datastore(self.ml_client, datastore, location.account, location.share)
        with tempfile.TemporaryDirectory(prefix="nbbatch-code-") as tmp:
            code_dir = build_code_snapshot(todo, Path(tmp) / "code")
            for run in todo:
                job = self.build_job(run, self._environment_for(run, register=True), code_dir,
                                     datastore=datastore, share_url=location.url, share_prefix=location.prefix)
                try:
                    created = self.ml_client.jobs.create_or_update(job)
                except HttpResponseError as exc:
                    raise BackendError(f"Azure ML refused the job for run {run.run_id}: {_message(exc)}") from exc
                job_status = _job_status_text(created.status)
                status, note = map_job_status(job_status)
                state = JobState(run.run_id, created.name, run.experiment, studio_url=created.studio_url,
                                 job_status=job_status, status=status, note=note, submitted_at=utc_now(),
                                 updated_at=utc_now())
                share.write_bytes(f"{run.experiment}/{run.run_id}/{JOB_FILE}", state.to_json())
                record = read_record(share, run.experiment, run.run_id) or new_record(run, self.name)
                if record.final:
                    record = new_record(run, self.name)
                record.backend = self.name
                write_record(share, record)
                if options.on_update:
                    options.on_update(record)
        if options.wait:
            self.wait(todo[0].experiment, share, [r.run_id for r in todo], options)

    def build_job(
        self,
        run: Run,
        environment: str,
        code: str | os.PathLike[str],
        *,
        datastore: str,
        share_url: str,
        share_prefix: str = "",
    ) -> Command:
        """The command job of one run (what :meth:`submit` sends; also handy to inspect or dump as YAML)."""
        from nbbatch.redact import SECRET_NAME_HINTS as SECRET_ENV_HINTS

        secret = sorted(k for k in run.env if any(h in k.upper() for h in SECRET_ENV_HINTS))
        if secret:
            raise BackendError(
                f"run {run.run_id} sets `{secret[0]}` in `env:`; on Azure ML a run's settings are part of the job's "
                "command, visible in the studio and the job's history, so they must hold no secrets. Keep secrets in "
                "a workspace connection or Key Vault and read them from the notebook"
            )
        remote = dataclasses.replace(run, notebook=run.notebook_rel,
                                     cwd=run.cwd if run.cwd and not Path(run.cwd).is_absolute() else None)
        spec = json.dumps(remote.to_dict(), sort_keys=True, separators=(",", ":"))
        gpus = ",".join(str(i) for i in range(run.gpus))
        share_arg = "${{outputs.share}}" if self.share_mode == "mount" else shlex.quote(share_url)
        parts = [self.launcher, "run-one", "--spec", shlex.quote(spec), "--share", share_arg, "--backend", self.name]
        if gpus:
            parts += ["--gpus", gpus]
        outputs = {}
        if self.share_mode == "mount":
            path = f"azureml://datastores/{datastore}/paths/{share_prefix.strip('/')}"
            outputs["share"] = Output(type="uri_folder", path=path.rstrip("/") + "/", mode="rw_mount")
        tags = {"nbbatch": "1", "run_id": run.run_id, "experiment": run.experiment,
                "framework": run.framework or "", "notebook": run.notebook_rel,
                "parameters": json.dumps(run.parameters, sort_keys=True, default=str)[:1000]}
        job = command(
            name=_job_name(run.run_id),
            display_name=run.run_id,
            experiment_name=run.experiment,
            description=f"nbbatch run {run.run_id}: {run.notebook_rel}",
            code=str(code),
            command=" ".join(parts),
            environment=environment,
            compute=self.cluster_settings.name,
            outputs=outputs,
            tags=tags,
            instance_count=1,
            shm_size=self.shm_size,
            timeout=int(run.timeout_s) + 600 if run.timeout_s else None,
        )
        return job

    def _environment_for(self, run: Run, register: bool) -> str:
        key = run.framework or "*"
        if key in self.environments or "*" in self.environments:
            return self.environments.get(key) or self.environments["*"]
        if not run.framework:
            raise BackendError(f"run {run.run_id} ({run.notebook_rel}) has no framework, so the azureml backend has "
                               "no image for it; set `environments: {'*': azureml:<name>:<version>}` in `backend:`")
        if key in self._environment_refs:
            return self._environment_refs[key]
        from nbbatch.spec.frameworks import get_framework
        from nbbatch.spec.project import Project

        root = _project_root_of(run)
        framework = get_framework(run.framework, Project(root))
        dockerfiles = self.dockerfiles or root / "dockerfiles"
        env = framework_environment(framework, dockerfiles)
        if not register:
            return f"azureml:{env.name}:{env.version}"
        registered = ensure_environment(self.ml_client, framework, dockerfiles)
        ref = f"azureml:{registered.name}:{registered.version}"
        self._environment_refs[key] = ref
        return ref

    # --- state ------------------------------------------------------------------------------------
    def job_state(self, share: Share, experiment: str, run_id: str) -> JobState | None:
        """The run's ``azureml.json``, or None when it was never submitted to Azure ML."""
        try:
            return JobState.from_json(share.read_bytes(f"{experiment}/{run_id}/{JOB_FILE}"))
        except (FileNotFoundError, ValueError, TypeError):
            return None

    def _refresh_state(self, state: JobState) -> str:
        try:
            job = self.ml_client.jobs.get(state.job_name)
        except ResourceNotFoundError:
            state.job_status, state.status, state.note = None, "failed", "the Azure ML job no longer exists"
            return state.status
        state.job_status = _job_status_text(job.status)
        state.status, state.note = map_job_status(state.job_status)
        state.studio_url = job.studio_url or state.studio_url
        state.updated_at = utc_now()
        return state.status

    def refresh(self, experiment: str, share: Share) -> None:
        """Bring run records up to date with their jobs' states."""
        self._refresh(experiment, share, None)

    def _refresh(self, experiment: str, share: Share, run_ids: Sequence[str] | None) -> list[RunRecord]:
        from nbbatch.store.records import read_record, write_record

        changed: list[RunRecord] = []
        for run_id in run_ids if run_ids is not None else share.list(experiment):
            state = self.job_state(share, experiment, run_id)
            if state is None:
                continue
            record = read_record(share, experiment, run_id)
            if record is not None and record.final and state.status in FINAL_STATUSES:
                continue
            before = (state.job_status, state.note)
            self._refresh_state(state)
            if (state.job_status, state.note) != before:
                share.write_bytes(f"{experiment}/{run_id}/{JOB_FILE}", state.to_json())
            if record is None or record.final:
                continue
            if _reconcile(record, state):
                write_record(share, record)
                changed.append(record)
        return changed

    def wait(self, experiment: str, share: Share, run_ids: Sequence[str], options: SubmitOptions) -> None:
        """Poll until every run in ``run_ids`` is final, reporting changes through ``options.on_update``."""
        from nbbatch.store.records import read_record

        seen: dict[str, tuple[str, int]] = {}
        while True:
            self._refresh(experiment, share, run_ids)
            pending = 0
            for run_id in run_ids:
                record = read_record(share, experiment, run_id)
                if record is None:
                    continue
                key = (record.status, record.cells_done)
                if seen.get(run_id) != key:
                    seen[run_id] = key
                    if options.on_update:
                        options.on_update(record)
                if not record.final:
                    pending += 1
            if not pending:
                return
            time.sleep(self.poll_seconds)

    def cancel(self, experiment: str, share: Share, run_ids: Sequence[str] | None = None) -> list[str]:
        """Cancel the jobs of unfinished runs (all when ``run_ids`` is None); return the run ids asked to stop."""
        from nbbatch.store.records import read_record, write_record

        targets = list(run_ids) if run_ids else share.list(experiment)
        asked: list[str] = []
        for run_id in targets:
            state = self.job_state(share, experiment, run_id)
            record = read_record(share, experiment, run_id)
            if state is None or record is None or record.final:
                continue
            try:
                self.ml_client.jobs.begin_cancel(state.job_name)
            except ResourceNotFoundError:
                pass
            share.write_bytes(f"{experiment}/{run_id}/{CANCEL_MARKER}", utc_now().encode())
            state.job_status, state.status, state.note = "CancelRequested", "cancelled", None
            state.updated_at = utc_now()
            share.write_bytes(f"{experiment}/{run_id}/{JOB_FILE}", state.to_json())
            record.status, record.ended_at = "cancelled", record.ended_at or utc_now()
            record.error = RunError("Cancelled", f"Azure ML job {state.job_name}", reason="cancelled by the user")
            write_record(share, record)
            asked.append(run_id)
        return asked

    def stream_log(self, experiment: str, share: Share, run_id: str, follow: bool = False) -> Iterator[str] | None:
        """With ``follow``, the job's own log stream (image build, node setup, stdout) until it ends.

        Without ``follow`` (or for runs never sent to Azure ML) ``None``: read ``log.txt`` from the share.
        """
        state = self.job_state(share, experiment, run_id)
        if not follow or state is None:
            return None
        return _stream_job(self.ml_client, state.job_name)


def job_yaml(job: Command) -> str:
    """A command job as the YAML ``az ml job create --file`` (and ``azure.ai.ml.load_job``) reads."""
    stream = io.StringIO()
    # A `command()` builder dumps as a pipeline node; its job form is what a job YAML file holds.
    job._to_job().dump(stream)  # noqa: SLF001 - the SDK's own conversion, not exposed publicly
    return stream.getvalue()


def _reconcile(record: RunRecord, state: JobState) -> bool:
    """Apply a job's state to a record that is not final; True when the record changed."""
    if state.status == "running" and record.status == "queued":
        record.status = "running"
        return True
    if state.status in FINAL_STATUSES:
        record.status = state.status
        record.ended_at = record.ended_at or utc_now()
        if state.status == "failed" and record.error is None:
            where = f" ({state.studio_url})" if state.studio_url else ""
            reason = state.note or "the job ended before the run finished: see `nbbatch logs --follow` or the studio"
            record.error = RunError("AzureMLJobFailed", f"Azure ML job {state.job_name} failed{where}", reason=reason)
        if state.status == "cancelled" and record.error is None:
            record.error = RunError("Cancelled", f"Azure ML job {state.job_name}", reason="cancelled in Azure ML")
        return True
    return False


def _job_name(run_id: str) -> str:
    return f"{run_id}-{uuid.uuid4().hex[:8]}"


def _azure_files_location(share: Share) -> AzureFilesLocation:
    from nbbatch.store.azfiles import AzureFileShare, parse_azfiles_url

    if isinstance(share, AzureFileShare):
        return share.location
    if str(getattr(share, "url", "")).startswith("azfiles://"):
        return parse_azfiles_url(share.url)
    raise BackendError(
        f"the azureml backend writes results to an Azure File share, but this experiment's share is "
        f"{getattr(share, 'url', share)}; set `share: azfiles://<storage account>/<file share>` in the experiment file"
    )


# --- log streaming ----------------------------------------------------------------------------


class _ThreadStdout(io.TextIOBase):
    """``sys.stdout`` stand-in: one thread's writes go to a queue, everyone else's to the real stdout."""

    def __init__(self, original: Any, owner: int, sink: queue.Queue[str | None]):
        self.original, self.owner, self.sink = original, owner, sink

    def write(self, text: str) -> int:
        if threading.get_ident() == self.owner:
            self.sink.put(text)
        else:
            self.original.write(text)
        return len(text)

    def flush(self) -> None:
        self.original.flush()


_STDOUT_LOCK = threading.Lock()


def _stream_job(ml_client: MLClient, job_name: str) -> Iterator[str]:
    """Lines of ``MLClient.jobs.stream`` (which prints to stdout) as an iterator."""
    sink: queue.Queue[str | None] = queue.Queue()
    failure: list[BaseException] = []
    started = threading.Event()

    def worker() -> None:
        started.wait()
        try:
            ml_client.jobs.stream(job_name)
        except Exception as exc:  # noqa: BLE001 - reported to the consumer as the stream's last line
            failure.append(exc)
        finally:
            sink.put(None)

    thread = threading.Thread(target=worker, name=f"azureml-stream-{job_name}", daemon=True)
    with _redirected_stdout(thread, sink):
        started.set()
        buffer = ""
        while True:
            chunk = sink.get()
            if chunk is None:
                break
            buffer += chunk
            while "\n" in buffer:
                line, buffer = buffer.split("\n", 1)
                yield line + "\n"
        if buffer:
            yield buffer
    thread.join(timeout=5)
    if failure:
        yield f"(log stream ended: {type(failure[0]).__name__}: {_message(failure[0])})\n"


@contextmanager
def _redirected_stdout(thread: threading.Thread, sink: queue.Queue[str | None]) -> Iterator[None]:
    with _STDOUT_LOCK:
        original = sys.stdout
        thread.start()
        proxy = _ThreadStdout(original, thread.ident or 0, sink)
        sys.stdout = proxy
    try:
        yield
    finally:
        with _STDOUT_LOCK:
            if sys.stdout is proxy:
                sys.stdout = original


# --- CLI --------------------------------------------------------------------------------------


def _settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    if getattr(args, "experiment", None):
        from nbbatch.spec.experiment import load_experiment

        spec = load_experiment(args.experiment)
        if spec.backend != "azureml":
            raise BackendError(f"{args.experiment} uses the `{spec.backend}` backend, not azureml")
        settings.update(spec.backend_settings)
    for key in ("subscription_id", "resource_group", "workspace", "config", "vm_size", "min_nodes", "max_nodes",
                "tier", "idle_time_before_scale_down"):
        value = getattr(args, key, None)
        if value is not None:
            settings[key] = value
    if getattr(args, "name", None):
        settings["compute"] = args.name
    return settings


def cli_cluster(args: argparse.Namespace, ml_client: MLClient | None = None) -> int:
    """``nbbatch cluster create|status|scale|delete``: manage the azureml backend's compute cluster.

    Reads ``args.action`` and the optional ``experiment``, ``name``, ``vm_size``, ``min_nodes``,
    ``max_nodes``, ``tier``, ``idle_time_before_scale_down``, ``subscription_id``,
    ``resource_group``, ``workspace``, ``config``, ``no_wait`` and ``json`` attributes.
    """
    settings = _settings_from_args(args)
    known = {k: v for k, v in settings.items() if k in _SETTINGS}
    backend = AzureMLBackend(ml_client=ml_client, **known)
    cluster = backend.cluster
    wait = not getattr(args, "no_wait", False)
    action = args.action
    if action == "create":
        status = cluster.create(wait=wait)
    elif action == "status":
        status = cluster.status()
    elif action == "scale":
        if getattr(args, "min_nodes", None) is None and getattr(args, "max_nodes", None) is None:
            raise BackendError("nbbatch cluster scale needs --min-nodes and/or --max-nodes")
        status = cluster.scale(getattr(args, "min_nodes", None), getattr(args, "max_nodes", None), wait=wait)
    elif action == "delete":
        deleted = cluster.delete(wait=wait)
        print(f"cluster {cluster.name}: {'deleted' if deleted else 'did not exist'}")
        return 0
    else:
        raise BackendError(f"unknown cluster action `{action}`{did_you_mean(action, ['create', 'status', 'scale', 'delete'])}")
    if getattr(args, "json", False):
        print(json.dumps(status.to_dict(), indent=2))
    else:
        print(status.summary())
    return 0
