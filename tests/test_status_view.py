"""The status table fits a terminal, ``nbbatch status --watch`` follows runs to their end, and
``nbbatch compare`` tells a metric named ``framework`` from the run's framework (issue 17)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import threading
from io import StringIO
from pathlib import Path

import pytest
from rich.console import Console
from support.records import two_runs, write_records

from nbbatch.results.status import format_metric, status_rows, status_table, varying_parameters
from nbbatch.store.layout import RUN_RECORD
from nbbatch.store.runjson import RunError, RunRecord
from nbbatch.store.share import FileShare

pytestmark = pytest.mark.timeout(120)

FRAMEWORKS = ["chainer", "gluon", "jax-flax", "keras-jax", "keras-tf", "lightning", "mxnet", "pytorch", "tensorflow"]
CONSTANT = {"EPOCHS": 2, "N_CLASSES": 10, "MOMENTUM": 0.9, "GPU": False, "SEED": 42, "DATASET": "digits",
            "DATA_DIR": "/mnt/datasets/shared/cifar-10-batches-py/extracted", "MAX_SAMPLES": None}
ERROR = ("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.78 GiB total capacity; 13.10 GiB already "
         "allocated; 1.20 GiB free; 14.00 GiB reserved in total by PyTorch) If reserved memory is >> allocated")


def sweep(experiment: str = "digits") -> list[RunRecord]:
    """9 frameworks × LR 0.01/0.1 (BATCHSIZE follows LR), 10 parameters of which 8 are the same everywhere."""
    records = []
    for index, framework in enumerate(FRAMEWORKS):
        for lr, batch in ((0.01, 32), (0.1, 256)):
            parameters = {**CONSTANT, "LR": lr, "BATCHSIZE": batch}
            digest = hashlib.sha256(f"{framework}{lr}".encode()).hexdigest()[:10]
            record = RunRecord(run_id=f"{framework}-{digest}", experiment=experiment, notebook=f"{framework}.ipynb",
                               kernel=f"nbbatch-{framework}", framework=framework, parameters=parameters,
                               status="succeeded", attempts=1, duration_s=30.5 + index)
            kind = (index + (lr == 0.1)) % 3
            if kind == 0:
                record.metrics = {"accuracy": 0.95 + index / 1000, "train_seconds": 20.25 + index,
                                  "images_per_second": 12345.6 / (index + 1), "framework": framework.title()}
            elif kind == 1:
                record.status, record.duration_s = "failed", 3.0
                record.error = RunError("RuntimeError", ERROR, cell_index=7)
            else:  # live: the metrics of the steps so far
                record.status, record.duration_s, record.started_at = "running", None, "2024-05-01T10:00:00+00:00"
                record.cells_done, record.cells_total = 5, 12
                record.metrics = {"loss": 0.4321, "accuracy": 0.71}
            records.append(record)
    return records


def render(renderable: object, width: int) -> list[str]:
    out = StringIO()
    Console(width=width, file=out, color_system=None).print(renderable)
    return out.getvalue().splitlines()


def run_lines(lines: list[str], run_ids: list[str]) -> dict[str, int]:
    """How many lines each run's row takes: its first line starts with its id, the rest with blanks."""
    rule = next(i for i, line in enumerate(lines) if line.startswith("───"))
    counts: dict[str, int] = {}
    current = None
    for line in lines[rule + 1:]:
        starts = [r for r in run_ids if line.startswith(r + " ")]
        if starts:
            current = starts[0]
            counts[current] = 1
        elif current and line.strip() and line.startswith(" ") and "hidden at this width" not in line:
            counts[current] += 1
        else:
            current = None
    return counts


@pytest.mark.parametrize("width", [80, 160])
def test_every_run_is_one_or_two_lines_with_its_whole_id_varying_parameters_and_metrics(width):
    records = sweep()
    lines = render(status_table(records, title="digits"), width)
    ids = [r.run_id for r in records]
    assert all(len(line) <= width for line in lines), "\n".join(lines)
    counts = run_lines(lines, ids)
    assert sorted(counts) == sorted(ids), "\n".join(lines)  # every id whole, at the start of its row
    assert all(1 <= n <= 2 for n in counts.values()), (counts, "\n".join(lines))
    rule = next(i for i, line in enumerate(lines) if line.startswith("───"))
    header = " ".join(lines[1:rule])
    text = "\n".join(lines)
    assert re.search(r"\bLR\b", header) and "BATCHSIZE" in header
    for name in CONSTANT:  # the same in every run: no column
        assert not re.search(rf"\b{name}\b", header), name
    assert "cifar-10-batches-py" not in text
    assert "accuracy" in header and "status" in header and "run" in header
    assert "0.01" in text and "256" in text and "running 5/12" in text
    assert "RuntimeError" in text and "…" in text  # the error cut to what fits
    assert ERROR not in text
    if width == 160:  # the room is used: every metric, the live loss and more of each error
        assert "hidden at this width" not in text
        assert "loss" in header and "0.4321" in text and "12346" in text and "train_seconds" in header
        assert "CUDA out of memory" in text
    else:
        assert "hidden at this width" in text  # what did not fit is named, not silently gone


def test_columns_that_say_nothing_are_left_out_and_retries_and_gpus_shown_when_there():
    records = [r for r in sweep() if r.status == "succeeded"]
    text = "\n".join(render(status_table(records), 200))
    header = text.splitlines()[0]
    for column in ("try", "GPU", "framework", "error"):  # one attempt each, CPU only, id names the framework
        assert not re.search(rf"\b{column}\b", header), column
    records[0].attempts, records[1].gpu_ids = 2, [0, 1]
    records[2].framework = "PyTorch Lightning"  # not what its run id says
    header = render(status_table(records), 200)[0]
    for column in ("try", "GPU", "framework"):
        assert re.search(rf"\b{column}\b", header), (column, header)


def test_a_long_error_takes_at_most_two_lines_ending_in_an_ellipsis():
    record = next(r for r in sweep() if r.status == "failed")
    lines = render(status_table([record]), 80)
    counts = run_lines(lines, [record.run_id])
    assert counts == {record.run_id: 2}, "\n".join(lines)
    assert lines[-1].rstrip().endswith("…")


def test_varying_parameters_is_the_one_rule_for_the_table_and_the_widget():
    from nbbatch.ui.widgets.jobs import JobsSummaryModel

    records = sweep()
    assert varying_parameters(records) == ["LR", "BATCHSIZE"]
    model = JobsSummaryModel("digits")
    model.replace_all(records)
    assert model.varying_parameters() == ["LR", "BATCHSIZE"]
    assert varying_parameters(records[:1]) == []
    assert format_metric(12345.6) == "12346" and format_metric(0.123456) == "0.1235"


def test_the_submit_progress_table_shows_the_latest_live_metrics(tmp_path, monkeypatch, capsys):
    from nbbatch.results.progress import live_progress

    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    monkeypatch.setenv("COLUMNS", "120")
    running = next(r for r in sweep() if r.status == "running")
    with live_progress(FileShare(tmp_path), "digits", [running.run_id]) as on_update:
        running.metrics = {"loss": 0.9}
        on_update(running)
        newer = RunRecord.from_dict(running.to_dict())
        newer.metrics, newer.cells_done = {"loss": 0.1234, "accuracy": 0.875}, 9
        on_update(newer)
    out = capsys.readouterr().out
    last = out[out.rindex("digits: 1 running"):]  # the table as the live view left it
    assert "loss" in last and "0.1234" in last and "0.875" in last and "running 9/12" in last


# --- nbbatch status --watch --------------------------------------------------------------------------

def test_watch_in_a_pipe_prints_on_change_and_exits_0_when_every_run_ended(project):
    running, final = two_runs()
    write_records(project / "results", running)
    env = {**os.environ, "COLUMNS": "100", "NO_COLOR": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "nbbatch", "status", "w", "--watch", "--interval", "0.05"],
                            cwd=project, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        seen = []
        for line in proc.stdout:  # the first table: both running
            seen.append(line)
            if "w: 2 running" in line:
                break
        writer = threading.Thread(target=write_records, args=(project / "results", final))
        writer.start()
        writer.join()
        rest, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert "w: 1 failed, 1 succeeded" in rest and "succeeded" in rest and "bad LR" in rest
    assert rest.count("w: 1 failed, 1 succeeded") == 1  # printed on change, not every poll


def _patch_status(monkeypatch, on_call):
    """``nbbatch.api.read_status`` that calls ``on_call(n)`` before reading (n: how many reads so far)."""
    import nbbatch.api

    real = nbbatch.api.read_status
    calls = []

    def status(*args, **kwargs):
        calls.append(1)
        on_call(len(calls))
        return real(*args, **kwargs)

    monkeypatch.setattr(nbbatch.api, "read_status", status)
    return calls


def _finish_after_first_read(monkeypatch, root: Path, final: list[RunRecord]) -> list[threading.Thread]:
    """Records become final from another thread once the watch has read them once (running)."""
    first_read = threading.Event()
    threads = [threading.Thread(target=lambda: (first_read.wait(30), write_records(root, final)))]
    threads[0].start()

    def on_call(n: int) -> None:
        if n == 2:
            first_read.set()
            threads[0].join()

    _patch_status(monkeypatch, on_call)
    return threads


def test_watch_on_a_terminal_redraws_until_final_then_check_says_not_all_succeeded(project, monkeypatch, capsys):
    from nbbatch.ui.cli import main

    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    monkeypatch.setenv("COLUMNS", "80")
    running, final = two_runs()
    write_records(project / "results", running)
    _finish_after_first_read(monkeypatch, project / "results", final)
    assert main(["status", "w", "--watch", "--interval", "0.01", "--check"]) == 1  # one failed
    out = capsys.readouterr().out
    assert "w: 2 running" in out  # the live table before the runs ended
    last = out[out.rindex("w: 1 failed, 1 succeeded"):]
    assert "succeeded" in last and "failed" in last and "bad LR" in last and "0.93" in last


def test_watch_json_waits_then_prints_the_unchanged_json(project, monkeypatch, capsys):
    from nbbatch.ui.cli import main

    running, final = two_runs()
    write_records(project / "results", running)
    _finish_after_first_read(monkeypatch, project / "results", final)
    assert main(["status", "w", "--watch", "--json", "--interval", "0.01"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown == json.loads(json.dumps(status_rows(final), default=str))


def test_ctrl_c_while_watching_exits_130_quietly_and_touches_no_run(project, monkeypatch, capsys):
    from nbbatch.ui.cli import main

    running, _ = two_runs()
    write_records(project / "results", running)

    def on_call(n: int) -> None:
        if n == 3:
            raise KeyboardInterrupt

    _patch_status(monkeypatch, on_call)
    assert main(["status", "w", "--watch", "--interval", "0.01"]) == 130
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "cancelled" not in captured.err
    for record in running:
        on_disk = RunRecord.from_json((project / "results" / "w" / record.run_id / RUN_RECORD).read_bytes())
        assert on_disk.status == "running"


def test_bad_interval_is_a_usage_error(project, capsys):
    from nbbatch.ui.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["status", "w", "--watch", "--interval", "0"])
    assert exc.value.code == 2 and "positive number of seconds" in capsys.readouterr().err


# --- nbbatch compare: a metric named like a run column -----------------------------------------------

def _framework_share(root: Path, recorded: list[str]) -> None:
    records = []
    for name, title in zip(["pytorch", "keras-tf"], recorded, strict=True):
        records.append(RunRecord(run_id=f"{name}-0123456789", experiment="c", notebook=f"{name}.ipynb",
                                 kernel="python3", framework=name, status="succeeded", attempts=1,
                                 duration_s=1.0, metrics={"accuracy": 0.9, "framework": title}))
    write_records(root, records)


def _headers(table_or_html: object) -> list[str]:
    if isinstance(table_or_html, str):
        return re.findall(r"<th(?:\s[^>]*)?>(.*?)</th>", table_or_html)
    return [str(column.header) for column in table_or_html.columns]


@pytest.mark.compare
def test_compare_heads_a_framework_metric_apart_from_the_run_framework(tmp_path):
    from nbbatch.results.compare import collect, render_report, runs_table

    _framework_share(tmp_path, ["PyTorch", "Keras (TensorFlow)"])
    frame = collect(tmp_path, ["c"])
    # by default the metric is left out: it only relabels the run's framework (issue 34)
    assert _headers(runs_table(frame)).count("framework") == 1
    assert "metric.framework" not in _headers(render_report(frame, tmp_path / "report.html"))
    asked = runs_table(frame, columns=["run_id", "framework", "metric.framework"])  # --columns
    headers = _headers(asked)
    assert headers.count("framework") == 1 and "metric.framework" in headers, headers
    text = "\n".join(render(asked, 200))
    assert "Keras (TensorFlow)" in text and "keras-tf" in text


@pytest.mark.compare
def test_compare_leaves_out_a_framework_metric_that_repeats_the_run_framework(tmp_path):
    from nbbatch.results.compare import collect, render_report, runs_table

    _framework_share(tmp_path, ["pytorch", "keras-tf"])  # nbbatch.record(framework="pytorch")
    frame = collect(tmp_path, ["c"])
    assert _headers(runs_table(frame)).count("framework") == 1
    assert "metric.framework" in frame.columns  # still there for --where, CSV and JSON
    html_headers = _headers(render_report(frame, tmp_path / "report.html"))
    assert html_headers.count("framework") == 1 and "accuracy" in html_headers, html_headers


def test_a_cancelled_run_is_one_line_saying_who_when_and_how_far():
    records = [r for r in sweep() if r.status == "succeeded"][:2]
    stopped = [RunRecord.from_dict(r.to_dict()) for r in records]
    for record, started in zip(stopped, (True, False), strict=True):
        record.run_id = record.run_id[:-1] + "x"
        record.status, record.metrics, record.duration_s = "cancelled", {}, None
        record.started_at = "2024-05-01T10:00:00+00:00" if started else None
        record.cells_done, record.cells_total = (4, 9) if started else (0, 0)
        record.error = RunError("cancelled", "", cell_index=4 if started else None, kind="cancelled",
                                stopped_by="`nbbatch cancel`", stopped_at="2024-05-01T14:02:00+00:00",
                                reason="cancelled by `nbbatch cancel` from ann@box (pid 7) at 2024-05-01 14:02:00 UTC")
    ids = [r.run_id for r in records + stopped]
    lines = [line for line in render(status_table(records + stopped), 200) if "rows by" not in line]
    text = "\n".join(lines)
    assert run_lines(lines, ids) == {run_id: 1 for run_id in ids}, text
    assert re.search(r"cancelled by `nbbatch cancel` at 2024-05-01 \d\d:\d\d \(after 3 of 9 cells\)", text), text
    assert re.search(r"cancelled by `nbbatch cancel` at 2024-05-01 \d\d:\d\d \(before it started\)", text), text
    # narrow: the status column says "cancelled"; how far comes first, so that a cut keeps it
    narrow = [line for line in render(status_table(records + stopped), 80) if "rows by" not in line]
    text = "\n".join(narrow)
    assert all(n <= 2 for n in run_lines(narrow, ids).values()), text
    assert "after 3 of 9 cells," in text and "before it started, by" in text, text


def search_trials() -> list[RunRecord]:
    """A search of loss over ALPHA and DEPTH: 6 trials that also record accuracy, train_seconds and images_per_second;
    two pruned by the pruner, one still running."""
    records = []
    for number in range(6):
        digest = hashlib.sha256(f"trial{number}".encode()).hexdigest()[:10]
        record = RunRecord(run_id=f"sklearn-{digest}", experiment="tune", notebook="sklearn.ipynb",
                           kernel="nbbatch-sklearn", framework="sklearn",
                           parameters={**CONSTANT, "ALPHA": 0.001304907355036239 * (number + 1), "DEPTH": 2 + number},
                           status="succeeded", attempts=1, duration_s=61.5 + number,
                           metrics={"accuracy": 0.9 - number / 100, "train_seconds": 50.25 + number,
                                    "images_per_second": 12345.6 / (number + 1), "loss": 0.25 + number / 10},
                           trial={"study": "tune/sklearn", "number": number, "state": "complete"})
        if number in (3, 4):
            record.status = "pruned"
            record.trial = {"study": "tune/sklearn", "number": number, "state": "pruned", "step": 4, "value": 0.9}
            record.error = RunError("pruned", "", reason=f"stopped at step 4 by the search's median pruner: loss "
                                    f"0.{number} is not among the lowest it keeps at this step", kind="pruned")
        if number == 5:
            record.status, record.duration_s, record.started_at = "running", None, "2024-05-01T10:00:00+00:00"
        records.append(record)
    return records


def test_a_search_at_80_columns_shows_its_metric_and_trial_first_and_pruned_is_no_error():
    records = search_trials()
    lines = render(status_table(records, title="tune", search={"metric": "loss", "mode": "min"}), 80)
    text = "\n".join(lines)
    assert all(len(line) <= 80 for line in lines), text
    rule = next(i for i, line in enumerate(lines) if line.startswith("───"))
    header = lines[1:rule]
    columns = " ".join(header).split()
    assert columns[:4] == ["run", "status", "trial", "loss"], text  # what the search is about, first
    assert not re.search(r"hidden at this width:.*\bloss\b", text), text
    assert "pruned at step 4" in text and "error" not in columns, text
    assert "median pruner" not in text  # the pruner's reason is no error to show; `status --json` has it as a note
    rows = {row["run_id"]: row for row in status_rows(records, {"metric": "loss", "mode": "min"})}
    pruned = rows[records[3].run_id]
    assert pruned["error"] == "" and "median pruner" in pruned["note"]
