"""A private CUDA MPS (Multi-Process Service) control daemon for the GPUs a batch drives.

Kernels sharing one GPU time-slice unless MPS is on. With ``resources: {mps: true}`` the local backend
checks the machine (:func:`check_mps`), starts an :class:`MpsDaemon` of its own (pipe and log folders in
a new private temporary folder, so it never meets a system-wide MPS), makes every run's kernel a client
of it (:meth:`MpsDaemon.client_env`) and stops it at the end. A daemon this process started and did not
stop (an exception, Ctrl-C) is stopped at exit at the latest: nothing is left running.

Stopping allows for MPS being asynchronous: the runs' kernels may still be exiting when the batch ends (``quit``
waits for its clients), and the daemon may leave before its servers, which are then re-parented and may not name
the pipe folder in their environment. So :meth:`MpsDaemon.stop` waits for the daemon's clients first, notes the
daemon's process tree before ``quit``, and waits for all of it, killing only what outlives ``stop_timeout``. A
daemon or server that an nbbatch which has gone left running anyway is stopped by the next :func:`check_mps`.

`nvidia-cuda-mps-control -d` daemonizes: its daemon would be re-parented to the nearest subreaper or init, and a
container's first process that reaps nobody keeps it a zombie once it quits. So this process adopts it (a child
subreaper while the daemon starts) and reaps it when it is stopped.

The daemon sees only the driven GPUs (``CUDA_VISIBLE_DEVICES``); MPS renumbers them from 0 for its
clients, so a client names its GPUs by their position in the daemon's list.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from types import TracebackType

from nbbatch.backends.local.gpus import GpuInfo
from nbbatch.backends.local.orphans import adopting_orphans, reap, reap_exited_children
from nbbatch.errors import BackendError, ValidationError
from nbbatch.store.lock import pid_alive

MPS_CONTROL = "nvidia-cuda-mps-control"
MPS_COMM = "nvidia-cuda-mps"  # /proc/<pid>/comm of both the control daemon and its servers (15 characters)
PID_FILE = "nvidia-cuda-mps-control.pid"  # written by the daemon in its pipe folder
START_TIMEOUT = 10.0  # seconds for the daemon to write its pid file
STOP_TIMEOUT = 10.0  # seconds for the clients to go before `quit`, and for the daemon and servers to go after it
KILL_TIMEOUT = 10.0  # seconds for a killed MPS process to be gone (a server tearing down GPU contexts takes a while)
COMMAND_TIMEOUT = 5.0  # seconds for one `nvidia-cuda-mps-control` client command
SOCKET_PATH_MAX = 100  # bytes: MPS's sockets must fit sun_path (as in kernels.py, not imported: it pulls in ZeroMQ)
_FOLDER_PREFIX = "nbbatch-mps-"
_LONGEST_NAME = 32  # room for the longest socket name MPS makes in its pipe folder (`control_privileged`…)
_FOLDER_LEN = len(os.sep + _FOLDER_PREFIX + "x" * 8 + os.sep + "pipe" + os.sep) + _LONGEST_NAME
OWNER_FILE = "owner"  # the pid of the nbbatch that started the daemon, next to its pipe folder
OWNER_ENV = "NBBATCH_MPS_OWNER"  # the same in the daemon's environment: still there once the folder is removed
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
_POLL = 0.05  # seconds between two looks at the processes while waiting
_LOG_TAIL = 2000  # characters of control.log quoted in an error
logger = logging.getLogger(__name__)


def check_mps(gpus: Sequence[GpuInfo]) -> None:
    """Refuse (:class:`ValidationError`) where nbbatch cannot run its own MPS daemon for ``gpus``, saying why and what to do."""
    if not gpus:
        raise ValidationError(
            "resources.mps needs GPU runs: set resources.gpus to 1 or more on a machine with an NVIDIA GPU, "
            "or drop resources.mps.")
    if shutil.which(MPS_CONTROL) is None:
        raise ValidationError(
            f"resources.mps needs `{MPS_CONTROL}` on PATH; it comes with the NVIDIA driver (and the CUDA toolkit). "
            "Install it or add its folder to PATH, or drop resources.mps to run without MPS.")
    for gpu in gpus:
        # exclusive_process is fine: it is the mode NVIDIA recommends with MPS
        if gpu.compute_mode == "prohibited":
            raise ValidationError(
                f"GPU {gpu.index} ({gpu.name}) is in compute mode PROHIBITED: no CUDA program, MPS included, may use it. "
                f"Reset it with `nvidia-smi -i {gpu.index} -c DEFAULT` (as root), or leave GPU {gpu.index} out.")
        if gpu.compute_mode == "exclusive_thread":
            raise ValidationError(
                f"GPU {gpu.index} ({gpu.name}) is in compute mode EXCLUSIVE_THREAD, which MPS does not support. "
                f"Set it with `nvidia-smi -i {gpu.index} -c DEFAULT` (or EXCLUSIVE_PROCESS), or drop resources.mps.")
    _stop_leftovers()
    foreign = _foreign_mps_pids()
    if foreign:
        raise _refusal(foreign)


def _refusal(foreign: Sequence[int]) -> ValidationError:
    """Why nbbatch does not start its daemon beside the MPS processes ``foreign``, and what to do."""
    pid = foreign[0]
    env = _environ_of(pid)
    pipe = env.get(PIPE_ENV)
    others = f"; also pids {', '.join(map(str, foreign[1:]))}" if len(foreign) > 1 else ""
    owner = _owner(env, pipe)
    if owner is not None and owner != os.getpid() and _alive(owner):  # in use: stopping it would break its runs
        return ValidationError(
            f"another nbbatch (pid {owner}) runs its own CUDA MPS daemon on this machine (pid {pid}{others}); "
            "two MPS daemons cannot share GPUs. Wait until that nbbatch is done, or drop resources.mps.")
    whose = (" It was left running by an nbbatch that has gone, and could not be stopped."
             if _left_over(pid) else "")
    how = (f"`kill -9 {pid}`" if pipe and not os.path.isdir(pipe)  # its folder is gone: nobody can ask it to quit
           else f"`echo quit | {f'{PIPE_ENV}={pipe} ' if pipe else ''}{MPS_CONTROL}`")
    return ValidationError(
        f"another CUDA MPS daemon or server is already running on this machine (pid {pid}{others}); CUDA programs may "
        f"already go through it, and nbbatch runs its own private one.{whose} Stop it with {how} (as the user that "
        "started it), or drop resources.mps.")


def _stop_leftovers() -> None:
    """Stop, with a warning, the MPS daemons and servers that an nbbatch which has gone left running (killed before it
    could stop them, or outlived its stop): nobody uses them, and they would keep every later batch from MPS."""
    left: dict[str, list[int]] = {}
    for pid in _foreign_mps_pids():
        pipe = _left_over(pid)
        if pipe is not None:
            left.setdefault(pipe, []).append(pid)
    for pipe, pids in left.items():
        logger.warning("stopping CUDA MPS processes %s left running by an nbbatch that has gone (%s=%s)",
                       pids, PIPE_ENV, pipe)
        daemon = _read_pid(os.path.join(pipe, PID_FILE))
        if not _shut_down(daemon if daemon in pids else None, pipe, shutil.which(MPS_CONTROL), STOP_TIMEOUT, pids):
            shutil.rmtree(os.path.dirname(pipe), ignore_errors=True)  # an nbbatch folder of this user (_left_over)


class MpsDaemon:
    """A private MPS control daemon for GPU indices ``gpu_ids``: its pipe and log folders in a new 0700
    temporary folder, stopped (with its servers) and removed by :meth:`stop`."""

    def __init__(self, gpu_ids: Sequence[int], *, start_timeout: float = START_TIMEOUT,
                 stop_timeout: float = STOP_TIMEOUT) -> None:
        ids = [int(i) for i in gpu_ids]
        if not ids or any(i < 0 for i in ids) or len(set(ids)) != len(ids):
            raise ValueError(f"an MPS daemon needs distinct GPU indices ≥ 0, not {list(gpu_ids)!r}")
        self.gpu_ids: tuple[int, ...] = tuple(ids)
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self._folder: str | None = None
        self._pid: int | None = None
        self._control: str | None = None  # the binary found at start, used again to stop (PATH may change meanwhile)
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        return f"MpsDaemon(gpu_ids={list(self.gpu_ids)!r}, pid={self._pid!r}, folder={self._folder!r})"

    @property
    def pid(self) -> int | None:
        """The control daemon's process id (None before start and after stop)."""
        return self._pid

    @property
    def folder(self) -> str | None:
        """The private folder holding the pipe and log folders (None before start and after stop)."""
        return self._folder

    @property
    def running(self) -> bool:
        """Whether the control daemon is alive."""
        pid = self._pid
        return pid is not None and _alive(pid)

    @property
    def pipe_dir(self) -> str | None:
        """``CUDA_MPS_PIPE_DIRECTORY`` of this daemon (None when not started)."""
        return os.path.join(self._folder, "pipe") if self._folder else None

    @property
    def log_dir(self) -> str | None:
        """``CUDA_MPS_LOG_DIRECTORY`` of this daemon (None when not started)."""
        return os.path.join(self._folder, "log") if self._folder else None

    def start(self) -> MpsDaemon:
        """Start the daemon and wait for its pid file; :class:`BackendError` (all cleaned up) if it does not come up."""
        with self._lock:
            if self._folder is not None:
                return self
            control = shutil.which(MPS_CONTROL)
            if control is None:
                raise BackendError(f"cannot start CUDA MPS: `{MPS_CONTROL}` is not on PATH (drop resources.mps)")
            self._control = control
            self._folder = _private_folder()
            with _live_lock:
                _live[self] = os.getpid()
            try:
                self._start(control)
            except BaseException:  # Ctrl-C while starting too: leave nothing behind
                self.stop()
                raise
            logger.info("started CUDA MPS daemon %s for GPUs %s in %s", self._pid, self.gpu_ids, self._folder)
            return self

    def _start(self, control: str) -> None:
        pipe, log = self.pipe_dir, self.log_dir
        assert pipe is not None and log is not None
        os.mkdir(pipe, 0o700)
        with open(os.path.join(self._folder or "", OWNER_FILE), "w") as f:
            f.write(f"{os.getpid()}\n")  # tells another nbbatch whether this daemon is in use or left over
        os.mkdir(log, 0o700)
        env = self._env()
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in self.gpu_ids)  # its servers touch no other GPU
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA numbers GPUs as NVML does (the indices nbbatch uses)
        env[OWNER_ENV] = str(os.getpid())
        # its output goes to a file, not a pipe: a daemonized child that kept the pipe open would block us
        out_path = os.path.join(self._folder or "", "start.out")
        # `-d` forks and its fork forks the daemon: adopted while it starts, this process reaps them (_reap_adopted)
        with adopting_orphans():
            try:
                with open(out_path, "wb") as out:
                    # a session of its own: a Ctrl-C in the terminal must not reach it before we stop it cleanly
                    done = subprocess.run([control, "-d"], env=env, stdin=subprocess.DEVNULL, stdout=out,
                                          stderr=subprocess.STDOUT, start_new_session=True, timeout=self.start_timeout,
                                          check=False)
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise BackendError(f"cannot start CUDA MPS (`{MPS_CONTROL} -d`): {exc}{self._diagnosis(out_path)}") from exc
            if done.returncode != 0:
                raise BackendError(f"cannot start CUDA MPS: `{MPS_CONTROL} -d` exited with {done.returncode}"
                                   f"{self._diagnosis(out_path)}")
            deadline = time.monotonic() + self.start_timeout
            # a pid file being written may hold the first digits alone: the pid must be a running daemon of this folder
            while (pid := _read_pid(os.path.join(pipe, PID_FILE))) is None or not _is_mps(pid, pipe):
                if time.monotonic() > deadline:
                    raise BackendError(f"cannot start CUDA MPS: no {PID_FILE} naming a running daemon after "
                                       f"{self.start_timeout:g} s{self._diagnosis(out_path)}")
                time.sleep(0.02)
            self._pid = pid
            _wait_adopted(pid)
        _reap_adopted()  # `-d`'s intermediate process, gone once the daemon runs

    def _diagnosis(self, out_path: str) -> str:
        """What the daemon said: its output and the tail of control.log."""
        parts = []
        for label, path in (("output", out_path), ("control.log", os.path.join(self.log_dir or "", "control.log"))):
            with contextlib.suppress(OSError), open(path, errors="replace") as f:
                text = f.read()[-_LOG_TAIL:].strip()
                if text:
                    parts.append(f"{label}:\n{text}")
        return ("\n" + "\n".join(parts)) if parts else ""

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env[PIPE_ENV] = self.pipe_dir or ""
        env["CUDA_MPS_LOG_DIRECTORY"] = self.log_dir or ""
        return env

    def client_env(self, gpu_ids: Sequence[int]) -> dict[str, str]:
        """Variables that make a process on ``gpu_ids`` a client of this daemon (its GPUs renumbered as MPS shows them)."""
        if self._folder is None:
            raise RuntimeError("the MPS daemon is not started")
        ids = [int(i) for i in gpu_ids]
        if not ids:
            raise ValueError("an MPS client needs at least one GPU")
        foreign = [i for i in ids if i not in self.gpu_ids]
        if foreign:
            raise ValueError(f"GPU {foreign[0]} is not driven by this MPS daemon (GPUs {list(self.gpu_ids)})")
        return {
            PIPE_ENV: self.pipe_dir or "",
            "CUDA_MPS_LOG_DIRECTORY": self.log_dir or "",
            "CUDA_VISIBLE_DEVICES": ",".join(str(self.gpu_ids.index(i)) for i in ids),
        }

    def stop(self) -> None:
        """Quit the daemon, kill what is left of it and its servers, remove its folder. Idempotent; never raises."""
        with self._lock:
            if self._folder is None:
                return
            try:
                self._stop()
            except Exception as exc:  # noqa: BLE001 - a failed stop must not hide the run's own outcome
                logger.warning("could not stop CUDA MPS daemon %s cleanly: %s", self._pid, exc)
            shutil.rmtree(self._folder, ignore_errors=True)
            with _live_lock:
                _live.pop(self, None)
            self._folder = None
            self._pid = None

    def _stop(self) -> None:
        pid, pipe = self._pid, self.pipe_dir
        if pid is not None and pipe and _alive(pid):
            # the runs' kernels may still be exiting: `quit` would wait for them, and this wait would run out
            clients = _wait_for_clients(pid, pipe, self.stop_timeout)
            if clients:
                logger.warning("CUDA MPS clients %s still run %g s after the batch: stopping the daemon anyway",
                               clients, self.stop_timeout)
        _shut_down(pid, pipe, self._control or shutil.which(MPS_CONTROL), self.stop_timeout)
        if pid is not None:
            reap(pid)
        _reap_adopted()

    def __enter__(self) -> MpsDaemon:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


_live: dict[MpsDaemon, int] = {}  # started daemon → the process that started it; stopped at exit at the latest
_live_lock = threading.Lock()


@atexit.register
def _stop_live_daemons() -> None:
    # A driver that dies by an exception (or Ctrl-C outside `with`) still leaves no daemon behind.
    with _live_lock:  # not a forked child's: its parent still drives these daemons
        daemons = [d for d, pid in _live.items() if pid == os.getpid()]
    for daemon in daemons:
        daemon.stop()


def _wait_adopted(daemon: int, timeout: float = 2.0) -> None:
    """Wait (at most ``timeout`` s) until the daemon is this process's child: its parent, ``-d``'s intermediate process,
    has exited while this process adopts orphans."""
    deadline = time.monotonic() + timeout
    while _parent_of(daemon) not in (os.getpid(), None) and _alive(daemon) and time.monotonic() < deadline:
        time.sleep(0.01)


def _reap_adopted() -> None:
    """Collect the exit of each MPS process this process adopted (``-d``'s intermediate process, the daemon once it
    quit); what :mod:`subprocess` started it collects itself."""
    reap_exited_children(lambda pid: _comm(pid).startswith(MPS_COMM))


def _private_folder() -> str:
    """A new folder, mode 0700, short enough for MPS's socket paths (a long TMPDIR falls back to /tmp)."""
    bases = [b for b in (tempfile.gettempdir(), "/tmp") if len(os.fsencode(b)) + _FOLDER_LEN <= SOCKET_PATH_MAX]
    errors = []
    for base in dict.fromkeys(bases):
        try:
            return tempfile.mkdtemp(prefix=_FOLDER_PREFIX, dir=base)  # mode 0700, like every mkdtemp
        except OSError as exc:
            errors.append(f"{base}: {exc}")
    raise BackendError("cannot start CUDA MPS: no temporary folder with a path short enough for its sockets "
                       f"(set TMPDIR to a short writable folder){': ' + '; '.join(errors) if errors else ''}")


def _read_pid(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # empty while being written


def _owner(env: dict[str, str], pipe: str | None) -> int | None:
    """The nbbatch process that started the MPS process with environment ``env`` (None: not one of nbbatch's, or not
    known any more)."""
    owner = env.get(OWNER_ENV, "")
    return int(owner) if owner.isdigit() else _owner_of(pipe) if pipe else None


def _owner_of(pipe: str) -> int | None:
    """The nbbatch process that started the daemon with pipe folder ``pipe`` (None: not one of nbbatch's)."""
    folder = os.path.dirname(pipe)
    if not os.path.basename(folder).startswith(_FOLDER_PREFIX):
        return None
    return _read_pid(os.path.join(folder, OWNER_FILE))


def _left_over(pid: int) -> str | None:
    """The pipe folder of MPS process ``pid`` when it is provably an nbbatch daemon's (or its server's) that nobody
    uses: this user's, in a folder nbbatch made, and its nbbatch gone (or this process, which stopped it already,
    or its folder removed, which nbbatch does only once it has stopped the daemon). Else None."""
    env = _environ_of(pid)
    parent = _parent_of(pid)
    if PIPE_ENV not in env and parent and _comm(parent).startswith(MPS_COMM):  # a server without the daemon's env
        env = _environ_of(parent)
    pipe = env.get(PIPE_ENV, "")
    folder = os.path.dirname(pipe)
    if os.path.basename(pipe) != "pipe" or not os.path.basename(folder).startswith(_FOLDER_PREFIX) \
            or _uid_of(pid) != os.getuid():
        return None
    owner = _owner(env, pipe)
    if owner is None:
        return None if os.path.isdir(folder) else pipe
    return pipe if owner == os.getpid() or not _alive(owner) else None


def _shut_down(daemon: int | None, pipe: str | None, control: str | None, timeout: float,
               known: Sequence[int] = ()) -> list[int]:
    """Quit MPS daemon ``daemon`` (pipe folder ``pipe``), wait until it and every server it ran have gone, and kill
    what is left after ``timeout`` seconds (at once where no daemon can be asked); what outlived even SIGKILL."""
    tree = _ProcessTree(daemon, pipe, known)
    if daemon is not None and _alive(daemon) and control and pipe and os.path.isdir(pipe):
        # asked before quitting: a daemon shutting down may answer no more, and a server it left behind,
        # re-parented, is found by none of the marks the tree looks for
        listed = [int(word) for word in _command(control, pipe, "get_server_list").split() if word.isdigit()]
        tree.add(p for p in listed if _is_mps(p, pipe))
        _command(control, pipe, "quit")
        left = tree.wait_gone(timeout)  # `quit` is asynchronous, and the daemon may leave before its servers
        why = f"did not quit in {timeout:g} s"
    else:
        left, why = tree.running(), "have no daemon to quit them"
    if left:
        logger.warning("CUDA MPS processes %s %s: killing them", left, why)
        for p in left:
            tree.kill(p)
        left = tree.wait_gone(KILL_TIMEOUT)
        if left:
            logger.warning("CUDA MPS processes %s survived SIGKILL for %g s", left, KILL_TIMEOUT)
    return left


class _ProcessTree:
    """An MPS daemon and its servers, each known by pid and start time (a later process given the same pid is never
    taken for one of them), found again as they shut down: MPS processes the daemon started, or that serve its pipe."""

    def __init__(self, daemon: int | None, pipe: str | None, known: Iterable[int] = ()) -> None:
        self.daemon, self.pipe = daemon, pipe
        self.members: dict[int, str] = {}
        self.add([daemon] if daemon is not None else [])
        self.add(known)
        self.refresh()

    def add(self, pids: Iterable[int]) -> None:
        for pid in pids:
            since = _running_since(pid)
            if since is not None:
                self.members.setdefault(pid, since)

    def refresh(self) -> None:
        daemon = self.daemon if self.daemon in self.running() else None  # its pid may be another process's by now
        self.add(p for p in _mps_pids() if (daemon is not None and _parent_of(p) == daemon) or _belongs(p, self.pipe))

    def running(self) -> list[int]:
        return [pid for pid, since in self.members.items() if _running_since(pid) == since]

    def wait_gone(self, timeout: float) -> list[int]:
        """Wait until none of the tree runs; what still runs after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            self.refresh()
            left = self.running()
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(_POLL)

    def kill(self, pid: int) -> None:
        if _running_since(pid) == self.members.get(pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _wait_for_clients(daemon: int, pipe: str, timeout: float) -> list[int]:
    """Wait until no process is a client of the daemon with pipe folder ``pipe`` (names the folder in its environment:
    the runs' kernels and what they started); those still running after ``timeout`` seconds."""
    seen: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while True:
        for pid in _client_pids(daemon, pipe):
            since = _running_since(pid)
            if since is not None and pid not in seen:
                seen[pid] = since
                logger.info("CUDA MPS daemon %s is waiting for its clients to exit before it quits: %s", daemon, pid)
        # once seen, a client counts until it is gone: one exiting may no longer show its environment
        left = [pid for pid, since in seen.items() if _running_since(pid) == since]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(_POLL)


def _client_pids(daemon: int, pipe: str) -> list[int]:
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    found = []
    for entry in entries:
        if not entry.isdigit() or int(entry) in (os.getpid(), daemon):
            continue
        pid = int(entry)
        if _environ_of(pid).get(PIPE_ENV) == pipe and not _comm(pid).startswith(MPS_COMM) \
                and _parent_of(pid) != daemon:  # not the daemon, its servers, nor `nvidia-cuda-mps-control` commands
            found.append(pid)
    return found


def _command(control: str, pipe: str, command: str) -> str:
    """Send one command to the daemon with pipe folder ``pipe``; its answer ('' on failure)."""
    try:
        done = subprocess.run([control], input=command + "\n", env={**os.environ, PIPE_ENV: pipe},
                              capture_output=True, text=True, timeout=COMMAND_TIMEOUT, start_new_session=True,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        logger.warning("`echo %s | %s` failed: %s", command, MPS_CONTROL, exc)
        return ""
    return done.stdout


def _running_since(pid: int) -> str | None:
    """When ``pid`` started (its start time in /proc), None if it does not run (a zombie does not: nobody may reap an
    orphaned daemon in a container). Without /proc: "?" while the kernel knows the pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except FileNotFoundError:
        return None
    except OSError:  # no /proc: ask the kernel
        return "?" if pid_alive(pid) else None
    return fields[19] if len(fields) > 19 and fields[0] not in ("Z", "X") else None


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    return _running_since(pid) is not None


def _is_mps(pid: int, pipe: str) -> bool:
    """Whether ``pid`` runs and is an MPS process of the daemon with pipe folder ``pipe``: by the folder in its
    environment, or by its name where its environment does not tell."""
    serves = _belongs(pid, pipe) if _alive(pid) else False
    return serves if serves is not None else _comm(pid).startswith(MPS_COMM)


def _wait_gone(pids: Sequence[int], timeout: float) -> bool:
    """Wait until none of ``pids`` runs; whether they all went within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _uid_of(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def _mps_pids() -> list[int]:
    """Running MPS control daemons and servers on this machine (empty without /proc)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    return sorted(int(e) for e in entries if e.isdigit() and _comm(int(e)).startswith(MPS_COMM) and _alive(int(e)))


def _environ_of(pid: int) -> dict[str, str]:
    """``pid``'s environment as it started (empty where unreadable: another user's process)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {key: value for key, _, value in pairs}


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _belongs(pid: int, pipe: str | None) -> bool | None:
    """Whether ``pid`` serves the daemon with pipe folder ``pipe``, by the folder in its environment;
    None where that does not tell (another user's process, no such variable)."""
    found = _environ_of(pid).get(PIPE_ENV)
    return None if found is None or pipe is None else found == pipe


def _foreign_mps_pids() -> list[int]:
    """MPS processes that are not those of a daemon this process started and still runs."""
    with _live_lock:
        ours = [d for d, owner in _live.items() if owner == os.getpid()]
    own_pids = {d.pid for d in ours if d.pid is not None}
    own_pipes = {d.pipe_dir for d in ours if d.pipe_dir}
    return [p for p in _mps_pids()
            if p not in own_pids and _parent_of(p) not in own_pids
            and _environ_of(p).get(PIPE_ENV) not in own_pipes]
