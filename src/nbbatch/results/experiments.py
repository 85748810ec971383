"""The experiments of a share, one row each: what ``nbbatch status`` without an experiment lists.

Each row is an experiment (its runs counted by status, as ``status EXPERIMENT`` counts them: its last submission's)
or a pipeline (its stages counted by state), with when it last changed. Only reads.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from nbbatch.errors import NbbatchError
from nbbatch.results.fitted import ALWAYS, FittedTable, fit_column
from nbbatch.results.pipeline import read_pipeline_state
from nbbatch.results.status import experiment_names, load_plan_records, search_of, summary_counts
from nbbatch.store.share import Share


@dataclass(frozen=True)
class ExperimentRow:
    """One experiment or pipeline of a share."""

    name: str
    kind: str  # ``runs`` (a batch), ``search`` or ``pipeline``
    counts: dict[str, int]  # its runs by status; a pipeline's stages by state; ``unreadable``: records not read
    changed: str | None  # when it last changed (ISO 8601, UTC): its latest run's latest time, a pipeline's update

    def to_dict(self) -> dict[str, Any]:
        """What ``status --json`` without an experiment prints of it."""
        return {"experiment": self.name, "kind": self.kind, "counts": self.counts, "changed": self.changed}


def experiment_rows(share: Share, names: Collection[str] | None = None) -> list[ExperimentRow]:
    """The experiments and pipelines of ``share`` (with ``names``: those, a pipeline's stages with it), latest change
    first."""
    rows = []
    for name in experiment_names(share):
        if names is not None and name not in names and name.split(".", 1)[0] not in names:
            continue
        rows.append(_row(share, name))
    return sorted(sorted(rows, key=lambda r: r.name), key=lambda r: r.changed or "", reverse=True)


def _row(share: Share, name: str) -> ExperimentRow:
    try:
        state = read_pipeline_state(share, name)
    except NbbatchError:  # a damaged pipeline.json: `status NAME` says why
        return ExperimentRow(name, "pipeline", {"unreadable": 1}, None)
    if state is not None:
        counts: dict[str, int] = {}
        for stage in state["stages"].values():
            said = str(stage.get("state", "unknown")) if isinstance(stage, dict) else "unknown"
            counts[said] = counts.get(said, 0) + 1
        updated = state.get("updated")
        return ExperimentRow(name, "pipeline", counts, updated if isinstance(updated, str) else None)
    records, problems, _planned = load_plan_records(share, name)
    counts = summary_counts(records)
    if problems:
        counts["unreadable"] = len(problems)
    times = [t for r in records for t in (r.ended_at, r.started_at, r.queued_at) if isinstance(t, str)]
    return ExperimentRow(name, "search" if search_of(share, name) else "runs", counts, max(times, default=None))


def _when(changed: str | None) -> str:
    """``2026-01-03 09:00`` (UTC) of an ISO time; as it is when it is no ISO time."""
    if not changed:
        return ""
    try:
        moment = datetime.fromisoformat(changed)
    except ValueError:
        return changed
    if moment.tzinfo is not None:
        moment = moment.astimezone(timezone.utc)
    return moment.strftime("%Y-%m-%d %H:%M")


def experiments_table(rows: list[ExperimentRow], title: Any = None) -> FittedTable:
    """The rows as a table that fits the terminal: the experiment (never cut), its kind, its counts, its last change."""
    counts = [", ".join(f"{n} {s}" for s, n in sorted(r.counts.items())) or "no runs" for r in rows]
    columns = [fit_column("experiment", [r.name for r in rows], ALWAYS),
               fit_column("kind", [r.kind for r in rows], 60, cap=8),
               fit_column("changed (UTC)", [_when(r.changed) for r in rows], 70, numeric=True),
               fit_column("runs / stages", counts, 90, flexible=True)]
    return FittedTable(columns, title=title, caption="rows by last change, latest first")
