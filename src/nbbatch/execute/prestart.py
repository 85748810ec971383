"""Kernels started ahead of their runs: :class:`KernelPool` starts a run's kernel before the run starts, with the
run's own kernel, environment and working directory, so that its start-up overlaps the runs before it.

A kernel whose framework has a ``preload`` list is forked, where it can be, from a fork server that imported those
modules once (:mod:`nbbatch.execute.forkserver`, started by :meth:`KernelPool.warm` when the batch starts): a batch's
first wave starts in milliseconds, not seconds each. Once up, a kernel imports the run's framework (instant when
forked) in one silent request that binds no name, puts back the working directory, environment variables and
``sys.path`` the imports changed, and never touches CUDA: a kernel's GPUs are fixed when it starts, and it is used
only by a run that got those GPUs. A kernel only ever executes the one notebook it was started for.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import os
import sys
import threading
import time
from collections.abc import Sequence
from queue import Empty
from typing import Any, BinaryIO

from nbbatch.execute.affinity import CPUS_VARIABLE
from nbbatch.execute.forkserver import ForkServer, ForkServers
from nbbatch.execute.kernels import KERNEL_ARGUMENTS, BatchKernelManager, kill_kernel_group, pin_kernel, reap_kernel

PRELOAD_TIMEOUT = 120.0  # seconds a kernel started ahead may take to import its modules
_PRELOAD_OUTPUT_MAX = 16 << 10  # characters of what importing them printed kept for the run's log


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
    """A kernel process started (in the background) for one run, before that run starts.

    With ``preload``, the kernel then imports those modules (one silent ``execute_request`` that binds no name,
    keeps no history and leaves the execution count alone; a module that cannot be imported is skipped), so that
    the run's own imports of them are instant. Nothing touches CUDA: a kernel's GPUs are fixed when it starts.
    A kernel that dies while importing, or takes longer than ``preload_timeout``, is not used.
    """

    def __init__(self, kernel_name: str, env: dict[str, str], cwd: str, preload: Sequence[str] = (),
                 preload_timeout: float = PRELOAD_TIMEOUT, fork_server: ForkServer | None = None):
        self.kernel_name, self.env, self.cwd, self.preload = kernel_name, env, cwd, tuple(preload)
        self.preload_timeout = preload_timeout
        self.km = BatchKernelManager(kernel_name=kernel_name)
        self.km.fork_server = fork_server  # the kernel is forked from it, its modules already imported
        self.error: BaseException | None = None
        self.imported: tuple[str, ...] = ()  # the preloaded modules the kernel has
        self.preload_seconds: float | None = None
        self.preload_output = ""  # what importing them printed (not the run's: kept out of its notebook)
        self._output: _KernelOutput | None = None
        self._launched = threading.Event()  # the kernel process started (or could not)
        self._ready = threading.Event()  # … and imported its modules (or could not)
        self._stop = threading.Event()
        threading.Thread(target=self._launch, name=f"prestart-{kernel_name}", daemon=True).start()

    def _launch(self) -> None:
        try:
            self._output = _KernelOutput()
            asyncio.run(self._start())
        except BaseException as exc:  # noqa: BLE001 - reported when the run claims the kernel
            self.error = exc
        finally:
            self._launched.set()
            self._ready.set()

    async def _start(self) -> None:
        assert self._output is not None
        try:
            await self.km.start_kernel(env=self.env, cwd=self.cwd, stdout=self._output.write_fd,
                                       stderr=self._output.write_fd, extra_arguments=list(KERNEL_ARGUMENTS))
        finally:
            self._output.launched()
        self._launched.set()
        if self.preload and not self._stop.is_set():
            await self._import_preload()

    async def _import_preload(self) -> None:
        names = ", ".join(self.preload)
        deadline = time.monotonic() + self.preload_timeout
        client = self.km.client()
        client.start_channels(stdin=False, hb=False, control=False)
        try:
            await client.wait_for_ready(timeout=self.preload_timeout)
            began = time.monotonic()
            asked = client.execute(_preload_code(self.preload), silent=True, store_history=False, allow_stdin=False,
                                   stop_on_error=False, user_expressions={"imported": _imported_expression(self.preload)})
            printed: list[str] = []
            while True:  # the request's output, up to its `idle`: after that the reply is on the shell channel
                if self._stop.is_set() or not await client._async_is_alive():
                    raise RuntimeError(f"the kernel ended while importing {names}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"importing {names} took longer than {self.preload_timeout:g} s")
                with contextlib.suppress(Empty):
                    msg = await client.iopub_channel.get_msg(timeout=0.2)
                    if msg["parent_header"].get("msg_id") != asked:
                        continue
                    if msg["msg_type"] == "stream" and sum(map(len, printed)) < _PRELOAD_OUTPUT_MAX:
                        printed.append(msg["content"].get("text", ""))
                    elif msg["msg_type"] == "status" and msg["content"].get("execution_state") == "idle":
                        break
            self.preload_seconds = time.monotonic() - began
            self.preload_output = "".join(printed)[:_PRELOAD_OUTPUT_MAX]
            while (reply := await client.shell_channel.get_msg(timeout=5.0))["parent_header"].get("msg_id") != asked:
                pass
            found = reply["content"].get("user_expressions", {}).get("imported", {})
            with contextlib.suppress(ValueError, SyntaxError, TypeError):
                self.imported = tuple(ast.literal_eval(found.get("data", {}).get("text/plain", "()")))
        finally:
            client.stop_channels()

    def matches(self, kernel_name: str, env: dict[str, str], cwd: str, preload: Sequence[str] = ()) -> bool:
        """Whether the kernel was started as a run with these settings would start its own. The cores it is pinned
        to may differ (a CPU run's cores are known only once it starts): :meth:`KernelPool.take` pins it again."""
        def unpinned(variables: dict[str, str]) -> dict[str, str]:
            return {name: value for name, value in variables.items() if name != CPUS_VARIABLE}

        return ((kernel_name, unpinned(env), cwd, tuple(preload))
                == (self.kernel_name, unpinned(self.env), self.cwd, self.preload))

    def claim(self, kernel_output: BinaryIO | None, wait: float = 120.0) -> BatchKernelManager | None:
        """The started kernel's manager, its process output now going to ``kernel_output``, once it has imported
        its modules; None if it could not start or import them, or has died (the run then starts a kernel of its own)."""
        ready = self._ready.wait(wait)
        process = getattr(self.km.provisioner, "process", None)
        if not ready or self.error is not None or process is None or process.poll() is not None:
            if ready and self.error is None:
                self.error = RuntimeError("it had ended")
            elif not ready:
                self.error = RuntimeError(f"it was not ready within {wait:g} s")
            self.discard()
            return None
        assert self._output is not None
        self._output.attach(kernel_output)
        return self.km

    def describe(self, km: Any) -> str:
        """One line for the run's log: whether the run got this kernel (``km`` is the one it got), whether it was
        forked, and what it imported."""
        if km is not self.km:
            return f"the kernel started ahead was not used ({self.error}); this run started its own"
        line, server = "kernel started ahead", self.km.fork_server
        if self.preload:
            missing = [name for name in self.preload if name not in self.imported]
            line += (f", {', '.join(self.imported)} imported in {self.preload_seconds or 0:.1f} s" if self.imported
                     else "") + (f", {', '.join(missing)} not importable" if missing else "")
        printed = self.preload_output
        if server is not None and self.km.fork_error is None:
            line += f"; forked from a process that had imported {', '.join(server.imported) or 'nothing'}"
            printed = server.printed + printed  # the imports ran in the server: what they printed is there
        elif server is not None:
            line += f"; not forked ({self.km.fork_error}): started as usual"
        return line + (f"; importing printed:\n{printed.rstrip()}" if printed.strip() else "")

    def release_output(self, wait: float = 1.0) -> None:
        """Stop writing the kernel's output anywhere (call once the kernel is gone)."""
        if self._output is not None:
            self._output.detach(wait)

    def discard(self) -> None:
        """Kill the kernel (never claimed, or not usable), also while it imports its modules, and clean up after it."""
        self._stop.set()
        if self._launched.wait(120.0):
            kill_kernel_group(self.km)  # an import that hangs ends now
        self._ready.wait(10.0)  # the importing thread sees the kernel gone within 0.2 s
        reap_kernel(self.km)
        self.release_output(wait=0.5)


def _preload_code(modules: Sequence[str]) -> str:
    """Import each module, skipping those that fail, then put back the working directory, environment variables and
    ``sys.path`` as they were (a module changing them must not change the run: a fresh kernel has them as started);
    no name is bound in the kernel's namespace."""
    body = "".join(f"\n    try:\n        importlib.import_module({name!r})\n    except Exception:\n        pass"
                   for name in modules) or "\n    pass"
    code = ("import importlib, os, sys\ncwd, env, path = os.getcwd(), dict(os.environ), list(sys.path)\ntry:" + body +
            "\nfinally:\n    try:\n        os.chdir(cwd)\n    except OSError:\n        pass\n"
            "    if dict(os.environ) != env:\n        os.environ.clear()\n        os.environ.update(env)\n"
            "    sys.path[:] = path\n")
    return f"exec({code!r}, {{}})"  # in a namespace of its own


def _imported_expression(modules: Sequence[str]) -> str:
    """An expression (no name bound) for which of ``modules`` the kernel has."""
    return f'[m for m in {tuple(modules)!r} if m in __import__("sys").modules]'


class KernelPool:
    """Kernels started ahead of the runs that will use them, one per run id, at most ``size`` at a time (more for
    runs starting now); ``size`` 0 starts nothing.

    A kernel is started with the run's own kernel name, environment and working directory and
    handed to that run only (:meth:`take`); a kernel whose run is cancelled, or whose launch
    settings no longer match when the run starts, is killed. A kernel is forked from the fork server
    :meth:`warm` started for its settings, if there is one. ``close`` kills every unclaimed kernel
    and lets the fork servers end with the kernels they forked.
    """

    def __init__(self, size: int, preload_timeout: float = PRELOAD_TIMEOUT):
        self.size = max(0, size)
        self.preload_timeout = preload_timeout
        self.servers = ForkServers()
        self._kernels: dict[str, PrestartedKernel] = {}
        self._lock = threading.Lock()
        self._closed = False

    def __len__(self) -> int:
        with self._lock:
            return len(self._kernels)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._kernels

    def warm(self, kernel_name: str, env: dict[str, str], preload: Sequence[str], per_run: Sequence[str] = ()) -> None:
        """Start the fork server for kernels of ``kernel_name`` with this environment (but for the variables
        ``per_run``, set when each kernel is forked) and ``preload``; none without ``preload``, with the pool off,
        or for a kernel that is not ``python -m ipykernel_launcher``."""
        if self.size and preload and (spec := _launch_spec(kernel_name, env)) is not None:
            self.servers.start(spec[0], preload, spec[1], per_run)

    def prestart(self, key: str, kernel_name: str, env: dict[str, str], cwd: str, preload: Sequence[str] = (),
                 now: bool = False, per_run: Sequence[str] = ()) -> bool:
        """Start a kernel for run ``key`` (importing ``preload`` once started; forked where a :meth:`warm` server
        serves it) unless the pool is full (``now``: the run starts now, whatever the size) or has one for it;
        whether it started one."""
        with self._lock:
            if (self._closed or not self.size or key in self._kernels
                    or (len(self._kernels) >= self.size and not now)):
                return False
        spec = _launch_spec(kernel_name, env) if preload else None
        server = self.servers.find(spec[0], preload, spec[1], per_run) if spec is not None else None
        with self._lock:
            if self._closed or key in self._kernels:
                return False
            self._kernels[key] = PrestartedKernel(kernel_name, env, cwd, preload, self.preload_timeout, server)
            return True

    def take(self, key: str, kernel_name: str, env: dict[str, str], cwd: str,
             preload: Sequence[str] = ()) -> PrestartedKernel | None:
        """The kernel started for run ``key``, if it was started with exactly these settings."""
        with self._lock:
            kernel = self._kernels.pop(key, None)
        if kernel is not None and not kernel.matches(kernel_name, env, cwd, preload):
            kernel.discard()
            return None
        if kernel is not None and env.get(CPUS_VARIABLE) != kernel.env.get(CPUS_VARIABLE):
            pin_kernel(kernel.km, env)  # every thread it has, so also those its preload started
        return kernel

    def discard(self, key: str) -> None:
        with self._lock:
            kernel = self._kernels.pop(key, None)
        if kernel is not None:
            kernel.discard()

    def close(self) -> None:
        """Kill every unclaimed kernel; the fork servers end once the kernels they forked have ended."""
        with self._lock:
            self._closed = True
            kernels, self._kernels = list(self._kernels.values()), {}
        for kernel in kernels:
            kernel.discard()
        self.servers.close()


def _launch_spec(kernel_name: str, env: dict[str, str]) -> tuple[list[str], dict[str, str]] | None:
    """The kernel's command and the environment it starts with (its kernelspec's variables over ``env``, as
    jupyter_client starts it); None for a kernel not found."""
    try:
        spec = BatchKernelManager(kernel_name=kernel_name).kernel_spec
    except Exception:  # noqa: BLE001 - the run itself then says the kernel is missing
        return None
    if spec is None:
        return None
    argv = list(spec.argv)
    if argv and argv[0] in {"python", f"python{sys.version_info[0]}", "python{}.{}".format(*sys.version_info[:2])}:
        argv[0] = sys.executable  # as jupyter_client starts such a kernel: with the driver's own Python
    return argv, {**env, **(spec.env or {})}
