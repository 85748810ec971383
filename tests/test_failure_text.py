"""How a failed or cancelled run is told: the traceback in log.txt, `nbbatch logs` and run.json; one cell numbering
(the user's own notebook's, 1-based, the injected parameters cell not counted) with the cell's first line, in
`submit`, `status` and `nbbatch run` alike; a cancel said as who, when and how far, on one line."""

from __future__ import annotations

import json
import re
import threading
import time
from datetime import datetime, timezone

import nbformat
import pytest
from support.notebooks import make_notebook
from support.waiting import wait_running

import nbbatch
from nbbatch.api import submit
from nbbatch.store.layout import experiment_paths, run_paths
from nbbatch.store.notebook_io import cell_number, stopped_cell, user_cells
from nbbatch.store.runfiles import cancel_request, stop_request, write_cancel_markers, write_record
from nbbatch.store.runjson import TRACEBACK_LINES, ErrorKind, RunError, RunRecord, Status, plain_traceback
from nbbatch.store.share import open_share
from nbbatch.ui.cli import main

pytestmark = pytest.mark.timeout(180)

_MARKDOWN = ["# Training", "Markdown cells count: cells are numbered as the notebook has them"]
_FAILING = ["print('before', A)", "x = 1\nraise ValueError(f'bad value {x}')", "print('never')"]


def _notebook_with_markdown(path):
    make_notebook(path, [])
    nb = nbformat.read(path, as_version=4)
    nb.cells.extend([*map(nbformat.v4.new_markdown_cell, _MARKDOWN), *map(nbformat.v4.new_code_cell, _FAILING)])
    nbformat.write(nb, path)


@pytest.fixture
def utc(monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_cells_are_numbered_as_the_users_notebook_has_them():
    injected = nbformat.v4.new_code_cell("A = 2")
    injected.metadata["tags"] = ["injected-parameters"]
    marker = nbformat.v4.new_markdown_cell("papermill's error marker")
    marker.metadata["tags"] = ["papermill-error-cell-tag"]
    cells = [marker, nbformat.v4.new_code_cell("A = 1"), injected, nbformat.v4.new_markdown_cell("# t"),
             nbformat.v4.new_code_cell("fit()")]
    assert [cell_number(cells, i) for i in range(5)] == [None, 1, None, 2, 3]
    assert user_cells(cells) == 3 and user_cells(cells, 3) == 1
    cells[4].metadata["papermill"] = {"start_time": "t"}
    assert stopped_cell(nbformat.v4.new_notebook(cells=cells)) == (3, "fit()")


def test_an_errors_line_names_the_cell_by_its_first_line():
    error = RunError("ValueError", "bad", cell_index=3, cell_source="\n  model.fit(X, y)  # the slow one\nmore")
    assert error.summary() == 'cell 3 ("model.fit(X, y)  # the slow one"): ValueError: bad'
    assert error.summary(with_cell=False) == "ValueError: bad"
    error.rank, error.cell_source = 1, "y = " + "z" * 60
    assert error.summary() == f'rank 1: cell 3 ("y = {"z" * 35}…"): ValueError: bad'


def test_a_traceback_is_kept_plain_and_bounded():
    frames = ["\x1b[0;31m---------------------------------------------------------------------------\x1b[0m",
              "\x1b[0;31mValueError\x1b[0m                                Traceback (most recent call last)",
              *[f"frame {i}" for i in range(500)], "\x1b[0;31mValueError\x1b[0m: bad value 1"]
    text = plain_traceback(frames)
    assert "\x1b" not in text and text.endswith("ValueError: bad value 1")
    assert len(text.splitlines()) == TRACEBACK_LINES + 1 and "left out" in text.splitlines()[0]
    assert plain_traceback(["x" * 50_000]).endswith("x") and len(plain_traceback(["x" * 50_000])) < 20_100
    assert plain_traceback([]) is None and plain_traceback(["a", "b"]) == "a\nb"


def test_a_cancel_says_by_whom_when_and_how_far_in_one_line(utc, tmp_path):
    request = cancel_request("`nbbatch cancel`", " from ann@box (pid 7)", at="2026-11-28T14:02:31.500+00:00")
    assert request.reason == "cancelled by `nbbatch cancel` from ann@box (pid 7) at 2026-11-28 14:02:31 UTC"
    today = datetime(2026, 11, 28, 18, 0, tzinfo=timezone.utc)
    _, stopped = request.outcome()
    stopped.cell_index, stopped.cell_source = 4, "import time; time.sleep(120)"
    assert stopped.summary((4, 9), now=today) == "cancelled by `nbbatch cancel` at 14:02 (after 3 of 9 cells)"
    assert stopped.summary((4, 9), now=datetime(2026, 11, 30, tzinfo=timezone.utc)) == \
        "cancelled by `nbbatch cancel` at 2026-11-28 14:02 (after 3 of 9 cells)"
    _, queued = request.outcome(reason="cancelled before it started")  # a backend's words keep the sender
    assert queued.summary(started=False, now=today) == "cancelled by `nbbatch cancel` at 14:02 (before it started)"
    assert queued.reason == "cancelled before it started"

    # the sender travels through the run's marker in the share, as every backend's executor reads it
    share = open_share(str(tmp_path / "share"))
    record = RunRecord("r1", "exp", "nb.ipynb", "python3", status=Status.RUNNING)
    write_record(share, record)
    assert write_cancel_markers(share, "exp", ["r1"], request) == ["r1"]
    _, marked = stop_request(share, "exp", "r1").outcome()
    assert (marked.stopped_by, marked.stopped_at, marked.kind) == ("`nbbatch cancel`", request.at, ErrorKind.CANCELLED)

    # cancelling them all: the experiment's marker is written first (a queued run never starts between the runs'
    # markers) and says who asked too, for a run whose own marker is not there yet
    queued_record = RunRecord("r2", "exp", "nb.ipynb", "python3", status=Status.QUEUED)
    write_record(share, queued_record)
    written = []
    real_write = share.write_bytes
    share.write_bytes = lambda path, data: (written.append(path), real_write(path, data))[1]
    write_cancel_markers(share, "exp", None, request)
    assert written == [experiment_paths("exp").cancel, run_paths("exp", "r1").cancel, run_paths("exp", "r2").cancel]
    share.remove(written[-1])  # as if read before r2's own marker was written
    _, everything = stop_request(share, "exp", "r2").outcome()
    assert (everything.stopped_by, everything.stopped_at) == ("`nbbatch cancel`", request.at)

    # a cluster's own cancel, and a record of an earlier nbbatch, say their reason, with how far
    scancel = RunError("cancelled", "job 3", reason="cancelled in Slurm (scancel)", kind=ErrorKind.CANCELLED)
    assert scancel.summary((2, 9)) == "cancelled in Slurm (scancel, after 2 of 9 cells)"


@pytest.mark.kernel
def test_a_failed_run_shows_its_traceback_and_its_cell_as_the_notebook_numbers_it(project, write_experiment, capsys):
    _notebook_with_markdown(project / "nb.ipynb")
    exp = write_experiment("experiment: tb\nnotebooks: [nb.ipynb]\n")  # no parameters: none injected
    (record,) = submit(exp, progress=False).records
    expected = 'cell 5 ("x = 1"): ValueError: bad value 1'  # parameters, 2 markdown, print, then the failing cell
    assert record.status == "failed" and record.error_summary() == expected
    traceback = record.error.traceback
    assert "\x1b[" not in traceback and "raise ValueError(f'bad value {x}')" in traceback
    assert traceback.rstrip().endswith("ValueError: bad value 1")
    assert (record.cells_done, record.cells_total) == (5, 6)

    log = (project / "results/tb" / record.run_id / "log.txt").read_text()
    assert log.rstrip().endswith(f"{traceback}\n=== failed after {record.duration_s:.2f} s: {expected}")
    assert main(["logs", "tb", record.run_id]) == 0
    assert traceback in capsys.readouterr().out
    assert main(["status", "tb", "--json", "--no-refresh"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["error"] == expected and row["traceback"] == traceback
    on_disk = json.loads((project / "results/tb" / record.run_id / "run.json").read_text())
    assert on_disk["error"]["traceback"] == traceback and on_disk["error"]["cell_index"] == 5

    # `nbbatch run` numbers the cell the same way (its parameters injected), and shows the traceback as papermill does
    assert main(["run", "nb.ipynb", str(project / "out.ipynb"), "-p", "A", "2", "-q"]) == 1
    err = capsys.readouterr().err
    assert "raise ValueError(f'bad value {x}')" in err and "\x1b[" not in err
    assert f"nb.ipynb failed in {expected} (executed notebook" in err




@pytest.mark.kernel
def test_a_cancelled_run_says_who_when_and_how_far_not_that_its_kernel_died(project, write_experiment, capsys):
    make_notebook(project / "nb.ipynb", ["print(A)", "import time; time.sleep(120)", "print('never')"])
    exp = write_experiment("experiment: stop\nnotebooks: [nb.ipynb]\nsweep: {grid: {A: [1, 2]}}\n"
                           "resources: {max_parallel: 1}\n")
    thread = threading.Thread(target=lambda: submit(exp, progress=False))
    thread.start()
    wait_running("stop", 2)
    assert main(["cancel", "stop"]) == 0
    thread.join(60)
    capsys.readouterr()
    ran, queued = sorted(nbbatch.status("stop"), key=lambda r: r.started_at is None)
    clock = r"at (\d{4}-\d\d-\d\d )?\d\d:\d\d"
    assert re.fullmatch(rf"cancelled by `nbbatch cancel` {clock} \(after 2 of 4 cells\)", ran.error_summary())
    assert re.fullmatch(rf"cancelled by `nbbatch cancel` {clock} \(before it started\)", queued.error_summary())
    assert ran.error.cell_index == 3 and "DeadKernelError" not in ran.error_summary()
    assert main(["status", "stop", "--json", "--no-refresh"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted(row["error"] for row in rows) == sorted([ran.error_summary(), queued.error_summary()])
    assert main(["status", "stop", "--no-refresh"]) == 0
    table = capsys.readouterr().out  # at 80 columns: how far first, beside the status
    assert "after 2 of 4 cells, by `nbbatch cancel` at" in table and "DeadKernelError" not in table
    log = (project / "results/stop" / ran.run_id / "log.txt").read_text()
    assert log.rstrip().splitlines()[-1].endswith(ran.error_summary())
