"""The kubernetes backend: a sweep as Indexed Jobs, a distributed run as an Indexed Job of N pods, the share a volume."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from nbbatch.backends.base import Backend, Capabilities, Compute, SubmitOptions
from nbbatch.backends.kubernetes.cluster import KubernetesApi, KubernetesRefusal
from nbbatch.backends.kubernetes.manifests import (
    SHARE_MOUNT,
    PodShape,
    check_pod,
    experiment_selector,
    gang_job,
    gang_service,
    in_pod,
    job_name,
    launch_folder,
    project_folder,
    sweep_job,
)
from nbbatch.backends.kubernetes.settings import KubernetesSettings
from nbbatch.backends.kubernetes.states import (
    KubernetesJob,
    ended_without_record,
    evicted,
    indexes,
    job_deleted,
    pods_of_index,
    start_failure,
    waiting_note,
)
from nbbatch.backends.sharedfs import record_age_s
from nbbatch.containers.checks import NodeImages
from nbbatch.errors import BackendError
from nbbatch.execute.launch import LaunchSpec
from nbbatch.plan.runs import Run
from nbbatch.spec.project import Project
from nbbatch.store.layout import experiment_paths
from nbbatch.store.runfiles import (
    CANCEL_REQUEST,
    StopRequest,
    load_records,
    read_record_or_none,
    requested_outcome,
    stop_request,
    write_record,
)
from nbbatch.store.runjson import ErrorKind, RunError, RunRecord, Status, utc_now
from nbbatch.store.share import Share, poll_interval

DEFAULT_CPU = "1"  # a run's CPU request where neither `cpu`, resources.cpus nor the namespace's LimitRange says
DEFAULT_MEMORY = "4Gi"  # the same for memory (request and limit)
PER_INDEX_VERSION = (1, 29)  # backoffLimitPerIndex (per-run retries in an Indexed Job) is on by default from here
EARLIER_JOBS_S = 120.0  # how long a forced submission waits for the runs' earlier Jobs to be gone
LIST_FRESH_S = 10.0  # how long in_flight trusts one list of an experiment's Jobs
SYNC_INTERVAL_S = 5.0  # while waiting, how often the cluster is asked about the runs' Jobs and pods
NOT_SUBMITTED_S = 120.0  # a queued record this old without a Job: its submission died before the Job was made
NOTHING = "Nothing was queued."


@dataclass
class _Group:
    """The runs of one Job: a shape's single-node runs, or one distributed run."""

    runs: list[Run]
    shape: PodShape
    gang: bool = False


class KubernetesBackend(Backend):
    """Execute runs as Kubernetes Jobs: one Indexed Job per run shape, an Indexed Job of N pods per distributed run."""

    name: ClassVar[str] = "kubernetes"
    # pods run the frameworks' images on the cluster's nodes, and outlive the submitting process
    capabilities: ClassVar[Capabilities] = Capabilities(multi_node=True, local_kernels=False, detached=True,
                                                        containers=True)
    Settings: ClassVar[type] = KubernetesSettings
    settings: KubernetesSettings
    waits_by_default: ClassVar[bool] = False  # a cluster: submit returns once the Jobs are made (--wait waits)

    def __init__(self, settings: Any = None, /, **values: Any) -> None:
        super().__init__(settings, **values)
        s = self.settings
        self.api = KubernetesApi(s.namespace, s.context, s.kubeconfig, client=s.client)
        self._images = NodeImages(self.name, "podman", s.cpu_image, s.base_image, s.registry)
        self._synced_at = float("-inf")
        self._listed: tuple[float, str, dict[str, Any]] = (float("-inf"), "", {})  # when, experiment, its Jobs
        self._cluster: tuple[bool, tuple[str | None, str | None]] | None = None  # per-index retries; cpu, memory

    @property
    def poll_s(self) -> float | None:  # type: ignore[override]
        return self.settings.poll_s or None

    def compute(self) -> Compute:
        """The namespace this backend submits to (the cluster's nodes are not the namespace's to list)."""
        return Compute(backend=self.name, slots=self.parallel_limit(SubmitOptions()) or 1,
                       details={"server": self.api.server, "namespace": self.settings.namespace,
                                "context": self.settings.context})

    # --- checks before anything is queued ---------------------------------------------------------------------

    def prepare_environments(self, frameworks: Sequence[str], project: Project, build: bool = False,
                             progress: bool = True) -> None:
        """``submit --build-envs``: the frameworks' images built here (push them for the cluster)."""
        if build and not self.settings.images:
            self._images.build(frameworks, project, progress)

    def image_of(self, run: Run) -> str:
        """The image a run's pod starts: ``images:`` (by framework, or ``*``), else its framework's in ``registry``."""
        images = self.settings.images or {}
        if run.framework and run.framework in images:
            return images[run.framework]
        if "*" in images:
            return images["*"]
        if not run.framework:
            raise BackendError(f"{run.notebook_rel} (kernel {run.kernel}) belongs to no framework, so no framework "
                               "image can run it on Kubernetes: list it under `frameworks:`, or name its image in the "
                               f"backend's `images: {{'*': IMAGE}}`. {NOTHING}")
        if not self.settings.registry:
            raise BackendError(f"the kubernetes backend pulls each framework's image from a registry: push it "
                               f"(`nbbatch images push {run.framework} --registry REGISTRY`) and set `registry:`, or "
                               f"name it in `images: {{{run.framework}: IMAGE}}`. {NOTHING}")
        return self._images.refs([run])[run.framework]

    def check(self, runs: Sequence[Run], options: SubmitOptions | None = None) -> None:
        """Before anything is queued: images, inputs, and the cluster's own verdict on every Job (a server-side
        dry run of the Job, its Service and one of its pods: names, quota, LimitRange, priority class, webhooks)."""
        super().check(runs, options)
        if options is not None and isinstance(options.runs_per_gpu, int) and options.runs_per_gpu > 1 \
                and any(r.gpus for r in runs):
            raise BackendError(f"resources.runs_per_gpu: {options.runs_per_gpu}: Kubernetes gives each pod whole GPUs "
                               "(nvidia.com/gpu), so runs cannot share one there; drop runs_per_gpu, or use backend "
                               "`local`")
        self._check_namespace()
        groups = self._groups(runs)
        limit = self.parallel_limit(options or SubmitOptions())
        for number, group in enumerate(groups):
            name = job_name(runs[0].experiment, "check00", number)
            for manifest in self._manifests(name, "check00", group, "check", limit):
                self._dry_run(manifest, group.runs[0])

    def _check_namespace(self) -> None:
        try:
            self.api.read_namespace()
        except KubernetesRefusal as refusal:
            if refusal.code == 404:
                raise BackendError(f"the namespace `{self.settings.namespace}` does not exist on {self.api.server}: "
                                   f"create it (`kubectl create namespace {self.settings.namespace}`) or set "
                                   f"`namespace:`. {NOTHING}") from None
            if refusal.code not in (401, 403):  # may not read namespaces: its Jobs' dry runs will say what they must
                raise BackendError(f"the Kubernetes API server {self.api.server} refused to read namespace "
                                   f"`{self.settings.namespace}`: {refusal}. {NOTHING}") from None

    def _dry_run(self, manifest: Mapping[str, Any], run: Run) -> None:
        try:
            self.api.create(manifest, dry_run=True)
        except KubernetesRefusal as refusal:
            raise BackendError(f"Kubernetes would refuse the {manifest['kind']} of run {run.run_id}: "
                               f"{_refusal_words(refusal)}. {NOTHING}") from None

    # --- what the cluster is like (asked once per backend) -------------------------------------------------------

    def _cluster_facts(self) -> tuple[bool, tuple[str | None, str | None]]:
        """Whether the server keeps per-index retry limits, and the (cpu, memory) a run asks for by default: None
        where the namespace's LimitRange gives containers a default (a server fills it from the LimitRange's max when
        only that is given), else ours."""
        if self._cluster is None:
            per_index = self.api.version() >= PER_INDEX_VERSION
            defaults: dict[str, Any] = {}
            for limit_range in self.api.limit_ranges():
                for item in (limit_range.get("spec") or {}).get("limits") or []:
                    if item.get("type") == "Container":
                        defaults.update(item.get("defaultRequest") or item.get("default") or {})
            cpu = None if "cpu" in defaults else DEFAULT_CPU
            memory = None if "memory" in defaults else DEFAULT_MEMORY
            self._cluster = per_index, (cpu, memory)
        return self._cluster

    def _groups(self, runs: Sequence[Run]) -> list[_Group]:
        _per_index, (cpu, memory) = self._cluster_facts()
        groups: dict[PodShape, _Group] = {}
        gangs = []
        for run in runs:
            shape = PodShape(self.image_of(run), run.gpus, self.settings.cpu or (str(run.cpus) if run.cpus else cpu),
                             self.settings.memory or memory, run.retries)
            if run.distribution:
                gangs.append(_Group([run], shape, gang=True))
            else:
                groups.setdefault(shape, _Group([], shape)).runs.append(run)
        return [*groups.values(), *gangs]

    def _manifests(self, name: str, submission: str, group: _Group, folder: str,
                   limit: int | None) -> list[dict[str, Any]]:
        """The Job of a group (and, for a gang, its Service and a pod of it, for a dry run)."""
        per_index, _defaults = self._cluster_facts()
        pods, experiment = self.settings.pod_settings(), group.runs[0].experiment
        launches = in_pod(folder)
        if group.gang:
            job = gang_job(name, experiment, submission, group.runs[0], group.shape, pods, launches)
            return [job, gang_service(job), check_pod(job)]
        job = sweep_job(name, experiment, submission, group.runs, group.shape, pods, launches, limit, per_index)
        return [job, check_pod(job)]

    # --- submission ---------------------------------------------------------------------------------------------

    def launch(self, runs: Sequence[Run], share: Share, options: SubmitOptions) -> None:
        """As every backend launches, after deleting the Jobs these runs still have (``submit --force`` restarts runs
        in flight): a run's files are never written by two pods."""
        self._stop_earlier_jobs(runs, share)
        super().launch(runs, share, options)

    def _stop_earlier_jobs(self, runs: Sequence[Run], share: Share) -> None:
        earlier = {j.job for r in runs if (j := KubernetesJob.read(share, r.experiment, r.run_id)) is not None}
        if not earlier:
            return
        for found in self.api.jobs(experiment_selector(runs[0].experiment)):
            name = found["metadata"]["name"]
            if name in earlier and not (_condition(found, "Complete") or _condition(found, "Failed")):
                self.api.delete_job(name, self.settings.termination_grace_s)
                if not self.api.watch_job_gone(name, int(EARLIER_JOBS_S)):
                    raise BackendError(f"Job {name} still runs runs of this submission {EARLIER_JOBS_S:g} s after "
                                       f"nbbatch deleted it; see `kubectl -n {self.settings.namespace} describe job "
                                       f"{name}`. {NOTHING}")

    def start(self, runs: Sequence[Run], share: Share, options: SubmitOptions) -> None:
        """Make one Job per group of runs (their launches and notebooks first, on the share). A Job the server
        refuses fails only its runs, with the server's words."""
        experiment = runs[0].experiment
        submission = uuid.uuid4().hex[:6]
        root = f"{experiment_paths(experiment).folder}"
        project = project_folder(root, submission)
        for run in {r.notebook_rel: r for r in runs}.values():
            share.write_bytes(f"{project}/{run.notebook_rel}", run.resolve_notebook(run.project_root()).read_bytes())
        limit = self.parallel_limit(options)
        for number, group in enumerate(self._groups(runs)):
            name = job_name(experiment, submission, number)
            folder = launch_folder(root, submission, name)
            for index, run in enumerate(group.runs):
                share.write_bytes(f"{folder}/{index}.json", self._launch(run, share, in_pod(project)).to_json().encode())
            job, *more = self._manifests(name, submission, group, folder, limit)
            try:
                made = self.api.create(job)
                for manifest in more[:-1]:  # a gang's Service (the check pod is for dry runs only)
                    self.api.create(gang_service(made) if manifest["kind"] == "Service" else manifest)
            except (KubernetesRefusal, BackendError) as exc:
                for run in group.runs:
                    self.finalize(share, run, Status.FAILED, RunError(
                        "KubernetesRefused", f"the API server refused Job {name}: {exc}",
                        reason="the run never started: fix what Kubernetes names and submit again",
                        kind=ErrorKind.INFRA))
                continue
            for index, run in enumerate(group.runs):
                KubernetesJob(name, 0 if group.gang else index, self.settings.namespace, folder, utc_now(),
                              self.settings.context).write(share, experiment, run.run_id)

    def _launch(self, run: Run, share: Share, project: str) -> LaunchSpec:
        """What run-one executes in the pod: the run with its notebook in the submission's copy of the project, the
        share at :data:`SHARE_MOUNT`, its inputs where the pod sees them, the pod's GPUs."""
        inputs = {name: self._input_in_pod(run, name, where, share) for name, where in run.inputs.items()}
        remote = dataclasses.replace(run, notebook=run.notebook_rel, inputs=inputs,
                                     cwd=run.cwd if run.cwd and not Path(run.cwd).is_absolute() else None)
        return LaunchSpec(run=remote, share=SHARE_MOUNT, backend=self.name, project=project,
                          gpus=tuple(range(run.gpus)), inputs=inputs)

    def _input_in_pod(self, run: Run, name: str, where: str, share: Share) -> str:
        root = share.local_path("")
        folder = Path(where)
        if root is not None and folder.is_absolute() and folder.resolve().is_relative_to(root.resolve()):
            return in_pod(folder.resolve().relative_to(root.resolve()).as_posix())
        raise BackendError(f"input `{name}` of run {run.run_id} is {where}, which the pods cannot see: they see only "
                           f"the share. Put it there (`nbbatch data push {where} SHARE_FOLDER`) and name that "
                           f"folder. {NOTHING}")

    # --- state ----------------------------------------------------------------------------------------------------

    def _open(self, experiment: str, share: Share,
              run_ids: Sequence[str] | None) -> list[tuple[RunRecord, KubernetesJob]]:
        if run_ids is None:
            records, _problems = load_records(share, experiment)
        else:
            records = [r for i in run_ids if (r := read_record_or_none(share, experiment, i)) is not None]
        return [(r, j) for r in records if not r.final and r.backend == self.name
                and (j := KubernetesJob.read(share, experiment, r.run_id)) is not None]

    def in_flight(self, share: Share, record: RunRecord) -> bool:
        """Whether the run's Job still has its index to run (not completed, not failed). One list of the experiment's
        Jobs serves :data:`LIST_FRESH_S`: a resubmission asks this of every unfinished run."""
        job = KubernetesJob.read(share, record.experiment, record.run_id)
        if job is None:
            return False
        taken, experiment, jobs = self._listed
        if experiment != record.experiment or time.monotonic() - taken > LIST_FRESH_S:
            jobs = {j["metadata"]["name"]: j for j in self.api.jobs(experiment_selector(record.experiment))}
            self._listed = (time.monotonic(), record.experiment, jobs)
        found = jobs.get(job.job)
        if found is None or found["metadata"].get("deletionTimestamp"):
            return False
        status = found.get("status") or {}
        return job.index not in indexes(status.get("completedIndexes")) | indexes(status.get("failedIndexes")) \
            and not any(c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
                        for c in status.get("conditions") or [])

    def sync(self, experiment: str, share: Share, run_ids: Sequence[str] | None = None) -> None:
        """Bring the unfinished runs' records up to date with the cluster (at most every :data:`SYNC_INTERVAL_S`
        while waiting): a waiting pod's reason as the run's note; a run that cannot start (its image) or whose pod
        ended without its final record (OOMKilled, evicted for good, its Job deleted) ends with why."""
        if run_ids is not None and time.monotonic() - self._synced_at < SYNC_INTERVAL_S:
            return
        self._synced_at = time.monotonic()
        open_runs = self._open(experiment, share, run_ids)
        if not open_runs:
            return
        selector = experiment_selector(experiment)
        jobs = {j["metadata"]["name"]: j for j in self.api.jobs(selector)}
        pods = self.api.pods(selector)
        for record, job in open_runs:
            self._sync_one(share, record, job, jobs.get(job.job), pods)
        self._delete_finished(experiment, share, jobs, pods)

    def _sync_one(self, share: Share, record: RunRecord, job: KubernetesJob, found: Mapping[str, Any] | None,
                  pods: Sequence[Mapping[str, Any]]) -> None:
        if found is None:
            self._end(share, record, job_deleted(job.job))
            return
        mine = pods_of_index(pods, job.job, job.index)
        latest = mine[-1] if mine else None
        status = found.get("status") or {}
        ended = indexes(status.get("failedIndexes")) | indexes(status.get("completedIndexes"))
        if job.index in ended or _condition(found, "Failed"):  # its pod is over, and the run wrote no final record
            self._end(share, record, ended_without_record(latest, job.job, job.index, self._log_tail(latest)))
            return
        if latest is None:
            return
        failure = start_failure(latest, self.settings.registry)
        if failure is not None:
            self._end(share, record, failure)
            return
        earlier = next((why for pod in reversed(mine[:-1]) if (why := evicted(pod))), None)
        note = waiting_note(latest) if record.status == Status.QUEUED else None
        if earlier and note is None:
            note = f"its pod was evicted ({earlier}); a new pod resumes it from its checkpoint"
        if note is not None and note != record.note:
            current = read_record_or_none(share, record.experiment, record.run_id)
            if current is not None and not current.final and current.note != note:
                current.note = note
                write_record(share, current)

    def _log_tail(self, pod: Mapping[str, Any] | None) -> str:
        if pod is None:
            return ""
        try:
            return self.api.pod_log(pod["metadata"]["name"])
        except (KubernetesRefusal, BackendError):
            return ""

    def _end(self, share: Share, record: RunRecord, error: RunError) -> None:
        """End a run the cluster says is over, unless its own final record came meanwhile; a cancel marker's request
        decides how a run stopped by a cancel ends."""
        current = read_record_or_none(share, record.experiment, record.run_id)
        if current is None or current.final:
            return
        if stop_request(share, current.experiment, current.run_id) is not None:  # its Job was deleted by a cancel
            self.finalize(share, current, *requested_outcome(share, current.experiment, current.run_id,
                                                             "cancelled: its pod was stopped", error.evalue))
        else:
            self.finalize(share, current, Status.FAILED, error)

    def _delete_finished(self, experiment: str, share: Share, jobs: Mapping[str, Mapping[str, Any]],
                         pods: Sequence[Mapping[str, Any]]) -> None:
        """Delete a Job that still has pods although every run of it is final: pods that can never start. A pod still
        running is left to end (its launcher wrote the final record and is exiting), so a Job that is finishing is
        not deleted under it."""
        running = {(p["metadata"].get("labels") or {}).get("batch.kubernetes.io/job-name") for p in pods
                   if (p.get("status") or {}).get("phase") == "Running"}
        for name, found in jobs.items():
            if found["metadata"].get("deletionTimestamp") or not (found.get("status") or {}).get("active") \
                    or name in running:
                continue
            if all(r.final for r in self._runs_of_job(experiment, share, name)):
                self.api.delete_job(name, self.settings.termination_grace_s)

    def _runs_of_job(self, experiment: str, share: Share, name: str) -> list[RunRecord]:
        records, _problems = load_records(share, experiment)
        return [r for r in records if (j := KubernetesJob.read(share, experiment, r.run_id)) is not None and j.job == name]

    def lost_runs(self, experiment: str, share: Share, records: Sequence[RunRecord]) -> dict[str, RunError]:
        """Queued runs that never got a Job: their submission stopped before the Job was made."""
        return {r.run_id: RunError("NotSubmitted", "the run has no Kubernetes Job: its submission stopped before "
                                   "the Job was made", reason="never queued; submit again", kind=ErrorKind.INFRA)
                for r in records if KubernetesJob.read(share, experiment, r.run_id) is None
                and record_age_s(r) > NOT_SUBMITTED_S}

    # --- cancel ---------------------------------------------------------------------------------------------------

    def cancel(self, experiment: str, share: Share, run_ids: Sequence[str] | None = None,
               request: StopRequest = CANCEL_REQUEST) -> list[str]:
        """Write the cancel markers; runs whose pod has not started end at once; a Job none of whose runs is left is
        deleted with its pods (foreground), after ``cancel_grace_s`` for runs that are running (their launcher
        stops the kernel and records the cancel first, keeping the partial notebook)."""
        asked = super().cancel(experiment, share, run_ids, request)
        open_runs = self._open(experiment, share, asked)
        if not open_runs:
            return asked
        for record, _job in open_runs:
            if record.status == Status.QUEUED:
                self.finalize(share, record, *request.outcome(reason="cancelled before it started"))
        deadline = time.monotonic() + self.settings.cancel_grace_s
        running = [r for r, _j in open_runs if r.status != Status.QUEUED]
        while running and time.monotonic() < deadline:
            running = [r for r in running if not ((c := read_record_or_none(share, experiment, r.run_id)) is not None
                                                  and c.final)]
            if running:
                time.sleep(poll_interval(share))
        for name in sorted({j.job for _r, j in open_runs}):
            if all(r.final for r in self._runs_of_job(experiment, share, name)):
                self.api.delete_job(name, self.settings.termination_grace_s)
        return asked


def _condition(obj: Mapping[str, Any], kind: str) -> bool:
    return any(c.get("type") == kind and c.get("status") == "True" for c in (obj.get("status") or {}).get("conditions")
               or [])


def _refusal_words(refusal: KubernetesRefusal) -> str:
    """The server's refusal, with the fix where the kind of refusal says it."""
    hints = {
        "exceeded quota": "lower the experiment's resources (gpus, cpus), the backend's `cpu:`/`memory:`, or ask for "
                          "more quota",
        "PriorityClass": "set `priority_class:` to one the cluster has (`kubectl get priorityclasses`)",
        "maximum": "the namespace's LimitRange caps each container: lower the backend's `cpu:`/`memory:`",
        "admission webhook": "the cluster's policy refuses it: ask its admins what it allows",
        "is forbidden: User": "the kubeconfig's user may not do this here: the RBAC rules docs/kubernetes.md lists",
    }
    hint = next((h for key, h in hints.items() if key in refusal.message), "")
    fields = ", ".join(sorted({c.get("field", "") for c in refusal.causes if c.get("field")}))
    said = refusal.message + (f" (fields: {fields})" if fields and fields not in refusal.message else "")
    return f"{said}; {hint}" if hint else said


__all__ = ["KubernetesBackend", "KubernetesSettings"]
