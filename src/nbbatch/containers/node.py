"""A run in its framework's image on a cluster's node: ``nbbatch run-one`` of a launch naming ``container_images``.

The slurm backend's ``container: true``: the job's launcher (``nbbatch run-one`` of the node's venv) starts the run's
container with the local backend's runner (:func:`~nbbatch.containers.runner.execute_in_container`), on this node.
Inside, ``nbbatch run-one`` of the image watches the share's cancel markers and the run's timeout itself, as in a
venv. Slurm stops a job (``scancel``, its time limit) with SIGTERM, but the container is no process of the job
(the engine's monitor runs it), so SIGTERM here stops the container (SIGTERM to its ``run-one``, which saves the
notebook as far as it ran and ends the record) before the launcher exits; should the container's ``run-one`` not
get that far, the driver records how the job ended, from Slurm.

A distributed run's job starts one launcher per node (``srun``); each finds its place in the gang on the host (the
share's address exchange, :mod:`nbbatch.backends.slurm.gang`) and runs the node's ranks in one container, told that
place in the container's launch file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import signal
import socket
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from nbbatch.containers.engines import Engine, find_engine
from nbbatch.containers.registry import names_registry, pull_image
from nbbatch.containers.runner import end_unfinished, execute_in_container
from nbbatch.errors import ContainerError
from nbbatch.execute.context import AttemptContext
from nbbatch.execute.stopsignals import STOP_SIGNALS, handling_stop_signals
from nbbatch.plan.runs import Run
from nbbatch.store.runjson import ContainerInfo, ErrorKind, RunError, RunRecord, Status
from nbbatch.store.share import Share


class LauncherStopped(BaseException):
    """The launcher was told to stop (SIGTERM): a BaseException, so no ``except Exception`` on the way hides it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def node_image(engine: Engine, ref: str) -> str:
    """The id of image ``ref`` on this node, pulled first when it is missing and names a registry (``registry:``);
    else :class:`ContainerError` saying it is not here, or why the pull failed."""
    image_id = engine.image_id(ref)
    if image_id is None and names_registry(ref):
        print(f"nbbatch run-one: pulling {ref} on node {socket.gethostname()}", file=sys.stderr)
        return pull_image(engine, ref)
    if image_id is None:
        raise ContainerError(f"the image {ref} is not on node {socket.gethostname()} ({engine.name} has no image of "
                             "that tag): with container: true every node needs each framework's image; build it on "
                             "each node (`nbbatch images build FRAMEWORK` there, with the same project and options), "
                             f"or copy it there (`{engine.name} save` here, `{engine.name} load` there)")
    return image_id


def execute_on_node(run: Run, share: Share, context: AttemptContext, engine_name: str,
                    images: Mapping[str, str]) -> RunRecord:
    """Execute ``run`` in its framework's image (``images``: framework → tag) with the engine ``engine_name``.

    An image or engine this node lacks ends the run as failed, saying so; SIGTERM stops the container and exits
    (status 128 + the signal), leaving the run's end to the driver."""
    try:
        image = images.get(run.framework or "")
        if image is None:
            raise ContainerError(f"run {run.run_id} (framework {run.framework or 'none'}) has no image among those "
                                 f"its launcher was given ({', '.join(sorted(images)) or 'none'}); submit it again")
        if engine_name != "auto" and not shutil.which(engine_name):
            raise ContainerError(f"node {socket.gethostname()} has no {engine_name} (not on PATH): container: true "
                                 f"starts each run's image with {engine_name} on its node; install {engine_name} on "
                                 "every node, or submit without container: true")
        engine = find_engine(engine_name)
        if context.gpu_ids:
            engine.check_gpus()
        info = ContainerInfo(engine=engine.name, image=image, image_id=node_image(engine, image))
    except ContainerError as exc:  # a gang's node ends its own ranks, and the other nodes stop
        return end_unfinished(share, run, context.placement if run.distribution else None, Status.FAILED, RunError(
            "ContainerError", str(exc), reason=f"its container could not start on node {socket.gethostname()}",
            kind=ErrorKind.INFRA), backend=context.backend)
    try:
        with _stopped_by_signals():
            return execute_in_container(engine, run, share, dataclasses.replace(context, container=info))
    except LauncherStopped as stop:
        print(f"nbbatch run-one: {stop} received: the container of run {run.run_id} was stopped; the backend records "
              "how its job ended", file=sys.stderr)
        raise SystemExit(128 + stop.signum) from None


@contextlib.contextmanager
def _stopped_by_signals() -> Iterator[None]:
    """While inside: the first stop signal raises :class:`LauncherStopped` in this (the main) thread, later ones are
    ignored, so stopping the container is not cut short."""
    def handler(signum: int, frame: Any) -> None:
        for number in STOP_SIGNALS:
            signal.signal(number, signal.SIG_IGN)
        raise LauncherStopped(signum)

    with handling_stop_signals(handler):
        yield
