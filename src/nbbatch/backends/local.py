"""The local backend: runs in parallel on this machine, packed onto its GPUs.

Each run executes in a worker thread of this process (papermill is imported once; the kernels are
separate processes, the next ones started ahead of their runs). Runs start longest-first by their
past durations, GPU runs get ``CUDA_VISIBLE_DEVICES`` from a :class:`~nbbatch.execute.gpus.SlotPool`
(by count, or by memory with ``runs_per_gpu: auto``), CPU runs get it empty. A run that runs out of
GPU memory while sharing its GPU is run again, alone. With ``resources.mps`` the runs are clients of
a CUDA MPS daemon started for the batch. Ctrl-C cancels: kernels are killed, runs are marked
``cancelled``, finished output stays, the MPS daemon is stopped.

With ``container: true`` each run executes ``nbbatch run-one`` inside its framework's image
(:mod:`nbbatch.containers`) instead of a kernel of this machine's venv; placement is the same.

A distributed run (:mod:`nbbatch.execute.ranks`) takes its GPUs as one gang, to itself, and counts as
its ranks against ``max_parallel``; its ranks rendezvous on free ports of 127.0.0.1. This machine is one
node; ``NBBATCH_SIMULATE_NODES=1`` (for tests) runs every node of a run here, each a launcher of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from nbbatch.backends.base import Backend, Capabilities, Compute, Setting, SubmitOptions
from nbbatch.errors import ContainerError, ShareError, ValidationError
from nbbatch.execute.attempt import SHARE_FAILED, execute_run, kernel_launch
from nbbatch.execute.gpus import GpuInfo, GpuLease, MemoryNeeds, SlotPool, detect_gpus, is_gpu_oom
from nbbatch.plan.runs import Run
from nbbatch.store.lock import pid_alive
from nbbatch.store.runfiles import CancelRequests, cancel_requests, write_record
from nbbatch.store.runjson import ErrorKind, RunError, RunRecord, Status
from nbbatch.store.share import Share

if TYPE_CHECKING:
    from nbbatch.containers.engines import Engine
    from nbbatch.containers.images import ImageSpec
    from nbbatch.execute.kernels import KernelPool
    from nbbatch.execute.mps import MpsDaemon
    from nbbatch.spec.project import Project


logger = logging.getLogger(__name__)

PRESTART_DEFAULT = 2  # kernels started ahead of the next runs (`backend: {name: local, prestart: N}`; 0: none)
SIMULATE_NODES_ENV = "NBBATCH_SIMULATE_NODES"  # tests: every node of a distributed run on this machine


class LocalBackend(Backend):
    """Execute runs on this machine's CPUs and GPUs."""

    name: ClassVar[str] = "local"
    capabilities: ClassVar[Capabilities] = Capabilities(gpu_slots=True)
    SETTINGS: ClassVar[dict[str, Setting]] = {
        "max_parallel": Setting(None, (int,), minimum=1),
        "prestart": Setting(None, (int,), minimum=0),  # kernels started ahead of their runs
        "container": Setting(False, (bool,)),  # run each run inside its framework's image
        "engine": Setting("auto", (str,), choices=("auto", "docker", "podman")),  # the container engine
        "cpu_image": Setting(False, (bool,)),  # the frameworks' CPU images (the pins as the venvs have them)
        "base_image": Setting(None, (str,)),  # build the images on this base instead of framework.yaml's
    }
    settings_hint: ClassVar[str] = "use resources: for gpus, runs_per_gpu, max_parallel"

    def __init__(self, gpus: list[GpuInfo] | None = None, max_parallel: int | None = None,
                 prestart: int | None = None, container: bool = False, engine: str = "auto",
                 cpu_image: bool = False, base_image: str | None = None, **unknown: object):
        """``gpus`` replaces NVML's list (for tests); the rest are the experiment's ``backend:`` settings."""
        super().__init__(max_parallel=max_parallel, prestart=prestart, container=container, engine=engine,
                         cpu_image=cpu_image, base_image=base_image, **unknown)
        self._gpus = gpus
        self.max_parallel = max_parallel
        self.prestart = prestart  # None: PRESTART_DEFAULT
        self.container = bool(container)
        if self.container:  # the runs' kernels are the images', not this machine's venvs
            self.capabilities = dataclasses.replace(self.capabilities, local_kernels=False, containers=True)
        self._engine: Engine | None = None
        self._images: dict[str, tuple[str, str]] = {}  # framework → (image, image id)

    @property
    def gpus(self) -> list[GpuInfo]:
        if self._gpus is None:
            self._gpus = detect_gpus()
        return self._gpus

    def compute(self) -> Compute:
        cpus = os.cpu_count() or 1
        return Compute(
            backend=self.name,
            gpus=[{"index": g.index, "name": g.name, "memory_mb": g.memory_mb} for g in self.gpus],
            nodes=[{"name": os.uname().nodename, "state": "idle", "cpus": cpus, "gpus": len(self.gpus)}],
            slots=max(cpus, len(self.gpus)),
        )

    def check(self, runs: Sequence[Run], options: SubmitOptions | None = None) -> None:
        """Refuse runs this machine cannot place, before anything starts."""
        if self.container:
            self._check_containers(runs, options)
        self._check_distributed(runs)
        need = max((r.gpus * _nodes_here(r) for r in runs), default=0)
        if need > len(self.gpus):
            have = f"{len(self.gpus)} GPU(s)" if self.gpus else "no NVIDIA GPU (NVML found none)"
            raise ValidationError(f"runs ask for {need} GPU(s) each but this machine has {have}; "
                                  "set resources.gpus to 0 to run on the CPU, or use another backend")
        if options is None or not need:
            return
        if options.mps:
            from nbbatch.execute.mps import check_mps

            check_mps(self.gpus)
        elif isinstance(options.runs_per_gpu, int) and options.runs_per_gpu > 1:
            held = [g.index for g in self.gpus if g.compute_mode == "exclusive_process"]
            if held:
                raise ValidationError(
                    f"GPU(s) {', '.join(map(str, held))} are in exclusive-process compute mode: one process at a time, "
                    f"so resources.runs_per_gpu: {options.runs_per_gpu} cannot share them; set resources.mps: true "
                    "(CUDA MPS lets runs share such a GPU), runs_per_gpu: 1, or `nvidia-smi -c DEFAULT`")

    def _check_distributed(self, runs: Sequence[Run]) -> None:
        spread = next((r for r in runs if r.distribution and r.distribution["nodes"] > 1), None)
        if spread is not None and not os.environ.get(SIMULATE_NODES_ENV):
            raise ValidationError(f"run {spread.run_id} spans {spread.distribution['nodes']} nodes, but the local backend "
                                  "is this one machine; set resources.nodes: 1 (processes_per_node ranks here), or use "
                                  "a backend with nodes (ray, azureml)")
        if self.container and any(r.distribution for r in runs):
            raise ValidationError("container: true runs one kernel per container, and a distributed run has one per "
                                  "rank; run distributed runs without containers (or on azureml, whose images they use)")

    # --- container: true --------------------------------------------------------------------------------

    def check_share(self, share: Share) -> None:
        if self.container and share.local_path("") is None:
            raise ContainerError(f"container: true bind-mounts the share into each run's container, so it must be a "
                                 f"folder on this machine; {share.url} is not: use a local folder as `share:`, or "
                                 "run without containers")

    def prepare_environments(self, frameworks: Sequence[str], project: Project, build: bool = False,
                             progress: bool = True) -> None:
        if not self.container:
            return super().prepare_environments(frameworks, project, build, progress)
        if build and frameworks:
            from nbbatch.containers.images import build_image
            from nbbatch.spec.frameworks import get_framework

            for name in frameworks:
                spec = self._image_spec(get_framework(name, project), project)
                if progress:
                    print(f"image of {name}: {spec.ref} (build log: .nbbatch/images/{name}.log)", file=sys.stderr)
                build_image(self._container_engine(), spec, project)

    def _container_engine(self) -> Engine:
        if self._engine is None:
            from nbbatch.containers.engines import find_engine

            self._engine = find_engine(self.settings["engine"])
        return self._engine

    def _image_spec(self, framework: Any, project: Project) -> ImageSpec:
        from nbbatch.containers.images import image_spec

        return image_spec(framework, project.root / "dockerfiles", gpu=not self.settings["cpu_image"],
                          base=self.settings["base_image"])

    def _check_containers(self, runs: Sequence[Run], options: SubmitOptions | None) -> None:
        """The engine runs, the GPUs can reach containers, every framework's image is ready: before any run starts."""
        from nbbatch.containers.images import require_image
        from nbbatch.spec.frameworks import get_framework
        from nbbatch.spec.project import Project

        if options is not None and options.mps:
            raise ValidationError("resources.mps cannot be combined with container: true (the MPS daemon's pipe is not "
                                  "shared with containers); drop one of them")
        loose = next((r for r in runs if not r.framework), None)
        if loose is not None:
            raise ValidationError(f"container: true runs each notebook in its framework's image, and {loose.notebook_rel} "
                                  f"(kernel {loose.kernel}) belongs to no framework; list it under `frameworks:`, or run "
                                  "without containers")
        remote = next(((r, n, u) for r in runs for n, u in r.inputs.items() if "://" in u), None)
        if remote is not None:
            run, name, url = remote
            raise ValidationError(f"input `{name}` is the share folder {url}, which a container cannot pull into the "
                                  f"(read-only) project; bring it here first (`nbbatch data pull {url} ./{name.lower()}`) "
                                  f"and name that folder in `inputs:`, or run without containers")
        engine = self._container_engine()
        if any(r.gpus for r in runs):
            engine.check_gpus()
        for run in runs:
            if run.framework and run.framework not in self._images:
                project = Project(run.project_root())
                status = require_image(engine, self._image_spec(get_framework(run.framework, project), project))
                self._images[run.framework] = (status.ref, status.image_id or "")

    def _execute(self, run: Run, share: Share, lease: GpuLease, shared: bool, gpu_env: dict[str, str],
                 info: dict[str, Any], cancel: threading.Event, notify: Callable[[RunRecord], None],
                 kernels: KernelPool) -> RunRecord:
        """One run: in a kernel of this machine's venv, or with ``container: true`` inside its framework's image."""
        if run.distribution:
            return _execute_distributed(run, share, lease.gpu_ids, cancel, notify)
        if not self.container:
            return execute_run(run, share, gpu_ids=lease.gpu_ids, shared_gpu=shared, cancel_event=cancel,
                               on_update=notify, kernels=kernels, gpu_env=gpu_env, gpu_share=info)
        from nbbatch.containers.runner import execute_in_container

        if run.framework not in self._images:
            self._check_containers([run], None)
        image, image_id = self._images[run.framework or ""]
        return execute_in_container(self._container_engine(), image, image_id, run, share, Path(run.project_root()),
                                    gpu_ids=lease.gpu_ids, shared_gpu=shared, gpu_share=info, cancel_event=cancel,
                                    notify=notify)

    # --- scheduling -------------------------------------------------------------------------------------

    def start(self, runs: Sequence[Run], share: Share, options: SubmitOptions) -> None:
        """Run every run in worker threads of this process, on GPU slots; return when all are final."""
        with contextlib.ExitStack() as stack:
            daemon = None
            if options.mps and any(r.gpus for r in runs):
                from nbbatch.execute.mps import MpsDaemon

                daemon = stack.enter_context(MpsDaemon([g.index for g in self.gpus]))
            self._schedule(runs, share, options, daemon)

    def _schedule(self, runs: Sequence[Run], share: Share, options: SubmitOptions, daemon: MpsDaemon | None) -> None:
        pool = SlotPool(self.gpus, options.runs_per_gpu, mps=daemon is not None)
        needs = MemoryNeeds(options.earlier if pool.auto else ())
        cpu_parallel = options.max_parallel or self.max_parallel or (os.cpu_count() or 1)
        gpu_parallel = options.max_parallel or self.max_parallel or max(pool.capacity, 1)
        pending = list(runs)
        weight = {r.run_id: r.world_size if r.distribution and not r.gpus else 1 for r in runs}  # CPUs a run keeps busy
        active: dict[str, threading.Thread] = {}
        gpu_runs: set[str] = set()  # active runs holding GPU slots
        out_of_memory: dict[str, str] = {}  # runs to run again alone: the error that ended their shared attempt
        cancel = threading.Event()
        changed = threading.Condition()
        notify = options.guarded_update  # a failing display never changes a run's record
        share_failures: list[ShareError] = []  # the share cannot be written (full): start no more runs
        from nbbatch.execute.kernels import KernelPool  # imports jupyter_client: not at module import

        # A container starts its run's kernel itself: nothing to start ahead.
        kernels = KernelPool(0 if self.container else PRESTART_DEFAULT if self.prestart is None else self.prestart)

        def placement(run: Run, lease: GpuLease) -> tuple[bool, dict[str, str], dict[str, Any]]:
            """Whether the run shares its GPUs, its MPS environment, and what run.json says about both."""
            if not lease.gpu_ids:
                return False, {}, {}
            info: dict[str, Any] = {"runs_per_gpu": options.runs_per_gpu, "shared": pool.shared(lease),
                                    "exclusive": lease.exclusive, "mps": daemon is not None}
            if pool.auto:
                info.update(need_mb=lease.need_mb, need_from=needs.source(run))
            if lease.alone:
                info.update(alone=True, retried_after=out_of_memory.get(run.run_id, ""))
            return pool.shared(lease), daemon.client_env(lease.gpu_ids) if daemon else {}, info

        def end_pending(status: Status, error: RunError) -> None:
            for run in pending:
                kernels.discard(run.run_id)
                try:
                    self.finalize(share, run, status, error, notify)
                except ShareError as exc:  # not recorded: resubmitting reruns it
                    share_failures.append(exc)
            pending.clear()

        def cancel_pending(reason: str) -> None:
            end_pending(Status.CANCELLED, RunError("cancelled", "", reason=reason, kind=ErrorKind.CANCELLED))

        def worker(run: Run, lease: GpuLease) -> None:
            again = False
            try:
                try:
                    shared, gpu_env, info = placement(run, lease)
                    record = self._execute(run, share, lease, shared, gpu_env, info, cancel, notify, kernels)
                    needs.learn(record)
                    again = self._out_of_memory_while_sharing(record, lease, pool, share, notify)
                    if again and record.error is not None:
                        out_of_memory[run.run_id] = record.error.summary()
                except ShareError as exc:
                    share_failures.append(exc)
                    self.finalize(share, run, Status.FAILED, RunError("ShareError", str(exc), reason=SHARE_FAILED,
                                                                      kind=ErrorKind.SHARE), notify)
                except Exception as exc:  # noqa: BLE001 - a failure in one run never loses another's results
                    self.finalize(share, run, Status.FAILED, RunError(type(exc).__name__, str(exc), reason="nbbatch error",
                                                                      kind=ErrorKind.INTERNAL), notify)
            except ShareError as exc:  # not even the failure could be recorded; resubmitting reruns the run
                share_failures.append(exc)
            finally:
                pool.release(lease)
                with changed:
                    active.pop(run.run_id, None)
                    gpu_runs.discard(run.run_id)
                    if again:
                        pending.insert(0, run)
                    changed.notify_all()

        requests = _CancelWatch(share, runs[0].experiment if runs else "")
        try:
            with changed:
                while pending or active:
                    if share_failures and pending:
                        end_pending(Status.CANCELLED, RunError("ShareError", str(share_failures[0]),
                                                               reason="not started: " + SHARE_FAILED, kind=ErrorKind.SHARE))
                        kernels.close()
                    if pending and options.halt is not None and options.halt.is_set():
                        cancel_pending("not started: another driver took the experiment over (its lease on the share)")
                    standing = requests.current()
                    if cancel.is_set() or standing.everything:
                        cancel.set()
                        cancel_pending("cancelled before it started")
                        kernels.close()
                    started = False
                    for run in list(pending):
                        if run.run_id in standing:
                            pending.remove(run)
                            kernels.discard(run.run_id)
                            try:
                                self.finalize(share, run, Status.CANCELLED, RunError(
                                    "cancelled", "", reason="cancelled before it started", kind=ErrorKind.CANCELLED),
                                    notify)
                            except ShareError as exc:
                                share_failures.append(exc)
                            continue
                        running_gpu = sum(1 for r in active if r in gpu_runs)
                        running_cpu = sum(weight[r] for r in active if r not in gpu_runs)
                        if run.gpus and running_gpu >= gpu_parallel or not run.gpus and running_cpu and \
                                running_cpu + weight[run.run_id] > cpu_parallel:
                            continue
                        lease = pool.acquire(run.gpus * _nodes_here(run),
                                             needs.need_mb(run) if pool.auto and run.gpus else None,
                                             alone=run.run_id in out_of_memory or bool(run.distribution))
                        if lease is None:
                            continue
                        pending.remove(run)
                        if run.gpus:
                            gpu_runs.add(run.run_id)
                        thread = threading.Thread(target=worker, args=(run, lease), name=f"run-{run.run_id}",
                                                  daemon=True)
                        active[run.run_id] = thread
                        thread.start()
                        started = True
                    self._prestart(kernels, pending, pool, needs, out_of_memory, placement, share)
                    if not started:
                        changed.wait(timeout=0.5)
        except BaseException as exc:  # Ctrl-C, SIGTERM, or a defect: no run may be left `running`
            cancel.set()
            interrupted = isinstance(exc, KeyboardInterrupt)
            cancel_pending("interrupted before it started" if interrupted else f"not started: nbbatch error: {exc}")
            for thread in list(active.values()):
                thread.join()
            raise
        finally:
            kernels.close()
        if share_failures:
            raise share_failures[0]

    @staticmethod
    def _out_of_memory_while_sharing(record: RunRecord, lease: GpuLease, pool: SlotPool, share: Share,
                                     notify: Callable[[RunRecord], None]) -> bool:
        """Whether the run ran out of GPU memory beside other runs: then it is queued again, to run alone."""
        if (record.status != Status.FAILED or lease.exclusive or not lease.gpu_ids or record.error is None
                or not is_gpu_oom(record.error) or pool.capacity <= len(pool.load)):
            return False
        record.gpu_share["out_of_memory"] = record.error.summary()
        record.status = Status.QUEUED  # its next attempt says why it runs alone
        write_record(share, record)
        notify(record)
        return True

    @staticmethod
    def _prestart(kernels: KernelPool, pending: list[Run], pool: SlotPool, needs: MemoryNeeds,
                  out_of_memory: dict[str, str], placement: Callable[..., tuple[bool, dict[str, str], dict[str, Any]]],
                  share: Share) -> None:
        """Start the kernels of the next runs to start. A GPU run's kernel is started for the GPUs it will most
        likely get; if it gets others, the kernel is not used (its environment does not match) and is killed."""
        for run in pending[:kernels.size]:
            if run.run_id in kernels or run.distribution:  # a distributed run starts a kernel per rank itself
                continue
            try:
                gpu_ids = pool.preview(run.gpus)
                lease = GpuLease(gpu_ids, needs.need_mb(run) if pool.auto else None,
                                 exclusive=run.run_id in out_of_memory or (pool.auto and needs.need_mb(run) is None),
                                 alone=run.run_id in out_of_memory)
                shared, gpu_env, _info = placement(run, lease)
                kernels.prestart(run.run_id, *kernel_launch(run, gpu_ids, shared, gpu_env=gpu_env, share=share))
            except Exception:  # noqa: BLE001 - the run then starts its kernel itself
                return

    def lost_runs(self, experiment: str, share: Share, records: Sequence[RunRecord]) -> dict[str, RunError]:
        """Runs left ``running`` or ``queued`` by a submitting process of this machine that is gone."""
        host = socket.gethostname()
        return {r.run_id: RunError("DriverDied", f"process {r.pid} that ran it is gone",
                                   reason="the submitting process died; resubmit to rerun", kind=ErrorKind.INFRA)
                for r in records if r.host == host and r.pid and not pid_alive(r.pid)}


def _nodes_here(run: Run) -> int:
    """How many of the run's nodes run on this machine: one, or all of them when simulated."""
    return int(run.distribution["nodes"]) if run.distribution and os.environ.get(SIMULATE_NODES_ENV) else 1


def _execute_distributed(run: Run, share: Share, gpu_ids: list[int], cancel: threading.Event,
                         notify: Callable[[RunRecord], None]) -> RunRecord:
    """Every node of a distributed run this machine runs: node 0 here, simulated others in threads beside it."""
    from nbbatch.execute.ranks import execute_node, local_placements

    placements = local_placements(run)[:_nodes_here(run)]
    per_node = run.gpus

    def fresh_endpoints() -> tuple[str, ...]:
        return local_placements(run)[0].endpoints

    def node(index: int) -> RunRecord:
        return execute_node(run, share, placements[index], gpu_ids=gpu_ids[index * per_node:(index + 1) * per_node],
                            cancel_event=cancel, on_update=notify if index == 0 else None,
                            new_endpoints=fresh_endpoints if len(placements) == 1 else None)

    others = [threading.Thread(target=node, args=(i,), name=f"node-{run.run_id}-{i}", daemon=True)
              for i in range(1, len(placements))]
    for thread in others:
        thread.start()
    try:
        return node(0)
    finally:
        for thread in others:
            thread.join()


class _CancelWatch:
    """The scheduler's view of the cancel requests: one listing per pass at most every ``poll`` seconds.

    A share error keeps the last answer and backs off (doubling, at most 30 s): a flaky share neither
    floods the service nor stops the batch; each running run's watchdog watches its own markers too.
    """

    def __init__(self, share: Share, experiment: str):
        self.share, self.experiment = share, experiment
        self.poll = 0.5 if share.local_path("") is not None else 2.0
        self.failures = 0
        self._last = CancelRequests()
        self._next = 0.0

    def current(self) -> CancelRequests:
        if not self.experiment or time.monotonic() < self._next:
            return self._last
        try:
            self._last = cancel_requests(self.share, self.experiment)
            self.failures = 0
            self._next = time.monotonic() + self.poll
        except (ShareError, OSError) as exc:
            self.failures += 1
            self._next = time.monotonic() + min(self.poll * 2 ** self.failures, 30.0)
            if self.failures == 1:
                logger.warning("cannot read the cancel requests of %s (%s); retrying", self.experiment, exc)
        return self._last

