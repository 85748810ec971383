"""What an attempt of a run needs from the backend that executes it, in one value."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from nbbatch.execute.placement import NodePlacement
from nbbatch.store.runjson import ContainerInfo, GpuSharing, RunRecord

if TYPE_CHECKING:
    from nbbatch.execute.prestart import KernelPool
    from nbbatch.execute.telemetry import GpuSampler

UpdateCallback = Callable[[RunRecord], None]
SamplerCallback = Callable[["GpuSampler | None"], None]


def ignore_update(_record: RunRecord) -> None:
    """The ``on_update`` of a caller that does not follow the run."""


@dataclass(frozen=True)
class AttemptContext:
    """Where and how a run's attempts execute (every field has the default of a plain run on this machine)."""

    backend: str = "local"  # recorded in run.json
    project_root: Path | None = None  # where the notebook and the project's folders are here
    gpu_ids: list[int] = field(default_factory=list)  # CUDA_VISIBLE_DEVICES of the kernel
    recorded_gpu_ids: list[int] | None = None  # in a container: the GPUs' indices on the host (run.json's)
    shared_gpu: bool = False  # the run shares its GPU: the kernel gets ``run.shared_gpu_env``
    gpu_env: dict[str, str] | None = None  # added to the kernel's environment (a CUDA MPS daemon's pipe)
    gpu_share: GpuSharing | None = None  # run.json's ``gpu_share`` (``exclusive``: no other run on them)
    container: ContainerInfo | None = None  # run.json's ``container``: the engine and image it ran in
    cancel_event: threading.Event | None = None  # set: stop the run (as a cancel marker in the share does)
    on_update: UpdateCallback | None = None  # called with the record whenever it changes
    kernels: KernelPool | None = None  # may hold a kernel started ahead for this run (its first attempt's)
    input_paths: dict[str, str] | None = None  # inputs the backend mounted: name -> path here
    save_every: float = 1.0  # seconds between checkpoints of the output notebook
    placement: NodePlacement | None = None  # a distributed run: this node's place in the gang (None: from the environment)
    new_endpoints: Callable[[], tuple[str, ...]] | None = None  # fresh rendezvous ports when one was taken (local)
    # Called with the attempt's GPU sampler once it samples, and with None when it stops (the local scheduler
    # watches the memory of a run whose need is unknown, to let other runs join it once that stopped growing).
    on_sampler: SamplerCallback | None = None

    @property
    def notify(self) -> UpdateCallback:
        """``on_update``, or a callback that does nothing."""
        return self.on_update or ignore_update
