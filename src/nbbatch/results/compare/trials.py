"""A search's trials in the runs table: one row per trial, however many runs (segments) it took.

A trial that a scheduler paused at a rung and later continued from its checkpoint is several ordinary runs, its
*segments* (``trial.segment`` in each run's record: 0, 1, 2, …; each records only the steps after the previous one).
The runs table keeps one row per run, with its ``segment`` and ``trial_state``; every view of the search's trials
(the best trial, the value by trial, the parameters, the Pareto front, which parameters matter, the trials' curves)
reads one row per trial instead: its latest segment (the highest segment number), whose value is the trial's, with
the status the trial's state gives it (:func:`trial_status`). A search whose trials are one run each is unchanged.

Population-based training's members are such trials too; each segment records its parameters and the member it
copied, if any (``resource``, ``exploited`` and ``exploited_run`` in the runs table): :func:`member_schedules` reads a
member's schedule of parameters from them.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from nbbatch.results.history import joined_history
from nbbatch.results.status import trial_status

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

PARAM = "param."  # a run's parameter's column: param.<name> (the runs table's, :mod:`...collect`)
SEGMENT = "segment"
TRIAL_STATE = "trial_state"
RESOURCE, EXPLOITED, EXPLOITED_RUN = "resource", "exploited", "exploited_run"  # a PBT segment's rung and copy


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def has_segments(frame: pd.DataFrame) -> bool:
    """Whether any run of ``frame`` is a segment of a continued trial."""
    return SEGMENT in frame and bool(frame[SEGMENT].notna().any())


def trial_key(row: Mapping[str, Any]) -> tuple[str, ...]:
    """What names one trial: its experiment, its study's notebook (a search draws one study per notebook) and its
    number."""
    return tuple("" if _missing(row.get(c)) else str(row.get(c)) for c in ("experiment", "framework", "notebook")) \
        + (str(int(row["trial"])),)


def segment_groups(frame: pd.DataFrame) -> dict[Hashable, list[Hashable]]:
    """Each row that stands for itself or for its trial (the latest segment) → the rows it stands for, in segment
    order. A run that is no segment stands for itself alone; the order of ``frame`` is kept."""
    if not has_segments(frame):
        return {index: [index] for index in frame.index}
    chains: dict[tuple[str, ...], list[tuple[float, Hashable]]] = {}
    firsts: dict[Hashable, tuple[str, ...]] = {}
    for index, row in frame.iterrows():
        if _missing(row.get("trial")) or _missing(row.get(SEGMENT)):
            continue
        key = trial_key(row)
        chains.setdefault(key, []).append((float(row[SEGMENT]), index))
        firsts[index] = key
    latest = {key: max(chain)[1] for key, chain in chains.items()}
    groups: dict[Hashable, list[Hashable]] = {}
    for index in frame.index:
        key = firsts.get(index)
        if key is None:
            groups[index] = [index]
        elif latest[key] == index:
            groups[index] = [i for _, i in sorted(chains[key])]
    return groups


def latest_segments(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with one row per trial: a continued trial's latest segment only, its ``status`` the trial's
    (:func:`trial_status`); every other run as it is. ``frame`` itself when no run is a segment."""
    if not has_segments(frame):
        return frame
    kept = frame.loc[list(segment_groups(frame))].copy()
    segmented = kept[SEGMENT].notna()
    if TRIAL_STATE in kept:
        kept.loc[segmented, "status"] = [trial_status(s, t) for s, t in
                                         zip(kept.loc[segmented, "status"], kept.loc[segmented, TRIAL_STATE],
                                             strict=True)]
    kept.attrs = dict(frame.attrs)
    return kept


def trials_of(frame: pd.DataFrame) -> pd.DataFrame:
    """The search's trials (runs with a trial number), one row per trial (:func:`latest_segments`)."""
    if "trial" not in frame:
        return frame.iloc[0:0]
    trials = latest_segments(frame)
    return trials[trials["trial"].notna()]


def joined_histories(frame: pd.DataFrame, histories: Mapping[Hashable, Sequence[Mapping[str, Any]]]
                     ) -> dict[Hashable, list[dict[str, Any]]]:
    """The runs' histories (by row index, as :func:`~nbbatch.results.compare.steps.read_histories` reads them) with
    a continued trial's segments joined into one, under its latest segment's index (:func:`segment_groups`)."""
    joined = {}
    for index, members in segment_groups(frame).items():
        parts = [list(histories[m]) for m in members if m in histories]
        if parts:
            joined[index] = joined_history(parts)
    return joined


def is_pbt(frame: pd.DataFrame) -> bool:
    """Whether ``frame``'s trials are population-based training's members (their segments say whom they copied)."""
    return EXPLOITED in frame and has_segments(frame)


def searched_names(frame: pd.DataFrame) -> list[str]:
    """The searched parameters' names: the search's space, or else the parameters that vary but the resource."""
    space = (frame.attrs.get("search") or {}).get("params")
    if space:
        return [n for n in space if f"{PARAM}{n}" in frame]
    rungs = frame[RESOURCE].astype(str) if RESOURCE in frame else None
    return [str(c).removeprefix(PARAM) for c in frame.columns if str(c).startswith(PARAM)
            and frame[c].astype(str).nunique() > 1 and (rungs is None or not frame[c].astype(str).equals(rungs))]


def _plain(value: Any) -> Any:
    """A cell as JSON holds it: numpy's numbers as Python's, a missing value as None."""
    value = value.item() if hasattr(value, "item") and callable(value.item) else value
    return None if _missing(value) else value


def member_schedules(frame: pd.DataFrame) -> dict[Hashable, list[dict[str, Any]]]:
    """Each population-based training member's schedule, under its latest segment's index (:func:`segment_groups`):
    one ``{segment, from, to, params, exploited}`` per segment, in order. ``from``..``to``: the resource it trained
    over (its previous segment's rung, 0 for the first, to its own); ``params``: its searched parameters;
    ``exploited``: ``{trial, run_id}`` of the member whose run it copied, or None. Empty unless :func:`is_pbt`."""
    if not is_pbt(frame):
        return {}
    names = searched_names(frame)
    schedules = {}
    for index, members in segment_groups(frame).items():
        if _missing(frame.loc[index].get(SEGMENT)):
            continue
        schedule, start = [], 0
        for member in members:
            row = frame.loc[member]
            copied = _plain(row.get(EXPLOITED))
            end = _plain(row.get(RESOURCE))
            end = int(end) if isinstance(end, float) and end.is_integer() else end  # a column with gaps is float
            schedule.append({"segment": int(row[SEGMENT]), "from": start, "to": end,
                             "params": {n: _plain(row[f"{PARAM}{n}"]) for n in names},
                             "exploited": None if copied is None else {"trial": int(copied),
                                                                       "run_id": _plain(row.get(EXPLOITED_RUN))}})
            start = end if end is not None else start
        schedules[index] = schedule
    return schedules


def trials_summary(frame: pd.DataFrame, metric: str) -> list[dict[str, Any]]:
    """One JSON-able object per trial, by trial number (``compare --json``'s ``trials``): its ``trial`` number,
    ``state`` (complete, pruned, paused, or its run's status), ``value`` of ``metric`` (its latest segment's),
    ``run_id`` (its latest segment's), for a continued trial ``segments`` (its runs, in order) and for a member of
    population-based training its ``schedule`` (:func:`member_schedules`)."""
    groups = segment_groups(frame)
    schedules = member_schedules(frame)
    column = f"metric.{metric}"
    rows = []
    for index, row in trials_of(frame).iterrows():
        value = row.get(column)
        number = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else None
        status = str(row["status"])
        summary: dict[str, Any] = {
            "trial": int(row["trial"]),
            "state": {"succeeded": "complete"}.get(status, status),
            "value": None if number is None or math.isnan(number) else float(number),
            "run_id": row["run_id"],
        }
        if not _missing(row.get(SEGMENT)):
            summary["segments"] = [str(frame.loc[m, "run_id"]) for m in groups[index]]
        if index in schedules:
            summary["schedule"] = schedules[index]
        rows.append(summary)
    return sorted(rows, key=lambda r: r["trial"])
