"""Execute one run: the same code on every backend (``nbbatch run-one`` calls it).

Inject parameters, execute with papermill (engine ``nbbatch``) in the run's kernel, stream the
kernel's output to ``log.txt``, write ``output.ipynb`` and ``run.json`` atomically to the share,
enforce run and cell timeouts, honour cancellation, and retry when the kernel died.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from nbbatch.errors import NbbatchError, ShareError
from nbbatch.execute.kernels import kill_kernel_group
from nbbatch.execute.live import LiveRecord, StreamedFile
from nbbatch.execute.watchdog import REAPER, Watchdog
from nbbatch.plan.runs import Run
from nbbatch.redact import is_secret, tracking_credentials
from nbbatch.store.jsonl import jsonl_line
from nbbatch.store.layout import LOG_FILE, METRICS_FILE, OUTPUT_NOTEBOOK, TELEMETRY_FILE, run_paths
from nbbatch.store.runfiles import cancel_requested, new_record, read_record, write_record
from nbbatch.store.runjson import ErrorKind, RunError, RunRecord, Status, utc_now
from nbbatch.store.share import Share

SHARE_FAILED = "the share could not be written"
UpdateCallback = Callable[[RunRecord], None]


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


def _kernel_env(run: Run, gpu_ids: list[int] | None, shared_gpu: bool,
                gpu_env: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # A run's kernel gets no credentials of the driver: they would be readable from the notebook.
    for name in list(env):
        if is_secret(name, env[name]):
            del env[name]
    env.update(tracking_credentials(os.environ))  # only with MLFLOW_TRACKING_URI: nbbatch.record logs there
    env.update(run.env)
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpu_ids or [])
    if gpu_ids:  # CUDA's default order puts the fastest GPU first; nbbatch's indices are NVML's, by PCI bus
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    if shared_gpu:
        env.update(run.shared_gpu_env)
    env.update(gpu_env or {})  # a CUDA MPS daemon's pipe, and the devices as it numbers them
    env.update({"NBBATCH_RUN_ID": run.run_id, "NBBATCH_EXPERIMENT": run.experiment,
                "PYDEVD_DISABLE_FILE_VALIDATION": "1"})
    parameters = json.dumps(run.parameters, default=str)
    if len(parameters) <= _MAX_PARAMETERS_ENV:  # what nbbatch.record gives MLflow as the run's params
        env["NBBATCH_PARAMETERS"] = parameters
    return env


_MAX_PARAMETERS_ENV = 64 * 1024  # an environment variable much larger than this can stop exec


def kernel_launch(run: Run, gpu_ids: list[int] | None = None, shared_gpu: bool = False,
                  project_root: Path | None = None, gpu_env: dict[str, str] | None = None,
                  share: Share | None = None) -> tuple[str, dict[str, str], str]:
    """The kernel name, environment and working directory a run's kernel is started with.

    With ``share``, the environment names the run's output and checkpoint folders.
    """
    from nbbatch.execute.folders import folder_env

    cwd = run.cwd or str(run.resolve_notebook(project_root).parent)
    env = _kernel_env(run, gpu_ids, shared_gpu, gpu_env)
    if share is not None:
        env.update(folder_env(run, share))
    return run.kernel, env, cwd


def _error_from(exc: BaseException) -> RunError:
    cell_index = getattr(exc, "cell_index", None)
    source = getattr(exc, "source", None)
    ename = getattr(exc, "ename", None) or type(exc).__name__
    evalue = getattr(exc, "evalue", None)
    if evalue is None:
        evalue = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
    snippet = "\n".join(str(source).splitlines()[:5]) if source else None
    return RunError(ename=str(ename), evalue=str(evalue)[:2000], cell_index=cell_index, cell_source=snippet)


def _environment_versions(run: Run) -> dict[str, str]:
    if not run.framework:
        return {}
    try:
        from nbbatch.execute.envs import env_packages
        from nbbatch.spec.frameworks import get_framework

        packages = env_packages(get_framework(run.framework))
    except Exception:  # noqa: BLE001 - remote nodes may lack the project's frameworks/ folder
        return {}
    wanted = {line.split("==")[0].split("[")[0].lower() for line in _pins(run)}
    return {k: v for k, v in packages.items() if k in wanted or k in ("ipykernel", "numpy")} or packages


def _pins(run: Run) -> list[str]:
    try:
        from nbbatch.spec.frameworks import get_framework

        return get_framework(run.framework).pinned() if run.framework else []
    except Exception:  # noqa: BLE001
        return []


@contextlib.contextmanager
def _gpu_telemetry(gpu_ids: list[int], stream: StreamedFile, alone: bool) -> Iterator[Any]:
    try:
        from nbbatch.execute.telemetry import GpuSampler
    except ImportError:
        yield None
        return
    with GpuSampler(gpu_ids, sink=stream.append, alone=alone) as sampler:
        yield sampler


def execute_run(run: Run, share: Share, *, gpu_ids: list[int] | None = None, shared_gpu: bool = False,
                cancel_event: threading.Event | None = None, on_update: UpdateCallback | None = None,
                backend: str = "local", project_root: Path | None = None, save_every: float = 1.0,
                kernels: Any = None, gpu_env: dict[str, str] | None = None,
                gpu_share: dict[str, Any] | None = None, container: dict[str, Any] | None = None,
                recorded_gpu_ids: list[int] | None = None, input_paths: dict[str, str] | None = None,
                placement: Any = None) -> RunRecord:
    """Execute ``run`` (retrying after kernel deaths up to ``run.retries``) and return its final record.

    ``kernels`` is an :class:`nbbatch.execute.kernels.KernelPool` that may hold a kernel started for this run.
    ``gpu_env`` is added to the kernel's environment (a CUDA MPS daemon's); ``gpu_share`` says in run.json
    how the run's GPUs were shared (``exclusive``: no other run on them, so their memory use is the run's).
    In a container, ``container`` names its image, and ``recorded_gpu_ids`` are the GPUs' indices on the
    host (``gpu_ids`` are the container's own, numbered from 0).
    A distributed run starts this node's ranks (:mod:`nbbatch.execute.ranks`): ``placement`` says where the node
    is in the gang, else the environment its backend set does.
    """
    from nbbatch.execute.folders import RunFolders

    if run.distribution:
        from nbbatch.execute.ranks import execute_node, placement_from_env

        return execute_node(run, share, placement or placement_from_env(run, os.environ), gpu_ids=gpu_ids,
                            cancel_event=cancel_event, on_update=on_update, backend=backend, project_root=project_root,
                            save_every=save_every, recorded_gpu_ids=recorded_gpu_ids, input_paths=input_paths)

    record = read_record(share, run.experiment, run.run_id) or new_record(run, backend)
    record.gpu_share = dict(gpu_share or {})
    record.container = dict(container or {})
    _note_lost_attempt(record)
    try:
        folders = RunFolders(run, share, input_paths=input_paths, project_root=project_root)
    except NbbatchError as exc:  # an input missing here, or a share that would not give the checkpoints
        return _failed_before_start(share, record, exc, on_update)
    record.inputs = dict(folders.inputs)
    attempts_left = run.retries + 1
    try:
        while True:
            record = _attempt(run, share, record, gpu_ids or [], shared_gpu, cancel_event, on_update, backend,
                              project_root, save_every, kernels, gpu_env, recorded_gpu_ids, folders)
            kernels = None  # a retry starts a kernel of its own
            attempts_left -= 1
            died = record.status == Status.FAILED and record.error is not None and \
                record.error.kind == ErrorKind.KERNEL_DIED
            if not died or attempts_left <= 0 or _cancelled_meanwhile(run, share, cancel_event):
                break
    finally:
        folders.close()
    if record.status == Status.SUCCEEDED:  # checkpoints are for resuming a run, not its results
        with contextlib.suppress(ShareError, OSError):
            share.remove(run_paths(run.experiment, run.run_id).checkpoints)
    return record


def _note_lost_attempt(record: RunRecord) -> None:
    """An attempt that never ended (its node or job was lost, then restarted this one) goes in the attempt log."""
    if record.status != Status.RUNNING or not record.attempts:
        return
    entry = next((e for e in record.attempt_log if e.get("attempt") == record.attempts), None)
    if entry is None:
        entry = {"attempt": record.attempts, "host": record.host, "started_at": record.started_at}
        record.attempt_log.append(entry)
    entry.update(status="lost", kind=str(ErrorKind.INFRA))


def _failed_before_start(share: Share, record: RunRecord, exc: NbbatchError,
                         on_update: UpdateCallback | None) -> RunRecord:
    record.status, record.ended_at = Status.FAILED, utc_now()
    record.error = RunError(type(exc).__name__, str(exc), reason="the run could not start here", kind=ErrorKind.INFRA)
    write_record(share, record)
    if on_update is not None:
        on_update(record)
    return record


def _cancelled_meanwhile(run: Run, share: Share, cancel_event: threading.Event | None) -> bool:
    """Whether a cancel came while the kernel died: then the run is not retried (its record says why it ended)."""
    if cancel_event is not None and cancel_event.is_set():
        return True
    try:
        return cancel_requested(share, run.experiment, run.run_id)
    except ShareError:
        return False  # the retry's own watchdog keeps looking


def _attempt(run: Run, share: Share, record: RunRecord, gpu_ids: list[int], shared_gpu: bool,
             cancel_event: threading.Event | None, on_update: UpdateCallback | None, backend: str,
             project_root: Path | None, save_every: float, kernels: Any = None,
             gpu_env: dict[str, str] | None = None, recorded_gpu_ids: list[int] | None = None,
             folders: Any = None, rank: Any = None) -> RunRecord:
    """One attempt of ``run`` (with ``rank``, a :class:`~nbbatch.execute.ranks.Rank`: of that rank of a distributed run).

    A rank's files go to ``ranks/<rank>/`` (rank 0's are the run's own); only rank 0 saves the run's outputs.
    """
    from papermill.exceptions import PapermillExecutionError
    from papermill.execute import prepare_notebook_metadata, raise_for_execution_errors, remove_error_markers
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    from nbbatch.execute import engine as _engine  # noqa: F401 - registers the papermill engine
    from nbbatch.metrics import metrics_from_notebook

    notify = on_update or (lambda _r: None)
    paths = run_paths(run.experiment, run.run_id, rank.files if rank is not None else None)
    primary = rank is None or rank.rank == 0  # the attempt that keeps the run's outputs and checkpoints
    record.status, record.error, record.metrics = Status.RUNNING, None, {}
    record.attempts += 1
    record.started_at, record.ended_at, record.duration_s = utc_now(), None, None
    record.host, record.pid, record.backend = socket.gethostname(), os.getpid(), backend
    record.gpu_ids = list(gpu_ids if recorded_gpu_ids is None else recorded_gpu_ids)
    record.cells_done = 0
    record.environment = _environment_versions(run)
    resumed = folders.checkpoint_summary() if folders is not None else None
    entry: dict[str, Any] = {"attempt": record.attempts, "host": record.host, "started_at": record.started_at,
                             "resumed_from": resumed}
    record.attempt_log.append(entry)
    write_record(share, record)
    notify(record)

    local = share.local_path(paths.folder)
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
    if local is None and hasattr(share, "remove_partial_writes"):  # the same on a remote share (Azure Files)
        with contextlib.suppress(ShareError):
            share.remove_partial_writes(paths.folder)
    log_path = work / LOG_FILE
    remote, fresh = local is None, record.attempts == 1  # a retry continues the log and the metric history
    log_stream = StreamedFile(share, paths.log, log_path, remote=remote, fresh=fresh)
    metrics_stream = StreamedFile(share, paths.metrics, work / METRICS_FILE, remote=remote, fresh=fresh)
    telemetry_stream = StreamedFile(share, paths.telemetry, work / TELEMETRY_FILE, remote=remote, fresh=True)
    log = _LogSink(log_path)
    log.write(f"=== nbbatch run {run.run_id} attempt {record.attempts} on {record.host} "
              f"(kernel {run.kernel}{rank.describe() if rank is not None else ''}, "
              f"GPUs {','.join(map(str, record.gpu_ids)) or 'none'}{_sharing(record.gpu_share)}"
              f"{_image(record.container)}) "
              f"at {record.started_at}{_resuming(resumed)}\n")
    live = LiveRecord(share, record, notify, [log_stream, metrics_stream, telemetry_stream]).start()

    def save_notebook(nb: Any) -> None:
        from nbbatch.store.notebook_io import notebook_bytes

        share.write_bytes(paths.notebook, notebook_bytes(nb))
        log_stream.push()  # a remote share gets the log alongside the checkpoint

    def on_cell(done: int, total: int) -> None:
        with live.lock:
            record.cells_done, record.cells_total = done, total
        live.changed()

    on_point = _point_recorder(record, live, metrics_stream, log)

    nb: Any = None
    started = time.monotonic()
    deadline = started + run.timeout_s if run.timeout_s else None
    watchdog = Watchdog(run, share, deadline, cancel_event)
    status, error = Status.SUCCEEDED, None
    sampler: Any = None
    try:
        notebook_path = run.resolve_notebook(project_root)
        nb = load_notebook_node(str(notebook_path))
        parameters = {**run.parameters, **(folders.parameters if folders is not None else {})}
        nb = parameterize_notebook(nb, parameters, kernel_name=run.kernel, language="python") if parameters else nb
        nb = prepare_notebook_metadata(nb, str(notebook_path), OUTPUT_NOTEBOOK)
        nb = remove_error_markers(nb)
        _set_kernelspec(nb, run.kernel)

        kernel_group: list[int | None] = [None]

        def on_kernel(km: Any) -> None:
            watchdog.km = km
            kernel_group[0] = REAPER.watch(km)
            if sampler is not None:  # the GPU memory of the kernel's process group is the run's
                sampler.process_group = getattr(getattr(km.provisioner, "process", None), "pid", None)
            if watchdog.reason:
                kill_kernel_group(km)

        kernel_name, kernel_env, kernel_cwd = kernel_launch(run, gpu_ids, shared_gpu, project_root, gpu_env, share)
        if rank is not None:  # after the secret filter, which would drop names such as NCCL_IB_PKEY
            kernel_env.update(rank.env)
            if rank.rank != 0:  # MLflow gets the run's metrics once, from rank 0
                for name in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID"):
                    kernel_env.pop(name, None)
        prestarted = kernels.take(run.run_id, kernel_name, kernel_env, kernel_cwd) if kernels is not None else None
        alone = bool(record.gpu_share.get("exclusive"))
        if folders is not None and primary:
            folders.start()
        sampled = gpu_ids if rank is None or rank.local_rank == 0 else []  # one sampler per node watches its GPUs
        with watchdog, _gpu_telemetry(sampled, telemetry_stream, alone) as sampler, \
                open(log_path, "ab") as kernel_output:
            if sampler is not None and sampler.unavailable is None:
                live.summary = sampler.summary
            try:
                nb = _engine.NbbatchEngine.execute_notebook(
                    nb, kernel_name, saver=save_notebook, save_every=save_every, on_cell=on_cell,
                    stdout_file=log, stderr_file=log, start_timeout=120, execution_timeout=run.cell_timeout_s,
                    kernel_env=kernel_env, kernel_cwd=kernel_cwd, on_kernel=on_kernel, input_path=str(notebook_path),
                    kernel_stderr=kernel_output, prestarted=prestarted, final_save=False,  # saved below, once
                    max_output_bytes=int(run.max_output_mb * 2**20), on_point=on_point,
                )
            finally:
                REAPER.forget(kernel_group[0])
        errored = [c for c in nb.cells if c.get("metadata", {}).get("papermill", {}).get("exception")]
        if errored:
            raise_for_execution_errors(nb, str(work / ".failed-output.ipynb"))
    except PapermillExecutionError as exc:
        status, error = Status.FAILED, _error_from(exc)
        error.kind = ErrorKind.CELL_ERROR
    except Exception as exc:  # noqa: BLE001 - every failure becomes the run's recorded error
        status, error = _classify(exc, watchdog, run)
        if error.kind == ErrorKind.INTERNAL:
            import traceback

            log.write(traceback.format_exc())
    finally:
        if folders is not None and primary:
            folders.stop()
        live.stop()  # the final record and files are written below, after every live write
        if sampler is not None:  # stopped: its summary has the last sample
            record.telemetry = sampler.summary()
        (work / ".failed-output.ipynb").unlink(missing_ok=True)
    if watchdog.reason and status != Status.SUCCEEDED:
        status = watchdog.reason
        timed_out = status == Status.TIMED_OUT
        error = error or RunError(ename=status.value, evalue="")
        error.kind = ErrorKind.TIMEOUT if timed_out else ErrorKind.CANCELLED
        error.reason = ("stopped by the run timeout" + f" ({run.timeout_s:g} s)") if timed_out else \
            "stopped by a cancel request"
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
            status, error = Status.FAILED, share_error(exc)
    if log.error is not None and status == Status.SUCCEEDED:
        status, error = Status.FAILED, share_error(f"cannot write {LOG_FILE} in the share: {log.error}")
    if folders is not None and primary:
        try:
            record.outputs = folders.save()
        except (NbbatchError, OSError) as exc:  # the notebook is on the share; its outputs are not all there
            log.write(f"=== nbbatch: cannot save the outputs and checkpoints to the share: {exc}\n")
            if status == Status.SUCCEEDED:
                status, error = Status.FAILED, share_error(f"cannot save the run's outputs to the share: {exc}")
    record.status, record.error = status, error
    entry.update(ended_at=record.ended_at, status=str(status), kind=str(error.kind) if error and error.kind else None)
    summary = error.summary() if error else "ok"
    log.write(f"=== {status} after {record.duration_s:.2f} s: {summary}\n")
    log.close()
    try:
        live.push_streams(final=True)
    except ShareError as exc:
        if record.status == Status.SUCCEEDED:
            record.status, record.error = Status.FAILED, share_error(exc)
    finally:
        if scratch is not None:
            scratch.cleanup()
    if rank is None or rank.rank != 0:  # a gang's run record turns final once every rank ended (ranks.py)
        write_record(share, record)
        notify(record)
    return record


def _resuming(checkpoint: dict[str, Any] | None) -> str:
    if not checkpoint:
        return ""
    return f", resuming from {checkpoint['latest']} ({checkpoint['files']} checkpoint file(s))"


def _image(container: dict[str, Any]) -> str:
    return f", in {container.get('engine')} image {container.get('image')}" if container else ""


def _sharing(gpu_share: dict[str, Any]) -> str:
    """How the run's GPUs are shared, for the log's first line of an attempt."""
    if not gpu_share:
        return ""
    parts = [f"runs per GPU {gpu_share.get('runs_per_gpu')}"]
    if gpu_share.get("need_mb"):
        parts.append(f"{gpu_share['need_mb']:.0f} MiB reserved ({gpu_share.get('need_from')})")
    if gpu_share.get("exclusive"):
        parts.append("alone on it" + (" after running out of GPU memory" if gpu_share.get("alone") else ""))
    if gpu_share.get("mps"):
        parts.append("under CUDA MPS")
    return ": " + ", ".join(parts)


def _point_recorder(record: RunRecord, live: LiveRecord, stream: StreamedFile, log: _LogSink
                    ) -> Callable[[dict[str, Any]], None]:
    """What the engine calls with each ``record(step=...)`` point: append it to metrics.jsonl, update the metrics."""
    from nbbatch.metrics import metrics_of_point

    def on_point(point: dict[str, Any]) -> None:
        step = point.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            return  # not one of nbbatch.record's points
        line = {"step": step, "time": point.get("time"), "attempt": record.attempts, **metrics_of_point(point)}
        try:
            stream.append(jsonl_line(line))
        except (OSError, ValueError) as exc:  # the run goes on; its notebook still holds the latest point
            log.write(f"=== nbbatch: cannot write {METRICS_FILE}: {exc}\n")
        with live.lock:
            record.metrics.update(metrics_of_point(point))
        live.changed()

    return on_point


def share_error(exc: BaseException | str) -> RunError:
    """The error of a run whose files the share would not take."""
    return RunError("ShareError", str(exc), reason=SHARE_FAILED, kind=ErrorKind.SHARE)


def _classify(exc: Exception, watchdog: Watchdog, run: Run) -> tuple[Status, RunError]:
    from jupyter_client.kernelspec import NoSuchKernel
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    error = _error_from(exc)
    if watchdog.reason:
        return watchdog.reason, error
    if isinstance(exc, CellTimeoutError):
        error.reason = f"a cell ran longer than the cell timeout ({run.cell_timeout_s:g} s)"
        error.kind = ErrorKind.TIMEOUT
        return Status.TIMED_OUT, error
    if isinstance(exc, DeadKernelError):
        error.reason, error.kind = "kernel died", ErrorKind.KERNEL_DIED
        return Status.FAILED, error
    if isinstance(exc, ShareError):
        return Status.FAILED, share_error(exc)
    if isinstance(exc, NoSuchKernel):
        error.reason = f"kernel `{run.kernel}` is not installed where the run executed"
        error.kind = ErrorKind.NO_KERNEL
        return Status.FAILED, error
    error.reason = error.reason or "nbbatch could not execute the notebook"
    error.kind = ErrorKind.INTERNAL
    return Status.FAILED, error


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
    """papermill's own error marker (its style and tag: papermill removes it again on a rerun), with our reason."""
    import html

    import nbformat
    from papermill.execute import ERROR_MARKER_TAG, ERROR_STYLE

    marker = nbformat.v4.new_markdown_cell(source=f"<span {ERROR_STYLE}>nbbatch stopped this run: {html.escape(reason)}</span>")
    marker.metadata["tags"] = [ERROR_MARKER_TAG]
    nb.cells.insert(0, marker)
