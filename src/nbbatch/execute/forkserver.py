"""Kernels forked from a process that already imported their framework: the driver's side of
:mod:`nbbatch.execute.kernel_forkserver`.

:class:`ForkServer` runs ``kernel_forkserver.py`` with a kernel's own Python (its venv, its interpreter options) and
the environment of the runs it serves; once it has imported the ``preload`` modules, :meth:`ForkServer.fork` gives a
kernel in milliseconds where a cold one takes seconds to import them. :class:`ForkedKernel` is that kernel's process
as ``subprocess.Popen`` shows one (jupyter_client's provisioner polls, signals, kills and waits it): not this
process's child, it is watched through a pidfd and the server reports its exit code. :class:`ForkServers` keeps one
server per (kernel command, preload, environment read at import).
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nbbatch.execute.affinity import CPUS_VARIABLE

SERVER_SCRIPT = Path(__file__).with_name("kernel_forkserver.py")
LAUNCHER = ["-m", "ipykernel_launcher"]
READY_TIMEOUT = 120.0  # seconds a server may take to import its modules
PRINTED_MAX = 16 << 10  # characters of what importing them printed kept for the runs' logs
# Set per run, never read at import: runs that differ only in these share a server (which starts without them).
PER_RUN_VARIABLES = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY",
                     "JPY_PARENT_PID", "JPY_SESSION_NAME", "PYDEVD_DISABLE_FILE_VALIDATION", CPUS_VARIABLE)


def import_env(env: dict[str, str], per_run: Sequence[str] = ()) -> dict[str, str]:
    """The part of a kernel's environment its imports may read: without the variables nbbatch sets per run, nor
    ``per_run`` (those a run sharing its GPUs gets: read when the framework first uses the GPU, never at import)."""
    return {name: value for name, value in env.items()
            if name not in PER_RUN_VARIABLES and name not in per_run and not name.startswith("NBBATCH_")}


def split_command(argv: Sequence[str]) -> tuple[list[str], list[str]] | None:
    """``(python and its options, the launcher's arguments)`` of a kernel command ``python [options] -m
    ipykernel_launcher …``; None for any other command (another language, a wrapper script, a container)."""
    argv = list(argv)
    for i in range(1, len(argv) - 1):
        if argv[i:i + 2] == LAUNCHER:
            options = argv[1:i]
            if all(o.startswith("-") and o not in ("-c", "-m") for o in options):
                return argv[:i], argv[i + 2:]
            return None
    return None


class ForkedKernel:
    """A kernel process forked by a :class:`ForkServer`, as much of ``subprocess.Popen`` as jupyter_client uses."""

    stdin = stdout = stderr = None

    def __init__(self, pid: int, conn: socket.socket, args: list[str]):
        self.pid, self.args, self.returncode = pid, args, None
        self._conn = conn
        self._pidfd: int | None = None
        with contextlib.suppress(AttributeError, OSError):
            self._pidfd = os.pidfd_open(pid)
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                self._read_exit()
            return self.returncode

    def _read_exit(self) -> None:
        try:
            data = self._conn.recv(4096, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            with contextlib.suppress(ValueError):
                self._ended(int(json.loads(data.splitlines()[0]).get("exit", 1)))
            return
        # The server is gone without a word: the pidfd says whether the kernel still runs (its code is lost).
        if self._pidfd is None or select.select([self._pidfd], [], [], 0)[0]:
            self._ended(-signal.SIGKILL)

    def _ended(self, code: int) -> None:
        self.returncode = code
        self._conn.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        step = 0.002
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            time.sleep(step)
            step = min(step * 2, 0.05)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        with self._lock:
            if self.returncode is not None:
                return
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, signum)  # never another process that took its pid
            else:
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class ForkServer:
    """A fork server for one kernel command, preload list and import environment, starting in the background."""

    def __init__(self, python: Sequence[str], preload: Sequence[str], env: dict[str, str], per_run: Sequence[str] = ()):
        self.python, self.preload, self.per_run = list(python), tuple(preload), tuple(sorted(per_run))
        self.env = import_env(env, self.per_run)
        # Mode 0700: only this user may ask for kernels. A socket's path must fit sun_path: a long TMPDIR is not used.
        base = tempfile.gettempdir()
        self.folder = tempfile.mkdtemp(prefix="nbbatch-f", dir=base if len(os.fsencode(base)) <= 80 else "/tmp")
        self.socket_path = os.path.join(self.folder, "s")
        self.error: str | None = None
        self.imported: tuple[str, ...] = ()
        self.seconds: float | None = None
        self.printed = ""  # what importing the modules printed
        self._closing = False
        self._ready = threading.Event()
        self._process: subprocess.Popen[bytes] | None = None
        threading.Thread(target=self._start, name="fork-server", daemon=True).start()

    def _start(self) -> None:
        try:
            self._process = subprocess.Popen(
                [*self.python, str(SERVER_SCRIPT), self.socket_path, *self.preload], env={**self.env, "CUDA_VISIBLE_DEVICES": ""},
                cwd=self.folder, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                start_new_session=True)
            if self._closing:  # closed while it was being started
                self._process.kill()
            assert self._process.stdout is not None
            said, printed = b"", []
            for line in self._process.stdout:  # what importing printed, then the ready line
                said = line
                if line.startswith(b'{"ready"'):
                    break
                if sum(map(len, printed)) < PRINTED_MAX:
                    printed.append(line)
            self.printed = b"".join(printed)[:PRINTED_MAX].decode(errors="replace")
            last = said.decode(errors="replace").strip()[-200:]  # an error's last line, when it died of one
            answer = json.loads(said) if said.startswith(b'{"ready"') else \
                {"ready": False, "why": f"it ended ({last})" if last else "it ended"}
            self._process.stdout.close()
            if answer["ready"]:
                self.imported, self.seconds = tuple(answer.get("imported", ())), answer.get("seconds")
            else:
                self.error = f"the fork server did not start: {answer.get('why') or 'it ended'}"
        except (OSError, ValueError) as exc:
            self.error = f"the fork server did not start: {exc}"
        finally:
            self._ready.set()

    def ready(self, wait: float = READY_TIMEOUT) -> bool:
        """Wait until the server has imported its modules; whether it can fork kernels."""
        if not self._ready.wait(wait):
            self.error = f"the fork server was not ready within {wait:g} s"
        return self._ready.is_set() and self.error is None

    def serves(self, python: Sequence[str], preload: Sequence[str], env: dict[str, str],
               per_run: Sequence[str] = ()) -> bool:
        """Whether kernels of this command, preload list and environment may be forked from this server."""
        per_run = tuple(sorted(per_run))
        return ((list(python), tuple(preload), per_run, import_env(env, per_run))
                == (self.python, self.preload, self.per_run, self.env))

    def fork(self, launcher_args: Sequence[str], env: dict[str, str], cwd: str, stdout: Any = None,
             stderr: Any = None, wait: float = READY_TIMEOUT) -> ForkedKernel:
        """A kernel ``python -m ipykernel_launcher *launcher_args`` would be, in ``cwd`` with ``env``; its stdout and
        stderr to those files or descriptors (else nowhere). Raises RuntimeError or OSError if none could be forked."""
        if not self.ready(wait):
            raise RuntimeError(self.error)
        fds = [_fileno(stream) for stream in (stdout, stderr)]
        devnull = os.open(os.devnull, os.O_WRONLY) if None in fds else None
        fds = [devnull if fd is None else fd for fd in fds]
        request = {"argv": list(launcher_args), "env": env, "cwd": cwd,
                   "orig_argv": [*self.python, *LAUNCHER, *launcher_args]}
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(10.0)
            conn.connect(self.socket_path)
            payload = json.dumps(request).encode() + b"\n"
            conn.sendmsg([payload[:65536]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, bytes(_int_array(fds)))])
            if len(payload) > 65536:
                conn.sendall(payload[65536:])
            answer = b""
            while not answer.endswith(b"\n"):
                chunk = conn.recv(4096)
                if not chunk:
                    raise RuntimeError("the fork server ended")
                answer += chunk
            pid = int(json.loads(answer)["pid"])
        except BaseException:
            conn.close()
            raise
        finally:
            if devnull is not None:
                os.close(devnull)
        conn.settimeout(None)
        return ForkedKernel(pid, conn, [*self.python, *LAUNCHER, *launcher_args])

    def close(self) -> None:
        """Stop the server once its kernels have ended (they are killed by their runs, never by this); one still
        importing is killed."""
        self._closing = True
        process = self._process
        if process is not None and not self._ready.is_set():
            with contextlib.suppress(OSError):
                process.kill()
        threading.Thread(target=self._reap, name="fork-server-reap", daemon=True).start()

    def _reap(self) -> None:
        self._ready.wait(READY_TIMEOUT)
        process = self._process
        if process is not None and process.poll() is None:
            if self._ready.is_set() and self.error is None:
                with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                    conn.settimeout(2.0)
                    conn.connect(self.socket_path)
                    conn.sendall(b'{"close": true}\n')
            else:
                with contextlib.suppress(OSError):
                    process.kill()
        if process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=24 * 3600)  # its kernels' runs end them
        shutil.rmtree(self.folder, ignore_errors=True)


def _fileno(stream: Any) -> int | None:
    if stream is None or isinstance(stream, int):
        return stream
    with contextlib.suppress(AttributeError, OSError, ValueError):
        return int(stream.fileno())
    return None


def _int_array(fds: list[int]) -> Any:
    return array.array("i", fds)


class ForkServers:
    """The fork servers of a batch: one per kernel command, preload list and import environment."""

    def __init__(self) -> None:
        self._servers: list[ForkServer] = []
        self._lock = threading.Lock()
        self._closed = False

    def start(self, argv: Sequence[str], preload: Sequence[str], env: dict[str, str],
              per_run: Sequence[str] = ()) -> ForkServer | None:
        """The server for kernels of command ``argv`` with these modules and environment (but for ``per_run``),
        started now if there is none; None when ``argv`` is not a Python kernel, there is nothing to preload, or the
        servers are closed."""
        split = split_command(argv)
        if split is None or not preload:
            return None
        with self._lock:
            if self._closed:
                return None
            for server in self._servers:
                if server.serves(split[0], preload, env, per_run):
                    return server
            server = ForkServer(split[0], preload, env, per_run)
            self._servers.append(server)
            return server

    def find(self, argv: Sequence[str], preload: Sequence[str], env: dict[str, str],
             per_run: Sequence[str] = ()) -> ForkServer | None:
        """The server started for these kernels, if any (it may still be importing)."""
        split = split_command(argv)
        with self._lock:
            return next((s for s in self._servers
                         if split is not None and s.serves(split[0], preload, env, per_run)), None)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            servers, self._servers = self._servers, []
        for server in servers:
            server.close()
