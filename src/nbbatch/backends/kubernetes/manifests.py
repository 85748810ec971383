"""What nbbatch asks a Kubernetes cluster for, as plain manifests: one Indexed Job per group of runs of one shape, one
Indexed Job of N pods and a headless Service per distributed run. Pure functions: no client, no cluster.

Every pod runs its framework's image and the same node launcher as every backend, ``nbbatch run-one`` on the launch
of its index, which lies on the share (``<experiment>/.kubernetes/<submission>/<job>/specs/<index>.json``; the
share is a volume mounted at :data:`SHARE_MOUNT`). Kubernetes names are DNS-1123 labels and label values of at most
63 characters: :func:`job_name` and :func:`label_value` make them from an experiment's name, which may be anything.
"""

from __future__ import annotations

import hashlib
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nbbatch.execute.launch import RUN_ONE_NOT_DONE, launch_shell_command, shell_launcher
from nbbatch.plan.runs import Run

SHARE_MOUNT = "/mnt/nbbatch/share"  # where every pod sees the share
SUBMISSIONS = ".kubernetes"  # in the experiment's folder on the share: one folder per submission
CONTAINER = "run"  # the pod's one container
RENDEZVOUS_PORT = 29500  # a gang's rank 0 listens here (torchrun's default)
MANAGED_BY = "app.kubernetes.io/managed-by"
EXPERIMENT_LABEL = "nbbatch.io/experiment"
SUBMISSION_LABEL = "nbbatch.io/submission"
EXPERIMENT_ANNOTATION = "nbbatch.io/experiment"  # the experiment's name as written (a label value may not hold it)
INDEX_LABEL = "batch.kubernetes.io/job-completion-index"  # set by the Job controller on each pod
JOB_LABEL = "batch.kubernetes.io/job-name"  # the same
FINISHED_TTL_S = 86400  # a finished Job (and its pods' logs) stays a day for `kubectl logs`, then goes
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_QUANTITY = re.compile(r"^(\d+(\.\d*)?|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?\d+)?$")


def is_quantity(value: object) -> bool:
    """Whether ``value`` is a Kubernetes resource quantity (``500m``, ``2``, ``4Gi``, ``1.5``)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 or \
        isinstance(value, str) and bool(_QUANTITY.match(value))


def _slug(text: str, size: int) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:size].strip("-")
    return slug or "x"


def _digest(text: str, size: int = 6) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:size]


def label_value(text: str) -> str:
    """``text`` as a label value: itself when Kubernetes allows it, else a readable slug and a hash of it."""
    if len(text) <= 63 and _LABEL_VALUE.match(text):
        return text
    return f"{_slug(text, 56)}-{_digest(text)}"


def job_name(experiment: str, submission: str, part: int) -> str:
    """The name of a submission's ``part``-th Job: a DNS-1123 label of at most 47 characters, so that its pods'
    names (``<job>-<index>-<5 characters>``) and host names stay within 63."""
    return f"nb-{_slug(experiment, 24)}-{submission}-{part}"


def experiment_selector(experiment: str) -> str:
    """The label selector of every Job and pod of ``experiment``."""
    return f"{MANAGED_BY}=nbbatch,{EXPERIMENT_LABEL}={label_value(experiment)}"


@dataclass(frozen=True)
class PodShape:
    """What one pod of a Job asks for: runs of one shape share a Job."""

    image: str
    gpus: int = 0
    cpu: str | None = None  # requests.cpu (None: the namespace's LimitRange default)
    memory: str | None = None  # requests.memory and limits.memory (None: as cpu)
    retries: int = 0  # pod failures an index may have before it fails (OOMKilled, a crash)


@dataclass(frozen=True)
class PodSettings:
    """What every pod of the backend gets (the backend's settings, as the cluster takes them)."""

    namespace: str
    share_volume: Mapping[str, Any]  # a pod volume's source, e.g. {"persistentVolumeClaim": {"claimName": "results"}}
    share_sub_path: str = ""
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: Sequence[Mapping[str, Any]] = ()
    priority_class: str | None = None
    service_account: str | None = None
    image_pull_secrets: Sequence[str] = ()
    run_as_user: int | None = None
    fs_group: int | None = None
    termination_grace_s: int = 30
    env: Mapping[str, str] = field(default_factory=dict)
    python: str = "python"  # nbbatch's interpreter in the image (the image's PATH finds its venv)


def launch_folder(experiment_folder: str, submission: str, job: str) -> str:
    """A Job's folder on the share (share-relative): its runs' launches under ``specs/``."""
    return f"{experiment_folder}/{SUBMISSIONS}/{submission}/{job}"


def project_folder(experiment_folder: str, submission: str) -> str:
    """A submission's copy of the runs' notebooks on the share (share-relative): the project the pods see."""
    return f"{experiment_folder}/{SUBMISSIONS}/{submission}/project"


def in_pod(share_relative: str) -> str:
    """Where a share-relative path is inside a pod."""
    return f"{SHARE_MOUNT}/{share_relative}" if share_relative else SHARE_MOUNT


def labels(experiment: str, submission: str) -> dict[str, str]:
    return {MANAGED_BY: "nbbatch", EXPERIMENT_LABEL: label_value(experiment), SUBMISSION_LABEL: submission}


def _as_written(value: str) -> str:
    """``value`` escaped for a container's env value: Kubernetes expands ``$(VAR)`` there and makes ``$$`` one ``$``
    (``$$`` escapes both), so a value reaches the pod as the user wrote it, as on every backend."""
    return value.replace("$", "$$")


def _command(python: str, launch: str, gang: bool) -> list[str]:
    """The container's command: run-one on ``launch`` (a shell word). Kubernetes tells a pod its index in
    ``JOB_COMPLETION_INDEX``; a gang's node takes it as its rank (nbbatch's own ``NBBATCH_NODE_RANK``)."""
    node = 'export NBBATCH_NODE_RANK="${JOB_COMPLETION_INDEX}"; ' if gang else ""
    return ["/bin/sh", "-c", node + "exec " + launch_shell_command(shell_launcher(python), launch)]


def _resources(shape: PodShape) -> dict[str, Any]:
    requests: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    if shape.cpu is not None:
        requests["cpu"] = str(shape.cpu)
    if shape.memory is not None:  # memory is not compressible: the limit is the request, so OOMKilled names it
        requests["memory"] = limits["memory"] = str(shape.memory)
    if shape.gpus:
        limits["nvidia.com/gpu"] = str(shape.gpus)
    return {k: v for k, v in (("requests", requests), ("limits", limits)) if v}


def pod_template(shape: PodShape, settings: PodSettings, launch: str, meta_labels: Mapping[str, str],
                 gang: str | None = None) -> dict[str, Any]:
    """The pod of every index: the image, run-one on ``launch`` (a shell word: the index's launch file in the pod),
    the share and a memory-backed /dev/shm (data loaders' shared memory), the user's placement settings."""
    env = [{"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {
        "fieldPath": f"metadata.annotations['{INDEX_LABEL}']"}}}]
    env += [{"name": k, "value": _as_written(str(v))} for k, v in sorted(settings.env.items())]
    if gang is not None:
        env.append({"name": "NBBATCH_ENDPOINTS", "value": gang})
    mount = {"name": "share", "mountPath": SHARE_MOUNT}
    if settings.share_sub_path:
        mount["subPath"] = settings.share_sub_path
    container = {"name": CONTAINER, "image": shape.image, "imagePullPolicy": "IfNotPresent",
                 "command": _command(settings.python, launch, gang is not None), "env": env,
                 "volumeMounts": [mount, {"name": "dshm", "mountPath": "/dev/shm"}]}
    if resources := _resources(shape):
        container["resources"] = resources
    spec: dict[str, Any] = {
        "restartPolicy": "Never", "containers": [container],
        "terminationGracePeriodSeconds": settings.termination_grace_s,
        "volumes": [{"name": "share", **settings.share_volume}, {"name": "dshm", "emptyDir": {"medium": "Memory"}}]}
    security = {k: v for k, v in (("runAsUser", settings.run_as_user), ("fsGroup", settings.fs_group)) if v is not None}
    if security:
        spec["securityContext"] = security
    for key, value in (("nodeSelector", dict(settings.node_selector)), ("tolerations", list(settings.tolerations)),
                       ("priorityClassName", settings.priority_class),
                       ("serviceAccountName", settings.service_account),
                       ("imagePullSecrets", [{"name": s} for s in settings.image_pull_secrets])):
        if value:
            spec[key] = value
    if gang is not None:
        spec["subdomain"] = gang_service_name(gang)
    return {"metadata": {"labels": dict(meta_labels)}, "spec": spec}


def gang_service_name(endpoints: str) -> str:
    """The headless Service of a gang, from its endpoints (``<job>-0.<job>:<port>,…``): named as its Job."""
    return endpoints.split(",")[0].split(":")[0].split(".", 1)[1]


def gang_endpoints(job: str, nodes: int) -> str:
    """``NBBATCH_ENDPOINTS`` of a gang's pods: each index's DNS name under the gang's headless Service."""
    return ",".join(f"{job}-{i}.{job}:{RENDEZVOUS_PORT}" for i in range(nodes))


def sweep_job(name: str, experiment: str, submission: str, runs: Sequence[Run], shape: PodShape,
              settings: PodSettings, launches: str, parallelism: int | None, per_index: bool) -> dict[str, Any]:
    """The Indexed Job of ``runs`` (index ``i`` runs ``runs[i]``), at most ``parallelism`` pods at once.

    ``per_index`` (servers that keep ``backoffLimitPerIndex``): a run that run-one recorded as failed or cancelled
    fails its index alone, never retried; a pod that died otherwise (OOMKilled, a crash) is retried up to
    ``shape.retries`` times; an evicted or preempted pod is replaced without counting (the run resumes from its
    checkpoint). Older servers: pod deaths count against the Job's ``backoffLimit`` (the sum of the runs' retries)."""
    meta = labels(experiment, submission)
    count = len(runs)
    rules: list[dict[str, Any]] = [{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget",
                                                                             "status": "True"}]}]
    spec: dict[str, Any] = {"completionMode": "Indexed", "completions": count,
                            "parallelism": min(parallelism or count, count), "ttlSecondsAfterFinished": FINISHED_TTL_S}
    if per_index:
        rules.append({"action": "FailIndex", "onExitCodes": {"containerName": CONTAINER, "operator": "In",
                                                             "values": [RUN_ONE_NOT_DONE]}})
        spec["backoffLimitPerIndex"] = shape.retries
    else:
        spec["backoffLimit"] = shape.retries * count
    spec["podFailurePolicy"] = {"rules": rules}
    spec["template"] = pod_template(shape, settings, f'{shlex.quote(launches)}/"${{JOB_COMPLETION_INDEX}}".json', meta)
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "namespace": settings.namespace, "labels": meta,
                         "annotations": {EXPERIMENT_ANNOTATION: experiment}},
            "spec": spec}


def gang_job(name: str, experiment: str, submission: str, run: Run, shape: PodShape, settings: PodSettings,
             launches: str) -> dict[str, Any]:
    """The Indexed Job of one distributed run: one pod per node, all at once; a failed pod fails the gang (its
    ranks are stopped by nbbatch's gang, the run's record names the rank). Index ``i`` is node ``i``; every node
    reads the run's one launch (``0.json``)."""
    assert run.distribution is not None
    nodes = run.distribution.nodes
    meta = labels(experiment, submission)
    template = pod_template(shape, settings, shlex.quote(f"{launches}/0.json"), meta, gang=gang_endpoints(name, nodes))
    container = template["spec"]["containers"][0]
    container["ports"] = [{"name": "rendezvous", "containerPort": RENDEZVOUS_PORT}]
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "namespace": settings.namespace, "labels": meta,
                         "annotations": {EXPERIMENT_ANNOTATION: experiment}},
            "spec": {"completionMode": "Indexed", "completions": nodes, "parallelism": nodes, "backoffLimit": 0,
                     "ttlSecondsAfterFinished": FINISHED_TTL_S, "template": template}}


def gang_service(job: Mapping[str, Any]) -> dict[str, Any]:
    """The headless Service that gives a gang's pods their DNS names (``<job>-<index>.<job>``), ready or not, owned
    by the Job (it goes with it); ``ownerReferences`` needs the Job's uid, so it is made after the Job."""
    name, meta = job["metadata"]["name"], job["metadata"]
    owner = {"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": meta.get("uid", ""),
             "controller": False, "blockOwnerDeletion": False}
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": meta["namespace"], "labels": dict(meta["labels"]),
                         **({"ownerReferences": [owner]} if meta.get("uid") else {})},
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {JOB_LABEL: name},
                     "ports": [{"name": "rendezvous", "port": RENDEZVOUS_PORT}]}}


def check_pod(job: Mapping[str, Any]) -> dict[str, Any]:
    """A pod as the Job's controller would make it, for the server's dry run: quota, LimitRange, priority classes and
    admission webhooks judge pods, not Jobs (a Job they would refuse is accepted, and its pods are never made)."""
    template = job["spec"]["template"]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{job['metadata']['name']}-0-check", "namespace": job["metadata"]["namespace"],
                         "labels": dict(template["metadata"]["labels"]),
                         "annotations": {INDEX_LABEL: "0"}},
            "spec": template["spec"]}


__all__ = ["CONTAINER", "SHARE_MOUNT", "SUBMISSIONS", "PodSettings", "PodShape", "check_pod", "experiment_selector",
           "gang_job", "gang_service", "in_pod", "is_quantity", "job_name", "label_value", "launch_folder",
           "project_folder", "sweep_job"]
