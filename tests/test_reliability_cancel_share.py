"""Cancels that belong to one submission, watchdogs and schedulers that outlive a failing share, SIGTERM,
and resume that reuses only what is really the same run (issue 13, items 1, 2, 4, 7).

Real kernels and a real folder share; share faults are injected by wrapping the share, the way an
Azure Files 503 or an NFS hiccup reaches nbbatch (a :class:`ShareError` or an ``OSError``).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.notebooks import make_notebook
from support.shares import ShareDouble
from support.waiting import wait_running

import nbbatch
from nbbatch.api import prepare, submit
from nbbatch.backends.base import SubmitOptions
from nbbatch.backends.local.backend import LocalBackend
from nbbatch.execute.attempts import AttemptContext, execute_run
from nbbatch.plan.runs import Run, run_id_for
from nbbatch.store.layout import run_paths
from nbbatch.store.runfiles import new_record, write_record
from nbbatch.store.share import FileShare

pytestmark = pytest.mark.timeout(120)

WAIT_FOR_RELEASE = "import pathlib, time\nwhile not pathlib.Path('release').exists():\n    time.sleep(0.05)\nprint('ran', A)"


def _statuses(name: str) -> dict[int, str]:
    return {r.parameters["A"]: r.status for r in nbbatch.status(name)}




# --- 1. a cancel belongs to one submission --------------------------------------------------------

@pytest.mark.parametrize("force", [False, True])
@pytest.mark.kernel
def test_runs_cancelled_in_one_submission_run_in_the_next(project, write_experiment, force):
    make_notebook(project / "nb.ipynb", [WAIT_FOR_RELEASE])
    exp = write_experiment("experiment: again\nnotebooks: [nb.ipynb]\nsweep: {grid: {A: [1, 2, 3]}}\n"
                           "resources: {max_parallel: 1}\n")
    box: dict = {}
    thread = threading.Thread(target=lambda: box.setdefault("result", submit(exp, progress=False)))
    thread.start()
    wait_running("again", 0)
    assert nbbatch.cancel("again")
    thread.join(60)
    assert set(_statuses("again").values()) == {"cancelled"}

    (project / "release").write_text("go")
    again = submit(exp, progress=False, force=force)
    assert sorted(again.started) == sorted(r.run_id for r in again.records)
    assert set(_statuses("again").values()) == {"succeeded"}, [r.error for r in again.records]


@pytest.mark.kernel
def test_a_cancel_that_comes_after_the_scheduler_looked_still_stops_the_run(project):
    """The marker written between the scheduler's check and the attempt's start (or a retry) is not wiped."""
    make_notebook(project / "nb.ipynb", ["import time; time.sleep(60)"])
    share = FileShare(project / "results")
    run = Run(run_id="late-cancel", experiment="late", notebook=str(project / "nb.ipynb"), notebook_rel="nb.ipynb",
              kernel="python3")
    write_record(share, new_record(run))
    share.write_bytes(run_paths("late", run.run_id).cancel, b"now")  # after launch cleared the old ones
    record = execute_run(run, share)
    assert record.status == "cancelled" and record.error.kind == "cancelled"


# --- 2. the watchdog outlives share errors ----------------------------------------------------------

def _sleeper_run(project: Path, name: str, timeout: float | None = None) -> Run:
    make_notebook(project / "nb.ipynb", ["import time; time.sleep(300)"])
    return Run(run_id=f"{name}-run", experiment=name, notebook=str(project / "nb.ipynb"), notebook_rel="nb.ipynb",
               kernel="python3", timeout_s=timeout)


@pytest.mark.kernel
def test_run_timeout_holds_while_every_share_check_fails(project):
    share = ShareDouble(project / "results", failing=lambda path, method: method == "exists")
    record = execute_run(_sleeper_run(project, "to503", timeout=3), share)
    assert record.status == "timed_out" and "run timeout" in record.error.reason
    assert any(m == "exists" for _, m, _ in share.calls), "the watchdog never looked at the share"


@pytest.mark.kernel
def test_cancel_is_seen_once_the_share_recovers(project):
    failures = {"left": 3}

    def failing(path: str, method: str) -> bool:
        if method == "exists" and failures["left"] > 0:
            failures["left"] -= 1
            return True
        return False

    share = ShareDouble(project / "results", failing=failing)
    run = _sleeper_run(project, "cancel503")
    threading.Timer(1.0, lambda: share.write_bytes(run_paths(run.experiment, run.run_id).cancel, b"x")).start()
    record = execute_run(run, share)
    assert failures["left"] == 0
    assert record.status == "cancelled"


# --- 7. the scheduler: one listing per pass, share errors retried ----------------------------------

@pytest.mark.kernel
def test_scheduler_lists_cancels_once_per_pass_and_rides_out_share_errors(project, write_experiment):
    make_notebook(project / "nb.ipynb", ["import time; time.sleep(0.5); print('ran', A)"])  # ≥ 3 s: several passes
    exp = write_experiment("experiment: flaky\nnotebooks: [nb.ipynb]\nsweep: {grid: {A: [1, 2, 3, 4, 5, 6]}}\n"
                           "resources: {max_parallel: 1}\n")
    the_plan, _backend, folder = prepare(exp, progress=False)
    calls = {"n": 0}

    def failing(path: str, method: str) -> bool:  # once the runs are queued, every other check of the scheduler fails
        if threading.current_thread() is threading.main_thread() and len(list(root.glob("flaky/*/run.json"))) == 6:
            calls["n"] += 1
            return calls["n"] % 2 == 1
        return False

    root = folder.local_path("")
    share = ShareDouble(root, failing=failing)
    backend = LocalBackend()
    outcome = backend.triage(the_plan.runs, share)  # what the submission driver does, without its lock and manifest
    backend.launch(the_plan.runs, share, SubmitOptions())
    assert len(outcome.started) == 6
    assert set(_statuses("flaky").values()) == {"succeeded"}
    main = [(m, p) for t, m, p in share.calls if t == threading.main_thread().name]
    assert calls["n"] >= 2, "the scheduler never checked for cancels"
    assert not [p for m, p in main if m == "exists" and "/.cancel/" in p], "one exists() per pending run per pass"


# --- SIGTERM is handled like Ctrl-C -----------------------------------------------------------------

@pytest.mark.kernel
def test_sigterm_to_submit_leaves_no_run_running(project, write_experiment):
    make_notebook(project / "nb.ipynb", ["import time\nif A > 1: time.sleep(120)\nprint('done', A)"])
    write_experiment("experiment: term\nnotebooks: [nb.ipynb]\nsweep: {grid: {A: [1, 2, 3]}}\n"
                     "resources: {max_parallel: 2}\n")
    proc = subprocess.Popen([sys.executable, "-m", "nbbatch", "submit", "exp.yaml", "-q"], cwd=project,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_running("term", 0, timeout=90)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(r.status == "running" and r.parameters["A"] > 1
                                                      for r in nbbatch.status("term")):
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, out
    statuses = _statuses("term")
    assert "running" not in statuses.values() and "queued" not in statuses.values(), statuses
    assert statuses[2] == statuses[3] == "cancelled"


# --- 4. resume reuses only the same run -------------------------------------------------------------

def test_run_id_changes_with_the_experiment_env_and_gpus():
    base = run_id_for("nb", b"{}", {"A": 1}, "lock")
    assert run_id_for("nb", b"{}", {"A": 1}, "lock", env={}, gpus=0) == base  # ids of plain runs are unchanged
    assert run_id_for("nb", b"{}", {"A": 1}, "lock", env={"SEED": "2"}) != base
    assert run_id_for("nb", b"{}", {"A": 1}, "lock", env={"SEED": "2"}) != \
        run_id_for("nb", b"{}", {"A": 1}, "lock", env={"SEED": "3"})
    assert run_id_for("nb", b"{}", {"A": 1}, "lock", gpus=1) != base


@pytest.mark.kernel
def test_changing_env_reruns_and_a_lost_output_notebook_is_not_skipped(project, write_experiment):
    make_notebook(project / "nb.ipynb", ["import os; print(os.environ.get('SEED'))"])
    exp = write_experiment("experiment: resume2\nnotebooks: [nb.ipynb]\nenv: {SEED: '1'}\n")
    (first,) = submit(exp, progress=False).records
    again = submit(exp, progress=False)
    assert again.skipped == [first.run_id]

    (project / "results" / "resume2" / first.run_id / "output.ipynb").unlink()
    rerun = submit(exp, progress=False)
    assert rerun.started == [first.run_id] and not rerun.skipped
    assert any("output.ipynb is gone" in w for w in rerun.warnings)
    assert (project / "results" / "resume2" / first.run_id / "output.ipynb").exists()

    exp.write_text(exp.read_text().replace("SEED: '1'", "SEED: '2'"))
    changed = submit(exp, progress=False)
    (record,) = changed.records
    assert record.run_id != first.run_id and record.status == "succeeded"


# --- 7. a remote share's log traffic grows with the log, not with its square ---------------------

CHATTY = [f"print('line {i} ' + 'x' * 2000)\nimport time; time.sleep(0.01)" for i in range(60)]


@pytest.mark.parametrize("ranged", [True, False], ids=["appending", "whole-file"])
@pytest.mark.kernel
def test_remote_log_is_sent_once_not_at_every_checkpoint(project, ranged):
    make_notebook(project / "nb.ipynb", CHATTY)
    share = ShareDouble(project / "results", remote=True, ranged=ranged)
    run = Run(run_id="chatty-run", experiment="chatty", notebook=str(project / "nb.ipynb"), notebook_rel="nb.ipynb",
              kernel="python3")
    record = execute_run(run, share, AttemptContext(save_every=0.0))  # a checkpoint after every cell
    assert record.status == "succeeded"
    log_path = run_paths("chatty", run.run_id).log
    log = share.read_bytes(log_path)
    assert log.count(b"x" * 2000) == 60 and log.rstrip().endswith(b"ok")
    assert share.whole_writes[run_paths("chatty", run.run_id).notebook] > 20  # the checkpoints did happen
    if ranged:
        assert share.written[log_path] == len(log)  # every byte once
    else:
        assert share.whole_writes[log_path] <= 3  # throttled: the end, and at most every 30 s


@pytest.mark.kernel
def test_a_retried_remote_run_keeps_every_attempts_log(project):
    make_notebook(project / "nb.ipynb", [
        "import os, pathlib\nflag = pathlib.Path('died-once')\nprint('attempt', 2 if flag.exists() else 1)\n"
        "if not flag.exists():\n    flag.write_text('x')\n    os._exit(1)"])
    share = ShareDouble(project / "results", remote=True, ranged=True)
    share.write_bytes(run_paths("retry", "retry-run").log, b"an old submission's log\n" * 1000)
    run = Run(run_id="retry-run", experiment="retry", notebook=str(project / "nb.ipynb"), notebook_rel="nb.ipynb",
              kernel="python3", retries=1)
    record = execute_run(run, share)
    assert record.status == "succeeded" and record.attempts == 2
    log = share.read_bytes(run_paths("retry", "retry-run").log).decode()
    assert "old submission" not in log
    assert log.index("attempt 1") < log.index("attempt 2")


# --- low: fetch stays inside its destination --------------------------------------------------------

def test_fetch_refuses_a_path_for_an_experiment_and_never_writes_outside_dest(tmp_path):
    from nbbatch.errors import NbbatchError
    from nbbatch.store.fetch import fetch

    outside = tmp_path / "victim"
    # like Azure Files, the share reads `/abs/path` as `abs/path` inside itself, and may list hostile names
    share = ShareDouble(tmp_path / "share", remote=True, extra_listing={"exp": [".."]})
    for path, data in ((f"{str(outside).strip('/')}/run/run.json", b"{}"), ("exp/run/run.json", b"{}")):
        share.write_bytes(path, data)
    with pytest.raises(NbbatchError, match="not an experiment name"):
        fetch(share, str(outside), tmp_path / "dest")
    assert not outside.exists()
    written = fetch(share, "exp", tmp_path / "dest")
    assert written == [tmp_path / "dest" / "exp" / "run" / "run.json"]
    assert not (tmp_path / "evil.json").exists()
