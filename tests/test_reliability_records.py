"""Damaged records and the commands that read every record (issue 45): one damaged ``run.json`` never stops the
others, and each is named with its file."""

from __future__ import annotations

import json

import pytest
from support.records import two_runs, write_records

from nbbatch.store.layout import RUN_RECORD, experiment_paths
from nbbatch.ui.cli import main

pytestmark = pytest.mark.timeout(120)


def test_cancel_goes_on_past_a_damaged_record_and_names_its_file(project, capsys):
    running, _final = two_runs()
    write_records(project / "results", running)
    damaged = project / "results" / "w" / running[1].run_id / RUN_RECORD
    damaged.write_text("{broken")

    assert main(["cancel", "w"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("asked 2 run(s) to stop") and running[0].run_id in out
    assert err.startswith(f"nbbatch: warning: {damaged} is not valid JSON") and err.count("\n") == 1
    assert f"run {running[1].run_id} was asked to stop all the same" in err
    markers = project / "results" / experiment_paths("w").cancel_folder
    assert {p.name for p in markers.iterdir()} == {r.run_id for r in running}  # the damaged one may be running
    assert json.loads((markers / running[0].run_id).read_text())["status"] == "cancelled"
    assert damaged.read_text() == "{broken"  # left as it is, for the user to see

    assert main(["cancel", "w", running[1].run_id]) == 0  # named alone, too
    assert f"{damaged} is not valid JSON" in capsys.readouterr().err
