"""The Kubernetes API as the backend uses it, through the official client (``pip install 'nbbatch[kubernetes]'``).

Objects go in and come out as plain dicts (the manifests of :mod:`nbbatch.backends.kubernetes.manifests`); a refusal
becomes :class:`KubernetesRefusal` carrying the server's ``Status`` (its message, reason and the fields it names),
and a server that cannot be reached a :class:`~nbbatch.errors.BackendError` naming the server and context.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kubernetes import client as k8s
from kubernetes import config, watch
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from nbbatch.errors import BackendError

T = TypeVar("T")


@dataclass
class KubernetesRefusal(Exception):
    """The API server refused a request: its ``Status``."""

    code: int
    reason: str
    message: str
    causes: list[dict[str, Any]] = field(default_factory=list)

    def __str__(self) -> str:
        return self.message or f"{self.code} {self.reason}"


class KubernetesApi:
    """One namespace of one cluster (a kubeconfig's context, or the pod's own service account in a cluster)."""

    def __init__(self, namespace: str, context: str | None = None, kubeconfig: str | None = None,
                 client: Any = None) -> None:
        self.namespace, self.context, self.kubeconfig = namespace, context, kubeconfig
        self._client = client  # a kubernetes.client.ApiClient (tests may give one)

    # --- the connection --------------------------------------------------------------------------------------

    @property
    def client(self) -> Any:
        if self._client is None:
            in_cluster = not self.kubeconfig and not self.context and "KUBERNETES_SERVICE_HOST" in os.environ \
                and not os.path.exists(os.path.expanduser(os.environ.get("KUBECONFIG", "~/.kube/config")))
            try:
                if in_cluster:
                    config.load_incluster_config()
                    self._client = k8s.ApiClient()
                else:
                    self._client = config.new_client_from_config(config_file=self.kubeconfig, context=self.context)
            except (config.ConfigException, OSError, ValueError, KeyError) as exc:
                where = f"kubeconfig {self.kubeconfig}" if self.kubeconfig else "the kubeconfig ($KUBECONFIG or ~/.kube/config)"
                context = f", context `{self.context}`" if self.context else ""
                raise BackendError(f"the kubernetes backend cannot load {where}{context}: {exc}. Set `kubeconfig:` or "
                                   "`context:` in the experiment's backend settings (`kubectl config get-contexts` "
                                   "lists the contexts). Nothing was queued.") from None
        return self._client

    @property
    def server(self) -> str:
        return str(self.client.configuration.host)

    def _call(self, what: str, request: Callable[[], T]) -> T:
        """``request``'s answer; a refusal as :class:`KubernetesRefusal`, an unreachable server as BackendError."""
        try:
            return request()
        except ApiException as exc:
            raise refusal_of(exc) from None
        except (HTTPError, OSError) as exc:
            raise BackendError(f"cannot reach the Kubernetes API server {self.server} to {what} "
                               f"({type(exc).__name__}: {exc}); check the cluster, your network and `context:`") from None

    def _plain(self, obj: Any) -> Any:
        return self.client.sanitize_for_serialization(obj)

    @property
    def _core(self) -> Any:
        return k8s.CoreV1Api(self.client)

    @property
    def _batch(self) -> Any:
        return k8s.BatchV1Api(self.client)

    # --- reading -----------------------------------------------------------------------------------------------

    def version(self) -> tuple[int, int]:
        """The server's (major, minor) version."""
        info = self._call("read its version", lambda: k8s.VersionApi(self.client).get_code())
        digits = "".join(ch for ch in str(info.minor) if ch.isdigit())
        return int(info.major), int(digits or 0)

    def read_namespace(self) -> dict[str, Any]:
        return self._plain(self._call(f"read namespace {self.namespace}",
                                      lambda: self._core.read_namespace(self.namespace)))

    def limit_ranges(self) -> list[dict[str, Any]]:
        answer = self._call("list the namespace's LimitRanges",
                            lambda: self._core.list_namespaced_limit_range(self.namespace))
        return self._plain(answer).get("items") or []

    def jobs(self, selector: str) -> list[dict[str, Any]]:
        answer = self._call("list the experiment's Jobs",
                            lambda: self._batch.list_namespaced_job(self.namespace, label_selector=selector))
        return self._plain(answer).get("items") or []

    def pods(self, selector: str) -> list[dict[str, Any]]:
        answer = self._call("list the experiment's pods",
                            lambda: self._core.list_namespaced_pod(self.namespace, label_selector=selector))
        return self._plain(answer).get("items") or []

    def pod_log(self, name: str, tail_lines: int = 40) -> str:
        return str(self._call(f"read pod {name}'s log", lambda: self._core.read_namespaced_pod_log(
            name, self.namespace, tail_lines=tail_lines)) or "")

    def watch_job_gone(self, name: str, timeout_s: int) -> bool:
        """Watch the Job until it is deleted (True) or ``timeout_s`` passes (False); a watch whose resourceVersion is
        too old (410 Gone) starts again from a fresh list, as the API conventions ask."""
        selector = f"metadata.name={name}"
        for _ in range(3):
            listed = self._call("list the Job", lambda: self._batch.list_namespaced_job(
                self.namespace, field_selector=selector))
            if not listed.items:
                return True
            try:
                for event in watch.Watch().stream(self._batch.list_namespaced_job, self.namespace,
                                                  field_selector=selector, timeout_seconds=timeout_s,
                                                  resource_version=listed.metadata.resource_version):
                    if event["type"] == "DELETED":
                        return True
                return False
            except ApiException as exc:  # 410: the version is gone from the server's history (list again)
                if exc.status != 410:
                    raise refusal_of(exc) from None
        return False

    # --- writing -----------------------------------------------------------------------------------------------

    def create(self, manifest: Mapping[str, Any], dry_run: bool = False) -> dict[str, Any]:
        """Create the Job, Service or Pod ``manifest`` describes (``dry_run``: the server judges it, stores nothing);
        the object as the server has it."""
        kind, ns = manifest["kind"], self.namespace
        calls = {"Job": self._batch.create_namespaced_job, "Service": self._core.create_namespaced_service,
                 "Pod": self._core.create_namespaced_pod}
        extra = {"dry_run": "All"} if dry_run else {}
        name = manifest["metadata"]["name"]
        return self._plain(self._call(f"create {kind} {name}", lambda: calls[kind](ns, dict(manifest), **extra)))

    def delete_job(self, name: str, grace_s: int | None = None) -> bool:
        """Delete a Job with its pods, the pods first (foreground); False when it was gone already."""
        body = k8s.V1DeleteOptions(propagation_policy="Foreground", grace_period_seconds=grace_s)
        try:
            self._call(f"delete Job {name}", lambda: self._batch.delete_namespaced_job(name, self.namespace, body=body))
        except KubernetesRefusal as refusal:
            if refusal.code == 404:
                return False
            raise
        return True


def refusal_of(exc: Any) -> KubernetesRefusal:
    """The ``Status`` of an ApiException (its body), or what the exception says when it has none."""
    code = int(getattr(exc, "status", 0) or 0)
    try:
        status = json.loads(getattr(exc, "body", None) or "{}")
    except ValueError:
        status = {}
    if not isinstance(status, dict) or status.get("kind") != "Status":
        return KubernetesRefusal(code, str(getattr(exc, "reason", "") or ""), str(getattr(exc, "body", "") or exc))
    return KubernetesRefusal(int(status.get("code") or code), str(status.get("reason") or ""),
                             str(status.get("message") or ""), list((status.get("details") or {}).get("causes") or []))


def items_by_name(items: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {item["metadata"]["name"]: item for item in items}


def iter_containers(pod: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    yield from (pod.get("status") or {}).get("containerStatuses") or []


__all__ = ["KubernetesApi", "KubernetesRefusal", "items_by_name", "iter_containers", "refusal_of"]
