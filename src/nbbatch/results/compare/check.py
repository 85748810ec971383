"""The regression check against a baseline (``nbbatch check``): :func:`check` and :class:`CheckResult`."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nbbatch.errors import NbbatchError, did_you_mean
from nbbatch.results.compare.collect import METRIC, _pandas, collect_targets
from nbbatch.results.compare.plots import _numeric, swept_parameters
from nbbatch.results.compare.query import _text, read_table, resolve_column
from nbbatch.results.compare.trials import latest_segments
from nbbatch.store.share import Share

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

FAILING_OUTCOMES = frozenset({"moved", "missing", "failed"})


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
    :func:`default_check_key`; several runs with the same key are averaged (a search's trial continued over several
    runs is one, its latest segment). Baseline runs that did not succeed are left out.
    """
    pd = _pandas()
    if direction not in ("both", "decrease", "increase"):
        raise NbbatchError(f"direction `{direction}` must be both, decrease or increase")
    names = [m.strip() for m in (metrics.split(",") if isinstance(metrics, str) else metrics) if m.strip()]
    if not names:
        raise NbbatchError("check needs a metric, e.g. --metric accuracy")
    # a trial continued over several runs is measured once, by its latest segment (its earlier ones stopped at a rung)
    current, baseline = latest_segments(current), latest_segments(baseline)
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
        if "status" in cur:  # a search's pruned (or paused) runs stopped as meant, at a partial value: no measurement
            cur = cur[~cur["status"].astype(str).isin(["pruned", "paused"])]
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
