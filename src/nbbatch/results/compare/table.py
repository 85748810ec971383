"""The runs table in the terminal: the columns worth showing and a :class:`rich.table.Table` of them."""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.text import Text

from nbbatch.results.compare.collect import LEADING_COLUMNS, METRIC, PARAM, _pandas, varies
from nbbatch.results.compare.query import resolve_column
from nbbatch.results.compare.steps import STEP
from nbbatch.results.fitted import ALWAYS, FittedTable, fit_column
from nbbatch.results.status import STATUS_STYLE

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd


def display_columns(frame: pd.DataFrame) -> list[str]:
    """The columns worth showing: ids, status, the parameters that vary, the metrics, duration, errors."""
    shown: list[str] = []
    if "experiment" in frame and frame["experiment"].nunique(dropna=False) > 1:
        shown.append("experiment")
    shown += [c for c in ("run_id", "trial", "segment", "trial_state", "pareto", "framework", "status") if c in frame]
    shown += [c for c in frame.columns if str(c).startswith(PARAM) and varies(frame[c])]
    for column in frame.columns:
        # a metric named like a column that names the run (`nbbatch.record(framework="PyTorch")`) only relabels
        # it: left out here, still in the frame for --columns, --where, CSV and JSON
        if str(column).startswith(METRIC) and str(column).removeprefix(METRIC) not in LEADING_COLUMNS:
            values = frame[column].dropna()
            if values.empty or not values.map(lambda v: isinstance(v, str) and v[:1] in "[{").all():
                shown.append(str(column))
    shown += [c for c in ("duration_s",) if c in frame]
    if "gpu_ids" in frame and frame["gpu_ids"].fillna("").astype(str).str.len().gt(0).any():
        shown.append("gpu_ids")
    if "error" in frame and frame["error"].notna().any():
        shown.append("error")
    return shown


def column_header(column: str, columns: Iterable[Any]) -> str:
    """A column's header: a parameter or a metric without its ``param.``/``metric.`` prefix (``C``, ``accuracy``,
    as ``status`` heads them), unless that name is also another column's (of the runs, or a parameter and a metric
    of one name).

    A notebook may record a metric named like a run column (``nbbatch.record(framework="PyTorch")``);
    asked for with ``--columns``, its header stays ``metric.framework``, so no table has two ``framework`` columns.
    """
    for prefix in (PARAM, METRIC):
        if column.startswith(prefix):
            name = column.removeprefix(prefix)
            others = [str(c) for c in columns if str(c) != column]
            if name not in others and not any(c.startswith((PARAM, METRIC)) and c.split(".", 1)[1] == name
                                               for c in others):
                return name
    return column


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




def runs_table(frame: pd.DataFrame, columns: Sequence[str] | None = None, title: str | None = None,
               max_rows: int | None = None) -> FittedTable:
    """The runs as a terminal table (default columns: :func:`display_columns`) that fits the console's width.

    Every run stays on one line (two for a long error); when the width runs out, the least useful
    columns are left out and named under the table: text metrics first, then the GPUs, the
    framework, numeric metrics, the duration, and swept parameters last. Columns named in ``columns``
    are left out last to first. Headers, cells and the title are :class:`rich.text.Text`: metric names,
    parameters and errors are shown as they are, never read as rich markup.
    """
    chosen = [resolve_column(frame, c) for c in columns] if columns else display_columns(frame)
    rows = frame if max_rows is None else frame.head(max_rows)
    fitted = []
    for index, column in enumerate(chosen):
        texts = [_cell_text(v) for v in rows[column]] if column in rows else []
        numeric = _pandas().api.types.is_numeric_dtype(frame[column]) and column != "gpu_ids"
        keep = ALWAYS if column in ("experiment", "run_id", "status") else \
            ALWAYS - 1 - index if columns else _keep(column, numeric, index)
        if column == "status":
            texts = [Text(t, style=STATUS_STYLE.get(t, "")) for t in texts]
        fitted.append(fit_column(column_header(column, frame.columns), texts, keep, cap=24, numeric=numeric,
                                 flexible=column == "error"))
    more = f"{len(frame) - max_rows} more runs not shown" if max_rows is not None and len(frame) > max_rows else None
    caption = "; ".join(line for line in (frame.attrs.get("order"), more) if line)  # the row order, said as status does
    return FittedTable(fitted, title=title, caption=caption or None)


def _keep(column: str, numeric: bool, index: int) -> int:
    """How much a default column matters (the lowest is left out first when the width runs out)."""
    if column == "error":
        return 90
    if column.startswith(PARAM):
        return 85 - min(index, 10)
    if column == "duration_s":
        return 65
    if column.startswith((METRIC, STEP)):
        return 75 - min(index, 40) if numeric else 30 - min(index, 20)
    return {"framework": 50, "gpu_ids": 40}.get(column, 20)


PIPED_WIDTH = 120  # a log or a pager reads a table this wide; the columns that do not fit are named under it


def terminal() -> Console:
    """A rich console: the terminal's width, or ``$COLUMNS`` (default 120) when output goes to a file or CI log."""
    console = Console()
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console = Console(width=PIPED_WIDTH)
    return console
