"""The ``slurm`` backend: runs as Slurm jobs, on the cluster most GPU users outside a cloud have.

* one ``nbbatch submit`` queues one **job array** per job shape for the single-node runs (a task per run,
  ``--array=0-N%K`` with ``max_parallel: K``) and one **job** per distributed run (``--nodes=N``, ``srun``
  starting one ``nbbatch run-one`` node launcher per node);
* every job executes ``nbbatch run-one`` — the executor every backend uses — in the project's framework
  environments (or their images, ``container: true``), writing the run's files to the share, a folder
  on the cluster's shared file system;
* the driver need not stay up: ``status``, ``logs``, ``cancel`` (``scancel``), ``fetch`` and ``compare`` work from
  any machine that sees the share and has Slurm's client tools. A run's job id is kept next to its files
  (``<experiment>/<run id>/slurm.json``, :class:`~nbbatch.backends.slurm.jobs.SlurmJob`).

Settings (the experiment's ``backend:`` mapping) are the fields of :class:`SlurmSettings`. See docs/slurm.md.
"""

from __future__ import annotations

from nbbatch.backends.slurm.backend import SlurmBackend, SlurmSettings
from nbbatch.backends.slurm.commands import Slurm, SlurmCommandError
from nbbatch.backends.slurm.jobs import JOB_FILE, SlurmJob

__all__ = ["JOB_FILE", "Slurm", "SlurmBackend", "SlurmCommandError", "SlurmJob", "SlurmSettings"]
