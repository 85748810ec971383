"""Querying the runs table: column names, filter, sort, group; reading and writing it as CSV/JSON."""

from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nbbatch.artifacts import atomic_path
from nbbatch.errors import NbbatchError, did_you_mean
from nbbatch.results.compare.collect import LOCATION_COLUMNS, METRIC, PARAM, TELEMETRY, _pandas
from nbbatch.results.compare.trials import has_segments, latest_segments, segment_groups
from nbbatch.results.status import order_caption, search_rank

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd


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


def sort_search(frame: pd.DataFrame, search: Mapping[str, Any]) -> pd.DataFrame:
    """A search's runs: those that succeeded first, best first by the search's metric (its ``mode``), then the others
    (pruned ones at the value they were stopped at) the same way; a trial continued over several runs where its
    latest segment ranks, its segments together in order."""
    column = f"{METRIC}{search['metric']}"
    if column not in frame or "status" not in frame:
        return frame
    values = _pandas().to_numeric(frame[column], errors="coerce")
    mode = search.get("mode", "min")
    ranks: list[Any] = [search_rank(status, value, mode) for status, value in zip(frame["status"], values, strict=True)]
    if has_segments(frame):  # a continued trial's segments together, in order, where its latest segment ranks
        frame, values = frame.reset_index(drop=True), values.reset_index(drop=True)
        latest = latest_segments(frame)
        for group, (index, members) in enumerate(segment_groups(frame).items()):
            rank = search_rank(latest.loc[index, "status"], values[index], mode)
            for position, member in enumerate(members):
                ranks[member] = (rank, group, position)  # every row is in one group: all ranks alike
    ranked = frame.iloc[sorted(range(len(frame)), key=ranks.__getitem__)].reset_index(drop=True)  # stable
    ranked.attrs["order"] = order_caption(search=search)
    return ranked


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
    ordered = frame.sort_values(columns, ascending=ascending, na_position="last", kind="stable").reset_index(drop=True)
    ordered.attrs["order"] = order_caption([f"{c.removeprefix(METRIC).removeprefix(PARAM)}{'' if up else ' (descending)'}"
                                            for c, up in zip(columns, ascending, strict=True)])
    return ordered


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


def write_table(frame: pd.DataFrame, path: str | os.PathLike[str], about: Mapping[str, Any] | None = None) -> Path:
    """Write the table as CSV (``.csv``) or JSON (``.json``: a list of row objects, missing values null).

    ``about``: what the JSON says of the runs as a whole (a search's ``search`` and ``importance``); with it the JSON
    is one object, ``about``'s keys and ``runs`` (the list), which :func:`read_table` reads back alike. CSV has no
    place for it."""
    target = Path(path)
    suffix = target.suffix.lower()
    if suffix not in (".csv", ".json"):
        raise NbbatchError(f"cannot tell the format of `{target}`: name it .csv or .json")
    with atomic_path(target) as tmp:
        if suffix == ".csv":
            frame.to_csv(tmp, index=False)
        else:
            data: Any = _records(frame) if about is None else {**about, "runs": _records(frame)}
            tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
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
