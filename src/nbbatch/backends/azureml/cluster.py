"""The azureml backend's compute cluster: an ``AmlCompute`` cluster nbbatch creates, inspects, resizes and deletes."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from azure.ai.ml import MLClient
from azure.ai.ml.entities import AmlCompute
from azure.core.exceptions import AzureError, HttpResponseError, ResourceNotFoundError

from nbbatch.backends.azureml.rules import check_name, cluster_create_hint
from nbbatch.backends.azureml.workspace import error_codes, error_text
from nbbatch.backends.settings import setting
from nbbatch.errors import BackendError

DEFAULT_CLUSTER = "nbbatch-gpu"
DEFAULT_VM_SIZE = "Standard_NC4as_T4_v3"
TIERS = ("dedicated", "low_priority")
VM_SIZES = ("Standard_NC4as_T4_v3", "Standard_NC6s_v3", "Standard_NC24ads_A100_v4", "Standard_ND96asr_v4",
            "Standard_D4s_v5")  # what a form offers (any size the region has is allowed)
# GPUs of one VM of the sizes nbbatch knows (Azure's size names are case-insensitive). A size not here is not
# checked; sizes with a fraction of a GPU (Standard_NV6ads_A10_v5 …) are left out on purpose.
VM_GPUS = {
    "Standard_NC4as_T4_v3": 1, "Standard_NC8as_T4_v3": 1, "Standard_NC16as_T4_v3": 1, "Standard_NC64as_T4_v3": 4,
    "Standard_NC6s_v3": 1, "Standard_NC12s_v3": 2, "Standard_NC24s_v3": 4, "Standard_NC24rs_v3": 4,
    "Standard_ND40rs_v2": 8,
    "Standard_NC24ads_A100_v4": 1, "Standard_NC48ads_A100_v4": 2, "Standard_NC96ads_A100_v4": 4,
    "Standard_ND96asr_v4": 8, "Standard_ND96amsr_A100_v4": 8,
    "Standard_NC40ads_H100_v5": 1, "Standard_NC80adis_H100_v5": 2,
    "Standard_ND96isr_H100_v5": 8, "Standard_ND96isr_H200_v5": 8,
    "Standard_NV36ads_A10_v5": 1, "Standard_NV72ads_A10_v5": 2,
}
_VM_GPUS_LOWER = {name.lower(): n for name, n in VM_GPUS.items()}
_CPU_ONLY = re.compile(r"standard_[def]s?\d", re.IGNORECASE)  # D, DS, E, F families: general purpose, no GPU


def vm_gpus(vm_size: str) -> int | None:
    """How many GPUs one VM of ``vm_size`` has (None: a size nbbatch does not know)."""
    known = _VM_GPUS_LOWER.get(vm_size.lower())
    if known is not None:
        return known
    return 0 if _CPU_ONLY.match(vm_size) else None


def vm_sizes_with(gpus: int) -> list[str]:
    """Known VM sizes with at least ``gpus`` GPUs, fewest GPUs first."""
    return [name for n, name in sorted((n, name) for name, n in VM_GPUS.items() if n >= gpus)]


@dataclass(frozen=True)
class ClusterSettings:
    """How a compute cluster is sized: its name, VM size, node range, priority tier, idle time before scale-down.

    Declared once: the azureml backend's settings extend it (:class:`~nbbatch.backends.azureml.AzureMLSettings`),
    and its fields' metadata drive validation, the Jupyter form and ``nbbatch cluster``'s options.
    """

    compute: str = field(default=DEFAULT_CLUSTER, metadata=setting(label="cluster name", option="--name"))
    vm_size: str = field(default=DEFAULT_VM_SIZE, metadata=setting(suggestions=VM_SIZES, label="VM size",
                                                                    option="--vm-size"))
    min_nodes: int = field(default=0, metadata=setting(minimum=0, label="min nodes", option="--min-nodes"))
    max_nodes: int = field(default=2, metadata=setting(minimum=1, label="max nodes", option="--max-nodes"))
    # suggestions, not choices: the tier takes aliases too ("low-priority", "LowPriority", "spot")
    tier: str = field(default="dedicated", metadata=setting(suggestions=TIERS, label="priority", option="--tier"))
    idle_time_before_scale_down: int = field(default=1800, metadata=setting(minimum=0, option="--idle-seconds"))  # s

    def __post_init__(self) -> None:
        tier = self.tier.replace("-", "_").lower()
        tier = {"lowpriority": "low_priority", "low": "low_priority", "spot": "low_priority"}.get(tier, tier)
        if tier not in TIERS:
            raise BackendError(f"cluster tier `{self.tier}` is not one of {', '.join(TIERS)}")
        object.__setattr__(self, "tier", tier)
        check_name("compute", self.compute, "cluster name")  # the service's rule (rules.yaml), before anything is created
        if not (0 <= int(self.min_nodes) <= int(self.max_nodes)) or int(self.max_nodes) < 1:
            raise BackendError(f"cluster nodes must satisfy 0 <= min_nodes <= max_nodes and max_nodes >= 1 "
                               f"(got min_nodes={self.min_nodes}, max_nodes={self.max_nodes})")
        for name in ("min_nodes", "max_nodes", "idle_time_before_scale_down"):
            object.__setattr__(self, name, int(getattr(self, name)))

    @property
    def name(self) -> str:
        """The cluster's name (the ``compute`` setting)."""
        return self.compute

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

    def waiting_note(self) -> str | None:
        """What a job queued on this cluster waits on (None: nothing worth saying): errors that keep the cluster from
        getting nodes (a VM family without quota, a size the region lacks) until someone acts, or a resize under way."""
        if self.errors:
            return f"waiting for nodes: cluster {self.name} cannot allocate: {'; '.join(self.errors)}"
        if str(self.allocation_state or "").lower() == "resizing":
            nodes = f" ({self.current_nodes or 0} of {self.target_nodes} nodes)" if self.target_nodes is not None else ""
            return f"waiting for nodes: cluster {self.name} is resizing{nodes}"
        return None


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
                hint = cluster_create_hint(error_codes(exc))
                raise BackendError(f"cannot create cluster `{self.name}` ({self.settings.vm_size}), the service "
                                   f"answered: {error_text(exc)}" + (f". Likely cause: {hint}" if hint else "")) from exc
        return self.status()

    def provision(self, wait: bool = True) -> str:
        """Create the cluster if missing, else resize its node range to the settings'; what could not change.

        An existing cluster keeps its VM size and tier: the note says when the settings' differ (empty: none do)."""
        status = self.create(wait=wait)
        wanted = (self.settings.min_nodes, self.settings.max_nodes)
        if status.exists and (status.min_nodes, status.max_nodes) != wanted:
            status = self.scale(*wanted, wait=wait)
        differ = [f"{key} is {value}" for key, value in (("vm_size", status.vm_size), ("tier", status.tier))
                  if value and str(value).lower() != str(getattr(self.settings, key)).lower()]
        if not status.exists or not differ:
            return ""
        return (f"cluster {self.name} exists and its {' and its '.join(differ)}: only its node range changes; "
                "delete it (cluster.delete()) or choose another cluster name to change the others")

    def capacity(self) -> tuple[str, int, bool]:
        """``(vm_size, max_nodes, exists)``: the existing cluster's own (:meth:`create` keeps them), else the settings'."""
        compute = self._get()
        if compute is None:
            return self.settings.vm_size, self.settings.max_nodes, False
        max_nodes = compute.max_instances if compute.max_instances is not None else self.settings.max_nodes
        return compute.size or self.settings.vm_size, int(max_nodes), True

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

    def allocation(self) -> ClusterStatus:
        """Only the allocation state, node counts and errors (one request: what a queued job waits on)."""
        status = ClusterStatus(self.name, exists=True)
        self._add_allocation(status)
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
        self.settings = dataclasses.replace(self.settings, min_nodes=new_min, max_nodes=new_max)
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
