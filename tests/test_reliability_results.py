"""Reliability round 3 (issue 34), what the results show: the current plan's runs, not every run ever written
under the experiment's name (defect 4), and the rough edges of ``plan``, ``compare`` and the report."""

from __future__ import annotations

import json
import os
import re
import warnings
from io import StringIO
from pathlib import Path

import pytest
from rich.console import Console
from support.machine import REPO
from support.notebooks import make_notebook

from nbbatch import api
from nbbatch.plan.runs import Run
from nbbatch.results.compare import collect, render_report, runs_table
from nbbatch.results.status import plan_table
from nbbatch.spec.experiment import AUTO, load_experiment
from nbbatch.store.layout import MANIFEST, RUN_RECORD
from nbbatch.store.runjson import RunRecord
from nbbatch.ui.cli import main

pytestmark = pytest.mark.timeout(120)

EXPERIMENT = "experiment: e\nnotebooks: [nb.ipynb]\nsweep: {grid: {A: [1, 2]}}\n"


def _notebook(folder: Path, bug: bool) -> None:
    body = "import nbbatch\n" + ("raise ValueError('a bug')\n" if bug else "") + "nbbatch.record(accuracy=A / 10)"
    make_notebook(folder / "nb.ipynb", [body], parameters="A = 1")


def _render(renderable: object, width: int) -> list[str]:
    out = StringIO()
    Console(width=width, file=out, color_system=None).print(renderable)
    return out.getvalue().splitlines()


def _record(experiment: str, run_id: str, status: str = "succeeded", **metrics: object) -> RunRecord:
    return RunRecord(run_id=run_id, experiment=experiment, notebook="nb.ipynb", kernel="python3", framework="nb",
                     status=status, attempts=1, duration_s=1.0, parameters={"A": int(run_id[-1])},
                     metrics={"accuracy": 0.5, **metrics})


def _share(root: Path, experiment: str, records: list[RunRecord], planned: list[str] | None) -> Path:
    """A share folder holding ``records``, with a manifest planning ``planned`` (None: no manifest)."""
    for record in records:
        folder = root / experiment / record.run_id
        folder.mkdir(parents=True, exist_ok=True)
        (folder / RUN_RECORD).write_bytes(record.to_json())
    if planned is not None:
        (root / experiment / MANIFEST).write_text(json.dumps({"experiment": experiment, "runs": planned}))
    return root


# --- defect 4: status, compare and check judge the current plan ------------------------------------------------

@pytest.mark.kernel
def test_status_check_passes_once_the_fixed_notebook_succeeds_and_all_shows_the_superseded_runs(project, capsys):
    (project / "exp.yaml").write_text(EXPERIMENT)
    _notebook(project, bug=True)
    assert not api.submit(project / "exp.yaml", progress=False).ok
    _notebook(project, bug=False)  # the fix changes the notebook, so the runs get new ids
    assert api.submit(project / "exp.yaml", progress=False).ok

    assert main(["status", "e", "--check"]) == 0
    out = capsys.readouterr().out
    assert "2 succeeded" in out and "failed" not in out
    assert [r.status for r in api.status("e")] == ["succeeded", "succeeded"]
    assert sorted(r.status for r in api.status("e", all_runs=True)) == ["failed", "failed", "succeeded", "succeeded"]
    assert main(["status", "e", "--all", "--check"]) == 1
    assert "2 failed, 2 succeeded" in capsys.readouterr().out

    frame = collect(project / "results", ["e"])
    assert list(frame["status"]) == ["succeeded", "succeeded"] and frame.attrs["superseded"] == 2
    assert len(collect(project / "results", ["e"], all_runs=True)) == 4
    assert main(["compare", "e"]) == 0
    out = capsys.readouterr().out
    assert "2 run(s) of earlier submissions not shown (--all shows them)" in out and "a bug" not in out


@pytest.mark.kernel
def test_another_experiment_file_reusing_the_name_is_warned_of_naming_both(project):
    (project / "exp.yaml").write_text(EXPERIMENT)
    _notebook(project, bug=False)
    first = api.submit(project / "exp.yaml", progress=False)
    assert first.ok and not first.warnings
    assert not api.submit(project / "exp.yaml", progress=False).warnings  # the same file again: no warning

    other = project / "other"
    _notebook(other, bug=False)
    (other / "exp.yaml").write_text("experiment: e\nnotebooks: [nb.ipynb]\nparameters: {A: 7}\nshare: ../results\n")
    second = api.submit(other / "exp.yaml", progress=False)
    assert second.ok and len(second.records) == 1
    [warning] = second.warnings
    assert str((project / "exp.yaml").resolve()) in warning and str((other / "exp.yaml").resolve()) in warning
    assert "--all" in warning and "`experiment:` name" in warning
    assert [r.parameters["A"] for r in api.status("e")] == [7]  # not mixed with the first file's runs
    assert len(api.status("e", all_runs=True)) == 3


@pytest.mark.compare
def test_compare_of_the_whole_share_and_check_take_each_experiments_current_plan(project, capsys):
    results = project / "results"
    _share(results, "e", [_record("e", "nb-1", "failed"), _record("e", "nb-2")], planned=["nb-2"])
    _share(results, "old", [_record("old", "nb-1"), _record("old", "nb-3", "failed")], planned=None)
    frame = collect(results)
    assert sorted(zip(frame["experiment"], frame["run_id"], strict=True)) == [("e", "nb-2"), ("old", "nb-1"),
                                                                             ("old", "nb-3")]
    assert frame.attrs["superseded"] == 1
    # `check` compares the current plans: the superseded failed run of `e` is not a regression
    assert main(["check", "e", "--baseline", "e", "--metric", "accuracy", "--require-all"]) == 0
    assert "nb-1" not in capsys.readouterr().out


def test_a_damaged_manifest_shows_every_run_and_a_plan_not_started_yet_says_so(project):
    results = project / "results"
    _share(results, "e", [_record("e", "nb-1"), _record("e", "nb-2")], planned=None)
    (results / "e" / MANIFEST).write_text("{not json")
    assert len(api.status("e", refresh=False)) == 2
    (results / "e" / MANIFEST).write_text(json.dumps({"runs": ["nb-9"]}))  # submitted, its records not written yet
    with pytest.raises(api.NbbatchError, match=r"none of the 1 run\(s\) .* last submission .*--all"):
        api.status("e", refresh=False)
    assert len(api.status("e", refresh=False, all_runs=True)) == 2


def test_the_jobs_widget_lists_the_current_plan(project):
    pytest.importorskip("ipywidgets")
    from nbbatch.store.share import open_share
    from nbbatch.ui.widgets.jobs import JobsSummary, JobsSummaryModel

    results = project / "results"
    _share(results, "e", [_record("e", "nb-1", "failed"), _record("e", "nb-2")], planned=["nb-2"])
    summary = JobsSummary(JobsSummaryModel("e"), open_share(results))
    assert [r.run_id for r in summary.load()] == ["nb-2"]


# --- the rough edges -------------------------------------------------------------------------------------------

def _runs(count: int) -> list[Run]:
    return [Run(run_id=f"a-rather-long-notebook-name-{index:010x}", experiment="e",
                notebook=f"/p/notebooks/a_rather_long_notebook_name_{index}.ipynb",
                notebook_rel=f"notebooks/a_rather_long_notebook_name_{index}.ipynb", kernel="nbbatch-jax-flax",
                parameters={"DATASET": "digits", "LR": 0.01 * (index + 1), "BATCHSIZE": 32 * (index + 1)})
            for index in range(count)]


def test_plan_table_keeps_every_run_id_whole_on_one_line_at_80_columns(project, capsys, monkeypatch):
    runs = _runs(6)
    lines = _render(plan_table(runs, title="e: 6 run(s)"), 80)
    assert all(len(line) <= 80 for line in lines)
    for run in runs:
        [line] = [line for line in lines if run.run_id in line]
        assert f"{run.parameters['LR']:.4g}" in line
    assert any("every run: DATASET=digits" in line for line in lines)

    (project / "exp.yaml").write_text("experiment: e\nnotebooks: [nb.ipynb]\nsweep: {grid: {A: [1, 2, 3]}}\n")
    _notebook(project, bug=False)
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["plan", "exp.yaml"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert all(len(line) <= 80 for line in out)
    assert len([line for line in out if re.match(r"nb-[0-9a-f]{10} +[123] ", line)]) == 3, out


@pytest.mark.compare
def test_compare_piped_fits_a_sane_width(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    metrics = {f"a_metric_with_a_long_name_{i}": 0.123456 * i for i in range(8)}
    _share(tmp_path, "e", [_record("e", f"nb-{i}", **metrics) for i in range(1, 4)], planned=None)
    assert main(["compare", str(tmp_path / "e")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines and max(len(line) for line in lines) <= 120
    assert any("hidden at this width" in line for line in lines)  # what did not fit is named


@pytest.mark.compare
def test_compare_and_report_show_framework_once(tmp_path):
    records = [_record("c", "nb-1", framework="PyTorch"), _record("c", "nb-2", framework="Keras (TensorFlow)")]
    _share(tmp_path, "c", records, planned=None)
    frame = collect(tmp_path, ["c"])
    headers = [str(c.header) for c in runs_table(frame).columns]
    assert "framework" in headers and "metric.framework" not in headers, headers
    html = render_report(frame, tmp_path / "report.html")
    html_headers = re.findall(r"<th(?:\s[^>]*)?>(.*?)</th>", html)
    assert "framework" in html_headers and "metric.framework" not in html_headers, html_headers
    assert "metric.framework" in frame.columns  # still there for --where, --columns, CSV and JSON
    asked = [str(c.header) for c in runs_table(frame, columns=["run_id", "metric.framework"]).columns]
    assert asked == ["run_id", "metric.framework"]


def test_lr_sweep_example_leaves_runs_per_gpu_to_auto():
    path = REPO / "experiments" / "lr-sweep.yaml"
    text = path.read_text()
    assert "runs_per_gpu: 3" not in text and "auto" in text
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = load_experiment(path)
    assert spec.resources.runs_per_gpu == AUTO
    assert os.path.basename(spec.share) == "results"
