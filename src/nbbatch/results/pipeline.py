"""A pipeline's results: the best run of a stage, what a stage's runs hand downstream, and the stages' table.

The state of a pipeline is its ``pipeline.json`` (written by :mod:`nbbatch.drivers.pipeline`) and its stages'
run records; nothing here writes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.table import Table
from rich.text import Text

from nbbatch.errors import NbbatchError
from nbbatch.results.status import format_metric, segment_of, summary_counts
from nbbatch.spec.pipeline import Select
from nbbatch.store.layout import experiment_paths, run_paths
from nbbatch.store.runfiles import load_records
from nbbatch.store.runjson import RunRecord, Status
from nbbatch.store.share import Share

STAGE_STATES = ("pending", "running", "succeeded", "failed", "cancelled", "blocked")
STATE_STYLES = {"succeeded": "green", "failed": "red", "cancelled": "yellow", "blocked": "magenta", "running": "cyan"}


def metric_value(record: RunRecord, metric: str) -> float | None:
    """A run's metric as a number, or None when it recorded none, or a value that cannot be compared (NaN, text)."""
    value = record.metrics.get(metric)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def finished(record: RunRecord) -> bool:
    """Whether a run's metrics are a result: it succeeded, and when it is a segment of a search's trial continued over
    several runs, its trial completed there (a segment promoted, paused or pruned at a rung stopped part-way)."""
    return record.status == Status.SUCCEEDED and (segment_of(record) is None or record.trial.get("state") == "complete")


def best_record(records: Sequence[RunRecord], select: Select) -> RunRecord | None:
    """The finished run (:func:`finished`) with the best ``select.metric`` among those within ``select.where`` (the
    first in the list on a tie), or None."""
    scored = [(v, i, r) for i, r in enumerate(records)
              if finished(r) and (v := metric_value(r, select.metric)) is not None and select.admits(r.metrics)]
    if not scored:
        return None
    sign = -1 if select.mode == "max" else 1
    return min(scored, key=lambda item: (sign * item[0], item[1]))[2]


def outputs_location(share: Share, record: RunRecord) -> str:
    """Where a run's outputs/ folder is, as a downstream run reads it: a local path, or the share's URL of it."""
    path = run_paths(record.experiment, record.run_id).outputs
    local = share.local_path(path)
    return str(local) if local is not None else f"{share.url.rstrip('/')}/{path}"


def run_summary(share: Share, record: RunRecord) -> dict[str, Any]:
    """What ``${stage.runs}`` and ``${stage.best…}`` read of a run."""
    return {"run_id": record.run_id, "framework": record.framework, "parameters": dict(record.parameters),
            "metrics": dict(record.metrics), "outputs": outputs_location(share, record)}


def read_pipeline_state(share: Share, name: str) -> dict[str, Any] | None:
    """A pipeline's ``pipeline.json`` as its driver last wrote it, or None when ``name`` is no pipeline there."""
    try:
        data = json.loads(share.read_bytes(experiment_paths(name).pipeline_state))
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    except (OSError, ValueError, NbbatchError) as exc:
        raise NbbatchError(f"the pipeline state {share.url}/{experiment_paths(name).pipeline_state} cannot be read "
                           f"({exc}); submitting the pipeline again writes it anew") from exc
    return data if isinstance(data, dict) and isinstance(data.get("stages"), dict) else None


@dataclass
class StageRow:
    """One stage as ``nbbatch status PIPELINE`` shows it."""

    stage: str
    state: str
    done: int
    total: int
    best: str = ""
    note: str = ""
    counts: dict[str, int] = field(default_factory=dict)


def stage_rows(share: Share, state: Mapping[str, Any]) -> list[StageRow]:
    """The stages of a pipeline's state, with their runs as the share has them now (live counts and best so far)."""
    rows = []
    for name, stage in state["stages"].items():
        experiment = stage.get("experiment") or f"{state.get('pipeline')}.{name}"
        records, _problems = load_records(share, experiment) if share.exists(experiment) else ([], [])
        wanted = set(stage.get("runs") or [])
        if wanted:
            records = [r for r in records if r.run_id in wanted]
        counts = summary_counts(records)
        done = sum(n for s, n in counts.items() if s in ("succeeded", "pruned"))
        select = stage.get("select")
        best = best_record(records, Select(**select)) if select else None
        shown = ""
        if best is not None:
            varied = ", ".join(f"{k}={format_metric(v)}" for k, v in best.parameters.items()
                               if k in (stage.get("varies") or ()))
            shown = f"{select['metric']}={format_metric(best.metrics[select['metric']])} {best.run_id}" + \
                (f" ({varied})" if varied else "")
        rows.append(StageRow(name, stage.get("state", "pending"), done, len(records) or len(wanted), shown,
                             stage.get("reason") or _waits(stage, state), counts))
    return rows


def _waits(stage: Mapping[str, Any], state: Mapping[str, Any]) -> str:
    if stage.get("state") != "pending":
        return ""
    waiting = [n for n in stage.get("needs") or () if state["stages"].get(n, {}).get("state") != "succeeded"]
    return f"waits for {', '.join(waiting)}" if waiting else ""


def stage_table(name: str, state: Mapping[str, Any], rows: list[StageRow]) -> Table:
    """The stages of a pipeline in 80 columns: state, runs done of all, the best so far, what each waits for."""
    overall = state.get("state", "")
    table = Table(title=Text(f"pipeline {name}" + (f": {overall}" if overall else "")), title_justify="left",
                  expand=False, pad_edge=False)
    for column, style in (("stage", "bold"), ("state", ""), ("runs", ""), ("best", ""), ("note", "")):
        table.add_column(column, style=style or None, overflow="fold")
    for row in rows:
        runs = f"{row.done}/{row.total}" if row.total else "-"
        extra = ", ".join(f"{n} {s}" for s, n in sorted(row.counts.items()) if s not in ("succeeded", "pruned"))
        table.add_row(Text(row.stage), Text(row.state, style=STATE_STYLES.get(row.state, "")),
                      Text(runs + (f" ({extra})" if extra else "")), Text(row.best), Text(row.note))
    return table
