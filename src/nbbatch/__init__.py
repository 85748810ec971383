"""nbbatch: run parameterized Jupyter notebooks as a batch.

Inside a notebook: ``nbbatch.record(accuracy=...)`` and ``nbbatch.data``. From Python:
``nbbatch.submit(...)``, ``nbbatch.status(...)`` (or, as two steps, ``nbbatch.refresh_runs`` and
``nbbatch.read_status``) and friends. Importing nbbatch is light (it runs
in every framework kernel): the driver's modules load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "record": "nbbatch.metrics",  # lazy too: `nbbatch` starts running its command as soon as Python has started
    "Experiment": "nbbatch.spec.experiment",
    "load_experiment": "nbbatch.spec.experiment",
    "Run": "nbbatch.plan.runs",
    "plan": "nbbatch.plan.runs",
    "RunRecord": "nbbatch.store.runjson",
    "submit": "nbbatch.api",
    "submit_pipeline": "nbbatch.api",
    "plan_pipeline": "nbbatch.api",
    "load_pipeline": "nbbatch.spec.pipeline",
    "status": "nbbatch.api",
    "read_status": "nbbatch.api",
    "refresh_runs": "nbbatch.api",
    "cancel": "nbbatch.api",
    "logs": "nbbatch.api",
    "run_notebook": "nbbatch.api",
    "NbbatchError": "nbbatch.errors",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'nbbatch' has no attribute {name!r}")
