"""``nbbatch.record(...)``: metrics a notebook reports about itself.

Inside a kernel, :func:`record` displays the metrics as an output with nbbatch's own MIME type,
so the executed notebook alone carries them; :func:`metrics_from_notebook` reads them back
(later calls win). ``record(step=N, ...)`` is one point of the run's history: it is shown as one
line that each later point of the same cell updates (``update_display_data``), and nbbatch's
driver, which sees every such message, appends each point to the run's ``metrics.jsonl`` as the run
goes. When the kernel gets ``MLFLOW_TRACKING_URI`` (:func:`tracking_wanted`: the experiment's ``tracking:
mlflow``, or the URI set in the driver's environment where ``tracking:`` is not said), the same values,
with their step, and the run's parameters go to MLflow too.

Importing this module costs nothing heavy: it runs in every framework kernel (mlflow is imported
only when the variable is set).
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
import re
import sys
import uuid
from collections.abc import Iterator, Mapping
from datetime import datetime, timezone
from typing import Any
from urllib.parse import unquote, urlparse

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: MLflow file stores go unlocked there
    fcntl = None  # type: ignore[assignment]

METRICS_MIME = "application/vnd.nbbatch.metrics+json"
HISTORY_MIME = "application/vnd.nbbatch.history+json"  # one point: {"step", "time", metrics...}
POINT_KEYS = ("step", "time", "attempt")  # what nbbatch itself puts in a point of the history
# Where and as whom a kernel would track (Azure ML sets the URI, run, experiment and run token in every job): a
# kernel of a run without tracking gets none of them.
_TRACKING_VARIABLE = re.compile(r"MLFLOW_(TRACKING_\w+|REGISTRY_URI|RUN_ID|EXPERIMENT_ID|EXPERIMENT_NAME)|AZUREML_RUN_TOKEN\w*")


def tracking_wanted(tracking: str | None, environ: Mapping[str, str]) -> bool:
    """Whether a run's kernel tracks to MLflow: the experiment's ``tracking: mlflow`` (``none``: never); where it
    is not said, whether ``MLFLOW_TRACKING_URI`` is in ``environ`` (the driver's, set by the user). The azureml
    backend sends its runs with ``none`` unless asked, since Azure ML sets the URI in every job."""
    if tracking is None:
        return bool(environ.get("MLFLOW_TRACKING_URI"))
    return tracking == "mlflow"


def without_tracking(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` less MLflow's URI, run, experiment and credentials and Azure ML's run token."""
    return {name: value for name, value in environ.items() if not _TRACKING_VARIABLE.fullmatch(name)}


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


def record(step: int | None = None, **metrics: Any) -> dict[str, Any]:
    """Record metrics (``accuracy=0.97, train_seconds=12.3``) in the running notebook.

    With ``step`` (an epoch or iteration number, an int ≥ 0) the values are one point of the run's
    history (``metrics.jsonl`` on the share, learning curves in the report, live in ``nbbatch
    status``); the latest point's values are the run's metrics until later calls say otherwise.
    Values may be numbers, strings, booleans, numpy scalars or small lists/dicts of those.
    Outside a kernel the metrics are only returned.
    """
    if not metrics:
        raise TypeError("nbbatch.record() needs at least one metric, e.g. record(accuracy=0.97)")
    data = {name: _plain(value) for name, value in metrics.items()}
    if step is not None:
        point = {"step": _step(step), "time": datetime.now(timezone.utc).isoformat(timespec="milliseconds")}
        reserved = sorted(set(data) & set(POINT_KEYS))
        if reserved:
            raise TypeError(f"nbbatch.record(step=...): `{reserved[0]}` is a name every point of the history already "
                            f"has; call the metric something else (e.g. `{reserved[0]}_s`)")
        point.update(data)
        _show(point, HISTORY_MIME, f"nbbatch.record step {point['step']}: {_text(data)}", per_cell=True)
        _MLFLOW.log(data, point["step"])
        return point
    _show(data, METRICS_MIME, f"nbbatch.record: {_text(data)}", per_cell=False)
    _MLFLOW.log(data, None)
    return data


def _step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or int(step) < 0:
        raise TypeError(f"nbbatch.record(step=...) takes a whole number ≥ 0 (an epoch or iteration), not {step!r}")
    return int(step)


def _text(data: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in data.items())


_history_display: dict[str, Any] = {"cell": None, "id": None}


def _show(data: dict[str, Any], mime: str, text: str, per_cell: bool) -> None:
    """Display ``data`` under ``mime``; history points of one cell update one output instead of adding lines."""
    ipython = sys.modules.get("IPython")  # loaded in every kernel; absent elsewhere, and then nothing to show
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None:
        return
    display = ipython.display.display
    bundle = {mime: data, "text/plain": text}
    if not per_cell:
        display(bundle, raw=True)
        return
    cell = getattr(shell, "execution_count", None)
    if _history_display["cell"] != cell or _history_display["id"] is None:
        _history_display.update(cell=cell, id=f"nbbatch-history-{uuid.uuid4().hex}")
        display(bundle, raw=True, display_id=_history_display["id"])
    else:
        display(bundle, raw=True, display_id=_history_display["id"], update=True)


class _MlflowLog:
    """Sends recorded values to MLflow when ``MLFLOW_TRACKING_URI`` is set; a failure warns once, never raises.

    Under Azure ML (``MLFLOW_RUN_ID`` set) the job's own run is used; elsewhere a run named after the
    nbbatch run is started in an experiment named after the nbbatch experiment, with the run's
    parameters (``NBBATCH_PARAMETERS``, set by nbbatch's driver) as its params.
    """

    def __init__(self) -> None:
        self.mlflow: Any = None
        self.broken = False

    def log(self, data: Mapping[str, Any], step: int | None) -> None:
        numeric = {k: float(v) for k, v in data.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if not numeric or self.broken or not os.environ.get("MLFLOW_TRACKING_URI"):
            return
        try:
            if self.mlflow is None:
                self.mlflow = self._start()
            self.mlflow.log_metrics(numeric, step=step)
        except Exception as exc:  # noqa: BLE001 - tracking never breaks the training
            self.broken = True
            print(f"nbbatch.record: MLflow logging is off for this run: {type(exc).__name__}: {exc}", file=sys.stderr)

    @staticmethod
    def _start() -> Any:
        try:
            import mlflow
        except ImportError as exc:
            raise RuntimeError("MLFLOW_TRACKING_URI is set but mlflow is not installed in this kernel's "
                               "environment (pip install mlflow-skinny)") from exc
        if mlflow.active_run() is None:
            if os.environ.get("MLFLOW_RUN_ID"):  # Azure ML: the job's run
                mlflow.start_run()
            else:
                if not (os.environ.get("MLFLOW_EXPERIMENT_NAME") or os.environ.get("MLFLOW_EXPERIMENT_ID")):
                    with _file_store_lock(os.environ["MLFLOW_TRACKING_URI"]):
                        mlflow.set_experiment(os.environ.get("NBBATCH_EXPERIMENT") or "nbbatch")
                mlflow.start_run(run_name=os.environ.get("NBBATCH_RUN_ID") or None)
            try:
                parameters = json.loads(os.environ.get("NBBATCH_PARAMETERS") or "{}")
            except ValueError:
                parameters = {}
            if isinstance(parameters, dict) and parameters:
                mlflow.log_params({k: json.dumps(v, default=str)[:500] if not isinstance(v, str) else v[:500]
                                   for k, v in parameters.items()})
        return mlflow


_MLFLOW = _MlflowLog()


@contextlib.contextmanager
def _file_store_lock(uri: str) -> Iterator[None]:
    """Hold a lock in a local MLflow file store while the experiment is looked up or created.

    The runs of a sweep start together; without it, two kernels that both find no experiment each
    create one and a run can land in the wrong one. Tracking servers (Azure ML's too) need no lock.
    """
    parsed = urlparse(uri)
    if parsed.scheme not in ("", "file") or fcntl is None:
        yield
        return
    folder = unquote(parsed.path) if parsed.scheme else uri
    try:
        os.makedirs(folder, exist_ok=True)
        handle = open(os.path.join(folder, ".nbbatch-experiment.lock"), "a")  # noqa: SIM115 - held below
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def metrics_from_notebook(nb: Mapping[str, Any]) -> dict[str, Any]:
    """All metrics recorded in a (possibly partial) executed notebook, in order, later wins."""
    found: dict[str, Any] = {}
    for cell in nb.get("cells", []):
        for output in cell.get("outputs", []) or []:
            data = output.get("data") or {}
            if METRICS_MIME in data and isinstance(data[METRICS_MIME], Mapping):
                found.update(data[METRICS_MIME])
            elif HISTORY_MIME in data and isinstance(data[HISTORY_MIME], Mapping):
                found.update(metrics_of_point(data[HISTORY_MIME]))
    return found


def metrics_of_point(point: Mapping[str, Any]) -> dict[str, Any]:
    """A history point's metrics (without its step, time and attempt)."""
    return {k: v for k, v in point.items() if k not in POINT_KEYS}
