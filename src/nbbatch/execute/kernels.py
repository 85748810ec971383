"""Kernels for a batch: started with the run's own settings, ready without sleeping, killed at once.

jupyter_client's kernel manager and client with these changes (kernels started ahead of their runs:
:mod:`nbbatch.execute.prestart`):

* A kernel is ready once one ``kernel_info`` round trip has been seen on both shell and IOPub,
  without jupyter_client's fixed 0.2-s IOPub flush (:class:`ReadyKernelClient`).
* A kernel's output is taken off its socket as soon as it comes, and held up to ``IOPUB_BUFFER_BYTES``
  until the driver handles it (:class:`_IOPubChannel`): a kernel printing faster than the driver handles
  neither fills the driver's memory nor, in short bursts, loses lines.
* A killed kernel is reaped in milliseconds, not on jupyter_client's 0.1-s poll (:class:`BatchKernelManager`).
* A kernel whose environment has ``NBBATCH_CPUS`` (a rank's cores) runs on those cores only
  (:class:`BatchKernelManager`, :mod:`nbbatch.execute.affinity`).
* A kernel may be forked from a server that already imported its framework (``fork_server``,
  :mod:`nbbatch.execute.forkserver`); if it cannot be, it starts as usual and ``fork_error`` says why.
* A kernel is reached over Unix sockets (ZeroMQ ``ipc``), not localhost TCP, where the platform has
  them (:func:`kernel_transport`): no port other local users could connect to, and no ipykernel
  warning about unencrypted TCP at the top of every run's log. Its sockets and connection file live
  in a private folder of their own, removed when the kernel is reaped (:class:`BatchKernelManager`).

No papermill here: the local backend imports this module without importing papermill (papermill's
entry-point scan imports ``nbbatch.execute.engine``).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import shutil
import signal
import socket
import stat
import tempfile
import threading
import time
from collections import deque
from queue import Empty
from typing import Any

import zmq
import zmq.asyncio
from jupyter_client.asynchronous.client import AsyncKernelClient
from jupyter_client.channels import AsyncZMQSocketChannel
from jupyter_client.localinterfaces import localhost
from jupyter_client.manager import AsyncKernelManager
from jupyter_core.utils import run_sync
from traitlets import DottedObjectName, Type, default

from nbbatch.errors import NbbatchError
from nbbatch.execute.affinity import CPUS_VARIABLE, parse_cpu_list, pin_process
from nbbatch.execute.forkserver import ForkServer, split_command

# A kernel's output the driver has received but not handled yet: at most this many bytes (see _IOPubChannel),
# and this many messages in ZeroMQ's own queue (its default, 1000, is 1 GiB of 1-MiB lines).
IOPUB_BUFFER_BYTES = 16 << 20
IOPUB_QUEUE = 32
KERNEL_ARGUMENTS = ["--HistoryManager.hist_file=:memory:"]  # what nbclient gives the kernels it starts
# An IPython kernel's IOPub socket drops what its reader has not taken once 1,000 messages wait: a cell printing
# faster than the driver reads lost lines of log.txt and the notebook (and its end, the run then said the output
# did not come). Told not to drop (XPUB_NODROP, ipykernel 6.10+), the kernel waits for the driver instead. Bound
# to no name in the kernel; where the socket is not XPUB (older ipykernel), nothing changes.
NO_DROP_ARGUMENT = (
    "--IPKernelApp.exec_lines=(lambda zmq, thread: None if thread is None or thread.socket.type != zmq.XPUB else "
    "thread.schedule(lambda: thread.socket.setsockopt(zmq.XPUB_NODROP, 1)) and None)"
    "(__import__('zmq'), getattr(__import__('ipykernel.kernelapp').kernelapp.IPKernelApp.instance(), "
    "'iopub_thread', None))")
TRANSPORT_VARIABLE = "NBBATCH_KERNEL_TRANSPORT"
SOCKET_PATH_MAX = 100  # bytes: a Unix socket path must fit sun_path (108 on Linux, 104 on macOS)
_SOCKET_NAME = "k"  # the kernel binds <folder>/k-1 … k-5
_FOLDER_PREFIX = "nbbatch-k"
_FOLDER_LEN = len(os.sep + _FOLDER_PREFIX + "x" * 8 + os.sep + _SOCKET_NAME + "-99")  # mkdtemp adds 8 characters
logger = logging.getLogger(__name__)
_pin_warned = threading.Event()  # a kernel that could not be pinned is said once per driver, not once per kernel


def kernel_transport() -> str:
    """The ZeroMQ transport for the kernels nbbatch starts: ``"ipc"`` (Unix sockets) or ``"tcp"`` (localhost).

    ``ipc`` wherever ZeroMQ has it on a POSIX system (Linux, macOS); ``tcp`` elsewhere (Windows).
    ``NBBATCH_KERNEL_TRANSPORT=tcp`` forces localhost TCP (e.g. for a kernelspec that wraps a
    container or remote launcher, which cannot reach a socket file of this machine);
    ``NBBATCH_KERNEL_TRANSPORT=ipc`` asks for ``ipc`` where it is available. A kernel also falls back
    to TCP when no temporary folder gives a socket path short enough (``SOCKET_PATH_MAX``).
    """
    wanted = os.environ.get(TRANSPORT_VARIABLE, "").strip().lower()
    if wanted not in ("", "auto", "ipc", "tcp"):
        logger.warning("%s=%r is not one of ipc, tcp, auto: using auto", TRANSPORT_VARIABLE, wanted)
    if wanted == "tcp" or os.name != "posix" or not zmq.has("ipc"):
        return "tcp"
    return "ipc"


_live_folders: dict[str, int] = {}  # private kernel folder → the process that made it; removed at exit at the latest
_folders_lock = threading.Lock()


def _private_folder(transport: str) -> str | None:
    """A new folder, mode 0700, for one kernel's connection file (and sockets with ``ipc``); None if none fits."""
    bases = [tempfile.gettempdir()]
    if transport == "ipc":  # socket paths must stay short; a long TMPDIR (a pytest tmp_path…) falls back to /tmp
        bases = [b for b in (*bases, "/tmp") if len(os.fsencode(b)) + _FOLDER_LEN <= SOCKET_PATH_MAX]
    for base in bases:
        if transport == "ipc":
            _sweep_once(base)
        with contextlib.suppress(OSError):
            folder = tempfile.mkdtemp(prefix=_FOLDER_PREFIX, dir=base)  # mode 0700, like every mkdtemp
            with _folders_lock:
                _live_folders[folder] = os.getpid()
            return folder
    return None


def _remove_folder(folder: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    with _folders_lock:
        _live_folders.pop(folder, None)


_swept: set[str] = set()


def _sweep_once(base: str) -> None:
    """Remove, once per process, the folders in ``base`` of dead kernels whose driver was killed (kill -9: no
    clean-up of its own ran; its reaper killed the kernels). A folder whose sockets still answer, or that has
    none yet (a kernel starting), is kept."""
    with _folders_lock:
        if base in _swept:
            return
        _swept.add(base)
        ours = set(_live_folders)
    with contextlib.suppress(OSError), os.scandir(base) as entries:
        for entry in entries:
            with contextlib.suppress(OSError):
                if (entry.name.startswith(_FOLDER_PREFIX) and entry.path not in ours
                        and entry.is_dir(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_uid == os.getuid()
                        and _nobody_listens(os.path.join(entry.path, _SOCKET_NAME + "-1"))):
                    shutil.rmtree(entry.path, ignore_errors=True)


def _nobody_listens(path: str) -> bool:
    """Whether ``path`` is a Unix socket that refuses connections: the process that bound it is gone."""
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            return True
        except OSError:  # busy, timed out: someone is there
            return False
    return False


@atexit.register
def _remove_live_folders() -> None:
    # A driver stopped mid-run (Ctrl-C, an exception) leaves kernels that its reaper kills: their folders go here.
    with _folders_lock:  # not a forked child's: its parent's kernels may still be running
        folders = [folder for folder, pid in _live_folders.items() if pid == os.getpid()]
    for folder in folders:
        _remove_folder(folder)


class _IOPubChannel(AsyncZMQSocketChannel):
    """jupyter_client's IOPub channel, taking every message that has come off the socket whenever one is asked for.

    ipykernel publishes its output on a PUB socket, which drops what its subscriber is not ready to take
    once 1000 messages wait in its own queue and ``IOPUB_QUEUE`` in the driver's; the driver handles a
    message (parse, notebook, log) far more slowly than ZeroMQ hands it over. Here waiting messages are
    received at each request (microseconds each) and held, still serialized, up to ``IOPUB_BUFFER_BYTES``:
    a burst of thousands of short lines is kept whole, and 1-MiB lines cost the driver at most that much.
    """

    def __init__(self, socket: zmq.asyncio.Socket, session: Any, loop: Any = None) -> None:
        super().__init__(socket, session, loop)
        self._held: deque[list[bytes]] = deque()
        self._held_bytes = 0
        self._receiver = zmq.Socket.shadow(socket.underlying)  # non-blocking receives, in the same thread

    def _take_waiting(self) -> bool:
        """Receive what has come, within the byte limit; whether a message is held."""
        while self._held_bytes < IOPUB_BUFFER_BYTES:
            try:
                frames = self._receiver.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._held.append(frames)
            self._held_bytes += sum(map(len, frames))
        return bool(self._held)

    async def get_msg(self, timeout: float | None = None) -> dict[str, Any]:  # type: ignore[override]
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._take_waiting():
            left = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            if not await self.socket.poll(left) and deadline is not None:
                raise Empty
        frames = self._held.popleft()
        self._held_bytes -= sum(map(len, frames))
        _, message = self.session.feed_identities(frames)
        return self.session.deserialize(message)

    async def msg_ready(self) -> bool:  # type: ignore[override]
        return self._take_waiting() or bool(await self.socket.poll(timeout=0))


class ReadyKernelClient(AsyncKernelClient):
    """jupyter_client's async client, with a ``wait_for_ready`` that does not sleep.

    jupyter_client's version ends with a 0.2-s IOPub flush, and waits 0.2 s more whenever the first
    ``kernel_info`` status messages were published before the IOPub subscription reached the kernel
    (always the case for a kernel started earlier). Here the kernel is ready as soon as the reply to
    a ``kernel_info`` request has come on shell and that request's ``idle`` status on IOPub: the
    same guarantee (both channels connected), reached in one round trip.
    """

    async def _ready_wait(self, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout if timeout is not None else float("inf"))
        asked: set[str] = set()
        reply: dict[str, Any] | None = None
        while True:
            asked.add(self.kernel_info())
            reply = await self._next_reply(asked, wait=1.0)
            if reply is not None and await self._idle_seen(asked, wait=0.2):
                self._handle_kernel_info_reply(reply)
                return
            if not await self._async_is_alive():
                raise RuntimeError("Kernel died before replying to kernel_info")
            if time.monotonic() > deadline:
                raise RuntimeError(f"Kernel didn't respond in {timeout:g} seconds")

    wait_for_ready = _ready_wait  # type: ignore[assignment]
    iopub_channel_class = Type(_IOPubChannel)  # type: ignore[assignment]

    def connect_iopub(self, identity: bytes | None = None) -> zmq.Socket[Any]:
        """The IOPub socket, holding at most ``IOPUB_QUEUE`` messages not received yet (the rest wait in the kernel)."""
        # A socket's queue limit counts when it connects: pyzmq sets its context's defaults on the sockets it makes.
        defaults = self.context.sockopts
        before = defaults.get(zmq.RCVHWM)
        defaults[zmq.RCVHWM] = IOPUB_QUEUE
        try:
            return super().connect_iopub(identity)
        finally:
            if before is None:
                del defaults[zmq.RCVHWM]
            else:
                defaults[zmq.RCVHWM] = before

    async def _next_reply(self, asked: set[str], wait: float) -> dict[str, Any] | None:
        until = time.monotonic() + wait
        while (left := until - time.monotonic()) > 0:
            try:
                msg = await self.shell_channel.get_msg(timeout=left)
            except Empty:
                return None
            if msg["msg_type"] == "kernel_info_reply" and msg["parent_header"].get("msg_id") in asked:
                return msg
        return None

    async def _idle_seen(self, asked: set[str], wait: float) -> bool:
        until = time.monotonic() + wait
        while (left := until - time.monotonic()) > 0:
            try:
                msg = await self.iopub_channel.get_msg(timeout=left)
            except Empty:
                return False
            if (msg["msg_type"] == "status" and msg["content"].get("execution_state") == "idle"
                    and msg["parent_header"].get("msg_id") in asked):
                return True
        return False


class BatchKernelManager(AsyncKernelManager):
    """jupyter_client's async kernel manager with a non-sleeping client, a quick reap after a kill, and
    the kernel's connection file and sockets in a private folder (:func:`kernel_transport`).

    jupyter_client would put an ``ipc`` kernel's sockets at ``kernel-ipc-<n>`` relative to the
    current directory (and the kernel binds them relative to its own: the notebook's folder, perhaps
    read-only or a share), and a kernel's connection file loose in the temporary folder. Here both
    live in one folder made for this kernel, removed with everything in it (a killed kernel never
    unlinks its sockets) by :meth:`cleanup_resources`, which nbclient's shutdown and
    :func:`reap_kernel` call, by a failed start, or at the driver's exit; those of a driver killed
    with SIGKILL, by the next driver's first ``ipc`` kernel (:func:`_sweep_once`).
    """

    client_class = DottedObjectName("nbbatch.execute.kernels.ReadyKernelClient")
    client_factory = Type(klass=ReadyKernelClient)
    private_folder: str | None = None
    fork_server: ForkServer | None = None  # set before the start: the kernel is forked from it if it can be
    fork_error: str | None = None  # why it was not (it started as usual)

    @default("transport")
    def _default_transport(self) -> str:
        return kernel_transport()

    async def _async_pre_start_kernel(self, **kw: Any) -> tuple[list[str], dict[str, Any]]:
        if not self.connection_file:  # not on a restart, nor when the caller chose the file
            self.private_folder = _private_folder(self.transport)
            if self.private_folder is None:
                if self.transport == "ipc":
                    self.transport, self.ip = "tcp", localhost()
            else:
                self.connection_file = os.path.join(self.private_folder, "kernel.json")
                if self.transport == "ipc":
                    self.ip = os.path.join(self.private_folder, _SOCKET_NAME)
        if self.kernel_spec is not None and self.kernel_spec.language.lower() == "python":
            kw["extra_arguments"] = [*kw.get("extra_arguments", []), NO_DROP_ARGUMENT]
        return await super()._async_pre_start_kernel(**kw)

    async def _async_start_kernel(self, **kw: Any) -> None:
        try:
            await super()._async_start_kernel(**kw)
        except BaseException:
            # nbclient leaves a kernel that failed to start as it is: kill it and remove its files now.
            with contextlib.suppress(Exception):
                await _reap(self)
            raise
        pin_kernel(self, kw.get("env") or {})

    start_kernel = _async_start_kernel  # type: ignore[assignment]  # AsyncKernelManager binds the base's

    async def _async_launch_kernel(self, kernel_cmd: list[str], **kw: Any) -> None:
        server, provisioner = self.fork_server, self.provisioner
        split = split_command(kernel_cmd)
        if server is None or split is None or type(provisioner).__name__ != "LocalProvisioner":
            return await super()._async_launch_kernel(kernel_cmd, **kw)
        env = {**(kw.get("env") or os.environ), "JPY_PARENT_PID": str(os.getpid())}  # as jupyter_client's launch
        cwd = kw.get("cwd") or os.getcwd()
        try:
            if split[0] != server.python:
                raise RuntimeError(f"the kernel's command is not the fork server's ({' '.join(server.python)})")
            process = await asyncio.to_thread(server.fork, split[1], env, str(cwd), kw.get("stdout"), kw.get("stderr"))
        except (OSError, RuntimeError, ValueError, KeyError) as exc:
            self.fork_error = str(exc) or type(exc).__name__
            return await super()._async_launch_kernel(kernel_cmd, **kw)
        assert provisioner is not None
        provisioner.process, provisioner.pid, provisioner.pgid = process, process.pid, process.pid  # type: ignore[attr-defined]
        provisioner.cwd = cwd  # type: ignore[attr-defined]
        self._reconcile_connection_info(provisioner.connection_info)

    _launch_kernel = _async_launch_kernel  # type: ignore[assignment]

    async def _async_cleanup_resources(self, restart: bool = False) -> None:
        try:
            await super()._async_cleanup_resources(restart=restart)
        finally:
            if not restart and self.private_folder is not None:
                _remove_folder(self.private_folder)
                self.private_folder = None
                self.connection_file = ""  # a later start makes a new folder

    cleanup_resources = _async_cleanup_resources  # type: ignore[assignment]  # AsyncKernelManager binds the base's

    async def _async_wait(self, pollinterval: float = 0.1) -> None:
        # jupyter_client polls every 0.1 s for the killed kernel to be gone; it is gone in milliseconds.
        step = 0.002
        while await self._async_is_alive():
            await asyncio.sleep(step)
            step = min(step * 2, pollinterval)


def pin_kernel(km: Any, env: dict[str, str]) -> None:
    """Pin the kernel process of ``km`` to the cores ``NBBATCH_CPUS`` in its environment ``env`` names, if any.

    Without ``sched_setaffinity`` (not Linux) or a local kernel process (another provisioner) nothing is pinned. A
    malformed value, a kernel already gone, or cores this process may not use leave the kernel unpinned, with a
    warning (once per driver): pinning is an optimization, never a reason for a run to fail.
    """
    value = env.get(CPUS_VARIABLE, "").strip()
    pid = getattr(getattr(getattr(km, "provisioner", None), "process", None), "pid", None)
    if not value or pid is None or not hasattr(os, "sched_setaffinity"):
        return
    try:
        pin_process(pid, parse_cpu_list(value))
    except (NbbatchError, OSError, OverflowError) as exc:
        log = logger.debug if _pin_warned.is_set() else logger.warning
        _pin_warned.set()
        log("kernel %s is not pinned to the cores %s=%s names: %s", pid, CPUS_VARIABLE, value, exc)


def kill_kernel_group(km: Any) -> None:
    """SIGKILL a kernel and every process it started (it runs in its own session), unless it was reaped
    already (its process id may then belong to another process)."""
    process = getattr(getattr(km, "provisioner", None), "process", None)
    if process is None or process.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)  # the kernel leads its own process group
    with contextlib.suppress(ProcessLookupError, PermissionError):
        process.kill()


async def _reap(km: Any) -> None:
    """Kill a kernel nbclient did not shut down, wait for it to go, and clean up its files and sockets."""
    kill_kernel_group(km)
    if km.has_kernel:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(km._async_wait(), timeout=5.0)
        if km.has_kernel:
            await km.provisioner.wait()
    await km.cleanup_resources()


def reap_kernel(km: Any) -> None:
    """Kill a kernel nbclient did not shut down (it failed before its own clean-up) and clean up after it."""
    with contextlib.suppress(Exception):
        run_sync(_reap)(km)
