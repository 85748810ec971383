"""The cluster behind the fake API server: the Job controller, the garbage collector, events, and the loop that
hands pods to a kubelet (:mod:`fakes.kubernetes_kubelets`).

One background thread reacts to every write. The Job controller follows pkg/controller/job (v1.31 unless the server's
version says otherwise): pods carry the ``batch.kubernetes.io/job-tracking`` finalizer until their end is counted;
an Indexed Job runs the lowest pending indexes while fewer than ``parallelism`` are active (none while suspended);
failures go through ``podFailurePolicy`` (rules in order: ``FailJob``, ``FailIndex``, ``Ignore``, ``Count``), then
``backoffLimitPerIndex`` and ``backoffLimit``; from v1.31 ``FailureTarget`` / ``SuccessCriteriaMet`` come first and
``Failed`` / ``Complete`` once no pod runs. Pods are created through the API, so quota, LimitRange and priority judge
them: a refusal is a ``FailedCreate`` Warning event on the Job, retried with a growing pause. Simplification: failed
pods are replaced at once (the real controller waits 10 s, doubling).

The garbage collector deletes objects whose owners are all gone, the dependents of an object deleted in the
foreground (then lets it go), and orphans the dependents of one deleted with ``Orphan``.
"""

from __future__ import annotations

import copy
import threading
import time
import traceback
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Protocol

from fakes.kubernetes_jobs import (
    COMPLETION_INDEX,
    TRACKING_FINALIZER,
    format_indexes,
    parse_indexes,
    pod_for_index,
)
from fakes.kubernetes_rules import ApiError, now, parse_time
from fakes.kubernetes_server import FOREGROUND, ORPHAN, ApiCore
from fakes.kubernetes_store import RESOURCES

CONTROLLER = "job-controller"
MAX_CREATE_PAUSE = 5.0


class Kubelet(Protocol):
    """What runs the pods: told when a pod is to start and when it is to stop."""

    def attach(self, cluster: Cluster) -> None: ...
    def start_pod(self, pod: dict[str, Any]) -> None: ...
    def stop_pod(self, pod: dict[str, Any], grace_seconds: float) -> None: ...
    def close(self) -> None: ...


@dataclass
class JobMemory:
    """What the controller remembers of one Job between syncs."""

    failures: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    ignored: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    create_pause: float = 0.0
    create_after: float = 0.0
    removed: set[str] = field(default_factory=set)  # pods the controller deleted itself (not failures)


def pod_index(pod: dict[str, Any]) -> int | None:
    meta = pod["metadata"]
    text = (meta.get("labels") or {}).get(COMPLETION_INDEX) or (meta.get("annotations") or {}).get(COMPLETION_INDEX)
    return int(text) if text is not None else None


def is_terminal(pod: dict[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def condition_true(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in (obj.get("status") or {}).get("conditions") or []
                 if c["type"] == kind and c["status"] == "True"), None)


def set_condition(status: dict[str, Any], kind: str, value: str, reason: str = "", message: str = "") -> bool:
    """Add or change a condition; False when it already says so."""
    conditions = status.setdefault("conditions", [])
    for condition in conditions:
        if condition["type"] == kind:
            if condition["status"] == value:
                return False
            condition.update(status=value, reason=reason, message=message, lastProbeTime=now(),
                             lastTransitionTime=now())
            return True
    entry = {"type": kind, "status": value, "lastProbeTime": now(), "lastTransitionTime": now()}
    if reason:
        entry["reason"] = reason
    if message:
        entry["message"] = message
    conditions.append(entry)
    return True


def failure_rule(spec: dict[str, Any], pod: dict[str, Any]) -> tuple[str, str] | None:
    """The action of the first ``podFailurePolicy`` rule a failed pod matches, and the controller's message for it."""
    meta = pod["metadata"]
    who = f"{meta['namespace']}/{meta['name']}"
    status = pod.get("status") or {}
    for i, rule in enumerate((spec.get("podFailurePolicy") or {}).get("rules") or []):
        action = rule.get("action")
        codes = rule.get("onExitCodes")
        if codes:
            for container in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
                if codes.get("containerName") not in (None, container["name"]):
                    continue
                ended = ((container.get("state") or {}).get("terminated") or {})
                code = ended.get("exitCode", 0)
                if code and (code in codes["values"]) == (codes["operator"] == "In"):
                    return action, (f"Container {container['name']} for pod {who} failed with exit code {code} "
                                    f"matching {action} rule at index {i}")
        for pattern in rule.get("onPodConditions") or []:
            for condition in status.get("conditions") or []:
                if condition["type"] == pattern["type"] and condition["status"] == pattern.get("status", "True"):
                    return action, f"Pod {who} has condition {pattern['type']} matching {action} rule at index {i}"
    return None


class Cluster:
    """The controllers and the node of the fake cluster, over an :class:`ApiCore`; ``errors`` collects the
    tracebacks of a failing sync (the fake raises them when it stops, so that a broken fake fails its test)."""

    def __init__(self, core: ApiCore, kubelet: Kubelet, node: str = "fake-node"):
        self.core = core
        self.store = core.store
        self.minor = core.minor
        self.kubelet = kubelet
        self.node = node
        self.errors: list[str] = []
        self.memory: dict[str, JobMemory] = {}
        self._started: set[str] = set()
        self._stopping: set[str] = set()
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fake-kubernetes-cluster", daemon=True)
        kubelet.attach(self)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._halt.set()
        self.store.close()
        self._thread.join(timeout=10)
        self.kubelet.close()

    def _loop(self) -> None:
        seen = -1
        while not self._halt.is_set():
            with self.store.changed:
                if self.store.rv == seen:
                    self.store.changed.wait(0.2)  # a timer for deadlines and creation pauses
            if self._halt.is_set():
                return
            try:
                self.sync()
            except Exception:  # recorded for the test to see; the loop goes on
                self.errors.append(traceback.format_exc())
            seen = self.store.rv

    def sync(self) -> None:
        self.collect_garbage()
        for job in self.store.list("jobs"):
            JobSync(self, job).run()
        self._release_orphans()
        self._drive_kubelet()

    # ------------------------------------------------------------------------------------------------ events
    def record_event(self, obj: dict[str, Any], kind: str, reason: str, message: str,
                     component: str = CONTROLLER) -> None:
        """An Event about ``obj``; a repeat of the same one bumps its count, as the event recorder does."""
        meta = obj["metadata"]
        namespace = meta.get("namespace", "default")
        with self.store.lock:
            for event in self.store.list("events", namespace):
                if (event["involvedObject"].get("uid") == meta.get("uid") and event["reason"] == reason
                        and event["message"] == message):
                    event["count"] += 1
                    event["lastTimestamp"] = now()
                    self.store.put("events", event)
                    return
            stamp = now()
            self.store.put("events", {
                "apiVersion": "v1", "kind": "Event",
                "metadata": {"name": f"{meta['name']}.{time.time_ns():x}", "namespace": namespace,
                             "uid": str(uuid.uuid4()), "creationTimestamp": stamp},
                "involvedObject": {"apiVersion": obj.get("apiVersion", "v1"), "kind": obj.get("kind", ""),
                                   "name": meta["name"], "namespace": namespace, "uid": meta.get("uid"),
                                   "resourceVersion": meta.get("resourceVersion")},
                "reason": reason, "message": message, "type": kind, "count": 1, "firstTimestamp": stamp,
                "lastTimestamp": stamp, "source": {"component": component},
                "reportingComponent": component, "reportingInstance": ""})

    # ------------------------------------------------------------------------------------- garbage collector
    def _all_objects(self) -> list[tuple[str, dict[str, Any]]]:
        return [(plural, obj) for plural in RESOURCES if plural not in ("events", "namespaces")
                for obj in self.store.list(plural)]

    def collect_garbage(self) -> None:
        objects = self._all_objects()
        alive = {obj["metadata"]["uid"] for _plural, obj in objects}
        dependents: dict[str, list[tuple[str, dict[str, Any]]]] = defaultdict(list)
        for plural, obj in objects:
            owners = obj["metadata"].get("ownerReferences") or []
            for owner in owners:
                dependents[owner["uid"]].append((plural, obj))
            if owners and not any(o["uid"] in alive for o in owners) and not obj["metadata"].get("deletionTimestamp"):
                self._delete(plural, obj)
        for plural, obj in objects:
            meta = obj["metadata"]
            finalizers = meta.get("finalizers") or []
            if not meta.get("deletionTimestamp"):
                continue
            if FOREGROUND in finalizers:
                waiting = [d for d in dependents[meta["uid"]] if self.store.get(d[0], d[1]["metadata"]["namespace"],
                                                                               d[1]["metadata"]["name"])]
                for dep_plural, dependent in waiting:
                    if not dependent["metadata"].get("deletionTimestamp"):
                        self._delete(dep_plural, dependent)
                if not waiting:
                    self.core.remove_finalizer(plural, meta.get("namespace", ""), meta["name"], FOREGROUND)
            if ORPHAN in finalizers:
                for dep_plural, dependent in dependents[meta["uid"]]:
                    dep_meta = dependent["metadata"]
                    self.store.update(dep_plural, dep_meta["namespace"], dep_meta["name"], lambda o, uid=meta["uid"]: (
                        o["metadata"].__setitem__("ownerReferences", [r for r in o["metadata"].get("ownerReferences")
                                                                      or [] if r["uid"] != uid])))
                self.core.remove_finalizer(plural, meta.get("namespace", ""), meta["name"], ORPHAN)

    def _delete(self, plural: str, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        try:
            self.core.delete(plural, meta.get("namespace", ""), meta["name"], {"propagationPolicy": "Background"})
        except ApiError:  # gone meanwhile
            pass

    def _release_orphans(self) -> None:
        """Drop the tracking finalizer of pods whose Job is gone (the Job controller's orphan handling)."""
        jobs = {job["metadata"]["uid"] for job in self.store.list("jobs")}
        for pod in self.store.list("pods"):
            meta = pod["metadata"]
            owned = [r["uid"] for r in meta.get("ownerReferences") or [] if r.get("kind") == "Job"]
            if TRACKING_FINALIZER in (meta.get("finalizers") or []) and not any(uid in jobs for uid in owned):
                self.core.remove_finalizer("pods", meta["namespace"], meta["name"], TRACKING_FINALIZER)

    # --------------------------------------------------------------------------------------------- the node
    def _drive_kubelet(self) -> None:
        for pod in self.store.list("pods"):
            uid = pod["metadata"]["uid"]
            if uid not in self._started and not is_terminal(pod):
                self._started.add(uid)
                self.kubelet.start_pod(pod)
            if pod["metadata"].get("deletionTimestamp") and uid not in self._stopping:
                self._stopping.add(uid)
                self.kubelet.stop_pod(pod, float(pod["metadata"].get("deletionGracePeriodSeconds") or 0))
            self.core.settle("pods", pod["metadata"]["namespace"], pod["metadata"]["name"])


class JobSync:
    """One pass of the Job controller over one Job."""

    def __init__(self, cluster: Cluster, job: dict[str, Any]):
        self.cluster, self.core, self.job = cluster, cluster.core, job
        self.meta, self.spec = job["metadata"], job["spec"]
        self.status: dict[str, Any] = copy.deepcopy(job.get("status") or {})
        self.memory = cluster.memory.setdefault(self.meta["uid"], JobMemory())
        self.indexed = self.spec.get("completionMode") == "Indexed"
        self.only_failed = (self.spec.get("podReplacementPolicy") == "Failed"
                            or self.spec.get("podFailurePolicy") is not None)
        self.pods = [p for p in cluster.store.list("pods", self.meta["namespace"])
                     if any(r["uid"] == self.meta["uid"] for r in p["metadata"].get("ownerReferences") or [])]
        self.completed = parse_indexes(self.status.get("completedIndexes"))
        self.failed_indexes = parse_indexes(self.status.get("failedIndexes"))
        self.fail_job: tuple[str, str] | None = None

    def run(self) -> None:
        before = self.job.get("status") or {}
        self.count_ended_pods()
        if not self.meta.get("deletionTimestamp") and not self.finished():
            self.decide()
        self.write_counts()
        if self.status != before:
            self.cluster.store.update("jobs", self.meta["namespace"], self.meta["name"],
                                      lambda obj: obj.__setitem__("status", self.status))

    def finished(self) -> bool:
        return bool(condition_true(self.job, "Complete") or condition_true(self.job, "Failed"))

    @property
    def active(self) -> list[dict[str, Any]]:
        return [p for p in self.pods if not is_terminal(p) and not p["metadata"].get("deletionTimestamp")]

    @property
    def terminating(self) -> list[dict[str, Any]]:
        return [p for p in self.pods if not is_terminal(p) and p["metadata"].get("deletionTimestamp")]

    def count_ended_pods(self) -> None:
        for pod in self.pods:
            meta = pod["metadata"]
            if TRACKING_FINALIZER not in (meta.get("finalizers") or []):
                continue
            phase = (pod.get("status") or {}).get("phase")
            index = pod_index(pod)
            if phase == "Succeeded":
                if not self.indexed:
                    self.status["succeeded"] = self.status.get("succeeded", 0) + 1
                elif index not in self.failed_indexes:
                    self.completed.add(index)
            elif phase == "Failed" or (meta.get("deletionTimestamp") and not self.only_failed):
                self.count_failure(pod, index)
            else:
                continue
            self.core.remove_finalizer("pods", meta["namespace"], meta["name"], TRACKING_FINALIZER)

    def count_failure(self, pod: dict[str, Any], index: int | None) -> None:
        if pod["metadata"]["uid"] in self.memory.removed:
            return  # stopped by the controller (suspension, scale down, the Job's end), not failed
        matched = failure_rule(self.spec, pod) if self.spec.get("podFailurePolicy") else None
        action = matched[0] if matched else "Count"
        if action == "Ignore":
            if index is not None:
                self.memory.ignored[index] += 1
            return
        self.status["failed"] = self.status.get("failed", 0) + 1
        if action == "FailJob":
            self.fail_job = ("PodFailurePolicy", matched[1])
        elif action == "FailIndex" and index is not None:
            self.failed_indexes.add(index)
        elif self.spec.get("backoffLimitPerIndex") is not None and index is not None:
            self.memory.failures[index] += 1
            if self.memory.failures[index] > self.spec["backoffLimitPerIndex"]:
                self.failed_indexes.add(index)

    def failure(self) -> tuple[str, str] | None:
        spec, status = self.spec, self.status
        if self.fail_job:
            return self.fail_job
        if status.get("failed", 0) > spec.get("backoffLimit", 6):
            return "BackoffLimitExceeded", "Job has reached the specified backoff limit"
        if spec.get("maxFailedIndexes") is not None and len(self.failed_indexes) > spec["maxFailedIndexes"]:
            return "MaxFailedIndexesExceeded", "Job has exceeded the specified maximal number of failed indexes"
        deadline = spec.get("activeDeadlineSeconds")
        if deadline is not None and status.get("startTime") and \
                time.time() - parse_time(status["startTime"]).timestamp() > deadline:
            return "DeadlineExceeded", "Job was active longer than specified deadline"
        if (self.indexed and self.failed_indexes
                and len(self.completed | self.failed_indexes) >= (spec.get("completions") or 0)):
            return "FailedIndexes", "Job has failed indexes"
        return None

    def succeeded(self) -> bool:
        completions = self.spec.get("completions")
        if self.indexed:
            return len(self.completed) >= completions
        done = self.status.get("succeeded", 0)
        return done >= completions if completions is not None else done > 0 and not self.active

    def decide(self) -> None:
        status, late = self.status, self.cluster.minor >= 31
        target = condition_true(self.job, "FailureTarget") or condition_true(self.job, "SuccessCriteriaMet")
        if not target and (failure := self.failure()):
            if late or failure[0] == "PodFailurePolicy":
                set_condition(status, "FailureTarget", "True", *failure)
            self.cluster.record_event(self.job, "Warning", *failure)
            target = {"type": "FailureTarget", "reason": failure[0], "message": failure[1]}
            if not late:
                set_condition(status, "Failed", "True", *failure)
        elif not target and self.succeeded():
            target = {"type": "SuccessCriteriaMet", "reason": "CompletionsReached",
                      "message": "Reached expected number of succeeded pods"}
            if late:
                set_condition(status, "SuccessCriteriaMet", "True", target["reason"], target["message"])
            else:
                self.complete(None)
        if target:
            for pod in self.active:
                self.delete_pod(pod)
            if late and not self.active and not self.terminating:
                if target["type"] == "FailureTarget":
                    set_condition(status, "Failed", "True", target["reason"], target["message"])
                else:
                    self.complete(target)
            return
        if self.spec.get("suspend"):
            for pod in self.active:
                self.delete_pod(pod)
            if set_condition(status, "Suspended", "True", "JobSuspended", "Job suspended"):
                self.cluster.record_event(self.job, "Normal", "Suspended", "Job suspended")
            status.pop("startTime", None)
            return
        if condition_true(self.job, "Suspended") and set_condition(status, "Suspended", "False", "JobResumed",
                                                                   "Job resumed"):
            self.cluster.record_event(self.job, "Normal", "Resumed", "Job resumed")
        status.setdefault("startTime", now())
        self.scale()

    def complete(self, target: dict[str, Any] | None) -> None:
        reason, message = (target["reason"], target["message"]) if target else ("", "")
        set_condition(self.status, "Complete", "True", reason, message)
        self.status["completionTime"] = now()
        self.cluster.record_event(self.job, "Normal", "Completed", "Job completed")

    def scale(self) -> None:
        """Create pods for the lowest pending indexes (or plain pods) up to ``parallelism``; remove surplus ones."""
        parallelism, completions = self.spec.get("parallelism", 1), self.spec.get("completions")
        if self.indexed:  # an elastic Indexed Job scaled down: indexes past completions go
            for pod in [p for p in self.active if (pod_index(p) or 0) >= completions]:
                self.delete_pod(pod)
        active = self.active
        for pod in sorted(active, key=lambda p: -(pod_index(p) or 0))[:max(0, len(active) - parallelism)]:
            self.delete_pod(pod)
        active = self.active
        room = parallelism - len(active)
        if room <= 0 or time.monotonic() < self.memory.create_after:
            return
        if self.indexed:
            busy = {pod_index(p) for p in active}
            if self.only_failed:
                busy |= {pod_index(p) for p in self.terminating}
            pending = [i for i in range(completions)
                       if i not in self.completed and i not in self.failed_indexes and i not in busy]
            wanted = [pod_for_index(self.job, i, failures=self.memory.failures[i],
                                    ignored_failures=self.memory.ignored[i], index_label=self.cluster.minor >= 28)
                      for i in pending[:room]]
        else:
            left = room if completions is None else completions - self.status.get("succeeded", 0) - len(active)
            if self.only_failed:
                left -= len(self.terminating)
            wanted = [self.plain_pod() for _ in range(max(0, min(room, left)))]
        for pod in wanted:
            pod["metadata"]["finalizers"] = [TRACKING_FINALIZER]
            try:
                created, _ = self.core.create("pods", self.meta["namespace"], pod)
            except ApiError as error:
                self.cluster.record_event(self.job, "Warning", "FailedCreate", f"Error creating: {error}")
                self.memory.create_pause = min(MAX_CREATE_PAUSE, max(0.2, self.memory.create_pause * 2))
                self.memory.create_after = time.monotonic() + self.memory.create_pause
                return
            self.memory.create_pause = 0.0
            self.pods.append(created)
            self.cluster.record_event(self.job, "Normal", "SuccessfulCreate",
                                      f"Created pod: {created['metadata']['name']}")

    def plain_pod(self) -> dict[str, Any]:
        """A pod of a NonIndexed Job: the template, the Job's labels and owner, a name generated from the Job's."""
        pod = pod_for_index(self.job, 0)
        meta = pod["metadata"]
        for section in ("labels", "annotations"):
            meta[section].pop(COMPLETION_INDEX, None)
        del meta["name"]
        meta["generateName"] = self.meta["name"] + "-"
        pod["spec"] = copy.deepcopy((self.spec.get("template") or {}).get("spec") or {})
        return pod

    def delete_pod(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        self.memory.removed.add(meta["uid"])
        try:
            self.core.delete("pods", meta["namespace"], meta["name"])
        except ApiError:
            return
        pod["metadata"]["deletionTimestamp"] = now()
        self.cluster.record_event(self.job, "Normal", "SuccessfulDelete", f"Deleted pod: {meta['name']}")

    def write_counts(self) -> None:
        status, active = self.status, self.active
        for key, value in (("active", len(active)), ("succeeded", len(self.completed) if self.indexed else None)):
            if value is not None:
                if value:
                    status[key] = value
                else:
                    status.pop(key, None)
        status["ready"] = sum(1 for p in active if condition_true(p, "Ready"))
        if self.cluster.minor >= 29:
            status["terminating"] = len(self.terminating)
        if self.indexed:
            status["completedIndexes"] = format_indexes(self.completed)
            if self.spec.get("backoffLimitPerIndex") is not None:
                status["failedIndexes"] = format_indexes(self.failed_indexes)
        status["uncountedTerminatedPods"] = {}
