"""The admission a Kubernetes API server runs after decoding an object, in the real order, with the real messages:
LimitRanger's defaults and Priority (mutating, before the name is generated), then LimitRanger's min/max, the
admission webhooks and ResourceQuota (validating, after). A dry run goes through all of it and stores nothing.

Pods are judged here when they are created, through the API or by the Job controller; a Job itself only meets the
webhooks and the ``count/jobs.batch`` quota, as on a real server: a Job whose pods exceed a compute quota is
accepted, and its pods fail to be created (``FailedCreate`` events).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fakes.kubernetes_rules import ApiError, Quantity, aggregate, forbidden
from fakes.kubernetes_store import RESOURCES, Store

COMPUTE = ("cpu", "memory")
SYSTEM_PRIORITY_CLASSES = {"system-cluster-critical": 2000000000, "system-node-critical": 2000001000}


@dataclass
class Webhook:
    """A validating admission webhook that denies every matching request (a test's stand-in for a policy engine)."""

    name: str
    message: str
    resources: tuple[str, ...] = ("pods", "jobs")
    code: int = 403

    def error(self) -> ApiError:
        error = ApiError(self.code, "", f'admission webhook "{self.name}" denied the request: {self.message}')
        del error.status["reason"]  # a webhook's denial carries the code it chose, no reason
        return error


def _containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]


def pod_usage(pod: dict[str, Any]) -> dict[str, Quantity]:
    """What a pod counts against a ResourceQuota (init containers count as their largest, as the scheduler does)."""
    spec = pod.get("spec") or {}
    usage: dict[str, Quantity] = {"pods": Quantity(1), "count/pods": Quantity(1)}

    def total(containers: list[dict[str, Any]], section: str) -> dict[str, Quantity]:
        sums: dict[str, Quantity] = {}
        for container in containers:
            for name, text in ((container.get("resources") or {}).get(section) or {}).items():
                value = Quantity.parse(text)
                sums[name] = sums[name] + value if name in sums else value
        return sums

    for section in ("requests", "limits"):
        regular = total(spec.get("containers") or [], section)
        for init in spec.get("initContainers") or []:
            for name, value in total([init], section).items():
                if name not in regular or value.value > regular[name].value:
                    regular[name] = value
        for name, value in regular.items():
            if section == "limits" and name not in COMPUTE:
                continue  # extended resources are quota'd by their requests only
            usage[f"{section}.{name}"] = value
            if section == "requests" and name in COMPUTE:
                usage[name] = value
    return usage


def _pretty(values: dict[str, Quantity]) -> str:
    return ",".join(f"{name}={values[name]}" for name in sorted(values))


class Admission:
    """The admission chain of the fake server; ``webhooks`` may be changed by a test at any time."""

    def __init__(self, store: Store):
        self.store = store
        self.webhooks: list[Webhook] = []

    # -------------------------------------------------------------------------------------------- mutating
    def mutate(self, plural: str, obj: dict[str, Any], namespace: str) -> None:
        """LimitRanger's defaults and the pod's priority (the name may still be empty: ``generateName``)."""
        if plural != "pods":
            return
        spec = obj.setdefault("spec", {})
        pod_name = obj["metadata"].get("name", "")  # before the name is generated: a generateName pod is "pods"
        subject = f'pods "{pod_name}"' if pod_name else "pods"
        account = spec.get("serviceAccountName") or "default"
        if self.store.get("serviceaccounts", namespace, account) is None:
            raise ApiError(403, "Forbidden", f"{subject} is forbidden: error looking up service account "
                           f'{namespace}/{account}: serviceaccount "{account}" not found', {"name": pod_name,
                                                                                             "kind": "pods"})
        for item in self._limit_items(namespace):
            for container in _containers(spec):
                resources = container.setdefault("resources", {})
                for section, key in (("limits", "default"), ("requests", "defaultRequest")):
                    for name, value in (item.get(key) or {}).items():
                        resources.setdefault(section, {}).setdefault(name, value)
        name = spec.get("priorityClassName")
        if name:
            found = self.store.get("priorityclasses", "", name)
            if found is None:
                raise ApiError(403, "Forbidden", f"{subject} is forbidden: no PriorityClass with name {name} was found",
                               {"name": pod_name, "kind": "pods"})
            spec["priority"] = found["value"]
            spec["preemptionPolicy"] = found.get("preemptionPolicy", "PreemptLowerPriority")
        else:
            default = next((c for c in self.store.list("priorityclasses") if c.get("globalDefault")), None)
            spec["priority"] = default["value"] if default else 0
            if default:
                spec["priorityClassName"] = default["metadata"]["name"]

    def _limit_items(self, namespace: str) -> list[dict[str, Any]]:
        return [item for limit_range in self.store.list("limitranges", namespace)
                for item in (limit_range.get("spec") or {}).get("limits") or [] if item.get("type") == "Container"]

    # ------------------------------------------------------------------------------------------ validating
    def validate(self, plural: str, obj: dict[str, Any], namespace: str) -> None:
        """LimitRanger's bounds, the webhooks, then the quotas (the name is generated by now)."""
        resource = RESOURCES[plural]
        name = obj["metadata"]["name"]
        if plural == "pods":
            problems = self._limit_problems(obj)
            if problems:
                raise forbidden("pods", "", name, aggregate(problems))
        for webhook in self.webhooks:
            if plural in webhook.resources:
                raise webhook.error()
        if plural == "pods":
            self._check_quota(resource.plural, name, namespace, pod_usage(obj), obj)
        elif resource.namespaced:
            counted = f"count/{plural}.{resource.group}" if resource.group else f"count/{plural}"
            self._check_quota(plural, name, namespace, {counted: Quantity(1)}, None)

    def _limit_problems(self, pod: dict[str, Any]) -> list[str]:
        problems = []
        for item in self._limit_items(pod["metadata"].get("namespace", "")):
            for container in _containers(pod.get("spec") or {}):
                resources = container.get("resources") or {}
                for name, text in (item.get("min") or {}).items():
                    request = (resources.get("requests") or {}).get(name)
                    if request is None:
                        problems.append(f"minimum {name} usage per Container is {text}.  No request is specified")
                    elif Quantity.parse(request).value < Quantity.parse(text).value:
                        problems.append(f"minimum {name} usage per Container is {text}, but request is {request}")
                for name, text in (item.get("max") or {}).items():
                    limit = (resources.get("limits") or {}).get(name)
                    if limit is None:
                        problems.append(f"maximum {name} usage per Container is {text}.  No limit is specified")
                    elif Quantity.parse(limit).value > Quantity.parse(text).value:
                        problems.append(f"maximum {name} usage per Container is {text}, but limit is {limit}")
        return problems

    def used(self, namespace: str, exclude: str | None = None) -> dict[str, Quantity]:
        """What the namespace uses now: its pods that have not ended, and its count of each kind."""
        used: dict[str, Quantity] = {}
        for pod in self.store.list("pods", namespace):
            if pod["metadata"]["name"] == exclude or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                continue
            for key, value in pod_usage(pod).items():
                used[key] = used[key] + value if key in used else value
        for plural, resource in RESOURCES.items():
            if resource.namespaced and plural != "pods":
                counted = f"count/{plural}.{resource.group}" if resource.group else f"count/{plural}"
                used[counted] = Quantity(len(self.store.list(plural, namespace)))
        return used

    def _check_quota(self, plural: str, name: str, namespace: str, requested: dict[str, Quantity],
                     pod: dict[str, Any] | None) -> None:
        resource = RESOURCES[plural]
        quotas = self.store.list("resourcequotas", namespace)
        if not quotas:
            return
        used = self.used(namespace, exclude=name if plural == "pods" else None)
        for quota in quotas:
            hard = {k: Quantity.parse(v) for k, v in ((quota.get("spec") or {}).get("hard") or {}).items()}
            if pod is not None:
                missing = self._unspecified(pod, hard)
                if missing:
                    raise forbidden(plural, resource.group, name,
                                    f"failed quota: {quota['metadata']['name']}: must specify {missing}")
            exceeded = [key for key in hard if key in requested
                        and (used.get(key, Quantity(0)) + requested[key]).value > hard[key].value]
            if exceeded:
                raise forbidden(plural, resource.group, name, f"exceeded quota: {quota['metadata']['name']}, "
                                f"requested: {_pretty({k: requested[k] for k in exceeded})}, "
                                f"used: {_pretty({k: used.get(k, Quantity(0)) for k in exceeded})}, "
                                f"limited: {_pretty({k: hard[k] for k in exceeded})}")

    @staticmethod
    def _unspecified(pod: dict[str, Any], hard: dict[str, Quantity]) -> str:
        """The compute resources a quota tracks that some container does not state (the quota must see them)."""
        missing: dict[str, list[str]] = {}
        for key in sorted(hard):
            section, _, name = key.partition(".") if key.startswith(("requests.", "limits.")) else ("requests", "", key)
            if name not in COMPUTE or section not in ("requests", "limits"):
                continue
            for container in (pod.get("spec") or {}).get("containers") or []:
                if name not in ((container.get("resources") or {}).get(section) or {}):
                    missing.setdefault(key, []).append(container.get("name", ""))
        return "; ".join(f"{key} for: {', '.join(names)}" for key, names in missing.items())

    def quota_status(self, quota: dict[str, Any]) -> dict[str, Any]:
        """``status.hard`` / ``status.used`` as the quota controller keeps them."""
        hard = (quota.get("spec") or {}).get("hard") or {}
        used = self.used(quota["metadata"]["namespace"])
        return {"hard": dict(hard), "used": {k: str(used.get(k, Quantity(0))) for k in hard}}
