"""The jobs table: an experiment's runs as a live table (HTML in JupyterLab, text elsewhere)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import nbbatch.ui.widgets.display as display
from nbbatch.errors import NbbatchError
from nbbatch.results.status import KEY_METRICS, format_metric, status_rows
from nbbatch.store.runrecord import RunRecord
from nbbatch.ui.widgets.links import NotebookLinks, notebook_links_for
from nbbatch.ui.widgets.logs import cancel_all, cancel_job
from nbbatch.ui.widgets.submission import Submission, resolve

if TYPE_CHECKING:
    from nbbatch.store.share import Share


def _shown_metrics(metrics: dict[str, Any]) -> list[str]:
    shown = [k for k in KEY_METRICS if k in metrics]
    return shown or [k for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)][:3]


def _text_table(header: Sequence[str], rows: Sequence[Sequence[str]], max_width: int = 48) -> str:
    """A plain-text table through rich: inner cells longer than ``max_width`` are cut (the first and last never)."""
    import io

    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    last = len(header) - 1
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="", expand=False)
    for i, name in enumerate(header):
        table.add_column(name, max_width=None if i in (0, last) else max_width, overflow="ellipsis", no_wrap=True)
    for row in rows:
        table.add_row(*(Text(cell) for cell in row))  # Text: run data is never read as rich markup
    out = io.StringIO()
    Console(file=out, width=10_000, color_system=None, highlight=False).print(table)
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines())


class JobsSummaryModel:
    """The runs of one experiment as the jobs table shows them; records go in, HTML or text comes out.

    :meth:`replace_all` and :meth:`update` take run records and remember every status transition;
    :attr:`all_final` says when there is nothing left to watch.
    """

    def __init__(self, experiment: str, expected: Iterable[str] = (),
                 links: Callable[[RunRecord], NotebookLinks] | None = None):
        self.experiment = experiment
        self.expected: list[str] = list(expected)
        self.records: dict[str, RunRecord] = {}
        self.transitions: list[tuple[str, str | None, str]] = []  # (run id, old status, new status)
        self.problems: list[str] = []
        self.message: str = ""
        self.links = links
        self._lock = threading.RLock()

    def expect(self, run_ids: Iterable[str]) -> None:
        """Runs that will appear (a submission's plan): the table is not final until they are."""
        with self._lock:
            for run_id in run_ids:
                if run_id not in self.expected:
                    self.expected.append(run_id)

    def update(self, record: RunRecord) -> bool:
        """Take one record; return whether anything shown changed."""
        with self._lock:
            old = self.records.get(record.run_id)
            if old is not None and old.to_dict() == record.to_dict():
                return False
            if old is None or old.status != record.status:
                self.transitions.append((record.run_id, old.status if old else None, record.status))
            self.records[record.run_id] = record
            return True

    def replace_all(self, records: Iterable[RunRecord]) -> bool:
        """Take the experiment's current records (runs not among them are kept); return whether anything changed."""
        changed = False
        for record in records:
            changed = self.update(record) or changed
        return changed

    @property
    def missing(self) -> list[str]:
        """Expected runs without a record yet."""
        with self._lock:
            return [r for r in self.expected if r not in self.records]

    @property
    def active(self) -> list[str]:
        """Runs not final yet (queued, running, or expected but not recorded)."""
        with self._lock:
            return [r.run_id for r in self.records.values() if not r.final] + self.missing

    @property
    def all_final(self) -> bool:
        """Whether there are runs and every one of them (and every expected one) is final."""
        with self._lock:
            return bool(self.records) and not self.active

    def counts(self) -> dict[str, int]:
        """Runs per status (expected runs without a record count as queued)."""
        with self._lock:
            counts: dict[str, int] = {}
            for record in self.records.values():
                counts[record.status] = counts.get(record.status, 0) + 1
            if self.missing:
                counts["queued"] = counts.get("queued", 0) + len(self.missing)
            return counts

    def headline(self) -> str:
        """``exploring: 3 runs — 1 running, 2 succeeded``."""
        counts = self.counts()
        total = sum(counts.values())
        detail = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no runs yet"
        return f"{self.experiment}: {total} run{'s' if total != 1 else ''} — {detail}"

    def varying_parameters(self) -> list[str]:
        """Parameter names whose values differ between runs (what tells the runs apart)."""
        with self._lock:
            records = list(self.records.values())
        names: list[str] = []
        for record in records:
            names.extend(k for k in record.parameters if k not in names)
        return [n for n in names
                if len({json.dumps(r.parameters.get(n), sort_keys=True, default=str) for r in records}) > 1]

    def rows(self, now: datetime | None = None) -> list[dict[str, Any]]:
        """One dict per run (and per expected run without a record), ready to render."""
        now = now or datetime.now(timezone.utc)
        with self._lock:
            records = list(self.records.values())
            missing = self.missing
        varying = self.varying_parameters()
        rows = []
        by_id = {r.run_id: r for r in records}
        for row in status_rows(records):
            record = by_id[row["run_id"]]
            params = row["parameters"]
            names = varying or list(params)[:4]
            row["parameters_shown"] = ", ".join(f"{k}={format_metric(params[k])}" for k in names if k in params)
            row["parameters_all"] = ", ".join(f"{k}={format_metric(v)}" for k, v in params.items())
            metrics = row["metrics"]
            row["metrics_shown"] = ", ".join(f"{k}={format_metric(metrics[k])}" for k in _shown_metrics(metrics))
            duration = row["duration_s"]
            if record.status == "running" and duration is None:
                started = display.parse_time(record.started_at)
                duration = (now - started).total_seconds() if started else None
                row["duration_text"] = display.format_duration(duration) + "…" if duration is not None else ""
            else:
                row["duration_text"] = display.format_duration(duration)
            row["gpu_text"] = ",".join(map(str, row["gpu_ids"])) or "cpu"
            row["links"] = self.links(record) if self.links and record.status != "queued" else NotebookLinks(None)
            rows.append(row)
        for run_id in missing:
            rows.append({"run_id": run_id, "framework": "", "parameters": {}, "status": "queued", "attempts": 0,
                         "progress": "", "duration_s": None, "gpu_ids": [], "metrics": {}, "error": "",
                         "parameters_shown": "", "parameters_all": "", "metrics_shown": "", "duration_text": "",
                         "gpu_text": "", "links": NotebookLinks(None)})
        return rows

    COLUMNS = ("run", "framework", "parameters", "status", "try", "duration", "GPU", "metrics", "notebook")

    def to_text(self, now: datetime | None = None) -> str:
        """The table as plain text (what a terminal or papermill's output shows)."""
        rows = self.rows(now)
        body = []
        for row in rows:
            status = row["status"] + (f" {row['progress']}" if row["progress"] else "")
            body.append([row["run_id"], str(row["framework"]), row["parameters_shown"], status, str(row["attempts"]),
                         row["duration_text"], row["gpu_text"], row["metrics_shown"], row["links"].text()])
        lines = [self.headline()]
        if body:
            lines.append(_text_table(self.COLUMNS, body))
        errors = [f"  {row['run_id']}: {row['error']}" for row in rows if row["error"]]
        if errors:
            lines += ["errors:", *errors]
        if self.message:
            lines.append(self.message)
        lines += [f"warning: {p}" for p in self.problems]
        return "\n".join(lines)

    def to_html(self, now: datetime | None = None) -> str:
        """The table as HTML: one ``<tr data-run=… data-status=…>`` per run, status in colour, notebook links."""
        return display.render_html("widget_jobs.html.j2", experiment=self.experiment, headline=self.headline(),
                                   state="final" if self.all_final else "live", columns=self.COLUMNS,
                                   rows=self.rows(now), message=self.message, problems=self.problems)


class SummaryRefresher:
    """Polls an experiment's records into a :class:`JobsSummaryModel` until every run is final.

    ``load`` returns the current records (it may raise :class:`NbbatchError`, shown as the
    model's message); ``render`` is called after each poll that changed something, and every poll
    while a run is running (its duration grows). ``keep_going`` says that more runs may still
    appear (a submission still planning). With nothing to show and nothing in flight the
    refresher gives up after ``idle_timeout`` seconds.
    """

    def __init__(self, model: JobsSummaryModel, load: Callable[[], list[RunRecord]],
                 render: Callable[[JobsSummaryModel], None], interval: float = 1.0,
                 keep_going: Callable[[], bool] | None = None, idle_timeout: float = 30.0):
        self.model, self.load, self.render = model, load, render
        self.interval, self.idle_timeout = interval, idle_timeout
        self.keep_going = keep_going or (lambda: False)
        self.polls = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._idle_since = time.monotonic()

    def poll_once(self) -> bool:
        """Load, update, render; return whether to keep polling."""
        self.polls += 1
        try:
            records = self.load()
            changed = self.model.replace_all(records)
            if self.model.message:
                self.model.message, changed = "", True
        except NbbatchError as exc:
            changed = self.model.message != str(exc)
            self.model.message = str(exc)
        running = any(r.status == "running" for r in self.model.records.values())
        more = self.keep_going()
        if changed or running or self.polls == 1:
            self.render(self.model)
        if self.model.all_final and not more:
            return False
        if self.model.records or more:
            self._idle_since = time.monotonic()
            return True
        return time.monotonic() - self._idle_since < self.idle_timeout

    def run(self) -> None:
        """Poll until final or :meth:`stop` (blocking); render once more at the end."""
        while not self._stop.is_set():
            try:
                again = self.poll_once()
            except Exception as exc:  # noqa: BLE001 - a broken share must not kill the thread silently
                self.model.message = f"stopped refreshing: {type(exc).__name__}: {exc}"
                again = False
            if not again:
                break
            self._stop.wait(self.interval)
        self.render(self.model)

    def start(self) -> SummaryRefresher:
        """Poll in a daemon thread."""
        self._thread = threading.Thread(target=self.run, name=f"nbbatch-summary-{self.model.experiment}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling (the table keeps its last state)."""
        self._stop.set()

    @property
    def running(self) -> bool:
        """Whether the polling thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end; return whether it did."""
        if self._thread is not None:
            self._thread.join(timeout)
        return not self.running


_REFRESHERS: dict[str, SummaryRefresher] = {}

class JobsSummary:
    """A jobs table: the model, its widget (in JupyterLab) and the thread refreshing it."""

    def __init__(self, model: JobsSummaryModel, share: Share, submission: Submission | None = None,
                 backend_refresh_s: float = 15.0):
        self.model, self.share, self.submission = model, share, submission
        self.widget: Any = None
        self.refresher: SummaryRefresher | None = None
        self.backend_refresh_s = backend_refresh_s
        self._backend_refreshed = time.monotonic()
        self._buttons: dict[str, Any] = {}
        self._lock = threading.Lock()

    def load(self) -> list[RunRecord]:
        """The experiment's records from the share (corrupt ones become the model's problems).

        Every ``backend_refresh_s`` seconds the backend first brings them up to date with its own
        view (:func:`nbbatch.api.status`), e.g. a job Azure ML failed to start, or a run whose
        driver process died.
        """
        from nbbatch.store.records import load_records

        if self.submission is not None:
            self.model.expect(self.submission.model.run_ids)
        records, problems = load_records(self.share, self.model.experiment)
        if records and not problems and time.monotonic() - self._backend_refreshed > self.backend_refresh_s:
            from nbbatch import api

            self._backend_refreshed = time.monotonic()
            records = api.status(self.model.experiment, share=self.share, refresh=True)
        self.model.problems = problems
        if self.model.expected:
            wanted = set(self.model.expected)
            records = [r for r in records if r.run_id in wanted]
        return records

    def text(self) -> str:
        """The table as text."""
        return self.model.to_text()

    def build_widget(self) -> Any:
        """The ipywidgets view: headline + table (one HTML widget), cancel buttons, messages."""
        import ipywidgets as w

        self.table = w.HTML(self.model.to_html())
        self.cancel_all_button = w.Button(description="Cancel all", icon="stop", button_style="danger",
                                          tooltip="cancel every unfinished run of this experiment")
        self.cancel_all_button.on_click(lambda _b: self._cancel(None))
        self.actions = w.HBox([self.cancel_all_button], layout=w.Layout(flex_flow="row wrap"))
        self.notice = w.HTML("")
        self.widget = w.VBox([self.table, self.actions, self.notice])
        self.widget.add_class("nbbatch-jobs-summary")
        self.render(self.model)
        return self.widget

    def render(self, model: JobsSummaryModel) -> None:
        """Refresh the widget from the model (called by the refresher's thread)."""
        if self.widget is None:
            return
        import ipywidgets as w

        with self._lock:
            self.table.value = model.to_html()
            active = [r for r in model.active if r in model.records]
            for run_id in active:
                if run_id not in self._buttons:
                    button = w.Button(description=f"Cancel {run_id}", icon="times", tooltip=f"cancel run {run_id}",
                                      layout=w.Layout(width="auto"))
                    button.on_click(lambda _b, run_id=run_id: self._cancel([run_id]))
                    self._buttons[run_id] = button
            children = [self.cancel_all_button, *(self._buttons[r] for r in active)]
            if tuple(children) != tuple(self.actions.children):
                self.actions.children = children
            self.cancel_all_button.disabled = not model.active
            self.actions.layout.display = "none" if model.all_final else "flex"

    def _cancel(self, runs: list[str] | None) -> None:
        try:
            asked = cancel_job(self.model.experiment, runs, self.share) if runs else cancel_all(self.model.experiment,
                                                                                               self.share)
            self.notice.value = display.message_html(f"asked to stop: {', '.join(asked)}" if asked
                                                     else "nothing left to cancel")
        except NbbatchError as exc:
            self.notice.value = display.message_html(str(exc), "error")

    def start(self, interval: float | None = None) -> None:
        """Refresh in the background until every run is final."""
        if interval is None:
            interval = 1.0 if self.share.local_path("") is not None else 5.0
        previous = _REFRESHERS.get(self.model.experiment)
        if previous is not None:
            previous.stop()
        submission = self.submission

        def keep_going() -> bool:
            return submission is not None and submission.model.active

        self.refresher = SummaryRefresher(self.model, self.load, self.render, interval, keep_going).start()
        _REFRESHERS[self.model.experiment] = self.refresher

    def stop(self) -> None:
        """Stop refreshing."""
        if self.refresher is not None:
            self.refresher.stop()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the refresher stopped (every run final); return whether it did."""
        return self.refresher.join(timeout) if self.refresher is not None else True

    def show(self) -> None:
        """Display the table again (the live widget in JupyterLab, the text elsewhere)."""
        if self.widget is not None:
            display.show(display.WithText(self.widget, self.model.to_text))
        else:
            print(self.model.to_text())

    def _ipython_display_(self) -> None:
        """Already shown by :func:`print_jobs_summary`: a cell ending with the call shows it once."""

    def __repr__(self) -> str:
        return f"<JobsSummary {self.model.headline()}>"


def print_jobs_summary(experiment: Any, share: str | Share | None = None, interval: float | None = None) -> JobsSummary:
    """Show every run of an experiment: framework, parameters, status, attempt, duration, GPU, metrics, notebook.

    In JupyterLab: a table that refreshes itself while runs are active and stops when all are
    final, with cancel buttons (per run and all) and links that open each executed notebook.
    Elsewhere: the table printed once as text. ``experiment`` is a name known to this project,
    an experiment file, an :class:`~nbbatch.spec.Experiment` or the :class:`Submission` from
    :func:`submit_all`; ``share`` overrides where its results are.
    """
    name, the_share, submission = resolve(experiment, share)
    model = JobsSummaryModel(name, links=lambda r: notebook_links_for(the_share, name, r.run_id))
    summary = JobsSummary(model, the_share, submission)
    try:
        model.replace_all(summary.load())
    except NbbatchError as exc:
        model.message = str(exc)
    if not model.records and not (submission and submission.model.active):
        model.message = model.message or (f"experiment `{name}` has no runs in {the_share.url} yet; "
                                          "submit it with submit_all()")
    if display.display_mode() != "widgets":
        print(model.to_text())
        return summary
    display.show(display.WithText(summary.build_widget(), model.to_text))
    if not model.all_final or (submission and submission.model.active):
        summary.start(interval)
    return summary

