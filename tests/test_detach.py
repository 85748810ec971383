"""``nbbatch submit FILE --detach``: the driver outlives the terminal (docs/detach.md).

Real ``python -m nbbatch`` processes: the submitting one returns while the runs still wait for a release file, the
terminal's process group is hung up, and the detached driver runs them to the end; ``status`` follows it. On the
real two-node Slurm the driver is itself a job.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.notebooks import make_notebook
from support.processes import gone
from support.waiting import wait_until

from nbbatch import api
from nbbatch.drivers.base import lock_path
from nbbatch.drivers.detach import driver_line, driver_state
from nbbatch.errors import LockedError
from nbbatch.store.drivers import PROCESS, DetachedDriver, exit_line
from nbbatch.store.lock import ExperimentLock
from nbbatch.store.runjson import utc_now
from nbbatch.store.share import FileShare
from nbbatch.ui.cli import main

pytestmark = pytest.mark.timeout(240)

BLOCKS = ("import pathlib, time\npathlib.Path(f'started-{A}').touch()\n"
          "while not pathlib.Path('release').exists():\n    time.sleep(0.05)\nprint('ran', A)")
START_S = 120  # a kernel may take long to start on a loaded machine


def _nbbatch(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nbbatch", *args], cwd=project, capture_output=True, text=True)


def _statuses(share: Path, name: str) -> list[str]:
    records = api.read_status(name, str(share)).records
    return sorted(r.status for r in records)


def _as_a_terminal_leaves_them() -> None:
    """In a child before exec: SIGHUP as a shell on a terminal leaves it (the tests may run under nohup)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


@pytest.fixture
def blocking(project):
    """An experiment of two runs that wait for ``release``; whatever the test leaves running is stopped after it."""
    make_notebook(project / "nb.ipynb", [BLOCKS])
    (project / "exp.yaml").write_text("experiment: away\nnotebooks: [nb.ipynb]\nsweep: {grid: {A: [1, 2]}}\n")
    yield project
    (project / "release").touch()
    driver = DetachedDriver.read(project / ".nbbatch", "away")
    if driver is not None and driver.how == PROCESS and not gone(int(driver.id)):
        with contextlib.suppress(ProcessLookupError):
            wait_until(lambda: gone(int(driver.id)), timeout=60, message="the driver to end")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(int(driver.id), signal.SIGKILL)


@pytest.mark.kernel
def test_a_detached_driver_outlives_its_terminal_and_runs_the_experiment_to_the_end(blocking):
    project = blocking
    # a terminal's session: the shell submits, then the terminal closes (SIGHUP to the whole process group)
    terminal = subprocess.run(
        ["bash", "-c", f"{sys.executable} -m nbbatch submit exp.yaml --detach; echo exit=$?; kill -HUP 0; sleep 60"],
        cwd=project, capture_output=True, text=True, start_new_session=True, preexec_fn=_as_a_terminal_leaves_them)

    assert terminal.returncode == -signal.SIGHUP, terminal.stderr  # the shell itself was hung up
    said, status = terminal.stdout.strip().splitlines()
    assert status == "exit=0" and terminal.stderr == ""
    driver = DetachedDriver.read(project / ".nbbatch", "away")
    assert driver is not None and driver.how == PROCESS and driver.host == socket.gethostname()
    assert said == (f"started the driver of `away` as process {driver.id} on {driver.host}; its log: "
                    f".nbbatch/drivers/away.log; follow it with `nbbatch status away`")
    assert driver.command == f"nbbatch submit {project / 'exp.yaml'} --wait -q"
    assert os.getsid(int(driver.id)) == int(driver.id)  # a session of its own: no terminal reaches it
    assert not (project / "release").exists()  # so no run can have ended: submit returned while they go on

    wait_until(lambda: (project / "started-1").exists(), timeout=START_S, message="a run's kernel to start")
    running = _nbbatch(project, "status", "away", "--no-refresh")
    first = running.stdout.splitlines()[0]
    assert first.startswith(f"driver: process {driver.id} running since ") and len(first) <= 80, running.stdout
    assert first.endswith("(log .nbbatch/drivers/away.log)")

    again = _nbbatch(project, "submit", "exp.yaml", "--detach")
    assert again.returncode == 2 and again.stdout == ""
    assert again.stderr.strip() == (f"nbbatch: error: `away` already has a detached driver: process {driver.id} on "
                                    f"{driver.host}, started {first.split(' since ')[1].split(' ')[0]}. Follow it "
                                    "with `nbbatch status away`, or stop it with `nbbatch cancel away`")

    (project / "release").touch()
    wait_until(lambda: driver_state(driver).running is False, timeout=START_S, message="the driver to end")
    assert _statuses(project / "results", "away") == ["succeeded", "succeeded"]
    ended = _nbbatch(project, "status", "away")
    assert ended.returncode == 0
    assert ended.stdout.splitlines()[0] == "driver: ended, exit 0 (log .nbbatch/drivers/away.log)"
    log = (project / ".nbbatch" / "drivers" / "away.log").read_text()
    assert "experiment away: 2 succeeded" in log and log.splitlines()[-1] == exit_line(0)


@pytest.mark.kernel
def test_a_pipeline_is_detached_as_it_is(project):
    """The detached driver of a pipeline file is `nbbatch submit PIPELINE --wait` too: its stages run in order."""
    make_notebook(project / "nb.ipynb", ["print(A)"], parameters="A = 1")
    (project / "pipe.yaml").write_text("pipeline: chain\nstages:\n  one: {notebooks: [nb.ipynb]}\n"
                                       "  two: {notebooks: [nb.ipynb], needs: [one], parameters: {A: 2}}\n")

    submitted = _nbbatch(project, "submit", "pipe.yaml", "--detach", "--force")

    assert submitted.returncode == 0, submitted.stderr
    driver = DetachedDriver.read(project / ".nbbatch", "chain")
    assert driver.command == f"nbbatch submit {project / 'pipe.yaml'} --wait -q --force"
    wait_until(lambda: driver_state(driver).running is False, timeout=START_S, message="the driver to end")
    status = _nbbatch(project, "status", "chain")
    assert status.stdout.splitlines()[0] == "driver: ended, exit 0 (log .nbbatch/drivers/chain.log)"
    assert "pipeline chain: succeeded" in status.stdout
    assert _statuses(project / "results", "chain.two") == ["succeeded"]


def test_detach_is_refused_while_another_driver_holds_the_experiment(blocking):
    """A foreground `nbbatch submit` of the experiment holds its lock: --detach names it, as a second submit is."""
    project = blocking
    share = FileShare(project / "results")
    with ExperimentLock(lock_path(api.find_project(), share, "away"), "away"), pytest.raises(LockedError) as refused:
        api.detach(project / "exp.yaml")
    assert str(refused.value).startswith(f"experiment `away` is already being run by process {os.getpid()} on ")
    assert not (project / ".nbbatch" / "drivers").exists()


@pytest.mark.parametrize("spec, options", [
    ("experiment: e\nnotebooks: [nb.ipynb]\nparameters: {AA: 3}\n", []),
    ("experiment: e\nnotebooks: [{path: nb.ipynb, kernel: pyhton3}]\n", []),
    ("experiment: e\nnotebooks: [nb.ipynb]\nbackend: lcoal\n", []),
    ("experiment: e\nnotebooks: [nb.ipynb]\n", ["--only", "nosuchrun"]),
    ("experiment: [unclosed\n", []),
    ("- a\n- b\n", []),
])
def test_bad_input_is_refused_as_submit_refuses_it_before_anything_starts(blocking, capsys, spec, options):
    (blocking / "bad.yaml").write_text(spec)
    assert main(["submit", "bad.yaml", *options]) == 2
    refused = capsys.readouterr().err

    assert main(["submit", "bad.yaml", "--detach", *options]) == 2
    assert capsys.readouterr().err == refused and refused.startswith("nbbatch: error: ")
    assert not (blocking / ".nbbatch" / "drivers").exists() and not (blocking / "results").exists()


def test_a_missing_file_is_one_line(project, capsys):
    assert main(["submit", "nowhere.yaml", "--detach"]) == 2
    assert capsys.readouterr().err == "nbbatch: error: experiment file nowhere.yaml does not exist\n"
    assert not (project / ".nbbatch" / "drivers").exists()


@pytest.mark.parametrize("spec", [
    "pipeline: ../up\nstages: {a: {notebooks: [nb.ipynb]}}\n",
    "pipeline: p\nstages: {a: {notebooks: [nb.ipynb], parameters: {A: '${b.best.parameters.A}'}}}\n",
    "pipeline: p\nstages: {a: {notebooks: [nb.ipynb], parameters: {AA: 1}}}\n",
])
def test_a_bad_pipeline_is_refused_as_submit_refuses_it(blocking, capsys, spec):
    (blocking / "pipe.yaml").write_text(spec)
    assert main(["submit", "pipe.yaml"]) == 2
    refused = capsys.readouterr().err

    assert main(["submit", "pipe.yaml", "--detach"]) == 2
    assert capsys.readouterr().err == refused and refused.startswith("nbbatch: error: ")
    assert not (blocking / ".nbbatch" / "drivers").exists() and not (blocking / "results").exists()


def test_a_failed_driver_is_one_line_with_its_exit_code_and_last_error(project):
    log = project / ".nbbatch" / "drivers" / "gone.log"
    log.parent.mkdir(parents=True)
    log.write_text("nbbatch: error: the share /data/results is read-only\n" + exit_line(2) + "\n")
    driver = DetachedDriver("gone", "local", PROCESS, str(_gone_pid()), str(log), "nbbatch submit gone.yaml --wait -q",
                            utc_now())
    driver.write(project / ".nbbatch")

    state = driver_state(DetachedDriver.read(project / ".nbbatch", "gone"))
    line = driver_line(driver, state)

    assert (state.running, state.exit_code) == (False, 2)
    assert line == "driver: failed, exit 2: the share /data/results… (log .nbbatch/drivers/gone.log)"
    assert len(line) == 80
    assert api.detached_driver("gone")[1] == state and api.detached_driver("other") is None


def _gone_pid() -> int:
    """The pid of a process that has ended (and was reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# --- Slurm: the driver is a job ---------------------------------------------------------------------------------



@pytest.mark.slurm
@pytest.mark.kernel
@pytest.mark.timeout(300)
def test_on_slurm_the_driver_is_a_job_and_the_runs_end_without_the_submitting_process(slurm_cluster, project):
    make_notebook(project / "nb.ipynb", [BLOCKS])
    share = project / "share"
    (project / "exp.yaml").write_text(yaml.safe_dump({
        "experiment": "onslurm", "notebooks": [{"path": "nb.ipynb", "kernel": "python3"}],
        "sweep": {"grid": {"A": [1, 2]}}, "share": str(share),
        "backend": {"name": "slurm", "cpus": 1, "memory": "256M", "cancel_grace_s": 5}}))

    submitted = _nbbatch(project, "submit", "exp.yaml", "--detach")

    assert submitted.returncode == 0, submitted.stderr
    driver = DetachedDriver.read(project / ".nbbatch", "onslurm")
    assert driver is not None and driver.how == "slurm job" and driver.backend == "slurm"
    assert submitted.stdout.startswith(f"started the driver of `onslurm` as slurm job {driver.id} on ")
    job = slurm_cluster.job(driver.id)
    assert (job["JobName"], job["NumCPUs"]) == ("nbbatch-driver-onslurm", "1")
    assert job["StdOut"] == str(project / ".nbbatch" / "drivers" / "onslurm.log")
    wait_until(lambda: (project / "started-1").exists(), timeout=START_S, message="a run's kernel to start")
    first = _nbbatch(project, "status", "onslurm", "--no-refresh").stdout.splitlines()[0]
    assert first.startswith(f"driver: slurm job {driver.id} running since ") and len(first) <= 80, first

    (project / "release").touch()
    assert slurm_cluster.wait_job_done(driver.id, timeout=200)["JobState"] == "COMPLETED"
    assert _statuses(share, "onslurm") == ["succeeded", "succeeded"]
    log = Path(driver.log).read_text()
    assert "experiment onslurm: 2 succeeded" in log and log.rstrip().endswith(exit_line(0))
    status = _nbbatch(project, "status", "onslurm")
    assert status.returncode == 0
    assert status.stdout.splitlines()[0] == "driver: ended, exit 0 (log .nbbatch/drivers/onslurm.log)"


@pytest.mark.slurm
@pytest.mark.kernel
@pytest.mark.timeout(300)
def test_on_slurm_a_detached_pipeline_is_a_driver_job_too(slurm_cluster, project):
    make_notebook(project / "nb.ipynb", ["print(A)"], parameters="A = 1")
    share = project / "share"
    (project / "pipe.yaml").write_text(yaml.safe_dump({
        "pipeline": "slurmchain", "share": str(share), "backend": {"name": "slurm", "cpus": 1, "memory": "256M"},
        "stages": {"one": {"notebooks": [{"path": "nb.ipynb", "kernel": "python3"}]},
                   "two": {"notebooks": [{"path": "nb.ipynb", "kernel": "python3"}], "needs": ["one"],
                           "parameters": {"A": 2}}}}))

    submitted = _nbbatch(project, "submit", "pipe.yaml", "--detach")

    assert submitted.returncode == 0, submitted.stderr
    driver = DetachedDriver.read(project / ".nbbatch", "slurmchain")
    assert driver.how == "slurm job" and slurm_cluster.job(driver.id)["JobName"] == "nbbatch-driver-slurmchain"
    assert slurm_cluster.wait_job_done(driver.id, timeout=240)["JobState"] == "COMPLETED"
    assert _statuses(share, "slurmchain.one") == _statuses(share, "slurmchain.two") == ["succeeded"]
    log = Path(driver.log).read_text()
    assert "pipeline slurmchain: succeeded" in log and log.rstrip().endswith(exit_line(0))
