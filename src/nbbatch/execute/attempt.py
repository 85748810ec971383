"""One attempt of a run (or of one rank of a distributed run): :func:`run_attempt`.

Inject parameters, execute with papermill (engine ``nbbatch``) in the run's kernel, stream the
kernel's output to ``log.txt``, write ``output.ipynb`` and ``run.json`` atomically to the share,
enforce run and cell timeouts and honour cancellation. Whether a failed attempt is tried again is
:func:`retry_after`'s to say, for single runs and gangs alike.
"""

from __future__ import annotations

import contextlib
import copy
import html
import json
import os
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import nbformat
from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
from nbclient.exceptions import CellTimeoutError, DeadKernelError
from papermill.exceptions import PapermillExecutionError
from papermill.execute import ERROR_MARKER_TAG, ERROR_STYLE, prepare_notebook_metadata, remove_error_markers
from papermill.iorw import load_notebook_node
from papermill.parameterize import parameterize_notebook

from nbbatch.errors import NbbatchError, ShareError
from nbbatch.execute.context import AttemptContext, UpdateCallback
from nbbatch.execute.engine import NbbatchEngine, raise_for_cell_errors
from nbbatch.execute.envs import env_packages
from nbbatch.execute.folders import RunFolders, folder_env
from nbbatch.execute.kernels import kill_kernel_group
from nbbatch.execute.launch import LOG_ECHO_ENV
from nbbatch.execute.live import LiveRecord, LogSink, StreamedFile
from nbbatch.execute.placement import Rank
from nbbatch.execute.telemetry import GpuSampler
from nbbatch.execute.watchdog import REAPER, Watchdog
from nbbatch.metrics import metrics_from_notebook, metrics_of_point, tracking_wanted, without_tracking
from nbbatch.plan.runs import Run
from nbbatch.redact import is_secret, tracking_credentials
from nbbatch.spec.frameworks import get_framework
from nbbatch.store.jsonl import jsonl_line
from nbbatch.store.layout import LOG_FILE, METRICS_FILE, OUTPUT_NOTEBOOK, TELEMETRY_FILE, RunPaths, run_paths
from nbbatch.store.notebook_io import notebook_bytes, stopped_cell, user_cells
from nbbatch.store.runfiles import CANCEL_REQUEST, StopRequest, cancel_requested, write_record
from nbbatch.store.runjson import (
    AttemptEntry,
    CheckpointSummary,
    ContainerInfo,
    ErrorKind,
    GpuSharing,
    RunError,
    RunRecord,
    Status,
    plain_traceback,
    utc_now,
)
from nbbatch.store.share import Share

SHARE_FAILED = "the share could not be written"
_MAX_PARAMETERS_ENV = 64 * 1024  # an environment variable much larger than this can stop exec
_FAILED_OUTPUT = ".failed-output.ipynb"  # papermill's own error write, removed after the attempt


# --- the kernel's environment -------------------------------------------------------------------------------


def _kernel_env(run: Run, gpu_ids: list[int] | None, shared_gpu: bool,
                gpu_env: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # A run's kernel gets no credentials of the driver: they would be readable from the notebook.
    for name in list(env):
        if is_secret(name, env[name]):
            del env[name]
    if tracking_wanted(run.tracking, os.environ):  # nbbatch.record logs there, with these credentials
        env.update(tracking_credentials(os.environ))
    else:  # no tracking asked for: no MLflow URI, run or credentials (Azure ML sets them in every job)
        env = without_tracking(env)
    if shared_gpu:  # under the experiment's own `env:`, which may set them otherwise
        env.update(run.shared_gpu_env)
    env.update(run.env)
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpu_ids or [])
    if gpu_ids:  # CUDA's default order puts the fastest GPU first; nbbatch's indices are NVML's, by PCI bus
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env.update(gpu_env or {})  # a CUDA MPS daemon's pipe, and the devices as it numbers them
    env.update({"NBBATCH_RUN_ID": run.run_id, "NBBATCH_EXPERIMENT": run.experiment,
                "PYDEVD_DISABLE_FILE_VALIDATION": "1"})
    parameters = json.dumps(run.parameters, default=str)
    if len(parameters) <= _MAX_PARAMETERS_ENV:  # what nbbatch.record gives MLflow as the run's params
        env["NBBATCH_PARAMETERS"] = parameters
    return env


def kernel_launch(run: Run, gpu_ids: list[int] | None = None, shared_gpu: bool = False,
                  project_root: Path | None = None, gpu_env: dict[str, str] | None = None,
                  share: Share | None = None) -> tuple[str, dict[str, str], str]:
    """The kernel name, environment and working directory a run's kernel is started with.

    With ``share``, the environment names the run's output and checkpoint folders.
    """
    cwd = run.cwd or str(run.resolve_notebook(project_root).parent)
    env = _kernel_env(run, gpu_ids, shared_gpu, gpu_env)
    if share is not None:
        env.update(folder_env(run, share))
    return run.kernel, env, cwd


def _rank_kernel_env(env: dict[str, str], rank: Rank | None) -> dict[str, str]:
    """A rank's kernel environment: added after the secret filter, which would drop names such as NCCL_IB_PKEY."""
    if rank is not None:
        env.update(rank.env)
        if rank.rank != 0:  # MLflow gets the run's metrics once, from rank 0
            for name in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID"):
                env.pop(name, None)
    return env


# --- the record before and after attempts -------------------------------------------------------------------


def note_lost_attempt(record: RunRecord) -> None:
    """An attempt that never ended (its node or job was lost, then restarted this one) goes in the attempt log."""
    if record.status != Status.RUNNING or not record.attempts:
        return
    entry = next((e for e in record.attempt_log if e.attempt == record.attempts), None)
    if entry is None:
        entry = AttemptEntry(record.attempts, record.host, record.started_at)
        record.attempt_log.append(entry)
    entry.status, entry.kind = "lost", ErrorKind.INFRA


def failed_before_start(share: Share, record: RunRecord, exc: NbbatchError,
                        on_update: UpdateCallback | None) -> RunRecord:
    """Fail ``record`` with ``exc``, which kept the run from starting here (an input missing, the share)."""
    record.status, record.ended_at = Status.FAILED, utc_now()
    record.error = RunError(type(exc).__name__, str(exc), reason="the run could not start here", kind=ErrorKind.INFRA)
    write_record(share, record)
    if on_update is not None:
        on_update(record)
    return record


def cancel_came(run: Run, share: Share, cancel_event: threading.Event | None) -> bool:
    """Whether the run was asked to stop (by the caller's event or a marker in the share; unreadable: not)."""
    if cancel_event is not None and cancel_event.is_set():
        return True
    with contextlib.suppress(ShareError, OSError):  # the next attempt's own watchdog keeps looking
        return cancel_requested(share, run.experiment, run.run_id)
    return False


def retry_after(failure: RunRecord | None, attempts_left: int, cancelled: Callable[[], bool]) -> bool:
    """The one retry policy: run again when the kernel died, attempts are left, and no cancel came meanwhile."""
    died = failure is not None and failure.status == Status.FAILED and failure.error is not None and \
        failure.error.kind == ErrorKind.KERNEL_DIED
    return died and attempts_left > 0 and not cancelled()


def share_error(exc: BaseException | str) -> RunError:
    """The error of a run whose files the share would not take."""
    return RunError("ShareError", str(exc), reason=SHARE_FAILED, kind=ErrorKind.SHARE)


# --- one attempt ----------------------------------------------------------------------------------------------


def run_attempt(run: Run, share: Share, record: RunRecord, context: AttemptContext,
                folders: RunFolders | None = None, rank: Rank | None = None) -> RunRecord:
    """One attempt of ``run`` (with ``rank``: of that rank of a distributed run); returns ``record``, updated.

    A rank's files go to ``ranks/<rank>/`` (rank 0's are the run's own); only rank 0 saves the run's outputs.
    Rank 0's final record is left to the gang (:mod:`nbbatch.execute.ranks`), which adds every rank's outcome.
    """
    return _Attempt(run, share, record, context, folders, rank).execute()


class _Attempt:
    """The state of one attempt while it runs: its files, its kernel's watchdog, its GPU sampler."""

    def __init__(self, run: Run, share: Share, record: RunRecord, context: AttemptContext,
                 folders: RunFolders | None, rank: Rank | None):
        self.run, self.share, self.record, self.context = run, share, record, context
        self.folders, self.rank = folders, rank
        self.notify = context.notify
        self.paths: RunPaths = run_paths(run.experiment, run.run_id, rank.files if rank is not None else None)
        self.primary = rank is None or rank.rank == 0  # the attempt that keeps the run's outputs and checkpoints
        self.scratch: tempfile.TemporaryDirectory[str] | None = None
        self.sampler: GpuSampler | None = None
        self.nb: Any = None
        self.kernel_group: int | None = None

    def execute(self) -> RunRecord:
        resumed = self._begin()
        self._open_files(resumed)
        started = time.monotonic()
        deadline = started + self.run.timeout_s if self.run.timeout_s else None
        self.watchdog = Watchdog(self.run, self.share, deadline, self.context.cancel_event)
        status, error = self._execute_notebook()
        status, error = self._stopped(status, error)
        record = self.record
        record.status, record.error = status, error
        record.ended_at, record.duration_s = utc_now(), round(time.monotonic() - started, 3)
        return self._finish(*self._save(status, error))

    def _begin(self) -> CheckpointSummary | None:
        """The record of a new attempt, written; returns the checkpoint it resumes from."""
        record, context = self.record, self.context
        record.status, record.error, record.metrics = Status.RUNNING, None, {}
        record.note = None  # what the backend said while the run waited (a pending reason) is over
        record.attempts += 1
        record.started_at, record.ended_at, record.duration_s = utc_now(), None, None
        record.host, record.pid, record.backend = socket.gethostname(), os.getpid(), context.backend
        record.gpu_ids = list(context.gpu_ids if context.recorded_gpu_ids is None else context.recorded_gpu_ids)
        record.cells_done = 0
        record.environment = _environment_versions(self.run)
        resumed = self.folders.checkpoint_summary() if self.folders is not None else None
        self.entry = AttemptEntry(record.attempts, record.host, record.started_at, resumed)
        record.attempt_log.append(self.entry)
        write_record(self.share, record)
        self.notify(record)
        return resumed

    def _work_folder(self) -> Path:
        """Where the attempt's log and metrics are written: the run's folder on a local share, else a scratch one."""
        local = self.share.local_path(self.paths.folder)
        if local is not None:
            try:
                local.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ShareError(f"cannot create the run folder {local}: {exc.strerror or exc}") from exc
        with contextlib.suppress(ShareError):  # left by a driver killed mid-write; this run's writer is us
            self.share.remove_partial_writes(self.paths.folder)
        if local is None:
            self.scratch = tempfile.TemporaryDirectory(prefix="nbbatch-run-")
            return Path(self.scratch.name)
        return local

    def _open_files(self, resumed: CheckpointSummary | None) -> None:
        """The log, metric and telemetry streams, the log's first line, and the live record."""
        self.work = work = self._work_folder()
        share, paths, record, run = self.share, self.paths, self.record, self.run
        self.log_path = work / LOG_FILE
        remote, fresh = self.scratch is not None, record.attempts == 1  # a retry continues the log and metrics
        self.log_stream = StreamedFile(share, paths.log, self.log_path, remote=remote, fresh=fresh)
        self.metrics_stream = StreamedFile(share, paths.metrics, work / METRICS_FILE, remote=remote, fresh=fresh)
        self.telemetry_stream = StreamedFile(share, paths.telemetry, work / TELEMETRY_FILE, remote=remote, fresh=True)
        self.log = LogSink(self.log_path, echo=sys.stdout if os.environ.get(LOG_ECHO_ENV) else None)
        self.log.write(f"=== nbbatch run {run.run_id} attempt {record.attempts} on {record.host} "
                       f"(kernel {run.kernel}{self.rank.describe() if self.rank is not None else ''}, "
                       f"GPUs {','.join(map(str, record.gpu_ids)) or 'none'}{_sharing(record.gpu_share)}"
                       f"{_image(record.container)}) "
                       f"at {record.started_at}{self.folders.resuming(resumed) if self.folders is not None else ''}\n")
        streams = [self.log_stream, self.metrics_stream, self.telemetry_stream]
        self.live = LiveRecord(share, record, self.notify, streams).start()
        self.on_point = _point_recorder(record, self.live, self.metrics_stream, self.log)

    def save_notebook(self, nb: Any) -> None:
        """A checkpoint of the output notebook; a remote share gets the log alongside it."""
        self.share.write_bytes(self.paths.notebook, notebook_bytes(nb))
        self.log_stream.push()

    def on_cell(self, done: int, total: int) -> None:
        with self.live.lock:
            self.record.cells_done, self.record.cells_total = done, total
        self.live.changed()

    def on_kernel(self, km: Any) -> None:
        """The kernel started: its watchdog and the GPU sampler watch it; killed at once if stopped meanwhile."""
        self.watchdog.km = km
        self.kernel_group = REAPER.watch(km)
        if self.sampler is not None:  # the GPU memory of the kernel's process group is the run's
            self.sampler.process_group = getattr(getattr(km.provisioner, "process", None), "pid", None)
        if self.watchdog.reason:
            kill_kernel_group(km)

    def _prepared_notebook(self, notebook_path: Path) -> Any:
        """The notebook with the run's parameters (and its folders') injected, papermill's way."""
        nb = load_notebook_node(str(notebook_path))
        parameters = {**self.run.parameters, **(self.folders.parameters if self.folders is not None else {})}
        nb = parameterize_notebook(nb, parameters, kernel_name=self.run.kernel, language="python") if parameters else nb
        nb = prepare_notebook_metadata(nb, str(notebook_path), OUTPUT_NOTEBOOK)
        nb = remove_error_markers(nb)
        _set_kernelspec(nb, self.run.kernel)
        return nb

    def _execute_notebook(self) -> tuple[Status, RunError | None]:
        """Execute the notebook in the run's kernel; the status and error it ended with."""
        status, error = Status.SUCCEEDED, None
        try:
            notebook_path = self.run.resolve_notebook(self.context.project_root)
            self.nb = self._prepared_notebook(notebook_path)
            self._run_kernel(notebook_path)
            if any(c.get("metadata", {}).get("papermill", {}).get("exception") for c in self.nb.cells):
                raise_for_cell_errors(self.nb, str(self.work / _FAILED_OUTPUT))
        except PapermillExecutionError as exc:
            status, error = Status.FAILED, _error_from(exc)
            error.kind = ErrorKind.CELL_ERROR
        except Exception as exc:  # noqa: BLE001 - every failure becomes the run's recorded error
            status, error = _classify(exc, self.watchdog, self.run)
            if error.kind == ErrorKind.INTERNAL:
                self.log.write(traceback.format_exc())
            if error.kind == ErrorKind.KERNEL_DIED:  # in the cell it was running
                error.cell_index, error.cell_source = stopped_cell(self.nb)
        finally:
            if self.folders is not None and self.primary:
                self.folders.stop()
            self.live.stop()  # the final record and files are written below, after every live write
            if self.sampler is not None:  # stopped: its summary has the last sample
                self.record.telemetry = self.sampler.summary()
            (self.work / _FAILED_OUTPUT).unlink(missing_ok=True)
        return status, error

    def _run_kernel(self, notebook_path: Path) -> None:
        """Start (or take the prestarted) kernel and execute the notebook in it, watched and sampled."""
        context, run = self.context, self.run
        kernel_name, kernel_env, kernel_cwd = kernel_launch(run, context.gpu_ids, context.shared_gpu,
                                                            context.project_root, context.gpu_env, self.share)
        kernel_env = _rank_kernel_env(kernel_env, self.rank)
        kernels = context.kernels
        prestarted = kernels.take(run.run_id, kernel_name, kernel_env, kernel_cwd, run.preload) \
            if kernels is not None else None

        def on_kernel(km: Any) -> None:  # whether the run got the kernel started ahead, warm
            if prestarted is not None:
                self.log.write(f"=== nbbatch: {prestarted.describe(km)}\n")
            self.on_kernel(km)

        alone = self.record.gpu_share is not None and self.record.gpu_share.exclusive
        if self.folders is not None and self.primary:
            self.folders.start()
        # one sampler per node watches its GPUs
        sampled = context.gpu_ids if self.rank is None or self.rank.local_rank == 0 else []
        with self.watchdog, _gpu_telemetry(sampled, self.telemetry_stream, alone) as self.sampler, \
                open(self.log_path, "ab") as kernel_output:
            if self.sampler is not None and self.sampler.unavailable is None:
                self.live.summary = self.sampler.summary
                if context.on_sampler is not None:
                    context.on_sampler(self.sampler)
            try:
                self.nb = NbbatchEngine.execute_notebook(
                    self.nb, kernel_name, saver=self.save_notebook, save_every=context.save_every,
                    on_cell=self.on_cell, stdout_file=self.log, stderr_file=self.log, start_timeout=120,
                    execution_timeout=run.cell_timeout_s, kernel_env=kernel_env, kernel_cwd=kernel_cwd,
                    on_kernel=on_kernel, input_path=str(notebook_path), kernel_stderr=kernel_output,
                    prestarted=prestarted, final_save=False,  # saved by _save, once
                    max_output_bytes=int(run.max_output_mb * 2**20), on_point=self.on_point,
                )
            finally:
                REAPER.forget(self.kernel_group)
                if context.on_sampler is not None:
                    context.on_sampler(None)

    def _stopped(self, status: Status, error: RunError | None) -> tuple[Status, RunError | None]:
        """A run stopped by its timeout, a cancel or its search's pruner ends as such, whatever the kernel said last."""
        reason = self.watchdog.reason
        if not reason or status == Status.SUCCEEDED:
            return status, error
        error = error or RunError(ename=reason.value, evalue="")
        if reason == Status.TIMED_OUT:
            error.kind, error.reason = ErrorKind.TIMEOUT, f"stopped by the run timeout ({self.run.timeout_s:g} s)"
        else:  # the kernel was killed on purpose: its death (DeadKernelError) is not what ended the run
            request = self.watchdog.why()  # a stop event's request decides (Slurm's time limit: timed_out)
            if not self.watchdog.by_event and request.status != reason:
                request = StopRequest(reason, CANCEL_REQUEST.reason)
            reason, stop = request.outcome()
            if reason != Status.PRUNED:  # with the cell it stopped in
                at = (error.cell_index, error.cell_source) if error.cell_index is not None else stopped_cell(self.nb)
                stop.cell_index, stop.cell_source, stop.rank = *at, error.rank
            error = stop
        if self.nb is not None:
            _add_stop_marker(self.nb, error.reason)
        return reason, error

    def _save(self, status: Status, error: RunError | None) -> tuple[Status, RunError | None]:
        """The executed notebook, its metrics and (rank 0's) the run's outputs, to the share."""
        record, nb = self.record, self.nb
        if nb is not None:
            record.metrics = metrics_from_notebook(nb)
            record.cells_total = user_cells(nb.cells)  # as the user's notebook counts them
            record.cells_done = max((user_cells(nb.cells, i + 1) for i, c in enumerate(nb.cells)
                                     if c.get("metadata", {}).get("papermill", {}).get("end_time")), default=0)
            try:
                self.save_notebook(nb)
            except ShareError as exc:  # the previous (partial) notebook stays, and the run is not succeeded
                status, error = Status.FAILED, share_error(exc)
        if self.log.error is not None and status == Status.SUCCEEDED:
            status, error = Status.FAILED, share_error(f"cannot write {LOG_FILE} in the share: {self.log.error}")
        if self.folders is not None and self.primary:
            try:
                record.outputs = self.folders.save()
            except (NbbatchError, OSError) as exc:  # the notebook is on the share; its outputs are not all there
                self.log.write(f"=== nbbatch: cannot save the outputs and checkpoints to the share: {exc}\n")
                if status == Status.SUCCEEDED:
                    status, error = Status.FAILED, share_error(f"cannot save the run's outputs to the share: {exc}")
        return status, error

    def _finish(self, status: Status, error: RunError | None) -> RunRecord:
        """The attempt's last log line and final files; the record (but rank 0's: the gang writes it)."""
        record = self.record
        record.status, record.error = status, error
        self.entry.ended_at, self.entry.status = record.ended_at, str(status)
        self.entry.kind = error.kind if error else None
        if error is not None and error.traceback:  # at the log's end, as papermill shows it
            self.log.write(f"\n{error.traceback}\n")
        self.log.write(f"=== {status} after {record.duration_s:.2f} s: {record.error_summary() or 'ok'}\n")
        self.log.close()
        try:
            self.live.push_streams(final=True)
        except ShareError as exc:
            if record.status == Status.SUCCEEDED:
                record.status, record.error = Status.FAILED, share_error(exc)
        finally:
            if self.scratch is not None:
                self.scratch.cleanup()
        if self.rank is None or self.rank.rank != 0:  # a gang's run record turns final once every rank ended
            shown = _while_retried(record, self.run) if self.rank is None else record
            write_record(self.share, shown)
            self.notify(shown)
        return record


# --- helpers of an attempt ------------------------------------------------------------------------------------


def _while_retried(record: RunRecord, run: Run) -> RunRecord:
    """The record to show for an attempt whose kernel died while attempts are left: still running (the next attempt
    starts at once), so nobody reading the share (`nbbatch status`, a detached backend's wait) takes the run for
    failed. Should no attempt follow after all (a cancel came), :func:`~nbbatch.execute.attempts.execute_run` writes
    the final record."""
    if record.error is None or record.error.kind != ErrorKind.KERNEL_DIED or record.attempts > run.retries:
        return record
    shown = copy.deepcopy(record)
    shown.status, shown.error, shown.ended_at, shown.duration_s = Status.RUNNING, None, None, None
    shown.note = f"attempt {record.attempts} failed ({record.error.summary()}); starting attempt {record.attempts + 1}"
    return shown


def _environment_versions(run: Run) -> dict[str, str]:
    if not run.framework:
        return {}
    try:
        packages = env_packages(get_framework(run.framework))
    except Exception:  # noqa: BLE001 - remote nodes may lack the project's frameworks/ folder
        return {}
    wanted = {line.split("==")[0].split("[")[0].lower() for line in _pins(run)}
    return {k: v for k, v in packages.items() if k in wanted or k in ("ipykernel", "numpy")} or packages


def _pins(run: Run) -> list[str]:
    try:
        return get_framework(run.framework).pinned() if run.framework else []
    except Exception:  # noqa: BLE001
        return []


@contextlib.contextmanager
def _gpu_telemetry(gpu_ids: list[int], stream: StreamedFile, alone: bool) -> Iterator[GpuSampler]:
    with GpuSampler(gpu_ids, sink=stream.append, alone=alone) as sampler:
        yield sampler


def _error_from(exc: BaseException) -> RunError:
    """The error of ``exc``: its cell (numbered as in the user's notebook) and the kernel's traceback."""
    source = getattr(exc, "source", None)
    ename = getattr(exc, "ename", None) or type(exc).__name__
    evalue = getattr(exc, "evalue", None)
    if evalue is None:
        evalue = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
    snippet = "\n".join(str(source).splitlines()[:5]) if source else None
    frames = getattr(exc, "traceback", None)  # a PapermillExecutionError's: the kernel's lines
    return RunError(ename=str(ename), evalue=str(evalue)[:2000], cell_index=getattr(exc, "cell_number", None),
                    cell_source=snippet, traceback=plain_traceback(frames) if isinstance(frames, list) else None)


def _image(container: ContainerInfo | None) -> str:
    return f", in {container.engine} image {container.image}" if container is not None else ""


def _sharing(gpu_share: GpuSharing | None) -> str:
    """How the run's GPUs are shared, for the log's first line of an attempt."""
    if gpu_share is None:
        return ""
    parts = [f"runs per GPU {gpu_share.runs_per_gpu}"]
    if gpu_share.need_mb:
        parts.append(f"{gpu_share.need_mb:.0f} MiB reserved ({gpu_share.need_from})")
    if gpu_share.exclusive:
        parts.append("alone on it" + (" after running out of GPU memory" if gpu_share.alone else ""))
    if gpu_share.mps:
        parts.append("under CUDA MPS")
    return ": " + ", ".join(parts)


def _point_recorder(record: RunRecord, live: LiveRecord, stream: StreamedFile, log: LogSink
                    ) -> Callable[[dict[str, Any]], None]:
    """What the engine calls with each ``record(step=...)`` point: append it to metrics.jsonl, update the metrics."""

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


def _classify(exc: Exception, watchdog: Watchdog, run: Run) -> tuple[Status, RunError]:
    error = _error_from(exc)
    if watchdog.reason:
        return watchdog.reason, error
    if isinstance(exc, CellTimeoutError):
        limit = getattr(exc, "timeout", None) or run.cell_timeout_s
        error.reason = "stopped by the cell timeout" + (f" ({limit:g} s)" if limit else "")
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
        spec = KernelSpecManager().get_kernel_spec(kernel)
        display, language = spec.display_name, spec.language
    except Exception:  # noqa: BLE001
        display, language = kernel, "python"
    nb.metadata["kernelspec"] = {"name": kernel, "display_name": display, "language": language}
    nb.metadata.setdefault("language_info", {"name": language})


def _add_stop_marker(nb: Any, reason: str) -> None:
    """papermill's own error marker (its style and tag: papermill removes it again on a rerun), with our reason."""
    marker = nbformat.v4.new_markdown_cell(source=f"<span {ERROR_STYLE}>nbbatch stopped this run: {html.escape(reason)}</span>")
    marker.metadata["tags"] = [ERROR_MARKER_TAG]
    nb.cells.insert(0, marker)
