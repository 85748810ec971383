"""Metric histories in compare: ``<metric> by step`` figures, GPU telemetry files, --at-step and --history best.

The share is written by hand, as the driver writes it: run.json through the store's record helpers, and
each run's ``metrics.jsonl`` (with a partial last line, and a retry's points) and telemetry series.
"""

from __future__ import annotations

import argparse
import json
import math
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from nbbatch.errors import NbbatchError
from nbbatch.results import compare
from nbbatch.store.layout import METRICS_FILE, TELEMETRY_FILE, run_paths
from nbbatch.store.runfiles import write_record
from nbbatch.store.runjson import RunRecord
from nbbatch.store.share import open_share
from nbbatch.ui import results_commands

pytest.importorskip("pandas")
pytest.importorskip("matplotlib")

EXPERIMENT = "curves"
# (step, attempt, metrics) per run, in the order the lines are appended
HISTORIES: dict[str, list[tuple[int, int, dict[str, float]]]] = {
    # loss is lowest at step 3 and accuracy highest at step 4: best is not last
    "pytorch-lr0.1": [(s, 1, {"loss": loss, "accuracy": acc, **({"lr_final": 0.001} if s == 5 else {})})
                      for s, (loss, acc) in enumerate(
        [(1.0, 0.3), (0.7, 0.5), (0.5, 0.6), (0.42, 0.7), (0.45, 0.75), (0.5, 0.72)])],  # lr_final: one point only
    # attempt 1 died after step 3; attempt 2 resumed at step 2: its points win (0.95 never counts)
    "keras-lr0.01": [(s, 1, {"loss": loss, "accuracy": acc}) for s, (loss, acc) in enumerate(
        [(1.2, 0.2), (0.9, 0.4), (0.8, 0.5), (0.75, 0.95)])]
    + [(s, 2, {"loss": loss, "accuracy": acc}) for s, (loss, acc) in zip(
        range(2, 6), [(0.6, 0.6), (0.5, 0.65), (0.4, 0.7), (0.35, 0.8)], strict=True)],
    # accuracy evaluated every other step only
    "jax-lr0.001": [(s, 1, {"loss": loss, **({"accuracy": (s + 1) / 10} if s % 2 == 0 else {})})
                    for s, loss in enumerate([2.0, 1.5, 1.1, 0.9, 0.8, 0.85])],
}


# how the runs are named in the plots: by what tells them apart (framework, then the swept parameters)
LABELS = {"pytorch-lr0.1": "pytorch, LR=0.1", "keras-lr0.01": "keras, LR=0.01", "jax-lr0.001": "jax, LR=0.001"}


def _point(step: int, attempt: int, metrics: dict[str, float]) -> bytes:
    point = {"step": step, "time": f"2026-11-26T09:40:{step:02d}.000+00:00", "attempt": attempt, **metrics}
    return (json.dumps(point) + "\n").encode()


def _telemetry_lines(gpu: int) -> bytes:
    return b"".join((json.dumps({"t": t, "gpu": gpu, "util_pct": 50.0 + t, "memory_mb": 1000.0 + t,
                                 "power_w": 100.0}) + "\n").encode() for t in range(5))


def _record(run_id: str, experiment: str, metrics: dict[str, Any]) -> RunRecord:
    framework, _, lr = run_id.partition("-lr")
    return RunRecord(run_id=run_id, experiment=experiment, notebook=f"{framework}.ipynb", kernel=f"nbbatch-{framework}",
                     framework=framework, parameters={"LR": float(lr), "EPOCHS": 6}, status="succeeded", attempts=1,
                     duration_s=60.0, metrics=metrics,
                     telemetry={"samples": 5, "gpu_ids": [0], "util_mean_pct": 52.0, "util_max_pct": 54.0})


@pytest.fixture(scope="module")
def share(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("history") / "share"
    opened = open_share(root)
    for gpu, (run_id, points) in enumerate(HISTORIES.items()):
        latest: dict[str, Any] = {"train_seconds": 50.0 + gpu}  # recorded without a step
        for _, _, metrics in points:
            latest.update(metrics)
        write_record(opened, _record(run_id, EXPERIMENT, latest))
        paths = run_paths(EXPERIMENT, run_id)
        data = b"".join(_point(*p) for p in points)
        if run_id == "pytorch-lr0.1":
            data += b'{"step": 6, "time": "2026-11-26T09:41:00.000+00:00", "attempt": 1, "loss": 0.0'  # mid-write
        opened.write_bytes(paths.metrics, data)
        if run_id == "jax-lr0.001":  # a run made before the series was streamed: one JSON document
            samples = [json.loads(line) for line in _telemetry_lines(gpu).splitlines()]
            opened.write_bytes(paths.file("telemetry.json"), json.dumps({"schema_version": 1, "samples": samples}).encode())
        else:
            opened.write_bytes(paths.telemetry, _telemetry_lines(gpu))
    # an older experiment: latest metrics only, no history
    write_record(opened, _record("pytorch-lr0.5", "old", {"loss": 0.3, "accuracy": 0.9}))
    return root


def _step_value(run_id: str, metric: str, at_step: int) -> tuple[int, float]:
    """What --at-step should show, worked out from HISTORIES: the last point ≤ at_step, the latest attempt's."""
    by_step = {s: m for s, _, m in HISTORIES[run_id] if metric in m}  # later lines replace earlier ones
    step = max(s for s in by_step if s <= at_step)
    return step, by_step[step][metric]


class _Figures(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.captions: list[str] = []
        self.images: list[str] = []
        self._in_caption = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "figcaption":
            self._in_caption = True
            self.captions.append("")
        elif tag == "img":
            self.images.append(dict(attrs).get("alt") or "")

    def handle_endtag(self, tag: str) -> None:
        if tag == "figcaption":
            self._in_caption = False

    def handle_data(self, data: str) -> None:
        if self._in_caption:
            self.captions[-1] += data


def _figures(html: str) -> list[str]:
    parser = _Figures()
    parser.feed(html)
    assert not parser.captions  # the title is in each image (its alt text): no caption repeats it
    return [alt.strip() for alt in parser.images]


def _compare(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    results_commands.add_compare_arguments(parser)
    return results_commands.cli_compare(parser.parse_args(list(argv)))


def test_collect_names_the_history_and_telemetry_files(share: Path) -> None:
    frame = compare.collect(share, EXPERIMENT).set_index("run_id")
    assert set(frame["metrics_file"]) == {METRICS_FILE}
    assert frame["telemetry_file"].to_dict() == {"pytorch-lr0.1": TELEMETRY_FILE, "keras-lr0.01": TELEMETRY_FILE,
                                                 "jax-lr0.001": "telemetry.json"}
    assert "metrics_file" in compare.LOCATION_COLUMNS
    assert compare.collect(share, "old")["metrics_file"].isna().all()
    series = compare.load_telemetry(compare.collect(share, EXPERIMENT))
    assert sorted(series) == sorted(LABELS.values()) and all(len(s) == 5 for s in series.values())


def test_report_has_a_figure_per_history_metric_and_gpu_utilisation(share: Path, tmp_path: Path) -> None:
    frame = compare.collect(share, EXPERIMENT)
    html = compare.write_report(frame, tmp_path / "report.html").read_text()
    figures = _figures(html)
    assert "loss by step" in figures and "accuracy by step" in figures
    assert "lr_final by step" not in figures  # one point in every run: no curve to draw
    assert "GPU utilisation over time" in figures
    assert figures.count("loss by step") == 1


def test_metric_by_step_plot_draws_each_run_with_its_latest_attempt(share: Path) -> None:
    histories = compare.load_histories(compare.collect(share, EXPERIMENT))
    assert sorted(histories) == sorted(LABELS.values())
    fig = compare.plot_metric_by_step(histories, "accuracy")
    assert fig is not None
    ax = fig.axes[0]
    assert ax.get_title() == "accuracy by step" and ax.get_xlabel() == "step"
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert sorted(lines) == sorted(LABELS.values())
    assert list(lines[LABELS["keras-lr0.01"]].get_ydata()) == [0.2, 0.4, 0.6, 0.65, 0.7, 0.8]  # attempt 2 from step 2
    assert list(lines[LABELS["jax-lr0.001"]].get_xdata()) == [0, 2, 4]
    assert list(lines[LABELS["pytorch-lr0.1"]].get_xdata()) == [0, 1, 2, 3, 4, 5]  # the half-written step 6 is not
    assert compare.plot_metric_by_step(histories, "lr_final") is None


def test_at_step_shows_each_history_metric_at_that_step(share: Path) -> None:
    frame = compare.select_history(compare.collect(share, EXPERIMENT), at_step=3).set_index("run_id")
    for run_id in HISTORIES:
        for metric in ("loss", "accuracy"):
            step, value = _step_value(run_id, metric, 3)
            assert frame.loc[run_id, f"metric.{metric}"] == pytest.approx(value), (run_id, metric)
            assert frame.loc[run_id, f"step.{metric}"] == step, (run_id, metric)
    assert frame.loc["keras-lr0.01", "metric.loss"] == pytest.approx(0.5)  # the retry's step 3, not 0.75
    assert frame.loc["jax-lr0.001", "step.accuracy"] == 2  # no accuracy at step 3: the one before
    assert frame["metric.train_seconds"].to_dict() == {"pytorch-lr0.1": 50.0, "keras-lr0.01": 51.0,
                                                        "jax-lr0.001": 52.0}  # recorded without a step: unchanged
    columns = list(frame.columns)
    assert columns.index("step.loss") == columns.index("metric.loss") + 1


def test_runs_without_history_show_empty_history_metrics(share: Path) -> None:
    frame = compare.select_history(compare.collect(share), at_step=3).set_index("run_id")
    assert math.isnan(frame.loc["pytorch-lr0.5", "metric.loss"])  # not its latest 0.3: that is no step-3 value
    assert frame.attrs["runs_without_history"] == 1
    before = compare.select_history(compare.collect(share, EXPERIMENT), at_step=0).set_index("run_id")
    assert before.loc["pytorch-lr0.1", "metric.loss"] == pytest.approx(1.0)


def test_history_best_picks_min_loss_max_accuracy_and_the_step(share: Path) -> None:
    frame = compare.select_history(compare.collect(share, EXPERIMENT), history="best").set_index("run_id")
    expected = {  # run: (min loss, its step, max accuracy, its step)
        "pytorch-lr0.1": (0.42, 3, 0.75, 4),
        "keras-lr0.01": (0.35, 5, 0.8, 5),  # attempt 1's 0.95 at step 3 was replaced by the retry
        "jax-lr0.001": (0.8, 4, 0.5, 4),
    }
    for run_id, (loss, loss_step, accuracy, accuracy_step) in expected.items():
        assert frame.loc[run_id, "metric.loss"] == pytest.approx(loss), run_id
        assert frame.loc[run_id, "step.loss"] == loss_step, run_id
        assert frame.loc[run_id, "metric.accuracy"] == pytest.approx(accuracy), run_id
        assert frame.loc[run_id, "step.accuracy"] == accuracy_step, run_id
    assert "min of loss" in frame.attrs["history"] and "max of accuracy" in frame.attrs["history"]
    worst = compare.select_history(compare.collect(share, EXPERIMENT), history="best", best=["accuracy=min"])
    assert worst.set_index("run_id").loc["pytorch-lr0.1", "metric.accuracy"] == pytest.approx(0.3)
    early = compare.select_history(compare.collect(share, EXPERIMENT), history="best", at_step=2)
    assert early.set_index("run_id").loc["pytorch-lr0.1", "step.loss"] == 2
    assert compare.default_best_mode("val_top1_error") == "min" and compare.default_best_mode("bleu") == "max"


def test_compare_cli_at_step_and_best(share: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # wide enough for `step.loss` on one header line (piped: 120)
    assert _compare(EXPERIMENT, "--share", str(share), "--at-step", "3", "--json", str(tmp_path / "t.json"),
                    "--report", str(tmp_path / "r.html")) == 0
    out = capsys.readouterr().out
    assert "step.loss" in out and "value at step 3" in out
    rows = {r["run_id"]: r for r in json.loads((tmp_path / "t.json").read_text())}
    for run_id in HISTORIES:
        assert rows[run_id]["metric.loss"] == pytest.approx(_step_value(run_id, "loss", 3)[1])
        assert rows[run_id]["step.loss"] == 3
    html = (tmp_path / "r.html").read_text()
    assert "value at step 3" in html and "<th>step.loss</th>" in html
    assert _compare(EXPERIMENT, "--share", str(share), "--history", "best", "--best-mode", "accuracy=min",
                    "--sort", "accuracy", "--csv", str(tmp_path / "b.csv")) == 0
    best = compare.read_table(tmp_path / "b.csv")
    assert list(best["run_id"]) == ["jax-lr0.001", "keras-lr0.01", "pytorch-lr0.1"]  # min accuracy 0.1, 0.2, 0.3
    assert list(best["step.accuracy"]) == [0, 0, 0]
    # the default is today's: the latest values, no step columns
    assert _compare(EXPERIMENT, "--share", str(share), "--json", str(tmp_path / "l.json")) == 0
    latest = {r["run_id"]: r for r in json.loads((tmp_path / "l.json").read_text())}
    assert latest["keras-lr0.01"]["metric.accuracy"] == pytest.approx(0.8)
    assert "step.loss" not in latest["keras-lr0.01"]


def test_bad_history_options_say_what_is_wrong(share: Path, capsys: pytest.CaptureFixture[str]) -> None:
    frame = compare.collect(share, EXPERIMENT)
    with pytest.raises(NbbatchError, match=r"--at-step takes a step number ≥ 0 .*not -1"):
        compare.select_history(frame, at_step=-1)
    with pytest.raises(NbbatchError, match="unknown history mode `bset`"):
        compare.select_history(frame, history="bset")
    with pytest.raises(NbbatchError, match="unknown best mode `minimum` for `loss`"):
        compare.select_history(frame, history="best", best=["loss=minimum"])
    with pytest.raises(NbbatchError, match="cannot read the best mode `loss`"):
        compare.select_history(frame, history="best", best="loss")
    with pytest.raises(NbbatchError, match="no history metric `los`.*did you mean `loss`"):
        compare.select_history(frame, history="best", best={"los": "min"})
    with pytest.raises(NbbatchError, match="add --history best"):
        compare.select_history(frame, best=["loss=min"])
    with pytest.raises(NbbatchError, match=r"--at-step 3: none of the 1 runs has a metric history \(metrics.jsonl"):
        compare.select_history(compare.collect(share, "old"), at_step=3)

    from nbbatch.ui.cli import main

    assert main(["compare", EXPERIMENT, "--share", str(share), "--at-step", "-1"]) == 2
    assert "--at-step takes a step number ≥ 0" in capsys.readouterr().err
    assert main(["compare", "old", "--share", str(share), "--history", "best"]) == 2
    assert "--history best: none of the 1 runs has a metric history" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["compare", EXPERIMENT, "--share", str(share), "--history", "first"])
    assert "invalid choice: 'first'" in capsys.readouterr().err
