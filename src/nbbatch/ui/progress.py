"""Live terminal progress for ``nbbatch submit``: a rich table that updates as runs change."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator

from nbbatch.store.runrecord import RunRecord
from nbbatch.store.share import Share


@contextlib.contextmanager
def live_progress(share: Share, experiment: str, run_ids: list[str]) -> Iterator[Callable[[RunRecord], None]]:
    """Yield an ``on_update`` callback; show a live table (TTY) or one line per final run (pipes, CI)."""
    from rich.console import Console, Group
    from rich.live import Live
    from rich.text import Text

    from nbbatch.results.status import status_table, summary_counts
    from nbbatch.store.records import read_record

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
        counts = summary_counts(current)
        line = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        # run data reaches rich as Text only (status_table's cells and a str title): never read as markup
        return Group(status_table(current, title=f"{experiment}: {line}"), Text(f"share: {share.url}", style="dim"))

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
            with lock:
                records[record.run_id] = record
            live.update(render())

        yield on_update
        live.update(render())
