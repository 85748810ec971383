"""nbbatch.results.diff on notebooks executed for real with papermill."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from support.notebooks import make_run

from nbbatch.errors import NbbatchError
from nbbatch.results import diff
from nbbatch.ui import results_commands

pytest.importorskip("nbdime")

pytestmark = pytest.mark.kernel  # the tests read notebooks executed for real


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("diff")
    share, notebooks = root / "share", root / "notebooks"
    made = {
        "low": make_run(share, "sweep", "pytorch", {"LR": 0.01, "EPOCHS": 2}, notebooks),
        "high": make_run(share, "sweep", "pytorch", {"LR": 0.1, "EPOCHS": 2}, notebooks),
        "fail": make_run(share, "sweep", "keras", {"LR": 0.1, "EPOCHS": 2, "FAIL": True}, notebooks),
        # the same run executed again into another experiment: only execution details differ
        "again": make_run(share, "again", "pytorch", {"LR": 0.01, "EPOCHS": 2}, notebooks),
    }
    made["share"] = share
    return made


def _ref(folder: Path) -> str:
    return f"{folder.parent.name}/{folder.name}"


def test_parameters_metrics_sources_outputs(runs: dict[str, Path]) -> None:
    result = diff.diff_runs(_ref(runs["low"]), _ref(runs["high"])[:-4], share=runs["share"])  # a run id prefix
    assert result.changed_parameters == [("LR", 0.01, 0.1)]
    metrics = {name: (a, b) for name, a, b in result.metrics}
    assert metrics["accuracy"][0] < metrics["accuracy"][1]
    assert not result.identical
    text = result.pretty()
    assert "LR: 0.01 -> 0.1" in text
    assert "accuracy: 0.805051 -> 0.824949  (+0.0199)" in text
    assert "## modified /cells/" in text and "-  LR = 0.01" in text and "+  LR = 0.1" in text  # nbdime's printer
    assert "lr=0.01 accuracy=0.8051" in text and "lr=0.1 accuracy=0.8249" in text  # an output changed
    for volatile in ("start_time", "execution_count", "duration"):
        assert volatile not in text
    assert "\x1b[" not in text and "\x1b[" in result.pretty(color=True)


def test_same_run_executed_twice_is_identical_unless_details(runs: dict[str, Path]) -> None:
    result = diff.diff_runs(runs["low"], runs["again"])  # run folders given as paths
    assert result.identical, result.pretty()
    assert "the notebooks' cells are the same" in result.pretty()
    detailed = diff.diff_runs(runs["low"] / "output.ipynb", runs["again"] / "output.ipynb", details=True)
    assert not detailed.identical  # execution counts and cell ids differ


def test_toggles_leave_out_sources_or_outputs(runs: dict[str, Path]) -> None:
    no_outputs = diff.diff_runs(runs["low"], runs["high"], outputs=False)
    assert "accuracy=0.8051" not in no_outputs.pretty() and "+  LR = 0.1" in no_outputs.pretty()
    no_sources = diff.diff_runs(runs["low"], runs["high"], sources=False)
    assert "+  LR = 0.1" not in no_sources.pretty() and "accuracy=0.8249" in no_sources.pretty()
    with_metadata = diff.diff_runs(runs["low"], runs["high"], metadata=True)
    assert "/metadata/papermill/parameters/LR" in with_metadata.pretty()


def test_html_of_a_failed_run_against_a_good_one(runs: dict[str, Path], tmp_path: Path) -> None:
    result = diff.diff_runs(runs["high"], runs["fail"])
    path = result.write_html(tmp_path / "diff.html")
    html = path.read_text()
    assert html.startswith("<!DOCTYPE html>")
    assert '<tr class="changed"><td>FAIL</td>' in html
    assert "RuntimeError: diverged: loss is nan" in html
    assert 'class="cell modified"' in html and 'class="add"' in html
    assert "<script" not in html and "http" not in html.split("</style>")[0]  # self-contained


def test_bad_references_say_what_exists(runs: dict[str, Path]) -> None:
    share = runs["share"]
    with pytest.raises(NbbatchError, match="no run `nope` in experiment `sweep`.*runs there"):
        diff.load_run_notebook("sweep/nope", share)
    with pytest.raises(NbbatchError, match="no experiment `swep`.*did you mean `sweep`"):
        diff.load_run_notebook("swep/pytorch", share)
    with pytest.raises(NbbatchError, match="matches several runs"):
        diff.load_run_notebook("sweep/pytorch-", share)
    with pytest.raises(NbbatchError, match="neither a notebook file"):
        diff.load_run_notebook("just-a-name", share)


def test_cli(runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    results_commands.add_diff_arguments(parser)
    args = parser.parse_args([_ref(runs["low"]), _ref(runs["fail"]), "--share", str(runs["share"]),
                              "--html", str(tmp_path / "d.html"), "--no-color"])
    assert results_commands.cli_diff(args) == 0
    out = capsys.readouterr().out
    assert "nbbatch diff" in out and "FAIL" in out and "wrote" in out
    assert (tmp_path / "d.html").is_file()
