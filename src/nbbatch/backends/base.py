"""The backend protocol: where runs execute.

A backend only decides *where* ``nbbatch run-one`` (:func:`nbbatch.execute.execute_run`) runs;
the execution itself and the share layout are the same everywhere. Status is read from the share's
run records, which a backend may refresh with what it knows (:meth:`Backend.refresh`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from ..runrecord import RunRecord
from ..runs import Run
from ..share import Share


@dataclass
class Compute:
    """What a backend has to run on."""

    backend: str
    gpus: list[dict[str, Any]] = field(default_factory=list)  # {"index", "name", "memory_mb", "node"?}
    nodes: list[dict[str, Any]] = field(default_factory=list)  # {"name", "state", "cpus", "gpus"}
    slots: int = 1  # runs that can execute at once
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class SubmitOptions:
    """How to run a batch (from the experiment's resources and the command line)."""

    runs_per_gpu: int = 1
    max_parallel: int | None = None  # None: as many as the compute allows
    wait: bool = True  # block until every run is final (remote backends may return at once)
    on_update: Callable[[RunRecord], None] | None = None  # called on every status change
    extra: dict[str, Any] = field(default_factory=dict)  # backend-specific settings from the spec


class Backend(Protocol):
    """What every backend implements. Register it with :func:`nbbatch.backends.register_backend`."""

    name: ClassVar[str]

    def compute(self) -> Compute:
        """The GPUs/nodes this backend can use."""

    def submit(self, runs: Sequence[Run], share: Share, options: SubmitOptions) -> None:
        """Start ``runs``; each writes ``output.ipynb``, ``run.json`` and ``log.txt`` to the share.

        Runs already queued in the share as ``queued`` records. With ``options.wait`` the call
        returns when every run is final.
        """

    def refresh(self, experiment: str, share: Share) -> None:
        """Bring the share's run records up to date with the backend's own view (e.g. job states)."""

    def cancel(self, experiment: str, share: Share, run_ids: Sequence[str] | None = None) -> list[str]:
        """Cancel runs (all unfinished ones when ``run_ids`` is None); return the ids asked to stop."""

    def stream_log(self, experiment: str, share: Share, run_id: str, follow: bool = False) -> Iterator[str] | None:
        """Stream a run's log from the backend; ``None`` means: read ``log.txt`` from the share."""
