"""The report never misleads (issue 46, items 1–4): every plotted point of a grid is a value some run reached,
a search is a scatter, parameters print short, learning curves are named by what the runs differ in, and
``compare`` and ``status`` show the runs alike.

The shares are written by hand, as the driver writes them (run.json through the store's record helpers).
"""

from __future__ import annotations

import json
import re
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from nbbatch.errors import NbbatchError
from nbbatch.results import compare
from nbbatch.results.status import status_table, status_view
from nbbatch.store.layout import run_paths
from nbbatch.store.runfiles import write_record
from nbbatch.store.runjson import RunRecord
from nbbatch.store.share import open_share

pytest.importorskip("pandas")
pytest.importorskip("matplotlib")

# accuracy on a C × PENALTY grid: at C=0.01 the two penalties are far apart (their mean, 0.483, no run reached)
GRID = {(0.01, "l1"): 0.083, (0.01, "l2"): 0.883, (0.1, "l1"): 0.71, (0.1, "l2"): 0.9, (1.0, "l1"): 0.93,
        (1.0, "l2"): 0.91}


def _record(experiment: str, index: int, parameters: dict[str, Any], metrics: dict[str, Any],
            framework: str | None = "sklearn", **extra: Any) -> RunRecord:
    notebook = f"{framework or 'Train'}.ipynb"
    return RunRecord(run_id=f"{(framework or 'train').lower()}-{index:04x}a1b2c3", experiment=experiment,
                     notebook=notebook, kernel=f"nbbatch-{framework}" if framework else "python3",
                     framework=framework, parameters=parameters, status="succeeded", attempts=1,
                     duration_s=10.0 + index, metrics=metrics, **extra)


def _write(root: Path, records: list[RunRecord], histories: dict[str, list[dict[str, Any]]] | None = None) -> None:
    share = open_share(root)
    for record in records:
        write_record(share, record)
        points = (histories or {}).get(record.run_id)
        if points:
            share.write_bytes(run_paths(record.experiment, record.run_id).metrics,
                              b"".join((json.dumps(p) + "\n").encode() for p in points))


@pytest.fixture(scope="module")
def share(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("truth") / "share"
    grid = [_record("grid", i, {"C": c, "PENALTY": penalty, "SEED": 0}, {"accuracy": acc})
            for i, ((c, penalty), acc) in enumerate(GRID.items())]
    # 12 runs: LR × BATCH, each with a learning curve
    curves, histories = [], {}
    for i, (lr, batch) in enumerate((lr, b) for lr in (0.001, 0.01, 0.1) for b in (16, 32, 64, 128)):
        record = _record("curves", i, {"LR": lr, "BATCH": batch, "EPOCHS": 3}, {"loss": 1 / (i + 2)},
                         framework="pytorch")
        curves.append(record)
        histories[record.run_id] = [{"step": s, "attempt": 1, "loss": 1 / (i + 2 + s)} for s in range(3)]
    # one plain notebook, run twice alike (nothing tells the runs apart)
    plain = [_record("plain", i, {"N": 10}, {"accuracy": 0.5 + i / 10, "train_seconds": 3.0 + i}, framework=None)
             for i in range(2)]
    for record in plain:
        histories[record.run_id] = [{"step": s, "attempt": 1, "loss": 1 / (s + 1)} for s in range(3)]
    # a search on ALPHA × DEPTH: trial 3 is the best
    search = [_record("search", i, {"ALPHA": alpha, "DEPTH": depth}, {"loss": loss},
                      trial={"number": i, "state": "complete"})
              for i, (alpha, depth, loss) in enumerate([(0.05, 3, 0.4), (0.0003, 5, 0.3), (0.01, 2, 0.5),
                                                        (0.001304907355036239, 4, 0.1), (0.2, 6, 0.6)])]
    # the nine frameworks once each (the demo)
    demo = [_record("demo", i, {"DATASET": "digits"}, {"accuracy": acc, "train_seconds": 5.0 + i}, framework=fw)
            for i, (fw, acc) in enumerate([("chainer", 0.91), ("gluon", 0.95), ("jax-flax", 0.97), ("keras-jax", 0.93),
                                           ("keras-tf", 0.96), ("lightning", 0.98), ("mxnet", 0.9),
                                           ("pytorch", 0.975), ("tensorflow", 0.94)])]
    _write(root, [*grid, *curves, *plain, *search, *demo], histories)
    (root / "search" / "experiment.json").write_text(json.dumps(
        {"runs": [r.run_id for r in search], "search": {"metric": "loss", "mode": "min"}}))
    return root


def _lines(fig) -> list:
    return [line for ax in fig.axes for line in ax.lines if len(line.get_xdata())]


# -- 1: the metric vs. a swept parameter of a grid --------------------------------------------------------------
def test_grid_plot_draws_only_values_runs_reached_one_series_per_other_parameter(share: Path) -> None:
    frame = compare.collect(share, "grid")
    fig = compare.plot_metric_vs_param(frame, param="C")
    lines = _lines(fig)
    assert len(lines) == 2  # one per PENALTY
    reached = set(GRID.items())
    for line in lines:
        penalty = re.fullmatch(r"PENALTY=(\w+)", line.get_label())
        assert penalty, line.get_label()  # labelled by the other swept parameter
        for c, accuracy in zip(line.get_xdata(), line.get_ydata(), strict=True):
            assert ((float(c), penalty.group(1)), float(accuracy)) in reached  # never 0.483


def test_grid_with_many_combinations_shows_a_labelled_median_and_its_spread(tmp_path: Path) -> None:
    records = [_record("wide", i, {"LR": lr, "A": a, "B": b}, {"accuracy": (i % 7) / 10})
               for i, (lr, a, b) in enumerate((lr, a, b) for lr in (0.01, 0.1) for a in range(4) for b in range(4))]
    _write(tmp_path, records)
    fig = compare.plot_metric_vs_param(compare.collect(tmp_path, "wide"), param="LR")
    ax = fig.axes[0]
    (median,) = [line for line in ax.lines if "median" in line.get_label()]
    assert "A, B" in median.get_label() and "min–max" in median.get_label()
    assert ax.collections, "the spread (a band) and every run (dots) are drawn"
    assert "median" in ax.get_title()


def test_a_parameter_only_some_runs_have_splits_their_series_and_shows_in_the_table(tmp_path: Path) -> None:
    """A run given FAIL=True (the others have no FAIL) is no point on the others' line: it is its own series."""
    records = [_record("part", i, {"LR": lr}, {"accuracy": 0.7 + i / 100}) for i, lr in enumerate((0.003, 0.03, 0.3))]
    records.append(_record("part", 3, {"LR": 0.1, "FAIL": True}, {"accuracy": 0.2}))
    _write(tmp_path, records)
    frame = compare.collect(tmp_path, "part")
    assert compare.swept_parameters(frame) == ["param.LR", "param.FAIL"]  # the one every run has is the x axis
    assert "param.FAIL" in compare.display_columns(frame)  # as status shows it
    lines = {line.get_label(): list(line.get_xdata()) for line in _lines(compare.plot_metric_vs_param(frame))}
    assert lines == {"FAIL=(unset)": [0.003, 0.03, 0.3], "FAIL=True": [0.1]}


# -- 2: a search --------------------------------------------------------------------------------------------------
def test_search_metric_vs_parameter_is_a_scatter_coloured_by_trial(share: Path) -> None:
    frame = compare.collect(share, "search")
    fig = compare.plot_metric_vs_param(frame)
    assert not _lines(fig), "no line joins trials"
    from matplotlib.collections import PathCollection

    scatters = [c for ax in fig.axes for c in ax.collections if isinstance(c, PathCollection)]
    assert scatters and all(len(c.get_offsets()) == 5 for c in scatters)
    assert any(ax.get_ylabel() == "trial" or ax.get_xlabel() == "trial" for ax in fig.axes), "a colour bar: trial"
    assert {ax.get_xlabel() for ax in fig.axes} >= {"ALPHA", "DEPTH"}
    assert fig.axes[0].get_ylabel() == "loss"  # the searched metric, not the first one found


def test_best_parameters_print_to_4_significant_digits(share: Path, tmp_path: Path) -> None:
    from nbbatch.drivers.notify import best_line

    frame = compare.collect(share, "search")
    html = compare.render_report(frame, tmp_path / "r.html")
    assert "ALPHA=0.001305" in html and "0.00130490" not in html
    records = [RunRecord.from_json((p / "run.json").read_bytes()) for p in (share / "search").iterdir() if p.is_dir()]
    line = best_line(records, "loss", "min")
    assert "ALPHA=0.001305" in line and "0.00130490" not in line


# -- 3: learning curves, captions, the demo ------------------------------------------------------------------------
def test_learning_curves_named_by_parameters_distinct_styles_legend_outside(share: Path) -> None:
    frame = compare.collect(share, "curves")
    histories = compare.load_histories(frame)
    assert set(histories) == {f"BATCH={b}, LR={lr}" for lr in (0.001, 0.01, 0.1) for b in (16, 32, 64, 128)}
    fig = compare.plot_metric_by_step(histories, "loss")
    lines = _lines(fig)
    assert len(lines) == 12
    assert len({(line.get_color(), line.get_linestyle()) for line in lines}) == 12
    fig.canvas.draw()
    ax = fig.axes[0]
    legend, axes_box = ax.get_legend().get_window_extent(), ax.get_window_extent()
    assert legend.x0 >= axes_box.x1 or legend.y1 <= axes_box.y0, "the legend is outside the axes"


def test_learning_curves_fall_back_to_run_ids_when_nothing_differs(share: Path) -> None:
    frame = compare.collect(share, "plain")
    assert set(compare.load_histories(frame)) == set(frame["run_id"])


def test_single_plain_notebook_has_no_by_framework_legend(share: Path) -> None:
    fig = compare.plot_metric_vs_time(compare.collect(share, "plain"))
    ax = fig.axes[0]
    assert ax.get_legend() is None and "framework" not in ax.get_title()


def test_report_captions_do_not_repeat_titles_and_demo_leads_with_accuracy_by_framework(share: Path,
                                                                                     tmp_path: Path) -> None:
    frame = compare.collect(share, "demo")
    html = compare.render_report(frame, tmp_path / "r.html")
    titles = re.findall(r'alt="([^"]*)"', html)
    for title in titles:
        assert f"<figcaption>{title}</figcaption>" not in html
    leaders = re.search(r'<table class="leaders">(.*?)</table>', html, re.S)
    assert leaders and html.index('class="leaders"') < html.index("<img")  # first thing after the summary
    names = re.findall(r'<td class="framework">([^<]*)</td>', leaders.group(1))
    assert names == ["lightning", "pytorch", "jax-flax", "keras-tf", "gluon", "tensorflow", "keras-jax", "chainer",
                     "mxnet"]
    assert titles[0] == "accuracy by framework"


def test_leaders_are_runs_that_succeeded(share: Path) -> None:
    frame = compare.collect(share, "demo")
    frame.loc[frame["framework"] == "lightning", "status"] = "failed"  # its 0.98 is where it stopped
    assert [row["name"] for row in compare.leaders(frame)][:2] == ["pytorch", "jax-flax"]


# -- 4: compare and status agree -------------------------------------------------------------------------------------
def _render(table: Any) -> str:
    out = StringIO()
    Console(file=out, width=160, color_system=None).print(table)
    return out.getvalue()


def test_compare_and_status_same_rows_same_headers(share: Path) -> None:
    frame = compare.collect(share, "grid")
    compare_text = _render(compare.runs_table(frame))
    records = status_view(open_share(share), "grid").records
    status_text = _render(status_table(records, title="grid"))
    for text in (compare_text, status_text):
        header = next(line for line in text.splitlines() if "PENALTY" in line)
        assert "param." not in header and re.search(r"\bC\b", header)
        assert "rows by C, PENALTY" in text  # the order, said

    def order(text: str) -> list[str]:
        return re.findall(r"sklearn-[0-9a-f]+", text)

    assert order(compare_text) == order(status_text) == [r.run_id for r in sorted(
        records, key=lambda r: (r.parameters["C"], r.parameters["PENALTY"]))]


def test_search_rows_best_first_in_compare_and_status(share: Path) -> None:
    from nbbatch.results.status import search_of

    frame = compare.sort_search(compare.collect(share, "search"), {"metric": "loss", "mode": "min"})
    compare_text = _render(compare.runs_table(frame))
    records = status_view(open_share(share), "search").records
    status_text = _render(status_table(records, title="search", search=search_of(open_share(share), "search")))
    ids = [re.findall(r"sklearn-[0-9a-f]+", t) for t in (compare_text, status_text)]
    assert ids[0] == ids[1] == list(frame["run_id"])
    assert "rows by loss, lowest first" in compare_text and "rows by loss, lowest first" in status_text


def test_misspelt_experiment_same_did_you_mean(share: Path) -> None:
    with pytest.raises(NbbatchError) as by_compare:
        compare.collect(share, "gird")
    with pytest.raises(NbbatchError) as by_status:
        status_view(open_share(share), "gird")
    assert "did you mean `grid`" in str(by_compare.value)
    assert str(by_status.value) == str(by_compare.value)



def test_a_pipeline_reports_each_stage_as_a_report_does(share: Path, tmp_path: Path) -> None:
    """Each stage of a pipeline's report is the same body: its leaders, its best run's parameters rounded."""
    from nbbatch.results.compare.pipeline_report import render_pipeline_report
    from nbbatch.store.layout import experiment_paths

    opened = open_share(share)
    stages = {"train": {"experiment": "demo", "state": "succeeded", "runs": []},
              "tune": {"experiment": "search", "state": "succeeded", "runs": []}}
    opened.write_bytes(experiment_paths("study").pipeline_state,
                       json.dumps({"pipeline": "study", "state": "succeeded", "stages": stages}).encode())
    html = render_pipeline_report(opened, "study", tmp_path / "r.html")
    assert html.count('<table class="leaders">') == 1 and "ALPHA=0.001305" in html
