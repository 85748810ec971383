"""A terminal table laid out for the width it is drawn at: what ``nbbatch status`` and ``compare`` print.

rich wraps a table that is too wide, cell by cell, until every row takes ten lines. Here each column
says how wide it would like to be and how important it is (:class:`FitColumn`, made by
:func:`fit_column`); :class:`FittedTable` keeps every row on one line (two for the one flexible
column, the error), cuts free text with ``…``, shows numbers whole, and leaves out the least
important columns when the width runs out, naming them under the table.

Every cell and header is :class:`rich.text.Text`: run data is shown as it is, never read as markup.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rich import box
from rich.cells import cell_len
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:  # pragma: no cover
    from rich.console import Console, ConsoleOptions, JustifyMethod, RenderResult

ALWAYS = 100  # a column's `keep` that is never left out (the run id, the status)
_GAP = 2  # what a column boundary costs with padding=(0, 1, 0, 0) and a blank box divider


@dataclass
class FitColumn:
    """One column: its cells, the widths it would like, and how much it matters (``keep``: lowest goes first)."""

    header: str
    cells: list[Text]
    natural: int  # the width that shows every cell and the header whole (capped for free text)
    comfort: int  # the width that shows the values whole with a header of at most two lines
    minimum: int  # the width below which the column is left out instead
    keep: int
    justify: JustifyMethod = "left"
    flexible: bool = False  # takes what is left over, up to two lines (the error)
    short: list[Text] | None = None  # the flexible column's cells when it is narrow


def fit_column(header: str, texts: Sequence[str | Text], keep: int, cap: int = 20, *, numeric: bool = False,
               flexible: bool = False) -> FitColumn:
    """A column of ``texts``: numbers (``numeric``) are shown whole or not at all; free text is cut at ``cap``
    and never below what tells values apart; a ``flexible`` column gets the width left, on two lines."""
    cells = [t if isinstance(t, Text) else Text(str(t)) for t in texts]
    values, whole, two_lines = max((c.cell_len for c in cells), default=0), cell_len(header), _header_minimum(header)
    if keep >= ALWAYS:
        minimum = comfort = natural = max(values, whole)
    elif numeric:
        natural, comfort, minimum = max(values, whole), max(values, two_lines), max(values, two_lines)
    else:
        natural = min(max(values, whole), cap)
        comfort = min(natural, max(two_lines, min(values, 12)))
        minimum = min(comfort, max(min(values, 8), min(two_lines, 6)))
    column = FitColumn(header, cells, natural, comfort, minimum, keep, "right" if numeric else "left")
    if flexible:
        column.natural = min(max(values, whole), 10**6)
        column.minimum, column.comfort, column.flexible = min(column.natural, 16), min(column.natural, 40), True
    return column


class FittedTable:
    """A rich renderable: the :class:`FitColumn` s laid out for the width the console gives it.

    ``columns`` is the list, or a function that makes it when the table is drawn (a live view whose
    elapsed times tick). ``caption`` goes under the table, after the names of columns left out;
    ``row_styles`` maps a row's index to its style (``{3: "red"}``).
    """

    def __init__(self, columns: Sequence[FitColumn] | Callable[[], Sequence[FitColumn]], title: Any = None,
                 caption: str | None = None) -> None:
        self._columns = columns
        self.title = title
        self.caption = caption
        self.row_styles: dict[int, str] = {}

    @property
    def columns(self) -> list[FitColumn]:
        """Every column worth showing, before the width decides."""
        return list(self._columns() if callable(self._columns) else self._columns)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.table(console, options.max_width)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement(min(options.max_width, 20), options.max_width)

    def table(self, console: Console, width: int) -> Table:
        """The :class:`rich.table.Table` for ``width`` columns of terminal."""
        columns = self.columns
        shown, widths, dropped = _fit(columns, width)
        title = Text(self.title) if isinstance(self.title, str) else self.title
        notes = ([f"hidden at this width: {', '.join(dropped)}"] if dropped else []) + ([self.caption] if self.caption else [])
        # no vertical rules and one space of padding: the width goes to the data
        table = Table(title=title, caption=Text("\n".join(notes), style="dim") if notes else None, box=box.SIMPLE_HEAD,
                      show_edge=False, pad_edge=False, padding=(0, 1, 0, 0), header_style="bold")
        for column, size in zip(shown, widths, strict=True):
            table.add_column(_header(column.header, size), justify=column.justify, no_wrap=True,
                             overflow="ellipsis", width=size)
        cells = [[_two_lines(console, short if cell.cell_len > size else cell, size)
                  for cell, short in zip(column.cells, column.short or column.cells, strict=True)]
                 if column.flexible else column.cells for column, size in zip(shown, widths, strict=True)]
        for index, row in enumerate(zip(*cells, strict=True)):
            table.add_row(*row, style=self.row_styles.get(index))
        return table


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
    lines = _header_lines(name, width)
    if len(lines) > 2:
        lines = [lines[0], "".join(lines[1:])]
    return Text("\n".join(lines), no_wrap=True, overflow="ellipsis")


def _two_lines(console: Console, text: Text, width: int) -> Text:
    """``text`` wrapped to ``width``, two lines at most, the second ending in ``…`` when it was cut."""
    lines = text.wrap(console, width, overflow="fold")
    if len(lines) <= 2:
        return Text("\n").join(lines)
    second = lines[1].copy()
    second.rstrip()
    second.truncate(max(width - 1, 0))
    second.append("…")
    return Text("\n").join([lines[0], second])


def _fit(columns: list[FitColumn], width: int) -> tuple[list[FitColumn], list[int], list[str]]:
    """The columns that fit ``width`` (least useful left out first), their widths, and the names left out."""
    shown = list(columns)

    def need(cols: list[FitColumn]) -> int:
        return sum(c.minimum for c in cols) + _GAP * (len(cols) - 1)

    while need(shown) > width and any(c.keep < ALWAYS for c in shown):
        shown.remove(min((c for c in shown if c.keep < ALWAYS), key=lambda c: c.keep))
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
