"""Kubelets for the fake cluster: one plays a script per pod, the other runs the pod's container as a local process.

Both report pod status as the real kubelet does (``PodScheduled`` / ``Initialized`` / ``ContainersReady`` /
``Ready`` / ``PodReadyToStartContainers`` conditions, ``containerStatuses[].state`` waiting / running / terminated,
``podIP``, ``startTime``, the phase) and write the events a cluster shows (``Scheduled``, ``FailedScheduling``,
``Pulling``, ``Failed``, ``BackOff``, ``Started``, ``Killing``).

:class:`ScriptedKubelet` takes a function ``pod -> [steps]`` (or one list for every pod): :class:`Pending`,
:class:`ImagePullError`, :class:`Running`, :class:`Log`, :class:`Wait`, :class:`WaitUntilDeleted`, :class:`Exit`,
:class:`Evicted`. A script that ends without ``Exit`` or ``Evicted`` leaves the pod as it is (running, unschedulable,
failing to pull) until the pod is deleted; waiting steps keep an unschedulable pod unscheduled.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

from fakes.kubernetes_rules import now

if TYPE_CHECKING:
    from fakes.kubernetes_cluster import Cluster

SCHEDULER = "default-scheduler"
KUBELET = "kubelet"


# ---------------------------------------------------------------------------------------------- reporting status

class PodReporter:
    """Writes one pod's status and events the way the kubelet (and the scheduler) do."""

    def __init__(self, cluster: Cluster, pod: dict[str, Any], pod_ip: str, host_ip: str):
        self.cluster, self.store = cluster, cluster.store
        self.namespace, self.name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        self.pod = pod
        self.pod_ip, self.host_ip = pod_ip, host_ip
        self.containers = [c["name"] for c in pod["spec"].get("containers") or []]
        self.images = {c["name"]: c.get("image", "") for c in pod["spec"].get("containers") or []}
        self.running_since: str | None = None

    def _write(self, change: Callable[[dict[str, Any]], None]) -> dict[str, Any] | None:
        written = self.store.update("pods", self.namespace, self.name, change)
        if written is not None:
            self.pod = written
            self.cluster.core.settle("pods", self.namespace, self.name)
        return written

    def event(self, kind: str, reason: str, message: str, component: str = KUBELET) -> None:
        if self.store.get("pods", self.namespace, self.name) is not None:
            self.cluster.record_event(self.pod, kind, reason, message, component)

    def gone(self) -> bool:
        return self.store.get("pods", self.namespace, self.name) is None

    @staticmethod
    def _conditions(status: dict[str, Any], **values: str | tuple[str, str, str]) -> None:
        conditions = {c["type"]: c for c in status.get("conditions") or []}
        for kind, value in values.items():
            state, reason, message = value if isinstance(value, tuple) else (value, "", "")
            old = conditions.get(kind)
            if old and old["status"] == state and old.get("reason", "") == reason:
                continue
            entry = {"type": kind, "status": state, "lastProbeTime": None, "lastTransitionTime": now()}
            if reason:
                entry["reason"] = reason
            if message:
                entry["message"] = message
            conditions[kind] = entry
        status["conditions"] = list(conditions.values())

    def unschedulable(self, reason: str, message: str) -> None:
        self._write(lambda pod: self._conditions(pod.setdefault("status", {}), PodScheduled=("False", reason, message)))
        self.event("Warning", "FailedScheduling", message, SCHEDULER)

    def schedule(self) -> None:
        node = self.cluster.node

        def bind(pod: dict[str, Any]) -> None:
            pod["spec"]["nodeName"] = node
            status = pod.setdefault("status", {})
            status.update(hostIP=self.host_ip, hostIPs=[{"ip": self.host_ip}], startTime=now())
            unready = ("False", "ContainersNotReady", f"containers with unready status: [{' '.join(self.containers)}]")
            self._conditions(status, PodReadyToStartContainers="False", Initialized="True", Ready=unready,
                             ContainersReady=unready, PodScheduled="True")
            status["containerStatuses"] = [self._container(name, {"waiting": {"reason": "ContainerCreating"}})
                                           for name in self.containers]

        self._write(bind)
        self.event("Normal", "Scheduled", f"Successfully assigned {self.namespace}/{self.name} to {node}", SCHEDULER)

    def _container(self, name: str, state: dict[str, Any], ready: bool = False, restarts: int = 0,
                   last: dict[str, Any] | None = None) -> dict[str, Any]:
        image = self.images.get(name, "")
        running = "running" in state
        entry = {"name": name, "image": image, "imageID": "", "ready": ready, "restartCount": restarts,
                 "started": running, "state": state, "lastState": last or {}}
        if running or "terminated" in state:
            entry["imageID"] = f"{image}@sha256:{'0' * 64}"
            entry["containerID"] = f"containerd://{abs(hash((self.name, name))):064x}"[:77]
        return entry

    def waiting(self, reason: str, message: str) -> None:
        def wait(pod: dict[str, Any]) -> None:
            pod["status"]["containerStatuses"] = [self._container(n, {"waiting": {"reason": reason,
                                                                                  "message": message}})
                                                  for n in self.containers]

        self._write(wait)

    def running(self) -> None:
        self.running_since = now()

        def run(pod: dict[str, Any]) -> None:
            status = pod["status"]
            status.update(phase="Running", podIP=self.pod_ip, podIPs=[{"ip": self.pod_ip}])
            self._conditions(status, PodReadyToStartContainers="True", Ready="True", ContainersReady="True")
            status["containerStatuses"] = [self._container(n, {"running": {"startedAt": self.running_since}}, True)
                                           for n in self.containers]

        for name in self.containers:
            self.event("Normal", "Pulled", f'Container image "{self.images[name]}" already present on machine')
            self.event("Normal", "Created", f"Created container: {name}")
            self.event("Normal", "Started", f"Started container {name}")
        self._write(run)

    def terminated(self, code: int, reason: str | None = None, message: str | None = None) -> None:
        """The container ended with ``code``: phase Succeeded on 0, else Failed (the pods run ``restartPolicy``
        Never; an ``OnFailure`` pod also ends here, a simplification)."""
        reason = reason or ("Completed" if code == 0 else "Error")

        def end(pod: dict[str, Any]) -> None:
            status = pod.setdefault("status", {})
            ended = {"exitCode": code, "reason": reason, "startedAt": self.running_since or now(),
                     "finishedAt": now()}
            if message:
                ended["message"] = message
            status["containerStatuses"] = [self._container(n, {"terminated": dict(ended)}) for n in self.containers]
            status["phase"] = "Succeeded" if code == 0 else "Failed"
            done = ("False", "PodCompleted", "")
            self._conditions(status, PodReadyToStartContainers="False", Ready=done, ContainersReady=done)

        self._write(end)

    def evicted(self, reason: str, message: str) -> None:
        """Evicted by the node (or preempted): ``DisruptionTarget`` with ``reason``, phase Failed, ``Evicted``."""
        def evict(pod: dict[str, Any]) -> None:
            status = pod.setdefault("status", {})
            self._conditions(status, DisruptionTarget=("True", reason, message))
            status.update(reason="Evicted", message=message)

        self._write(evict)
        self.event("Warning", "Evicted", message)
        self.terminated(137, "Error")

    def never_ran(self) -> None:
        """A pod deleted before its container ran ends Failed (what the pod garbage collector does)."""
        self._write(lambda pod: pod.setdefault("status", {}).__setitem__("phase", "Failed"))


# --------------------------------------------------------------------------------------------------- the script

@dataclass(frozen=True)
class Pending:
    """Not scheduled: ``PodScheduled`` False with ``reason`` (``Unschedulable``) and the scheduler's message."""

    reason: str = "Unschedulable"
    message: str = "0/1 nodes are available: 1 Insufficient cpu."


@dataclass(frozen=True)
class ImagePullError:
    """The image cannot be pulled: ``ErrImagePull`` with ``message``, then ``ImagePullBackOff``."""

    message: str = "failed to pull and unpack image: not found"


@dataclass(frozen=True)
class Running:
    """The container runs and is ready."""


@dataclass(frozen=True)
class Log:
    """The container writes ``text`` (to the pod's log)."""

    text: str


@dataclass(frozen=True)
class Wait:
    """Stay as is for ``seconds`` (shorter if the pod is deleted)."""

    seconds: float


@dataclass(frozen=True)
class WaitUntilDeleted:
    """Stay as is until the pod is deleted."""


@dataclass(frozen=True)
class Exit:
    """The container exits with ``code`` (reason ``Completed`` / ``Error`` unless given, e.g. ``OOMKilled``)."""

    code: int = 0
    reason: str | None = None
    message: str | None = None


@dataclass(frozen=True)
class Evicted:
    """The node evicts the pod (``TerminationByKubelet``) or the scheduler preempts it (``PreemptionByScheduler``)."""

    reason: str = "TerminationByKubelet"
    message: str = "The node was low on resource: memory. "


Step = Union[Pending, ImagePullError, Running, Log, Wait, WaitUntilDeleted, Exit, Evicted]  # noqa: UP007 (a runtime alias)
Script = Union[Callable[[dict[str, Any]], list[Step]], list[Step]]  # noqa: UP007


class ScriptedKubelet:
    """Plays a script per pod. ``script`` is a list of steps for every pod or a function of the pod (a dict) that
    returns one (default: run, then exit 0). A deleted running pod exits ``sigterm_exit_code`` at once (143: it
    honours SIGTERM); with ``None`` it ignores SIGTERM and is killed (137) when its grace period ends. ``script``
    may be replaced while the fake runs: pods started afterwards play the new one."""

    def __init__(self, script: Script | None = None, *, sigterm_exit_code: int | None = 143):
        self.script = script if script is not None else [Running(), Exit(0)]
        self.sigterm_exit_code = sigterm_exit_code
        self.cluster: Cluster | None = None
        self._deleted: dict[str, tuple[threading.Event, list[float]]] = {}
        self._threads: list[threading.Thread] = []
        self._closing = threading.Event()
        self._ips = 0

    def attach(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def steps_for(self, pod: dict[str, Any]) -> list[Step]:
        return list(self.script(copy.deepcopy(pod)) if callable(self.script) else self.script)

    def start_pod(self, pod: dict[str, Any]) -> None:
        self._ips += 1
        deleted = (threading.Event(), [0.0])
        self._deleted[pod["metadata"]["uid"]] = deleted
        thread = threading.Thread(target=self._play, args=(pod, deleted), daemon=True,
                                  name=f"kubelet-{pod['metadata']['name']}")
        self._threads.append(thread)
        thread.start()

    def stop_pod(self, pod: dict[str, Any], grace_seconds: float) -> None:
        event, grace = self._deleted.get(pod["metadata"]["uid"], (None, None))
        if event is not None:
            grace[0] = grace_seconds
            event.set()

    def close(self) -> None:
        self._closing.set()
        for event, _grace in self._deleted.values():
            event.set()
        for thread in self._threads:
            thread.join(timeout=5)

    def _play(self, pod: dict[str, Any], deleted: tuple[threading.Event, list[float]]) -> None:
        assert self.cluster is not None
        report = PodReporter(self.cluster, pod, f"10.244.0.{self._ips % 250 + 2}", "10.0.0.2")
        event, grace = deleted
        scheduled = running = False
        for step in self.steps_for(pod):
            if event.is_set() or report.gone():
                break
            if isinstance(step, Pending):
                report.unschedulable(step.reason, step.message)
                continue
            if not scheduled and not isinstance(step, (Wait, WaitUntilDeleted)):  # waiting keeps the pod as it is
                report.schedule()
                scheduled = True
            if isinstance(step, ImagePullError):
                self._pull_fails(report, step.message, event)
            elif isinstance(step, Running):
                report.running()
                running = True
            elif isinstance(step, Log):
                self.cluster.store.append_log(report.namespace, report.name, step.text)
            elif isinstance(step, Wait):
                event.wait(step.seconds)
            elif isinstance(step, WaitUntilDeleted):
                event.wait()
            elif isinstance(step, Exit):
                report.terminated(step.code, step.reason, step.message)
                return
            elif isinstance(step, Evicted):
                report.evicted(step.reason, step.message)
                return
        if not event.is_set():
            event.wait()  # the pod stays as the script left it (running, pending, pulling) until it is deleted
        if self._closing.is_set() or report.gone():
            return
        if not running:
            report.never_ran()
            return
        for name in report.containers:
            report.event("Normal", "Killing", f"Stopping container {name}")
        if self.sigterm_exit_code is not None:
            report.terminated(self.sigterm_exit_code, "Error")
        else:
            self._closing.wait(grace[0])
            report.terminated(137, "Error")

    @staticmethod
    def _pull_fails(report: PodReporter, message: str, deleted: threading.Event) -> None:
        for image in report.images.values():
            report.event("Normal", "Pulling", f'Pulling image "{image}"')
            report.event("Warning", "Failed", f'Failed to pull image "{image}": {message}')
            report.event("Warning", "Failed", "Error: ErrImagePull")
        image = next(iter(report.images.values()), "")
        report.waiting("ErrImagePull", f'Failed to pull image "{image}": {message}')
        deleted.wait(0.05)
        report.waiting("ImagePullBackOff", f'Back-off pulling image "{image}": ErrImagePull: {message}')
        report.event("Normal", "BackOff", f'Back-off pulling image "{image}"')
