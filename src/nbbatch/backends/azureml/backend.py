"""The azureml backend: one Azure ML command job per run, on a compute cluster it manages."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import tempfile
import warnings
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from azure.ai.ml import Input, MLClient, Output, command
from azure.ai.ml.entities import Command
from azure.core.exceptions import AzureError, HttpResponseError, ResourceNotFoundError, ServiceRequestError

from nbbatch.backends.azureml.cluster import AzureMLCluster, ClusterSettings, vm_gpus, vm_sizes_with
from nbbatch.backends.azureml.images import (
    build_code_snapshot,
    check_pushed,
    datastore_name_for,
    ensure_datastore,
    ensure_environment,
    framework_environment,
    project_root_of,
)
from nbbatch.backends.azureml.jobs import (
    CANCEL_REQUESTED,
    ENDED,
    JobLaunch,
    JobState,
    canonical_status,
    job_distribution,
    job_status_text,
    map_job_status,
    refused_job_error,
    runtime_environment,
)
from nbbatch.backends.azureml.logstream import stream_job
from nbbatch.backends.azureml.placement import azureml_placement
from nbbatch.backends.azureml.polling import (
    EXPERIMENT_PROPERTY,
    NEVER_CREATED,
    Backoff,
    JobPolling,
    attempt_job_name,
    create_job,
    next_attempt,
)
from nbbatch.backends.azureml.rules import (
    check_location,
    check_run,
    check_settings,
    datastore_path,
    job_timeout_s,
    normal_shm_size,
)
from nbbatch.backends.azureml.workspace import connect, error_text, job_environment
from nbbatch.backends.base import Backend, Capabilities, Compute, SubmitOptions
from nbbatch.backends.settings import setting
from nbbatch.errors import BackendError, NbbatchError, ShareError, ValidationError
from nbbatch.execute.launch import LaunchSpec, launch_shell_command
from nbbatch.execute.placement import NodePlacement
from nbbatch.plan.runs import Run
from nbbatch.redact import is_secret, is_secret_value
from nbbatch.spec.frameworks import get_framework
from nbbatch.spec.project import Project
from nbbatch.store.azfiles import AzureFileShare, AzureFilesLocation, parse_azfiles_url
from nbbatch.store.runfiles import (
    CANCEL_REQUEST,
    StopRequest,
    read_record,
    write_cancel_markers,
)
from nbbatch.store.runfiles import run_ids as list_run_ids
from nbbatch.store.runjson import ErrorKind, RunError, RunRecord, Status, utc_now
from nbbatch.store.share import Share

DEFAULT_LAUNCHER = 'PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" python -m nbbatch'
SHARE_BINDING = "${{outputs.share}}"  # where Azure ML mounted the share (share_mode: mount), in the job's command



@dataclass(frozen=True)
class AzureMLSettings(ClusterSettings):
    """The azureml backend's settings (the experiment's ``backend:`` mapping; all optional).

    ``compute`` names the cluster (created on first submit unless ``create_cluster: false``)
    sized by ``vm_size``, ``min_nodes``, ``max_nodes``, ``tier`` (dedicated | low_priority) and
    ``idle_time_before_scale_down`` (seconds): the fields of :class:`ClusterSettings`. The workspace is
    ``subscription_id``, ``resource_group`` and ``workspace``, or a ``config`` file. ``datastore`` names the workspace
    datastore of the experiment's file share (default ``nbbatch_<account>_<share>``). ``environments`` maps a
    framework (or ``"*"``) to an existing Azure ML environment (``azureml:name:version``)
    instead of building the framework's image from ``dockerfiles/``; ``registry`` uses the framework images pushed
    there (``nbbatch images push REGISTRY``) instead of building them. ``poll_seconds`` is how often waiting
    reads job states. ``share_mode`` is ``mount`` (the share is the job's rw_mount output) or
    ``direct`` (the job opens ``azfiles://`` itself with the cluster's managed identity; ``identity_client_id``
    names a user-assigned one, which the job's credential then uses as ``AZURE_CLIENT_ID``).
    ``ml_client``/``credential``/``client_kwargs`` are for Python callers and tests.
    """

    subscription_id: str | None = field(default=None, metadata=setting(option="--subscription-id"))
    resource_group: str | None = field(default=None, metadata=setting(option="--resource-group"))
    workspace: str | None = field(default=None, metadata=setting(option="--workspace"))
    config: str | os.PathLike | None = field(default=None, metadata=setting(option="--config"))  # a config.json
    create_cluster: bool = True
    datastore: str | None = None
    environments: Mapping[str, str] | None = None
    dockerfiles: str | os.PathLike | None = None
    registry: str | None = None  # the images pushed there (`nbbatch images push`), not built by Azure ML
    base_mirror: str | None = None  # a registry holding copies of Docker Hub base images (az acr import)
    poll_seconds: float = field(default=30.0, metadata=setting(minimum=0))
    shm_size: str | None = None
    launcher: str = DEFAULT_LAUNCHER
    share_mode: str = field(default="mount", metadata=setting(choices=("mount", "direct")))
    identity_client_id: str | None = None  # the cluster's user-assigned identity: the job's AZURE_CLIENT_ID
    ml_client: MLClient | None = field(default=None, metadata=setting(python_only=True))
    credential: Any = field(default=None, metadata=setting(python_only=True))
    client_kwargs: Mapping[str, Any] | None = field(default=None, metadata=setting(python_only=True))


class AzureMLBackend(JobPolling, Backend):
    """Runs each planned run as an Azure ML command job; see :mod:`nbbatch.backends.azureml`."""

    name: ClassVar[str] = "azureml"
    capabilities: ClassVar[Capabilities] = Capabilities(
        cancel=True, log_stream=True, gpus=True, multi_node=True, local_kernels=False, detached=True,
        gpu_slots=False, managed_cluster=True,  # kernels live in the framework images
        parallel_limit=False)  # every run's job is created at once: the cluster's max_nodes bounds them
    Settings: ClassVar[type] = AzureMLSettings
    settings: AzureMLSettings

    def __init__(self, settings: AzureMLSettings | None = None, /, **values: Any) -> None:
        """Configure from the experiment's ``backend:`` settings (see :class:`AzureMLSettings`)."""
        super().__init__(settings, **values)
        self._ml_client = self.settings.ml_client
        self._cluster: AzureMLCluster | None = None
        self._environment_refs: dict[str, str] = {}
        self._registry_checked: set[str] = set()  # frameworks whose image was found in `registry:`
        self._backoff = Backoff()  # when the service may be asked again after a throttled answer (sync)

    @property
    def poll_s(self) -> float:  # type: ignore[override]
        """How often waiting reads job states (``poll_seconds``)."""
        return float(self.settings.poll_seconds)

    # --- connections ------------------------------------------------------------------------------
    @property
    def ml_client(self) -> MLClient:
        """The workspace client (connected on first use)."""
        if self._ml_client is None:
            given = self.settings
            self._ml_client = connect(credential=given.credential, subscription_id=given.subscription_id,
                                      resource_group=given.resource_group, workspace=given.workspace,
                                      config=given.config, **dict(given.client_kwargs or {}))
        return self._ml_client

    @property
    def cluster(self) -> AzureMLCluster:
        """The compute cluster these settings name (:class:`~nbbatch.backends.cluster.ManagedCluster`)."""
        if self._cluster is None:
            self._cluster = AzureMLCluster(self.ml_client, self.settings)
        return self._cluster

    @property
    def cluster_settings(self) -> ClusterSettings:
        """The cluster's shape: the settings', with the node range it was resized to through :attr:`cluster`."""
        return self._cluster.settings if self._cluster is not None else self.settings

    # --- the Backend hooks ------------------------------------------------------------------------
    def compute(self) -> Compute:
        """The cluster's nodes (all of them count as slots: one run per node)."""
        status = self.cluster.status()
        nodes = [{"name": n["name"], "state": n["state"], "cpus": None, "gpus": None} for n in status.nodes]
        return Compute(backend=self.name, nodes=nodes, slots=self.cluster_settings.max_nodes,
                       details={"cluster": status.to_dict(), "summary": status.summary()})

    @classmethod
    def node_placement(cls, run: Run, environ: Mapping[str, str], share: Share | None = None) -> NodePlacement | None:
        """Azure ML's PyTorch, TensorFlow and MPI variables (:func:`~nbbatch.backends.azureml.placement.azureml_placement`,
        what the registry gives run-one on a node without the SDK)."""
        return azureml_placement(run, environ, share)

    def check_share(self, share: Share) -> None:
        """Jobs write to an Azure File share: refuse any other share, or one Azure ML cannot mount, before anything starts."""
        location = _azure_files_location(share)
        check_location(location, self.settings.datastore or datastore_name_for(location.account, location.share),
                       "the experiment's share", mounted=self.settings.share_mode == "mount")

    def check(self, runs: Sequence[Run], options: SubmitOptions | None = None) -> None:
        """Fail before anything starts when a run has no environment to run in, the cluster cannot hold it, or Azure ML
        would refuse its job (names, shm_size, datastore paths, time limit: :mod:`nbbatch.backends.azureml.rules`)."""
        super().check(runs, options)
        check_settings(datastore=self.settings.datastore, shm_size=self.settings.shm_size,
                       identity_client_id=self.settings.identity_client_id)
        for run in runs:
            environment = self._environment_for(run, register=False)
            for name, location in run.inputs.items():
                _input_location(name, location)
            check_run(run, environment, self.cluster_settings.tier)
        self._check_placement(runs)

    def _check_placement(self, runs: Sequence[Run]) -> None:
        """Refuse a run spanning more nodes than the cluster scales to, or wanting more GPUs per node than its VMs have.

        Only runs that are distributed or want several GPUs ask Azure ML (an existing cluster keeps its own VM size
        and node range; a missing one will be created from the settings), so checking ordinary runs stays offline.
        """
        wide = [r for r in runs if r.distribution or r.gpus > 1]
        if not wide:
            return
        name = self.cluster_settings.name
        try:
            vm_size, max_nodes, exists = self.cluster.capacity()
        except AzureError as exc:
            raise BackendError(f"cannot read cluster `{name}` to check that it can hold the runs: "
                               f"{error_text(exc) if isinstance(exc, HttpResponseError) else exc}") from exc
        for run in wide:
            nodes = run.distribution.nodes if run.distribution else 1
            if nodes > max_nodes:
                fix = (f"raise it with `nbbatch cluster scale --name {name} --max-nodes {nodes}` (`max_nodes:` under "
                       "`backend:` only sizes a cluster nbbatch creates)" if exists else
                       f"set `max_nodes: {nodes}` under `backend:` (nbbatch creates the cluster with it)")
                raise ValidationError(
                    f"run {run.run_id} spans {nodes} nodes (resources.nodes: {nodes}), but cluster `{name}` scales to "
                    f"at most {max_nodes} (max_nodes: {max_nodes}), and all of a run's nodes must run at once; {fix}, "
                    "or lower resources.nodes. Nothing was submitted")
            have = vm_gpus(vm_size)
            if have is not None and run.gpus > have:
                where = "gpus_per_node" if run.distribution else "gpus"
                sizes = ", ".join(vm_sizes_with(run.gpus)[:3])
                size = f"`vm_size:` under `backend:` to a size with at least {run.gpus} GPUs{f' (e.g. {sizes})' if sizes else ''}"
                fix = (f"a cluster's VM size cannot change: delete it (`nbbatch cluster delete --name {name}`) and "
                       f"submit again with {size}, or name another cluster with `compute:`" if exists else f"set {size}")
                raise ValidationError(
                    f"run {run.run_id} wants {run.gpus} GPU(s) per node (resources.{where}: {run.gpus}), but a node of "
                    f"cluster `{name}` is a {vm_size} with {have}; {fix}, or lower resources.{where}. Nothing was submitted")

    def in_flight(self, share: Share, record: RunRecord) -> bool:
        """Whether the run's job is still queued or running in Azure ML (asked again, not taken from the file)."""
        state = self.job_state(share, record.experiment, record.run_id)
        return state is not None and state.active and self._refresh_state(state).active

    def start(self, runs: Sequence[Run], share: Share, options: SubmitOptions) -> None:
        """Ensure cluster and datastore, snapshot the code once, and create one command job per run.

        A job Azure ML refuses does not strand the others: that run is failed at once with the service's answer
        (``AzureMLJobRefused``) and the rest are created; only when it refuses every job is a :class:`BackendError`
        raised. A create that times out may have made its job all the same: that run keeps the job's name (a
        resubmission finds the job), the rest are created, and a BackendError says so at the end. When something
        before the jobs fails (cluster, datastore, environment, a run's job), the runs left without a job are failed
        with that error, not left ``queued`` forever, and the error is raised.
        """
        location = _azure_files_location(share)
        tried: set[str] = set()
        refused: list[str] = []
        uncertain: list[str] = []
        try:
            if self.settings.create_cluster:
                self.cluster.ensure()
            elif not self.cluster.status().exists:
                raise BackendError(f"cluster `{self.cluster_settings.name}` does not exist and create_cluster is "
                                   "false; create it with `nbbatch cluster create`")
            datastore = self.settings.datastore or datastore_name_for(location.account, location.share)
            if self.settings.share_mode == "mount":
                ensure_datastore(self.ml_client, datastore, location.account, location.share)
            inputs = {_input_location(n, u) for r in runs for n, u in r.inputs.items()}
            for place in sorted({(i.account, i.share) for i in inputs} - {(location.account, location.share)}):
                ensure_datastore(self.ml_client, datastore_name_for(*place), *place)
            with tempfile.TemporaryDirectory(prefix="nbbatch-code-") as tmp:
                code_dir = build_code_snapshot(runs, Path(tmp) / "code")
                for run in runs:  # every run's file before the first job: one snapshot, uploaded once, for all
                    self._launch(run, share_url=location.url).write_run_file(code_dir)
                for run in runs:
                    job = self.build_job(run, self._environment_for(run, register=True), code_dir,
                                         datastore=datastore, share_url=location.url, share_prefix=location.prefix)
                    tried.add(run.run_id)
                    state = JobState(run.run_id, job.name, run.experiment, status=Status.QUEUED,
                                     note="being created in Azure ML", submitted_at=utc_now(), updated_at=utc_now())
                    attempt = next_attempt(self.job_state(share, run.experiment, run.run_id))
                    try:
                        created, attempt = create_job(self.ml_client, job, experiment=run.experiment, run_id=run.run_id,
                                                attempt=attempt, before=self._noting(share, state))
                    except HttpResponseError as exc:  # refused: this run fails with the service's answer, whole
                        error = refused_job_error(job.name, error_text(exc), exc.status_code)
                        state.status, state.note, state.updated_at = Status.FAILED, error.evalue, utc_now()
                        self._write_state(share, state)
                        self.finalize(share, run, Status.FAILED, error, options.guarded_update)
                        refused.append(f"run {run.run_id}: {error_text(exc)}")
                        continue
                    except AzureError as exc:  # a timeout or a dropped connection: the job may exist all the same
                        if isinstance(exc, ServiceRequestError):  # never sent: no job, the next submission makes it
                            state.status, state.note = Status.FAILED, NEVER_CREATED
                            self._write_state(share, state)
                        uncertain.append(f"creating Azure ML job {job.name} for run {run.run_id} failed ({exc})")
                        continue
                    job_status = job_status_text(created.status)
                    status, note = map_job_status(job_status)
                    self._write_state(share, JobState(run.run_id, created.name, run.experiment,
                                                      studio_url=created.studio_url, job_status=job_status,
                                                      status=status, note=note, submitted_at=state.submitted_at,
                                                      updated_at=utc_now(), attempt=attempt))
        except (NbbatchError, AzureError) as exc:
            for run in runs:  # those without a job: failed with why, so neither status nor wait waits on them
                if run.run_id not in tried:
                    self.finalize(share, run, Status.FAILED, RunError(
                        "NotSubmitted", error_text(exc) if isinstance(exc, AzureError) else str(exc),
                        reason="no Azure ML job was created for this run: fix the error and submit again",
                        kind=ErrorKind.INFRA), options.guarded_update)
            raise
        if uncertain:
            raise BackendError(f"{'; '.join(uncertain)}; it may have been created all the same. Submit again: nbbatch "
                               "looks that job up and leaves it running rather than creating another")
        if refused and len(refused) == len(runs):
            raise BackendError(f"Azure ML refused every job ({len(runs)}), so nothing runs: {refused[0]}"
                               + (f" (and {len(refused) - 1} more: `nbbatch status` shows each)"
                                  if len(refused) > 1 else ""))

    def cancel(self, experiment: str, share: Share, run_ids: Sequence[str] | None = None,
               request: StopRequest = CANCEL_REQUEST) -> list[str]:
        """Cancel the jobs of unfinished runs (all when ``run_ids`` is None); return the run ids asked to stop.

        Each run's cancel marker is written first (its executor stops at the next cell, whatever Azure ML answers),
        then its job is cancelled and the run recorded as cancelled. Azure ML refuses to cancel a job that is
        finalizing or has ended (its notebook is done): such a run is not recorded as cancelled but as its job ends
        (:meth:`sync`: a completed job's run succeeds, a failed one's fails, a finalizing one stays running until its
        job ends), it is left out of the ids returned, and a :class:`UserWarning` names it with the service's answer.
        Any other error for one job (a refusal, the service unreachable) is warned about too and stops no other
        cancel; that run is recorded as cancelled, as its marker stops its notebook. A run whose record is damaged is
        named in a warning and its job cancelled all the same; its record is left as it is.
        """
        asked: list[str] = []
        for run_id in list(run_ids) if run_ids else list_run_ids(share, experiment):
            state = self.job_state(share, experiment, run_id)
            try:
                record, damaged = read_record(share, experiment, run_id), False
            except ShareError:  # named by write_cancel_markers; its job is cancelled all the same
                record, damaged = None, True
            if state is None or (not damaged and (record is None or record.final)):
                continue
            write_cancel_markers(share, experiment, [run_id], request)  # the executor stops too
            try:
                self.ml_client.jobs.begin_cancel(state.job_name)
            except ResourceNotFoundError:
                pass
            except AzureError as exc:
                answer = error_text(exc)
                try:
                    self._refresh_state(state)
                except AzureError:
                    pass
                if canonical_status(state.job_status) in ENDED:
                    self._write_state(share, state)
                    self.sync(experiment, share, [run_id])  # the run ends as its job did, not as cancelled
                    warnings.warn(f"run {run_id} was not cancelled: its Azure ML job {state.job_name} is "
                                  f"{state.job_status} (Azure ML: {answer}); `nbbatch status` shows how it ended",
                                  UserWarning, stacklevel=2)
                    continue
                warnings.warn(f"Azure ML did not cancel job {state.job_name} of run {run_id} ({answer}); the run's "
                              "cancel marker stops its notebook, but the job may hold its node until it ends: cancel "
                              "it in the studio", UserWarning, stacklevel=2)
            state.job_status = CANCEL_REQUESTED  # active until the service says Canceled (or Completed, Failed)
            state.status, state.note = map_job_status(state.job_status)
            state.updated_at = utc_now()
            self._write_state(share, state)
            if record is not None:
                self.finalize(share, record, *request.outcome(f"Azure ML job {state.job_name}", "cancelled by the user"))
            asked.append(run_id)
        return asked

    def stream_log(self, experiment: str, share: Share, run_id: str, follow: bool = False) -> Iterator[str] | None:
        """With ``follow``, the job's own log stream (image build, node setup, stdout) until it ends.

        Without ``follow`` (or for runs never sent to Azure ML) ``None``: read ``log.txt`` from the share.
        """
        state = self.job_state(share, experiment, run_id)
        if not follow or state is None:
            return None
        return stream_job(self.ml_client, state.job_name)

    # --- jobs -------------------------------------------------------------------------------------
    def build_job(
        self,
        run: Run,
        environment: str,
        code: str | os.PathLike[str],
        *,
        datastore: str,
        share_url: str,
        share_prefix: str = "",
        attempt: int = 1,
    ) -> Command:
        """The command job of one run's ``attempt`` (what :meth:`start` sends; also handy to inspect or dump as YAML)."""
        launch = self._launch(run, share_url=share_url)
        run_file = launch.write_run_file(code)
        outputs = {}
        if self.settings.share_mode == "mount":
            outputs["share"] = Output(type="uri_folder", path=_datastore_path(datastore, share_prefix), mode="rw_mount")
        inputs = {}
        share_place = _azure_files_location_of(share_url)
        for name, url in sorted(run.inputs.items()):
            place = _input_location(name, url)
            store = datastore if (place.account, place.share) == share_place else datastore_name_for(place.account,
                                                                                                     place.share)
            inputs[name] = Input(type="uri_folder", path=_datastore_path(store, place.prefix), mode="ro_mount")
        tags = {"nbbatch": "1", "run_id": run.run_id, "experiment": run.experiment,
                "framework": run.framework or "", "notebook": run.notebook_rel,
                "parameters": json.dumps(run.parameters, sort_keys=True, default=str)[:1000]}
        instance_count, distribution = job_distribution(run.distribution)
        if distribution is not None:
            tags["distribution"] = json.dumps(run.distribution.to_dict(), sort_keys=True)
        return command(
            name=attempt_job_name(run.experiment, run.run_id, attempt),
            display_name=run.run_id,
            experiment_name=run.experiment,
            description=f"nbbatch run {run.run_id}: {run.notebook_rel}",
            code=str(code),
            command=launch_shell_command(self.settings.launcher, shlex.quote(
                command_json(launch.spec.to_dict(run_file=run_file), launch.bindings))),
            environment=environment,
            compute=self.cluster_settings.name,
            inputs=inputs,
            outputs=outputs,
            tags=tags,
            properties={EXPERIMENT_PROPERTY: run.experiment},  # the list of the experiment's jobs (sync) filters on it
            instance_count=instance_count,
            distribution=distribution,
            shm_size=normal_shm_size(self.settings.shm_size),
            timeout=job_timeout_s(run),  # every attempt of the runner inside, not one
            environment_variables={**runtime_environment(), **job_environment(self.settings.identity_client_id)},
        )

    def _launch(self, run: Run, *, share_url: str) -> JobLaunch:
        """What the run's job hands ``run-one``: the launch (the share and inputs as the job's bindings) and its run;
        refused when the run holds something that looks like a secret (the workspace shows both to its readers)."""
        secret = sorted(k for k, v in run.env.items() if is_secret(k, v))
        secret += sorted(k for k, v in run.parameters.items() if is_secret_value(v))
        if secret:
            where = "`env:`" if secret[0] in run.env else "its parameters"
            raise BackendError(
                f"run {run.run_id} sets `{secret[0]}` in {where}, which looks like a secret (by its name or value); "
                "on Azure ML a run's settings are part of the job's command and code, visible in the studio and "
                "the job's history, so they must hold no secrets. Keep secrets in a workspace connection or Key Vault "
                "and read them from the notebook"
            )
        # Azure ML sets MLflow's URI and the run token in every job: its kernels track only when asked (`tracking:`)
        remote = dataclasses.replace(run, notebook=run.notebook_rel, tracking=run.tracking or "none",
                                     cwd=run.cwd if run.cwd and not Path(run.cwd).is_absolute() else None)
        mounted = self.settings.share_mode == "mount"
        spec = LaunchSpec(run=remote, share=SHARE_BINDING if mounted else share_url, backend=self.name,
                          gpus=tuple(range(run.gpus)), inputs={name: f"${{{{inputs.{name}}}}}" for name in run.inputs})
        return JobLaunch(spec, frozenset({"inputs", "share"} if mounted else {"inputs"}))

    def _environment_for(self, run: Run, register: bool) -> str:
        key = run.framework or "*"
        environments = self.settings.environments or {}
        if key in environments or "*" in environments:
            return environments.get(key) or environments["*"]
        if not run.framework:
            raise BackendError(f"run {run.run_id} ({run.notebook_rel}) has no framework, so the azureml backend has "
                               "no image for it; set `environments: {'*': azureml:<name>:<version>}` in `backend:`")
        if key in self._environment_refs:
            return self._environment_refs[key]
        root = project_root_of(run)
        framework = get_framework(run.framework, Project(root))
        dockerfiles = Path(self.settings.dockerfiles) if self.settings.dockerfiles else root / "dockerfiles"
        env = framework_environment(framework, dockerfiles, registry=self.settings.registry,
                                    base_mirror=self.settings.base_mirror)
        if not register:
            if self.settings.registry and key not in self._registry_checked:
                check_pushed(framework, dockerfiles, self.settings.registry)
                self._registry_checked.add(key)
            return f"azureml:{env.name}:{env.version}"
        registered = ensure_environment(self.ml_client, framework, dockerfiles, registry=self.settings.registry,
                                        base_mirror=self.settings.base_mirror)
        ref = f"azureml:{registered.name}:{registered.version}"
        self._environment_refs[key] = ref
        return ref

def command_json(value: Mapping[str, Any], bindings: Collection[str] = ()) -> str:
    """``value`` as compact JSON for a job's command, with every ``$`` written ``\\u0024`` except in the entries
    ``bindings`` names, whose ``${{…}}`` Azure ML replaces (the share's mount, the inputs').

    Azure ML reads ``${{…}}`` anywhere in a command as a binding (``${{inputs.x}}``, ``${{outputs.share}}``);
    a parameter holding that text would be taken for one. ``$`` only occurs inside JSON strings, where
    ``\\u0024`` is the same character to any JSON reader, and it means nothing to the shell in quotes.
    """
    entries = (f"{json.dumps(key)}:{json.dumps(item, sort_keys=True, separators=(',', ':'))}" if key in bindings
               else f"{json.dumps(key)}:{_escaped_json(item)}" for key, item in sorted(value.items()))
    return "{" + ",".join(entries) + "}"


def _escaped_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).replace("$", "\\u0024")


def _datastore_path(datastore: str, prefix: str) -> str:
    """A folder of a datastore as Azure ML names it (``azureml://datastores/<name>/paths/<folder>/``; the root: ``./``)."""
    return datastore_path(datastore, prefix)


def _azure_files_location_of(url: str) -> tuple[str, str]:
    location = parse_azfiles_url(url)
    return location.account, location.share


def _input_location(name: str, location: str) -> AzureFilesLocation:
    """Where input ``name`` is, as an Azure Files location; a local folder or another share is refused."""
    if not location.startswith("azfiles://"):
        where = "a folder on this machine" if "://" not in location else "not an Azure File share"
        raise ValidationError(
            f"input `{name}` is {location}, {where}; Azure ML jobs mount their inputs from Azure File shares. Upload it "
            f"once with `nbbatch data push {location} azfiles://<account>/<share>/<folder>` and name that URL in "
            "`inputs:`")
    return parse_azfiles_url(location)


def _azure_files_location(share: Share) -> AzureFilesLocation:
    if isinstance(share, AzureFileShare):
        return share.location
    if str(getattr(share, "url", "")).startswith("azfiles://"):
        return parse_azfiles_url(share.url)
    raise BackendError(
        f"the azureml backend writes results to an Azure File share, but this experiment's share is "
        f"{getattr(share, 'url', share)}; set `share: azfiles://<storage account>/<file share>` in the experiment file"
    )
