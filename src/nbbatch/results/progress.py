"""Live terminal progress: the table of ``nbbatch submit`` and of ``nbbatch status --watch``, updated as runs change.

In the results layer, below :mod:`nbbatch.api`: ``submit(progress=True)`` draws it from Python as the command line does.
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from nbbatch.backends import backend_class
from nbbatch.errors import NbbatchError
from nbbatch.results.status import REFRESH_EVERY_S, RefreshOutcome, StatusView, status_table, summary_counts
from nbbatch.store.layout import experiment_paths
from nbbatch.store.lease import STALE_AFTER_S
from nbbatch.store.lock import pid_alive
from nbbatch.store.runfiles import read_record
from nbbatch.store.runjson import RunRecord, Status
from nbbatch.store.share import LeaseStore, Share


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
        return Group(*_screenful(current, experiment, console), Text(f"share: {share.url}", style="dim"))

    if not console.is_terminal:
        def on_update_plain(record: RunRecord) -> None:
            with lock:
                records[record.run_id] = record
            if record.final:
                detail = f" ({record.error_summary()})" if record.error else ""
                took = f" in {record.duration_s:.1f}s" if record.duration_s else ""
                console.print(f"{record.run_id}: {record.status}{took}{detail}", markup=False, emoji=False,
                              highlight=False, soft_wrap=True)

        yield on_update_plain
        console.print(render())
        return

    with _drawn(Live(render(), console=console, refresh_per_second=4, transient=False)) as live:
        def on_update(record: RunRecord) -> None:
            with lock:  # also a running run's record: its latest metrics show in the table
                records[record.run_id] = record
            live.update(render())

        yield on_update
        live.update(render())


@contextlib.contextmanager
def _drawn(live: Live) -> Iterator[Live]:
    """``with live:``, except that a terminal that closed (SIGHUP: the window or the ssh session is gone) ends the
    drawing quietly: the error of its last redraw must not replace the interrupt that cancels the runs."""
    live.start(refresh=True)  # as `with live:` does
    try:
        yield live
    finally:
        with contextlib.suppress(OSError):
            live.stop()


# the runs a live table shows first when they do not all fit the terminal: those moving, then those that went wrong
_SHOWN_FIRST = (Status.RUNNING, Status.FAILED, Status.TIMED_OUT, Status.CANCELLED, Status.QUEUED, Status.SUCCEEDED,
                Status.PRUNED)


def _screenful(records: list[RunRecord], experiment: str, console: Console,
               search: Mapping[str, Any] | None = None) -> list[object]:
    """The live table of ``records``, with at most a screenful of rows: a large sweep (10^4 runs and more) would
    otherwise be laid out whole four times a second. The title counts every run; the runs left out are counted
    under the table (``nbbatch status`` lists them all)."""
    room = max(10, console.size.height - 8)
    title = table_title(experiment, records)
    if len(records) <= room:
        return [status_table(records, title=title, search=search)]
    rank = {status: index for index, status in enumerate(_SHOWN_FIRST)}
    order = sorted(range(len(records)), key=lambda i: rank.get(records[i].status, len(rank)))
    shown = sorted(order[:room])
    left = summary_counts([records[i] for i in order[room:]])
    note = ", ".join(f"{n} {s}" for s, n in sorted(left.items()))
    return [status_table([records[i] for i in shown], title=title, search=search),
            Text(f"… and {len(records) - room} more run(s) not shown ({note}); `nbbatch status` lists them all",
                 style="dim")]


def abandoned_runs(share: Share, experiment: str, records: Sequence[RunRecord]) -> list[RunRecord]:
    """The queued runs that nothing will start: runs of a backend that executes them in the submitting process
    (``local``), while no live ``nbbatch submit`` holds the experiment's lease on the share (it was killed). None
    when the share keeps no lease, so cannot tell. (Its running runs name their process: ``status`` fails them.)"""
    waiting = [r for r in records if r.status == Status.QUEUED]
    if not waiting or not isinstance(share, LeaseStore) or _driver_alive(share, experiment):
        return []
    try:
        return [r for r in waiting if not backend_class(r.backend).capabilities.detached]
    except NbbatchError:  # a backend not installed here: its runs may well go on
        return []


def _driver_alive(share: LeaseStore, experiment: str) -> bool:
    """Whether a driver holds the experiment's lease: alive on this machine, or renewed lately on another."""
    try:
        held = share.lease_read(experiment_paths(experiment).lease)
    except OSError:
        return True  # cannot tell
    if held is None:
        return False
    try:
        holder = json.loads(held[0])
    except ValueError:
        holder = None
    if isinstance(holder, dict) and holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        return pid_alive(holder["pid"])
    return held[1] <= STALE_AFTER_S


def _changes(records: list[RunRecord]) -> tuple[tuple[str, str, int, int], ...]:
    """What makes the plain (non-terminal) watch print the table again: a status, an attempt, a cell done."""
    return tuple(sorted((r.run_id, str(r.status), r.attempts, r.cells_done) for r in records))


class StatusReads:
    """The reads of ``nbbatch status`` (one, or one per tick of ``--watch``), each a :class:`StatusView`.

    Every call reads the share (``read``: nothing written). When ``refresh`` is given it asks the backend first, on
    the first call and then once every ``refresh_s`` seconds, not at every redraw: asking runs ``squeue`` or calls
    a cloud service, and may write records. Each view carries the last ask's outcome, so a failed refresh stays one
    line under the table until an ask succeeds.
    """

    def __init__(self, read: Callable[[], StatusView], refresh: Callable[[], RefreshOutcome] | None = None,
                 refresh_s: float = REFRESH_EVERY_S, clock: Callable[[], float] = time.monotonic):
        self.read, self.refresh, self.refresh_s, self.clock = read, refresh, refresh_s, clock
        self._asked: float | None = None
        self._outcome: RefreshOutcome | None = None

    def __call__(self) -> StatusView:
        if self.refresh is not None and (self._asked is None or self.clock() - self._asked >= self.refresh_s):
            self._asked = self.clock()
            self._outcome = self.refresh()
        view = self.read()
        view.refresh = self._outcome
        return view


def footer_lines(view: StatusView) -> list[Text]:
    """The footer under a live status table: one line per record that could not be read, and a failed refresh."""
    return [Text(f"warning: {line}", style="yellow") for line in view.footer]


def watch_status(load: Callable[[], StatusView], experiment: str, interval: float = 2.0,
                 console: Console | None = None,
                 stuck: Callable[[list[RunRecord]], object] = lambda records: False,
                 say_footer: Callable[[StatusView], None] = lambda view: None,
                 search: Mapping[str, Any] | None = None) -> StatusView:
    """Show the runs table until every run is final, or ``stuck`` (e.g. :func:`abandoned_runs`) says that nothing will
    move any more (``nbbatch status --watch``); return the last view.

    ``load`` (e.g. a :class:`StatusReads`) reads the records again every ``interval`` seconds. On a terminal the
    table is redrawn in place, its footer (:attr:`StatusView.footer`) under it, and its last state stays on screen.
    Elsewhere (a pipe, a CI log) it is printed when a run's status, attempt or cell count changed (metrics that
    tick every step would flood a log), and always for the final state; each view then goes to ``say_footer``,
    which says the footer lines it has not said yet. Ctrl-C raises :class:`KeyboardInterrupt` with the table left
    as it was. A search's runs (given its ``search:`` block) are best first, as ``status`` and ``compare`` show them.
    """
    console = console or Console()
    view = load()

    def ended() -> bool:
        return all(r.final for r in view.records) or bool(stuck(view.records))

    def frame() -> Group:
        return Group(*_screenful(view.records, experiment, console, search), *footer_lines(view))
    if console.is_terminal:
        with _drawn(Live(frame(), console=console, refresh_per_second=1,
                         transient=False)) as live:  # 1/s: elapsed times tick between reads
            while not ended():
                time.sleep(interval)
                view = load()
                live.update(frame(), refresh=True)
        return view
    printed = None
    while True:
        if _changes(view.records) != printed:
            printed = _changes(view.records)
            title = f"{time.strftime('%H:%M:%S')} {table_title(experiment, view.records)}"  # a log says when
            console.print(status_table(view.records, title=title, search=search))
        say_footer(view)
        if ended():
            return view
        time.sleep(interval)
        view = load()
