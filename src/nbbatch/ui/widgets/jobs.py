"""The jobs table: an experiment's runs as a live table (HTML in JupyterLab, text elsewhere)."""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

import nbbatch.ui.widgets.display as display
from nbbatch import api
from nbbatch.errors import NbbatchError
from nbbatch.results.history import history_metrics, metric_series, read_history
from nbbatch.results.status import (
    KEY_METRICS,
    RefreshOutcome,
    StatusView,
    format_metric,
    load_plan_records,
    status_rows,
    varying_parameters,
)
from nbbatch.store.runjson import RunRecord
from nbbatch.store.share import poll_interval
from nbbatch.ui.widgets.links import NotebookLinks, notebook_links_for
from nbbatch.ui.widgets.submission import Submission, cancel_all, cancel_job, resolve

if TYPE_CHECKING:
    from nbbatch.store.share import Share


def _shown_metrics(metrics: dict[str, Any]) -> list[str]:
    shown = [k for k in KEY_METRICS if k in metrics]
    return shown or [k for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)][:3]


PREFERRED_CURVES = ("loss", "accuracy")  # the curve shown by default when a run records one of them
Points = list[dict[str, Any]]  # a run's metric history (see nbbatch.results.history)


def _text_table(header: Sequence[str], rows: Sequence[Sequence[str]], max_width: int = 48) -> str:
    """A plain-text table through rich: inner cells longer than ``max_width`` are cut (the first and last never)."""
    last = len(header) - 1
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="", expand=False)
    for i, name in enumerate(header):
        table.add_column(Text(name), max_width=None if i in (0, last) else max_width, overflow="ellipsis", no_wrap=True)
    for row in rows:
        table.add_row(*(Text(cell) for cell in row))  # Text: run data is never read as rich markup
    out = io.StringIO()
    Console(file=out, width=10_000, color_system=None, highlight=False).print(table)
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines())


class JobsSummaryModel:
    """The runs of one experiment as the jobs table shows them; records go in, HTML or text comes out.

    :meth:`replace_all` and :meth:`update` take run records and remember every status transition;
    :attr:`all_final` says when there is nothing left to watch. :meth:`refresh_histories` reads the
    runs' metric histories; :attr:`metric` picks the one drawn as a curve per run (None: the default,
    see :meth:`chosen_metric`).
    """

    def __init__(self, experiment: str, expected: Iterable[str] = (),
                 links: Callable[[RunRecord], NotebookLinks] | None = None, metric: str | None = None):
        self.experiment = experiment
        self.expected: list[str] = list(expected)
        self.records: dict[str, RunRecord] = {}
        self.transitions: list[tuple[str, str | None, str]] = []  # (run id, old status, new status)
        self.problems: list[str] = []
        self.message: str = ""
        self.links = links
        self.metric = metric
        self.histories: dict[str, Points] = {}
        self._history_names: dict[str, list[str]] = {}  # per run, so a render does not walk every point
        self._history_done: set[str] = set()  # read after the run ended: its history grows no more
        self._series: dict[tuple[str, str], tuple[list[int], list[float]]] = {}
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
            if not record.final:
                self._history_done.discard(record.run_id)  # e.g. submitted again: its history may change
            self.records[record.run_id] = record
            return True

    def replace_all(self, records: Iterable[RunRecord]) -> bool:
        """Take the experiment's current records (runs not among them are kept); return whether anything changed."""
        changed = False
        for record in records:
            changed = self.update(record) or changed
        return changed

    def refresh_histories(self, read: Callable[[str], Points]) -> bool:
        """Read the history of each run that may have new points with ``read(run_id)``; return whether any changed.

        A run is read on every call while it runs, and once more when it is final (its last points),
        then never again; queued runs are not read (nothing yet). Each read is the whole
        ``metrics.jsonl``: one small request per running run and poll (some KB for hundreds of
        steps), simpler than ranged reads and right when a re-run starts the file anew.
        """
        with self._lock:
            todo = [(r.run_id, r.final) for r in self.records.values()
                    if r.status != "queued" and r.run_id not in self._history_done]
        changed = False
        for run_id, final in todo:
            try:
                points = read(run_id)
            except (OSError, NbbatchError):
                continue  # a share hiccup: keep what is shown, read again next poll
            with self._lock:
                if final:
                    self._history_done.add(run_id)
                if self.histories.get(run_id, []) != points:
                    self.histories[run_id] = points
                    self._history_names[run_id] = history_metrics(points)
                    for key in [k for k in self._series if k[0] == run_id]:
                        del self._series[key]
                    changed = True
        return changed

    def history_metrics(self) -> list[str]:
        """The metrics of every run's history (what the curve can show), in the order first seen."""
        with self._lock:
            per_run = list(self._history_names.values())
        names: list[str] = []
        for run_names in per_run:
            names.extend(n for n in run_names if n not in names)
        return names

    def chosen_metric(self) -> str | None:
        """The metric drawn: :attr:`metric` when set, else ``loss``/``accuracy`` when recorded, else the first."""
        if self.metric:
            return self.metric
        names = self.history_metrics()
        return next((n for n in PREFERRED_CURVES if n in names), names[0] if names else None)

    def series(self, run_id: str, metric: str) -> tuple[list[int], list[float]]:
        """``(steps, values)`` of one run's ``metric`` (empty without points)."""
        with self._lock:
            key = (run_id, metric)
            if key not in self._series:
                self._series[key] = metric_series(self.histories.get(run_id, []), metric)
            return self._series[key]

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
        return varying_parameters(records)  # one rule for the terminal table and the widget

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
            row["parameters_items"] = [(k, format_metric(params[k])) for k in names if k in params]
            row["parameters_shown"] = ", ".join(f"{k}={v}" for k, v in row["parameters_items"])
            row["parameters_all"] = ", ".join(f"{k}={format_metric(v)}" for k, v in params.items())
            metrics = row["metrics"]
            row["metrics_items"] = [(k, format_metric(metrics[k])) for k in _shown_metrics(metrics)]
            row["metrics_shown"] = ", ".join(f"{k}={v}" for k, v in row["metrics_items"])
            duration = row["duration_s"]
            if record.status == "running" and duration is None:
                started = display.parse_time(record.started_at)
                duration = (now - started).total_seconds() if started else None
                row["duration_text"] = display.format_duration(duration) + "…" if duration is not None else ""
            else:
                row["duration_text"] = display.format_duration(duration)
            row["gpu_text"] = ",".join(map(str, row["gpu_ids"])) or "cpu"
            row["links"] = self.links(record) if self.links and record.status != "queued" else NotebookLinks(None)
            # the driver keeps the now-values only while the run goes; a final record's would be stale
            row["gpu_now_text"] = display.format_gpu_now(record.telemetry) if record.status == "running" else ""
            rows.append(row)
        for run_id in missing:
            rows.append({"run_id": run_id, "framework": "", "parameters": {}, "status": "queued", "attempts": 0,
                         "progress": "", "duration_s": None, "gpu_ids": [], "metrics": {}, "error": "",
                         "traceback": "", "parameters_shown": "", "parameters_items": [], "parameters_all": "",
                         "metrics_shown": "", "metrics_items": [], "duration_text": "", "gpu_text": "",
                         "links": NotebookLinks(None), "gpu_now_text": ""})
        metric = self.chosen_metric()
        display.add_curves(rows, metric, lambda run_id: self.series(run_id, metric) if metric else ([], []))
        return rows

    COLUMNS = ("run", "framework", "parameters", "status", "try", "duration", "GPU", "metrics", "notebook")

    def _optional_columns(self, rows: list[dict[str, Any]]) -> tuple[bool, str | None]:
        """Whether ``GPU now`` is shown (some run shows a value), and the chosen metric (its column's name)."""
        return any(row["gpu_now_text"] for row in rows), self.chosen_metric()

    def columns(self, rows: list[dict[str, Any]]) -> list[str]:
        """:attr:`COLUMNS`, with ``GPU now`` after ``GPU`` while a run shows it, and the chosen metric after ``metrics``."""
        gpu_now, metric = self._optional_columns(rows)
        columns = list(self.COLUMNS)
        if metric:
            columns.insert(columns.index("metrics") + 1, metric)  # the first "metrics": the base column
        if gpu_now:
            columns.insert(columns.index("GPU") + 1, "GPU now")
        return columns

    def to_text(self, now: datetime | None = None) -> str:
        """The table as plain text (what a terminal or papermill's output shows): the chosen metric's latest value
        and its step stand for the curve."""
        rows = self.rows(now)
        gpu_now, metric = self._optional_columns(rows)
        body = []
        for row in rows:
            status = row["status"] + (f" {row['progress']}" if row["progress"] else "")
            body.append([row["run_id"], str(row["framework"]), row["parameters_shown"], status, str(row["attempts"]),
                         row["duration_text"], row["gpu_text"], *([row["gpu_now_text"]] if gpu_now else []),
                         row["metrics_shown"], *([row["latest_text"]] if metric else []), row["links"].text()])
        lines = [self.headline()]
        if body:
            lines.append(_text_table(self.columns(rows), body))
        errors = [f"  {row['run_id']}: {row['error']}" for row in rows if row["error"]]
        if errors:
            lines += ["errors:", *errors]
        if self.message:
            lines.append(self.message)
        lines += [f"warning: {p}" for p in self.problems]
        return "\n".join(lines)

    def to_html(self, now: datetime | None = None) -> str:
        """The table as HTML: one ``<tr data-run=… data-status=…>`` per run, status in colour, notebook links."""
        rows = self.rows(now)
        gpu_now, metric = self._optional_columns(rows)
        return display.render_html("widget_jobs.html.j2", experiment=self.experiment, headline=self.headline(),
                                   state="final" if self.all_final else "live", columns=self.columns(rows), rows=rows,
                                   metric=metric, gpu_now=gpu_now, size=(display.CURVE_WIDTH, display.CURVE_HEIGHT),
                                   message=self.message, problems=self.problems)


class SummaryRefresher:
    """Polls an experiment's records into a :class:`JobsSummaryModel` until every run is final.

    ``load`` returns the current records (it may raise :class:`NbbatchError`, shown as the
    model's message); ``render`` is called after each poll that changed something, and every poll
    while a run is running (its duration grows). ``keep_going`` says that more runs may still
    appear (a submission still planning). With nothing to show and nothing in flight the
    refresher gives up after ``idle_timeout`` seconds. ``read_history(run_id)``, when given, reads a
    run's metric history after each load (see :meth:`JobsSummaryModel.refresh_histories`: only runs
    that may have new points).
    """

    def __init__(self, model: JobsSummaryModel, load: Callable[[], list[RunRecord]],
                 render: Callable[[JobsSummaryModel], None], interval: float = 1.0,
                 keep_going: Callable[[], bool] | None = None, idle_timeout: float = 30.0,
                 read_history: Callable[[str], Points] | None = None):
        self.model, self.load, self.render = model, load, render
        self.read_history = read_history
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
            if self.read_history is not None:
                changed = self.model.refresh_histories(self.read_history) or changed
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
                 backend_refresh_s: float = 15.0, metric: str | None = None):
        self.model, self.share, self.submission = model, share, submission
        if metric is not None:
            model.metric = metric
        self.widget: Any = None
        self.refresher: SummaryRefresher | None = None
        self.backend_refresh_s = backend_refresh_s
        self._backend_refreshed = time.monotonic()
        self._refreshed: RefreshOutcome | None = None  # the last ask of the backend
        self._buttons: dict[str, Any] = {}
        self._lock = threading.RLock()  # reentrant: setting the dropdown in render() calls its observer
        self._syncing = False  # render() is setting the dropdown: not the user's choice

    def load(self) -> list[RunRecord]:
        """The records of the experiment's current plan (its last submission's runs) from the share; those that
        could not be read, and a failed ask of the backend, are the model's problems (the table's footer).

        Every ``backend_refresh_s`` seconds the backend is asked about the runs first
        (:func:`nbbatch.api.refresh_runs`), e.g. about a job Azure ML failed to start, or a run whose driver
        process died; in between, a load only reads.
        """
        if self.submission is not None:
            self.model.expect(self.submission.model.run_ids)
        if time.monotonic() - self._backend_refreshed > self.backend_refresh_s:
            self._backend_refreshed = time.monotonic()
            self._refreshed = api.refresh_runs(self.model.experiment, share=self.share)
        records, problems, _planned = load_plan_records(self.share, self.model.experiment)  # the current plan's
        self.model.problems = StatusView(self.model.experiment, records, problems, self._refreshed).footer
        if self.model.expected:
            wanted = set(self.model.expected)
            records = [r for r in records if r.run_id in wanted]
        return records

    def read_history(self, run_id: str) -> Points:
        """One run's metric history from the share."""
        return read_history(self.share, self.model.experiment, run_id)

    def text(self) -> str:
        """The table as text."""
        return self.model.to_text()

    def set_metric(self, metric: str | None) -> None:
        """Draw ``metric``'s curve (None: the default); the dropdown follows."""
        with self._lock:
            self.model.metric = metric or None
        self.render(self.model)

    def build_widget(self) -> Any:
        """The ipywidgets view: the curve's metric (a dropdown), headline + table (one HTML widget), cancel buttons,
        messages."""
        import ipywidgets as w

        self.metric_choice = w.Dropdown(description="curve", tooltip="the metric drawn per run, from its history",
                                        layout=w.Layout(width="auto"), style={"description_width": "initial"})
        self.metric_choice.observe(self._metric_chosen, names="value")
        self.table = w.HTML(self.model.to_html())
        self.cancel_all_button = w.Button(description="Cancel all", icon="stop", button_style="danger",
                                          tooltip="cancel every unfinished run of this experiment")
        self.cancel_all_button.on_click(lambda _b: self._cancel(None))
        self.actions = w.HBox([self.cancel_all_button], layout=w.Layout(flex_flow="row wrap"))
        self.notice = w.HTML("")
        self.widget = w.VBox([self.metric_choice, self.table, self.actions, self.notice])
        self.widget.add_class("nbbatch-jobs-summary")
        self.render(self.model)
        return self.widget

    def render(self, model: JobsSummaryModel) -> None:
        """Refresh the widget from the model (called by the refresher's thread)."""
        if self.widget is None:
            return
        import ipywidgets as w

        with self._lock:
            self._sync_metric_choice(model)
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

    def _sync_metric_choice(self, model: JobsSummaryModel) -> None:
        """The dropdown lists the history metrics seen so far (hidden while there is none) and shows the chosen one."""
        options, chosen = model.history_metrics(), model.chosen_metric()
        if chosen and chosen not in options:
            options.append(chosen)  # asked for by name, not recorded yet
        self._syncing = True
        try:
            if tuple(options) != tuple(self.metric_choice.options):
                self.metric_choice.options = options
            if self.metric_choice.value != chosen:
                self.metric_choice.value = chosen
        finally:
            self._syncing = False
        self.metric_choice.layout.display = "flex" if options else "none"

    def _metric_chosen(self, change: dict[str, Any]) -> None:
        with self._lock:
            if self._syncing or change["new"] is None:
                return
            self.model.metric = change["new"]
            self.table.value = self.model.to_html()

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
            interval = poll_interval(self.share, local=1.0, remote=5.0)
        previous = _REFRESHERS.get(self.model.experiment)
        if previous is not None:
            previous.stop()
        submission = self.submission

        def keep_going() -> bool:
            return submission is not None and submission.model.active

        self.refresher = SummaryRefresher(self.model, self.load, self.render, interval, keep_going,
                                          read_history=self.read_history).start()
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


def print_jobs_summary(experiment: Any, share: str | Share | None = None, interval: float | None = None,
                       metric: str | None = None) -> JobsSummary:
    """Show every run of an experiment: framework, parameters, status, attempt, duration, GPU (and its use now),
    metrics, a curve of one history metric, notebook.

    In JupyterLab: a table that refreshes itself while runs are active and stops when all are
    final, with cancel buttons (per run and all), links that open each executed notebook, and a
    dropdown for the metric drawn per run. Elsewhere: the table printed once as text, with that
    metric's latest value and step. ``experiment`` is a name known to this project, an experiment
    file, an :class:`~nbbatch.spec.Experiment` or the :class:`Submission` from :func:`submit_all`;
    ``share`` overrides where its results are; ``metric`` picks the curve (default: ``loss``, else
    ``accuracy``, else the first metric recorded with ``nbbatch.record(step=...)``).
    """
    name, the_share, submission = resolve(experiment, share)
    model = JobsSummaryModel(name, links=lambda r: notebook_links_for(the_share, name, r.run_id, r.outputs))
    summary = JobsSummary(model, the_share, submission, metric=metric)
    try:
        model.replace_all(summary.load())
        model.refresh_histories(summary.read_history)
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

