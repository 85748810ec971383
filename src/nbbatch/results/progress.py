"""Live terminal progress: the table of ``nbbatch submit`` and of ``nbbatch status --watch``, updated as runs change.

In the results layer, below :mod:`nbbatch.api`: ``submit(progress=True)`` draws it from Python as the command line does.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from nbbatch.results.status import status_table, summary_counts
from nbbatch.store.runfiles import read_record
from nbbatch.store.runjson import RunRecord
from nbbatch.store.share import Share


def table_title(experiment: str, records: list[RunRecord]) -> str:
    """``<experiment>: 2 running, 7 succeeded`` (a ``str``: status_table shows it as Text, never as markup)."""
    counts = summary_counts(records)
    return f"{experiment}: " + (", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no runs")


@contextlib.contextmanager
def live_progress(share: Share, experiment: str, run_ids: list[str]) -> Iterator[Callable[[RunRecord], None]]:
    """Yield an ``on_update`` callback; show a live table (TTY) or one line per final run (pipes, CI)."""
    records: dict[str, RunRecord] = {}
    for run_id in run_ids:
        try:
            record = read_record(share, experiment, run_id)
        except Exception:  # noqa: BLE001
            record = None
        if record:
            records[run_id] = record
    lock = threading.Lock()
    console = Console(file=sys.stdout)

    def render() -> Group:
        with lock:
            current = list(records.values())
        # run data reaches rich as Text only (status_table's cells and a str title): never read as markup;
        # the table is laid out when drawn, so a running run's elapsed time ticks with each refresh
        return Group(status_table(current, title=table_title(experiment, current)),
                     Text(f"share: {share.url}", style="dim"))

    if not console.is_terminal:
        def on_update_plain(record: RunRecord) -> None:
            with lock:
                records[record.run_id] = record
            if record.final:
                detail = f" ({record.error.summary()})" if record.error else ""
                took = f" in {record.duration_s:.1f}s" if record.duration_s else ""
                console.print(f"{record.run_id}: {record.status}{took}{detail}", markup=False, emoji=False,
                              highlight=False, soft_wrap=True)

        yield on_update_plain
        console.print(render())
        return

    with Live(render(), console=console, refresh_per_second=4, transient=False) as live:
        def on_update(record: RunRecord) -> None:
            with lock:  # also a running run's record: its latest metrics show in the table
                records[record.run_id] = record
            live.update(render())

        yield on_update
        live.update(render())


def _changes(records: list[RunRecord]) -> tuple[tuple[str, str, int, int], ...]:
    """What makes the plain (non-terminal) watch print the table again: a status, an attempt, a cell done."""
    return tuple(sorted((r.run_id, str(r.status), r.attempts, r.cells_done) for r in records))


def watch_status(load: Callable[[], list[RunRecord]], experiment: str, interval: float = 2.0,
                 console: Console | None = None) -> list[RunRecord]:
    """Show the runs table until every run is final (``nbbatch status --watch``); return the last records.

    ``load`` reads the records again every ``interval`` seconds. On a terminal the table is redrawn
    in place and its last state stays on screen. Elsewhere (a pipe, a CI log) it is printed when a
    run's status, attempt or cell count changed (metrics that tick every step would flood a log), and
    always for the final state. Ctrl-C raises :class:`KeyboardInterrupt` with the table left as it was.
    """
    console = console or Console()
    records = load()
    if console.is_terminal:
        with Live(status_table(records, title=table_title(experiment, records)), console=console,
                  refresh_per_second=1, transient=False) as live:  # 1/s: elapsed times tick between reads
            while not all(r.final for r in records):
                time.sleep(interval)
                records = load()
                live.update(status_table(records, title=table_title(experiment, records)), refresh=True)
        return records
    printed = None
    while True:
        if _changes(records) != printed:
            printed = _changes(records)
            title = f"{time.strftime('%H:%M:%S')} {table_title(experiment, records)}"  # a log says when
            console.print(status_table(records, title=title))
        if all(r.final for r in records):
            return records
        time.sleep(interval)
        records = load()
