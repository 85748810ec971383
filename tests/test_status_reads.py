"""``nbbatch status`` reads, and refreshing is a step of its own (issue 43, item 7).

Reading the share writes nothing and asks no backend; the backend is asked once per ``status`` and, while
watching, at its own slower pace; a refresh that fails is one footer line, said once, never a Python warning;
the share is opened once per command.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from support.records import two_runs, write_records
from support.shares import ShareDouble

import nbbatch.api
import nbbatch.store.known
from nbbatch.backends import backend_class
from nbbatch.errors import BackendError
from nbbatch.results.progress import StatusReads
from nbbatch.results.status import RefreshOutcome, StatusView
from nbbatch.store.layout import RUN_RECORD
from nbbatch.store.runjson import RunRecord
from nbbatch.ui.cli import main

pytestmark = pytest.mark.timeout(120)

SCHEDULER_DOWN = "squeue: error: cannot reach slurmctld (injected)"
FOOTER = (f"nbbatch: warning: could not ask the `local` backend about the runs: {SCHEDULER_DOWN}; "
          "the records on the share may be behind")


@pytest.fixture
def refresh_fails(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The experiment's backend (local) cannot be asked about its runs; the list counts the asks."""
    asked: list[str] = []

    def refresh(self, experiment: str, share: object) -> None:
        asked.append(experiment)
        raise BackendError(SCHEDULER_DOWN)

    monkeypatch.setattr(backend_class("local"), "refresh", refresh)
    return asked


def _dead_driver_record(root: Path) -> RunRecord:
    """A running run whose driver process is gone: a refresh of the local backend ends it as failed."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    [record, _] = two_runs("d")[0]
    record.backend, record.host, record.pid = "local", socket.gethostname(), gone.pid
    write_records(root, [record])
    return record


def _files(root: Path) -> dict[str, tuple[int, bytes]]:
    return {p.relative_to(root).as_posix(): (p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(root.rglob("*")) if p.is_file()}


def _final_at_read(monkeypatch: pytest.MonkeyPatch, project: Path, final: list[RunRecord], at: int) -> list[int]:
    """Count the reads of the runs' status; the records turn final on read number ``at`` (a watch then ends)."""
    reads: list[int] = []
    real = nbbatch.api.read_status

    def read_status(*args, **kwargs) -> StatusView:
        reads.append(1)
        if len(reads) == at:
            write_records(project / "results", final)
        return real(*args, **kwargs)

    monkeypatch.setattr(nbbatch.api, "read_status", read_status)
    return reads


def test_a_failed_refresh_is_one_footer_line_and_the_table_and_exit_are_as_before(project, refresh_fails, capsys):
    running, final = two_runs()
    write_records(project / "results", final)
    assert main(["status", "w", "--no-refresh", "--check"]) == 1  # one failed: as before
    unrefreshed = capsys.readouterr()
    assert not refresh_fails and not unrefreshed.err

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # never a Python warning
        assert main(["status", "w", "--check"]) == 1
    refreshed = capsys.readouterr()
    assert refresh_fails == ["w"]
    assert refreshed.out == unrefreshed.out  # the table is the same
    assert refreshed.err.count("could not ask") == 1 and refreshed.err.strip() == FOOTER

    assert main(["status", "w", "--json"]) == 0
    shown = capsys.readouterr()
    assert shown.out.lstrip().startswith("[") and shown.err.strip() == FOOTER  # stdout stays JSON


def test_a_watch_says_a_failing_refresh_once_while_the_backend_keeps_failing(project, refresh_fails, monkeypatch,
                                                                             capsys):
    running, final = two_runs()
    write_records(project / "results", running)
    monkeypatch.setattr("nbbatch.ui.cli.REFRESH_EVERY_S", 0)  # ask at every read: it fails each time
    reads = _final_at_read(monkeypatch, project, final, 3)
    assert main(["status", "w", "--watch", "--interval", "0.01"]) == 0
    err = capsys.readouterr().err
    assert len(refresh_fails) == len(reads) >= 3
    assert err.count("could not ask") == 1 and err.strip() == FOOTER


def test_a_watch_asks_the_backend_at_its_own_pace_not_at_every_read(project, monkeypatch, capsys):
    running, final = two_runs()
    write_records(project / "results", running)
    asked: list[str] = []
    monkeypatch.setattr(nbbatch.api, "refresh_runs", lambda name, share=None: asked.append(name) or
                        RefreshOutcome("local"))
    reads = _final_at_read(monkeypatch, project, final, 4)
    assert main(["status", "w", "--watch", "--interval", "0.01"]) == 0
    assert len(reads) >= 4 and asked == ["w"]  # once, first; the next ask is REFRESH_EVERY_S away
    assert "warning" not in capsys.readouterr().err


def test_status_reads_ask_the_backend_first_then_every_refresh_s() -> None:
    now = [0.0]
    outcomes = iter([RefreshOutcome("slurm", "down"), RefreshOutcome("slurm")])
    asks: list[float] = []

    def refresh() -> RefreshOutcome:
        asks.append(now[0])
        return next(outcomes)

    reads = StatusReads(lambda: StatusView("e", []), refresh, refresh_s=15, clock=lambda: now[0])
    views = []
    for t in (0, 5, 14.9, 15, 20):
        now[0] = t
        views.append(reads())
    assert asks == [0, 15]
    assert [v.footer for v in views[:3]] == [["could not ask the `slurm` backend about the runs: down; the records "
                                              "on the share may be behind"]] * 3  # kept until an ask succeeds
    assert views[3].footer == views[4].footer == []
    assert StatusReads(lambda: StatusView("e", []))().refresh is None  # --no-refresh: never asked


def test_reading_status_writes_nothing_and_asks_no_backend(project, refresh_fails):
    results = project / "results"
    _dead_driver_record(results)
    share = ShareDouble(results, watched=("exists", "list", "read_bytes", "write_bytes", "remove",
                                          "remove_partial_writes"))
    before = _files(results)
    view = nbbatch.api.read_status("d", share)
    assert [r.status for r in view.records] == ["running"] and not view.problems and view.refresh is None
    assert not share.whole_writes and not [c for c in share.calls if c[1] in ("write_bytes", "remove")]
    assert not refresh_fails and _files(results) == before


def test_status_no_refresh_only_reads_and_a_plain_status_refreshes_once(project, capsys):
    results = project / "results"
    record = _dead_driver_record(results)
    before = _files(results)
    assert main(["status", "d", "--no-refresh"]) == 0
    assert "running" in capsys.readouterr().out and _files(results) == before  # nothing written, not even mtimes
    assert main(["status", "d"]) == 0  # asks the local backend: its driver is gone, so the run failed
    assert "failed" in capsys.readouterr().out
    on_disk = RunRecord.from_json((results / "d" / record.run_id / RUN_RECORD).read_bytes())
    assert on_disk.status == "failed" and on_disk.error.ename == "DriverDied"


def test_status_opens_the_share_once_however_often_it_reads(project, monkeypatch, capsys):
    running, final = two_runs()
    write_records(project / "results", running)
    opened: list[str] = []
    real_open = nbbatch.store.known.open_share
    monkeypatch.setattr(nbbatch.store.known, "open_share", lambda url: opened.append(str(url)) or real_open(url))
    reads = _final_at_read(monkeypatch, project, final, 3)
    assert main(["status", "w"]) == 0
    assert len(opened) == 1
    opened.clear()
    assert main(["status", "w", "--watch", "--interval", "0.01"]) == 0
    assert len(reads) >= 3 and len(opened) == 1
    capsys.readouterr()


def test_damaged_records_are_footer_lines_not_python_warnings(project, capsys):
    running, final = two_runs()
    write_records(project / "results", final)
    damaged = project / "results" / "w" / final[1].run_id / RUN_RECORD
    damaged.write_bytes(damaged.read_bytes()[:50])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main(["status", "w", "--no-refresh"]) == 0
        view = nbbatch.api.read_status("w")
    err = capsys.readouterr().err
    assert err.count(str(damaged)) == 1 and err.startswith(f"nbbatch: warning: {damaged} is not valid JSON")
    assert [r.run_id for r in view.records] == [final[0].run_id] and view.footer == view.problems
    assert str(damaged) in view.problems[0]


def test_a_live_watch_draws_the_footer_under_its_table(project, monkeypatch, capsys):
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    monkeypatch.setenv("COLUMNS", "400")  # the footer (a long path) on one line
    running, final = two_runs()
    write_records(project / "results", final)
    damaged = project / "results" / "w" / "toy-9a2b3c4d5e" / RUN_RECORD
    damaged.parent.mkdir()
    damaged.write_text("{not json")
    assert main(["status", "w", "--watch", "--no-refresh"]) == 0
    out, err = capsys.readouterr()
    plain = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", out)
    assert "w: 1 failed, 1 succeeded" in out and f"warning: {damaged} is not valid JSON" in plain
    assert not err  # the live table says it; stderr does not say it again


def test_the_jobs_widget_shows_a_failed_refresh_under_its_table(project, refresh_fails):
    from nbbatch.store.share import FileShare
    from nbbatch.ui.widgets.jobs import JobsSummary, JobsSummaryModel

    running, _final = two_runs()
    write_records(project / "results", running)
    summary = JobsSummary(JobsSummaryModel("w"), FileShare(project / "results"), backend_refresh_s=3600)
    assert len(summary.load()) == 2 and not summary.model.problems and not refresh_fails  # only read
    summary.backend_refresh_s = 0
    summary.load()
    assert refresh_fails == ["w"]
    assert summary.model.problems == [FOOTER.removeprefix("nbbatch: warning: ")]
    assert summary.model.to_text().count("could not ask") == 1
