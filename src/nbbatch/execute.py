"""Execute one run: the same code on every backend (``nbbatch run-one`` calls it).

Inject parameters, execute with papermill (engine ``nbbatch``) in the run's kernel, stream the
kernel's output to ``log.txt``, write ``output.ipynb`` and ``run.json`` atomically to the share,
enforce run and cell timeouts, honour cancellation, and retry when the kernel died.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .errors import ShareError
from .runrecord import LOG_FILE, OUTPUT_NOTEBOOK, RUN_RECORD, RunError, RunRecord, utc_now
from .runs import Run
from .share import Share

CANCEL_MARKER = "CANCEL"  # <experiment>/CANCEL cancels every run; <experiment>/<run>/CANCEL one run
SECRET_ENV_HINTS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "CONNECTION_STRING", "SAS")
SHARE_FAILED = "the share could not be written"
UpdateCallback = Callable[[RunRecord], None]


def run_dir(run: Run) -> str:
    return f"{run.experiment}/{run.run_id}"


def read_record(share: Share, experiment: str, run_id: str) -> RunRecord | None:
    """The run's ``run.json``, or None when it has none yet (a corrupt one raises ShareError)."""
    path = f"{experiment}/{run_id}/{RUN_RECORD}"
    try:
        data = share.read_bytes(path)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    return RunRecord.from_json(data, source=f"{share.url}/{path}")


def write_record(share: Share, record: RunRecord) -> None:
    share.write_bytes(f"{record.experiment}/{record.run_id}/{RUN_RECORD}", record.to_json())


def write_cancel_markers(share: Share, experiment: str, run_ids: list[str] | None = None) -> list[str]:
    """Ask unfinished runs to stop (all of the experiment's when ``run_ids`` is None); return the ids asked.

    Whoever executes a run (any backend) watches these markers and kills its kernel.
    """
    asked = []
    for run_id in list(run_ids) if run_ids else share.list(experiment):
        record = read_record(share, experiment, run_id)
        if record is None or record.final:
            continue
        share.write_bytes(f"{experiment}/{run_id}/{CANCEL_MARKER}", utc_now().encode())
        asked.append(run_id)
    if not run_ids:
        share.write_bytes(f"{experiment}/{CANCEL_MARKER}", utc_now().encode())
    return asked


def new_record(run: Run, backend: str = "local") -> RunRecord:
    """A ``queued`` record for a run that is about to be scheduled."""
    return RunRecord(run_id=run.run_id, experiment=run.experiment, notebook=run.notebook_rel, kernel=run.kernel,
                     framework=run.framework, parameters=dict(run.parameters), status="queued", queued_at=utc_now(),
                     backend=backend, timeout_s=run.timeout_s)


class _LogSink(io.TextIOBase):
    """A text stream the kernel's stdout/stderr go to: a local file, synced to remote shares.

    A write that fails (the share is full) never breaks the run's execution: the sink keeps the first
    error in ``error`` and stops writing; the run is then failed with it.
    """

    def __init__(self, path: Path):
        self.path = path
        self.error: OSError | None = None
        self._lock = threading.Lock()
        self._handle: Any = None
        try:
            self._handle = open(path, "a", encoding="utf-8", errors="replace")
        except OSError as exc:
            self.error = exc

    def write(self, text: str) -> int:  # type: ignore[override]
        with self._lock:
            if self._handle is not None and self.error is None:
                try:
                    self._handle.write(text)
                    self._handle.flush()
                except OSError as exc:
                    self.error = exc
        return len(text)

    def close(self) -> None:
        with self._lock:
            if self._handle is not None:
                with contextlib.suppress(OSError):
                    self._handle.close()
        super().close()


def _kernel_env(run: Run, gpu_ids: list[int] | None, shared_gpu: bool) -> dict[str, str]:
    env = dict(os.environ)
    # A run's kernel gets no credentials of the driver: they would be readable from the notebook.
    for name in list(env):
        if any(h in name.upper() for h in SECRET_ENV_HINTS):
            del env[name]
    env.update(run.env)
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpu_ids or [])
    if shared_gpu:
        env.update(run.shared_gpu_env)
    env.update({"NBBATCH_RUN_ID": run.run_id, "NBBATCH_EXPERIMENT": run.experiment,
                "PYDEVD_DISABLE_FILE_VALIDATION": "1"})
    return env


def kernel_launch(run: Run, gpu_ids: list[int] | None = None, shared_gpu: bool = False,
                  project_root: Path | None = None) -> tuple[str, dict[str, str], str]:
    """The kernel name, environment and working directory a run's kernel is started with."""
    cwd = run.cwd or str(run.resolve_notebook(project_root).parent)
    return run.kernel, _kernel_env(run, gpu_ids, shared_gpu), cwd


def _error_from(exc: BaseException) -> RunError:
    cell_index = getattr(exc, "cell_index", None)
    source = getattr(exc, "source", None)
    ename = getattr(exc, "ename", None) or type(exc).__name__
    evalue = getattr(exc, "evalue", None)
    if evalue is None:
        evalue = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
    snippet = "\n".join(str(source).splitlines()[:5]) if source else None
    return RunError(ename=str(ename), evalue=str(evalue)[:2000], cell_index=cell_index, cell_source=snippet)


def _kernel_pid(km: Any) -> int | None:
    provisioner = getattr(km, "provisioner", None)
    return getattr(provisioner, "pid", None) or getattr(getattr(provisioner, "process", None), "pid", None)


def _kill_process_group(km: Any) -> None:
    """Kill the kernel and every process it started (it runs in its own session)."""
    pid = _kernel_pid(km)
    if not pid:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(os.getpgid(pid), signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


_REAPER_SOURCE = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
groups = set()
for line in sys.stdin:
    op, _, pgid = line.strip().partition(" ")
    if pgid.isdigit():
        (groups.add if op == "+" else groups.discard)(int(pgid))
for pgid in groups:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
"""


class _KernelReaper:
    """Kills the process groups of this process's running kernels when this process dies, even by SIGKILL.

    A kernel polls its parent and exits when it is gone (``JPY_PARENT_PID``), but the processes the
    notebook started (data loaders, servers, ``subprocess``) would live on. One small helper process
    per driver holds the kernels' process groups and reads a pipe from the driver: the pipe closes
    when the driver dies however it dies, and the helper then kills the groups still registered.
    """

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._owner: int | None = None
        self._lock = threading.Lock()

    def watch(self, km: Any) -> int | None:
        pid = _kernel_pid(km)
        if not pid or not hasattr(os, "killpg"):  # no process groups (Windows)
            return None
        try:
            pgid = os.getpgid(pid) if pid else None
        except OSError:
            return None
        if pgid and pgid != os.getpgid(0):  # never our own group
            self._send(f"+ {pgid}\n")
            return pgid
        return None

    def forget(self, pgid: int | None) -> None:
        if pgid:
            self._send(f"- {pgid}\n")

    def _send(self, line: str) -> None:
        if not hasattr(os, "killpg"):
            return
        with self._lock:
            if self._proc is None or self._proc.poll() is not None or self._owner != os.getpid():
                try:
                    self._proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _REAPER_SOURCE],
                                                  stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                                  stderr=subprocess.DEVNULL, start_new_session=True)
                except OSError:
                    self._proc = None
                    return
                self._owner = os.getpid()
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.write(line.encode())
                self._proc.stdin.flush()
            except OSError:
                self._proc = None

    def close(self) -> None:
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is not None and self._owner == os.getpid():
            with contextlib.suppress(Exception):
                assert proc.stdin is not None
                proc.stdin.close()
                proc.wait(timeout=2)


_REAPER = _KernelReaper()
atexit.register(_REAPER.close)


class _Watchdog:
    """Stops the kernel when the run times out or is cancelled (by event or by marker in the share)."""

    def __init__(self, run: Run, share: Share, deadline: float | None, cancel_event: threading.Event | None):
        self.run, self.share, self.deadline, self.cancel_event = run, share, deadline, cancel_event
        self.reason: str | None = None  # "timed_out" | "cancelled"
        self.km: Any = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"watchdog-{run.run_id}", daemon=True)
        self._markers = (f"{run.experiment}/{CANCEL_MARKER}", f"{run_dir(run)}/{CANCEL_MARKER}")
        self._poll = 0.25 if share.local_path("") is not None else 2.0

    def __enter__(self) -> _Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def cancelled(self) -> bool:
        if self.cancel_event is not None and self.cancel_event.is_set():
            return True
        return any(self.share.exists(m) for m in self._markers)

    def _loop(self) -> None:
        while not self._stop.wait(self._poll):
            if self.reason is None:
                if self.deadline is not None and time.monotonic() > self.deadline:
                    self.reason = "timed_out"
                elif self.cancelled():
                    self.reason = "cancelled"
            if self.reason and self.km is not None:
                _kill_process_group(self.km)


def _environment_versions(run: Run) -> dict[str, str]:
    if not run.framework:
        return {}
    try:
        from .envs import env_packages
        from .frameworks import get_framework

        packages = env_packages(get_framework(run.framework))
    except Exception:  # noqa: BLE001 - remote nodes may lack the project's frameworks/ folder
        return {}
    wanted = {line.split("==")[0].split("[")[0].lower() for line in _pins(run)}
    return {k: v for k, v in packages.items() if k in wanted or k in ("ipykernel", "numpy")} or packages


def _pins(run: Run) -> list[str]:
    try:
        from .frameworks import get_framework

        return get_framework(run.framework).pinned() if run.framework else []
    except Exception:  # noqa: BLE001
        return []


@contextlib.contextmanager
def _gpu_telemetry(gpu_ids: list[int]) -> Iterator[Any]:
    try:
        from .telemetry import GpuSampler
    except ImportError:
        yield None
        return
    with GpuSampler(gpu_ids) as sampler:
        yield sampler


def execute_run(run: Run, share: Share, *, gpu_ids: list[int] | None = None, shared_gpu: bool = False,
                cancel_event: threading.Event | None = None, on_update: UpdateCallback | None = None,
                backend: str = "local", project_root: Path | None = None, save_every: float = 1.0,
                kernels: Any = None) -> RunRecord:
    """Execute ``run`` (retrying after kernel deaths up to ``run.retries``) and return its final record.

    ``kernels`` is an :class:`nbbatch.kernels.KernelPool` that may hold a kernel started for this run.
    """
    record = read_record(share, run.experiment, run.run_id) or new_record(run, backend)
    attempts_left = run.retries + 1
    while True:
        record = _attempt(run, share, record, gpu_ids or [], shared_gpu, cancel_event, on_update, backend,
                          project_root, save_every, kernels)
        kernels = None  # a retry starts a kernel of its own
        attempts_left -= 1
        died = record.status == "failed" and record.error is not None and record.error.reason == "kernel died"
        if not died or attempts_left <= 0:
            return record


def _attempt(run: Run, share: Share, record: RunRecord, gpu_ids: list[int], shared_gpu: bool,
             cancel_event: threading.Event | None, on_update: UpdateCallback | None, backend: str,
             project_root: Path | None, save_every: float, kernels: Any = None) -> RunRecord:
    from papermill.exceptions import PapermillExecutionError
    from papermill.execute import prepare_notebook_metadata, raise_for_execution_errors, remove_error_markers
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    from . import engine as _engine  # noqa: F401 - registers the papermill engine
    from .record import metrics_from_notebook

    notify = on_update or (lambda _r: None)
    folder = run_dir(run)
    share.remove(f"{folder}/{CANCEL_MARKER}")
    record.status, record.error, record.metrics = "running", None, {}
    record.attempts += 1
    record.started_at, record.ended_at, record.duration_s = utc_now(), None, None
    record.host, record.pid, record.backend = socket.gethostname(), os.getpid(), backend
    record.gpu_ids = list(gpu_ids)
    record.cells_done = 0
    record.environment = _environment_versions(run)
    write_record(share, record)
    notify(record)

    local = share.local_path(folder)
    scratch: Any = None
    if local is None:
        import tempfile

        scratch = tempfile.TemporaryDirectory(prefix="nbbatch-run-")
        work = Path(scratch.name)
    else:
        work = local
        try:
            work.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ShareError(f"cannot create the run folder {work}: {exc.strerror or exc}") from exc
        for stale in work.glob(".*.part"):  # left by a driver killed mid-write; this run's writer is us
            stale.unlink(missing_ok=True)
    log_path = work / LOG_FILE
    if record.attempts == 1 and log_path.exists():
        log_path.unlink()
    log = _LogSink(log_path)
    log.write(f"=== nbbatch run {run.run_id} attempt {record.attempts} on {record.host} "
              f"(kernel {run.kernel}, CUDA_VISIBLE_DEVICES={','.join(map(str, gpu_ids))}) at {record.started_at}\n")

    last_record_write = [time.monotonic()]  # the "running" record was just written: the next one after 2 s

    def save_notebook(nb: Any) -> None:
        from .notebook_io import notebook_bytes

        share.write_bytes(f"{folder}/{OUTPUT_NOTEBOOK}", notebook_bytes(nb))
        if local is None:  # remote share: push the log alongside the checkpoint
            share.write_bytes(f"{folder}/{LOG_FILE}", log_path.read_bytes())

    def on_cell(done: int, total: int) -> None:
        record.cells_done, record.cells_total = done, total
        if time.monotonic() - last_record_write[0] > 2.0:
            last_record_write[0] = time.monotonic()
            write_record(share, record)
            notify(record)

    nb: Any = None
    started = time.monotonic()
    deadline = started + run.timeout_s if run.timeout_s else None
    watchdog = _Watchdog(run, share, deadline, cancel_event)
    status, error = "succeeded", None
    try:
        notebook_path = run.resolve_notebook(project_root)
        nb = load_notebook_node(str(notebook_path))
        nb = parameterize_notebook(nb, run.parameters, kernel_name=run.kernel, language="python") \
            if run.parameters else nb
        nb = prepare_notebook_metadata(nb, str(notebook_path), OUTPUT_NOTEBOOK)
        nb = remove_error_markers(nb)
        _set_kernelspec(nb, run.kernel)

        kernel_group: list[int | None] = [None]

        def on_kernel(km: Any) -> None:
            watchdog.km = km
            kernel_group[0] = _REAPER.watch(km)
            if watchdog.reason:
                _kill_process_group(km)

        kernel_name, kernel_env, kernel_cwd = kernel_launch(run, gpu_ids, shared_gpu, project_root)
        prestarted = kernels.take(run.run_id, kernel_name, kernel_env, kernel_cwd) if kernels is not None else None
        with watchdog, _gpu_telemetry(gpu_ids) as sampler, open(log_path, "ab") as kernel_output:
            try:
                nb = _engine.NbbatchEngine.execute_notebook(
                    nb, kernel_name, saver=save_notebook, save_every=save_every, on_cell=on_cell,
                    stdout_file=log, stderr_file=log, start_timeout=120, execution_timeout=run.cell_timeout_s,
                    kernel_env=kernel_env, kernel_cwd=kernel_cwd, on_kernel=on_kernel, input_path=str(notebook_path),
                    kernel_stderr=kernel_output, prestarted=prestarted, final_save=False,  # saved below, once
                )
            finally:
                _REAPER.forget(kernel_group[0])
                if sampler is not None:
                    record.telemetry = sampler.summary()
                    with contextlib.suppress(Exception):
                        share.write_bytes(f"{folder}/telemetry.json", sampler.series_json())
        errored = [c for c in nb.cells if c.get("metadata", {}).get("papermill", {}).get("exception")]
        if errored:
            raise_for_execution_errors(nb, str(work / ".failed-output.ipynb"))
    except PapermillExecutionError as exc:
        status, error = "failed", _error_from(exc)
    except Exception as exc:  # noqa: BLE001 - every failure becomes the run's recorded error
        status, error = _classify(exc, watchdog, run)
        if error.reason == "nbbatch could not execute the notebook" and not isinstance(exc, ShareError):
            import traceback

            log.write(traceback.format_exc())
    finally:
        (work / ".failed-output.ipynb").unlink(missing_ok=True)
    if watchdog.reason and status != "succeeded":
        status = watchdog.reason
        what = "the run timeout" if status == "timed_out" else "a cancel request"
        error = error or RunError(ename=status, evalue="")
        error.reason = f"stopped by {what}" + (f" ({run.timeout_s:g} s)" if status == "timed_out" else "")
        if nb is not None:
            _add_stop_marker(nb, error.reason)

    record.status, record.error = status, error
    record.ended_at, record.duration_s = utc_now(), round(time.monotonic() - started, 3)
    if nb is not None:
        record.metrics = metrics_from_notebook(nb)
        record.cells_total = len(nb.cells)
        record.cells_done = max((i + 1 for i, c in enumerate(nb.cells)
                                 if c.get("metadata", {}).get("papermill", {}).get("end_time")), default=0)
        try:
            save_notebook(nb)
        except ShareError as exc:  # the previous (partial) notebook stays, and the run is not succeeded
            status, error = "failed", RunError("ShareError", str(exc), reason=SHARE_FAILED)
    if log.error is not None and status == "succeeded":
        status, error = "failed", RunError("ShareError", f"cannot write {LOG_FILE} in the share: {log.error}",
                                           reason=SHARE_FAILED)
    record.status, record.error = status, error
    summary = error.summary() if error else "ok"
    log.write(f"=== {status} after {record.duration_s:.2f} s: {summary}\n")
    log.close()
    if local is None:
        try:
            share.write_bytes(f"{folder}/{LOG_FILE}", log_path.read_bytes())
        except ShareError as exc:
            if record.status == "succeeded":
                record.status, record.error = "failed", RunError("ShareError", str(exc), reason=SHARE_FAILED)
        finally:
            scratch.cleanup()
    write_record(share, record)
    notify(record)
    return record


def _classify(exc: Exception, watchdog: _Watchdog, run: Run) -> tuple[str, RunError]:
    from jupyter_client.kernelspec import NoSuchKernel
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    error = _error_from(exc)
    if watchdog.reason:
        return watchdog.reason, error
    if isinstance(exc, CellTimeoutError):
        error.reason = f"a cell ran longer than the cell timeout ({run.cell_timeout_s:g} s)"
        return "timed_out", error
    if isinstance(exc, DeadKernelError):
        error.reason = "kernel died"
        return "failed", error
    if isinstance(exc, ShareError):
        error.evalue, error.reason = str(exc), SHARE_FAILED
        return "failed", error
    if isinstance(exc, NoSuchKernel):
        error.reason = f"kernel `{run.kernel}` is not installed where the run executed"
        return "failed", error
    error.reason = error.reason or "nbbatch could not execute the notebook"
    return "failed", error


def _set_kernelspec(nb: Any, kernel: str) -> None:
    """Make the output notebook name the kernel it actually ran in."""
    try:
        from jupyter_client.kernelspec import KernelSpecManager

        spec = KernelSpecManager().get_kernel_spec(kernel)
        display, language = spec.display_name, spec.language
    except Exception:  # noqa: BLE001
        display, language = kernel, "python"
    nb.metadata["kernelspec"] = {"name": kernel, "display_name": display, "language": language}
    nb.metadata.setdefault("language_info", {"name": language})


def _add_stop_marker(nb: Any, reason: str) -> None:
    import nbformat

    marker = nbformat.v4.new_markdown_cell(
        source=f'<span style="color:red; font-family:Helvetica Neue, Helvetica, Arial, sans-serif; font-size:2em;">'
               f"nbbatch stopped this run: {reason}</span>")
    marker.metadata["tags"] = ["papermill-error-cell-tag"]
    nb.cells.insert(0, marker)
