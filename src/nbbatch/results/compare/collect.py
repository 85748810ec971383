"""Finding runs and reading them into the runs table: :func:`collect` and :func:`collect_targets`.

A run is a run folder (``run.json`` and/or ``output.ipynb``) anywhere below the share or folder
searched, or a lone executed ``.ipynb``; each becomes one row (the columns: :mod:`nbbatch.results.compare`).
"""

from __future__ import annotations

import json
import math
import numbers
import os
import posixpath
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nbbatch.errors import NbbatchError
from nbbatch.metrics import metrics_from_notebook
from nbbatch.results.compare.trials import PARAM, latest_segments, segment_groups
from nbbatch.results.status import no_runs_message, order_caption, order_value, planned_run_ids, search_of
from nbbatch.spec.project import find_project
from nbbatch.store.known import open_experiment_share
from nbbatch.store.layout import LOG_FILE, METRICS_FILE, OLD_TELEMETRY_FILE, OUTPUT_NOTEBOOK, RUN_RECORD, TELEMETRY_FILE
from nbbatch.store.notebook_io import cell_number
from nbbatch.store.runjson import RunError, RunRecord
from nbbatch.store.share import Share, open_share

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

METRIC = "metric."
TELEMETRY = "telemetry."
# the old single JSON document, and telemetry.csv: GpuSampler.write_series's CSV
TELEMETRY_FILES = (TELEMETRY_FILE, OLD_TELEMETRY_FILE, "telemetry.csv")
LEADING_COLUMNS = ("experiment", "run_id", "framework", "notebook", "kernel", "status")
TRAILING_COLUMNS = ("duration_s", "gpu_ids", "started_at", "ended_at", "host", "attempts", "error")
LOCATION_COLUMNS = ("output", "source", "share_path", "telemetry_file", "metrics_file")
_MAX_DEPTH = 6
_SKIP_FOLDERS = {".ipynb_checkpoints", "__pycache__", ".git"}
_RUN_FILES = (LOG_FILE, METRICS_FILE, *TELEMETRY_FILES)  # files a run streams: never walked into


def _pandas() -> Any:
    try:
        import pandas
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise NbbatchError("comparing runs needs pandas: pip install 'nbbatch[compare]'") from exc
    return pandas


@dataclass(frozen=True)
class _Found:
    """A run found in a share: a run folder (``run.json`` and/or ``output.ipynb``) or a lone notebook."""

    experiment: str
    run_id: str
    folder: str | None  # run folder, relative to the share (None for a lone notebook)
    notebook: str | None  # notebook path relative to the share
    record: str | None  # run.json path relative to the share
    telemetry: str | None  # series file name in the run folder
    metrics: str | None = None  # metric history file name in the run folder


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
                telemetry=telemetry, metrics=METRICS_FILE if METRICS_FILE in names else None,
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
            elif name not in _SKIP_FOLDERS and depth < _MAX_DEPTH and name not in _RUN_FILES:
                walk(child, depth + 1)

    walk(base, 0)
    return found


def _current_plan(share: Share, found: list[_Found]) -> tuple[list[_Found], int]:
    """``found`` without the runs superseded by a later submission, and how many were left out.

    A run folder is superseded when the manifest beside it (``experiment.json``) does not list it (see
    :func:`nbbatch.results.status.planned_run_ids`); without a manifest every run counts.
    """
    plans: dict[str, set[str] | None] = {}
    kept = []
    for run in found:
        if run.folder is None:  # a lone notebook: no submission planned it
            kept.append(run)
            continue
        parent, _, name = run.folder.rpartition("/")
        if parent not in plans:
            planned = planned_run_ids(share, parent)
            plans[parent] = None if planned is None else set(planned)
        plan = plans[parent]
        if plan is None or name in plan:
            kept.append(run)
    return kept, len(found) - len(kept)


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


def _notebook_error(nb: Mapping[str, Any]) -> RunError | None:
    """The first error output of a notebook, its cell numbered as the user's notebook has it (as run.json's)."""
    cells = list(nb.get("cells", []))
    for index, cell in enumerate(cells):
        for output in cell.get("outputs", []) or []:
            if output.get("output_type") == "error":
                return RunError(str(output.get("ename", "")), str(output.get("evalue", "")),
                                cell_index=cell_number(cells, index), cell_source=cell_source(cell))
    return None


def cell_source(cell: Mapping[str, Any]) -> str:
    """A cell's source as one string."""
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
                             if c.get("cell_type") == "code" and cell_source(c).strip()):
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
        "error": error.summary() if error else None,
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
        "error": record.error_summary() or None,
        "source": RUN_RECORD,
        **_trial_columns(record.trial or {}),
    }
    _flatten(PARAM, record.parameters or {}, row)
    _flatten(METRIC, record.metrics or {}, row)
    if (record.telemetry or {}).get("samples"):  # nothing to show for runs without a GPU
        telemetry = {k: v for k, v in record.telemetry.items()
                     if k not in ("gpu_ids", "unavailable") and v is not None}
        _flatten(TELEMETRY, telemetry, row)
    return row


def _is_pbt(search: Mapping[str, Any]) -> bool:
    """Whether a search block's pruner is population-based training (``pruner: {pbt: {...}}``)."""
    pruner = search.get("pruner")
    return isinstance(pruner, Mapping) and "pbt" in pruner


def _trial_columns(trial: Mapping[str, Any]) -> dict[str, Any]:
    """A search's trial in the runs table: its number, where a pruned one was stopped (``pruned_at``) and, for a
    trial continued over several runs, this run's ``segment`` and the trial's state it recorded (``trial_state``)."""
    if not trial:
        return {}
    columns: dict[str, Any] = {"trial": trial.get("number")}
    if "segment" in trial:  # a segment stops at its rung (``resource``): a pruned trial was stopped there
        columns.update(segment=trial.get("segment"), trial_state=trial.get("state"))
        if "params" in trial:  # population-based training: its rung, and the member it copied (exploited) there
            exploited = trial.get("exploited") or {}
            columns.update(resource=trial.get("resource"), exploited=exploited.get("trial"),
                           exploited_run=exploited.get("run_id"))
        if trial.get("state") == "pruned":
            columns["pruned_at"] = trial.get("resource", trial.get("step"))
    elif trial.get("state") == "pruned":
        columns["pruned_at"] = trial.get("step")
    return columns


def share_location(share: Share, path: str) -> str:
    """Where ``path`` of ``share`` is, for people: a local path, else its URL."""
    local = share.local_path(path)
    return str(local) if local is not None else f"{share.url.rstrip('/')}/{path}"


def _read_run(share: Share, found: _Found) -> dict[str, Any]:
    base: dict[str, Any] = {"experiment": found.experiment, "run_id": found.run_id}
    row: dict[str, Any] = {}
    nb: Mapping[str, Any] | None = None
    try:
        if found.record is not None:
            record = RunRecord.from_json(share.read_bytes(found.record), source=share_location(share, found.record))
            row = _row_from_record(record)
            base = {"experiment": record.experiment or found.experiment, "run_id": found.run_id}  # its folder's
            if record.run_id and record.run_id != found.run_id:  # a folder copied or renamed, or a hand edit
                row["problem"] = f"{RUN_RECORD} names run {record.run_id}, not its folder's {found.run_id}"
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
    row["output"] = share_location(share, found.notebook) if found.notebook else None
    row["share_path"] = found.folder or found.notebook
    row["telemetry_file"] = found.telemetry
    row["metrics_file"] = found.metrics
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
            experiments: str | Sequence[str] | None = None, all_runs: bool = False) -> pd.DataFrame:
    """One row per run of ``experiments`` in a share, or of every run under a folder.

    ``share_or_path`` is a share (URL, folder or :class:`~nbbatch.store.share.Share`), any folder of
    papermill outputs (searched a few levels deep), or one executed ``.ipynb``. ``experiments``
    names folders in it; ``None`` takes everything below. An experiment's runs are those of its current
    plan (its last submission's), unless ``all_runs``: how many were left out is ``frame.attrs["superseded"]``.
    Columns: see the module docstring (``param.*`` and ``metric.*`` come from whatever the runs have).
    Raises :class:`NbbatchError` when an experiment has no runs, naming the experiments there are.
    """
    pd = _pandas()
    if isinstance(share_or_path, (str, os.PathLike)) and str(share_or_path).endswith(".ipynb") \
            and Path(share_or_path).is_file():
        path = Path(share_or_path).resolve()
        share = open_share(path.parent)
        found = [_Found(path.parent.name, path.stem, None, path.name, None, None)]
        return _frame(pd, [_read_run(share, f) for f in found], share)
    share = open_share(share_or_path)
    root_name = _root_name(share)
    if isinstance(experiments, str):
        experiments = [experiments]
    found = []
    if not experiments:
        found = _find(share, "", None, root_name)
        if not found:
            raise NbbatchError(
                f"no runs under {share.url}: it holds no run folders (`<experiment>/<run id>/{RUN_RECORD}` or "
                f"`{OUTPUT_NOTEBOOK}`) and no executed .ipynb files. Check the path, or submit an experiment first."
            )
    for experiment in experiments or []:
        name = experiment.strip("/")
        runs = _find(share, name, name, root_name) if name else []
        if not runs:
            raise NbbatchError(no_runs_message(share, name))
        found.extend(runs)
    superseded = 0
    if not all_runs:
        found, superseded = _current_plan(share, found)
    frame = _frame(pd, [_read_run(share, f) for f in found], share)
    frame.attrs["superseded"] = superseded
    searches = [s for s in (search_of(share, e.strip("/")) for e in experiments or []) if s]
    if searches:  # what a search optimised: `compare` sorts its runs by it (the first objective), best first
        search = searches[0]
        frame.attrs["search"] = {"metric": search["metric"], "mode": search.get("mode", "min"),
                                 **({"objectives": search["objectives"]} if search.get("objectives") else {}),
                                 "params": search.get("params") or {},  # its space: how importance reads them
                                 **({"pbt": True, "resource": search.get("resource")} if _is_pbt(search) else {})}
        if search.get("objectives") and "trial" in frame:
            frame["pareto"] = pareto_column(frame, search["objectives"])
    return frame


def pareto_column(frame: pd.DataFrame, objectives: list[list[str]]) -> list[bool | None]:
    """Per run of a multi-objective search: whether its trial is on the Pareto front (it succeeded, and no other
    succeeded trial is as good in every objective and better in one; a continued trial by its latest segment, and
    every segment of it marked alike); None for a run that is no trial."""
    points: dict[Hashable, list[float]] = {}
    for index, row in latest_segments(frame).iterrows():
        values = [row.get(f"{METRIC}{metric}") for metric, _ in objectives]
        if row.get("status") == "succeeded" and all(_finite(v) for v in values) and not _missing(row.get("trial")):
            points[index] = [float(v) if mode == "min" else -float(v)  # every objective made one to minimise
                             for v, (_, mode) in zip(values, objectives, strict=True)]

    def dominated(point: list[float]) -> bool:
        return any(all(o <= p for o, p in zip(other, point, strict=True)) and other != point
                   for other in points.values())

    groups = segment_groups(frame)
    front = {run for index, point in points.items() if not dominated(point) for run in groups[index]}
    return [None if _missing(trial) else index in front for index, trial in zip(frame.index, frame["trial"], strict=True)]


def _finite(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _frame(pd: Any, rows: list[dict[str, Any]], share: Share) -> pd.DataFrame:
    columns = _order_columns(c for row in rows for c in row)
    return in_plan_order(pd.DataFrame(rows, columns=columns), share.url)


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def varies(values: pd.Series) -> bool:
    """Whether a column has more than one value among the runs, a run without it counting as one more value (as
    ``status`` counts a parameter only some runs have): what makes a parameter swept in every table and plot."""
    return values.map(lambda v: json.dumps(None if _missing(v) else v, sort_keys=True, default=str)).nunique() > 1


def in_plan_order(frame: pd.DataFrame, share_url: str | None) -> pd.DataFrame:
    """The runs in the order ``status`` shows them (:func:`nbbatch.results.status.ordered_records`): by experiment,
    framework, then each parameter that varies (by name; numbers by value), then run id. ``attrs["order"]`` says it."""
    swept = sorted(c for c in frame.columns if str(c).startswith(PARAM) and varies(frame[c]))
    keys = [["" if _missing(v) else str(v) for v in frame[c]] for c in ("experiment", "framework")]
    keys += [[order_value(None if _missing(v) else v) for v in frame[c]] for c in swept]
    keys.append([str(v) for v in frame["run_id"]])
    order = sorted(range(len(frame)), key=lambda i: [k[i] for k in keys])
    ordered = frame.iloc[order].reset_index(drop=True)
    ordered.attrs["share"] = share_url
    several = [c for c in ("experiment", "framework") if ordered[c].astype(str).nunique() > 1]
    caption = order_caption([*several, *(c.removeprefix(PARAM) for c in swept)])
    if caption:
        ordered.attrs["order"] = caption
    return ordered


def collect_targets(targets: Sequence[str], share: str | os.PathLike[str] | Share | None = None,
                    all_runs: bool = False) -> pd.DataFrame:
    """What ``nbbatch compare`` reads: each target an existing folder/.ipynb or an experiment.

    Without ``share``, a target that exists as a path is read as a folder of executed notebooks; any
    other target is an experiment (name or YAML file) in the share it was submitted to from this
    project (:func:`nbbatch.store.known.open_experiment_share`; default ``results/``). No targets: the
    project's whole ``results/`` share. ``all_runs``: also the runs superseded by a later submission (see :func:`collect`).
    """
    pd = _pandas()
    if not targets:
        return collect(share if share is not None else _default_share(), all_runs=all_runs)
    frames = []
    for target in targets:
        if share is None and Path(target).exists() and not target.endswith((".yaml", ".yml")):
            frames.append(collect(target, all_runs=all_runs))
        else:
            name, opened = open_experiment_share(target, share)
            frames.append(collect(opened, [name], all_runs=all_runs))
    if len(frames) == 1:
        return frames[0]
    combined = pd.concat(frames, ignore_index=True, sort=False)
    combined = combined[_order_columns(combined.columns)]
    combined.attrs["share"] = frames[0].attrs.get("share")
    combined.attrs["superseded"] = sum(f.attrs.get("superseded", 0) for f in frames)
    return combined


def _default_share() -> str:
    return str(find_project().results_dir)


def read_run_files(frame: pd.DataFrame, column: str, parse: Callable[[bytes], Any],
                   share: str | os.PathLike[str] | Share | None = None) -> Iterator[tuple[Hashable, Any]]:
    """``(row index, parse(bytes))`` of the file each run names in location column ``column``
    (``telemetry_file``, ``metrics_file``), read through ``share`` (default: the share :func:`collect` read).

    Runs without the file, and files that are gone or cannot be parsed, are skipped.
    """
    if column not in frame or frame[column].isna().all():
        return
    target = share if share is not None else frame.attrs.get("share")
    if target is None:
        return
    opened = open_share(target)
    for index, row in frame[frame[column].notna()].iterrows():
        try:
            yield index, parse(opened.read_bytes(f"{row['share_path']}/{row[column]}"))
        except (OSError, ValueError, NbbatchError):
            continue
