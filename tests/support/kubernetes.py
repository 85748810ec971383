"""Helpers for tests against the fake Kubernetes API server (:mod:`fakes.kubernetes_api`): manifests as plain dicts
(the official client takes them as bodies) and the ``Status`` of a refused call."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def refusal(call: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Call the client and return the ``Status`` body of the refusal it must raise (``ApiException``)."""
    from kubernetes.client import ApiException

    try:
        call(*args, **kwargs)
    except ApiException as error:
        status = json.loads(error.body)
        assert status["code"] == error.status, status
        return status
    raise AssertionError(f"{getattr(call, '__name__', call)} was accepted; a refusal was expected")


def container(name: str = "main", command: tuple[str, ...] = ("sh", "-c", "true"), **fields: Any) -> dict[str, Any]:
    return {"name": name, "image": "busybox:1.36", "command": list(command), **fields}


def pod_manifest(name: str, *, containers: list[dict[str, Any]] | None = None, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"restartPolicy": "Never", "containers": containers or [container()], **spec}}


def job_manifest(name: str, *, completions: int | None = 1, parallelism: int = 1, indexed: bool = True,
                 containers: list[dict[str, Any]] | None = None, pod_spec: dict[str, Any] | None = None,
                 **spec: Any) -> dict[str, Any]:
    """A Job (Indexed unless ``indexed=False``) whose pods run ``containers`` with ``restartPolicy: Never``."""
    body_spec: dict[str, Any] = {"parallelism": parallelism, "template": {"spec": {
        "restartPolicy": "Never", "containers": containers or [container()], **(pod_spec or {})}}, **spec}
    if completions is not None:
        body_spec["completions"] = completions
    if indexed:
        body_spec["completionMode"] = "Indexed"
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name}, "spec": body_spec}


def condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any] | None:
    """The condition ``kind`` of an object (a dict as the fake stores it) when it is True."""
    return next((c for c in ((obj or {}).get("status") or {}).get("conditions") or []
                 if c["type"] == kind and c["status"] == "True"), None)


def clients(kube: Any, folder: Path) -> tuple[Any, Any]:
    """``BatchV1Api`` and ``CoreV1Api`` of a client made from the kubeconfig the fake ``kube`` writes in ``folder``."""
    import kubernetes

    api = kubernetes.config.new_client_from_config(str(kube.kubeconfig(folder / "kubeconfig")), context="fake")
    return kubernetes.client.BatchV1Api(api), kubernetes.client.CoreV1Api(api)


def index_of(pod: dict[str, Any]) -> int:
    """The completion index of a pod of an Indexed Job (a dict)."""
    return int(pod["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"])


def condition_of(obj: Any, kind: str) -> Any:
    """The condition ``kind`` of a client model (``V1Pod``, ``V1Job``), whatever its status."""
    return next((c for c in obj.status.conditions or [] if c.type == kind), None)


def waiting_reason(pod: Any) -> str | None:
    """Why the first container of a ``V1Pod`` waits (``ImagePullBackOff``…), if it does."""
    statuses = pod.status.container_statuses or []
    return statuses[0].state.waiting.reason if statuses and statuses[0].state.waiting else None
