"""Population-based training's schedule of each member's parameters, recorded and shown (issue 48, item 2): the
report draws each member's parameters by the resource with its exploits marked and has a table per member saying
whom it copied; ``compare --json`` gives each trial its ``schedule``. A search that is no PBT is unchanged.

The share is written by hand, as the PBT driver writes it: each segment an ordinary run whose record's ``trial`` holds
its segment (the generation), rung (``resource``), ``params``, the run it continues and, when it copied another
member, ``exploited``.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
from test_segments_report import SEARCH, TRIALS, _segments, _write

from nbbatch.results import compare
from nbbatch.store.runjson import RunRecord
from nbbatch.ui.cli import main

pytest.importorskip("pandas")
pytest.importorskip("matplotlib")

PBT = {"metric": "accuracy", "mode": "max", "trials": 4, "sampler": "random", "seed": 1, "resource": "EPOCHS",
       "pruner": {"pbt": {"interval": 3, "max_resource": 9, "fraction": 0.25, "perturb": [0.8, 1.2],
                          "resample": 0.25}},
       "params": {"LR": {"loguniform": [1e-4, 1e-1]}, "MOMENTUM": {"uniform": [0.5, 0.99]}}}
RUNGS = (3, 6, 9)
# member → per generation: its params, the member it copied there (None: it continued its own run), its accuracy
MEMBERS: dict[int, list[tuple[dict[str, float], int | None, float]]] = {
    0: [({"LR": 0.01, "MOMENTUM": 0.9}, None, 0.6), ({"LR": 0.01, "MOMENTUM": 0.9}, None, 0.8),
        ({"LR": 0.01, "MOMENTUM": 0.9}, None, 0.9)],
    1: [({"LR": 0.001, "MOMENTUM": 0.6}, None, 0.5), ({"LR": 0.001, "MOMENTUM": 0.6}, None, 0.7),
        ({"LR": 0.001, "MOMENTUM": 0.6}, None, 0.75)],
    # generation 2: copies member 1's generation-1 run, perturbed
    2: [({"LR": 0.05, "MOMENTUM": 0.7}, None, 0.4), ({"LR": 0.05, "MOMENTUM": 0.7}, None, 0.45),
        ({"LR": 0.0012, "MOMENTUM": 0.72}, 1, 0.78)],
    # generation 1: copies member 0's generation-0 run, perturbed
    3: [({"LR": 0.0002, "MOMENTUM": 0.55}, None, 0.2), ({"LR": 0.008, "MOMENTUM": 0.95}, 0, 0.82),
        ({"LR": 0.008, "MOMENTUM": 0.95}, None, 0.85)],
}


def _run_id(member: int, generation: int) -> str:
    return f"pbt-{member}{generation}f00d"


def _population(experiment: str) -> list[tuple[RunRecord, list[dict[str, Any]]]]:
    runs = []
    for member, generations in MEMBERS.items():
        for generation, (params, copied, accuracy) in enumerate(generations):
            rung, last = RUNGS[generation], generation == len(generations) - 1
            continues = _run_id(member if copied is None else copied, generation - 1) if generation else None
            trial = {"study": f"{experiment}/train", "number": member, "segment": generation, "resource": rung,
                     "state": "complete" if last else "continued", "value": accuracy, "params": params,
                     **({"continues": continues} if continues else {}),
                     **({"exploited": {"trial": copied, "run_id": continues}} if copied is not None else {}),
                     **({} if last else {"continued_by": _run_id(member, generation + 1)})}
            record = RunRecord(run_id=_run_id(member, generation), experiment=experiment, notebook="train.ipynb",
                               kernel="python3", framework=None, parameters={**params, "EPOCHS": rung},
                               status="succeeded", attempts=1, duration_s=3.0, metrics={"accuracy": accuracy},
                               trial=trial)
            start = rung - 3
            runs.append((record, [{"step": s, "attempt": 1, "accuracy": accuracy * s / rung}
                                  for s in range(start + 1, rung + 1)]))
    return runs


@pytest.fixture(scope="module")
def share(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(tmp_path_factory.mktemp("pbt") / "share", "pbt", _population("pbt"), PBT)


def _schedule(member: int) -> list[dict[str, Any]]:
    return [{"segment": g, "from": RUNGS[g - 1] if g else 0, "to": RUNGS[g], "params": params,
             "exploited": None if copied is None else {"trial": copied, "run_id": _run_id(copied, g - 1)}}
            for g, (params, copied, _) in enumerate(MEMBERS[member])]


def test_compare_json_gives_each_member_its_schedule(share: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["compare", "pbt", "--share", str(share), "--json", "t.json"]) == 0
    trials = json.loads((tmp_path / "t.json").read_text())["trials"]
    assert [t["trial"] for t in trials] == [0, 1, 2, 3]
    for trial in trials:
        assert trial["run_id"] == _run_id(trial["trial"], 2)
        assert trial["schedule"] == _schedule(trial["trial"]), trial["trial"]


def test_the_report_draws_each_members_parameters_with_its_exploits(share: Path) -> None:
    frame = compare.collect(share, "pbt")
    from nbbatch.results.compare.pbt_plots import plot_pbt_schedule

    fig = plot_pbt_schedule(frame, frame.attrs["search"])
    lr, momentum = fig.axes[:2]
    assert lr.get_yscale() == "log" and momentum.get_yscale() == "linear"  # LR is loguniform
    assert lr.get_xlabel() == "EPOCHS" and lr.get_ylabel() == "LR"
    dashed = [line for line in lr.lines if line.get_linestyle() == "--"]
    # a connector per exploit from the copied member's value where it was copied to the copier's new one
    assert sorted((tuple(line.get_xdata()), tuple(line.get_ydata())) for line in dashed) == [
        ((3, 3), (0.01, 0.008)), ((6, 6), (0.001, 0.0012))]
    steps = [line for line in lr.lines if line.get_linestyle() == "-"]
    assert len(steps) == 4  # one line per member
    # a step per generation; its own line breaks where it copied another member (the connector goes on from that one)
    member_3 = next(line for line in steps if line.get_ydata()[0] == 0.0002)
    assert _gaps(member_3.get_xdata()) == [0, 3, None, 3, 6, 6, 9]
    assert _gaps(member_3.get_ydata()) == [0.0002, 0.0002, None, 0.008, 0.008, 0.008, 0.008]


def _gaps(values: Any) -> list[float | None]:
    """A line's coordinates with its breaks (NaN) as None."""
    return [None if math.isnan(v) else float(v) for v in values]


def test_the_report_shows_the_figure_and_a_table_per_member_saying_whom_it_copied(share: Path) -> None:
    frame = compare.collect(share, "pbt")
    html = compare.render_report(frame, share.parent / "r.html")
    assert re.search(r'<img src="data:image/png;base64,[^"]+" alt="population-based training: each member(&#39;|\')s '
                     r'parameters by EPOCHS"', html)
    tables = dict(re.findall(r'<table class="pbt">\s*<caption>trial (\d)(.*?)</table>', html, re.S))
    assert list(tables) == ["0", "3", "2", "1"]  # best first
    copied = {trial: re.findall(r'<tr class="copied"><td class="num">(\d)</td>.*?<td>(trial \d \(run [\w-]+\))</td>',
                                text, re.S) for trial, text in tables.items()}
    assert copied == {"0": [], "1": [], "2": [("2", f"trial 1 (run {_run_id(1, 1)})")],
                      "3": [("1", f"trial 0 (run {_run_id(0, 0)})")]}
    assert "6–9" in tables["2"] and "0.0012" in tables["2"]


def test_a_search_that_is_no_pbt_is_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = []
    for number, segments in TRIALS.items():
        runs += _segments("asha", number, segments, {"LR": 10.0 ** -(number + 1), "MOMENTUM": 0.3 * number})
    root = _write(tmp_path / "share", "asha", runs, {**SEARCH, "resource": "EPOCHS",
                                                     "pruner": {"asha": {"min_resource": 1}}})
    frame = compare.collect(root, "asha")
    assert not {"resource", "exploited", "exploited_run"} & set(frame.columns)
    assert frame.attrs["search"] == {"metric": "accuracy", "mode": "max", "params": SEARCH["params"]}
    html = compare.render_report(frame, tmp_path / "r.html")
    assert "population-based training" not in html.lower() and 'class="pbt"' not in html
    monkeypatch.chdir(tmp_path)
    assert main(["compare", "asha", "--share", str(root), "--json", "t.json"]) == 0
    assert not any("schedule" in t for t in json.loads((tmp_path / "t.json").read_text())["trials"])
