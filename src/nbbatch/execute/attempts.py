"""Execute one run: the same code on every backend (``nbbatch run-one`` calls it).

:func:`execute_run` runs a run's attempts until one is not run again (:func:`retry_after`: the kernel died,
retries are left, no cancel came): each a kernel of this machine (:func:`run_attempt`), or for a
distributed run this node's ranks as a gang (:func:`nbbatch.execute.ranks.execute_gang`). What the
attempts need from the backend is one :class:`AttemptContext`.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace

from nbbatch.errors import NbbatchError, ShareError
from nbbatch.execute.attempt import (
    SHARE_FAILED,
    cancel_came,
    failed_before_start,
    kernel_launch,
    note_lost_attempt,
    retry_after,
    run_attempt,
    share_error,
)
from nbbatch.execute.context import AttemptContext, UpdateCallback
from nbbatch.execute.folders import RunFolders
from nbbatch.execute.placement import placement_from_env
from nbbatch.execute.ranks import execute_gang
from nbbatch.plan.runs import Run
from nbbatch.store.layout import run_paths
from nbbatch.store.runfiles import new_record, read_record, write_record
from nbbatch.store.runjson import ErrorKind, RunRecord, Status
from nbbatch.store.share import Share

__all__ = ["SHARE_FAILED", "AttemptContext", "UpdateCallback", "execute_run", "kernel_launch", "retry_after",
           "run_attempt", "share_error"]


def execute_run(run: Run, share: Share, context: AttemptContext | None = None) -> RunRecord:
    """Execute ``run`` (retrying after kernel deaths up to ``run.retries``) and return its final record.

    A distributed run starts this node's ranks: ``context.placement`` says where the node is in the gang,
    else nbbatch's own variables in the environment do (one node alone: on this machine).
    """
    context = context or AttemptContext()
    if run.distribution:
        return execute_gang(run, share, context.placement or placement_from_env(run, os.environ), context)
    record = read_record(share, run.experiment, run.run_id) or new_record(run, context.backend)
    record.gpu_share, record.container = context.gpu_share, context.container
    note_lost_attempt(record)
    try:
        folders = RunFolders(run, share, input_paths=context.input_paths, project_root=context.project_root)
    except NbbatchError as exc:  # an input missing here, or a share that would not give the checkpoints
        return failed_before_start(share, record, exc, context.on_update)
    record.inputs = dict(folders.inputs)
    record.continues = record.continues or folders.continues  # a new process of the run keeps what the first said
    try:
        record = _attempts(run, share, record, context, folders)
    finally:
        folders.close()
    if record.status == Status.SUCCEEDED and not run.keep_checkpoints:  # for resuming a run, not its results
        with contextlib.suppress(ShareError, OSError):
            share.remove(run_paths(run.experiment, run.run_id).checkpoints)
    return record


def _attempts(run: Run, share: Share, record: RunRecord, context: AttemptContext, folders: RunFolders) -> RunRecord:
    attempts_left = run.retries + 1

    def cancelled() -> bool:
        return cancel_came(run, share, context.cancel_event)

    while True:
        record = run_attempt(run, share, record, context, folders)
        context = replace(context, kernels=None)  # a retry starts a kernel of its own
        attempts_left -= 1
        if not retry_after(record, attempts_left, cancelled):
            if record.error is not None and record.error.kind == ErrorKind.KERNEL_DIED:
                write_record(share, record)  # it may have been shown as running until the retry (_while_retried)
            return record
