"""How nbbatch reaches its kernels: Unix sockets (ZeroMQ ipc) in a private folder, not localhost TCP, and
that folder (sockets and connection file) gone after every way a run or a kernel started ahead can end."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import nbformat
import psutil
import pytest
from support.notebooks import make_notebook

import nbbatch
from nbbatch.api import submit
from nbbatch.execute.kernels import TRANSPORT_VARIABLE, kernel_transport
from nbbatch.execute.prestart import KernelPool

pytestmark = [pytest.mark.kernel, pytest.mark.timeout(180),
              pytest.mark.skipif(os.name != "posix", reason="ipc (Unix sockets) is the POSIX transport")]

# The kernel reports how it was reached: its connection file, that file's transport and socket base, the folder's mode.
REPORT = ("import json, os\nfrom ipykernel import get_connection_file\nf = get_connection_file()\n"
          "info = json.load(open(f))\n"
          "print('CONNECTION ' + json.dumps({'file': f, 'transport': info['transport'], 'ip': info['ip'], "
          "'mode': os.stat(os.path.dirname(f)).st_mode, 'listing': sorted(os.listdir(os.path.dirname(f)))}))")


@pytest.fixture
def private_tmp(monkeypatch):
    """A short temporary folder of this test's own, as TMPDIR: whatever a run leaves there is listed."""
    folder = Path(tempfile.mkdtemp(prefix="nbt-", dir="/tmp"))  # short: Unix socket paths stay under ~100 bytes
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    monkeypatch.delenv(TRANSPORT_VARIABLE, raising=False)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _run_folder(project: Path, record) -> Path:
    return project / "results" / record.experiment / record.run_id


def _connection(project: Path, record) -> dict:
    nb = nbformat.read(_run_folder(project, record) / "output.ipynb", as_version=4)
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("text", "").startswith("CONNECTION "):
                return json.loads(out["text"].split(" ", 1)[1])
    raise AssertionError("the kernel did not report its connection")


def _assert_private_ipc(info: dict, tmp: Path) -> None:
    folder = Path(info["file"]).parent
    assert info["transport"] == "ipc"
    assert folder.parent == tmp and folder.name.startswith("nbbatch-k"), info
    assert stat.S_IMODE(info["mode"]) & 0o777 == 0o700  # (jupyter_client adds the sticky bit)
    assert Path(info["ip"]).parent == folder, "the sockets are in the kernel's private folder, not its cwd"
    assert {f"{Path(info['ip']).name}-{n}" for n in range(1, 6)} <= set(info["listing"])


def test_a_run_uses_ipc_and_its_log_has_only_the_runs_output(project, write_experiment, private_tmp):
    make_notebook(project / "nb.ipynb", [REPORT, "print('hello', A)"])
    (record,) = submit(write_experiment("experiment: ipc\nnotebooks: [nb.ipynb]\n"), progress=False).records
    assert record.status == "succeeded"
    _assert_private_ipc(_connection(project, record), private_tmp)
    log = (_run_folder(project, record) / "log.txt").read_text()
    assert "without encryption" not in log and "IPKernelApp" not in log
    lines = [line for line in log.splitlines() if not line.startswith(("=== ", "CONNECTION "))]
    assert lines == ["hello 1"], "the kernel wrote something of its own to the run's log"
    assert not list(private_tmp.iterdir()), "the kernel's folder was left behind"
    assert not list(project.glob("kernel-*")), "sockets were made in the notebook's folder"


# The run timeout counts the kernel's start: only the run meant to time out gets a short one (a loaded machine may
# take seconds to start a kernel).
@pytest.mark.parametrize("ending, status, timeout", [("raise ValueError('no')", "failed", 300),
                                                     ("import os; os._exit(1)", "failed", 300),
                                                     ("import time; time.sleep(120)", "timed_out", 3)],
                         ids=["cell-error", "kernel-death", "run-timeout"])
def test_nothing_is_left_after_a_run_that_does_not_succeed(project, write_experiment, private_tmp, ending, status,
                                                           timeout):
    make_notebook(project / "nb.ipynb", [REPORT, ending])
    exp = write_experiment(f"experiment: ends\nnotebooks: [nb.ipynb]\ntimeout: {timeout}\n")
    (record,) = submit(exp, progress=False).records
    assert record.status == status
    _assert_private_ipc(_connection(project, record), private_tmp)
    assert not list(private_tmp.iterdir()), "the kernel's folder was left behind"


def test_nothing_is_left_after_a_cancel_with_kernels_started_ahead(project, write_experiment, private_tmp):
    make_notebook(project / "nb.ipynb", [REPORT, "import time; time.sleep(60)"])
    exp = write_experiment("experiment: cancelipc\nnotebooks: [nb.ipynb]\nsweep: {grid: {A: [1, 2, 3, 4]}}\n"
                           "resources: {max_parallel: 1}\nbackend: {name: local, prestart: 2}\n")
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("result", submit(exp, progress=False)))
    thread.start()
    deadline = time.time() + 60  # the running kernel and the two started ahead have their folders
    while time.time() < deadline and len(list(private_tmp.glob("nbbatch-k*/kernel.json"))) < 3:
        time.sleep(0.1)
    assert len(list(private_tmp.glob("nbbatch-k*/kernel.json"))) >= 3
    nbbatch.cancel("cancelipc")
    thread.join(60)
    assert sorted(r.status for r in box["result"].records) == ["cancelled"] * 4
    assert not list(private_tmp.iterdir()), "a kernel's folder was left behind"


def _wait_sockets(folder: Path) -> list[str]:
    deadline = time.time() + 60  # the kernel binds its sockets once started
    while time.time() < deadline and len(list(folder.glob("nbbatch-k*/k-*"))) < 5:
        time.sleep(0.05)
    return sorted(p.name for p in folder.glob("nbbatch-k*/*"))


def test_kernels_started_ahead_and_never_used_leave_nothing(tmp_path, private_tmp):
    pool = KernelPool(1)
    env = dict(os.environ, NBBATCH_RUN_ID="a")
    assert pool.prestart("a", "python3", env, str(tmp_path))
    assert _wait_sockets(private_tmp) == ["k-1", "k-2", "k-3", "k-4", "k-5", "kernel.json"]
    assert pool.take("a", "python3", dict(env, NBBATCH_RUN_ID="other"), str(tmp_path)) is None  # settings changed
    assert not list(private_tmp.iterdir())
    assert pool.prestart("b", "python3", env, str(tmp_path))
    assert len(_wait_sockets(private_tmp)) == 6
    pool.close()  # the batch ended before run b
    assert not list(private_tmp.iterdir())
    assert not list(tmp_path.iterdir()), "sockets were made in the kernel's working directory"


@pytest.mark.parametrize("kernel", ["broken", "no-such-kernel"])  # fails to launch; fails before launching
def test_a_kernel_that_cannot_start_leaves_nothing(tmp_path, private_tmp, monkeypatch, kernel):
    from nbbatch.execute.engine import execute_notebook_file

    spec = tmp_path / "jupyter" / "kernels" / "broken"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({"argv": [str(tmp_path / "no-python"), "-f", "{connection_file}"],
                                                  "display_name": "broken", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    make_notebook(tmp_path / "nb.ipynb", ["print(1)"], kernel=kernel)
    with pytest.raises(Exception):  # noqa: B017 - FileNotFoundError or NoSuchKernel
        execute_notebook_file(str(tmp_path / "nb.ipynb"), str(tmp_path / "out.ipynb"), kernel_name=kernel)
    pool = KernelPool(1)  # the same through a kernel started ahead
    assert pool.prestart("a", kernel, dict(os.environ), str(tmp_path))
    started = pool.take("a", kernel, dict(os.environ), str(tmp_path))
    assert started is not None and started.claim(None) is None and started.error is not None
    assert not list(private_tmp.iterdir())


def test_the_folders_of_a_killed_driver_are_removed_by_the_next_one(project, write_experiment, private_tmp, monkeypatch):
    from nbbatch.execute import kernels

    monkeypatch.setattr(kernels, "_swept", set())  # the sweep runs once per process
    code = ("import asyncio, time\nfrom nbbatch.execute.kernels import BatchKernelManager\n"
            "km = BatchKernelManager(kernel_name='python3')\nasyncio.run(km.start_kernel())\n"
            "print(km.provisioner.process.pid, flush=True)\ntime.sleep(600)")
    driver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        kernel = psutil.Process(int(driver.stdout.readline()))
        assert len(_wait_sockets(private_tmp)) == 6
    finally:
        driver.kill()  # kill -9: no clean-up of its own
        driver.wait()
    kernel.kill()  # as the driver's reaper does
    psutil.wait_procs([kernel], timeout=30)
    (killed,) = private_tmp.iterdir()
    live, starting = private_tmp / "nbbatch-klive", private_tmp / "nbbatch-kstarting"
    live.mkdir(mode=0o700)
    starting.mkdir(mode=0o700)  # no sockets yet
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listening:  # another driver's kernel, alive
        listening.bind(str(live / "k-1"))
        listening.listen()
        make_notebook(project / "nb.ipynb", ["print(1)"])
        assert submit(write_experiment("experiment: sweep\nnotebooks: [nb.ipynb]\n"), progress=False).ok
    assert sorted(p.name for p in private_tmp.iterdir()) == ["nbbatch-klive", "nbbatch-kstarting"], killed


def test_tcp_can_be_forced_and_its_connection_file_is_not_left(project, write_experiment, private_tmp, monkeypatch):
    monkeypatch.setenv(TRANSPORT_VARIABLE, "tcp")
    make_notebook(project / "nb.ipynb", [REPORT, "import os; os._exit(1)"])
    (record,) = submit(write_experiment("experiment: tcp\nnotebooks: [nb.ipynb]\n"), progress=False).records
    info = _connection(project, record)
    assert info["transport"] == "tcp" and Path(info["file"]).parent.parent == private_tmp
    assert not list(private_tmp.iterdir())


def test_a_long_tmpdir_still_gets_short_socket_paths(project, write_experiment, private_tmp, monkeypatch):
    long = private_tmp / ("x" * 90)
    long.mkdir()
    monkeypatch.setenv("TMPDIR", str(long))
    monkeypatch.setattr(tempfile, "tempdir", None)
    make_notebook(project / "nb.ipynb", [REPORT])
    (record,) = submit(write_experiment("experiment: long\nnotebooks: [nb.ipynb]\n"), progress=False).records
    info = _connection(project, record)
    assert record.status == "succeeded" and info["transport"] == "ipc"
    assert len(os.fsencode(info["ip"] + "-5")) <= 100
    assert not Path(info["file"]).parent.exists() and not list(long.iterdir())


@pytest.mark.parametrize("value, expected", [("", "ipc"), ("auto", "ipc"), ("ipc", "ipc"), ("TCP", "tcp"),
                                             ("carrier-pigeon", "ipc")])
def test_the_transport_setting(monkeypatch, value, expected):
    monkeypatch.setenv(TRANSPORT_VARIABLE, value)
    assert kernel_transport() == expected
