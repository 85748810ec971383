"""``nbbatch plan`` of a partly run experiment says which runs ``submit`` will skip, by submit's own rule, reading the
share only; ``plan`` of a search shows the trials it will draw, not run ids that will never exist (issue 46 item 11)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from support.notebooks import LOSS_CURVE, SEARCH, make_notebook
from support.records import write_records

from nbbatch.store.runjson import RunError, RunRecord
from nbbatch.ui.cli import main

pytestmark = pytest.mark.timeout(120)


def _files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in sorted(root.rglob("*"))}


def _plan_json(capsys: pytest.CaptureFixture[str], exp: Path) -> list[dict]:
    assert main(["plan", str(exp), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_of_a_partly_run_experiment_says_which_runs_submit_will_skip(project, write_experiment, capsys):
    make_notebook(project / "nb.ipynb", ["print(A)"])
    exp = write_experiment("experiment: e\nnotebooks: [nb.ipynb]\nsweep: {grid: {A: [1, 2, 3, 4]}}\n")
    runs = _plan_json(capsys, exp)
    assert not any(r["skip"] for r in runs)
    assert not (project / "results").exists()  # a share that does not exist yet: nothing skipped, nothing made
    ids = [r["run_id"] for r in runs]
    base = {"experiment": "e", "notebook": "nb.ipynb", "kernel": "python3", "attempts": 1}
    records = [RunRecord(run_id=ids[0], parameters={"A": 1}, status="succeeded", **base),  # skipped
               RunRecord(run_id=ids[1], parameters={"A": 2}, status="succeeded", **base),  # its notebook is gone
               RunRecord(run_id=ids[2], parameters={"A": 3}, status="failed", error=RunError("ValueError", "x"),
                         **base)]
    write_records(project / "results", records)
    (project / "results" / "e" / ids[0] / "output.ipynb").write_text("{}")
    before = _files(project / "results")

    runs = _plan_json(capsys, exp)
    assert [r["skip"] for r in runs] == [True, False, False, False]
    assert main(["plan", str(exp)]) == 0
    out = capsys.readouterr().out
    assert "submit will skip 1 run(s) that already succeeded (--force reruns them)" in " ".join(out.split())
    skipped_row = next(line for line in out.splitlines() if line.startswith(ids[0]))
    assert "skip" in skipped_row
    assert not any("skip" in line for line in out.splitlines() if line.startswith(tuple(ids[1:])))
    assert _files(project / "results") == before  # read only


def test_plan_of_a_search_shows_the_trials_to_draw_not_run_ids(project, write_experiment, capsys):
    make_notebook(project / "nb.ipynb", [LOSS_CURVE], parameters="LR = 0.1\nEPOCHS = 12\nPAUSE = 0.3")
    exp = write_experiment(json.dumps({"experiment": "lr", "notebooks": ["nb.ipynb"], "search": SEARCH}))
    studies = _plan_json(capsys, exp)
    assert [(s["study"], s["trials_on_share"], s["search"]["trials"]) for s in studies] == [("lr/nb", 0, 6)]
    assert "run_id" not in studies[0]  # a run that will never exist
    assert main(["plan", str(exp)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert not re.search(r"nb-[0-9a-f]{10}", out), out
    for said in ("minimising loss", "LR loguniform [0.0001, 1.0]", "sampler random (seed 3)", "pruner median",
                 "nb.ipynb", "no trials yet: submit draws up to 6"):
        assert said in out, (said, out)
    trials = [RunRecord(run_id=f"nb-{n}a2b3c4d5e", experiment="lr", notebook="nb.ipynb", kernel="python3",
                        parameters={"LR": 0.1 / (n + 1)}, status="succeeded", attempts=1, metrics={"loss": 1.0},
                        trial={"study": "lr/nb", "number": n, "state": "complete"}) for n in range(2)]
    write_records(project / "results", trials)
    assert main(["plan", str(exp)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "2 of 6 trials on the share: submit draws up to 4 more" in out, out
