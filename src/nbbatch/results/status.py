"""Reading results back from a share: run records, status tables, log tails and follows."""

from __future__ import annotations

import json
import math
import numbers
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.cells import cell_len

from nbbatch.errors import NbbatchError, did_you_mean
from nbbatch.store.layout import run_paths
from nbbatch.store.records import read_record, run_ids
from nbbatch.store.runrecord import RunRecord, Status
from nbbatch.store.share import RangeStore, Share

if TYPE_CHECKING:  # pragma: no cover
    from rich.console import Console, ConsoleOptions, JustifyMethod, RenderResult
    from rich.measure import Measurement
    from rich.table import Table
    from rich.text import Text

# One colour per status, for every view (terminal tables, widgets, the HTML report).
STATUS_STYLE = {Status.QUEUED: "dim", Status.RUNNING: "bold blue", Status.SUCCEEDED: "green", Status.FAILED: "bold red",
                Status.CANCELLED: "yellow", Status.TIMED_OUT: "magenta",
                # what `compare` says of an executed notebook found without a run record
                "incomplete": "yellow", "unreadable": "magenta"}
KEY_METRICS = ("accuracy", "train_seconds", "images_per_second")


def resolve_run_id(share: Share, experiment: str, ref: str) -> str:
    """A full run id from an id or a unique prefix of one."""
    ids = [r for r in run_ids(share, experiment) if share.exists(run_paths(experiment, r).record)
           or share.exists(run_paths(experiment, r).log)]
    if ref in ids:
        return ref
    matches = [r for r in ids if r.startswith(ref)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise NbbatchError(f"no run `{ref}` in experiment `{experiment}` at {share.url}{did_you_mean(ref, ids)}; "
                           f"runs: {', '.join(ids) or '(none)'}")
    raise NbbatchError(f"`{ref}` matches {len(matches)} runs ({', '.join(matches)}); give more of the run id")


def format_metric(value: Any) -> str:
    """A metric or parameter value, short: floats to 4 significant digits, ``12346`` rather than ``1.235e+04``."""
    if isinstance(value, float):
        if math.isfinite(value) and 1e4 <= abs(value) < 1e6:
            return f"{value:.0f}"
        return f"{value:.4g}"
    return "" if value is None else str(value)


def status_rows(records: list[RunRecord]) -> list[dict[str, Any]]:
    """One plain dict per run (what the tables, the widgets and ``--json`` show)."""
    rows = []
    for r in sorted(records, key=lambda rec: (rec.framework or "", rec.run_id)):
        progress = f"{r.cells_done}/{r.cells_total}" if r.cells_total and r.status == Status.RUNNING else ""
        rows.append({
            "run_id": r.run_id, "framework": r.framework or r.notebook, "parameters": r.parameters,
            "status": r.status, "attempts": r.attempts, "progress": progress,
            "duration_s": r.duration_s, "gpu_ids": r.gpu_ids, "metrics": r.metrics,
            "error": r.error.summary() if r.error else "",
        })
    return rows


def varying_parameters(records: list[RunRecord]) -> list[str]:
    """Parameter names whose values differ between runs (what tells the runs apart), in first-seen order."""
    names: list[str] = []
    for record in records:
        names.extend(k for k in record.parameters if k not in names)
    return [n for n in names
            if len({json.dumps(r.parameters.get(n), sort_keys=True, default=str) for r in records}) > 1]


def shown_metrics(records: list[RunRecord], limit: int = 4) -> list[str]:
    """The metrics a table shows: the key ones any run has, then other numeric ones (also live ones, e.g. ``loss``)."""
    names = [k for k in KEY_METRICS if any(k in r.metrics for r in records)]
    for record in records:
        names.extend(k for k, v in record.metrics.items() if k not in names and _is_number(v))
    return names[:limit]


def status_table(records: list[RunRecord], title: Any = None, max_metrics: int = 4,
                 now: datetime | None = None) -> StatusTable:
    """A rich renderable of the runs, laid out for the width it is drawn at (see :class:`StatusTable`)."""
    return StatusTable(records, title=title, max_metrics=max_metrics, now=now)


class StatusTable:
    """The runs table: one row per run, one or two lines each, at any terminal width.

    Columns: the run id (never cut: people copy it), the framework (only where the run id does not
    already say it), one column per parameter that varies across the runs, status, attempts (only
    when a run was retried), duration (elapsed, with ``…``, while running), GPUs (only when a run had
    one), one column per shown metric, and the error, which gets the width left (two lines at most,
    then ``…``; the whole error is in ``nbbatch logs`` and ``run.json``). When the width runs out,
    the least useful columns are left out and named in the caption.

    Every cell and a ``str`` title are :class:`rich.text.Text`: run data (an error such as
    ``KeyError: "[/x] missing"``, a parameter or metric name) is shown as it is, never read as rich markup.
    """

    def __init__(self, records: list[RunRecord], title: Any = None, max_metrics: int = 4,
                 now: datetime | None = None) -> None:
        self.records = list(records)
        self.title = title
        self.max_metrics = max_metrics
        self.now = now  # None: elapsed times are taken when the table is drawn (a live view ticks)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.table(console, options.max_width)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        from rich.measure import Measurement

        return Measurement(min(options.max_width, 20), options.max_width)

    def table(self, console: Console, width: int) -> Table:
        """The :class:`rich.table.Table` for ``width`` columns of terminal."""
        from rich import box
        from rich.table import Table
        from rich.text import Text

        columns = _columns(self.records, self.max_metrics, self.now or datetime.now(timezone.utc))
        shown, widths, dropped = _fit(columns, width)
        title = Text(self.title) if isinstance(self.title, str) else self.title
        caption = Text(f"hidden at this width: {', '.join(dropped)}", style="dim") if dropped else None
        # no vertical rules and one space of padding: the width goes to the data
        table = Table(title=title, caption=caption, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                      padding=(0, 1, 0, 0), header_style="bold")
        for column, size in zip(shown, widths, strict=True):
            table.add_column(_header(column.header, size), justify=column.justify, no_wrap=True,
                             overflow="ellipsis", width=size)
        cells = [[_two_lines(console, short if cell.cell_len > size else cell, size)
                  for cell, short in zip(column.cells, column.short or column.cells, strict=True)]
                 if column.flexible else column.cells for column, size in zip(shown, widths, strict=True)]
        for row in zip(*cells, strict=True):
            table.add_row(*row)
        return table


_GAP = 2  # what a column boundary costs with padding=(0, 1, 0, 0) and a blank box divider
_MUST = 100  # columns kept at any width


@dataclass
class _Column:
    header: str
    cells: list[Text]
    natural: int  # the width that shows every cell and the header whole (capped for free text)
    comfort: int  # the width that shows the values whole with a header of at most two lines
    minimum: int  # the width below which the column is left out instead
    keep: int  # priority: the lowest is left out first when the width runs out
    justify: JustifyMethod = "left"
    flexible: bool = False  # the error: what is left over, up to two lines
    short: list[Text] | None = None  # the error's cells for a narrow column


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _duration(seconds: float | None) -> str:
    """``4.2s``, ``3m 05s``, ``1h 02m``; empty for None."""
    if seconds is None:
        return ""
    if not 0 <= seconds < 1e12:  # NaN, ±inf, negative or absurd: a hand-edited record
        return str(seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h {minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d {hours:02d}h"


def _elapsed(record: RunRecord, now: datetime) -> float | None:
    try:
        started = datetime.fromisoformat(str(record.started_at))
    except ValueError:
        return None
    if started.tzinfo is None:
        started = started.replace(tzinfo=timezone.utc)
    return max(0.0, (now - started).total_seconds())


def _cell_width(texts: list[Text]) -> int:
    return max((t.cell_len for t in texts), default=0)


def _header_lines(name: str, width: int) -> list[str]:
    """``name`` packed into lines of ``width``, broken after ``_``, ``-``, ``.`` or a space."""
    lines: list[str] = []
    for part in re.findall(r"[^_\-. ]*[_\-. ]|[^_\-. ]+", name) or [name]:
        if lines and cell_len(lines[-1] + part) <= width:
            lines[-1] += part
        else:
            lines.append(part)
    return [line.rstrip() or line for line in lines]


def _header_minimum(name: str) -> int:
    """The least width at which ``name`` fits two header lines without a cut."""
    for width in range(1, cell_len(name) + 1):
        if len(_header_lines(name, width)) <= 2 and all(cell_len(s) <= width for s in _header_lines(name, width)):
            return width
    return cell_len(name)


def _header(name: str, width: int) -> Text:
    """A header of at most two lines (a long metric name breaks at its ``_``); the rest cut with ``…``."""
    from rich.text import Text

    lines = _header_lines(name, width)
    if len(lines) > 2:
        lines = [lines[0], "".join(lines[1:])]
    return Text("\n".join(lines), no_wrap=True, overflow="ellipsis")


def _two_lines(console: Console, text: Text, width: int) -> Text:
    """``text`` wrapped to ``width``, two lines at most, the second ending in ``…`` when it was cut."""
    from rich.text import Text

    lines = text.wrap(console, width, overflow="fold")
    if len(lines) <= 2:
        return Text("\n").join(lines)
    second = lines[1].copy()
    second.rstrip()
    second.truncate(max(width - 1, 0))
    second.append("…")
    return Text("\n").join([lines[0], second])


def _sort_value(value: Any) -> tuple[int, Any]:
    if _is_number(value) and not (isinstance(value, float) and math.isnan(value)):
        return (0, float(value))
    return (1, json.dumps(value, sort_keys=True, default=str))


def _label(record: RunRecord) -> str:
    return record.framework or record.notebook


def _slug(text: str) -> str:
    """How a run id spells its framework or notebook (as nbbatch.plan.runs makes it)."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "run"


def _columns(records: list[RunRecord], max_metrics: int, now: datetime) -> list[_Column]:
    """Every column worth showing for ``records``, in display order, with its widths and priority."""
    from rich.text import Text

    varying = varying_parameters(records)
    records = sorted(records, key=lambda r: (_label(r), [_sort_value(r.parameters.get(k)) for k in varying],
                                             r.run_id))
    columns: list[_Column] = []

    def add(header: str, texts: list[str], keep: int, cap: int = 20, *, numeric: bool = False) -> _Column:
        cells = [Text(t) for t in texts]
        values, whole, two_lines = _cell_width(cells), cell_len(header), _header_minimum(header)
        if keep >= _MUST:
            minimum = comfort = natural = max(values, whole)
        elif numeric:  # numbers and their names are shown whole or left out; a name may take two lines
            natural, comfort, minimum = max(values, whole), max(values, two_lines), max(values, two_lines)
        else:  # free text is cut with an ellipsis, never below what tells values apart
            natural = min(max(values, whole), cap)
            comfort = min(natural, max(two_lines, min(values, 12)))
            minimum = min(comfort, max(min(values, 8), min(two_lines, 6)))
        column = _Column(header, cells, natural, comfort, minimum, keep, "right" if numeric else "left")
        columns.append(column)
        return column

    add("run", [r.run_id for r in records], _MUST)
    if any(not r.run_id.startswith(_slug(Path(_label(r)).stem) + "-") for r in records):
        add("framework", [_label(r) for r in records], 50, cap=16)
    for index, name in enumerate(varying):
        values = [r.parameters.get(name) for r in records]
        add(name, [format_metric(v) if name in r.parameters else "" for v, r in zip(values, records, strict=True)],
            80 - index, numeric=all(_is_number(v) for v in values))
    status = add("status", [str(r.status) + (f" {r.cells_done}/{r.cells_total}"
                                              if r.cells_total and r.status == Status.RUNNING else "")
                            for r in records], _MUST)
    for cell, record in zip(status.cells, records, strict=True):
        cell.stylize(STATUS_STYLE.get(record.status, ""))
    if any(r.attempts > 1 for r in records):  # only retries make the attempt count worth a column
        add("try", [str(r.attempts) for r in records], 45, numeric=True)
    times = []
    for r in records:
        if r.duration_s is None and r.status == Status.RUNNING and r.started_at:
            elapsed = _elapsed(r, now)
            times.append(_duration(elapsed) + "…" if elapsed is not None else "")
        else:
            times.append(_duration(r.duration_s))
    if any(times):
        add("time", times, 65, numeric=True)
    if any(r.gpu_ids for r in records):
        add("GPU", [",".join(map(str, r.gpu_ids)) or "cpu" for r in records], 40, cap=8)
    for index, name in enumerate(shown_metrics(records, max_metrics)):
        values = [r.metrics.get(name) for r in records]
        add(name, [format_metric(v) for v in values], 70 if index == 0 else 60 - index,
            numeric=all(v is None or _is_number(v) for v in values))
    errors = [" ".join(r.error.summary().splitlines()) if r.error else "" for r in records]
    if any(errors):
        error = add("error", errors, 90, cap=10**6)
        error.minimum, error.comfort, error.flexible = min(error.natural, 16), min(error.natural, 40), True
        # where the error does not fit one line, the exception matters more than the cell it came from
        error.short = [Text(text.removeprefix(f"cell {r.error.cell_index}: ")) if r.error else Text()
                       for text, r in zip(errors, records, strict=True)]
    return columns


def _fit(columns: list[_Column], width: int) -> tuple[list[_Column], list[int], list[str]]:
    """The columns that fit ``width`` (least useful left out first), their widths, and the names left out."""
    shown = list(columns)

    def need(cols: list[_Column]) -> int:
        return sum(c.minimum for c in cols) + _GAP * (len(cols) - 1)

    while need(shown) > width and any(c.keep < _MUST for c in shown):
        shown.remove(min((c for c in shown if c.keep < _MUST), key=lambda c: c.keep))
    dropped = [c.header for c in columns if c not in shown]
    widths = [c.minimum for c in shown]
    spare = width - need(shown)
    # The spare width goes to the most useful columns first: every column to its comfortable width,
    # then the error to 40, then whole headers, then the rest to the error.
    order = sorted(range(len(shown)), key=lambda i: (shown[i].flexible, -shown[i].keep))
    for target in ("comfort", "natural"):
        for index in order:
            grow = max(0, min(spare, getattr(shown[index], target) - widths[index]))
            widths[index] += grow
            spare -= grow
    return shown, [max(w, 1) for w in widths], dropped


def summary_counts(records: list[RunRecord]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in records:
        counts[r.status] = counts.get(r.status, 0) + 1
    return counts


def read_log(share: Share, experiment: str, run_id: str, tail: int | None = None) -> str:
    try:
        text = share.read_bytes(run_paths(experiment, run_id).log).decode("utf-8", "replace")
    except FileNotFoundError:
        return ""
    if tail:
        text = "\n".join(text.splitlines()[-tail:]) + "\n"
    return text


def follow_log(share: Share, experiment: str, run_id: str, poll: float | None = None,
               timeout: float | None = None) -> Iterator[str]:
    """Yield the log as it grows until the run is final (``logs -f``).

    Only the new bytes are read each time (a ranged read on shares that can, see
    :class:`~nbbatch.store.share.RangeStore`): following a long log costs what it grows, not its square.
    """
    import codecs

    offset = 0
    log_path = run_paths(experiment, run_id).log
    ranged = isinstance(share, RangeStore)
    if poll is None:
        poll = 0.5 if share.local_path("") is not None else 2.0
    decoder = codecs.getincrementaldecoder("utf-8")("replace")  # a character split across two reads stays whole
    started = time.monotonic()
    final = False
    while True:
        try:
            chunk = share.read_range(log_path, offset) if ranged else share.read_bytes(log_path)[offset:]
        except FileNotFoundError:
            chunk = b""
        if chunk:
            offset += len(chunk)
            text = decoder.decode(chunk)
            if text:
                yield text
            continue
        if final:
            return
        record = read_record(share, experiment, run_id)
        if record is not None and record.final:
            final = True  # read once more: the last lines were written just before the record
            continue
        if timeout is not None and time.monotonic() - started > timeout:
            return
        time.sleep(poll)
