"""A kernel fork server: run by a framework venv's own Python, by file path (stdlib only; the venv may not have nbbatch).

``python [interpreter options] kernel_forkserver.py SOCKET [MODULE ...]`` imports the modules (a module that cannot be
imported is skipped) and ipykernel's own start-up imports once, puts back the working directory, environment and
``sys.path`` the imports changed, prints one JSON line (``{"ready": …}``) and then forks a kernel for each request on
the Unix socket ``SOCKET``: a request is one JSON line (``argv`` after ``-m ipykernel_launcher``, ``env``, ``cwd``)
with the kernel's stdout and stderr passed as file descriptors (SCM_RIGHTS); the answer is ``{"pid": …}``, and when
the kernel ends, ``{"exit": code}`` (negative: the signal) on the same connection.

A forked kernel is made as a fresh ``python -m ipykernel_launcher -f …`` started in ``cwd`` with ``env`` would be: a
session of its own, that environment (``os.environ`` replaced), working directory, ``sys.argv`` and ``sys.path``, and
the random generators a module seeded at import seeded anew (``RESEED``; Python's ``random`` reseeds itself). The
server never forks once it has a Python thread besides its own or CUDA's driver or NVML loaded (a preload that
touched the GPU): it says so instead (``{"ready": false, …}``) and exits. It exits when its parent (the driver) is gone,
or when asked to (``{"close": true}``), once its kernels ended.
"""

import array
import atexit
import builtins
import importlib
import json
import os
import runpy
import select
import signal
import socket
import sys
import threading
import time
import traceback
import types

_MAX_FDS = 2


def _fresh_path(script_dir):
    """``sys.path`` as the interpreter made it, without this script's folder (a kernel puts its cwd there)."""
    return [p for i, p in enumerate(sys.path) if not (i == 0 and os.path.abspath(p or ".") == script_dir)]


def _python_threads():
    """Threads of Python's besides this one (an import's worker): a fork would copy its locks, not it. Native threads
    (PyTorch starts one at import) are a library's own, made fork-safe by it as PyTorch's data loaders need."""
    return threading.active_count() - 1


# The GPU device files CUDA's driver and NVML open when initialised (tests point it at files of their own).
_GPU_DEVICES = os.environ.pop("FORKSERVER_GPU_DEVICES", "/dev/nvidia")


def _cuda_loaded():
    """Whether CUDA's driver or NVML was initialised (a GPU device file is open): an import asked about the GPUs (a
    count it keeps would be the server's, which sees none), or made a CUDA context a fork cannot keep. Their libraries
    merely loaded are fine: a CUDA build of PyTorch loads CUDA's driver at import and forks safely until it is used."""
    try:
        return any(os.readlink(f"/proc/self/fd/{fd}").startswith(_GPU_DEVICES) for fd in os.listdir("/proc/self/fd")
                   if _is_link(f"/proc/self/fd/{fd}"))
    except OSError:
        return False


def _is_link(path):
    try:
        os.readlink(path)
        return True
    except OSError:  # gone meanwhile (the listing's own descriptor)
        return False


def _preload(modules):
    """Import ``modules`` (and ipykernel's kernel app) as a kernel would, then undo what they changed around them."""
    cwd, env, path = os.getcwd(), dict(os.environ), list(sys.path)
    imported = []
    try:
        for name in [*modules, "ipykernel.kernelapp"]:
            try:
                importlib.import_module(name)
                if name in modules:
                    imported.append(name)
            except Exception:  # noqa: BLE001 - a run imports what it can; the kernel's own import says why
                pass
    finally:
        try:
            os.chdir(cwd)
        except OSError:
            pass
        if dict(os.environ) != env:
            os.environ.clear()
            os.environ.update(env)
        sys.path[:] = path
    return imported


# Random generators seeded once, at import, from the OS: a fresh kernel's differ, a fork's would be its server's.
# (module, its function that seeds it anew from the OS). Python's `random` reseeds itself at a fork.
RESEED = (("numpy.random", "seed"), ("torch", "seed"))


def _reseed():
    for module, function in RESEED:
        target = sys.modules.get(module)
        for name in function.split(".") if target is not None else ():
            target = getattr(target, name, None)
        if callable(target):
            target()  # torch.seed() seeds CUDA's generators lazily: no CUDA call here


def _receive(conn):
    """One request: its JSON line and the file descriptors that came with it."""
    data, fds = b"", []
    while not data.endswith(b"\n"):
        chunk, ancillary, _flags, _addr = conn.recvmsg(1 << 20, socket.CMSG_SPACE(_MAX_FDS * 4))
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(payload[: len(payload) - len(payload) % 4])
                fds.extend(got)
        if not chunk:
            break
        data += chunk
    return json.loads(data or b"null"), fds


def _child(request, fds, own_fds, fresh_path):
    """Become the kernel: never returns."""
    code = 1
    try:
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        out = fds[0] if fds else os.open(os.devnull, os.O_WRONLY)
        err = fds[1] if len(fds) > 1 else out
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        for fd in {*own_fds, *fds, null}:
            if fd > 2:
                try:
                    os.close(fd)
                except OSError:
                    pass
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[:] = [os.getcwd(), *fresh_path]  # `python -m` puts the working directory first
        if hasattr(sys, "orig_argv"):
            sys.orig_argv = list(request.get("orig_argv") or sys.orig_argv)
        _reseed()
        sys.argv = ["-m", *request["argv"]]
        main = types.ModuleType("__main__")  # runpy runs the launcher in __main__'s globals: fresh ones, not ours
        main.__dict__["__builtins__"] = builtins
        sys.modules["__main__"] = main
        runpy._run_module_as_main("ipykernel_launcher", alter_argv=True)
        code = 0
    except SystemExit as exc:  # as the interpreter ends on one: a message is printed, its code 1
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            sys.stderr.write(f"{exc.code}\n")
    except BaseException:  # noqa: BLE001 - said on the kernel's stderr, which goes to the run's log
        traceback.print_exc()
    finally:
        _finalize()
        os._exit(code)


def _finalize():
    """What the interpreter does at its end, as a kernel started cold would: wait for the threads that are not daemons,
    run the ``atexit`` functions (the notebook's own too), flush the output."""
    for end in (threading._shutdown, atexit._run_exitfuncs):
        try:
            end()
        except BaseException:  # noqa: BLE001 - as the interpreter goes on past a failing one
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass


def _answer(conn, message):
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        pass


def serve(socket_path, modules):
    script_dir = os.path.dirname(os.path.abspath(__file__))
    fresh_path = _fresh_path(script_dir)
    driver = os.getppid()
    began = time.monotonic()
    imported = _preload(modules)
    threads, cuda = _python_threads(), _cuda_loaded()
    ready = not threads and not cuda
    why = "" if ready else ("the imports loaded CUDA's driver or NVML" if cuda
                            else f"the imports started {threads} Python threads")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if ready:
        listener.bind(socket_path)
        listener.listen(16)
    sys.stdout.write(json.dumps({"ready": ready, "why": why, "imported": imported,
                                 "seconds": round(time.monotonic() - began, 3)}) + "\n")
    sys.stdout.flush()
    if not ready:
        return
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 1)
    os.dup2(null, 2)
    kernels = {}  # pid → the connection its request came on
    quiet = set()  # connections the driver closed (its kernel is still reaped)
    closing = False
    while True:
        try:
            watched = [c for c in kernels.values() if c not in quiet]
            readable, _, _ = select.select([listener, *watched], [], [], 0.05)
        except InterruptedError:
            readable = []
        for conn in readable:
            if conn is listener:
                client, _ = listener.accept()
                try:
                    request, fds = _receive(client)
                except (OSError, ValueError):
                    client.close()
                    continue
                if not request or request.get("close"):
                    closing = True
                    client.close()
                    continue
                own = [listener.fileno(), client.fileno(), null, *(c.fileno() for c in kernels.values())]
                pid = os.fork()
                if pid == 0:
                    _child(request, fds, own, fresh_path)
                for fd in fds:
                    os.close(fd)
                kernels[pid] = client
                _answer(client, {"pid": pid})
            elif conn.recv(1) == b"":  # the driver closed its side: still reaped below
                quiet.add(conn)
        while kernels:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = kernels.pop(pid, None)
            if conn is not None:
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                _answer(conn, {"exit": code})
                conn.close()
                quiet.discard(conn)
        if os.getppid() != driver or (closing and not kernels):
            break
    listener.close()
    try:
        os.unlink(socket_path)
    except OSError:
        pass


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2:])
