"""A search's trial continued from its checkpoints over several runs (issue 48, item 1): its segments are one row each
in the runs table, one trial in every view of the trials (best, value by trial, importance, the JSON's trials), one
curve in the report, and ``trial·segment`` in ``status``.

The shares are written by hand, as the search driver writes them: each segment an ordinary run whose record's
``trial`` says its segment, its rung (``resource``), the run it continues and the trial's state there.
"""

from __future__ import annotations

import json
import random
import re
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from nbbatch.results import compare
from nbbatch.results.compare.importance import parameter_importance
from nbbatch.results.status import search_of, status_table, status_view
from nbbatch.store.layout import run_paths
from nbbatch.store.runfiles import write_record
from nbbatch.store.runjson import RunRecord
from nbbatch.store.share import open_share
from nbbatch.ui.cli import main

pytest.importorskip("pandas")
pytest.importorskip("matplotlib")

SEARCH = {"metric": "accuracy", "mode": "max",
          "params": {"LR": {"loguniform": [1e-4, 1e-1]}, "MOMENTUM": {"uniform": [0.0, 0.99]}}}
# trial → its segments: (last step, the trial's state there, its run's status, accuracy at that step)
TRIALS = {
    0: [(3, "promoted", "succeeded", 0.6), (9, "promoted", "succeeded", 0.8), (27, "complete", "succeeded", 0.95)],
    # its first segment's value is above the best trial's: a trial's value is its latest segment's
    1: [(1, "promoted", "succeeded", 0.97), (3, "pruned", "pruned", 0.7)],
    2: [(1, "pruned", "succeeded", 0.3)],
}


def _run_id(number: int, segment: int) -> str:
    return f"train-{number:02d}{segment}a1b2c3"


def _segments(experiment: str, number: int, segments: list[tuple[int, str, str, float]],
              parameters: dict[str, Any]) -> list[tuple[RunRecord, list[dict[str, Any]]]]:
    """A trial's runs, each with the history it recorded (only the steps after the previous segment's)."""
    runs, first = [], 1
    for segment, (rung, state, status, accuracy) in enumerate(segments):
        trial = {"study": f"{experiment}/train", "number": number, "segment": segment, "resource": rung,
                 "state": state, "value": accuracy,
                 **({"continues": _run_id(number, segment - 1)} if segment else {}),
                 **({"continued_by": _run_id(number, segment + 1)} if state == "promoted" else {})}
        record = RunRecord(run_id=_run_id(number, segment), experiment=experiment, notebook="train.ipynb",
                           kernel="python3", framework=None, parameters=parameters, status=status, attempts=1,
                           duration_s=float(rung - first + 1), metrics={"accuracy": accuracy}, trial=trial)
        points = [{"step": s, "attempt": 1, "accuracy": accuracy * s / rung, "loss": 1.0 / s}
                  for s in range(first, rung + 1)]
        runs.append((record, points))
        first = rung + 1
    return runs


def _write(root: Path, experiment: str, runs: list[tuple[RunRecord, list[dict[str, Any]]]],
           search: dict[str, Any] = SEARCH) -> Path:
    share = open_share(root)
    for record, points in runs:
        write_record(share, record)
        share.write_bytes(run_paths(experiment, record.run_id).metrics,
                          b"".join((json.dumps(p) + "\n").encode() for p in points))
    (root / experiment / "experiment.json").write_text(json.dumps(
        {"runs": [r.run_id for r, _ in runs], "search": search}))
    return root


@pytest.fixture(scope="module")
def share(tmp_path_factory: pytest.TempPathFactory) -> Path:
    runs = []
    for number, segments in TRIALS.items():
        runs += _segments("asha", number, segments, {"LR": 10.0 ** -(number + 1), "MOMENTUM": 0.3 * number})
    return _write(tmp_path_factory.mktemp("segments") / "share", "asha", runs)


def _render(table: Any) -> str:
    out = StringIO()
    Console(file=out, width=160, color_system=None).print(table)
    return out.getvalue()


def test_the_table_keeps_a_row_per_run_with_its_segment(share: Path) -> None:
    frame = compare.collect(share, "asha")
    assert len(frame) == 6
    rows = {(int(t), int(s)): row for (_, row), t, s in zip(frame.iterrows(), frame["trial"], frame["segment"],
                                                             strict=True)}
    assert set(rows) == {(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0)}
    assert rows[(0, 1)]["trial_state"] == "promoted" and rows[(0, 2)]["trial_state"] == "complete"
    # a trial stopped at a rung: pruned there (not at a step it never ran to), and only the trial's last segment
    assert rows[(1, 1)]["pruned_at"] == 3 and rows[(2, 0)]["pruned_at"] == 1
    assert frame["pruned_at"].notna().sum() == 2
    assert {"trial", "segment", "trial_state"} <= set(compare.display_columns(frame))


def test_every_view_of_the_trials_counts_each_trial_once_at_its_latest_segment(share: Path) -> None:
    frame = compare.collect(share, "asha")
    trials = compare.trials_of(frame)
    assert sorted(int(t) for t in trials["trial"]) == [0, 1, 2]
    by_trial = {int(row["trial"]): row for _, row in trials.iterrows()}
    assert {n: (row["run_id"], row["status"], row["metric.accuracy"]) for n, row in by_trial.items()} == {
        0: (_run_id(0, 2), "succeeded", 0.95), 1: (_run_id(1, 1), "pruned", 0.7), 2: (_run_id(2, 0), "pruned", 0.3)}
    best = compare.best_trial(frame, frame.attrs["search"])
    assert best == {"run_id": _run_id(0, 2), "trial": 0, "value": 0.95, "parameters": {"LR": 0.1, "MOMENTUM": 0.0}}

    from nbbatch.results.compare.search_plots import plot_best_by_trial

    fig = plot_best_by_trial(frame, frame.attrs["search"])
    points = {c.get_label(): sorted(map(tuple, c.get_offsets().tolist())) for c in fig.axes[0].collections}
    assert points == {"finished": [(0.0, 0.95)], "pruned (last value)": [(1.0, 0.7), (2.0, 0.3)]}
    scatter = compare.plot_trials(frame)  # the metric against the parameters: a dot per trial
    assert sum(len(c.get_offsets()) for c in scatter.axes[0].collections) == 3


def test_a_trials_segments_are_one_curve(share: Path) -> None:
    frame = compare.collect(share, "asha")
    histories = compare.load_histories(frame)
    assert len(histories) == 3  # one per trial, not one per run
    (joined,) = [points for points in histories.values() if len(points) > 5]
    assert [p["step"] for p in joined] == list(range(1, 28))
    from nbbatch.results.compare.search_plots import plot_trial_curves

    curves = plot_trial_curves(frame, histories, frame.attrs["search"])
    lines = sorted((list(line.get_xdata()) for line in curves.axes[0].lines), key=len)
    assert lines == [[1], [1, 2, 3], list(range(1, 28))]
    by_step = compare.plot_metric_by_step(histories, "loss")  # the report's other history figures: alike
    assert len(by_step.axes[0].get_legend().get_texts()) == 3
    html = compare.render_report(frame, share.parent / "r.html")
    assert "3 trials in 6 runs" in html


def test_compare_json_says_the_trials_and_the_best(share: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["compare", "asha", "--share", str(share), "--json", "t.json"]) == 0
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["trials"] == [
        {"trial": 0, "state": "complete", "value": 0.95, "run_id": _run_id(0, 2),
         "segments": [_run_id(0, 0), _run_id(0, 1), _run_id(0, 2)]},
        {"trial": 1, "state": "pruned", "value": 0.7, "run_id": _run_id(1, 1), "segments": [_run_id(1, 0),
                                                                                          _run_id(1, 1)]},
        {"trial": 2, "state": "pruned", "value": 0.3, "run_id": _run_id(2, 0), "segments": [_run_id(2, 0)]}]
    assert data["best"]["trial"] == 0 and data["best"]["run_id"] == _run_id(0, 2)
    assert len(data["runs"]) == 6
    # the runs best first by their trial's value, each trial's segments together and in order
    assert [r["run_id"] for r in data["runs"]] == [_run_id(0, 0), _run_id(0, 1), _run_id(0, 2), _run_id(1, 0),
                                                   _run_id(1, 1), _run_id(2, 0)]


def test_status_shows_each_run_as_trial_and_segment_in_compares_order(share: Path) -> None:
    records = status_view(open_share(share), "asha").records
    text = _render(status_table(records, title="asha", search=search_of(open_share(share), "asha")))
    assert "trial·segment" in text
    rows = {m.group(1): line for line in text.splitlines() if (m := re.search(r"(train-\w+)", line))}
    assert re.search(r"promoted at step 3\s+0·0\s", rows[_run_id(0, 0)])
    assert re.search(r"succeeded\s+0·2\s+0\.95", rows[_run_id(0, 2)])
    assert re.search(r"pruned at step 3\s+1·1\s", rows[_run_id(1, 1)])
    assert re.search(r"pruned at step 1\s+2·0\s", rows[_run_id(2, 0)])
    frame = compare.sort_search(compare.collect(share, "asha"), SEARCH)
    assert list(rows) == list(frame["run_id"])  # compare's order: best trial first, its segments in order


def test_a_paused_trial_says_so_and_does_not_count_as_finished(tmp_path: Path) -> None:
    runs = _segments("open", 0, [(3, "promoted", "succeeded", 0.6), (9, "complete", "succeeded", 0.8)],
                     {"LR": 0.01, "MOMENTUM": 0.1})
    runs += _segments("open", 1, [(3, "paused", "succeeded", 0.9)], {"LR": 0.001, "MOMENTUM": 0.5})
    root = _write(tmp_path / "share", "open", runs)
    records = status_view(open_share(root), "open").records
    assert "paused at step 3" in _render(status_table(records, search=search_of(open_share(root), "open")))
    frame = compare.collect(root, "open")
    assert compare.best_trial(frame, SEARCH)["trial"] == 0  # 0.9 is where the paused trial waits, no result
    assert [t["state"] for t in compare.trials_summary(frame, "accuracy")] == ["complete", "paused"]
    html = compare.render_report(frame, tmp_path / "r.html")
    assert "1 trial(s) paused at a rung" in html


def test_importance_counts_each_completed_trial_once(tmp_path: Path) -> None:
    pytest.importorskip("optuna")
    rng, runs = random.Random(2), []
    for number in range(16):
        lr, momentum = 10 ** rng.uniform(-4, -1), rng.uniform(0, 0.99)
        accuracy = 1 - abs(__import__("math").log10(lr) + 2) / 3
        # its first segment's accuracy says nothing of LR: only the complete trials' last values may count
        runs += _segments("imp", number, [(3, "promoted", "succeeded", rng.uniform(0, 1)),
                                          (9, "complete", "succeeded", accuracy)], {"LR": lr, "MOMENTUM": momentum})
    frame = compare.collect(_write(tmp_path / "share", "imp", runs), "imp")
    importance = parameter_importance(frame)
    assert importance is not None and importance["trials"] == 16
    assert list(importance["parameters"])[0] == "LR"


def test_a_search_without_segments_has_no_segment_columns(tmp_path: Path) -> None:
    share = open_share(tmp_path / "share")
    for number in range(3):
        write_record(share, RunRecord(run_id=_run_id(number, 0), experiment="plain", notebook="train.ipynb",
                                      kernel="python3", parameters={"LR": 0.1 * (number + 1)}, status="succeeded",
                                      metrics={"accuracy": 0.5}, trial={"number": number, "state": "complete"}))
    frame = compare.collect(tmp_path / "share", "plain")
    assert not {"segment", "trial_state"} & set(frame.columns)
    assert compare.latest_segments(frame) is frame
    records = status_view(share, "plain").records
    text = _render(status_table(records, search={"metric": "accuracy", "mode": "max"}))
    assert "trial·segment" not in text and "·" not in text


def test_check_measures_a_continued_trial_by_its_latest_segment(share: Path) -> None:
    """`check` matches runs on their parameters: a trial's segments share them, and only its latest segment's value
    is a measurement (the others stopped at a rung), never their mean."""
    frame = compare.collect(share, "asha")
    result = compare.check(frame, frame, "accuracy")
    measured = result.table[result.table["current"].notna()]
    assert list(measured["current"]) == [0.95] and list(measured["baseline"]) == [0.95]
    assert result.passed


def test_the_pareto_front_holds_trials_by_their_latest_segment(tmp_path: Path) -> None:
    """A segment that stopped early at a rung (high accuracy, little time) would dominate every trial; the front is
    of the trials as they ended, and every segment of a trial on it is marked so."""
    objectives = {"metric": ["accuracy", "train_seconds"], "mode": ["max", "min"]}
    runs = _segments("front", 0, [(3, "promoted", "succeeded", 0.99), (9, "complete", "succeeded", 0.9)],
                     {"LR": 0.01, "MOMENTUM": 0.1})
    runs += _segments("front", 1, [(9, "complete", "succeeded", 0.8)], {"LR": 0.001, "MOMENTUM": 0.5})
    for record, _ in runs:
        record.metrics["train_seconds"] = {0.99: 1.0, 0.9: 10.0, 0.8: 5.0}[record.metrics["accuracy"]]
    frame = compare.collect(_write(tmp_path / "share", "front", runs, objectives), "front")
    assert frame["pareto"].tolist() == [True, True, True]
    html = compare.render_report(frame, tmp_path / "r.html")
    assert re.search(r"2 trial\(s\) on the Pareto front .*?trial 0, 1;", html, re.S)


def test_a_stages_best_run_is_a_trial_that_completed_not_a_segment_stopped_at_a_rung(share: Path) -> None:
    """``${train.best…}`` and the end-of-search notice read the best run: trial 1's first segment has the highest
    accuracy, but it stopped at its first rung (promoted, then pruned); trial 0's last segment is the result."""
    from nbbatch.drivers.notify import best_line
    from nbbatch.results.pipeline import best_record
    from nbbatch.spec.pipeline import Select

    records = status_view(open_share(share), "asha").records
    best = best_record(records, Select("accuracy", "max"))
    assert best is not None and best.run_id == _run_id(0, 2)
    assert _run_id(0, 2) in (best_line(records, "accuracy", "max") or "")
