"""A cell's output, however much and however fast: the run's fate and log.txt do not depend on it, the driver's
memory stays bounded, and a cell timeout is recorded with the cell it stopped."""

from __future__ import annotations

import gc
import io
import logging
import threading
import time
from types import SimpleNamespace

import nbformat
import psutil
import pytest
from nbclient.exceptions import CellTimeoutError
from support.notebooks import make_notebook

from nbbatch.api import submit
from nbbatch.execute import attempt as one_attempt
from nbbatch.execute.engine import ELIDED, execute_notebook_file
from nbbatch.execute.live import LogSink

pytestmark = pytest.mark.timeout(180)


def _slow_driver(monkeypatch, seconds: float) -> None:
    """Make the driver (its log writes) take ``seconds`` more per output message: slower than the kernel prints."""
    write = LogSink.write

    def slow_write(self, text):
        if not text.startswith("==="):
            time.sleep(seconds)
        return write(self, text)

    monkeypatch.setattr(LogSink, "write", slow_write)


def _run(project, experiment: str, cells: list[str], **keys):
    """Submit a notebook of ``cells`` (parameter SIZE = 1) and return its record and the path of its log."""
    make_notebook(project / f"{experiment}.ipynb", cells, parameters="SIZE = 1")
    (record,) = submit({"experiment": experiment, "notebooks": [f"{experiment}.ipynb"], **keys}, progress=False).records
    return record, project / "results" / experiment / record.run_id / "log.txt"


@pytest.mark.kernel
def test_output_the_driver_reads_slower_than_the_kernel_prints_is_read_to_the_end(project, monkeypatch):
    """The kernel has finished the cell for seconds (longer than nbclient's 4-s IOPub wait) while the driver still
    reads its output: the run succeeds and log.txt keeps every line and its end line. (Before: papermill failed the
    cell with "Timeout waiting for IOPub output", then a TypeError formatting the unset cell timeout.)"""
    _slow_driver(monkeypatch, 0.05)  # about 6 s to handle what the kernel prints in a blink
    record, log_path = _run(project, "slowread", ["for i in range(120):\n    print(f'line {i}', flush=True)\nprint('end')"])
    log = log_path.read_text()
    assert record.status == "succeeded", record.error and record.error.summary()
    assert all(f"line {i}\n" in log for i in range(120)) and "end\n" in log
    assert log.rstrip().splitlines()[-1].startswith("=== succeeded after")


def test_a_cell_timeout_error_is_classified_without_a_cell_timeout_set():
    """nbclient's IOPub wait raises a CellTimeoutError also when no cell timeout is set: no TypeError then."""
    run = SimpleNamespace(cell_timeout_s=None, kernel="python3")
    status, error = one_attempt._classify(CellTimeoutError("Timeout waiting for IOPub output"),
                                          SimpleNamespace(reason=None), run)
    assert status == "timed_out" and error.reason == "stopped by the cell timeout"


def _peak_growth(action) -> float:
    """MiB the process's RSS peaked above where it was while ``action`` ran."""
    me = psutil.Process()
    baseline, peak, stop = me.memory_info().rss, [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], me.memory_info().rss)
            time.sleep(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        action()
    finally:
        stop.set()
        sampler.join()
    return (peak[0] - baseline) / 2**20


@pytest.mark.kernel
def test_a_cell_printing_faster_than_the_driver_reads_keeps_the_driver_memory_bounded(project, monkeypatch):
    """1-MiB lines printed and flushed as fast as the kernel can, max_output_mb: 2, to a driver that handles each
    10 ms more slowly: what it has received but not handled yet no longer piles up in its memory (before: ZeroMQ
    queued up to 1000 messages in the driver; +264 to +362 MiB for 400 MiB printed without the slowdown)."""
    _slow_driver(monkeypatch, 0.01)
    cells = ["import sys\nfor i in range(SIZE):\n    sys.stdout.write(str(i % 10) * (2**20 - 1) + '\\n')\n"
             "    sys.stdout.flush()\nprint('end')"]
    records = {}

    def loud(name: str, size: int) -> None:
        records[name] = _run(project, name, cells, parameters={"SIZE": size}, max_output_mb=2)

    loud("warm", 16)  # the first run's imports and caches
    small = _peak_growth(lambda: loud("small", 16))
    large = _peak_growth(lambda: loud("large", 200))
    for name, size in (("small", 16), ("large", 200)):
        record, log_path = records[name]
        assert record.status == "succeeded", record.error and record.error.summary()
        with open(log_path, "rb") as log:
            assert sum(line == b"end\n" for line in log) == 1  # one line at a time: 1 MiB at most
        assert log_path.stat().st_size > size * 2**20
        with open(log_path, "rb") as log:
            log.seek(-200, 2)
            assert log.read().rstrip().splitlines()[-1].startswith(b"=== succeeded after")
    assert large - small < 80, f"the driver grew by {small:.0f} MiB for 16 MiB printed and {large:.0f} MiB for 200 MiB"


@pytest.mark.kernel
def test_a_cell_timeout_names_the_cell_and_leaves_no_pending_task(project, caplog):
    """The record says which cell ran too long (its index and first line), not nbclient's line of dashes; asyncio
    has no "Task was destroyed but it is pending!" to say afterwards."""
    caplog.set_level(logging.ERROR, logger="asyncio")
    record, _ = _run(project, "celltimeout", ["print('started')", "import time\ntime.sleep(60)  # slow"], cell_timeout=2)
    gc.collect()  # the output reader nbclient left pending was reported when collected
    assert record.status == "timed_out"
    error = record.error
    assert error.cell_index == 3 and error.cell_source.startswith("import time")  # the notebook's third cell
    assert error.summary() == 'cell 3 ("import time"): CellTimeoutError: ran longer than 2 s (stopped by the cell timeout (2 s))'
    nb = nbformat.read(project / "results/celltimeout" / record.run_id / "output.ipynb", as_version=4)
    assert nb.cells[1].outputs[0].text == "started\n"
    assert not [r for r in caplog.records if "Task was destroyed" in r.getMessage()]


@pytest.mark.kernel
def test_consecutive_printed_text_of_a_stream_is_one_output_also_under_max_output_mb(tmp_path):
    """3,000 prints flushed one by one (a message each): one output per stream in the notebook, in order around a
    displayed value; a cell printing past max_output_mb keeps its head and the note in that one output. (Before: an
    output per message; 300,000 short prints made 232,190 outputs, a 20.8 MB notebook.)"""
    cells = ["import sys\nfor i in range(3000):\n    print(f'line {i}', flush=True)\n"
             "for i in range(3):\n    print(f'warn {i}', file=sys.stderr, flush=True)\n"
             "display('shown')\nprint('after', flush=True)\nprint('more', flush=True)",
             "for i in range(6000):\n    print(f'capped {i}', flush=True)"]
    make_notebook(tmp_path / "nb.ipynb", cells, parameters=None)
    nb = execute_notebook_file(str(tmp_path / "nb.ipynb"), str(tmp_path / "out.ipynb"), kernel_name="python3",
                               kernel_cwd=str(tmp_path), max_output_bytes=40_000)
    printed, capped = nb.cells[0].outputs, nb.cells[1].outputs
    assert [(o.output_type, o.get("name")) for o in printed] == [
        ("stream", "stdout"), ("stream", "stderr"), ("display_data", None), ("stream", "stdout")]
    assert printed[0].text == "".join(f"line {i}\n" for i in range(3000))
    assert printed[1].text == "warn 0\nwarn 1\nwarn 2\n" and printed[3].text == "after\nmore\n"
    assert len(capped) == 1, f"{len(capped)} outputs"
    everything = "".join(f"capped {i}\n" for i in range(6000))
    assert capped[0].text == everything[:40_000] + ELIDED.format(limit=40_000 / 2**20)
    assert nbformat.read(tmp_path / "out.ipynb", as_version=4).cells == nb.cells


@pytest.mark.kernel
def test_a_kernel_printing_faster_than_the_driver_reads_loses_no_line(tmp_path):
    """30,000 prints flushed one by one (a message each), faster than the driver reads them: the log and the notebook
    keep every line and the cell's end. (Before: the kernel's IOPub socket dropped what the driver had not taken once
    1,000 messages waited: 676 of 30,000 lines lost here; 300,000 prints lost 156,512 lines and their end, and the run
    succeeded, its log saying the rest of the output did not come.)"""
    lines = 30_000
    make_notebook(tmp_path / "nb.ipynb", [f"for i in range({lines}):\n    print(f'line {{i}}', flush=True)\nprint('end')"],
                  parameters=None)
    log = io.StringIO()
    nb = execute_notebook_file(str(tmp_path / "nb.ipynb"), str(tmp_path / "out.ipynb"), kernel_name="python3",
                               kernel_cwd=str(tmp_path), stdout_file=log, stderr_file=log)
    everything = "".join(f"line {i}\n" for i in range(lines)) + "end\n"
    assert log.getvalue() == everything, f"{lines + 1 - log.getvalue().count(chr(10))} lines lost"
    assert "".join(o.text for o in nb.cells[0].outputs) == everything
