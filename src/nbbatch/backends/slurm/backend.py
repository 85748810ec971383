"""The driver side of the Slurm backend: settings, checks before queueing, submission, state, cancel."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from nbbatch.backends.base import Backend, Capabilities, Compute, SubmitOptions
from nbbatch.backends.settings import setting
from nbbatch.backends.sharedfs import local_addresses, on_network_filesystem, record_age_s
from nbbatch.backends.slurm.commands import Partition, QueuedJob, Slurm, SlurmCommandError, find_job
from nbbatch.backends.slurm.driver import DRIVER_JOB, driver_job_state, start_driver_job
from nbbatch.backends.slurm.jobs import (
    LOST_REASONS,
    QUEUED_STATES,
    RUNNING_STATES,
    SlurmJob,
    ended_job_outcome,
    lost_error,
    minutes_of,
    pending_note,
)
from nbbatch.backends.slurm.script import (
    SUBMISSIONS,
    JobShape,
    array_option,
    batch_script,
    group_by_shape,
    job_launch,
    job_options,
    spec_path,
)
from nbbatch.containers.checks import (
    NodeImages,
    refuse_image_settings_without_container,
)
from nbbatch.errors import BackendError, ContainerError, NbbatchError, ValidationError, did_you_mean
from nbbatch.execute.launch import LaunchSpec, launch_shell_command, shell_launcher
from nbbatch.plan.runs import Run
from nbbatch.redact import is_secret
from nbbatch.spec.project import Project
from nbbatch.store.drivers import DetachedDriver, DriverState
from nbbatch.store.layout import experiment_paths
from nbbatch.store.runfiles import (
    CANCEL_REQUEST,
    StopRequest,
    load_records,
    read_record_or_none,
    requested_outcome,
    write_record,
)
from nbbatch.store.runjson import ErrorKind, RunError, RunRecord, Status, utc_now
from nbbatch.store.share import Share, poll_interval

_MEMORY = re.compile(r"^(\d+)([KMGT]?)$", re.IGNORECASE)
DEFAULT_MEMORY_MB = 8192  # a run's --mem where neither `memory` nor the cluster (DefMemPerCPU…) says, if nodes have it
_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")
OUTPUT_TAIL = 1500  # characters of Slurm's output file quoted in a lost or failed run's error
EARLIER_JOBS_S = 60.0  # how long a forced submission waits for the runs' earlier jobs to end
QUEUE_FRESH_S = 10.0  # how long in_flight trusts one squeue of an experiment's jobs
SYNC_INTERVAL_S = 5.0  # while waiting, how often Slurm is asked how the runs' jobs are
NOT_SUBMITTED_S = 120.0  # a queued record this old without a job: its submission died before sbatch
_JOB = "nbbatch names each job after its experiment and finds its jobs by that name"
_SHAPE = "one task per node; the experiment's resources (nodes, gpus) and the settings cpus and memory set it"
OWNED_OPTIONS = {  # sbatch options that extra_sbatch may not give, and why
    "--array": "a submission's runs are one array; set max_parallel for its throttle",
    "--output": "Slurm's output goes beside the runs' specs on the share", "-o": "Slurm's output goes beside the specs",
    "--job-name": _JOB, "-J": _JOB, "--wrap": "nbbatch writes the batch script",
    "--parsable": "nbbatch reads the job id itself", "--test-only": "nbbatch tests every job before queueing",
    "--wait": "use `nbbatch submit --wait`", "-W": "use `nbbatch submit --wait`",
    "--nodes": _SHAPE, "-N": _SHAPE, "--ntasks": _SHAPE, "-n": _SHAPE, "--ntasks-per-node": _SHAPE,
    "--mem": "set the backend's `memory`", "--cpus-per-task": "set the backend's `cpus`", "-c": "set `cpus`",
    "--requeue": "nbbatch submits a lost run again itself (retries)",
}
CONTAINER_ENGINE = "podman"  # container: true starts the images on the nodes with it (no daemon, no root needed)


@dataclass(frozen=True)
class SlurmSettings:
    """The slurm backend's settings (the experiment's ``backend:`` mapping; see docs/slurm.md)."""

    partition: str | None = field(default=None, metadata=setting(label="partition"))
    account: str | None = field(default=None, metadata=setting(label="account"))
    qos: str | None = field(default=None, metadata=setting(label="QOS"))
    constraint: str | None = field(default=None, metadata=setting(label="constraint"))
    time_limit: str | int | None = field(default=None, metadata=setting(label="time limit"))  # minutes or D-HH:MM:SS
    max_parallel: int | None = field(default=None, metadata=setting(minimum=1, label="max parallel"))  # array's %K
    cpus: int = field(default=2, metadata=setting(minimum=1, label="CPUs per run"))  # per node of a distributed run
    memory: str | None = field(default=None, metadata=setting(label="memory per run"))  # --mem, per node; None: fitted
    gpu_type: str | None = field(default=None, metadata=setting(label="GPU type"))  # --gpus-per-node=TYPE:N
    extra_sbatch: list[str] | None = None  # more sbatch options, as written on its command line
    container: bool = False  # each run in its framework's image (podman on the node; the image on every node)
    cpu_image: bool = False  # with container: the frameworks' CPU images (as `nbbatch images build --cpu`)
    base_image: str | None = None  # with container: the images built on this base (as `nbbatch images build --base`)
    registry: str | None = None  # with container: nodes pull REGISTRY/nbbatch-<fw>:<fingerprint> (`nbbatch images push`)
    python: str | None = None  # nbbatch's Python on the nodes (default: this one, on the shared file system)
    project: str | None = None  # the project's path on the nodes (default: its path here)
    env: dict[str, str] | None = None  # variables for the launcher (and so the kernel) on the nodes; no secrets
    shared_folder: bool = False  # the share is a folder every node sees at the same path (not detected here)
    cancel_grace_s: float = field(default=15.0, metadata=setting(minimum=0))  # before a running run's job is killed
    poll_s: float | None = field(default=None, metadata=setting(minimum=0))  # how often waiting reads the records

    def __post_init__(self) -> None:
        for name in ("partition", "account", "qos", "constraint", "gpu_type", "time_limit", "memory"):  # empty form fields
            if getattr(self, name) == "":
                object.__setattr__(self, name, None)
        if self.memory is not None and not _MEMORY.match(str(self.memory)):
            raise ValidationError(f"backend setting `memory: {self.memory}` is not a Slurm memory size: write a "
                                  "number with K, M, G or T (e.g. 16G), the memory each run's job asks for")
        for option in self.extra_sbatch or ():
            name = str(option).split("=", 1)[0]
            if name in OWNED_OPTIONS:
                raise ValidationError(f"backend setting `extra_sbatch` holds `{option}`, an option nbbatch sets itself "
                                      f"for every job: {OWNED_OPTIONS[name]}")
        limit = self.time_limit
        if limit is not None and not (isinstance(limit, int) or _TIME.match(str(limit))):
            raise ValidationError(f"backend setting `time_limit: {limit}` is not a Slurm time: write minutes (90) or "
                                  "days-hours:minutes:seconds (1-12:00:00)")


class SlurmBackend(Backend):
    """Execute runs as Slurm jobs: one job array per submission (a task per run), a job per distributed run."""

    name: ClassVar[str] = "slurm"
    capabilities: ClassVar[Capabilities] = Capabilities(
        cancel=True, log_stream=False, gpus=True, multi_node=True, local_kernels=True, detached=True,
        gpu_slots=False, managed_cluster=False, containers=True)
    Settings: ClassVar[type] = SlurmSettings
    settings: SlurmSettings
    waits_by_default: ClassVar[bool] = False  # a batch system: submit returns once the jobs are queued (--wait waits)

    def __init__(self, settings: Any = None, /, **values: Any) -> None:
        super().__init__(settings, **values)
        refuse_image_settings_without_container(self.settings)
        self.slurm = Slurm()
        self._active: tuple[float, str, set[str]] = (0.0, "", set())  # when, experiment, its active job ids
        self._synced_at = float("-inf")  # when sync last asked Slurm
        self._memory_fit: tuple[str | None] | None = None  # the --mem of a run without `memory`, once worked out
        if self.settings.container:  # the runs' kernels are the images', not venvs on the shared project
            self.capabilities = dataclasses.replace(self.capabilities, local_kernels=False)
        self._node_images = NodeImages(self.name, CONTAINER_ENGINE, self.settings.cpu_image, self.settings.base_image,
                                       self.settings.registry)

    @property
    def poll_s(self) -> float | None:  # type: ignore[override]
        return self.settings.poll_s or None

    # --- the cluster ---------------------------------------------------------------------------------------

    def compute(self) -> Compute:
        """The cluster's nodes (``sinfo``), their CPUs and GPUs."""
        out = self.slurm.run("sinfo", "-h", "-N", "-o", "%N|%T|%c|%G|%P").stdout
        nodes: dict[str, dict[str, Any]] = {}
        for line in out.splitlines():
            name, state, cpus, gres, partition = (line.split("|") + [""] * 5)[:5]
            node = nodes.setdefault(name, {"name": name, "state": state, "cpus": int(cpus or 0),
                                           "gpus": _gpu_count(gres), "partitions": []})
            node["partitions"].append(partition.rstrip("*"))
        gpus = [{"index": i, "name": "GPU", "memory_mb": None, "node": n["name"]}
                for n in nodes.values() for i in range(n["gpus"])]
        slots = sum(n["cpus"] // max(self.settings.cpus, 1) for n in nodes.values())
        return Compute(backend=self.name, gpus=gpus, nodes=list(nodes.values()), slots=max(slots, 1),
                       details={"partitions": [p.name for p in self.slurm.partitions()]})

    def check(self, runs: Sequence[Run], options: SubmitOptions | None = None) -> None:
        """Before anything is queued: the tools, the partition, secrets, and Slurm's own verdict on every job
        shape (``sbatch --test-only``: unknown account, QOS or GRES, too many nodes, a time above the limit)."""
        super().check(runs, options)
        missing = self.slurm.missing_tools()
        if missing:
            raise BackendError(f"the slurm backend needs Slurm's client tools, and this machine lacks "
                               f"{', '.join(missing)}: submit from a login node of the cluster, or install them "
                               "(Debian: apt-get install slurm-client). Nothing was queued.")
        self.check_secrets(runs)
        if self.settings.container:
            self._node_images.check(runs)
        if options is not None and isinstance(options.runs_per_gpu, int) and options.runs_per_gpu > 1 \
                and any(r.gpus for r in runs):
            raise BackendError(f"resources.runs_per_gpu: {options.runs_per_gpu}: Slurm gives each run's job whole GPUs "
                               "(GRES), so runs cannot share one there; drop runs_per_gpu, or use backend `local`")
        partitions = {p.name: p for p in self.slurm.partitions()}
        wanted = self.settings.partition
        if wanted and wanted not in partitions:
            raise BackendError(f"the Slurm partition `{wanted}` does not exist{did_you_mean(wanted, partitions)}; "
                               f"this cluster has: {', '.join(sorted(partitions)) or 'none'}. Fix `partition:` in the "
                               "experiment's backend settings. Nothing was queued.")
        shapes = {JobShape.of(r): r for r in runs}
        partition = partitions.get(wanted or "") or next((p for p in partitions.values() if p.default), None)
        self._check_time_limits(shapes, partition)
        for shape, run in shapes.items():
            refusal = self.slurm.test_only(job_options(self.settings, shape, "nbbatch-check", self._fitted_memory()))
            if refusal is not None:
                offered = sorted({g for p in partitions.values() for g in p.gres.split(",") if g})
                gres = f" (GPUs there: {', '.join(offered) or 'none'})" if shape.gpus else ""
                options = " ".join(job_options(self.settings, shape, job_name(run.experiment), self._fitted_memory()))
                raise BackendError(
                    f"Slurm would refuse the job of run {run.run_id} ({_shape_words(shape)}; options "
                    f"{options}). Slurm says: {refusal}{gres}.{self._memory_too_big(partition)} Fix the "
                    "backend settings (partition, account, qos, constraint, gpu_type, memory, cpus, time_limit, "
                    "extra_sbatch) or the experiment's resources. Nothing was queued.")

    def _fitted_memory(self) -> str | None:
        """The ``--mem`` of a run when the ``memory`` setting is unset: none where the cluster (or the partition) gives
        jobs a default (DefMemPerCPU, DefMemPerNode, DefMemPerGPU), else 8G or, where the partition's smallest node
        has less, all of that node's memory (a job without --mem would take a whole node on such a cluster)."""
        if self.settings.memory:
            return None
        if self._memory_fit is None:
            partition = self.settings.partition or next((p.name for p in self.slurm.partitions() if p.default), None)
            if self.slurm.default_memory(partition):
                self._memory_fit = (None,)
            else:
                sizes = self.slurm.node_memory_mb().get(partition or "", [])
                smallest = min(sizes, default=DEFAULT_MEMORY_MB)
                self._memory_fit = ("8G" if smallest >= DEFAULT_MEMORY_MB else f"{smallest}M",)
        return self._memory_fit[0]

    def _memory_too_big(self, partition: Partition | None) -> str:
        """After Slurm refused a job: whether the ``memory`` setting is more than any node of the partition has."""
        found = _MEMORY.match(str(self.settings.memory or ""))
        sizes = self.slurm.node_memory_mb().get(partition.name, []) if partition is not None else []
        if found is None or not sizes:
            return ""
        asked = int(found[1]) * {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024 * 1024}[found[2].upper()]
        if asked <= max(sizes):
            return ""
        return (f" The backend setting `memory: {self.settings.memory}` asks {asked:g} MB per node, but the nodes of "
                f"partition `{partition.name}` have at most {max(sizes)} MB (sinfo): set `memory` to at most "
                f"{max(sizes)}M, or leave it out to take the cluster's default.")

    def _check_time_limits(self, shapes: dict[JobShape, Run], partition: Partition | None) -> None:
        """A job whose --time is above its partition's limit pends forever (Slurm accepts it unless the cluster sets
        EnforcePartLimits): refuse it here."""
        limit = minutes_of(partition.time_limit) if partition is not None else None
        if limit is None:
            return
        given = minutes_of(str(self.settings.time_limit)) if self.settings.time_limit is not None else None
        for shape, run in shapes.items():
            wanted = given if given is not None else shape.time_minutes
            if wanted is not None and wanted > limit:
                source = ("the backend's time_limit" if given is not None else
                          f"timeout.run × (retries + 1) with each attempt's start ({run.timeout_s:g} s × "
                          f"{run.retries + 1} + margins)")
                raise BackendError(
                    f"run {run.run_id} needs a {wanted}-minute Slurm job ({source}), but partition `{partition.name}` "
                    f"allows at most {partition.time_limit} ({limit} min): its job would pend forever. Lower "
                    "timeout.run or retries, set time_limit, or choose another partition. Nothing was queued.")

    # --- container: true ----------------------------------------------------------------------------------

    def prepare_environments(self, frameworks: Sequence[str], project: Project, build: bool = False,
                             progress: bool = True) -> None:
        """``submit --build-envs``: the venvs, or with ``container: true`` the images on this machine (the nodes need
        their own copies)."""
        if not self.settings.container:
            return super().prepare_environments(frameworks, project, build, progress)
        if build:
            self._node_images.build(frameworks, project, progress)

    def check_secrets(self, runs: Sequence[Run] = ()) -> None:
        """Refuse a secret in ``env``: it would be written into the batch script on the share."""
        secret = sorted(k for k, v in (self.settings.env or {}).items() if is_secret(k, v))
        if secret:
            raise BackendError(f"the slurm backend setting `env` holds `{secret[0]}`, which looks like a secret; it "
                               "would be written into the batch script on the share. Export it in the environment "
                               "you submit from instead (sbatch passes it to the job, and nbbatch keeps "
                               "secret-looking variables out of the notebook's kernel). Nothing was queued.")

    def check_share(self, share: Share) -> None:
        """Refuse a share the nodes cannot see: it must be a folder (jobs read their specs and write their files
        there), on a network file system, on a cluster whose nodes are all this machine, or declared with
        ``shared_folder: true``."""
        root = share.local_path("")
        if root is None:
            raise BackendError(f"the share {share.url} is not a folder: Slurm jobs write their runs' files to a "
                               "folder on the cluster's shared file system (NFS, Lustre, GPFS…) that every node "
                               "mounts at the same path; set `share:` to such a folder. Nothing was queued.")
        if self.settings.shared_folder:
            return
        network, fs_type = on_network_filesystem(root)
        if network:
            return
        nodes = self.slurm.node_addresses()
        elsewhere = sorted(n for n, addr in nodes.items() if addr not in local_addresses())
        if not elsewhere:
            return
        raise BackendError(
            f"the share {share.url} is a folder on this machine's own disk ({fs_type or 'local file system'}), but the "
            f"Slurm nodes {', '.join(elsewhere[:5])}{' …' if len(elsewhere) > 5 else ''} are other machines, which "
            "cannot see it. Use a folder on the cluster's shared file system (mounted at the same path on every "
            "node), or, if this folder is shared in a way nbbatch cannot tell, set `shared_folder: true` in the "
            "experiment's backend settings. Nothing was queued.")

    # --- submission ----------------------------------------------------------------------------------------

    def launch(self, runs: Sequence[Run], share: Share, options: SubmitOptions) -> None:
        """As every backend launches, after stopping the jobs these runs still have in Slurm (``submit --force``
        restarts runs in flight): a run's files are never written by two jobs."""
        self._stop_earlier_jobs(runs, share)
        super().launch(runs, share, options)

    def _stop_earlier_jobs(self, runs: Sequence[Run], share: Share) -> None:
        if not runs:
            return
        name = job_name(runs[0].experiment)
        active = self.slurm.named_jobs(name)
        earlier = [j.job_id for r in runs if (j := SlurmJob.read(share, r.experiment, r.run_id)) is not None
                   and find_job(active, j.job_id) is not None]
        if not earlier:
            return
        self.slurm.cancel(earlier)
        deadline = time.monotonic() + EARLIER_JOBS_S
        while time.monotonic() < deadline and any(find_job(self.slurm.named_jobs(name), j) for j in earlier):
            time.sleep(1.0)

    def start(self, runs: Sequence[Run], share: Share, options: SubmitOptions) -> None:
        """Queue the runs: one job array per job shape for single-node runs, one job per distributed run.

        A shape whose ``sbatch`` is refused fails only its runs, with Slurm's answer; the others are queued.
        """
        root = share.local_path("")
        assert root is not None  # check_share refused every other share
        experiment = runs[0].experiment
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + "-" + uuid.uuid4().hex[:6]
        folder_rel = f"{experiment_paths(experiment).folder}/{SUBMISSIONS}/{stamp}"
        folder = root / folder_rel
        (folder / "specs").mkdir(parents=True, exist_ok=True)
        throttle = self.parallel_limit(options)
        project = self.settings.project or str(runs[0].project_root())
        python = self.settings.python or sys.executable
        index = 0
        jobs: list[tuple[list[Run], JobShape, int]] = []
        for shape, group in group_by_shape(runs).items():
            jobs.append((group, shape, index))
            index += len(group)
        for run in runs:
            if run.distribution:
                jobs.append(([run], JobShape.of(run), index))
                index += 1
        for group, shape, first in jobs:
            self._submit_group(group, shape, first, folder, folder_rel, share, project, python, throttle)

    def _submit_group(self, group: Sequence[Run], shape: JobShape, first: int, folder: Path, folder_rel: str,
                      share: Share, project: str, python: str, throttle: int | None, again: int = 0) -> None:
        gang = shape.nodes > 1 or bool(group[0].distribution)
        array = not gang
        task = f"$(( SLURM_ARRAY_TASK_ID + {first} ))" if array else str(first)
        images = self._node_images.refs(group) if self.settings.container else None
        for offset, run in enumerate(group):
            launch = job_launch(run, str(share.local_path("")), project, bool(shape.gpus), images, CONTAINER_ENGINE)
            (folder / "specs" / f"{first + offset}.json").write_text(launch.to_json())
        command = launch_shell_command(shell_launcher(python), spec_path(folder, task))
        script = folder / (f"batch-{first}-again-{again}.sh" if again else f"batch-{first}.sh")
        script.write_text(batch_script(group[0].experiment, command, project, self.settings.env or {}, gang))
        output = "slurm-%A_%a.out" if array else "slurm-%j.out"
        args = [*job_options(self.settings, shape, job_name(group[0].experiment), self._fitted_memory()),
                f"--output={folder / output}"]
        if array:
            args.append(array_option(len(group), throttle))
        if again and throttle:  # a job of its own beside the submission's array: it starts only when no job of the
            args.append("--dependency=singleton")  # experiment runs (at most K at once holds across both)
        try:
            job_id = self.slurm.submit(args, str(script))
        except SlurmCommandError as exc:
            for run in group:
                self.finalize(share, run, Status.FAILED, RunError(
                    "SlurmRefused", f"sbatch refused the job: {exc.stderr or exc}",
                    reason="the run never started: fix what Slurm names and submit again", kind=ErrorKind.INFRA))
            return
        for offset, run in enumerate(group):
            task_id = f"{job_id}_{offset}" if array else job_id
            out = f"{folder_rel}/slurm-{job_id}_{offset}.out" if array else f"{folder_rel}/slurm-{job_id}.out"
            SlurmJob(task_id, folder_rel, out, utc_now(), spec=f"{folder_rel}/specs/{first + offset}.json",
                     python=python, project=project, resubmits=again, max_parallel=throttle).write(
                share, run.experiment, run.run_id)

    # --- state ---------------------------------------------------------------------------------------------

    def _open_jobs(self, experiment: str, share: Share,
                   run_ids: Sequence[str] | None) -> list[tuple[RunRecord, SlurmJob | None]]:
        if run_ids is None:
            records, _problems = load_records(share, experiment)
        else:
            records = [r for i in run_ids if (r := read_record_or_none(share, experiment, i)) is not None]
        return [(r, SlurmJob.read(share, experiment, r.run_id)) for r in records
                if not r.final and r.backend == self.name]

    def in_flight(self, share: Share, record: RunRecord) -> bool:
        """Whether the run's job is still pending or running in Slurm (one ``squeue`` for all of an experiment's
        runs, kept for :data:`QUEUE_FRESH_S`: a resubmission asks this of every unfinished run)."""
        job = SlurmJob.read(share, record.experiment, record.run_id)
        if job is None:
            return False
        taken, experiment, active = self._active
        if experiment != record.experiment or time.monotonic() - taken > QUEUE_FRESH_S:
            active = set(self.slurm.named_jobs(job_name(record.experiment)))
            self._active = (time.monotonic(), record.experiment, active)
        return job.job_id in active

    def sync(self, experiment: str, share: Share, run_ids: Sequence[str] | None = None) -> None:
        """Bring the unfinished runs' records up to date with Slurm: a pending job's reason as the run's note; a job
        gone without the run's final record ends the run as Slurm ended the job (time limit, cancel, memory), or as
        lost, and a lost run with retries left is submitted again.

        While waiting (``run_ids`` given) Slurm is asked at most every :data:`SYNC_INTERVAL_S`: each ``squeue`` is a
        request to slurmctld, which a busy cluster's admins count; the runs' own records are read as often as ever.
        """
        if run_ids is not None and time.monotonic() - self._synced_at < SYNC_INTERVAL_S:
            return
        self._synced_at = time.monotonic()
        open_jobs = [(r, j) for r, j in self._open_jobs(experiment, share, run_ids) if j is not None]
        if not open_jobs:
            return
        queue = self.slurm.queue(j.job_id for _r, j in open_jobs)
        for record, job in open_jobs:
            seen = find_job(queue, job.job_id)
            if seen is not None and seen.state in QUEUED_STATES:
                self._note_pending(share, record, seen)
            elif seen is None or seen.state not in RUNNING_STATES:
                self._job_ended(share, record, job, seen)

    def _note_pending(self, share: Share, record: RunRecord, seen: QueuedJob) -> None:
        note = pending_note(seen.reason)
        if note is not None and record.status == Status.QUEUED and record.note != note:
            current = read_record_or_none(share, record.experiment, record.run_id)  # the run may have started
            if current is not None and current.status == Status.QUEUED:
                current.note = note
                write_record(share, current)

    def _job_ended(self, share: Share, record: RunRecord, job: SlurmJob, seen: QueuedJob | None) -> None:
        current = read_record_or_none(share, record.experiment, record.run_id)
        if current is None or current.final:
            return
        state, exit_code = seen.state if seen is not None else "", ""
        if state and seen is not None and seen.reason in LOST_REASONS:
            state = "NODE_FAIL"  # its launcher never ran, or died with its node
        if not state:
            details = self.slurm.job_details(job.job_id)
            state, exit_code = details.get("JobState", ""), details.get("ExitCode", "")
        if not state and self.slurm.accounting():
            state, exit_code = self.slurm.accounted_states([job.job_id]).get(job.job_id, ("", ""))
        if not state:  # forgotten by slurmctld (MinJobAge), no accounting: the job-completion log, where there is one
            state, exit_code = self.slurm.completion_log_states([job.job_id]).get(job.job_id, ("", ""))
        tail = _tail(share, job.output)
        if state in ("", "NODE_FAIL", "BOOT_FAIL", "PREEMPTED"):
            why = (f"Slurm reports {state} for job {job.job_id}" if state else
                   f"Slurm no longer knows job {job.job_id}, and the run wrote no final record")
            error = lost_error(job, why + (f"; its output ends with: {tail}" if tail else ""))
            if not self._resubmit(share, current, job, error):
                self.finalize(share, current, Status.FAILED, error)
            return
        status, error = ended_job_outcome(state, exit_code, job, tail)
        if status == Status.CANCELLED:  # scancel after a stop request: as the request asked (a search prunes)
            status, error = requested_outcome(share, current.experiment, current.run_id, error.reason or "",
                                              error.evalue)
        self.finalize(share, current, status, error)

    def _resubmit(self, share: Share, record: RunRecord, job: SlurmJob, error: RunError) -> bool:
        """Submit a lost run again while its retries allow; True when it was."""
        try:
            run = LaunchSpec.from_json(share.read_bytes(job.spec).decode(), job.spec).run
        except (OSError, ValueError, NbbatchError):  # one of an older nbbatch (its run alone) is not submitted again
            return False
        if job.resubmits >= run.retries:
            return False
        root = share.local_path("")
        assert root is not None
        folder = root / job.submission
        index = Path(job.spec).stem
        project = job.project or self.settings.project or str(run.project_root())  # as first submitted
        try:
            self._submit_group([run], JobShape.of(run), int(index), folder, job.submission, share, project,
                               job.python or self.settings.python or sys.executable,
                               job.max_parallel or self.parallel_limit(SubmitOptions()), again=job.resubmits + 1)
        except (OSError, ContainerError):  # no podman or image where status runs: the run ends as lost
            return False
        again = SlurmJob.read(share, run.experiment, run.run_id)
        if again is None or again.job_id == job.job_id:
            return False
        record.note = f"submitted again as job {again.job_id} after: {error.evalue}"
        record.status = Status.QUEUED
        write_record(share, record)
        return True

    def lost_runs(self, experiment: str, share: Share, records: Sequence[RunRecord]) -> dict[str, RunError]:
        """Queued runs that never got a job: their submission stopped before ``sbatch`` (the driver was killed)."""
        lost = {}
        for record in records:
            if SlurmJob.read(share, experiment, record.run_id) is None and record_age_s(record) > NOT_SUBMITTED_S:
                lost[record.run_id] = RunError("NotSubmitted", "the run has no Slurm job: its submission stopped "
                                               "before sbatch", reason="never queued; submit again", kind=ErrorKind.INFRA)
        return lost

    # --- a detached driver -----------------------------------------------------------------------------------

    def start_driver(self, name: str, args: Sequence[str], log: Path, cwd: Path, command: str) -> DetachedDriver:
        """The driver itself as a one-CPU job (:mod:`nbbatch.backends.slurm.driver`): a logout changes nothing."""
        return start_driver_job(self.slurm, self.settings, name, args, log, cwd, command, self._fitted_memory())

    @classmethod
    def driver_state(cls, driver: DetachedDriver) -> DriverState:
        """A driver job's state from Slurm; a driver started as a process (before) as every backend's."""
        return driver_job_state(Slurm(), driver) if driver.how == DRIVER_JOB else super().driver_state(driver)

    # --- cancel --------------------------------------------------------------------------------------------

    def cancel(self, experiment: str, share: Share, run_ids: Sequence[str] | None = None,
               request: StopRequest = CANCEL_REQUEST) -> list[str]:
        """Write the cancel markers, ``scancel`` pending jobs at once, and running ones after ``cancel_grace_s``
        (their launcher stops the kernel and records the cancel first, keeping the partial notebook)."""
        asked = super().cancel(experiment, share, run_ids, request)
        jobs = {r.run_id: j for r, j in self._open_jobs(experiment, share, asked) if j is not None}
        if not jobs:
            return asked
        queue = self.slurm.queue(j.job_id for j in jobs.values())
        pending = [i for i, j in jobs.items() if (q := find_job(queue, j.job_id)) is None or q.state in QUEUED_STATES]
        self.slurm.cancel([jobs[i].job_id for i in pending])
        for run_id in pending:
            current = read_record_or_none(share, experiment, run_id)
            if current is not None and not current.final:
                self.finalize(share, current, *request.outcome(reason="cancelled before it started (scancel)"))
        running = {i: j for i, j in jobs.items() if i not in pending}
        deadline = time.monotonic() + self.settings.cancel_grace_s
        while running and time.monotonic() < deadline:
            running = {i: j for i, j in running.items()
                       if not ((r := read_record_or_none(share, experiment, i)) is not None and r.final)}
            if running:
                time.sleep(poll_interval(share))
        if running:  # still going after the grace: Slurm kills them; sync records how they ended
            self.slurm.cancel([j.job_id for j in running.values()])
        return asked


def job_name(experiment: str) -> str:
    """The name of an experiment's jobs (``squeue -n``)."""
    return f"nbbatch-{experiment}"


def _gpu_count(gres: str) -> int:
    total = 0
    for item in gres.split(","):
        parts = item.split("(")[0].split(":")
        if parts[0] == "gpu" and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def _shape_words(shape: JobShape) -> str:
    nodes = f"{shape.nodes} nodes" if shape.nodes > 1 else "1 node"
    return f"{nodes}, {shape.gpus} GPU(s) per node"


def _tail(share: Share, path: str) -> str:
    with contextlib.suppress(OSError, FileNotFoundError):
        return share.read_bytes(path).decode(errors="replace").strip()[-OUTPUT_TAIL:]
    return ""
