"""One run's log as it grows (:func:`wait_for_job`)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import nbbatch.ui.widgets.display as display
from nbbatch import api
from nbbatch.errors import NbbatchError
from nbbatch.results.status import read_log, resolve_run_id
from nbbatch.store.runfiles import read_record
from nbbatch.store.runjson import RunRecord
from nbbatch.ui.widgets.links import notebook_links_for
from nbbatch.ui.widgets.submission import Submission, resolve

if TYPE_CHECKING:
    from nbbatch.store.share import Share


class JobLog:
    """A run's log as it grows (what :func:`wait_for_job` shows); keeps the last ``max_chars`` characters."""

    def __init__(self, experiment: str, run: str, share: Share, max_chars: int = 100_000):
        self.experiment, self.run, self.share = experiment, run, share
        self.run_id: str | None = None
        self.text = ""
        self.record: RunRecord | None = None
        self.max_chars = max_chars
        self.widget: Any = None
        self.done = threading.Event()
        self.error: str | None = None
        self._last_push = 0.0
        self._lock = threading.Lock()

    def resolve(self, submission: Submission | None, timeout: float = 60.0) -> str:
        """The full run id of :attr:`run`; waits (up to ``timeout`` s) while a submission of this experiment is active."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.run_id = resolve_run_id(self.share, self.experiment, self.run)
                return self.run_id
            except NbbatchError:
                waiting = submission is not None and submission.model.active
                if not waiting or time.monotonic() > deadline:
                    raise
            time.sleep(0.5)

    def append(self, chunk: str) -> None:
        """Add log text (and show it, at most four times a second)."""
        with self._lock:
            self.text = (self.text + chunk)[-self.max_chars:]
        if time.monotonic() - self._last_push > 0.25:
            self.push()

    def push(self) -> None:
        """Send the log's text to the Output widget."""
        if self.widget is None:
            return
        with self._lock:
            header, output = self.widget.children
            output.outputs = ({"output_type": "stream", "name": "stdout", "text": self.text},)
            self._last_push = time.monotonic()
            header.value = self.header_html()

    def header_html(self) -> str:
        """The run id, its status and a link to its executed notebook."""
        record = None if self.error else self.record
        took = f" in {display.format_duration(record.duration_s)}" if record and record.duration_s else ""
        links = notebook_links_for(self.share, self.experiment, record.run_id) if record else None
        return display.render_html("widget_log_header.html.j2", run=self.run_id or self.run, error=self.error,
                                   record=record, took=took, links=links)

    def _ipython_display_(self) -> None:
        """Already shown by :func:`wait_for_job`: a cell ending with the call shows it once."""

    def __repr__(self) -> str:
        status = self.record.status if self.record else ("error" if self.error else "following")
        return f"<JobLog {self.run_id or self.run}: {status}>"

    def follow(self, submission: Submission | None, on_chunk: Callable[[str], None]) -> RunRecord | None:
        """Resolve the run, stream its log to ``on_chunk`` until it is final; return its final record."""
        try:
            run_id = self.resolve(submission)
            for chunk in api.logs(self.experiment, run_id, follow=True, share=self.share):
                on_chunk(chunk)
            self.record = read_record(self.share, self.experiment, run_id)
        except NbbatchError as exc:
            self.error = str(exc)
        finally:
            self.done.set()
        return self.record


def wait_for_job(experiment: Any, run: str, share: str | Share | None = None, block: bool = True,
                 timeout: float | None = None) -> JobLog:
    """Follow one run's log until it ends; ``run`` is a run id or a unique prefix (``"pytorch"``).

    In JupyterLab the log streams into an Output widget under a status line that ends with a link
    to the executed notebook; elsewhere it is printed. ``block=False`` returns at once (JupyterLab
    keeps streaming in the background, so the notebook stays usable and buttons keep working).
    """
    name, the_share, submission = resolve(experiment, share)
    job = JobLog(name, run, the_share)
    if display.display_mode() != "widgets":
        def write(chunk: str) -> None:
            sys.stdout.write(chunk)
            sys.stdout.flush()

        if block:
            record = job.follow(submission, write)
            if job.error:
                print(job.error)
            elif record is not None:
                took = f" in {display.format_duration(record.duration_s)}" if record.duration_s else ""
                print(f"{record.run_id}: {record.status}{took}")
                if submission is not None:
                    submission._printed.add(record.run_id)  # Submission.wait() need not say it again
        else:
            try:
                print(read_log(the_share, name, job.resolve(submission, timeout=0), tail=20))
            except NbbatchError as exc:
                print(exc)
        return job
    import ipywidgets as w

    header = w.HTML(job.header_html())
    output = w.Output(layout=w.Layout(max_height="320px", overflow="auto",
                                      border="1px solid var(--jp-border-color2, #ddd)"))
    job.widget = w.VBox([header, output])
    job.widget.add_class("nbbatch-job-log")
    display.show(display.WithText(job.widget, lambda: f"{job.run_id or run}: log of a run (live in JupyterLab)"))

    def follow() -> None:
        job.follow(submission, job.append)
        job.push()

    thread = threading.Thread(target=follow, name=f"nbbatch-log-{run}", daemon=True)
    thread.start()
    if block:
        job.done.wait(timeout)
    return job

