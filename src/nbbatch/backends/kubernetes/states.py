"""What a run's Job and pods say about it: why it waits, and how it ended when it wrote no final record itself.

The run records on the share are the truth (run-one writes them in the pod); the cluster's objects only explain
waits (an unschedulable pod: which resource), failures that kill the launcher with its pod (OOMKilled, an image that
cannot be pulled, a pod that never started) and runs whose Job was deleted behind nbbatch's back.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from nbbatch.store.layout import run_paths
from nbbatch.store.runjson import ErrorKind, RunError
from nbbatch.store.share import Share

JOB_FILE = "kubernetes.json"  # in the run's folder: which Job and index run it
PULL_ERRORS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull", "RegistryUnavailable")
CONFIG_ERRORS = ("CreateContainerConfigError", "CreateContainerError", "RunContainerError")


@dataclass(frozen=True)
class KubernetesJob:
    """The Job (and index) of one run, kept next to its files so any machine that sees the share finds it."""

    job: str
    index: int
    namespace: str
    submission: str  # the submission's folder on the share (share-relative)
    submitted_at: str
    context: str | None = None

    @classmethod
    def read(cls, share: Share, experiment: str, run_id: str) -> KubernetesJob | None:
        try:
            data = json.loads(share.read_bytes(run_paths(experiment, run_id).file(JOB_FILE)))
            return cls(**{k: data[k] for k in ("job", "index", "namespace", "submission", "submitted_at", "context")
                          if k in data})
        except (FileNotFoundError, OSError, ValueError, TypeError):
            return None

    def write(self, share: Share, experiment: str, run_id: str) -> None:
        share.write_bytes(run_paths(experiment, run_id).file(JOB_FILE), json.dumps(asdict(self), indent=1).encode())


def indexes(ranges: str | None) -> set[int]:
    """The indexes a Job's ``completedIndexes`` / ``failedIndexes`` name ("0-2,5" → {0, 1, 2, 5})."""
    found: set[int] = set()
    for part in (ranges or "").split(","):
        if "-" in part:
            low, high = part.split("-", 1)
            found.update(range(int(low), int(high) + 1))
        elif part.strip():
            found.add(int(part))
    return found


def pods_of_index(pods: Sequence[Mapping[str, Any]], job: str, index: int) -> list[Mapping[str, Any]]:
    """The pods a Job made for ``index``, oldest first."""
    mine = [p for p in pods if (p["metadata"].get("labels") or {}).get("batch.kubernetes.io/job-name") == job
            and (p["metadata"].get("annotations") or {}).get("batch.kubernetes.io/job-completion-index") == str(index)]
    return sorted(mine, key=lambda p: p["metadata"].get("creationTimestamp") or "")


def _condition(obj: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    return next((c for c in (obj.get("status") or {}).get("conditions") or []
                 if c.get("type") == kind and c.get("status") == "True"), None)


def _terminated(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        state = status.get("state") or {}
        if state.get("terminated"):
            return state["terminated"]
    return None


def _waiting(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        waiting = (status.get("state") or {}).get("waiting")
        if waiting and waiting.get("reason"):
            return waiting
    return None


def _memory_limit(pod: Mapping[str, Any]) -> str:
    for container in (pod.get("spec") or {}).get("containers") or []:
        limit = ((container.get("resources") or {}).get("limits") or {}).get("memory")
        if limit:
            return str(limit)
    return "no limit set"


def evicted(pod: Mapping[str, Any]) -> str | None:
    """Why the pod was disrupted (evicted, preempted, its node drained), or None."""
    disruption = _condition(pod, "DisruptionTarget")
    if disruption is None and (pod.get("status") or {}).get("reason") != "Evicted":
        return None
    said = (disruption or {}).get("message") or (pod.get("status") or {}).get("message") or ""
    why = (disruption or {}).get("reason") or "Evicted"
    return f"{why}" + (f": {said}" if said else "")


def waiting_note(pod: Mapping[str, Any]) -> str | None:
    """Why a pod that has not started waits, in words (None: it does not wait, or for nothing worth saying)."""
    scheduled = next((c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == "PodScheduled"),
                     None)
    if scheduled is not None and scheduled.get("status") == "False":
        return f"waiting for a node: {scheduled.get('message') or scheduled.get('reason') or 'not scheduled yet'}"
    waiting = _waiting(pod)
    if waiting is not None and waiting["reason"] in ("ContainerCreating", "PodInitializing"):
        return "its pod is starting (pulling the image, mounting the share)"
    return None


def start_failure(pod: Mapping[str, Any], registry: str | None) -> RunError | None:
    """A pod that cannot start, ever: its image cannot be pulled, or its container cannot be made."""
    waiting = _waiting(pod)
    if waiting is None:
        return None
    image = next((c.get("image") for c in (pod.get("spec") or {}).get("containers") or []), "?")
    if waiting["reason"] in PULL_ERRORS:
        source = f"from the registry {registry}" if registry else "(no `registry:` is set: the nodes look for it as named)"
        return RunError("ImagePullError", f"{waiting['reason']}: {waiting.get('message') or ''}".strip(),
                        reason=f"the cluster cannot pull the image {image} {source}: push it (`nbbatch images push "
                               "FRAMEWORK --registry REGISTRY`), give the nodes access (`image_pull_secrets:`) or fix "
                               "`registry:`/`images:`", kind=ErrorKind.INFRA)
    if waiting["reason"] in CONFIG_ERRORS:
        return RunError(waiting["reason"], str(waiting.get("message") or ""),
                        reason=f"the cluster cannot start the pod's container (image {image})", kind=ErrorKind.INFRA)
    return None


def ended_without_record(pod: Mapping[str, Any] | None, job: str, index: int, log_tail: str = "") -> RunError:
    """Why a run whose index failed (or whose pod ended) left no final record: killed for memory, evicted, or its
    launcher's exit code, with the end of the pod's log."""
    tail = f"; its log ends with: {log_tail.strip()[-1500:]}" if log_tail.strip() else ""
    if pod is None:
        return RunError("PodLost", f"Job {job} has no pod left for index {index}{tail}",
                        reason="the run's pod is gone without the run's final record", kind=ErrorKind.INFRA)
    name = pod["metadata"]["name"]
    terminated = _terminated(pod) or {}
    if terminated.get("reason") == "OOMKilled":
        return RunError("OOMKilled", f"pod {name}: the container was killed at its memory limit ({_memory_limit(pod)})"
                        f"{tail}", reason="out of memory: raise the backend's `memory:` (each run's request and limit)",
                        kind=ErrorKind.INFRA)
    disrupted = evicted(pod)
    if disrupted:
        return RunError("PodEvicted", f"pod {name}: {disrupted}{tail}",
                        reason="the cluster evicted the run's pod, and it was not replaced", kind=ErrorKind.INFRA)
    code = terminated.get("exitCode")
    said = f"exit code {code}" + (f" ({terminated['reason']})" if terminated.get("reason") else "") \
        if code is not None else f"phase {(pod.get('status') or {}).get('phase') or '?'}"
    return RunError("PodFailed", f"pod {name} ended with {said} without the run's final record{tail}",
                    reason="the run's launcher stopped before recording how the run ended", kind=ErrorKind.INFRA)


def job_deleted(job: str) -> RunError:
    return RunError("JobDeleted", f"Job {job} was deleted before the run wrote its final record",
                    reason="its Job is gone (kubectl delete, or the namespace's cleanup)", kind=ErrorKind.INFRA)


__all__ = ["JOB_FILE", "KubernetesJob", "ended_without_record", "evicted", "indexes", "job_deleted", "pods_of_index",
           "start_failure", "waiting_note"]
