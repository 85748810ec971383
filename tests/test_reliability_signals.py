"""Signals to a real ``nbbatch submit``: a second Ctrl-C or SIGTERM while it stops, the terminal closing (SIGHUP),
``nohup``, and ``status --watch`` of a driver that was killed (issue 34, items 5 and 6).

Each runs real ``python -m nbbatch`` processes with notebooks that block until a release file exists, so a run is
surely ``running`` (its kernel inside the blocking cell) when the signal comes. See docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from support.notebooks import make_notebook
from support.processes import kernels_of
from support.waiting import wait_until

from nbbatch.backends.base import SubmitOptions
from nbbatch.backends.local.backend import LocalBackend
from nbbatch.backends.local.scheduler import LocalScheduler
from nbbatch.plan.runs import Run
from nbbatch.store.runfiles import new_record, read_record, write_record
from nbbatch.store.share import FileShare

pytestmark = pytest.mark.timeout(150)

BLOCKS = ("import pathlib, time\npathlib.Path(f'started-{A}').touch()\n"
          "while not pathlib.Path('release').exists():\n    time.sleep(0.05)\nprint('ran', A)")
START_S = 90  # the first run's kernel may take long to start on a loaded machine


def _experiment(project: Path, name: str, runs: int = 3) -> Path:
    make_notebook(project / "nb.ipynb", [BLOCKS])
    path = project / "exp.yaml"
    path.write_text(f"experiment: {name}\nnotebooks: [nb.ipynb]\nsweep: {{grid: {{A: {list(range(1, runs + 1))}}}}}\n"
                    "resources: {max_parallel: 1}\n")
    return path


def _records(project: Path, name: str) -> dict[int, dict]:
    """A → run.json, as it is on the share now (a record being replaced is skipped)."""
    found = {}
    for path in (project / "results" / name).glob("*/run.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        found[record["parameters"]["A"]] = record
    return found


def _one_running(project: Path) -> bool:
    """A run's kernel is inside its blocking cell (the others are queued)."""
    return any(project.glob("started-*"))


def _as_from_a_terminal() -> None:
    """In a child before exec: the stop signals as a shell on a terminal leaves them. Where the tests run under
    `nohup` or as a background job, SIGHUP or SIGINT is ignored, and nbbatch rightly keeps an ignored signal
    ignored: the tests of what those signals do would then test nothing (or wait forever)."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


def _submit(project: Path, *extra: str, prefix: tuple[str, ...] = ()) -> subprocess.Popen[str]:
    return subprocess.Popen([*prefix, sys.executable, "-m", "nbbatch", "submit", "exp.yaml", *extra], cwd=project,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=_as_from_a_terminal)


def _all_cancelled(project: Path, name: str) -> None:
    records = _records(project, name)
    assert {a: r["status"] for a, r in records.items()} == {1: "cancelled", 2: "cancelled", 3: "cancelled"}, records
    assert records[2]["error"]["reason"] == records[3]["error"]["reason"] == "interrupted before it started"
    assert kernels_of(name) == [], "kernels left running"


@pytest.mark.kernel
def test_a_second_signal_while_submit_stops_still_records_every_run_cancelled(project):
    """SIGTERM, then Ctrl-C (a user pressing again, a scheduler escalating) while submit cancels the runs. Before, the
    second cut the stop short: the running run stayed `running` (or the queued ones `queued`)."""
    _experiment(project, "twice")
    driver = _submit(project, "-q")
    try:
        wait_until(lambda: _one_running(project), START_S, "a run to be running")
        driver.send_signal(signal.SIGTERM)
        # the first is being handled: the queued runs are cancelled, the running one is being stopped
        wait_until(lambda: _records(project, "twice")[3]["status"] == "cancelled", 30, "the queued runs' cancel")
        driver.send_signal(signal.SIGINT)
        out, _ = driver.communicate(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
    _all_cancelled(project, "twice")
    assert driver.returncode == 143, out
    assert "already stopping" in out and "Traceback" not in out


def _spawn_on_terminal(project: Path, *argv: str) -> tuple[int, int]:
    """``python -m nbbatch ARGV`` in a session of its own whose controlling terminal is a new pty: (pid, master fd)."""
    pid, master = pty.fork()
    if pid == 0:  # the child: only exec (or exit) after a fork
        try:
            _as_from_a_terminal()
            os.chdir(project)
            os.execv(sys.executable, [sys.executable, "-m", "nbbatch", *argv])
        finally:
            os._exit(127)
    os.set_blocking(master, False)
    return pid, master


def _drain(master: int) -> None:
    """Read what the terminal shows, so that the live table never fills it."""
    try:
        while os.read(master, 65536):
            pass
    except (BlockingIOError, OSError):
        pass


@pytest.mark.kernel
def test_closing_the_terminal_cancels_the_batch_and_ends_a_watch(project):
    """The window or ssh session of `nbbatch submit` (drawing its live table) closes: the kernel sends SIGHUP, and
    every write to the terminal fails. Before, SIGHUP killed submit: the running run stayed `running`, the queued ones
    `queued` forever, and a `status --watch` of the experiment never returned. Now it stops as for Ctrl-C: every run
    `cancelled`, kernels killed, exit 129, and the watch ends."""
    _experiment(project, "hup")
    pid, master = _spawn_on_terminal(project, "submit", "exp.yaml")
    ended: list[int] = []  # submit's exit code, once reaped

    def submit_ended() -> bool:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            ended.append(os.waitstatus_to_exitcode(status))
        return bool(ended)

    watch = None
    try:
        wait_until(lambda: _drain(master) or _one_running(project), START_S, "a run to be running")
        watch = subprocess.Popen([sys.executable, "-m", "nbbatch", "status", "hup", "--watch", "--interval", "0.2"],
                                 cwd=project, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        os.close(master)  # the terminal goes away
        master = -1
        wait_until(submit_ended, 60, "submit to exit")
        out, _ = watch.communicate(timeout=60)
    finally:
        if master >= 0:
            os.close(master)
        if watch is not None and watch.poll() is None:
            watch.kill()
        if not ended:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    assert ended == [129]
    _all_cancelled(project, "hup")
    assert watch.returncode == 0 and "3 cancelled" in out, out


@pytest.mark.kernel
def test_nohup_submit_goes_on_after_sighup(project):
    """Under `nohup` (SIGHUP ignored, as the docs advise for a batch that must outlive the terminal) SIGHUP does
    nothing: the batch runs to its end."""
    _experiment(project, "nohup", runs=1)
    driver = _submit(project, "-q", prefix=("nohup",))
    try:
        wait_until(lambda: _one_running(project), START_S, "the run to be running")
        driver.send_signal(signal.SIGHUP)
        (project / "release").write_text("go")
        out, _ = driver.communicate(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 0, out
    assert _records(project, "nohup")[1]["status"] == "succeeded"


@pytest.mark.kernel
def test_watch_of_a_killed_submit_ends_and_says_why(project):
    """`kill -9` of submit: its queued runs can never start (they name no process that could be found dead). Before,
    `status --watch` waited for them forever; now it ends, saying that no submit runs them any more."""
    _experiment(project, "killed")
    driver = _submit(project, "-q")
    try:
        wait_until(lambda: _one_running(project), START_S, "a run to be running")
    finally:
        driver.kill()
        driver.wait(30)
    watch = subprocess.run([sys.executable, "-m", "nbbatch", "status", "killed", "--watch", "--interval", "0.2"],
                           cwd=project, capture_output=True, text=True, timeout=60)
    assert watch.returncode == 0, watch.stderr
    assert "2 run(s) of `killed` are still queued, but no `nbbatch submit` will start them" in watch.stderr
    assert {r["status"] for r in _records(project, "killed").values()} == {"failed", "queued"}


def test_a_second_ctrl_c_while_the_scheduler_stops_does_not_cut_it_short(tmp_path):
    """From Python (`nbbatch.submit` in a notebook, whose kernel is interrupted twice): the second KeyboardInterrupt
    lands while the scheduler cancels the runs not started; it still cancels every one and waits for the running
    one to record itself."""
    share = FileShare(tmp_path / "share")
    runs = [Run(run_id=f"r{i}", experiment="sched", notebook="/x/nb.ipynb", notebook_rel="nb.ipynb",
                kernel="python3") for i in range(3)]
    backend = LocalBackend(gpus=[], prestart=0, max_parallel=1)
    started = threading.Event()

    def execute(run, share_, lease, shared, gpu_env, info, cancel, notify, kernels):
        record = new_record(run)
        record.status = "running"
        write_record(share_, record)
        started.set()
        assert cancel.wait(10), "the scheduler never told the running run to stop"
        record.status = "cancelled"
        write_record(share_, record)
        return record

    backend._execute = execute  # type: ignore[method-assign]
    for run in runs:
        write_record(share, new_record(run))
    scheduler = LocalScheduler(backend, runs, share, SubmitOptions())
    finalize, interrupts = backend.finalize, []

    def finalize_after_a_second_ctrl_c(*args, **kwargs):
        if not interrupts:
            interrupts.append(1)
            raise KeyboardInterrupt  # the second Ctrl-C, as the first pending run is being cancelled
        return finalize(*args, **kwargs)

    backend.finalize = finalize_after_a_second_ctrl_c  # type: ignore[method-assign]
    first_pass = scheduler.step

    def step() -> bool:
        if scheduler.active:
            assert started.wait(10)
            raise KeyboardInterrupt  # the first Ctrl-C
        return first_pass()

    scheduler.step = step  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        scheduler.run()
    assert interrupts and not scheduler.active and not scheduler.pending
    assert {r.run_id: read_record(share, "sched", r.run_id).status for r in runs} == {
        "r0": "cancelled", "r1": "cancelled", "r2": "cancelled"}
