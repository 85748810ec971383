"""``nbbatch.record(...)``: metrics a notebook reports about itself.

Inside a kernel, :func:`record` displays the metrics as an output with nbbatch's own MIME type,
so the executed notebook alone carries them; :func:`metrics_from_notebook` reads them back
(later calls win). Importing this module costs nothing heavy: it runs in every framework kernel.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

METRICS_MIME = "application/vnd.nbbatch.metrics+json"


def _plain(value: Any) -> Any:
    """Turn numpy scalars, arrays and the like into JSON values."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        number = float(value)
        return number if math.isfinite(number) else str(number)
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 1) == 0:
        return _plain(value.item())
    if hasattr(value, "tolist"):
        return _plain(value.tolist())
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def record(**metrics: Any) -> dict[str, Any]:
    """Record metrics (``accuracy=0.97, train_seconds=12.3``) in the running notebook.

    Values may be numbers, strings, booleans, numpy scalars or small lists/dicts of those.
    Outside a kernel the metrics are only returned.
    """
    if not metrics:
        raise TypeError("nbbatch.record() needs at least one metric, e.g. record(accuracy=0.97)")
    data = {name: _plain(value) for name, value in metrics.items()}
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:  # pragma: no cover - plain Python without IPython
        return data
    if get_ipython() is not None:
        text = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in data.items())
        display({METRICS_MIME: data, "text/plain": f"nbbatch.record: {text}"}, raw=True)
    return data


def metrics_from_notebook(nb: Mapping[str, Any]) -> dict[str, Any]:
    """All metrics recorded in a (possibly partial) executed notebook, in order, later wins."""
    found: dict[str, Any] = {}
    for cell in nb.get("cells", []):
        for output in cell.get("outputs", []) or []:
            data = output.get("data") or {}
            if METRICS_MIME in data and isinstance(data[METRICS_MIME], Mapping):
                found.update(data[METRICS_MIME])
    return found
