"""Kernels for a batch: started with the run's own settings, ready without sleeping, killed at once.

jupyter_client's kernel manager and client with three changes, and a pool of kernels started ahead:

* A kernel is ready once one ``kernel_info`` round trip has been seen on both shell and IOPub,
  without jupyter_client's fixed 0.2-s IOPub flush (:class:`ReadyKernelClient`).
* A killed kernel is reaped in milliseconds, not on jupyter_client's 0.1-s poll (:class:`BatchKernelManager`).
* :class:`KernelPool` starts a kernel for a run before that run starts, with the run's own kernel,
  environment and working directory, so that its start-up overlaps the runs before it. A kernel only
  ever executes the one notebook it was started for.

No papermill here: the local backend imports this module without importing papermill (papermill's
entry-point scan imports ``nbbatch.execute.engine``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from queue import Empty
from typing import Any, BinaryIO

from jupyter_client.asynchronous.client import AsyncKernelClient
from jupyter_client.manager import AsyncKernelManager
from jupyter_core.utils import run_sync
from traitlets import DottedObjectName, Type

KERNEL_ARGUMENTS = ["--HistoryManager.hist_file=:memory:"]  # what nbclient gives the kernels it starts


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
    """jupyter_client's async kernel manager with a non-sleeping client and a quick reap after a kill."""

    client_class = DottedObjectName("nbbatch.execute.kernels.ReadyKernelClient")
    client_factory = Type(klass=ReadyKernelClient)

    async def _async_wait(self, pollinterval: float = 0.1) -> None:
        # jupyter_client polls every 0.1 s for the killed kernel to be gone; it is gone in milliseconds.
        step = 0.002
        while await self._async_is_alive():
            await asyncio.sleep(step)
            step = min(step * 2, pollinterval)


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


class _KernelOutput:
    """The kernel process's own stdout/stderr through a pipe: kept until a run claims the kernel, then
    written to the run's log as it comes."""

    LIMIT = 1 << 20  # bytes kept before a run claims the kernel

    def __init__(self) -> None:
        self._read_fd, self.write_fd = os.pipe()
        self._lock = threading.Lock()
        self._held: list[bytes] = []
        self._held_bytes = 0
        self._sink: BinaryIO | None = None
        self._thread = threading.Thread(target=self._pump, name="kernel-output", daemon=True)
        self._thread.start()

    def launched(self) -> None:
        """The kernel has its copy of the write end: close ours, so the pump sees EOF when the kernel ends."""
        os.close(self.write_fd)

    def _pump(self) -> None:
        with open(self._read_fd, "rb", buffering=0) as pipe:
            while data := pipe.read(65536):
                with self._lock:
                    if self._sink is not None:
                        with contextlib.suppress(ValueError, OSError):
                            self._sink.write(data)
                            self._sink.flush()
                    elif self._held_bytes < self.LIMIT:
                        self._held.append(data)
                        self._held_bytes += len(data)

    def attach(self, sink: BinaryIO | None) -> None:
        with self._lock:
            if sink is not None:
                with contextlib.suppress(ValueError, OSError):
                    sink.write(b"".join(self._held))
                    sink.flush()
            self._held, self._sink = [], sink

    def detach(self, wait: float) -> None:
        """After the kernel is gone: let the pump drain the pipe, then stop writing to the sink."""
        self._thread.join(timeout=wait)
        with self._lock:
            self._sink = None


class PrestartedKernel:
    """A kernel process started (in the background) for one run, before that run starts."""

    def __init__(self, kernel_name: str, env: dict[str, str], cwd: str):
        self.kernel_name, self.env, self.cwd = kernel_name, env, cwd
        self.km = BatchKernelManager(kernel_name=kernel_name)
        self.error: BaseException | None = None
        self._output: _KernelOutput | None = None
        self._launched = threading.Event()
        threading.Thread(target=self._launch, name=f"prestart-{kernel_name}", daemon=True).start()

    def _launch(self) -> None:
        try:
            self._output = _KernelOutput()
            try:
                asyncio.run(self.km.start_kernel(env=self.env, cwd=self.cwd, stdout=self._output.write_fd,
                                                 stderr=self._output.write_fd, extra_arguments=list(KERNEL_ARGUMENTS)))
            finally:
                self._output.launched()
        except BaseException as exc:  # noqa: BLE001 - reported when the run claims the kernel
            self.error = exc
        finally:
            self._launched.set()

    def matches(self, kernel_name: str, env: dict[str, str], cwd: str) -> bool:
        return (kernel_name, env, cwd) == (self.kernel_name, self.env, self.cwd)

    def claim(self, kernel_output: BinaryIO | None, wait: float = 120.0) -> BatchKernelManager | None:
        """The started kernel's manager, its process output now going to ``kernel_output``; None if it
        could not start or has died (the run then starts a kernel of its own)."""
        launched = self._launched.wait(wait)
        process = getattr(self.km.provisioner, "process", None)
        if not launched or self.error is not None or process is None or process.poll() is not None:
            self.discard()
            return None
        assert self._output is not None
        self._output.attach(kernel_output)
        return self.km

    def release_output(self, wait: float = 1.0) -> None:
        """Stop writing the kernel's output anywhere (call once the kernel is gone)."""
        if self._output is not None:
            self._output.detach(wait)

    def discard(self) -> None:
        """Kill the kernel (never claimed, or not usable) and clean up after it."""
        self._launched.wait(120.0)
        reap_kernel(self.km)
        self.release_output(wait=0.5)


class KernelPool:
    """Kernels started ahead of the runs that will use them, one per run id, at most ``size`` at a time.

    A kernel is started with the run's own kernel name, environment and working directory and
    handed to that run only (:meth:`take`); a kernel whose run is cancelled, or whose launch
    settings no longer match when the run starts, is killed. ``close`` kills every unclaimed kernel.
    """

    def __init__(self, size: int):
        self.size = max(0, size)
        self._kernels: dict[str, PrestartedKernel] = {}
        self._lock = threading.Lock()
        self._closed = False

    def __len__(self) -> int:
        with self._lock:
            return len(self._kernels)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._kernels

    def prestart(self, key: str, kernel_name: str, env: dict[str, str], cwd: str) -> bool:
        """Start a kernel for run ``key`` unless the pool is full or has one for it; whether it started one."""
        with self._lock:
            if self._closed or key in self._kernels or len(self._kernels) >= self.size:
                return False
            self._kernels[key] = PrestartedKernel(kernel_name, env, cwd)
            return True

    def take(self, key: str, kernel_name: str, env: dict[str, str], cwd: str) -> PrestartedKernel | None:
        """The kernel started for run ``key``, if it was started with exactly these settings."""
        with self._lock:
            kernel = self._kernels.pop(key, None)
        if kernel is not None and not kernel.matches(kernel_name, env, cwd):
            kernel.discard()
            return None
        return kernel

    def discard(self, key: str) -> None:
        with self._lock:
            kernel = self._kernels.pop(key, None)
        if kernel is not None:
            kernel.discard()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            kernels, self._kernels = list(self._kernels.values()), {}
        for kernel in kernels:
            kernel.discard()
