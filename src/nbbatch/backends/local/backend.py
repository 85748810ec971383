"""The local backend: runs in parallel on this machine, packed onto its GPUs.

Each run executes in a worker thread of this process (papermill is imported once; the kernels are
separate processes, the next ones started ahead of their runs). Runs start longest-first by their
past durations, GPU runs get ``CUDA_VISIBLE_DEVICES`` from a :class:`~nbbatch.backends.local.gpus.SlotPool`
(by count, or by memory with ``runs_per_gpu: auto``), CPU runs get it empty. A run that runs out of
GPU memory while sharing its GPU is run again, alone. With ``resources.mps`` the runs are clients of
a CUDA MPS daemon started for the batch. Ctrl-C cancels: kernels are killed, runs are marked
``cancelled``, finished output stays, the MPS daemon is stopped. The scheduling lives in
:mod:`nbbatch.backends.local.scheduler`.

With ``container: true`` each run executes ``nbbatch run-one`` inside its framework's image
(:mod:`nbbatch.containers`) instead of a kernel of this machine's venv; placement is the same.

A distributed run (:mod:`nbbatch.execute.ranks`) takes its GPUs as one gang, to itself, and counts as
its ranks against ``max_parallel``; its ranks rendezvous on free ports of 127.0.0.1. This machine is one
node; ``NBBATCH_SIMULATE_NODES=1`` (for tests) runs every node of a run here, each a launcher of its own
(with ``container: true``, each node's launcher and ranks in a container of their own).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from nbbatch.backends.base import Backend, Capabilities, Compute, SubmitOptions
from nbbatch.backends.local.cores import CorePool
from nbbatch.backends.local.gpus import GpuInfo, GpuLease, SlotPool, detect_gpus
from nbbatch.backends.local.mps import check_mps
from nbbatch.backends.local.scheduler import SIMULATE_NODES_ENV, nodes_here, run_batch
from nbbatch.backends.settings import setting
from nbbatch.containers.checks import (
    build_framework_images,
    framework_images,
    refuse_image_settings_without_container,
    refuse_runs_without_image,
)
from nbbatch.containers.engines import Engine, find_engine
from nbbatch.containers.runner import execute_in_container
from nbbatch.errors import ContainerError, ValidationError
from nbbatch.execute.attempts import execute_run
from nbbatch.execute.context import AttemptContext, SamplerCallback
from nbbatch.execute.placement import local_placements
from nbbatch.plan.runs import Run
from nbbatch.spec.project import Project
from nbbatch.store.lock import pid_alive
from nbbatch.store.runjson import ContainerInfo, ErrorKind, GpuSharing, RunError, RunRecord
from nbbatch.store.share import Share

if TYPE_CHECKING:
    from nbbatch.execute.prestart import KernelPool


@dataclass(frozen=True)
class LocalSettings:
    """The local backend's settings (the experiment's ``backend:`` mapping)."""

    max_parallel: int | None = field(default=None, metadata=setting(minimum=1))
    prestart: int | None = field(default=None, metadata=setting(minimum=0))  # kernels started ahead (None: PRESTART_DEFAULT)
    container: bool = False  # run each run inside its framework's image
    engine: str = field(default="auto", metadata=setting(choices=("auto", "docker", "podman")))  # the container engine
    cpu_image: bool = False  # the frameworks' CPU images (the pins as the venvs have them)
    base_image: str | None = None  # build the images on this base instead of framework.yaml's
    registry: str | None = None  # with container: pull REGISTRY/nbbatch-<fw>:<fingerprint> instead of a local build


class LocalBackend(Backend):
    """Execute runs on this machine's CPUs and GPUs."""

    name: ClassVar[str] = "local"
    capabilities: ClassVar[Capabilities] = Capabilities(gpu_slots=True)
    Settings: ClassVar[type] = LocalSettings
    settings: LocalSettings
    settings_hint: ClassVar[str] = "use resources: for gpus, runs_per_gpu, max_parallel"

    def __init__(self, settings: LocalSettings | None = None, /, gpus: list[GpuInfo] | None = None, **values: Any):
        """``gpus`` replaces NVML's list (for tests); the rest are the experiment's ``backend:`` settings."""
        super().__init__(settings, **values)
        refuse_image_settings_without_container(self.settings)
        self._gpus = gpus
        if self.settings.container:  # the runs' kernels are the images', not this machine's venvs
            self.capabilities = dataclasses.replace(self.capabilities, local_kernels=False, containers=True)
        self._engine: Engine | None = None
        self._images: dict[str, tuple[str, str]] = {}  # framework → (image, image id)
        self._pools: dict[tuple[object, bool], SlotPool] = {}
        self._pools_lock = threading.Lock()
        self.cores = CorePool()  # CPU runs' cores, for every batch this backend runs at once (as the GPU slots)

    def slot_pool(self, runs_per_gpu: int | str, mps: bool) -> SlotPool:
        """This machine's GPU slots, one pool for all the batches this backend runs at once (a search launches each
        trial as a batch of its own, while others run): no GPU is booked twice."""
        with self._pools_lock:
            key = (runs_per_gpu, mps)
            if key not in self._pools:
                self._pools[key] = SlotPool(self.gpus, runs_per_gpu, mps=mps)
            return self._pools[key]

    @property
    def gpus(self) -> list[GpuInfo]:
        if self._gpus is None:
            self._gpus = detect_gpus()
        return self._gpus

    def compute(self) -> Compute:
        cpus = os.cpu_count() or 1
        return Compute(
            backend=self.name,
            gpus=[{"index": g.index, "name": g.name, "memory_mb": g.memory_mb} for g in self.gpus],
            nodes=[{"name": os.uname().nodename, "state": "idle", "cpus": cpus, "gpus": len(self.gpus)}],
            slots=max(cpus, len(self.gpus)),
        )

    def check(self, runs: Sequence[Run], options: SubmitOptions | None = None) -> None:
        """Refuse runs this machine cannot place, before anything starts."""
        if self.settings.container:
            self._check_containers(runs, options)
        self._check_distributed(runs)
        cpus = max((r.cpus or 0 for r in runs), default=0)
        if cpus > len(self.cores.cores):
            raise ValidationError(f"runs ask for resources.cpus: {cpus} but this machine lets nbbatch use "
                                  f"{len(self.cores.cores)} core(s); set resources.cpus to at most that")
        need = max((r.gpus * nodes_here(r) for r in runs), default=0)
        if need > len(self.gpus):
            have = f"{len(self.gpus)} GPU(s)" if self.gpus else "no NVIDIA GPU (NVML found none)"
            raise ValidationError(f"runs ask for {need} GPU(s) each but this machine has {have}; "
                                  "set resources.gpus to 0 to run on the CPU, or use another backend")
        if options is None or not need:
            return
        if options.mps:
            check_mps(self.gpus)
        elif isinstance(options.runs_per_gpu, int) and options.runs_per_gpu > 1:
            held = [g.index for g in self.gpus if g.compute_mode == "exclusive_process"]
            if held:
                raise ValidationError(
                    f"GPU(s) {', '.join(map(str, held))} are in exclusive-process compute mode: one process at a time, "
                    f"so resources.runs_per_gpu: {options.runs_per_gpu} cannot share them; set resources.mps: true "
                    "(CUDA MPS lets runs share such a GPU), runs_per_gpu: 1, or `nvidia-smi -c DEFAULT`")

    def _check_distributed(self, runs: Sequence[Run]) -> None:
        spread = next((r for r in runs if r.distribution and r.distribution.nodes > 1), None)
        if spread is not None and not os.environ.get(SIMULATE_NODES_ENV):
            raise ValidationError(f"run {spread.run_id} spans {spread.distribution.nodes} nodes, but the local backend "
                                  "is this one machine; set resources.nodes: 1 (processes_per_node ranks here), or use "
                                  "a backend with nodes (slurm, ray, azureml)")

    # --- container: true --------------------------------------------------------------------------------

    def check_share(self, share: Share) -> None:
        if self.settings.container and share.local_path("") is None:
            raise ContainerError(f"container: true bind-mounts the share into each run's container, so it must be a "
                                 f"folder on this machine; {share.url} is not: use a local folder as `share:`, or "
                                 "run without containers")

    def prepare_environments(self, frameworks: Sequence[str], project: Project, build: bool = False,
                             progress: bool = True) -> None:
        if not self.settings.container:
            return super().prepare_environments(frameworks, project, build, progress)
        if build and frameworks:
            build_framework_images(self._container_engine(), frameworks, project, gpu=not self.settings.cpu_image,
                                   base=self.settings.base_image, progress=progress)

    def _container_engine(self) -> Engine:
        if self._engine is None:
            self._engine = find_engine(self.settings.engine)
        return self._engine

    def _check_containers(self, runs: Sequence[Run], options: SubmitOptions | None) -> None:
        """The engine runs, the GPUs can reach containers, every framework's image is ready: before any run starts."""
        if options is not None and options.mps:
            raise ValidationError("resources.mps cannot be combined with container: true (the MPS daemon's pipe is not "
                                  "shared with containers); drop one of them")
        refuse_runs_without_image(runs)
        engine = self._container_engine()
        if any(r.gpus for r in runs):
            engine.check_gpus()
        self._images = framework_images(engine, runs, gpu=not self.settings.cpu_image, base=self.settings.base_image,
                                        known=self._images, registry=self.settings.registry, pull_here=True)

    def _execute(self, run: Run, share: Share, lease: GpuLease, shared: bool, gpu_env: dict[str, str],
                 info: GpuSharing | None, cancel: threading.Event, notify: Callable[[RunRecord], None],
                 kernels: KernelPool, *, on_sampler: SamplerCallback | None = None) -> RunRecord:
        """One run: in a kernel of this machine's venv, or with ``container: true`` inside its framework's image.
        ``on_sampler`` is given the run's GPU sampler while it samples (see :class:`AttemptContext`)."""
        if run.distribution:  # a gang's GPUs are its own: no sharing, no kernel started ahead
            return _execute_distributed(run, share, AttemptContext(gpu_ids=lease.gpu_ids, cancel_event=cancel,
                                                                   on_update=notify),
                                        self._in_container if self.settings.container else execute_run)
        context = AttemptContext(gpu_ids=lease.gpu_ids, shared_gpu=shared, gpu_share=info, cancel_event=cancel,
                                 on_update=notify, on_sampler=on_sampler)
        if not self.settings.container:
            return execute_run(run, share, dataclasses.replace(context, gpu_env=gpu_env, kernels=kernels))
        return self._in_container(run, share, context)

    def _in_container(self, run: Run, share: Share, context: AttemptContext) -> RunRecord:
        """``run`` (a gang's node: its launcher, with the node's ranks) in its framework's image."""
        if run.framework not in self._images:
            self._check_containers([run], None)
        image, image_id = self._images[run.framework or ""]
        engine = self._container_engine()
        return execute_in_container(engine, run, share, dataclasses.replace(
            context, project_root=Path(run.project_root()),
            container=ContainerInfo(engine=engine.name, image=image, image_id=image_id)))

    # --- scheduling -------------------------------------------------------------------------------------

    def start(self, runs: Sequence[Run], share: Share, options: SubmitOptions) -> None:
        """Run every run in worker threads of this process, on GPU slots; return when all are final."""
        run_batch(self, runs, share, options)

    def lost_runs(self, experiment: str, share: Share, records: Sequence[RunRecord]) -> dict[str, RunError]:
        """Runs left ``running`` or ``queued`` by a submitting process of this machine that is gone."""
        host = socket.gethostname()
        return {r.run_id: RunError("DriverDied", f"process {r.pid} that ran it is gone",
                                   reason="the submitting process died; resubmit to rerun", kind=ErrorKind.INFRA)
                for r in records if r.host == host and r.pid and not pid_alive(r.pid)}


def _execute_distributed(run: Run, share: Share, context: AttemptContext,
                         launch: Callable[[Run, Share, AttemptContext], RunRecord] = execute_run) -> RunRecord:
    """Every node of a distributed run this machine runs: node 0 here, simulated others in threads beside it.
    ``launch`` runs one node's launcher (with ``container: true``, in a container of its own)."""
    placements = local_placements(run)[:nodes_here(run)]
    per_node = run.gpus

    def fresh_endpoints() -> tuple[str, ...]:
        return local_placements(run)[0].endpoints

    def node(index: int) -> RunRecord:
        return launch(run, share, dataclasses.replace(
            context, placement=placements[index], gpu_ids=context.gpu_ids[index * per_node:(index + 1) * per_node],
            on_update=context.on_update if index == 0 else None,
            new_endpoints=fresh_endpoints if len(placements) == 1 else None))

    others = [threading.Thread(target=node, args=(i,), name=f"node-{run.run_id}-{i}", daemon=True)
              for i in range(1, len(placements))]
    for thread in others:
        thread.start()
    try:
        return node(0)
    finally:
        for thread in others:
            thread.join()

