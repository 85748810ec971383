"""What a run is given: its GPUs, how runs share them, and what a distributed run spans.

Typed values the experiment holds and that travel unchanged to the plan's runs, the backends' submit
options and the widgets, so no layer re-reads the experiment file's keys.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from typing import Any

from nbbatch.errors import SpecError, did_you_mean

DISTRIBUTIONS = ("torch", "jax", "tensorflow", "mpi")  # distribution.type
ONE_PROCESS_PER_NODE = ("jax", "tensorflow")  # one process per node drives all of the node's GPUs


@dataclass(frozen=True)
class Distribution:
    """What one distributed run spans: ``nodes`` × ``processes_per_node`` ranks (one kernel each).

    ``gpus_per_node`` is what each node gives the run (0: CPU ranks over gloo); ``type`` is how the ranks
    meet: torch (as under torchrun), jax, tensorflow or mpi.
    """

    type: str
    nodes: int
    processes_per_node: int
    gpus_per_node: int

    @property
    def world_size(self) -> int:
        """How many ranks (kernels) the run has."""
        return self.nodes * self.processes_per_node

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (a run's spec, the run id's hash, job tags): ``{type, nodes, processes_per_node, gpus_per_node}``."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Distribution | None:
        """The inverse of :meth:`to_dict`; ``None`` or ``{}`` (a one-process run, as older specs wrote it): ``None``."""
        return cls(**data) if data else None


AUTO = "auto"  # resources.runs_per_gpu: as many runs as fit in the GPU's memory
AUTO_CAP = 16  # runs per GPU at most under `auto`


def auto_cap(gpu_count: int, cpus: int | None = None) -> int:
    """Runs per GPU at most under ``auto``: :data:`AUTO_CAP`, and no more than the CPU cores per GPU."""
    cpus = cpus or os.cpu_count() or 1
    return max(1, min(AUTO_CAP, cpus // max(1, gpu_count)))


@dataclass(frozen=True)
class Resources:
    """What each run of an experiment gets, and how runs share the compute.

    ``gpus`` is per run, or per node of a distributed run (then equal to ``distribution.gpus_per_node``).
    """

    gpus: int = 0
    cpus: int | None = None  # cores per run (per node of a distributed one); None: local: its share, Slurm: `cpus`
    runs_per_gpu: int | str = AUTO  # a number, or "auto": packed by memory (see nbbatch.backends.local.gpus)
    mps: bool = False  # the runs on a GPU share it through a CUDA MPS daemon nbbatch starts
    max_parallel: int | None = None  # None: as many as the compute allows
    max_runs: int = 10_000  # the most runs the experiment may plan: a larger sweep is refused before it is expanded
    distribution: Distribution | None = None  # None: each run is one kernel

    @classmethod
    def of(cls, distribution: str | None = None, nodes: int = 1, processes_per_node: int | None = None,
           gpus_per_node: int | None = None, **shared: Any) -> Resources:
        """The resources as an experiment file writes them (``resources:`` keys, ``distribution.type``), checked
        and with a distributed run's defaults filled in; raises :class:`SpecError` naming the first mistake."""
        resources = cls(**shared)
        if distribution is None:
            asked = [key for key, value, default in (("nodes", nodes, 1), ("processes_per_node", processes_per_node, None),
                                                     ("gpus_per_node", gpus_per_node, None)) if value != default]
            if asked:
                raise SpecError(f"`resources.{asked[0]}` spreads a run over several processes, but the experiment has no "
                                f"`distribution:`; add distribution: {{type: torch}} (or {', '.join(DISTRIBUTIONS[1:])}), "
                                "or drop it (resources.gpus gives a run its GPUs)")
            return resources
        if gpus_per_node is not None and resources.gpus not in (0, gpus_per_node):
            raise SpecError(f"`resources.gpus: {resources.gpus}` and `gpus_per_node: {gpus_per_node}` disagree; a "
                            "distributed run's GPUs are per node: give only gpus_per_node")
        gpus = resources.gpus if gpus_per_node is None else gpus_per_node
        if processes_per_node is None:
            processes_per_node = 1 if distribution in ONE_PROCESS_PER_NODE else max(gpus, 1)
        return replace(resources, gpus=gpus, distribution=Distribution(distribution, nodes, processes_per_node, gpus))


def resources_problem(resources: Resources) -> str | None:
    """What is wrong between the values of ``resources`` (their shapes are the schema's), or ``None``."""
    if resources.mps and not resources.gpus:
        return ("`resources.mps: true` shares GPUs between runs, but the runs ask for no GPU "
                "(resources.gpus is 0): set resources.gpus ≥ 1 or drop mps")
    world = resources.distribution
    if world is None:
        return None
    if world.type not in DISTRIBUTIONS:
        return (f"`distribution.type` must be one of {', '.join(DISTRIBUTIONS)} "
                f"(got {world.type!r}){did_you_mean(str(world.type), DISTRIBUTIONS)}")
    if world.gpus_per_node != resources.gpus:
        return (f"`resources.gpus: {resources.gpus}` and `gpus_per_node: {world.gpus_per_node}` disagree; a "
                "distributed run's GPUs are per node: give only gpus_per_node")
    ranks, gpus = world.processes_per_node, world.gpus_per_node
    if world.type in ONE_PROCESS_PER_NODE and ranks != 1:
        return (f"distribution `{world.type}` runs one process per node, which drives all the node's "
                f"GPUs (resources.processes_per_node is {ranks}); set processes_per_node: 1 and "
                "gpus_per_node to the GPUs each node gives, or use nodes: for more processes")
    if world.type not in ONE_PROCESS_PER_NODE and gpus and ranks != gpus:
        return (f"`resources.processes_per_node: {ranks}` with gpus_per_node: {gpus}: each rank drives one "
                "GPU (NCCL cannot share a GPU between ranks); make them equal")
    if resources.runs_per_gpu != AUTO and int(resources.runs_per_gpu) > 1:
        return (f"`resources.runs_per_gpu: {resources.runs_per_gpu}` shares GPUs between runs, but a distributed "
                "run's ranks need their GPUs to themselves (NCCL cannot share a GPU between processes); "
                "drop runs_per_gpu or distribution")
    if resources.mps:
        return ("`resources.mps: true` shares GPUs between runs, but a distributed run's ranks need their GPUs "
                "to themselves; drop mps or distribution")
    return None
