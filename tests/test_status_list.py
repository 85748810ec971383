"""``nbbatch status`` without an experiment lists the experiments (and pipelines) of the share, each with its counts by
status and when it last changed; from another folder it finds the user's experiments through a per-user index, or says
where it looked and how to point it (issue 46 item 10)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.records import write_records

from nbbatch.spec.project import Project
from nbbatch.store.known import remember, user_experiments, user_index_path
from nbbatch.store.layout import experiment_paths
from nbbatch.store.runjson import RunError, RunRecord
from nbbatch.ui.cli import main

pytestmark = pytest.mark.timeout(120)


def _record(experiment: str, run_id: str, status: str = "succeeded", ended: str = "2026-01-02T10:00:00+00:00"
            ) -> RunRecord:
    return RunRecord(run_id=run_id, experiment=experiment, notebook="nb.ipynb", kernel="python3", parameters={},
                     status=status, attempts=1, ended_at=ended,
                     error=RunError("ValueError", "x") if status == "failed" else None)


def _share(root: Path) -> None:
    write_records(root, [_record("digits", "nb-1"), _record("digits", "nb-2"),
                         _record("digits", "nb-3", "failed", "2026-01-03T09:00:00+00:00"),
                         _record("study.train", "nb-4", ended="2026-01-01T08:00:00+00:00")])
    state = {"pipeline": "study", "updated": "2026-01-01T08:00:01+00:00", "state": "running",
             "stages": {"train": {"experiment": "study.train", "state": "succeeded"},
                        "evaluate": {"experiment": "study.evaluate", "state": "waiting"}}}
    (root / "study").mkdir(parents=True)
    (root / experiment_paths("study").pipeline_state).write_text(json.dumps(state))


def _rows(out: str) -> dict[str, str]:
    return {line.split()[0]: line for line in out.splitlines() if line.split() and line.split()[0] in
            ("digits", "study", "study.train")}


def test_status_without_an_experiment_lists_the_shares_experiments_and_pipelines(project, capsys):
    _share(project / "results")
    assert main(["status"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert list(rows) == ["digits", "study", "study.train"], out  # latest change first
    assert "2 succeeded" in rows["digits"] and "1 failed" in rows["digits"] and "2026-01-03 09:00" in rows["digits"]
    assert "pipeline" in rows["study"] and "1 succeeded" in rows["study"] and "1 waiting" in rows["study"], out
    assert "1 succeeded" in rows["study.train"]
    assert "nbbatch status EXPERIMENT" in " ".join(out.split())  # what to do next


def test_from_another_folder_status_finds_the_users_experiments_through_the_index(project, tmp_path, capsys,
                                                                                  monkeypatch):
    elsewhere = tmp_path / "share"
    _share(elsewhere)
    remember(Project(project), "digits", str(elsewhere), "local", {})
    assert [(e["name"], e["share"]) for e in user_experiments()] == [("digits", str(elsewhere))]
    away = tmp_path / "away"
    away.mkdir()
    monkeypatch.chdir(away)
    assert main(["status"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert "2 succeeded" in rows["digits"] and "study" not in rows  # the user's experiments, not the share's all


def test_nothing_to_list_says_where_it_looked_and_how_to_point_it(tmp_path, capsys, monkeypatch):
    away = tmp_path / "away"
    away.mkdir()
    monkeypatch.chdir(away)
    monkeypatch.delenv("NBBATCH_PROJECT", raising=False)
    assert main(["status"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert str(user_index_path()) in err and "--share" in err and "cd into" in err, err


def test_a_damaged_index_is_set_aside_and_never_fails_a_submission(project, tmp_path):
    path = user_index_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json")
    assert user_experiments() == []
    remember(Project(project), "digits", str(tmp_path / "share"), "local", {})
    assert [e["name"] for e in user_experiments()] == ["digits"]
    path.write_text("[1, 2]")
    remember(Project(project), "other", str(tmp_path / "share"), "local", {})
    assert [e["name"] for e in user_experiments()] == ["other"]
