"""A run's metric history: the points ``nbbatch.record(step=N, ...)`` wrote to ``metrics.jsonl``.

Each line is ``{"step": N, "time": "<UTC ISO time>", "attempt": A, "<metric>": value, ...}``, appended
while the run goes. A retry appends its own points: for a step recorded by several attempts the latest
attempt's point is the one that counts (a retry resumed from a checkpoint continues the same curve).
"""

from __future__ import annotations

import numbers
from typing import Any

from nbbatch.metrics import POINT_KEYS  # what a point holds besides its metrics
from nbbatch.store.jsonl import parse_jsonl
from nbbatch.store.layout import run_paths
from nbbatch.store.share import Share


def history_points(data: bytes | str) -> list[dict[str, Any]]:
    """The points of a ``metrics.jsonl`` text, one per step, by step.

    Lines of one attempt for the same step are merged (``record(step=5, loss=…)`` then
    ``record(step=5, lr=…)``); a later attempt's point for a step replaces the earlier attempt's.
    """
    by_step: dict[int, dict[str, Any]] = {}
    for point in parse_jsonl(data):
        step = point.get("step")
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            continue
        earlier = by_step.get(int(step))
        if earlier is not None and earlier.get("attempt") == point.get("attempt"):
            earlier.update(point)
        else:
            by_step[int(step)] = point
    return [by_step[step] for step in sorted(by_step)]


def joined_history(segments: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One curve of a trial continued over several runs: its segments' points (each :func:`history_points`'s), in
    segment order. A segment records only the steps after the previous one's; should two record a step, the later
    segment's point is the one that counts (as a later attempt's does)."""
    by_step: dict[int, dict[str, Any]] = {}
    for points in segments:
        by_step.update((int(point["step"]), point) for point in points)
    return [by_step[step] for step in sorted(by_step)]


def read_history(share: Share, experiment: str, run_id: str) -> list[dict[str, Any]]:
    """The run's points (see :func:`history_points`); ``[]`` when it recorded none (yet)."""
    try:
        data = share.read_bytes(run_paths(experiment, run_id).metrics)
    except FileNotFoundError:
        return []
    return history_points(data)


def history_metrics(points: list[dict[str, Any]]) -> list[str]:
    """The names of the numeric metrics in ``points``, in the order they first appear."""
    names: list[str] = []
    for point in points:
        for name, value in point.items():
            if name in POINT_KEYS or name in names:
                continue
            if isinstance(value, numbers.Real) and not isinstance(value, bool):
                names.append(name)
    return names


def metric_series(points: list[dict[str, Any]], metric: str) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of one metric (points without it are skipped)."""
    steps, values = [], []
    for point in points:
        value = point.get(metric)
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            steps.append(int(point["step"]))
            values.append(float(value))
    return steps, values
