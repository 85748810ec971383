"""The jobs table's live results: a curve of one history metric per run, and each running run's GPU use now.

Runs write ``metrics.jsonl`` into a share folder between polls of the refresher; the HTML is parsed
(one SVG polyline per run, its points counted), the text rendering read, the dropdown driven from Python.
"""

from __future__ import annotations

from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from support.waiting import wait_until

from nbbatch import widgets
from nbbatch.store.jsonl import jsonl_line
from nbbatch.store.layout import run_paths
from nbbatch.store.runfiles import write_record
from nbbatch.store.runjson import RunRecord
from nbbatch.store.share import FileShare
from nbbatch.ui.widgets import JobsSummary, JobsSummaryModel, SummaryRefresher
from nbbatch.ui.widgets import display as widget_display

HOSTILE_RUN = "<script>alert('x')</script>\"[/x]"
HOSTILE_METRIC = "<script>\"'[/x]</script>"


def record(run_id: str, status: str = "running", **fields: Any) -> RunRecord:
    values = {"experiment": "exp", "notebook": "notebooks/Tiny.ipynb", "kernel": "python3", "framework": "pytorch",
              "parameters": {"LR": 0.01}, "attempts": 1 if status != "queued" else 0}
    values.update(fields)
    return RunRecord(run_id=run_id, status=status, **values)


def append_points(share: FileShare, run_id: str, *points: dict[str, Any]) -> None:
    """What the driver does while a run goes: one JSON line per ``nbbatch.record(step=...)``."""
    path = share.local_path(run_paths("exp", run_id).metrics)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as out:
        for point in points:
            out.write(jsonl_line({"time": "2025-01-01T00:00:00+00:00", "attempt": 1, **point}))


class Table(HTMLParser):
    """The parts of the jobs table these tests read: header cells, and per row its curve and GPU-now text."""

    def __init__(self, page: str):
        super().__init__()
        self.root: dict[str, str | None] = {}
        self.header: list[str] = []
        self.rows: dict[str, dict[str, Any]] = {}
        self._row: dict[str, Any] | None = None
        self._text: list[str] | None = None  # collecting the text of a th / title / span
        self._into = ""
        self.feed(page)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "div" and "nbbatch-jobs" in (a.get("class") or "").split():
            self.root = a
        elif tag == "th" or (tag == "title" and self._row is not None):
            self._text, self._into = [], tag
        elif tag == "tr" and a.get("data-run") is not None:
            self._row = self.rows.setdefault(a["data-run"], {"points": None, "title": "", "gpu_now": None})
        elif self._row is not None and tag == "polyline":
            self._row["points"] = [tuple(map(float, p.split(","))) for p in (a.get("points") or "").split()]
        elif self._row is not None and tag == "span" and a.get("class") == "nbbatch-gpu-now":
            self._text, self._into = [], "gpu_now"

    def handle_data(self, data: str) -> None:
        if self._text is not None:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if self._text is not None and tag in ("th", "title", "span"):
            text = "".join(self._text).strip()
            if self._into == "th":
                self.header.append(text)
            elif self._into == "title":
                self._row["title"] = text
            else:
                self._row["gpu_now"] = text
            self._text = None
        elif tag == "tr":
            self._row = None

    def points(self, run_id: str) -> int:
        """How many points the run's polyline has (0 without a curve)."""
        return len(self.rows[run_id]["points"] or [])


@pytest.fixture
def share(tmp_path: Path) -> FileShare:
    return FileShare(tmp_path / "results")


@pytest.fixture
def project(widget_project: Path) -> Path:
    return widget_project


def point(step: int, **metrics: float) -> dict[str, Any]:
    return {"step": step, **metrics}


# --------------------------------------------------------------------------------------------------
# the curve grows as the runs record


def test_each_poll_draws_every_step_so_far_and_a_final_run_is_read_once_more(share: FileShare) -> None:
    write_record(share, record("a"))
    write_record(share, record("b"))
    write_record(share, record("c", "queued"))
    append_points(share, "a", point(0, lr=0.1, accuracy=0.5, loss=0.9), point(1, lr=0.1, accuracy=0.6, loss=0.7))
    append_points(share, "b", point(0, lr=0.1, accuracy=0.4, loss=1.0))
    summary = JobsSummary(JobsSummaryModel("exp"), share)
    reads: list[str] = []

    def read(run_id: str) -> list[dict[str, Any]]:
        reads.append(run_id)
        return summary.read_history(run_id)

    refresher = SummaryRefresher(summary.model, summary.load, lambda m: None, read_history=read)
    assert refresher.poll_once()
    table = Table(summary.model.to_html())
    assert table.root["data-metric"] == "loss"  # preferred over the first metric recorded (lr)
    assert "loss" in table.header
    assert (table.points("a"), table.points("b"), table.points("c")) == (2, 1, 0)
    assert sorted(reads) == ["a", "b"]  # a queued run has nothing to read

    append_points(share, "a", point(2, accuracy=0.7, loss=0.5), point(3, accuracy=0.8, loss=0.3))
    append_points(share, "b", point(1, accuracy=0.5, loss=0.8))
    assert refresher.poll_once()
    table = Table(summary.model.to_html())
    assert (table.points("a"), table.points("b")) == (4, 2)
    # one scale for every run: a's last loss (0.3, the lowest) is at the bottom, b's first (1.0, the highest) on top
    assert table.rows["a"]["points"][-1][1] == pytest.approx(widget_display.CURVE_HEIGHT - widget_display.CURVE_PAD)
    assert table.rows["b"]["points"][0][1] == pytest.approx(widget_display.CURVE_PAD)
    assert table.rows["a"]["title"] == "loss = 0.3 at step 3; 0.3 to 0.9 over 4 steps"

    append_points(share, "a", point(4, accuracy=0.85, loss=0.25))
    write_record(share, record("a", "succeeded", duration_s=5.0))
    reads.clear()
    refresher.poll_once()
    assert Table(summary.model.to_html()).points("a") == 5  # the points written before it ended
    append_points(share, "a", point(5, accuracy=0.9, loss=0.2))  # never happens; shows a final run is not re-read
    reads.clear()
    refresher.poll_once()
    assert reads == ["b"] and Table(summary.model.to_html()).points("a") == 5


def test_a_run_submitted_again_is_read_again(share: FileShare) -> None:
    model = JobsSummaryModel("exp")
    histories = {"a": [point(0, loss=1.0)]}
    model.update(record("a", "succeeded"))
    assert model.refresh_histories(histories.get)
    histories["a"] = [point(0, loss=0.5), point(1, loss=0.4)]
    assert not model.refresh_histories(histories.get)  # final and read: not again
    model.update(record("a", "running", attempts=1))
    assert model.refresh_histories(histories.get)
    assert Table(model.to_html()).points("a") == 2


def test_a_long_history_is_thinned_but_keeps_its_ends() -> None:
    model = JobsSummaryModel("exp")
    model.update(record("a"))
    model.refresh_histories(lambda run_id: [point(i, loss=1.0 / (i + 1)) for i in range(1000)])
    drawn = Table(model.to_html()).rows["a"]["points"]
    assert len(drawn) == widget_display.MAX_CURVE_POINTS
    assert drawn[0][0] == pytest.approx(widget_display.CURVE_PAD)
    assert drawn[-1][0] == pytest.approx(widget_display.CURVE_WIDTH - widget_display.CURVE_PAD)
    assert "over 1000 steps" in Table(model.to_html()).rows["a"]["title"]


def test_without_history_there_is_no_curve_column(share: FileShare) -> None:
    model = JobsSummaryModel("exp")
    model.update(record("a", "succeeded", metrics={"accuracy": 0.9}))
    model.refresh_histories(lambda run_id: [])
    assert model.chosen_metric() is None
    table = Table(model.to_html())
    assert table.header == list(JobsSummaryModel.COLUMNS) and table.root["data-metric"] == ""
    assert "<svg" not in model.to_html()


# --------------------------------------------------------------------------------------------------
# choosing the metric


def test_the_dropdown_lists_the_history_metrics_and_switches_the_curve(share: FileShare) -> None:
    pytest.importorskip("ipywidgets")
    write_record(share, record("a"))
    write_record(share, record("b"))
    # accuracy only every other step, so its curve has fewer points than loss's
    append_points(share, "a", point(0, lr=0.1, loss=0.9, accuracy=0.5), point(1, lr=0.1, loss=0.8),
                  point(2, lr=0.1, loss=0.6, accuracy=0.7))
    append_points(share, "b", point(0, lr=0.2, loss=1.2), point(1, lr=0.2, loss=1.1, top5=0.9))
    summary = JobsSummary(JobsSummaryModel("exp"), share)
    refresher = SummaryRefresher(summary.model, summary.load, summary.render, read_history=summary.read_history)
    summary.build_widget()
    refresher.poll_once()
    assert list(summary.metric_choice.options) == ["lr", "loss", "accuracy", "top5"]
    assert summary.metric_choice.value == "loss" and summary.metric_choice.layout.display == "flex"
    assert Table(summary.table.value).points("a") == 3

    summary.metric_choice.value = "accuracy"  # what picking it in JupyterLab does
    table = Table(summary.table.value)
    assert table.root["data-metric"] == "accuracy" and "accuracy" in table.header and "loss" not in table.header
    assert (table.points("a"), table.points("b")) == (2, 0)
    append_points(share, "a", point(3, loss=0.5, accuracy=0.75))
    refresher.poll_once()  # the next poll keeps the user's choice
    assert summary.metric_choice.value == "accuracy" and Table(summary.table.value).points("a") == 3

    summary.set_metric("top5")  # scripted
    assert summary.metric_choice.value == "top5"
    assert (Table(summary.table.value).points("a"), Table(summary.table.value).points("b")) == (0, 1)


def test_the_dropdown_is_hidden_until_a_run_records_a_history(share: FileShare) -> None:
    pytest.importorskip("ipywidgets")
    write_record(share, record("a"))
    summary = JobsSummary(JobsSummaryModel("exp"), share)
    refresher = SummaryRefresher(summary.model, summary.load, summary.render, read_history=summary.read_history)
    summary.build_widget()
    refresher.poll_once()
    assert summary.metric_choice.layout.display == "none" and summary.metric_choice.options == ()
    append_points(share, "a", point(0, accuracy=0.5))
    refresher.poll_once()
    assert summary.metric_choice.layout.display == "flex" and summary.metric_choice.value == "accuracy"


def test_metric_argument_picks_the_curve_even_before_it_is_recorded(share: FileShare) -> None:
    write_record(share, record("a"))
    append_points(share, "a", point(0, loss=0.9))
    summary = JobsSummary(JobsSummaryModel("exp"), share, metric="accuracy")
    refresher = SummaryRefresher(summary.model, summary.load, lambda m: None, read_history=summary.read_history)
    refresher.poll_once()
    table = Table(summary.model.to_html())
    assert table.root["data-metric"] == "accuracy" and table.points("a") == 0
    append_points(share, "a", point(1, loss=0.8, accuracy=0.6))
    refresher.poll_once()
    assert Table(summary.model.to_html()).points("a") == 1


# --------------------------------------------------------------------------------------------------
# user data stays data


def test_a_hostile_run_id_and_metric_name_are_escaped_in_html_and_text() -> None:
    model = JobsSummaryModel("exp")
    model.update(record(HOSTILE_RUN))
    model.refresh_histories(lambda run_id: [point(0, **{HOSTILE_METRIC: 1.0}), point(1, **{HOSTILE_METRIC: 2.0})])
    assert model.chosen_metric() == HOSTILE_METRIC
    page = model.to_html()
    assert "<script" not in page and "&lt;script&gt;" in page
    table = Table(page)  # the parser decodes the entities: the names come back as they were
    assert table.root["data-metric"] == HOSTILE_METRIC and HOSTILE_METRIC in table.header
    assert list(table.rows) == [HOSTILE_RUN] and table.points(HOSTILE_RUN) == 2
    assert table.rows[HOSTILE_RUN]["title"].startswith(f"{HOSTILE_METRIC} = 2 at step 1")
    text = model.to_text()  # rich must not read "[/x]" as markup
    assert HOSTILE_METRIC in text.splitlines()[1] and HOSTILE_RUN in text and "2 (step 1)" in text


def test_a_hostile_metric_name_in_the_dropdown_is_only_text(share: FileShare) -> None:
    pytest.importorskip("ipywidgets")
    write_record(share, record("a"))
    append_points(share, "a", point(0, **{HOSTILE_METRIC: 0.5}))
    summary = JobsSummary(JobsSummaryModel("exp"), share)
    summary.model.replace_all(summary.load())
    summary.model.refresh_histories(summary.read_history)
    summary.build_widget()
    assert summary.metric_choice.options == (HOSTILE_METRIC,)  # a Dropdown's labels are text, never HTML
    assert "<script" not in summary.table.value


# --------------------------------------------------------------------------------------------------
# GPU use now


def test_gpu_now_shows_the_live_telemetry_of_running_runs_only() -> None:
    model = JobsSummaryModel("exp")
    live = {"util_now_pct": 87.4, "memory_now_mb": 3276.8, "util_mean_pct": 80.0, "memory_max_mb": 4000, "samples": 9}
    model.update(record("gpu", gpu_ids=[0], telemetry=live))
    model.update(record("small", gpu_ids=[1], telemetry={**live, "util_now_pct": None, "memory_now_mb": 512}))
    model.update(record("cpu", telemetry={"samples": 0, "util_now_pct": None, "memory_now_mb": None}))
    model.update(record("done", "succeeded", gpu_ids=[0], telemetry=live))  # a stale now-value
    table = Table(model.to_html())
    assert table.header[table.header.index("GPU") + 1] == "GPU now"
    assert {run: row["gpu_now"] for run, row in table.rows.items()} == {
        "gpu": "87% · 3.2 GB", "small": "512 MB", "cpu": "", "done": ""}
    text = model.to_text()
    assert "GPU now" in text.splitlines()[1]
    assert "87% · 3.2 GB" in next(line for line in text.splitlines() if line.startswith("gpu "))
    model.update(record("gpu", "succeeded", gpu_ids=[0], telemetry=live))
    model.update(record("small", "cancelled", gpu_ids=[1], telemetry=live))
    # nothing left to show now: the column goes (CPU runs and final runs only)
    assert "GPU now" not in Table(model.to_html()).header and "GPU now" not in model.to_text()


# --------------------------------------------------------------------------------------------------
# print_jobs_summary: text, and the live widget


def test_text_mode_shows_the_latest_value_and_its_step(project: Path, capsys: pytest.CaptureFixture) -> None:
    share = FileShare(project / "results")
    write_record(share, record("a", "succeeded", duration_s=3.0))
    write_record(share, record("b"))
    append_points(share, "a", point(0, loss=0.9, accuracy=0.5), point(1, loss=0.25, accuracy=0.75))
    append_points(share, "b", point(0, loss=1.5))
    widgets.print_jobs_summary("exp", share=str(project / "results"))
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["run", "framework", "parameters", "status", "try", "duration", "GPU", "metrics",
                                "loss", "notebook"]
    assert "0.25 (step 1)" in next(line for line in lines if line.startswith("a "))
    assert "1.5 (step 0)" in next(line for line in lines if line.startswith("b "))
    widgets.print_jobs_summary("exp", share=str(project / "results"), metric="accuracy")
    out = capsys.readouterr().out
    assert "accuracy" in out.splitlines()[1] and "0.75 (step 1)" in out and "<svg" not in out


def test_live_widget_draws_the_points_as_they_come(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ipywidgets")
    monkeypatch.setattr(widget_display, "display_mode", lambda: "widgets")
    monkeypatch.setattr(widget_display, "show", lambda obj: None)
    share = FileShare(project / "results")
    write_record(share, record("a"))
    append_points(share, "a", point(0, loss=0.9))
    summary = widgets.print_jobs_summary("exp", share=str(project / "results"), interval=0.02)
    assert Table(summary.table.value).points("a") == 1
    append_points(share, "a", point(1, loss=0.8), point(2, loss=0.7))
    wait_until(lambda: Table(summary.table.value).points("a") >= 3, 10, "the new points drawn")
    assert Table(summary.table.value).points("a") == 3
    write_record(share, record("a", "succeeded"))
    assert summary.wait(timeout=10)
    assert Table(summary.table.value).points("a") == 3 and "data-state='final'" in summary.table.value
