"""The private CUDA MPS daemon (nbbatch.backends.local.mps), against a fake `nvidia-cuda-mps-control`: no NVIDIA
software needed. The fake daemonizes a Python loop named like MPS that writes its pid file, quits ~0.5 s after
`quit` (so stop() must wait) and notes what happened in a record file outside its folder."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from nbbatch.backends.local import mps
from nbbatch.backends.local.gpus import GpuInfo
from nbbatch.backends.local.mps import MPS_CONTROL, MpsDaemon, check_mps
from nbbatch.errors import BackendError, ValidationError

SRC = Path(__file__).resolve().parents[1] / "src"
LOCK = os.path.join(tempfile.gettempdir(), "nbbatch-test-mps.lock")  # before any test changes the temporary folder
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc, like MPS itself: Linux only")

FAKE = '''#!{python}
"""A fake nvidia-cuda-mps-control: `-d` daemonizes, stdin commands drive the daemon."""
import contextlib, ctypes, json, os, subprocess, sys, time

pipe = sys.argv[2] if sys.argv[1:2] == ["--server"] else os.environ["CUDA_MPS_PIPE_DIRECTORY"]
log = os.environ.get("CUDA_MPS_LOG_DIRECTORY", "")  # a client command needs only the pipe
flag = os.path.join(pipe, "quit-flag")
clients_dir = os.path.join(pipe, "clients")  # a stand-in client notes its pid here: MPS knows its clients


def note(line):
    with open(os.environ["FAKE_MPS_RECORD"], "a") as f:
        f.write(line + "\\n")


def rename(name):  # like the real daemon and servers: /proc/<pid>/comm is nvidia-cuda-mps
    ctypes.CDLL(None).prctl(15, name.encode(), 0, 0, 0)


def spawn(role, env=None):
    return subprocess.Popen([sys.executable, __file__, role, pipe], start_new_session=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)


def comm(pid):
    try:
        with open(f"/proc/{{pid}}/comm") as f:
            return f.read()
    except OSError:
        return ""


def alive(pid):
    try:
        with open(f"/proc/{{pid}}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


def clients():
    try:
        return [int(name) for name in os.listdir(clients_dir) if alive(int(name))]
    except OSError:
        return []


def wait_for(condition):
    deadline = time.monotonic() + 120  # never outlive a broken test for long
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)


def write_pid_file():
    path, text = os.path.join(pipe, "nvidia-cuda-mps-control.pid"), str(os.getpid())
    if os.environ.get("FAKE_MPS_PIDFILE") == "split":  # in place, in two writes: a reader may see the first alone
        first = next((text[:k] for k in range(len(text) - 1, 0, -1) if not os.path.exists(f"/proc/{{text[:k]}}")), "")
        with open(path, "w") as f:
            f.write(first)
            f.flush()
            time.sleep(1.0)
            f.write(text[len(first):] + "\\n")
        return
    with open(os.path.join(pipe, "pid.tmp"), "w") as f:
        f.write(text + "\\n")
    os.replace(os.path.join(pipe, "pid.tmp"), path)


mode = os.environ.get("FAKE_MPS_START", "ok")
if sys.argv[1:] == ["-d"]:
    if mode == "fail":
        with open(os.path.join(log, "control.log"), "a") as f:
            f.write("[fake] no CUDA-capable device is detected\\n")
        sys.exit(1)
    if mode != "nopid":
        spawn("--fork")
    sys.exit(0)
if sys.argv[1:2] == ["--fork"]:  # like the real one: the fork of `-d` forks the daemon and exits
    rename("nvidia-cuda-mps-control")
    spawn("--daemon")
    sys.exit(0)
if sys.argv[1:2] == ["--daemon"]:
    if os.environ.get("FAKE_MPS_NAME"):  # opt-in: a test session beside this one would see it as another MPS
        rename("nvidia-cuda-mps-control")
    keys = ("CUDA_VISIBLE_DEVICES", "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")
    with open(os.path.join(log, "env.json"), "w") as f:
        json.dump({{"pid": os.getpid(), **{{k: os.environ.get(k) for k in keys}}}}, f)
    server_mode = os.environ.get("FAKE_MPS_SERVER")
    if server_mode:
        env = dict(os.environ)
        if os.environ.get("FAKE_MPS_SERVER_ENV") == "clean":  # a server whose environment does not name the pipe
            env = {{k: v for k, v in env.items() if not k.startswith("CUDA_MPS_")}}
        server = spawn("--server", env)
        # the real server is exec'd under its name; this one renames itself once Python has started, which a loaded
        # machine can delay past stop()'s look at the daemon's process tree
        wait_for(lambda: comm(server.pid).startswith("nvidia-cuda-mps"))
        with open(os.path.join(pipe, "servers"), "w") as f:
            f.write(f"{{server.pid}}\\n")
        note(f"server {{server.pid}}")
    note(f"daemon {{os.getpid()}}")  # before the pid file: once start() returns, the record names the daemon
    write_pid_file()
    wait_for(lambda: os.path.exists(flag))
    if clients():  # like MPS: quit waits for the clients still connected
        note("quit with clients")
        wait_for(lambda: not clients())
    if server_mode != "graceful":  # a graceful server outlives the daemon, which leaves at once
        time.sleep(0.5)  # shutdown is asynchronous: `quit` returns before the daemon is gone
    note("daemon quit")
    sys.exit(0)
if sys.argv[1:2] == ["--server"]:
    rename("nvidia-cuda-mps-server")
    if os.environ.get("FAKE_MPS_SERVER") != "graceful":  # one that ignores quit: stop() must find and kill it
        time.sleep(120)
        sys.exit(0)
    wait_for(lambda: os.path.exists(flag))  # told to go by the daemon, it leaves once its clients have...
    wait_for(lambda: not clients())
    time.sleep(1.0)  # ...and it has torn down its GPU contexts: after the daemon is gone
    note("server quit")
    sys.exit(0)
for line in sys.stdin:
    command = line.strip()
    note(f"command {{command}}")
    if command == "get_server_list" and os.environ.get("FAKE_MPS_LIST") != "empty":
        with contextlib.suppress(OSError), open(os.path.join(pipe, "servers")) as f:
            print(*[p for p in f.read().split() if alive(int(p))], sep="\\n")
    if command == "quit" and os.environ.get("FAKE_MPS_QUIT") != "ignore":
        open(flag, "w").close()
'''


@pytest.fixture
def short_tmp(monkeypatch):
    """A short temporary folder as tempfile's default (pytest's tmp_path is too long for socket paths)."""
    base = tempfile.mkdtemp(prefix="mps", dir="/tmp")
    monkeypatch.setattr(tempfile, "tempdir", base)
    yield Path(base)
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def fake(tmp_path, monkeypatch, short_tmp):
    """The fake control binary first on PATH; returns the record file it writes."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    binary = bin_dir / MPS_CONTROL
    binary.write_text(FAKE.format(python=sys.executable))
    binary.chmod(0o755)
    record = tmp_path / "record.txt"
    record.touch()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("FAKE_MPS_RECORD", str(record))
    for var in ("FAKE_MPS_START", "FAKE_MPS_QUIT", "FAKE_MPS_SERVER", "FAKE_MPS_NAME", "FAKE_MPS_SERVER_ENV",
                "FAKE_MPS_LIST", "FAKE_MPS_PIDFILE", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    yield record


@pytest.fixture(autouse=True)
def _one_session_at_a_time():
    # check_mps looks at the whole machine: a test session beside this one (same file) must not see our fakes
    import fcntl

    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
        for daemon in list(mps._live):  # a failing test must not leave its fake daemon to the next ones
            daemon.stop_timeout = 1.0  # the fake may be off PATH by now: kill it soon
            daemon.stop()


def _alive(pid: int) -> bool:
    return mps._alive(pid)


def _lines(record: Path, word: str) -> list[str]:
    return [line.split(" ", 1)[1] for line in record.read_text().splitlines() if line.startswith(word + " ")]


def test_start_writes_private_folder_and_sees_driven_gpus(fake):
    daemon = MpsDaemon([2, 5]).start()
    try:
        assert daemon.running and daemon.pid is not None and _alive(daemon.pid)
        folder = daemon.folder
        assert folder is not None and os.path.basename(folder).startswith("nbbatch-mps-")
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        seen = json.loads(Path(folder, "log", "env.json").read_text())
        assert seen["pid"] == daemon.pid
        assert seen["CUDA_VISIBLE_DEVICES"] == "2,5"
        assert seen["CUDA_MPS_PIPE_DIRECTORY"] == os.path.join(folder, "pipe")
        assert seen["CUDA_MPS_LOG_DIRECTORY"] == os.path.join(folder, "log")
        assert daemon.start() is daemon and _lines(fake, "daemon") == [str(daemon.pid)]  # idempotent: one daemon
    finally:
        daemon.stop()


def test_client_env_renumbers_gpus_as_mps_shows_them(fake):
    with MpsDaemon([2, 5]) as daemon:
        folder = daemon.folder
        assert folder is not None
        assert daemon.client_env([5]) == {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(folder, "pipe"),
                                          "CUDA_MPS_LOG_DIRECTORY": os.path.join(folder, "log"),
                                          "CUDA_VISIBLE_DEVICES": "1"}
        assert daemon.client_env([5, 2])["CUDA_VISIBLE_DEVICES"] == "1,0"
        with pytest.raises(ValueError, match="GPU 3"):
            daemon.client_env([3])
        with pytest.raises(ValueError):
            daemon.client_env([])


def test_bad_gpu_ids_and_client_env_before_start():
    for bad in ([], [1, 1], [-1]):
        with pytest.raises(ValueError):
            MpsDaemon(bad)
    with pytest.raises(RuntimeError):
        MpsDaemon([0]).client_env([0])


def test_stop_waits_for_quit_removes_folder_and_is_idempotent(fake):
    daemon = MpsDaemon([0]).start()
    pid, folder = daemon.pid, daemon.folder
    assert pid is not None and folder is not None
    daemon.stop()
    assert not _alive(pid)
    assert not os.path.exists(folder)
    assert daemon.pid is None and daemon.folder is None and not daemon.running
    assert _lines(fake, "command") == ["get_server_list", "quit"]  # servers asked before quitting
    assert _lines(fake, "daemon")[-1] == "quit"  # it left by itself: stop() waited out its slow exit
    daemon.stop()
    assert daemon not in mps._live


def test_daemon_ignoring_quit_is_killed(fake, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_QUIT", "ignore")
    daemon = MpsDaemon([0], stop_timeout=0.3).start()
    pid, folder = daemon.pid, daemon.folder
    assert pid is not None and folder is not None
    daemon.stop()
    assert not _alive(pid)
    assert not os.path.exists(folder)
    assert "quit" not in _lines(fake, "daemon")


def test_server_left_behind_is_killed(fake, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_SERVER", "1")
    monkeypatch.setenv("FAKE_MPS_NAME", "1")
    daemon = MpsDaemon([0], stop_timeout=1.0).start()
    servers = [int(p) for p in _lines(fake, "server")]
    assert servers and all(_alive(p) for p in servers)
    check_mps([GpuInfo(0, "H100", 81559)])  # our own daemon and its server are not "another MPS"
    daemon.stop()
    assert not any(_alive(p) for p in servers)


def test_failed_start_raises_with_control_log_and_cleans_up(fake, monkeypatch, short_tmp):
    monkeypatch.setenv("FAKE_MPS_START", "fail")
    daemon = MpsDaemon([0])
    with pytest.raises(BackendError, match="no CUDA-capable device is detected"):
        daemon.start()
    assert daemon.folder is None and not list(short_tmp.iterdir())
    assert daemon not in mps._live


def test_missing_pid_file_times_out_and_cleans_up(fake, monkeypatch, short_tmp):
    monkeypatch.setenv("FAKE_MPS_START", "nopid")
    with pytest.raises(BackendError, match="nvidia-cuda-mps-control.pid"):
        MpsDaemon([0], start_timeout=0.3).start()
    assert not list(short_tmp.iterdir())


def test_long_tmpdir_falls_back_to_tmp(fake, monkeypatch, tmp_path):
    long = tmp_path / ("x" * 90)
    long.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long))
    with MpsDaemon([0]) as daemon:
        assert daemon.folder is not None and os.path.dirname(daemon.folder) == "/tmp"


def test_forked_child_exit_leaves_parent_daemon(fake, monkeypatch):
    daemon = MpsDaemon([0]).start()
    with monkeypatch.context() as patch:
        patch.setattr(mps.os, "getpid", lambda: -1)  # as a forked child sees it: not the daemon's owner
        mps._stop_live_daemons()
    assert daemon.running
    daemon.stop()
    assert _lines(fake, "daemon")[-1] == "quit"


# check_mps


H100 = GpuInfo(0, "NVIDIA H100 80GB HBM3", 81559)


def test_check_accepts_default_and_exclusive_process(fake):
    check_mps([H100, GpuInfo(1, "NVIDIA H100 80GB HBM3", 81559, compute_mode="exclusive_process")])


def test_check_refuses_no_gpus(fake):
    with pytest.raises(ValidationError, match="resources.gpus"):
        check_mps([])


def test_check_refuses_without_binary(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    with pytest.raises(ValidationError, match="NVIDIA driver") as refusal:
        check_mps([H100])
    assert MPS_CONTROL in str(refusal.value) and "resources.mps" in str(refusal.value)


@pytest.mark.parametrize("mode", ["prohibited", "exclusive_thread"])
def test_check_refuses_compute_mode(fake, mode):
    with pytest.raises(ValidationError) as refusal:
        check_mps([H100, GpuInfo(3, "NVIDIA H100 80GB HBM3", 81559, compute_mode=mode)])
    message = str(refusal.value)
    assert "GPU 3" in message and "-c DEFAULT" in message and mode.upper() in message


def test_check_refuses_another_mps_daemon(fake, tmp_path):
    impostor = tmp_path / MPS_CONTROL  # its comm is truncated to `nvidia-cuda-mps`, like the real daemon's
    shutil.copy("/bin/sleep", impostor)
    process = subprocess.Popen([str(impostor), "60"])
    try:
        # Popen may return (vfork) before exec has renamed the child: wait for the name
        deadline = time.monotonic() + 30
        while mps._comm(process.pid) != "nvidia-cuda-mps" and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(ValidationError) as refusal:
            check_mps([H100])
        message = str(refusal.value)
        assert f"pid {process.pid}" in message and "echo quit |" in message and "resources.mps" in message
    finally:
        process.kill()
        process.wait()


# Ctrl-C and exceptions in a driver process


def _driver(tmp_path: Path, body: str) -> subprocess.Popen[str]:
    script = tmp_path / "driver.py"
    script.write_text("from nbbatch.backends.local.mps import MpsDaemon\nimport time\n" + textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))}
    # SIGINT back to default: a test runner started in the background passes it on ignored
    return subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _ready(process: subprocess.Popen[str]) -> tuple[int, str]:
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line:
        process.wait(timeout=60)
        pytest.fail(f"the driver ended before its daemon started: {process.stderr.read() if process.stderr else ''}")
    pid, folder = line.split()
    assert _alive(int(pid)) and os.path.isdir(folder)
    return int(pid), folder


def test_ctrl_c_stops_the_daemon_cleanly(fake, tmp_path):
    process = _driver(tmp_path, """
        with MpsDaemon([0]) as daemon:
            print(daemon.pid, daemon.folder, flush=True)
            time.sleep(120)
    """)
    try:
        pid, folder = _ready(process)
        os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert "KeyboardInterrupt" in err
    assert not _alive(pid) and not os.path.exists(folder)
    assert _lines(fake, "daemon")[-1] == "quit"  # quit by stop(), not hit by the Ctrl-C (a session of its own)


def test_exception_without_with_is_cleaned_at_exit(fake, tmp_path):
    process = _driver(tmp_path, """
        daemon = MpsDaemon([0]).start()
        print(daemon.pid, daemon.folder, flush=True)
        raise RuntimeError("the driver failed")
    """)
    try:
        pid, folder = _ready(process)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 1 and "the driver failed" in err
    assert not _alive(pid) and not os.path.exists(folder)
    assert _lines(fake, "daemon")[-1] == "quit"


def test_check_tells_a_busy_daemon_from_a_left_over_one_and_stops_that(fake, tmp_path, monkeypatch, caplog):
    import logging

    monkeypatch.setenv("FAKE_MPS_NAME", "1")
    process = _driver(tmp_path, """
        with MpsDaemon([0]) as daemon:
            print(daemon.pid, daemon.folder, flush=True)
            time.sleep(120)
    """)
    pid, folder = 0, ""
    try:
        pid, folder = _ready(process)
        with pytest.raises(ValidationError, match=f"another nbbatch \\(pid {process.pid}\\).*Wait until"):
            check_mps([H100])
        assert _alive(pid), "a daemon in use is left alone"
        process.kill()  # kill -9: no clean-up of its own runs
        process.communicate(timeout=60)
        with caplog.at_level(logging.WARNING, logger="nbbatch.backends.local.mps"):
            check_mps([H100])  # the daemon it left is nbbatch's own and unused: stopped, not a reason to refuse
        assert f"[{pid}] left running by an nbbatch that has gone" in caplog.text
        assert not _alive(pid) and _lines(fake, "daemon")[-1] == "quit", "asked to quit, not killed"
        assert not os.path.exists(folder)
    finally:
        process.kill()
        if pid and mps._alive(pid):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(folder, ignore_errors=True)


# --- the local backend with `resources.mps` (stand-in GPUs, CPU kernels, the fake daemon) -----------------

RECORD_CLIENT = ("import os, time, nbbatch\n"
                 "nbbatch.record(pipe=os.environ.get('CUDA_MPS_PIPE_DIRECTORY', ''), "
                 "devices=os.environ['CUDA_VISIBLE_DEVICES'])\ntime.sleep(SLEEP)")


@pytest.fixture
def two_gpus(monkeypatch):
    from nbbatch.backends.local import backend as local

    monkeypatch.setattr(local, "detect_gpus", lambda: [GpuInfo(3, "Fake 3", 1000), GpuInfo(5, "Fake 5", 1000)])


@pytest.mark.kernel
def test_local_runs_are_clients_of_a_daemon_started_and_stopped_for_the_batch(fake, two_gpus, project,
                                                                              write_experiment):
    from support.notebooks import make_notebook

    from nbbatch.api import submit

    make_notebook(project / "nb.ipynb", [RECORD_CLIENT], parameters="A = 1\nSLEEP = 0.0")
    exp = write_experiment("experiment: mpsruns\nnotebooks: [nb.ipynb]\nsweep: {grid: {A: [1, 2, 3, 4]}}\n"
                           "resources: {gpus: 1, runs_per_gpu: 2, mps: true}\n")
    records = submit(exp, progress=False).records
    assert [r.status for r in records] == ["succeeded"] * 4, [r.error for r in records]
    assert all(r.gpu_share.mps for r in records)
    pipes = {r.metrics["pipe"] for r in records}
    assert len(pipes) == 1 and pipes != {""}, "every run is a client of the one daemon"
    assert not Path(pipes.pop()).exists(), "its folder is gone once the batch ended"
    # MPS numbers the driven GPUs 3 and 5 as 0 and 1: each kernel sees its GPU's position
    assert {(r.gpu_ids[0], r.metrics["devices"]) for r in records} == {(3, "0"), (5, "1")}
    assert _lines(fake, "daemon")[-1] == "quit" and "command quit" in fake.read_text()


def test_mps_is_refused_before_anything_runs_without_the_binary(two_gpus, project, write_experiment, monkeypatch,
                                                                tmp_path):
    from support.notebooks import make_notebook

    from nbbatch.api import submit

    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    make_notebook(project / "nb.ipynb", ["pass"])
    exp = write_experiment("experiment: nompsbin\nnotebooks: [nb.ipynb]\nresources: {gpus: 1, mps: true}\n")
    with pytest.raises(ValidationError, match=MPS_CONTROL):
        submit(exp, progress=False)
    assert not (project / "results" / "nompsbin").exists()


@pytest.mark.kernel
def test_ctrl_c_during_a_batch_stops_the_daemon(fake, two_gpus, project, write_experiment):
    import _thread
    import threading

    from support.notebooks import make_notebook

    import nbbatch
    from nbbatch.api import submit

    # The runs sleep far longer than the presser waits: Ctrl-C always comes while the batch runs, also on a
    # machine so loaded that the presser never sees a run's first cell done.
    make_notebook(project / "nb.ipynb", [RECORD_CLIENT], parameters="A = 1\nSLEEP = 600.0")
    exp = write_experiment("experiment: mpsctrlc\nnotebooks: [nb.ipynb]\nsweep: {grid: {A: [1, 2]}}\n"
                           "resources: {gpus: 1, mps: true}\n")

    def press_ctrl_c_once_running() -> None:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if mps._live and any(r.status == "running" and r.cells_done >= 1 for r in nbbatch.status("mpsctrlc")):
                    break
            except nbbatch.NbbatchError:
                pass
            time.sleep(0.2)
        _thread.interrupt_main()  # what Ctrl-C does: KeyboardInterrupt in the main thread

    # A terminal's Ctrl-C needs Python's handler; a test runner started in the background (`cmd &`) inherits SIGINT
    # ignored, and then interrupt_main() does nothing.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    presser = threading.Thread(target=press_ctrl_c_once_running, daemon=True)
    presser.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            submit(exp, progress=False)
    finally:
        signal.signal(signal.SIGINT, previous)
    presser.join(5)
    assert _lines(fake, "daemon")[-1] == "quit", "the daemon was asked to quit, not left running"
    assert not mps._live
    assert {r.status for r in nbbatch.status("mpsctrlc")} == {"cancelled"}


# --- stopping against the races of a real MPS (issue 33: a daemon's server left running after a batch) ---------

CLIENT = ("import os, sys, time\n"
          "folder = os.path.join(os.environ['CUDA_MPS_PIPE_DIRECTORY'], 'clients')\n"
          "os.makedirs(folder, exist_ok=True)\n"
          "open(os.path.join(folder, str(os.getpid())), 'w').close()\n"
          "while not os.path.exists(sys.argv[1]):\n"
          "    time.sleep(0.02)\n")


def test_stop_waits_for_a_server_that_outlives_its_daemon(fake, monkeypatch):
    # MPS's `quit` is asynchronous: the daemon may be gone while its server still tears down its GPU contexts
    monkeypatch.setenv("FAKE_MPS_SERVER", "graceful")
    daemon = MpsDaemon([0], stop_timeout=60).start()
    server = int(_lines(fake, "server")[0])
    daemon.stop()
    assert not _alive(server)
    assert _lines(fake, "server") == [str(server), "quit"], "the server left by itself, not killed mid-teardown"


def test_stop_finds_a_reparented_server_that_names_no_pipe(fake, monkeypatch):
    # A server not in get_server_list whose environment does not name the pipe, re-parented once its daemon has
    # gone: only the daemon's process tree, taken before `quit`, still finds it.
    monkeypatch.setenv("FAKE_MPS_SERVER", "graceful")
    monkeypatch.setenv("FAKE_MPS_SERVER_ENV", "clean")
    monkeypatch.setenv("FAKE_MPS_LIST", "empty")
    daemon = MpsDaemon([0], stop_timeout=60).start()
    server = int(_lines(fake, "server")[0])
    try:
        assert mps._parent_of(server) == daemon.pid
        daemon.stop()
        assert not _alive(server), "the server outlived stop()"
        assert _lines(fake, "server")[-1] == "quit"
    finally:
        if _alive(server):
            os.kill(server, signal.SIGKILL)


def test_stop_waits_for_the_last_clients_before_quit(fake, tmp_path, caplog):
    import logging
    import threading

    from support.waiting import wait_until

    caplog.set_level(logging.INFO, logger="nbbatch.backends.local.mps")
    daemon = MpsDaemon([0], stop_timeout=60).start()
    release = tmp_path / "release"
    pipe = daemon.pipe_dir
    assert pipe is not None
    # a run's kernel still exiting when the batch ends: a client of the daemon
    client = subprocess.Popen([sys.executable, "-c", CLIENT, str(release)],
                              env={**os.environ, **daemon.client_env([0])})
    try:
        wait_until(lambda: os.path.exists(os.path.join(pipe, "clients", str(client.pid))), 60, "the client")
        stopper = threading.Thread(target=daemon.stop)
        stopper.start()
        wait_until(lambda: "command quit" in fake.read_text() or "waiting for its clients" in caplog.text, 60,
                   "stop() to quit or to wait for the client")
        assert "command quit" not in fake.read_text(), "quit was sent while a client was still connected"
        release.touch()
        stopper.join(120)
        assert not stopper.is_alive()
    finally:
        release.touch()
        client.wait(60)
    assert "quit with clients" not in _lines(fake, "daemon") and _lines(fake, "daemon")[-1] == "quit"
    assert _lines(fake, "command") == ["get_server_list", "quit"]


def test_a_pid_file_read_half_written_is_not_taken_for_the_daemon(fake, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_PIDFILE", "split")
    daemon = MpsDaemon([0]).start()
    recorded = int(_lines(fake, "daemon")[0])
    assert daemon.pid == recorded, "start() took the pid file's first half for the daemon's pid"
    daemon.stop()
    assert not _alive(recorded) and _lines(fake, "daemon")[-1] == "quit", "the daemon was asked to quit, not killed"


def _stray_server(env: dict[str, str], pipe: str) -> subprocess.Popen[bytes]:
    binary = shutil.which(MPS_CONTROL)
    assert binary is not None
    server = subprocess.Popen([binary, "--server", pipe], env={**os.environ, **env, "CUDA_MPS_PIPE_DIRECTORY": pipe},
                              start_new_session=True)
    from support.waiting import wait_until

    wait_until(lambda: mps._comm(server.pid) == "nvidia-cuda-mps", 60, "the stand-in server's name")
    return server


def test_check_stops_a_server_left_by_an_nbbatch_whose_folder_is_gone(fake, caplog, short_tmp):
    import logging

    pipe = os.path.join(str(short_tmp), "nbbatch-mps-gone1234", "pipe")  # removed by the stop() it outlived
    server = _stray_server({}, pipe)
    try:
        with caplog.at_level(logging.WARNING, logger="nbbatch.backends.local.mps"):
            check_mps([H100])
        assert mps._wait_gone([server.pid], 60)
        assert f"{server.pid}" in caplog.text and "left running" in caplog.text
    finally:
        server.kill()
        server.wait()


def test_check_still_refuses_a_server_of_a_folder_that_is_not_nbbatchs(fake, short_tmp):
    server = _stray_server({}, os.path.join(str(short_tmp), "someone-mps", "pipe"))
    try:
        with pytest.raises(ValidationError, match=f"pid {server.pid}"):
            check_mps([H100])
        assert _alive(server.pid)
    finally:
        server.kill()
        server.wait()


NON_REAPING_INIT = '''
import ctypes, subprocess, sys, time
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # a subreaper, like a container's first process, that reaps nobody
driver = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
driver.wait()  # the driver itself is reaped: only what it orphaned is left
time.sleep(float(sys.argv[2]))
zombies = []
import os
for entry in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open(f"/proc/{entry}/stat") as f:
            state, ppid = f.read().rpartition(")")[2].split()[:2]
    except OSError:
        continue
    if int(ppid) == os.getpid():  # the fake daemon is named so only on request: any process it was left
        zombies.append((int(entry), state))
print(zombies)
'''

DRIVER = '''
import sys
sys.path.insert(0, {src!r})
from nbbatch.backends.local.mps import MpsDaemon
daemon = MpsDaemon([0]).start()
daemon.stop()
'''


def test_the_daemon_is_reaped_under_a_first_process_that_reaps_nobody(fake):
    """`-d` daemonizes through an intermediate process: re-parented to a container's first process that never
    reaps, one was left a zombie after every batch (seen on an H200). nbbatch adopts the intermediate process and
    the daemon while starting it and reaps them."""
    done = subprocess.run([sys.executable, "-c", NON_REAPING_INIT, DRIVER.format(src=str(SRC)), "1.0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"processes left to the first process: {done.stdout}"
    assert _lines(fake, "daemon")[-1] == "quit"
