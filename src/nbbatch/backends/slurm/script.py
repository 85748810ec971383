"""What nbbatch hands ``sbatch``: the options of a run's job (resources, limits, the user's settings) and its script.

A submission's files go to ``<experiment>/.slurm/<submission>/`` on the share: ``batch.sh`` (one per job shape),
``specs/<index>.json`` (one per run: the launch its job's ``nbbatch run-one`` executes) and Slurm's output files
(``slurm-<job>_<task>.out``: the launcher's own output, the first place to look when a job ended without a record).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from nbbatch.backends.slurm.jobs import slurm_time, time_limit_minutes
from nbbatch.execute.launch import LaunchSpec
from nbbatch.plan.runs import Run

if TYPE_CHECKING:
    from nbbatch.backends.slurm.backend import SlurmSettings

SUBMISSIONS = ".slurm"  # in the experiment's folder on the share


@dataclass(frozen=True)
class JobShape:
    """What a group of runs asks Slurm for: runs of one shape share a job array."""

    nodes: int
    gpus: int  # per node
    time_minutes: int | None
    cpus: int | None = None  # per node: the experiment's resources.cpus (None: the backend's `cpus`)

    @classmethod
    def of(cls, run: Run) -> JobShape:
        nodes = run.distribution.nodes if run.distribution else 1
        return cls(nodes, run.gpus, time_limit_minutes(run), run.cpus)


def job_options(settings: SlurmSettings, shape: JobShape, name: str, fitted_memory: str | None = None) -> list[str]:
    """``sbatch``'s options for a job of ``shape`` (without ``--array`` and ``--output``): the shape's, then the
    backend's settings (the user's own ``time_limit`` replaces the one nbbatch works out), then ``extra_sbatch``.

    ``fitted_memory``: the ``--mem`` of a job whose ``memory`` setting is unset (None: the cluster's default)."""
    # --no-requeue: after a node failure nbbatch submits the run again itself (a requeue waits minutes)
    args = [f"--job-name={name}", f"--nodes={shape.nodes}", "--ntasks-per-node=1", "--no-requeue",
            f"--cpus-per-task={shape.cpus or settings.cpus}"]
    memory = settings.memory or fitted_memory
    if memory:
        args.append(f"--mem={str(memory).upper()}")
    if shape.gpus:
        gpus = f"{settings.gpu_type}:{shape.gpus}" if settings.gpu_type else str(shape.gpus)
        args.append(f"--gpus-per-node={gpus}")
    if settings.time_limit is not None:
        args.append(f"--time={settings.time_limit}")
    elif shape.time_minutes is not None:
        args.append(f"--time={slurm_time(shape.time_minutes)}")
    for flag in ("partition", "account", "qos", "constraint"):
        if getattr(settings, flag):
            args.append(f"--{flag}={getattr(settings, flag)}")
    return [*args, *(str(option) for option in settings.extra_sbatch or ())]


def job_launch(run: Run, share: str, project: str, gpus: bool, images: Mapping[str, str] | None = None,
               engine: str = "podman") -> LaunchSpec:
    """What the node launcher of one run executes (its ``specs/<index>.json``): its GPUs are those Slurm gave the job
    (CUDA_VISIBLE_DEVICES), none for a CPU run.

    ``images`` (framework → image tag): ``container: true``, the run starts in its framework's image with ``engine``;
    its GPUs are then the node's own indices (SLURM_JOB_GPUS: the container engine names GPUs by them, whereas
    CUDA_VISIBLE_DEVICES counts from 0 where Slurm constrains the job's devices)."""
    visible = ("SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES") if images else ("CUDA_VISIBLE_DEVICES",)
    return LaunchSpec(run=run, share=share, backend="slurm", project=project, gpus_from_env=visible if gpus else (),
                      container_images=dict(images or {}), container_engine=engine)


def batch_script(experiment: str, command: str, project: str, env: Mapping[str, str], gang: bool) -> str:
    """The batch script of a job: the run's environment, then its launcher (through ``srun`` on every node of a
    distributed run's job; the script itself runs on the job's first node)."""
    lines = ["#!/bin/bash", f"# nbbatch: runs of experiment {experiment} (see docs/slurm.md)", "set -u"]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in sorted(env.items())]
    lines.append(f"cd {shlex.quote(project)}")
    if gang:  # one launcher per node; nbbatch's gang stops the other nodes itself when a rank fails
        lines.append(f"exec srun --ntasks-per-node=1 --kill-on-bad-exit=0 bash -c {shlex.quote('exec ' + command)}")
    else:
        lines.append(f"exec {command}")
    return "\n".join(lines) + "\n"


def spec_path(folder: Path, index: int | str) -> str:
    """Where run ``index`` of a submission's job is described (``index`` may be ``$SLURM_ARRAY_TASK_ID``)."""
    return f"{shlex.quote(str(folder / 'specs'))}/{index}.json"


def array_option(count: int, max_parallel: int | None) -> str:
    """``--array`` for ``count`` runs, at most ``max_parallel`` at once."""
    throttle = f"%{max_parallel}" if max_parallel else ""
    return f"--array=0-{count - 1}{throttle}"


def group_by_shape(runs: Sequence[Run]) -> dict[JobShape, list[Run]]:
    """Single-node runs by the shape of their job (in order); each distributed run is a job of its own."""
    groups: dict[JobShape, list[Run]] = {}
    for run in runs:
        if not run.distribution:
            groups.setdefault(JobShape.of(run), []).append(run)
    return groups
