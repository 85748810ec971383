"""nbbatch.results.compare on notebooks executed for real with papermill (see support.notebooks.build_share)."""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

import pytest
from support.notebooks import build_share

from nbbatch.errors import NbbatchError
from nbbatch.results import compare
from nbbatch.ui import results_commands

pytest.importorskip("pandas")
pytest.importorskip("matplotlib")

pytestmark = pytest.mark.kernel  # the tests read notebooks executed for real


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_share(tmp_path_factory.mktemp("compare"))


def _parse(add, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add(parser)
    return parser.parse_args(argv)


def test_collect_reads_run_records(made: dict[str, Path]) -> None:
    frame = compare.collect(made["share"], ["sweep"])
    assert len(frame) == 5
    assert set(frame["experiment"]) == {"sweep"}
    assert set(frame["source"]) == {"run.json"}
    assert list(frame.columns[:6]) == ["experiment", "run_id", "framework", "notebook", "kernel", "status"]
    for column in ("param.LR", "param.EPOCHS", "metric.accuracy", "metric.train_seconds", "duration_s",
                   "gpu_ids", "started_at", "host", "output"):
        assert column in frame.columns, column
    assert frame["status"].value_counts().to_dict() == {"succeeded": 4, "failed": 1}
    assert sorted(frame["framework"].unique()) == ["keras", "pytorch"]
    assert all(Path(p).is_file() and p.endswith("output.ipynb") for p in frame["output"])


def test_run_failing_part_way_keeps_its_metrics(made: dict[str, Path]) -> None:
    frame = compare.collect(made["share"], "sweep")
    failed = frame[frame["status"] == "failed"].iloc[0]
    assert failed["param.FAIL"] is True or failed["param.FAIL"] == 1
    assert not math.isnan(failed["metric.accuracy"])  # recorded before the failing cell
    assert "RuntimeError" in failed["error"] and "diverged" in failed["error"]
    assert failed["metric.finished"] != True  # noqa: E712 - the cell after the failure never ran


def test_plain_papermill_folder_without_run_json(made: dict[str, Path]) -> None:
    frame = compare.collect(made["plain"])
    assert len(frame) == 3
    assert set(frame["source"]) == {"notebook"}
    by_id = frame.set_index("run_id")
    assert by_id.loc["pytorch_lr0.01", "experiment"] == "plain"
    assert by_id.loc["keras_fail", "experiment"] == "sub"
    assert by_id.loc["keras_lr0.1", "param.EPOCHS"] == 3
    assert by_id.loc["pytorch_lr0.01", "status"] == "succeeded"
    assert by_id.loc["keras_fail", "status"] == "failed"
    assert by_id.loc["keras_fail", "metric.accuracy"] > 0  # recorded before it failed
    assert "RuntimeError" in by_id.loc["keras_fail", "error"]
    # numbered as the input notebook has its cells, with the cell's first line, as run.json's errors are
    assert re.match(r'cell \d+ \("[^"]+"\): RuntimeError: ', by_id.loc["keras_fail", "error"])
    assert by_id.loc["pytorch_lr0.01", "framework"] == "Pytorch_CIFAR"  # the input notebook's name
    assert by_id["duration_s"].gt(0).all()
    # one executed notebook on its own
    single = compare.collect(made["plain"] / "keras_lr0.1.ipynb")
    assert list(single["run_id"]) == ["keras_lr0.1"] and single.loc[0, "metric.accuracy"] > 0


def test_whole_share_and_several_targets(made: dict[str, Path]) -> None:
    everything = compare.collect(made["share"])
    assert everything["experiment"].value_counts().to_dict() == {"sweep": 5, "drift": 2}
    both = compare.collect_targets(["sweep", "drift"], share=made["share"])
    assert len(both) == 7
    mixed = compare.collect_targets([str(made["plain"]), str(made["share"] / "drift")])
    assert len(mixed) == 5


def test_empty_or_missing_experiment_says_so(made: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(NbbatchError) as empty:
        compare.collect(made["share"], ["empty"])
    message = str(empty.value)
    assert "experiment `empty` has no runs" in message and "drift" in message and "sweep" in message
    with pytest.raises(NbbatchError, match="did you mean `sweep`"):
        compare.collect(made["share"], ["swep"])
    with pytest.raises(NbbatchError, match="no runs under"):
        compare.collect(tmp_path)


def test_sort_filter_group(made: dict[str, Path]) -> None:
    frame = compare.collect(made["share"], ["sweep"])
    ranked = compare.sort_runs(frame, "-accuracy")
    assert ranked["metric.accuracy"].is_monotonic_decreasing
    two_keys = compare.sort_runs(frame, "framework,-param.LR")
    assert list(two_keys["framework"]) == ["keras"] * 3 + ["pytorch"] * 2
    assert list(two_keys["param.LR"][:3]) == [0.1, 0.03, 0.01]
    assert list(compare.sort_runs(frame, "metric.accuracy:desc")["run_id"]) == list(ranked["run_id"])

    assert set(compare.filter_runs(frame, "param.LR=0.1")["param.LR"]) == {0.1}
    assert len(compare.filter_runs(frame, ["LR=0.10", "framework=pytorch"])) == 1
    assert len(compare.filter_runs(frame, "framework=pytorch,keras")) == 5
    assert set(compare.filter_runs(frame, "status!=failed")["status"]) == {"succeeded"}
    good = compare.filter_runs(frame, "metric.accuracy>=0.8")
    assert len(good) and good["metric.accuracy"].ge(0.8).all()
    with pytest.raises(NbbatchError, match="did you mean `param.LR`"):
        compare.filter_runs(frame, "param.LRR=0.1")
    with pytest.raises(NbbatchError, match="cannot read the condition"):
        compare.filter_runs(frame, "just-a-name")

    grouped = compare.group_runs(frame, "framework")
    rows = grouped.set_index("framework")
    assert rows.loc["keras", "runs"] == 3 and rows.loc["keras", "failed"] == 1
    assert rows.loc["pytorch", "succeeded"] == 2
    expected = frame[frame["framework"] == "pytorch"]["metric.accuracy"].mean()
    assert rows.loc["pytorch", "metric.accuracy (mean)"] == pytest.approx(expected)
    by_lr = compare.group_runs(frame, "param.LR", agg="max")
    assert sorted(by_lr["param.LR"]) == [0.01, 0.03, 0.1]


def test_csv_and_json_export_round_trip(made: dict[str, Path], tmp_path: Path) -> None:
    frame = compare.collect(made["share"], ["sweep"])
    csv_path = compare.write_table(frame, tmp_path / "runs.csv")
    json_path = compare.write_table(frame, tmp_path / "runs.json")
    from_csv = compare.read_table(csv_path)
    from_json = compare.read_table(json_path)
    records = json.loads(json_path.read_text())
    assert len(records) == 5 and records[0]["experiment"] == "sweep"
    assert any(r["metric.finished"] is None for r in records)  # missing values are null, not NaN
    for table in (from_csv, from_json):
        assert sorted(table["run_id"]) == sorted(frame["run_id"])
        merged = frame.set_index("run_id")["metric.accuracy"]
        assert table.set_index("run_id")["metric.accuracy"].to_dict() == pytest.approx(merged.to_dict())
    with pytest.raises(NbbatchError, match=".csv or .json"):
        compare.write_table(frame, tmp_path / "runs.xlsx")


def test_check_passes_within_tolerance_and_fails_beyond(made: dict[str, Path], tmp_path: Path) -> None:
    baseline = compare.collect(made["share"], ["sweep"])
    ok = compare.filter_runs(baseline, "status=succeeded")
    assert compare.check(ok, ok, "accuracy").passed
    drift = compare.collect(made["share"], ["drift"])
    result = compare.check(drift, ok, "accuracy", tolerance=0.02)
    assert not result.passed and result.exit_code == 1
    assert result.key == ["framework", "param.LR"]
    outcomes = result.table.set_index(["framework", "param.LR"])["outcome"].to_dict()
    assert outcomes[("pytorch", 0.01)] == "moved" and outcomes[("pytorch", 0.1)] == "moved"
    assert outcomes[("keras", 0.01)] == "not-run"
    assert result.table.loc[result.table["outcome"] == "moved", "delta"].to_list() == pytest.approx([-0.05, -0.05])
    assert compare.check(drift, ok, "accuracy", tolerance=0.06).passed
    assert not compare.check(drift, ok, "accuracy", tolerance=0.06, require_all=True).passed
    assert compare.check(drift, ok, "accuracy", rel_tolerance=0.08).passed  # 0.05 of ~0.8 is ~6 %
    assert compare.check(drift, ok, "accuracy", tolerance=0.02, direction="increase").passed
    assert compare.check(drift, ok, "loss", tolerance=0.02, direction="decrease").passed
    with pytest.raises(NbbatchError, match="no metric `acuracy`"):
        compare.check(drift, ok, "acuracy")


def test_check_cli_exit_status(made: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    share = str(made["share"])
    baseline_csv = compare.write_table(compare.collect(share, ["sweep"]), tmp_path / "baseline.csv")

    def run(*argv: str) -> int:
        return results_commands.cli_check(_parse(results_commands.add_check_arguments, list(argv)))

    assert run("sweep", "--baseline", str(baseline_csv), "--share", share, "--metric", "accuracy",
               "--tolerance", "0.02", "--where", "status=succeeded") == 0
    assert "check passed" in capsys.readouterr().out
    # the failed run fails the check on its own
    assert run("sweep", "--baseline", str(baseline_csv), "--share", share, "--metric", "accuracy") == 1
    out = capsys.readouterr().out
    assert "failed" in out and "check FAILED" in out
    # drift: experiment against experiment, absolute and relative tolerance
    assert run("drift", "--baseline", "sweep", "--share", share, "--metric", "accuracy", "--tolerance", "0.02") == 1
    assert "moved" in capsys.readouterr().out
    assert run("drift", "--baseline", "sweep", "--share", share, "--metric", "accuracy", "--tolerance", "8%",
               "--json", str(tmp_path / "check.json")) == 0
    assert {r["outcome"] for r in json.loads((tmp_path / "check.json").read_text())} == {"ok", "not-run"}
    assert run("drift", "--baseline", str(baseline_csv), "--share", share, "--metric", "accuracy,loss",
               "--tolerance", "0.06", "--require-all") == 1


def test_compare_cli_table_exports_and_report(made: dict[str, Path], tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    args = _parse(results_commands.add_compare_arguments, [
        "sweep", "--share", str(made["share"]), "--where", "status=succeeded", "--sort", "accuracy:desc",
        "--csv", str(tmp_path / "t.csv"), "--json", str(tmp_path / "t.json"), "--report", str(tmp_path / "r.html"),
    ])
    assert results_commands.cli_compare(args) == 0
    out = capsys.readouterr().out
    assert "4 runs" in out and "accuracy" in out and "pytorch" in out
    assert len(compare.read_table(tmp_path / "t.csv")) == 4
    html = (tmp_path / "r.html").read_text()
    # accuracy by framework (the leaders), vs. time, vs. LR; no telemetry series in this share
    assert html.count("data:image/png;base64,") == 3
    grouped = _parse(results_commands.add_compare_arguments, ["sweep", "--share", str(made["share"]), "--group-by",
                                                     "framework", "--json", str(tmp_path / "g.json")])
    assert results_commands.cli_compare(grouped) == 0
    assert {r["framework"]: r["runs"] for r in json.loads((tmp_path / "g.json").read_text())} == \
        {"keras": 3, "pytorch": 2}


def test_plots(made: dict[str, Path]) -> None:
    frame = compare.collect(made["share"], ["sweep"])
    scatter = compare.plot_metric_vs_time(frame)
    assert scatter is not None
    ax = scatter.axes[0]
    assert ax.get_xlabel().startswith("train_seconds") and ax.get_ylabel() == "accuracy"
    assert len(ax.collections) == 2  # one scatter per framework
    sweep = compare.plot_metric_vs_param(frame, param="LR")
    # keras, pytorch, and keras's run given FAIL=True on a line of its own (never joined to the others)
    assert sweep is not None and len(sweep.axes[0].lines) == 3 and sweep.axes[0].get_xlabel() == "LR"
    png = compare.figure_png(sweep)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert compare.plot_gpu_telemetry({}) is None
    assert compare.load_telemetry(frame) == {}


def test_collect_reads_what_submit_writes(project: Path, write_experiment) -> None:
    """End to end with the executor: nbbatch.api.submit runs a sweep, collect reads its share."""
    from support.notebooks import training_notebook

    from nbbatch.api import submit

    training_notebook(project, "pytorch")
    spec = write_experiment("experiment: lr\nnotebooks: [Pytorch_CIFAR.ipynb]\nparameters: {EPOCHS: 1}\n"
                            "sweep: {grid: {LR: [0.01, 0.1], FAIL: [false, true]}}\n")
    result = submit(spec, progress=False)
    assert len(result.records) == 4
    frame = compare.collect(project / "results", "lr")
    assert len(frame) == 4 and set(frame["source"]) == {"run.json"}
    assert frame["status"].value_counts().to_dict() == {"succeeded": 2, "failed": 2}
    assert frame["metric.accuracy"].notna().all()  # the failed runs recorded before failing
    assert sorted(frame["param.LR"]) == [0.01, 0.01, 0.1, 0.1]
    assert frame["error"].dropna().str.contains("diverged").all()
    assert set(frame["framework"]) == {"Pytorch_CIFAR"}  # no framework: known by its notebook
    grouped = compare.group_runs(frame, "param.FAIL").set_index("param.FAIL")
    assert grouped["failed"].to_dict() == {False: 0, True: 2}


def test_wired_into_the_nbbatch_command(made: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """`nbbatch compare | check | diff` through nbbatch.ui.cli.main: exit statuses as CI sees them."""
    from nbbatch.ui.cli import main

    share = str(made["share"])
    assert main(["compare", "sweep", "--share", share, "--group-by", "framework"]) == 0
    assert main(["check", "drift", "--baseline", "sweep", "--share", share, "--metric", "accuracy",
                 "--tolerance", "0.02"]) == 1
    assert main(["check", "drift", "--baseline", "sweep", "--share", share, "--metric", "accuracy",
                 "--tolerance", "0.06"]) == 0
    assert main(["compare", "empty", "--share", share]) == 2  # a clear message, no traceback
    assert "experiment `empty` has no runs" in capsys.readouterr().err
    runs = sorted(p.name for p in (made["share"] / "drift").iterdir())
    assert main(["diff", f"drift/{runs[0]}", f"drift/{runs[1]}", "--share", share]) == 0
    assert "LR:" in capsys.readouterr().out
