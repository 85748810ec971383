"""Run data is data: rich markup and HTML in errors, parameters and metrics are shown as they are.

An error text such as ``KeyError: "[/x] missing"``, a parameter ``[bold red]`` or a metric named
``[/]`` must print literally in every terminal view (``nbbatch status``, ``nbbatch compare``, the live
progress table) and be escaped in every HTML page (the compare report, the diff page). A display
callback that fails, or that changes the record it is handed, must not change the run's record.
See docs/reliability.md (issue 13).
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from support.notebooks import make_notebook

from nbbatch.api import submit
from nbbatch.metrics import METRICS_MIME
from nbbatch.store.layout import OUTPUT_NOTEBOOK, RUN_RECORD
from nbbatch.store.runjson import RunError, RunRecord
from nbbatch.store.share import FileShare

pytestmark = pytest.mark.timeout(180)

EVALUE = '"[/x] missing" [bold red]not red[/] [/]'
ERROR_TEXT = f"KeyError: {EVALUE}"
PARAMETERS = {"PATH": "[/tmp/x]", "[bold]NAME": "[link=http://x]click[/link]", "WIN": "C:\\[/]"}
# every parameter varies: the status table shows those that do, as columns headed by their names
OTHER_PARAMETERS = {"PATH": "[/tmp/y]", "[bold]NAME": "[link=http://y]other[/link]", "WIN": "D:\\[/]"}
METRICS = {"[/]": 1.5, "[bold red]loss": 0.25, "note": "C:\\[/] [red]"}
SCRIPT = "<script>alert(1)</script>"
IMG = '"><img src=x onerror=alert(1)>'


def hostile_records(root: Path, experiment: str = "e") -> list[RunRecord]:
    """Two final runs in ``<root>/<experiment>/`` whose run.json holds rich markup everywhere (no kernel)."""
    records = [
        RunRecord(run_id="nb-0123456789", experiment=experiment, notebook="[bold]nb.ipynb", kernel="python3",
                  parameters=PARAMETERS, status="failed", attempts=1, duration_s=1.5, metrics=METRICS,
                  error=RunError("KeyError", EVALUE, cell_index=2, cell_source="d['[/x]']")),
        RunRecord(run_id="nb-9876543210", experiment=experiment, notebook="[bold]nb.ipynb", kernel="python3",
                  parameters=OTHER_PARAMETERS, status="succeeded", attempts=1, duration_s=2.5,
                  metrics={**METRICS, "[/]": 2.5}),
    ]
    for record in records:
        folder = root / experiment / record.run_id
        folder.mkdir(parents=True, exist_ok=True)
        (folder / RUN_RECORD).write_bytes(record.to_json())
    return records


def assert_literal(out: str) -> None:
    """The status table's texts as they are: parameters and metrics are columns headed by their names."""
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out)  # a live table's styles and cursor moves
    header = next(line for line in plain.splitlines() if line.startswith("run "))
    for name in ("PATH", "[bold]NAME", "WIN", "[/]", "[bold red]loss"):
        assert name in header, (name, out)
    for text in (ERROR_TEXT, "[/tmp/x]", "[/tmp/y]", "[link=http://x]", "[link=http://y]", "C:\\[/]", "D:\\[/]",
                 " 1.5 ", " 2.5 ", " 0.25 "):
        assert text in plain, (text, out)


# --- terminal views ---------------------------------------------------------------------------------

@pytest.mark.compare
def test_status_and_compare_print_markup_in_run_data_literally(project):
    hostile_records(project / "results")
    env = {**os.environ, "COLUMNS": "1000", "NO_COLOR": "1"}

    def nbbatch(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "nbbatch", *args], cwd=project, capture_output=True, text=True,
                              env=env, timeout=150)

    done = nbbatch("status", "e")  # before: rich.errors.MarkupError and a traceback
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert_literal(done.stdout)
    assert "failed" in done.stdout and "succeeded" in done.stdout

    done = nbbatch("compare", "e")  # the metric names are the column headers
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    for text in (EVALUE, "[/tmp/x]", "[/tmp/y]", "[bold red]loss", "C:\\[/] [red]"):
        assert text in done.stdout, (text, done.stdout)


@pytest.mark.parametrize("tty", ["1", "0"], ids=["live-table", "plain-lines"])
def test_live_progress_renders_markup_in_run_data(tmp_path, monkeypatch, capsys, tty):
    from nbbatch.results.progress import live_progress
    from nbbatch.results.status import status_table

    monkeypatch.setenv("TTY_COMPATIBLE", tty)  # rich: a terminal (the live table) or not (one line per final run)
    monkeypatch.setenv("COLUMNS", "1000")
    monkeypatch.setenv("NO_COLOR", "1")
    records = hostile_records(tmp_path)
    with live_progress(FileShare(tmp_path), "e", [r.run_id for r in records]) as on_update:
        for record in records:
            on_update(record)  # before: MarkupError raised here (plain) or when the table was drawn (live)
    out = capsys.readouterr().out
    assert_literal(out)
    if tty == "0":
        assert f"nb-0123456789: failed in 1.5s (cell 2 (\"d['[/x]']\"): {ERROR_TEXT})" in out

    from rich.console import Console

    segments = list(Console(width=1000, force_terminal=True).render(status_table(records, title="[/] e")))
    failed = next(s for s in segments if s.text == "failed")  # the status keeps its STATUS_STYLE colour
    assert failed.style is not None and failed.style.bold and failed.style.color.name == "red"
    assert "[/] e" in "".join(s.text for s in segments)


# --- a display callback never changes a record ------------------------------------------------------

FAILING_CELL = 'raise KeyError("[/x] missing")'


@pytest.mark.parametrize("tty", ["0", "1"], ids=["plain-lines", "live-table"])
@pytest.mark.kernel
def test_nbbatchs_own_progress_display_does_not_overwrite_the_real_error(project, write_experiment, monkeypatch,
                                                                          capsys, tty):
    """The issue: the display crashed in the worker's callback and run.json got its MarkupError instead."""
    monkeypatch.setenv("TTY_COMPATIBLE", tty)
    monkeypatch.setenv("COLUMNS", "1000")
    make_notebook(project / "bad.ipynb", [FAILING_CELL])
    exp = write_experiment("experiment: brackets\nnotebooks: [bad.ipynb]\n")
    result = submit(exp, progress=True)
    (record,) = result.records
    assert record.status == "failed" and record.error.ename == "KeyError", record.error
    assert "[/x] missing" in record.error.evalue and record.error.reason != "nbbatch error"
    on_disk = json.loads(next((project / "results" / "brackets").glob("*/run.json")).read_text())
    assert on_disk["error"]["ename"] == "KeyError" and on_disk["status"] == "failed"
    assert "[/x] missing" in capsys.readouterr().out


@pytest.mark.kernel
def test_a_failing_or_meddling_display_callback_does_not_change_any_record(project, write_experiment, caplog):
    make_notebook(project / "bad.ipynb", [FAILING_CELL])
    make_notebook(project / "good.ipynb", ["import nbbatch; nbbatch.record(accuracy=0.5)"])
    exp = write_experiment("experiment: meddled\nnotebooks: [bad.ipynb, good.ipynb]\nresources: {max_parallel: 1}\n")
    seen: list[str] = []

    def meddling(record: RunRecord) -> None:
        seen.append(str(record.status))
        record.status, record.error = "succeeded", None  # a copy: the run's own record is untouched
        record.metrics["meddled"] = True
        raise RuntimeError("the display broke")

    with caplog.at_level(logging.WARNING, logger="nbbatch.backends.base"):
        result = submit(exp, progress=meddling)  # before: the RuntimeError of the first callback ended submit
    by_name = {r.notebook: r for r in result.records}
    bad, good = by_name["bad.ipynb"], by_name["good.ipynb"]
    assert bad.status == "failed" and bad.error.ename == "KeyError" and "[/x] missing" in bad.error.evalue
    assert good.status == "succeeded" and good.error is None and good.metrics == {"accuracy": 0.5}
    assert all("meddled" not in r.metrics for r in result.records)
    assert {"queued", "running", "failed", "succeeded"} <= set(seen)  # it was called all along, and failed each time
    warnings = [r for r in caplog.records if "progress display failed" in r.getMessage()]
    assert len(warnings) == 1 and "the display broke" in caplog.text  # once, with the traceback


# --- HTML: the compare report and the diff page -----------------------------------------------------

def hostile_notebook(path: Path, parameters: dict, metrics: dict, source: str) -> None:
    """An executed-looking notebook (papermill parameters, recorded metrics) written without a kernel."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["papermill"] = {"parameters": parameters}
    cell = nbformat.v4.new_code_cell(source, execution_count=1)
    cell.outputs = [nbformat.v4.new_output("display_data", data={METRICS_MIME: metrics, "text/plain": SCRIPT}),
                    nbformat.v4.new_output("stream", name="stdout", text=IMG + "\n")]
    nb.cells = [cell]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)


def assert_escaped(html: str) -> None:
    assert "<script>alert" not in html and "<img src=x" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "&lt;img src=x onerror=alert(1)&gt;" in html


def test_hostile_html_in_names_and_values_is_escaped_in_the_report_and_the_diff(tmp_path):
    pytest.importorskip("pandas")
    pytest.importorskip("jinja2")
    pytest.importorskip("nbdime")
    from nbbatch.results.compare import collect_targets, write_report
    from nbbatch.results.diff import diff_runs

    share = tmp_path / "share"
    folders = []
    for i, value in enumerate((SCRIPT, IMG)):
        record = RunRecord(run_id=f"nb-{i}123456789", experiment="h", notebook="nb.ipynb",
                           kernel="python3", parameters={SCRIPT: value, IMG: i}, status="failed", attempts=1,
                           duration_s=1.0 + i, metrics={SCRIPT: 0.5 + i, IMG: value},
                           error=RunError(SCRIPT, IMG))
        folder = share / "h" / record.run_id
        folder.mkdir(parents=True)
        (folder / RUN_RECORD).write_bytes(record.to_json())
        hostile_notebook(folder / OUTPUT_NOTEBOOK, record.parameters, record.metrics, f"x = {value!r}  # {SCRIPT}")
        folders.append(folder)

    frame = collect_targets(["h"], str(share))
    report = write_report(frame, tmp_path / "report.html").read_text()
    assert_escaped(report)

    result = diff_runs(folders[0], folders[1])
    assert sorted(name for name, _a, _b in result.changed_parameters) == sorted([SCRIPT, IMG])
    assert_escaped(result.to_html())
    text = result.pretty()  # the terminal diff is plain text: shown as it is
    assert f"   {SCRIPT}: " in text and f"   {IMG}: " in text
