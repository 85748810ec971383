"""Compare executed notebooks: one table of runs, plots, a mailable HTML report and a CI check.

:func:`collect` turns a share's experiments — or any folder of papermill outputs — into a
:class:`pandas.DataFrame` with one row per run::

    experiment, run_id, framework, notebook, kernel, status, param.<name>..., metric.<name>...,
    duration_s, gpu_ids, started_at, ended_at, host, attempts, error, telemetry.<name>...,
    output, source, share_path, telemetry_file

A run folder's ``run.json`` is read when present; otherwise the executed notebook itself is (its
papermill metadata and the metrics recorded with :func:`nbbatch.record`), so a run that failed
part-way shows ``failed`` with the metrics it got to record. Then :func:`filter_runs`,
:func:`sort_runs`, :func:`group_runs`, :func:`write_table`, :func:`runs_table` (rich),
the plots, :func:`write_report` and :func:`check` work on that table.

pandas and matplotlib come with the ``compare`` extra (``pip install nbbatch[compare]``).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import math
import numbers
import os
import posixpath
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from nbbatch.errors import NbbatchError, did_you_mean
from nbbatch.record import metrics_from_notebook
from nbbatch.store.runrecord import RunRecord
from nbbatch.store.layout import LOG_FILE, OUTPUT_NOTEBOOK, RUN_RECORD
from nbbatch.store.share import Share, open_share

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd
    from matplotlib.figure import Figure
    from rich.console import Console
    from rich.table import Table

PARAM = "param."
METRIC = "metric."
TELEMETRY = "telemetry."
TELEMETRY_FILES = ("telemetry.json", "telemetry.csv")
LEADING_COLUMNS = ("experiment", "run_id", "framework", "notebook", "kernel", "status")
TRAILING_COLUMNS = ("duration_s", "gpu_ids", "started_at", "ended_at", "host", "attempts", "error")
LOCATION_COLUMNS = ("output", "source", "share_path", "telemetry_file")
FAILING_OUTCOMES = frozenset({"moved", "missing", "failed"})
_MAX_DEPTH = 6
_SKIP_FOLDERS = {".ipynb_checkpoints", "__pycache__", ".git"}


def _pandas() -> Any:
    try:
        import pandas
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise NbbatchError("comparing runs needs pandas: pip install 'nbbatch[compare]'") from exc
    return pandas


# ---------------------------------------------------------------------------------------------
# Finding runs
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Found:
    """A run found in a share: a run folder (``run.json`` and/or ``output.ipynb``) or a lone notebook."""

    experiment: str
    run_id: str
    folder: str | None  # run folder, relative to the share (None for a lone notebook)
    notebook: str | None  # notebook path relative to the share
    record: str | None  # run.json path relative to the share
    telemetry: str | None  # series file name in the run folder


def _join(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))


def _find(share: Share, base: str, experiment: str | None, root_name: str) -> list[_Found]:
    """Every run under ``base``: share-layout folders and papermill outputs lying anywhere below."""
    found: list[_Found] = []

    def experiment_for(rel_parent: str) -> str:
        if experiment is not None:
            return experiment
        first = rel_parent.split("/", 1)[0]
        return first or root_name

    def walk(path: str, depth: int) -> None:
        names = share.list(path)
        if RUN_RECORD in names or OUTPUT_NOTEBOOK in names:
            rel = path[len(base):].strip("/") if path.startswith(base) else path
            parent, _, name = rel.rpartition("/")
            if not name:  # ``base`` itself is a run folder
                parent_base, _, name = base.rpartition("/")
                name = name or root_name
                exp = experiment or (parent_base.rsplit("/", 1)[-1] if parent_base else root_name)
            else:
                exp = experiment_for(parent)
            telemetry = next((t for t in TELEMETRY_FILES if t in names), None)
            found.append(_Found(
                experiment=exp, run_id=name, folder=path,
                notebook=_join(path, OUTPUT_NOTEBOOK) if OUTPUT_NOTEBOOK in names else None,
                record=_join(path, RUN_RECORD) if RUN_RECORD in names else None,
                telemetry=telemetry,
            ))
            return
        for name in names:
            child = _join(path, name)
            if name.endswith(".ipynb") and not share.list(child):
                rel = child[len(base):].strip("/") if base else child
                parent = rel.rpartition("/")[0]
                exp = experiment_for(parent)
                if experiment is None and parent:
                    run_id = rel.split("/", 1)[1] if "/" in rel else rel
                else:
                    run_id = rel
                found.append(_Found(exp, run_id[: -len(".ipynb")], None, child, None, None))
            elif name not in _SKIP_FOLDERS and depth < _MAX_DEPTH and name not in (LOG_FILE, *TELEMETRY_FILES):
                walk(child, depth + 1)

    walk(base, 0)
    return found


# ---------------------------------------------------------------------------------------------
# Reading one run
# ---------------------------------------------------------------------------------------------
def _flatten(prefix: str, values: Mapping[str, Any], into: dict[str, Any]) -> None:
    """``{"a": {"b": 1}, "c": [1, 2]}`` → ``prefix.a.b = 1``, ``prefix.c = "[1, 2]"`` (lists as JSON)."""
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            _flatten(f"{name}.", value, into)
        elif isinstance(value, (list, tuple)):
            into[name] = json.dumps(value, default=str)
        else:
            into[name] = value


def _notebook_error(nb: Mapping[str, Any]) -> tuple[int | None, str, str] | None:
    for index, cell in enumerate(nb.get("cells", [])):
        for output in cell.get("outputs", []) or []:
            if output.get("output_type") == "error":
                return index, str(output.get("ename", "")), str(output.get("evalue", ""))
    return None


def _source(cell: Mapping[str, Any]) -> str:
    source = cell.get("source") or ""
    return "".join(source) if isinstance(source, list) else str(source)


def _notebook_status(nb: Mapping[str, Any]) -> str:
    """``succeeded``, ``failed`` or ``incomplete`` (cells left pending or running) from the notebook."""
    papermill = (nb.get("metadata") or {}).get("papermill") or {}
    if papermill.get("exception") or _notebook_error(nb):
        return "failed"
    cell_states = [
        ((c.get("metadata") or {}).get("papermill") or {}).get("status")
        for c in nb.get("cells", []) if c.get("cell_type") == "code"
    ]
    if "failed" in cell_states:
        return "failed"
    if any(s in ("pending", "running") for s in cell_states):
        return "incomplete"
    if not papermill and any(c.get("execution_count") is None for c in nb.get("cells", [])
                             if c.get("cell_type") == "code" and _source(c).strip()):
        return "incomplete"
    return "succeeded"


def _framework_from_notebook(nb: Mapping[str, Any], notebook_name: str | None) -> str | None:
    metadata = nb.get("metadata") or {}
    explicit = (metadata.get("nbbatch") or {}).get("framework")
    if explicit:
        return str(explicit)
    kernel = (metadata.get("kernelspec") or {}).get("name") or ""
    if kernel.startswith("nbbatch-"):
        return kernel[len("nbbatch-"):]
    if notebook_name:
        return Path(notebook_name).stem
    return kernel or None


def _row_from_notebook(nb: Mapping[str, Any], found: _Found) -> dict[str, Any]:
    metadata = nb.get("metadata") or {}
    papermill = metadata.get("papermill") or {}
    input_path = papermill.get("input_path")
    notebook_name = posixpath.basename(str(input_path).replace("\\", "/")) if input_path else None
    if notebook_name is None and found.notebook and not found.notebook.endswith("/" + OUTPUT_NOTEBOOK):
        notebook_name = posixpath.basename(found.notebook)
    error = _notebook_error(nb)
    row: dict[str, Any] = {
        "framework": _framework_from_notebook(nb, notebook_name or posixpath.basename(found.notebook or "")),
        "notebook": notebook_name,
        "kernel": (metadata.get("kernelspec") or {}).get("name"),
        "status": _notebook_status(nb),
        "duration_s": papermill.get("duration"),
        "started_at": papermill.get("start_time"),
        "ended_at": papermill.get("end_time"),
        "error": (f"cell {error[0]}: {error[1]}: {error[2]}" if error else None),
        "source": "notebook",
    }
    _flatten(PARAM, papermill.get("parameters") or {}, row)
    _flatten(METRIC, metrics_from_notebook(nb), row)
    return row


def _row_from_record(record: RunRecord) -> dict[str, Any]:
    notebook = posixpath.basename(str(record.notebook).replace("\\", "/")) if record.notebook else None
    row: dict[str, Any] = {
        # a run of a plain notebook (no framework) is known by its notebook, as in a papermill folder
        "framework": record.framework or (Path(notebook).stem if notebook else None),
        "notebook": notebook,
        "kernel": record.kernel,
        "status": record.status,
        "duration_s": record.duration_s,
        "gpu_ids": ",".join(str(g) for g in record.gpu_ids),
        "started_at": record.started_at,
        "ended_at": record.ended_at,
        "host": record.host,
        "attempts": record.attempts,
        "error": record.error.summary() if record.error else None,
        "source": RUN_RECORD,
    }
    _flatten(PARAM, record.parameters or {}, row)
    _flatten(METRIC, record.metrics or {}, row)
    if (record.telemetry or {}).get("samples"):  # nothing to show for runs without a GPU
        telemetry = {k: v for k, v in record.telemetry.items()
                     if k not in ("gpu_ids", "unavailable") and v is not None}
        _flatten(TELEMETRY, telemetry, row)
    return row


def _location(share: Share, path: str) -> str:
    local = share.local_path(path)
    return str(local) if local is not None else f"{share.url.rstrip('/')}/{path}"


def _read_run(share: Share, found: _Found) -> dict[str, Any]:
    base: dict[str, Any] = {"experiment": found.experiment, "run_id": found.run_id}
    row: dict[str, Any] = {}
    nb: Mapping[str, Any] | None = None
    try:
        if found.record is not None:
            record = RunRecord.from_json(share.read_bytes(found.record), source=_location(share, found.record))
            row = _row_from_record(record)
            base = {"experiment": record.experiment or found.experiment, "run_id": record.run_id or found.run_id}
            if found.notebook and not record.metrics:
                # The record may predate the metrics (a run still going, or one killed): the notebook has them.
                nb = json.loads(share.read_bytes(found.notebook))
                _flatten(METRIC, metrics_from_notebook(nb), row)
        elif found.notebook is not None:
            nb = json.loads(share.read_bytes(found.notebook))
            row = _row_from_notebook(nb, found)
    except (NbbatchError, ValueError, UnicodeDecodeError, OSError) as exc:
        row = {"status": "unreadable", "error": str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
               "source": RUN_RECORD if found.record else "notebook"}
    row.update(base)
    row["output"] = _location(share, found.notebook) if found.notebook else None
    row["share_path"] = found.folder or found.notebook
    row["telemetry_file"] = found.telemetry
    return row


def _order_columns(columns: Iterable[str]) -> list[str]:
    present = list(dict.fromkeys(columns))
    params = sorted(c for c in present if c.startswith(PARAM))
    metrics = [c for c in present if c.startswith(METRIC)]
    telemetry = [c for c in present if c.startswith(TELEMETRY)]
    fixed = set(LEADING_COLUMNS) | set(TRAILING_COLUMNS) | set(LOCATION_COLUMNS)
    others = [c for c in present if c not in fixed and not c.startswith((PARAM, METRIC, TELEMETRY))]
    return [*LEADING_COLUMNS, *params, *metrics, *TRAILING_COLUMNS, *telemetry, *others, *LOCATION_COLUMNS]


def _root_name(share: Share) -> str:
    local = share.local_path("")
    if local is not None:
        return local.name or "runs"
    return share.url.rstrip("/").rsplit("/", 1)[-1] or "runs"


def collect(share_or_path: str | os.PathLike[str] | Share,
            experiments: str | Sequence[str] | None = None) -> pd.DataFrame:
    """One row per run of ``experiments`` in a share, or of every run under a folder.

    ``share_or_path`` is a share (URL, folder or :class:`~nbbatch.store.share.Share`), any folder of
    papermill outputs (searched a few levels deep), or one executed ``.ipynb``. ``experiments``
    names folders in it; ``None`` takes everything below. Columns: see the module docstring
    (``param.*`` and ``metric.*`` come from whatever the runs have). Raises :class:`NbbatchError`
    when an experiment has no runs, naming the experiments there are.
    """
    pd = _pandas()
    if isinstance(share_or_path, (str, os.PathLike)) and str(share_or_path).endswith(".ipynb") \
            and Path(share_or_path).is_file():
        path = Path(share_or_path).resolve()
        share = open_share(path.parent)
        found = [_Found(path.parent.name, path.stem, None, path.name, None, None)]
        rows = [_read_run(share, f) for f in found]
        return _frame(pd, rows, share)
    share = open_share(share_or_path)
    root_name = _root_name(share)
    if isinstance(experiments, str):
        experiments = [experiments]
    rows: list[dict[str, Any]] = []
    if not experiments:
        found = _find(share, "", None, root_name)
        if not found:
            raise NbbatchError(
                f"no runs under {share.url}: it holds no run folders (`<experiment>/<run id>/{RUN_RECORD}` or "
                f"`{OUTPUT_NOTEBOOK}`) and no executed .ipynb files. Check the path, or submit an experiment first."
            )
        rows = [_read_run(share, f) for f in found]
    else:
        for experiment in experiments:
            name = experiment.strip("/")
            found = _find(share, name, name, root_name) if name else []
            if not found:
                raise NbbatchError(_no_runs_message(share, name))
            rows.extend(_read_run(share, f) for f in found)
    return _frame(pd, rows, share)


def _no_runs_message(share: Share, experiment: str) -> str:
    known = [n for n in share.list("") if n not in _SKIP_FOLDERS and not n.endswith(".ipynb") and share.list(n)]
    where = f"experiment `{experiment}` has no runs in {share.url}"
    if share.exists(experiment):
        where += f" (the folder `{experiment}` holds no {RUN_RECORD}, {OUTPUT_NOTEBOOK} or executed .ipynb)"
    hint = did_you_mean(experiment, known)
    listing = f"; experiments there: {', '.join(known[:20])}{'…' if len(known) > 20 else ''}" if known else \
        "; that share holds no experiments yet"
    return f"{where}{hint}{listing}. Submit it first (`nbbatch submit`) or pass the share with --share."


def _frame(pd: Any, rows: list[dict[str, Any]], share: Share) -> pd.DataFrame:
    columns = _order_columns(c for row in rows for c in row)
    frame = pd.DataFrame(rows, columns=columns)
    frame = frame.sort_values(["experiment", "framework", "run_id"], na_position="last", kind="stable")
    frame = frame.reset_index(drop=True)
    frame.attrs["share"] = share.url
    return frame


def collect_targets(targets: Sequence[str], share: str | os.PathLike[str] | Share | None = None) -> pd.DataFrame:
    """What ``nbbatch compare`` reads: each target an existing folder/.ipynb or an experiment.

    Without ``share``, a target that exists as a path is read as a folder of executed notebooks; any
    other target is an experiment (name or YAML file) in the share it was submitted to from this
    project (:func:`nbbatch.api.open_experiment_share`; default ``results/``). No targets: the
    project's whole ``results/`` share.
    """
    pd = _pandas()
    if not targets:
        return collect(share if share is not None else _default_share())
    frames = []
    for target in targets:
        if share is None and Path(target).exists() and not target.endswith((".yaml", ".yml")):
            frames.append(collect(target))
        else:
            from nbbatch.api import open_experiment_share

            name, opened = open_experiment_share(target, share)
            frames.append(collect(opened, [name]))
    if len(frames) == 1:
        return frames[0]
    combined = pd.concat(frames, ignore_index=True, sort=False)
    combined = combined[_order_columns(combined.columns)]
    combined.attrs["share"] = frames[0].attrs.get("share")
    return combined


def _default_share() -> str:
    from nbbatch.spec.project import find_project

    return str(find_project().results_dir)


# ---------------------------------------------------------------------------------------------
# Sort, filter, group
# ---------------------------------------------------------------------------------------------
def resolve_column(frame: pd.DataFrame, name: str) -> str:
    """The column ``name`` means: exact, else ``param.``/``metric.``/``telemetry.`` + name, else case-blind.

    Raises :class:`NbbatchError` with a "did you mean" when nothing matches.
    """
    columns = [str(c) for c in frame.columns]
    if name in columns:
        return name
    candidates = [p + name for p in (PARAM, METRIC, TELEMETRY) if p + name in columns]
    if len(candidates) == 1:
        return candidates[0]
    if len(candidates) > 1:
        raise NbbatchError(f"`{name}` is ambiguous: say {' or '.join(candidates)}")
    lowered = [c for c in columns if c.lower() in {name.lower(), *(p + name.lower() for p in (PARAM, METRIC))}]
    if len(lowered) == 1:
        return lowered[0]
    shown = [c for c in columns if c not in LOCATION_COLUMNS]
    raise NbbatchError(f"no column `{name}`{did_you_mean(name, columns)}; columns: {', '.join(shown)}")


_OPERATORS = ("!=", ">=", "<=", "==", "=", ">", "<")


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _text(value: Any) -> str:
    """A comparable text for a cell or a filter value: 0.1 == "0.1", True == "true"."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, numbers.Number):
        try:
            return format(float(value), ".12g")  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return str(value)
    text = str(value)
    if text in ("True", "False"):
        return text.lower()
    try:
        return format(float(text), ".12g")
    except ValueError:
        return text


def filter_runs(frame: pd.DataFrame, where: str | Iterable[str]) -> pd.DataFrame:
    """Keep the rows matching every condition: ``param.LR=0.1``, ``framework=pytorch,keras`` (any of),
    ``status!=failed``, ``metric.accuracy>=0.9`` (``=``, ``!=``, ``>``, ``>=``, ``<``, ``<=``).

    Numbers compare as numbers (``0.1`` matches ``0.10``); column names resolve as in :func:`resolve_column`.
    """
    pd = _pandas()
    conditions = [where] if isinstance(where, str) else list(where)
    mask = pd.Series(True, index=frame.index)
    for condition in conditions:
        for op in _OPERATORS:
            name, sep, raw = condition.partition(op)
            if sep and name.strip():
                break
        else:
            raise NbbatchError(f"cannot read the condition `{condition}`: write NAME=VALUE, NAME!=VALUE, "
                               "NAME>VALUE, NAME>=VALUE, NAME<VALUE or NAME<=VALUE (e.g. param.LR=0.1)")
        column = resolve_column(frame, name.strip())
        raw = raw.strip()
        series = frame[column]
        if op in ("=", "==", "!="):
            wanted = {_text(_parse_value(part.strip())) for part in raw.split(",")} if raw else {""}
            hit = series.map(lambda v, w=wanted: _text(v) in w).astype(bool)
            mask &= ~hit if op == "!=" else hit
        else:
            value = _parse_value(raw)
            if isinstance(value, numbers.Number) and not isinstance(value, bool):
                numeric = pd.to_numeric(series, errors="coerce")
                compared = {">": numeric > value, ">=": numeric >= value,
                            "<": numeric < value, "<=": numeric <= value}[op]
            else:
                text = series.astype("object").map(lambda v: "" if _text(v) == "" else str(v))
                compared = {">": text > str(value), ">=": text >= str(value),
                            "<": text < str(value), "<=": text <= str(value)}[op]
            mask &= compared.fillna(False).astype(bool)
    return frame[mask].reset_index(drop=True)


def sort_runs(frame: pd.DataFrame, keys: str | Sequence[str]) -> pd.DataFrame:
    """Sort by columns, comma-separated: ``"metric.accuracy"``; descending ``"-metric.accuracy"`` or
    ``"metric.accuracy:desc"`` (on the command line ``--sort=-metric.accuracy`` or ``--sort accuracy:desc``)."""
    wanted = [k.strip() for k in (keys.split(",") if isinstance(keys, str) else keys) if k.strip()]
    if not wanted:
        return frame
    columns, ascending = [], []
    for key in wanted:
        name, _, order = key.partition(":")
        if order.strip().lower() not in ("", "asc", "desc"):
            raise NbbatchError(f"sort key `{key}`: write NAME, -NAME, NAME:asc or NAME:desc")
        descending = name.startswith("-") or order.strip().lower() == "desc"
        columns.append(resolve_column(frame, name.lstrip("-+").strip()))
        ascending.append(not descending)
    return frame.sort_values(columns, ascending=ascending, na_position="last", kind="stable").reset_index(drop=True)


def _numeric_columns(frame: pd.DataFrame, prefixes: tuple[str, ...]) -> list[str]:
    pd = _pandas()
    out = []
    for column in frame.columns:
        if str(column).startswith(prefixes) or column == "duration_s":
            series = frame[column]
            present = series.dropna()
            if pd.api.types.is_bool_dtype(series) or (len(present) and present.map(lambda v: isinstance(v, bool)).all()):
                continue
            if pd.api.types.is_numeric_dtype(series) or pd.to_numeric(series, errors="coerce").notna().any():
                if pd.to_numeric(series, errors="coerce").notna().sum() == series.notna().sum():
                    out.append(str(column))
    return out


def group_runs(frame: pd.DataFrame, by: str | Sequence[str], agg: str = "mean") -> pd.DataFrame:
    """One row per group: ``runs``, ``succeeded``, ``failed`` and ``agg`` (mean/median/min/max) of every
    numeric metric and of ``duration_s``. ``by``: column names (comma-separated or a list)."""
    pd = _pandas()
    keys = [resolve_column(frame, k.strip()) for k in (by.split(",") if isinstance(by, str) else by) if k.strip()]
    if not keys:
        raise NbbatchError("--group-by needs a column, e.g. --group-by framework")
    if agg not in ("mean", "median", "min", "max", "sum", "std"):
        raise NbbatchError(f"unknown aggregation `{agg}`: use mean, median, min, max, sum or std")
    values = [c for c in _numeric_columns(frame, (METRIC, TELEMETRY)) if c not in keys]
    work = frame.copy()
    for column in values:
        work[column] = pd.to_numeric(work[column], errors="coerce")
    grouped = work.groupby(keys, dropna=False, sort=True)
    result = grouped.size().rename("runs").to_frame()
    result["succeeded"] = grouped["status"].apply(lambda s: int((s == "succeeded").sum()))
    result["failed"] = grouped["status"].apply(lambda s: int(s.isin(["failed", "timed_out"]).sum()))
    if values:
        aggregated = grouped[values].agg(agg)
        aggregated.columns = [f"{c} ({agg})" for c in aggregated.columns]
        result = result.join(aggregated)
    return result.reset_index()


# ---------------------------------------------------------------------------------------------
# Export and import
# ---------------------------------------------------------------------------------------------
def _records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    pd = _pandas()
    rows = []
    for row in frame.to_dict(orient="records"):
        clean: dict[str, Any] = {}
        for key, value in row.items():
            if value is None or (not isinstance(value, (list, dict, str)) and pd.isna(value)):
                clean[str(key)] = None
            elif hasattr(value, "item") and callable(value.item):
                clean[str(key)] = value.item()
            else:
                clean[str(key)] = value
        rows.append(clean)
    return rows


def write_table(frame: pd.DataFrame, path: str | os.PathLike[str]) -> Path:
    """Write the table as CSV (``.csv``) or JSON (``.json``: a list of row objects, missing values null)."""
    target = Path(path)
    suffix = target.suffix.lower()
    if suffix not in (".csv", ".json"):
        raise NbbatchError(f"cannot tell the format of `{target}`: name it .csv or .json")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.part")
    if suffix == ".csv":
        frame.to_csv(tmp, index=False)
    else:
        tmp.write_text(json.dumps(_records(frame), indent=1, default=str) + "\n")
    os.replace(tmp, target)
    return target


def read_table(path: str | os.PathLike[str]) -> pd.DataFrame:
    """Read a table :func:`write_table` wrote (CSV or JSON), e.g. a baseline for :func:`check`."""
    pd = _pandas()
    source = Path(path)
    if not source.is_file():
        raise NbbatchError(f"no file `{source}`")
    try:
        if source.suffix.lower() == ".json":
            data = json.loads(source.read_text())
            if isinstance(data, dict):
                data = data.get("runs", [data])
            if not isinstance(data, list):
                raise ValueError("expected a list of run objects")
            return pd.DataFrame(data)
        return pd.read_csv(source)
    except (ValueError, pd.errors.ParserError) as exc:
        raise NbbatchError(f"cannot read the table `{source}`: {exc}") from exc


# ---------------------------------------------------------------------------------------------
# Terminal table
# ---------------------------------------------------------------------------------------------
def display_columns(frame: pd.DataFrame) -> list[str]:
    """The columns worth showing: ids, status, the parameters that vary, the metrics, duration, errors."""
    shown: list[str] = []
    if "experiment" in frame and frame["experiment"].nunique(dropna=False) > 1:
        shown.append("experiment")
    shown += [c for c in ("run_id", "framework", "status") if c in frame]
    shown += [c for c in frame.columns if str(c).startswith(PARAM) and frame[c].astype(str).nunique() > 1]
    for column in frame.columns:
        if str(column).startswith(METRIC):
            values = frame[column].dropna()
            if values.empty or not values.map(lambda v: isinstance(v, str) and v[:1] in "[{").all():
                shown.append(str(column))
    shown += [c for c in ("duration_s",) if c in frame]
    if "gpu_ids" in frame and frame["gpu_ids"].fillna("").astype(str).str.len().gt(0).any():
        shown.append("gpu_ids")
    if "error" in frame and frame["error"].notna().any():
        shown.append("error")
    return shown


def _cell_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if math.isnan(value):
            return ""
        return f"{value:.4g}"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        return _cell_text(float(value))
    try:
        if _pandas().isna(value):
            return ""
    except (TypeError, ValueError):
        pass
    return str(value)


_STATUS_STYLE = {"succeeded": "green", "failed": "red", "timed_out": "red", "cancelled": "yellow",
                 "running": "cyan", "queued": "dim", "incomplete": "yellow", "unreadable": "magenta"}


def runs_table(frame: pd.DataFrame, columns: Sequence[str] | None = None, title: str | None = None,
               max_rows: int | None = None) -> Table:
    """A :class:`rich.table.Table` of the runs (default columns: :func:`display_columns`)."""
    from rich.table import Table

    chosen = [resolve_column(frame, c) for c in columns] if columns else display_columns(frame)
    table = Table(title=title, show_lines=False, header_style="bold")
    for column in chosen:
        numeric = _pandas().api.types.is_numeric_dtype(frame[column]) and column != "gpu_ids"
        header = column.removeprefix(METRIC) if column.startswith(METRIC) else column
        table.add_column(header, justify="right" if numeric else "left", overflow="fold",
                         no_wrap=column in ("run_id", "framework", "status", "experiment"),
                         max_width=60 if column == "error" else None)
    rows = frame if max_rows is None else frame.head(max_rows)
    for _, row in rows.iterrows():
        cells = []
        for column in chosen:
            text = _cell_text(row[column])
            style = _STATUS_STYLE.get(text) if column == "status" else None
            cells.append(f"[{style}]{text}[/]" if style else text.replace("[", r"\["))
        table.add_row(*cells)
    if max_rows is not None and len(frame) > max_rows:
        table.caption = f"{len(frame) - max_rows} more runs not shown"
    return table


def terminal() -> Console:
    """A rich console: the terminal's width, or ``$COLUMNS`` (default 200) when output goes to a file or CI log."""
    from rich.console import Console

    console = Console()
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console = Console(width=200)
    return console


def print_table(frame: pd.DataFrame, console: Console | None = None, **options: Any) -> None:
    """Print :func:`runs_table` to the terminal (or ``console``)."""
    (console or terminal()).print(runs_table(frame, **options))


# ---------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------
def _figure(width: float = 6.4, height: float = 4.2) -> Figure:
    # A bare Figure renders with the Agg canvas and touches no pyplot state (safe in a Jupyter session).
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def _numeric(frame: pd.DataFrame, column: str) -> pd.Series:
    return _pandas().to_numeric(frame[column], errors="coerce")


def default_metric(frame: pd.DataFrame) -> str | None:
    """``metric.accuracy`` if present, else the first numeric metric column (None without one)."""
    if f"{METRIC}accuracy" in frame:
        return f"{METRIC}accuracy"
    numeric = _numeric_columns(frame, (METRIC,))
    return numeric[0] if numeric else None


def default_time(frame: pd.DataFrame) -> str:
    """The training-time column: ``metric.train_seconds`` when the notebooks record it, else ``duration_s``."""
    for name in ("train_seconds", "training_seconds", "train_time", "train_time_s"):
        if f"{METRIC}{name}" in frame and _numeric(frame, f"{METRIC}{name}").notna().any():
            return f"{METRIC}{name}"
    return "duration_s"


def swept_parameters(frame: pd.DataFrame) -> list[str]:
    """``param.*`` columns with more than one value among the runs, numeric ones first."""
    swept = [c for c in frame.columns if str(c).startswith(PARAM) and frame[c].astype(str).nunique() > 1]
    return sorted(swept, key=lambda c: (_numeric(frame, c).notna().sum() != frame[c].notna().sum(), c))


def _label(column: str) -> str:
    return column.removeprefix(METRIC).removeprefix(PARAM)


def _groups(frame: pd.DataFrame) -> Iterable[tuple[str, pd.DataFrame]]:
    key = frame["framework"].fillna(frame["notebook"]).fillna("runs").astype(str)
    for name in sorted(key.unique()):
        yield name, frame[key == name]


def plot_metric_vs_time(frame: pd.DataFrame, metric: str | None = None, time: str | None = None) -> Figure | None:
    """Scatter of a metric (default accuracy) against training time, one colour per framework.

    ``time`` defaults to :func:`default_time`. Returns None when no run has both values.
    """
    metric = resolve_column(frame, metric) if metric else default_metric(frame)
    if metric is None:
        return None
    time = resolve_column(frame, time) if time else default_time(frame)
    data = frame.assign(_x=_numeric(frame, time), _y=_numeric(frame, metric)).dropna(subset=["_x", "_y"])
    if data.empty:
        return None
    fig = _figure()
    ax = fig.add_subplot()
    for name, group in _groups(data):
        ax.scatter(group["_x"], group["_y"], label=name, s=40, alpha=0.85)
    ax.set_xlabel(f"{_label(time)} (s)" if not _label(time).endswith("_s") else _label(time))
    ax.set_ylabel(_label(metric))
    ax.set_title(f"{_label(metric)} vs. {_label(time)} by framework")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", title="framework")
    return fig


def plot_metric_vs_param(frame: pd.DataFrame, metric: str | None = None, param: str | None = None) -> Figure | None:
    """A metric against a swept parameter, one line per framework (mean over other parameters).

    ``param`` defaults to the first swept parameter (:func:`swept_parameters`), on a log axis when its
    values are positive and span a factor of 20 or more (learning rates, batch sizes). Returns None
    without a metric or a swept parameter.
    """
    metric = resolve_column(frame, metric) if metric else default_metric(frame)
    if param:
        param = resolve_column(frame, param)
    else:
        swept = swept_parameters(frame)
        param = swept[0] if swept else None
    if metric is None or param is None:
        return None
    data = frame.assign(_y=_numeric(frame, metric)).dropna(subset=["_y"])
    if data.empty:
        return None
    numeric_x = _numeric(data, param)
    categorical = numeric_x.isna().any()
    data = data.assign(_x=data[param].astype(str) if categorical else numeric_x)
    fig = _figure()
    ax = fig.add_subplot()
    for name, group in _groups(data):
        points = group.groupby("_x", sort=True)["_y"].mean()
        ax.plot(list(points.index), list(points.values), marker="o", label=name)
    if not categorical:
        positive = numeric_x[numeric_x > 0]
        if len(positive) == len(numeric_x) and positive.max() / positive.min() >= 20:
            ax.set_xscale("log")
    ax.set_xlabel(_label(param))
    ax.set_ylabel(_label(metric))
    ax.set_title(f"{_label(metric)} vs. {_label(param)}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", title="framework")
    return fig


def load_telemetry(frame: pd.DataFrame, share: str | os.PathLike[str] | Share | None = None
                   ) -> dict[str, list[dict[str, Any]]]:
    """The telemetry series of the runs that have one: ``{run label: samples}`` (see :mod:`nbbatch.execute.telemetry`).

    Reads ``<run folder>/telemetry.json`` (or ``.csv``) through ``share`` (default: the share
    :func:`collect` read). Unreadable series are skipped.
    """
    from nbbatch.execute.telemetry import read_series

    if "telemetry_file" not in frame or frame["telemetry_file"].isna().all():
        return {}
    target = share if share is not None else frame.attrs.get("share")
    if target is None:
        return {}
    opened = open_share(target)
    series: dict[str, list[dict[str, Any]]] = {}
    several = frame["experiment"].nunique() > 1
    for _, row in frame[frame["telemetry_file"].notna()].iterrows():
        label = f"{row['experiment']}/{row['run_id']}" if several else str(row["run_id"])
        try:
            samples = read_series(opened.read_bytes(f"{row['share_path']}/{row['telemetry_file']}"))
        except (OSError, ValueError, NbbatchError):
            continue
        if samples:
            series[label] = samples
    return series


def plot_gpu_telemetry(series: Mapping[str, Sequence[Mapping[str, Any]]]) -> Figure | None:
    """GPU utilisation (%) and memory used (MB) over time, one line per run (and GPU, when a run has several)."""
    if not any(series.values()):
        return None
    fig = _figure(height=6.0)
    util_ax, mem_ax = fig.subplots(2, 1, sharex=True)
    for label, samples in series.items():
        by_gpu: dict[Any, list[Mapping[str, Any]]] = {}
        for sample in samples:
            by_gpu.setdefault(sample.get("gpu"), []).append(sample)
        for gpu, points in by_gpu.items():
            name = label if len(by_gpu) == 1 else f"{label} gpu{gpu}"
            t = [p.get("t") for p in points]
            line = util_ax.plot(t, [p.get("util_pct") for p in points], label=name)[0]
            mem_ax.plot(t, [p.get("memory_mb") for p in points], color=line.get_color(), label=name)
    util_ax.set_ylabel("GPU utilisation (%)")
    util_ax.set_ylim(0, 105)
    mem_ax.set_ylabel("GPU memory used (MB)")
    mem_ax.set_xlabel("time since the run started (s)")
    util_ax.set_title("GPU utilisation and memory per run")
    for ax in (util_ax, mem_ax):
        ax.grid(True, alpha=0.3)
    util_ax.legend(fontsize="x-small", loc="upper right")
    return fig


def figure_png(fig: Figure) -> bytes:
    """A figure as PNG bytes (Agg renderer)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    return buffer.getvalue()


# ---------------------------------------------------------------------------------------------
# HTML report
# ---------------------------------------------------------------------------------------------
def _href(output: str | None, report_dir: Path) -> str | None:
    if not output or not isinstance(output, str):
        return None
    if "://" in output:
        return output
    try:
        relative = os.path.relpath(output, report_dir)
    except ValueError:  # another drive on Windows
        return Path(output).as_uri()
    return quote(relative.replace(os.sep, "/"))


def render_report(frame: pd.DataFrame, report_path: str | os.PathLike[str], *, metric: str | None = None,
                  time: str | None = None, param: str | None = None, title: str | None = None,
                  share: str | os.PathLike[str] | Share | None = None) -> str:
    """The report's HTML: summary, plots as embedded PNG, the runs with links to their notebooks, errors.

    Links are relative to ``report_path``'s folder. ``metric``/``time``/``param`` choose the plots'
    axes (defaults: accuracy, :func:`default_time`, the first swept parameter).
    """
    import importlib.resources

    import jinja2

    from nbbatch import __version__
    from nbbatch.store.runrecord import utc_now

    report_dir = Path(report_path).resolve().parent
    figures = []
    for caption, build in (
        ("Accuracy vs. training time", lambda: plot_metric_vs_time(frame, metric, time)),
        ("Metric vs. swept parameter", lambda: plot_metric_vs_param(frame, metric, param)),
        ("GPU telemetry", lambda: plot_gpu_telemetry(load_telemetry(frame, share))),
    ):
        fig = build()
        if fig is not None:
            title_text = fig.axes[0].get_title() or caption
            figures.append({"title": title_text,
                            "png": base64.b64encode(figure_png(fig)).decode("ascii")})
    columns = display_columns(frame)
    rows = []
    for _, row in frame.iterrows():
        rows.append({
            "cells": [{"column": c, "text": _cell_text(row[c]),
                       "numeric": isinstance(row[c], numbers.Number) and not isinstance(row[c], bool)}
                      for c in columns],
            "href": _href(row.get("output"), report_dir),
            "link": posixpath.basename(str(row.get("output")).replace("\\", "/")) if row.get("output") else "",
            "status": _cell_text(row.get("status")),
        })
    failures = [
        {"run": f"{row['experiment']}/{row['run_id']}", "error": _cell_text(row.get("error")),
         "href": _href(row.get("output"), report_dir), "status": _cell_text(row.get("status"))}
        for _, row in frame.iterrows() if row.get("status") not in ("succeeded",) and _cell_text(row.get("error"))
    ]
    counts = frame["status"].value_counts(dropna=False) if len(frame) else {}
    experiments = sorted({str(e) for e in frame.get("experiment", [])})
    template_text = importlib.resources.files("nbbatch.results").joinpath("templates/report.html.j2").read_text("utf-8")
    environment = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    return environment.from_string(template_text).render(
        title=title or f"nbbatch report: {', '.join(experiments) or 'runs'}",
        generated=utc_now(),
        version=__version__,
        experiments=experiments,
        total=len(frame),
        counts=[(str(k), int(v)) for k, v in dict(counts).items()],
        figures=figures,
        headers=[c.removeprefix(METRIC) if c.startswith(METRIC) else c for c in columns],
        rows=rows,
        failures=failures,
    )


def write_report(frame: pd.DataFrame, path: str | os.PathLike[str], **options: Any) -> Path:
    """Write :func:`render_report` to ``path`` (one self-contained HTML file; mail it as it is)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    html = render_report(frame, target, **options)
    tmp = target.with_name(f".{target.name}.part")
    tmp.write_text(html, encoding="utf-8")
    os.replace(tmp, target)
    return target


# ---------------------------------------------------------------------------------------------
# Regression check against a baseline
# ---------------------------------------------------------------------------------------------
@dataclass
class CheckResult:
    """The outcome of :func:`check`: one row per (run key, metric) and whether all passed.

    ``table`` columns: the key columns, ``metric``, ``baseline``, ``current``, ``delta``,
    ``rel_delta``, ``allowed`` (the tolerance in the metric's units) and ``outcome``: ``ok``,
    ``moved`` (beyond tolerance), ``missing`` (the current run has no value), ``failed`` (the
    current run did not succeed), ``new`` (no baseline), ``not-run`` (in the baseline only).
    ``moved``, ``missing`` and ``failed`` fail the check; ``not-run`` too with ``require_all``.
    """

    table: pd.DataFrame
    passed: bool
    key: list[str]

    @property
    def exit_code(self) -> int:
        """0 when the check passed, 1 when a metric moved beyond tolerance (or a run is missing)."""
        return 0 if self.passed else 1

    def summary(self) -> str:
        counts = self.table["outcome"].value_counts().to_dict() if len(self.table) else {}
        parts = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
        return f"check {'passed' if self.passed else 'FAILED'}: {parts or 'nothing compared'}"


def parse_tolerance(text: str | float | None) -> tuple[float | None, float | None]:
    """``"0.02"`` → absolute 0.02; ``"2%"`` → relative 0.02. Returns ``(abs, rel)``."""
    if text is None:
        return None, None
    if isinstance(text, (int, float)):
        return float(text), None
    raw = text.strip()
    try:
        if raw.endswith("%"):
            return None, float(raw[:-1]) / 100.0
        return float(raw), None
    except ValueError as exc:
        raise NbbatchError(f"tolerance `{text}` is not a number: write 0.02 (absolute) or 2% (relative)") from exc


def default_check_key(current: pd.DataFrame, baseline: pd.DataFrame) -> list[str]:
    """``framework`` plus the parameters swept (varying) in either table and present in both."""
    key = ["framework"] if "framework" in current and "framework" in baseline else ["run_id"]
    swept = set(swept_parameters(current)) | set(swept_parameters(baseline))
    key += sorted(c for c in swept if c in current and c in baseline)
    return key


def _metric_column(frame: pd.DataFrame, metric: str, what: str) -> str:
    try:
        return resolve_column(frame, metric if metric.startswith(METRIC) or metric in frame else METRIC + metric)
    except NbbatchError:
        raise NbbatchError(f"the {what} has no metric `{metric}`"
                           f"{did_you_mean(METRIC + metric, [str(c) for c in frame.columns])}; metrics there: "
                           f"{', '.join(c.removeprefix(METRIC) for c in frame.columns if str(c).startswith(METRIC))}"
                           ) from None


def check(current: pd.DataFrame, baseline: pd.DataFrame, metrics: str | Sequence[str], *,
          tolerance: float | None = None, rel_tolerance: float | None = None,
          key: Sequence[str] | None = None, direction: str = "both", require_all: bool = False) -> CheckResult:
    """Compare metrics of ``current`` runs with ``baseline`` runs matched on ``key``.

    A metric passes when ``|current - baseline| <= max(tolerance, rel_tolerance * |baseline|)``
    (both default to 0: any change fails). ``direction``: ``both``; ``decrease`` (only drops fail,
    for accuracy-like metrics) or ``increase`` (only rises fail, for loss/time). ``key`` defaults to
    :func:`default_check_key`; several runs with the same key are averaged. Baseline runs that did not
    succeed are left out.
    """
    pd = _pandas()
    if direction not in ("both", "decrease", "increase"):
        raise NbbatchError(f"direction `{direction}` must be both, decrease or increase")
    names = [m.strip() for m in (metrics.split(",") if isinstance(metrics, str) else metrics) if m.strip()]
    if not names:
        raise NbbatchError("check needs a metric, e.g. --metric accuracy")
    abs_tol = float(tolerance or 0.0)
    rel_tol = float(rel_tolerance or 0.0)
    if abs_tol < 0 or rel_tol < 0:
        raise NbbatchError("tolerances must be >= 0")
    keys = list(key) if key else default_check_key(current, baseline)
    keys = [resolve_column(current, k) for k in keys]
    for k in keys:
        if k not in baseline:
            raise NbbatchError(f"the baseline has no column `{k}` to match runs on; pass --key with columns both have")

    def keyed(frame: pd.DataFrame) -> pd.Series:
        return frame[keys].apply(lambda r: tuple(_text(v) for v in r), axis=1) if len(frame) else pd.Series([])

    rows: list[dict[str, Any]] = []
    for name in names:
        cur_col = _metric_column(current, name, "current experiment")
        base_col = _metric_column(baseline, name, "baseline")
        label = cur_col.removeprefix(METRIC)
        base = baseline.assign(_k=keyed(baseline), _v=_numeric(baseline, base_col))
        if "status" in base:  # a baseline run that did not succeed is no reference
            base = base[base["status"].isna() | (base["status"] == "succeeded")]
        cur = current.assign(_k=keyed(current), _v=_numeric(current, cur_col))
        base_values = base.dropna(subset=["_v"]).groupby("_k")["_v"].mean().to_dict()
        base_display = {k: g.iloc[0] for k, g in base.groupby("_k")[keys]}
        seen = set()
        for k, group in cur.groupby("_k", sort=True):
            seen.add(k)
            values = group["_v"].dropna()
            statuses = set(group["status"].dropna().astype(str)) if "status" in group else set()
            value = float(values.mean()) if len(values) else None
            reference = base_values.get(k)
            row = dict(zip(keys, group[keys].iloc[0], strict=True))
            row.update(metric=label, baseline=reference, current=value, delta=None, rel_delta=None, allowed=None)
            if reference is not None and value is not None:
                delta = value - reference
                allowed = max(abs_tol, rel_tol * abs(reference))
                row.update(delta=delta, rel_delta=(delta / abs(reference)) if reference else None, allowed=allowed)
                slack = 1e-12 * max(1.0, abs(reference))
                beyond = {"both": abs(delta) > allowed + slack, "decrease": delta < -(allowed + slack),
                          "increase": delta > allowed + slack}[direction]
            unsuccessful = sorted(statuses - {"succeeded"})
            if unsuccessful:
                outcome = "failed"
                row["outcome_detail"] = ",".join(unsuccessful)
            elif reference is None:
                outcome = "new"
            elif value is None:
                outcome = "missing"
            else:
                outcome = "moved" if beyond else "ok"
            row["outcome"] = outcome
            rows.append(row)
        for k, values in base_display.items():
            if k not in seen:
                row = dict(zip(keys, values, strict=True))
                row.update(metric=label, baseline=base_values.get(k), current=None, delta=None, rel_delta=None,
                           allowed=None, outcome="not-run")
                rows.append(row)
    table = pd.DataFrame(rows, columns=[*keys, "metric", "baseline", "current", "delta", "rel_delta", "allowed",
                                        "outcome", *(["outcome_detail"] if any("outcome_detail" in r for r in rows)
                                                     else [])])
    failing = set(FAILING_OUTCOMES) | ({"not-run"} if require_all else set())
    passed = not table["outcome"].isin(failing).any() if len(table) else False
    if not len(table):
        passed = False
    return CheckResult(table=table, passed=bool(passed), key=keys)


def load_baseline(reference: str, share: str | os.PathLike[str] | Share | None = None) -> pd.DataFrame:
    """A baseline: a ``.csv``/``.json`` table (:func:`write_table`), a folder of runs, or an experiment in the share."""
    path = Path(reference)
    if path.suffix.lower() in (".csv", ".json"):
        return read_table(path)
    return collect_targets([reference], share)


# ---------------------------------------------------------------------------------------------
# CLI glue (the lead's cli.py wires these; each returns the exit status)
# ---------------------------------------------------------------------------------------------
def add_compare_arguments(parser: argparse.ArgumentParser, share_option: bool = True) -> None:
    """The arguments of ``nbbatch compare``."""
    parser.add_argument("targets", nargs="*", metavar="EXPERIMENT|PATH",
                        help="experiments in the share, or folders/.ipynb files of executed notebooks "
                             "(default: every experiment in the share)")
    if share_option:
        parser.add_argument("--share", default=None, help="the share (default: the project's results/ folder)")
    parser.add_argument("--where", action="append", default=[], metavar="COND",
                        help="keep runs matching COND, e.g. param.LR=0.1, framework=pytorch,keras, "
                             "metric.accuracy>=0.9, status!=failed (repeatable: all must hold)")
    parser.add_argument("--sort", default=None, metavar="COLS",
                        help="sort by columns, comma-separated; NAME:desc (or --sort=-NAME) for descending, "
                             "e.g. --sort metric.accuracy:desc")
    parser.add_argument("--group-by", default=None, metavar="COLS",
                        help="one row per group (e.g. framework or param.LR) with counts and mean metrics")
    parser.add_argument("--agg", default="mean", choices=["mean", "median", "min", "max", "sum", "std"],
                        help="how --group-by aggregates metrics (default: mean)")
    parser.add_argument("--columns", default=None, metavar="COLS",
                        help="columns to show, comma-separated (default: ids, status, swept parameters, metrics)")
    parser.add_argument("--csv", default=None, metavar="FILE", help="also write the table as CSV")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the table as JSON")
    parser.add_argument("--report", default=None, metavar="FILE.html",
                        help="write a self-contained HTML report with plots and links to the notebooks")
    parser.add_argument("--metric", default=None, help="the metric the plots show (default: accuracy)")
    parser.add_argument("--time", default=None,
                        help="the x axis of the metric-vs-time plot (default: metric.train_seconds, else duration_s)")
    parser.add_argument("--param", default=None, help="the swept parameter of the metric-vs-parameter plot")
    parser.add_argument("--title", default=None, help="the report's title")


def cli_compare(args: argparse.Namespace) -> int:
    """``nbbatch compare``: print the runs table; write CSV/JSON/report as asked."""
    console = terminal()
    frame = collect_targets(args.targets, getattr(args, "share", None))
    if args.where:
        total = len(frame)
        frame = filter_runs(frame, args.where)
        if not len(frame):
            console.print(f"[yellow]none of the {total} runs matches {' and '.join(args.where)}[/]")
    if args.sort:
        frame = sort_runs(frame, args.sort)
    shown = group_runs(frame, args.group_by, args.agg) if args.group_by else frame
    if args.csv:
        console.print(f"wrote {write_table(shown, args.csv)}")
    if args.json:
        console.print(f"wrote {write_table(shown, args.json)}")
    columns = [c for c in args.columns.split(",") if c.strip()] if args.columns else None
    if args.group_by:
        console.print(runs_table(shown, columns=columns or [str(c) for c in shown.columns],
                                 title=f"{len(frame)} runs by {args.group_by}"))
    else:
        console.print(runs_table(shown, columns=columns, title=f"{len(shown)} runs"))
    if args.report:
        path = write_report(frame, args.report, metric=args.metric, time=args.time, param=args.param,
                            title=args.title, share=getattr(args, "share", None))
        console.print(f"wrote {path}")
    return 0


def add_check_arguments(parser: argparse.ArgumentParser, share_option: bool = True) -> None:
    """The arguments of ``nbbatch check``."""
    parser.add_argument("experiment", metavar="EXPERIMENT|PATH", help="the runs to check")
    parser.add_argument("--baseline", required=True, metavar="EXPERIMENT|FILE",
                        help="an experiment in the share, a folder of runs, or a table (.csv/.json from compare)")
    if share_option:
        parser.add_argument("--share", default=None, help="the share (default: the project's results/ folder)")
    parser.add_argument("--metric", action="append", required=True,
                        help="metric to check (repeatable or comma-separated)")
    parser.add_argument("--tolerance", default=None,
                        help="allowed change: absolute (0.02) or relative with %% (2%%); default 0")
    parser.add_argument("--rel-tolerance", type=float, default=None,
                        help="allowed relative change (0.05 = 5%% of the baseline); the larger allowance wins")
    parser.add_argument("--direction", choices=["both", "decrease", "increase"], default="both",
                        help="which moves fail: both (default), decrease (e.g. accuracy) or increase (e.g. loss)")
    parser.add_argument("--key", default=None,
                        help="columns matching runs to baseline runs, comma-separated "
                             "(default: framework + swept parameters)")
    parser.add_argument("--where", action="append", default=[], metavar="COND",
                        help="check only runs matching COND (applied to both sides)")
    parser.add_argument("--require-all", action="store_true", help="fail when a baseline run was not run")
    parser.add_argument("--csv", default=None, metavar="FILE", help="also write the check table as CSV")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the check table as JSON")


def cli_check(args: argparse.Namespace) -> int:
    """``nbbatch check``: print the check table; 0 when every metric is within tolerance, else 1."""
    console = terminal()
    share = getattr(args, "share", None)
    current = collect_targets([args.experiment], share)
    baseline = load_baseline(args.baseline, share)
    if args.where:
        current = filter_runs(current, args.where)
        baseline = filter_runs(baseline, args.where)
    abs_tol, rel_tol = parse_tolerance(args.tolerance)
    if args.rel_tolerance is not None:
        rel_tol = args.rel_tolerance
    metrics = [m for item in args.metric for m in item.split(",") if m.strip()]
    result = check(current, baseline, metrics, tolerance=abs_tol, rel_tolerance=rel_tol,
                   key=[k for k in args.key.split(",") if k.strip()] if args.key else None,
                   direction=args.direction, require_all=args.require_all)
    for path in (args.csv, args.json):
        if path:
            write_table(result.table, path)
    table = runs_table(result.table, columns=[str(c) for c in result.table.columns],
                       title=f"{args.experiment} vs. {args.baseline}")
    for index, row in enumerate(result.table.itertuples(index=False)):
        if row.outcome in FAILING_OUTCOMES:
            table.rows[index].style = "red"
    console.print(table)
    console.print(f"[{'green' if result.passed else 'red'}]{result.summary()}[/]")
    return result.exit_code
