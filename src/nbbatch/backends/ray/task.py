"""How a run asks Ray for resources: the plain data that travels from the driver to the supervisor and the node."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


def gpu_request(gpus: int, runs_per_gpu: int | str) -> tuple[float, bool]:
    """Ray's ``num_gpus`` for a run asking ``gpus`` GPUs, and whether it shares its GPU with other runs.

    One-GPU runs with ``runs_per_gpu`` > 1 ask for ``1/runs_per_gpu`` (rounded down to Ray's 1e-4
    granularity, so ``runs_per_gpu`` of them fit on one GPU); anything else asks for whole GPUs. Ray
    places runs itself and knows nothing of their memory, so ``auto`` asks for whole GPUs too.
    """
    if gpus == 1 and isinstance(runs_per_gpu, int) and runs_per_gpu > 1:
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
    gang_timeout_s: float = 300.0  # a distributed run: how long its nodes may take to be given (and to meet)
    container_images: dict[str, str] = field(default_factory=dict)  # container: true: framework → image tag
    container_engine: str | None = None  # container: true: the engine that starts the image on the node

    @property
    def run_id(self) -> str:
        return str(self.run["run_id"])

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def gang_size(spec: dict[str, Any]) -> int:
    """How many nodes a task spec's run spans as a gang (0: an ordinary run, one task)."""
    distribution = spec["run"].get("distribution") or {}
    return int(distribution["nodes"]) if distribution else 0


def gang_bundles(spec: dict[str, Any]) -> list[dict[str, float]]:
    """The placement group bundles of a distributed run: one per node, each holding that node's task."""
    bundle: dict[str, float] = {"CPU": float(spec["num_cpus"]) or 0.001}  # Ray refuses a bundle of zeros
    if spec["num_gpus"]:
        bundle["GPU"] = float(spec["num_gpus"])
    bundle.update({str(k): float(v) for k, v in (spec.get("resources") or {}).items()})
    return [dict(bundle) for _ in range(gang_size(spec))]
