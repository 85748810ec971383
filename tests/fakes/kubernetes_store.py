"""The fake Kubernetes API server's storage: plain dicts per (resource, namespace, name), one global resourceVersion,
a bounded history of watch events, the pods' logs, and label/field selectors.

Every write bumps the resourceVersion (a string of an int, as etcd's revision), stamps it on the object and appends an
ADDED / MODIFIED / DELETED event to the history, of which only the last ``history`` events are kept: a watch from a
resourceVersion older than that is answered with 410 ``Expired``, as the API server's watch cache does.
"""

from __future__ import annotations

import copy
import re
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from fakes.kubernetes_rules import ApiError, bad_request


@dataclass(frozen=True)
class Resource:
    """One kind of object the fake serves."""

    plural: str
    group: str
    kind: str
    namespaced: bool = True
    model: str = ""  # the client's model class of this kind (its schema), when not V1<kind>

    def __post_init__(self) -> None:
        if not self.model:
            object.__setattr__(self, "model", "V1" + self.kind)

    @property
    def api_version(self) -> str:
        return f"{self.group}/v1" if self.group else "v1"


RESOURCES = {r.plural: r for r in (
    Resource("namespaces", "", "Namespace", namespaced=False),
    Resource("pods", "", "Pod"),
    Resource("services", "", "Service"),
    Resource("configmaps", "", "ConfigMap"),
    Resource("secrets", "", "Secret"),
    Resource("persistentvolumeclaims", "", "PersistentVolumeClaim"),
    Resource("serviceaccounts", "", "ServiceAccount"),
    Resource("events", "", "Event", model="CoreV1Event"),
    Resource("limitranges", "", "LimitRange"),
    Resource("resourcequotas", "", "ResourceQuota"),
    Resource("jobs", "batch", "Job"),
    Resource("priorityclasses", "scheduling.k8s.io", "PriorityClass", namespaced=False),
)}

# The fields a field selector may name, per resource (the API server refuses others).
SELECTABLE_FIELDS = {
    "pods": {"spec.nodeName", "spec.restartPolicy", "spec.schedulerName", "spec.serviceAccountName", "status.phase",
             "status.podIP", "status.nominatedNodeName"},
    "events": {"involvedObject.kind", "involvedObject.namespace", "involvedObject.name", "involvedObject.uid",
               "involvedObject.apiVersion", "involvedObject.resourceVersion", "involvedObject.fieldPath", "reason",
               "reportingComponent", "source", "type"},
    "jobs": {"status.successful"},
}


@dataclass
class WatchEvent:
    rv: int
    plural: str
    namespace: str
    type: str  # ADDED | MODIFIED | DELETED
    obj: dict[str, Any]
    old: dict[str, Any] | None  # the object before a MODIFIED (a watch with a selector turns a change out into DELETED)


class Expired(Exception):
    """The resourceVersion a watch asked for is older than the history kept."""

    def __init__(self, asked: int, oldest: int):
        super().__init__(f"too old resource version: {asked} ({oldest})")


class Store:
    """Objects, resourceVersions and watch history; every method takes the lock, so threads may share one store."""

    def __init__(self, history: int = 200):
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.rv = 1000
        self.objects: dict[str, dict[tuple[str, str], dict[str, Any]]] = {plural: {} for plural in RESOURCES}
        self.history: deque[WatchEvent] = deque(maxlen=history)
        self.expired_rv = 0  # the newest resourceVersion no longer in the history
        self.logs: dict[tuple[str, str], list[str]] = {}
        self.closed = False

    def get(self, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        with self.lock:
            obj = self.objects[plural].get((namespace, name))
            return copy.deepcopy(obj) if obj is not None else None

    def list(self, plural: str, namespace: str | None = None) -> list[dict[str, Any]]:
        with self.lock:
            return [copy.deepcopy(obj) for (ns, _name), obj in sorted(self.objects[plural].items())
                    if namespace is None or ns == namespace]

    def put(self, plural: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Store ``obj`` (created or replaced) at a new resourceVersion; returns a copy as stored."""
        with self.lock:
            meta = obj["metadata"]
            key = (meta.get("namespace", ""), meta["name"])
            old = self.objects[plural].get(key)
            self.rv += 1
            stored = copy.deepcopy(obj)
            stored["metadata"]["resourceVersion"] = str(self.rv)
            self.objects[plural][key] = stored
            self._record(WatchEvent(self.rv, plural, key[0], "MODIFIED" if old else "ADDED", stored, old))
            return copy.deepcopy(stored)

    def remove(self, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        with self.lock:
            obj = self.objects[plural].pop((namespace, name), None)
            if obj is None:
                return None
            self.rv += 1
            gone = copy.deepcopy(obj)
            gone["metadata"]["resourceVersion"] = str(self.rv)
            self._record(WatchEvent(self.rv, plural, namespace, "DELETED", gone, None))
            if plural == "pods":
                self.logs.pop((namespace, name), None)
            return copy.deepcopy(gone)

    def update(self, plural: str, namespace: str, name: str,
               change: Callable[[dict[str, Any]], None]) -> dict[str, Any] | None:
        """Apply ``change`` to a copy of the object and store it if anything changed; ``None`` if it is gone."""
        with self.lock:
            current = self.objects[plural].get((namespace, name))
            if current is None:
                return None
            obj = copy.deepcopy(current)
            change(obj)
            return self.put(plural, obj) if obj != current else copy.deepcopy(current)

    def _record(self, event: WatchEvent) -> None:
        if len(self.history) == self.history.maxlen:
            self.expired_rv = self.history[0].rv
        self.history.append(event)
        self.changed.notify_all()

    def events_after(self, rv: int, plural: str) -> list[WatchEvent]:
        """The events of ``plural`` after resourceVersion ``rv``; :class:`Expired` when some were dropped already."""
        with self.lock:
            if rv < self.expired_rv:
                raise Expired(rv, self.expired_rv)
            return [e for e in self.history if e.rv > rv and e.plural == plural]

    def append_log(self, namespace: str, pod: str, text: str) -> None:
        with self.lock:
            self.logs.setdefault((namespace, pod), []).append(text)
            self.changed.notify_all()

    def log(self, namespace: str, pod: str) -> str:
        with self.lock:
            return "".join(self.logs.get((namespace, pod), []))

    def wait(self, timeout: float) -> None:
        """Block until the next write (or ``timeout`` seconds)."""
        with self.changed:
            if not self.closed:
                self.changed.wait(timeout)

    def close(self) -> None:
        with self.changed:
            self.closed = True
            self.changed.notify_all()


# ------------------------------------------------------------------------------------------------------ selectors

Requirement = tuple[str, str, frozenset[str]]  # (key, operator, values): = != in notin exists !exists


def parse_label_selector(text: str | None) -> list[Requirement]:
    """``a=b,c!=d,e in (f,g),h notin (i),j,!k`` as the API server reads a labelSelector."""
    requirements: list[Requirement] = []
    for part in _split(text or ""):
        part = part.strip()
        if not part:
            continue
        if match := re.fullmatch(r"(\S+)\s+(in|notin)\s+\(([^)]*)\)", part):
            key, op, values = match.groups()
            requirements.append((key, op, frozenset(v.strip() for v in values.split(",") if v.strip())))
        elif match := re.fullmatch(r"([^=!\s]+)\s*(==|=|!=)\s*(\S*)", part):
            key, op, value = match.groups()
            requirements.append((key, "!=" if op == "!=" else "=", frozenset([value])))
        elif re.fullmatch(r"!\s*[^=!\s(),]+", part):
            requirements.append((part[1:].strip(), "!exists", frozenset()))
        elif re.fullmatch(r"[^=!\s(),]+", part):
            requirements.append((part, "exists", frozenset()))
        else:
            raise bad_request(f"unable to parse requirement: found '{part}', expected: in, notin, =, ==, !=, gt, lt")
    return requirements


def _split(text: str) -> Iterator[str]:
    depth, start = 0, 0
    for i, char in enumerate(text):
        depth += char == "("
        depth -= char == ")"
        if char == "," and depth == 0:
            yield text[start:i]
            start = i + 1
    yield text[start:]


def labels_match(labels: dict[str, str] | None, requirements: list[Requirement]) -> bool:
    labels = labels or {}
    for key, op, values in requirements:
        present = key in labels
        ok = {"=": present and labels.get(key) in values, "!=": not present or labels[key] not in values,
              "in": present and labels[key] in values, "notin": not present or labels[key] not in values,
              "exists": present, "!exists": not present}[op]
        if not ok:
            return False
    return True


def parse_field_selector(text: str | None, plural: str) -> list[tuple[str, bool, str]]:
    """``metadata.name=x,status.phase!=Failed`` → [(path, equal, value)]; 400 for a field the resource cannot select."""
    selectable = {"metadata.name", "metadata.namespace"} | SELECTABLE_FIELDS.get(plural, set())
    terms = []
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        match = re.fullmatch(r"([^=!]+)(==|=|!=)(.*)", part)
        if not match:
            raise bad_request(f"invalid selector: '{text}'; can't understand '{part}'")
        path, op, value = match.groups()
        if path not in selectable:
            raise bad_request(f'field label not supported: {path}')
        terms.append((path, op != "!=", value))
    return terms


def fields_match(obj: dict[str, Any], terms: list[tuple[str, bool, str]]) -> bool:
    for path, equal, value in terms:
        found: Any = obj
        for key in ("status.succeeded" if path == "status.successful" else path).split("."):
            found = found.get(key) if isinstance(found, dict) else None
        actual = "" if found is None else str(found)
        if (actual == value) != equal:
            return False
    return True


def matches(obj: dict[str, Any], labels: list[Requirement], fields: list[tuple[str, bool, str]]) -> bool:
    return labels_match(obj.get("metadata", {}).get("labels"), labels) and fields_match(obj, fields)


def expired_status(error: Expired) -> dict[str, Any]:
    """The Status of a watch's ERROR event for a too-old resourceVersion."""
    return ApiError(410, "Expired", str(error)).status
