"""A protocol-level fake Kubernetes API server on 127.0.0.1, for the official ``kubernetes`` Python client.

    with FakeKubernetes(version="1.31", kubelet=ScriptedKubelet(...)) as kube:
        kube.add_namespace("ml")
        api = kube.client()                 # or kubernetes.config.new_client_from_config(kube.kubeconfig(path))
        kubernetes.client.BatchV1Api(api).create_namespaced_job("ml", job)

It serves JSON over HTTP/1.1 (keep-alive, chunked watches and log streams) for core/v1 ``namespaces``, ``pods``
(``/log``, ``/eviction``), ``services``, ``configmaps``, ``events``, ``limitranges``, ``resourcequotas``, batch/v1
``jobs`` and scheduling.k8s.io/v1 ``priorityclasses``: create (``dryRun=All``, ``fieldValidation``), get, list
(``labelSelector``, ``fieldSelector``, ``watch``), replace, patch (merge, strategic merge — applied as a merge patch —
and JSON patch), delete (``DeleteOptions``: ``propagationPolicy``, ``gracePeriodSeconds``, ``preconditions``), and
``/version``, ``/api``, ``/apis``. Every request needs the bearer token of :meth:`FakeKubernetes.kubeconfig` (401
otherwise); every refusal is a ``Status`` body. A watch streams ``{"type", "object"}`` lines after the given
resourceVersion (an ``ERROR`` event with a 410 ``Expired`` Status when it is older than the history kept), honours
``timeoutSeconds`` and sends ``BOOKMARK`` events with ``allowWatchBookmarks``. The rules, the admission, the cluster
and the kubelets are in the sibling modules ``kubernetes_*``.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import yaml
from support.waiting import wait_until

from fakes.kubernetes_admission import SYSTEM_PRIORITY_CLASSES, Webhook
from fakes.kubernetes_cluster import Cluster, Kubelet
from fakes.kubernetes_kubelets import ScriptedKubelet
from fakes.kubernetes_rules import ApiError, bad_request, now
from fakes.kubernetes_server import ApiCore, resource
from fakes.kubernetes_store import (
    RESOURCES,
    Expired,
    Store,
    expired_status,
    labels_match,
    matches,
    parse_field_selector,
    parse_label_selector,
)

GROUPS = {"": "v1", "batch": "batch/v1", "scheduling.k8s.io": "scheduling.k8s.io/v1"}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        pass

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def do_PATCH(self) -> None:
        self._serve("PATCH")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    # ---------------------------------------------------------------------------------------------- plumbing
    def _serve(self, method: str) -> None:
        fake = self.server.fake
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        fake.requests.append((method, self.path))
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            if self.headers.get("Authorization") != f"Bearer {fake.token}":
                raise ApiError(401, "Unauthorized", "Unauthorized")
            body = json.loads(raw) if raw else None
            fake.route(self, method, url.path, query, body)
        except ApiError as error:
            self.send_json(error.code, error.status)
        except json.JSONDecodeError as error:
            status = bad_request(f"the body of the request could not be decoded: {error}")
            self.send_json(400, status.status)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def send_json(self, code: int, payload: Any, warnings: list[str] = ()) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for warning in warnings:  # RFC 7234 warn-text: a quoted string
            quoted = warning.replace("\\", "\\\\").replace('"', '\\"')
            self.send_header("Warning", f'299 - "{quoted}"')
        self.end_headers()
        self.wfile.write(data)

    def send_text(self, text: str) -> None:
        data = text.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def start_stream(self, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    fake: FakeKubernetes

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hung up (a watch it stopped reading, a pool's idle connection closed) is not an error of the
        server's: the base class would print its traceback into the test run's output."""
        if not isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            super().handle_error(request, client_address)


class FakeKubernetes:
    """The fake API server and the cluster behind it. ``version`` (``"1.31"``) decides which Job fields are kept and
    how the Job controller reports; ``kubelet`` runs the pods (:class:`ScriptedKubelet` by default, or
    :class:`fakes.kubernetes_process.ProcessKubelet`); ``history`` is how many watch events are kept."""

    def __init__(self, version: str = "1.31", kubelet: Kubelet | None = None, *, token: str = "fake-token",
                 history: int = 200, bookmark_seconds: float = 1.0, namespaces: tuple[str, ...] = ("default",)):
        self.token = token
        self.store = Store(history)
        self.core = ApiCore(self.store, version)
        self.version = version
        self.kubelet = kubelet if kubelet is not None else ScriptedKubelet()
        self.cluster = Cluster(self.core, self.kubelet)
        self.bookmark_seconds = bookmark_seconds
        self.requests: list[tuple[str, str]] = []  # (method, path with query) of every request, in order
        self._server: _Server | None = None
        for name in namespaces:
            self.add_namespace(name)
        for name, value in SYSTEM_PRIORITY_CLASSES.items():
            self.add_priority_class(name, value)

    # ------------------------------------------------------------------------------------------- life cycle
    def __enter__(self) -> FakeKubernetes:
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.fake = self
        threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True, name="fake-kubernetes-api").start()
        self.cluster.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cluster.stop()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self.cluster.errors and exc[0] is None:
            raise AssertionError("the fake cluster failed:\n" + self.cluster.errors[0])

    @property
    def url(self) -> str:
        assert self._server is not None, "start the fake first: with FakeKubernetes() as kube"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def kubeconfig(self, path: str | Path, namespace: str = "default", context: str = "fake") -> Path:
        """Write a kubeconfig for this server (user with the bearer token, context ``context``)."""
        path = Path(path)
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": context,
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake-user", "user": {"token": self.token}}],
            "contexts": [{"name": context, "context": {"cluster": "fake", "user": "fake-user",
                                                       "namespace": namespace}}]}))
        return path

    def client(self) -> Any:
        """A ``kubernetes.client.ApiClient`` for this server."""
        import kubernetes

        configuration = kubernetes.client.Configuration()
        configuration.host = self.url
        configuration.api_key = {"authorization": f"Bearer {self.token}"}
        return kubernetes.client.ApiClient(configuration)

    # ----------------------------------------------------------------------------------------- seeding state
    def add(self, plural: str, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        """Create an object as a client would (validated), e.g. a ResourceQuota or LimitRange to test against."""
        return self.core.create(plural, namespace, body)[0]

    def add_namespace(self, name: str) -> dict[str, Any]:
        return self.add("namespaces", "", {"metadata": {"name": name}})

    def add_priority_class(self, name: str, value: int = 1000, global_default: bool = False,
                           preemption_policy: str = "PreemptLowerPriority") -> dict[str, Any]:
        return self.add("priorityclasses", "", {"metadata": {"name": name}, "value": value,
                                                "globalDefault": global_default,
                                                "preemptionPolicy": preemption_policy})

    def deny_with_webhook(self, name: str, message: str, resources: tuple[str, ...] = ("pods", "jobs"),
                          code: int = 403) -> Webhook:
        """From now on, an admission webhook ``name`` denies every create of ``resources`` (dry runs too)."""
        webhook = Webhook(name, message, resources, code)
        self.core.admission.webhooks.append(webhook)
        return webhook

    def clear_webhooks(self) -> None:
        self.core.admission.webhooks.clear()

    # ------------------------------------------------------------------------------------------------- reads
    def pods(self, namespace: str | None = None, selector: str | None = None) -> list[dict[str, Any]]:
        requirements = parse_label_selector(selector)
        return [p for p in self.store.list("pods", namespace) if labels_match(p["metadata"].get("labels"),
                                                                               requirements)]

    def jobs(self, namespace: str | None = None) -> list[dict[str, Any]]:
        return self.store.list("jobs", namespace)

    def job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.store.get("jobs", namespace, name)

    def pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.store.get("pods", namespace, name)

    def events(self, namespace: str | None = None, about: str | None = None) -> list[dict[str, Any]]:
        """Events, of the object named ``about`` if given, oldest first."""
        return sorted((e for e in self.store.list("events", namespace)
                       if about is None or e["involvedObject"]["name"] == about), key=lambda e: e["metadata"]["name"])

    def log(self, namespace: str, pod: str) -> str:
        return self.store.log(namespace, pod)

    def evict(self, pod_name: str, namespace: str | None = None) -> None:
        """What the Eviction API does to a pod: ``DisruptionTarget`` (``EvictionByEvictionAPI``), then deletion."""
        found = [p for p in self.store.list("pods", namespace) if p["metadata"]["name"] == pod_name]
        assert found, f"no pod {pod_name} to evict"
        self.core.evict(found[0]["metadata"]["namespace"], pod_name)

    def wait_for(self, condition: Callable[[], Any], timeout: float = 30.0, message: str = "condition") -> Any:
        """Wait until ``condition()`` is truthy (and return it)."""
        return wait_until(condition, timeout, message)

    # --------------------------------------------------------------------------------------------- routing
    def route(self, handler: _Handler, method: str, path: str, query: dict[str, str], body: Any) -> None:
        parts = [p for p in path.split("/") if p]
        if parts == ["version"]:
            minor = self.version.split(".")[1]
            return handler.send_json(200, {"major": "1", "minor": minor, "gitVersion": f"v{self.version}.0",
                                           "gitCommit": "fake", "gitTreeState": "clean", "buildDate": now(),
                                           "goVersion": "go1.22", "compiler": "gc", "platform": "linux/amd64"})
        if parts == ["api"]:
            return handler.send_json(200, {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [
                {"clientCIDR": "0.0.0.0/0", "serverAddress": self.url.split("//")[1]}]})
        if parts == ["apis"]:
            groups = [{"name": g, "versions": [{"groupVersion": gv, "version": "v1"}],
                       "preferredVersion": {"groupVersion": gv, "version": "v1"}} for g, gv in GROUPS.items() if g]
            return handler.send_json(200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
        if parts[:2] == ["api", "v1"]:
            group, rest = "", parts[2:]
        elif len(parts) >= 3 and parts[0] == "apis" and parts[1] in GROUPS and parts[2] == "v1":
            group, rest = parts[1], parts[3:]
        else:
            raise ApiError(404, "NotFound", "the server could not find the requested resource", {})
        if not rest:
            return handler.send_json(200, self._resource_list(group))
        namespace = None
        if rest[0] == "namespaces" and len(rest) >= 3:
            namespace, rest = rest[1], rest[2:]
        plural, name, sub = rest[0], (rest[1] if len(rest) > 1 else None), (rest[2] if len(rest) > 2 else None)
        if plural not in RESOURCES or RESOURCES[plural].group != group or len(rest) > 3:
            raise ApiError(404, "NotFound", "the server could not find the requested resource", {})
        self._verb(handler, method, plural, namespace, name, sub, query, body)

    def _resource_list(self, group: str) -> dict[str, Any]:
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": GROUPS[group], "resources": [
            {"name": r.plural, "singularName": r.kind.lower(), "namespaced": r.namespaced, "kind": r.kind,
             "verbs": ["create", "delete", "get", "list", "patch", "update", "watch"]}
            for r in RESOURCES.values() if r.group == group]}

    def _verb(self, handler: _Handler, method: str, plural: str, namespace: str | None, name: str | None,
              sub: str | None, query: dict[str, str], body: Any) -> None:
        core, res = self.core, resource(plural)
        dry_run = query.get("dryRun") == "All"
        validation = query.get("fieldValidation")
        ns = namespace or ""
        if sub == "log" and method == "GET" and plural == "pods":
            return self._log(handler, ns, name, query)
        if sub == "eviction" and method == "POST" and plural == "pods":
            return handler.send_json(201, core.evict(ns, name, (body or {}).get("deleteOptions")))
        if sub not in (None, "status"):
            raise ApiError(404, "NotFound", "the server could not find the requested resource", {})
        if name is None:
            if method == "GET":
                if query.get("watch") in ("true", "1"):
                    return self._watch(handler, plural, namespace, query)
                items, rv = core.list(plural, namespace, query.get("labelSelector"), query.get("fieldSelector"))
                return handler.send_json(200, {"kind": f"{res.kind}List", "apiVersion": res.api_version,
                                               "metadata": {"resourceVersion": rv}, "items": items})
            if method == "POST":
                obj, dropped = core.create(plural, ns, body, dry_run, validation)
                return handler.send_json(201, obj, [f'unknown field "{d}"' for d in dropped])
        elif method == "GET":
            return handler.send_json(200, core.get(plural, ns, name))
        elif method == "PUT":
            obj, dropped = core.replace(plural, ns, name, body, dry_run, validation)
            return handler.send_json(200, obj, [f'unknown field "{d}"' for d in dropped])
        elif method == "PATCH":
            content_type = handler.headers.get("Content-Type", "")
            obj, dropped = core.patch(plural, ns, name, body, content_type, dry_run, validation)
            return handler.send_json(200, obj, [f'unknown field "{d}"' for d in dropped])
        elif method == "DELETE":
            options = dict(body or {})
            for key in ("propagationPolicy", "gracePeriodSeconds"):
                if key in query:
                    options[key] = int(query[key]) if key == "gracePeriodSeconds" else query[key]
            return handler.send_json(200, core.delete(plural, ns, name, options, dry_run or
                                                      "All" in (options.get("dryRun") or [])))
        raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")

    # ------------------------------------------------------------------------------------------------- watch
    def _watch(self, handler: _Handler, plural: str, namespace: str | None, query: dict[str, str]) -> None:
        res = RESOURCES[plural]
        labels = parse_label_selector(query.get("labelSelector"))
        fields = parse_field_selector(query.get("fieldSelector"), plural)
        timeout = float(query["timeoutSeconds"]) if query.get("timeoutSeconds") else None
        bookmarks = query.get("allowWatchBookmarks") in ("true", "1")
        start = query.get("resourceVersion")
        handler.start_stream("application/json")

        def send(kind: str, obj: dict[str, Any]) -> None:
            handler.chunk(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

        with self.store.lock:
            if start in (None, "", "0"):
                items, last_text = self.core.list(plural, namespace, query.get("labelSelector"),
                                                  query.get("fieldSelector"))
                last = int(last_text)
                initial = items
            else:
                last, initial = int(start), []
        for obj in initial:
            send("ADDED", obj)
        deadline = None if timeout is None else time.monotonic() + timeout
        next_bookmark = time.monotonic() + self.bookmark_seconds
        try:
            while not self.store.closed:
                try:
                    events = self.store.events_after(last, plural)
                except Expired as error:
                    send("ERROR", expired_status(error))
                    break
                for event in events:
                    last = event.rv
                    if namespace is not None and event.namespace != namespace:
                        continue
                    kind = self._shown_type(event, labels, fields)
                    if kind:
                        obj = dict(event.obj, apiVersion=res.api_version, kind=res.kind)
                        send(kind, obj)
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                if bookmarks and time.monotonic() >= next_bookmark:
                    with self.store.lock:
                        if not self.store.events_after(last, plural):
                            last = self.store.rv
                    send("BOOKMARK", {"kind": res.kind, "apiVersion": res.api_version,
                                      "metadata": {"resourceVersion": str(last)}})
                    next_bookmark = time.monotonic() + self.bookmark_seconds
                with self.store.changed:
                    if self.store.rv == last or not self.store.events_after(last, plural):
                        waits = [w for w in (left, next_bookmark - time.monotonic() if bookmarks else None, 0.5)
                                 if w is not None]
                        self.store.changed.wait(max(0.0, min(waits)))
            if bookmarks:
                send("BOOKMARK", {"kind": res.kind, "apiVersion": res.api_version,
                                  "metadata": {"resourceVersion": str(last)}})
            handler.chunk(b"")
        except Expired as error:
            send("ERROR", expired_status(error))
            handler.chunk(b"")

    @staticmethod
    def _shown_type(event: Any, labels: list, fields: list) -> str | None:
        """The event a watch with selectors sees: a change into the selection is ADDED, out of it DELETED."""
        now_in = matches(event.obj, labels, fields)
        if event.type != "MODIFIED" or event.old is None:
            return event.type if now_in else None
        was_in = matches(event.old, labels, fields)
        if now_in:
            return "MODIFIED" if was_in else "ADDED"
        return "DELETED" if was_in else None

    # --------------------------------------------------------------------------------------------------- logs
    def _log(self, handler: _Handler, namespace: str, name: str, query: dict[str, str]) -> None:
        pod = self.core.get("pods", namespace, name)
        containers = [c["name"] for c in pod["spec"].get("containers") or []]
        container = query.get("container")
        if container is None and len(containers) > 1:
            raise bad_request(f"a container name must be specified for pod {name}, choose one of: "
                              f"[{' '.join(containers)}]")
        container = container or containers[0]
        if container not in containers:
            raise bad_request(f"container {container} is not valid for pod {name}")
        if not pod["spec"].get("nodeName"):
            raise bad_request(f"pod {name} does not have a host assigned")
        state = next((s.get("state") or {} for s in (pod.get("status") or {}).get("containerStatuses") or []
                      if s["name"] == container), {"waiting": {"reason": "ContainerCreating"}})
        if "waiting" in state:
            reason = state["waiting"].get("reason", "ContainerCreating")
            if reason in ("ErrImagePull", "ImagePullBackOff"):
                reason = "trying and failing to pull image"
            raise bad_request(f'container "{container}" in pod "{name}" is waiting to start: {reason}')
        if query.get("follow") not in ("true", "1"):
            text = self.store.log(namespace, name)
            if query.get("tailLines"):
                lines = text.splitlines(keepends=True)
                text = "".join(lines[-int(query["tailLines"]):]) if int(query["tailLines"]) else ""
            return handler.send_text(text)
        handler.start_stream("text/plain")
        sent = 0
        while True:
            text = self.store.log(namespace, name)
            if len(text) > sent:
                handler.chunk(text[sent:].encode())
                sent = len(text)
            current = self.store.get("pods", namespace, name)
            if current is None or (current.get("status") or {}).get("phase") in ("Succeeded", "Failed") \
                    or self.store.closed:
                if len(self.store.log(namespace, name)) == sent:
                    break
                continue
            self.store.wait(0.2)
        handler.chunk(b"")
