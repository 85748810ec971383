"""The fake Kubernetes API server's verbs, without HTTP: create, read, list, replace, patch, delete and evict, with
the real order of decoding, defaulting, admission, validation and storage, dry runs, and deletion with finalizers.

The order on create is the API server's: decode (unknown fields dropped with a warning, or refused with
``fieldValidation=Strict``; fields the server's version does not keep dropped; quantities parsed: a bad one is 400),
defaults, mutating admission (LimitRange defaults, priority; before a ``generateName`` becomes a name), the name,
validation (422), validating admission (LimitRange bounds, webhooks, quota: 403), then storage (409 when the name is
taken). ``dryRun=All`` does all of it and stores nothing.

Deletion: a pod on a node gets a ``deletionTimestamp`` and its grace period, and goes once the kubelet reports it
terminal and its finalizers are gone; a Job deleted without ``propagationPolicy`` orphans its pods (the batch/v1
default); ``Foreground`` keeps the Job (finalizer ``foregroundDeletion``) until the garbage collector has removed its
dependents, ``Background`` removes it at once and the dependents after, ``Orphan`` leaves the dependents.
"""

from __future__ import annotations

import copy
import uuid
from typing import Any

from fakes.kubernetes_admission import Admission
from fakes.kubernetes_jobs import generate_name
from fakes.kubernetes_kinds import decode_secret, default_claim, default_limit_range, default_service, errors_for
from fakes.kubernetes_rules import (
    ApiError,
    FieldError,
    QuantityError,
    already_exists,
    bad_request,
    cannot_decode,
    conflict,
    drop_gated_fields,
    drop_unknown_fields,
    invalid,
    minor_version,
    not_found,
    now,
)
from fakes.kubernetes_store import (
    RESOURCES,
    Resource,
    Store,
    matches,
    parse_field_selector,
    parse_label_selector,
)
from fakes.kubernetes_validation import (
    canonicalize_quantities,
    default_job,
    default_pod,
    default_pod_spec,
    job_update_errors,
)

FOREGROUND, ORPHAN = "foregroundDeletion", "orphan"
POD_MUTABLE_SPEC = ("activeDeadlineSeconds", "tolerations", "terminationGracePeriodSeconds")


def resource(plural: str) -> Resource:
    if plural not in RESOURCES:
        raise ApiError(404, "NotFound", "the server could not find the requested resource", {})
    return RESOURCES[plural]


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (the fake applies strategic merge patches the same way)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def json_patch(target: dict[str, Any], operations: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 JSON patch: add, replace, remove and test."""
    result = copy.deepcopy(target)
    for op in operations:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")]
        node: Any = result
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
        key: Any = int(last) if isinstance(node, list) and last != "-" else last
        kind = op["op"]
        if kind == "test" and node[key] != op["value"]:
            raise ApiError(422, "Invalid", f"the server rejected our request due to an error in our request: test "
                           f"failed at {op['path']}")
        if kind == "remove":
            del node[key]
        elif kind in ("add", "replace"):
            if isinstance(node, list) and kind == "add":
                node.insert(len(node) if key == "-" else key, op["value"])
            else:
                node[key] = op["value"]
    return result


class ApiCore:
    """The verbs of the fake server over a :class:`Store`, for a server of ``version`` (``"1.31"``)."""

    def __init__(self, store: Store, version: str = "1.31"):
        self.store = store
        self.version = version
        self.minor = minor_version(version)
        self.admission = Admission(store)
        self._service_ips = 0

    # ------------------------------------------------------------------------------------------------ reads
    def get(self, plural: str, namespace: str, name: str) -> dict[str, Any]:
        res = resource(plural)
        obj = self.store.get(plural, namespace if res.namespaced else "", name)
        if obj is None:
            raise not_found(plural, res.group, name)
        return self._shown(plural, obj)

    def list(self, plural: str, namespace: str | None, label_selector: str | None = None,
             field_selector: str | None = None) -> tuple[list[dict[str, Any]], str]:
        """The matching objects and the resourceVersion of the list."""
        resource(plural)
        labels, fields = parse_label_selector(label_selector), parse_field_selector(field_selector, plural)
        with self.store.lock:
            items = [self._shown(plural, o) for o in self.store.list(plural, namespace) if matches(o, labels, fields)]
            return items, str(self.store.rv)

    def _shown(self, plural: str, obj: dict[str, Any]) -> dict[str, Any]:
        res = RESOURCES[plural]
        obj.setdefault("apiVersion", res.api_version)
        obj.setdefault("kind", res.kind)
        if plural == "resourcequotas":
            obj["status"] = self.admission.quota_status(obj)
        return obj

    def require_namespace(self, namespace: str) -> None:
        if self.store.get("namespaces", "", namespace) is None:
            raise not_found("namespaces", "", namespace)

    # ------------------------------------------------------------------------------------------------ create
    def decode(self, res: Resource, body: Any, field_validation: str | None) -> tuple[dict[str, Any], list[str]]:
        """The body as the server reads it: unknown and version-gated fields dropped (their paths returned)."""
        if not isinstance(body, dict):
            raise bad_request(f'{res.kind} in version "v1" cannot be handled as a {res.kind}: the body is not an '
                              "object")
        obj = copy.deepcopy(body)
        unknown = drop_unknown_fields(obj, res.model)
        if unknown and field_validation == "Strict":
            raise bad_request(f'{res.kind} in version "v1" cannot be handled as a {res.kind}: strict decoding error: '
                              + ", ".join(f'unknown field "{path}"' for path in unknown))
        dropped = unknown + drop_gated_fields(res.kind, obj, self.minor)
        try:
            canonicalize_quantities(res.plural, obj)
            if res.plural == "secrets":
                decode_secret(obj)
        except (QuantityError, ValueError) as error:
            raise cannot_decode(res.kind, error) from None
        obj["apiVersion"], obj["kind"] = res.api_version, res.kind
        obj.setdefault("metadata", {})
        return obj, dropped

    def create(self, plural: str, namespace: str, body: Any, dry_run: bool = False,
               field_validation: str | None = None) -> tuple[dict[str, Any], list[str]]:
        """Create an object; returns it as stored (or as it would be, on a dry run) and the fields dropped."""
        res = resource(plural)
        namespace = namespace if res.namespaced else ""
        obj, dropped = self.decode(res, body, field_validation)
        meta = obj["metadata"]
        if res.namespaced:
            if meta.get("namespace") not in (None, namespace):
                raise bad_request("the namespace of the provided object does not match the namespace sent on the "
                                  "request")
            self.require_namespace(namespace)
            meta["namespace"] = namespace
        for key in ("resourceVersion", "deletionTimestamp", "deletionGracePeriodSeconds"):
            meta.pop(key, None)
        if plural == "pods":
            default_pod(obj)
        self.admission.mutate(plural, obj, namespace)
        if meta.get("generateName") and not meta.get("name"):
            meta["name"] = generate_name(meta["generateName"])
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now()
        self._defaults(plural, obj)
        errors = errors_for(plural, obj, self.minor)
        if errors:
            raise invalid(res.kind, res.group, meta.get("name") or meta.get("generateName", ""), errors)
        self.admission.validate(plural, obj, namespace)
        with self.store.lock:
            if self.store.get(plural, namespace, meta["name"]) is not None:
                raise already_exists(plural, res.group, meta["name"])
            if dry_run:
                obj["metadata"]["resourceVersion"] = ""
                return obj, dropped
            stored = self.store.put(plural, obj)
            if plural == "namespaces":  # what the service account controller makes in every namespace
                self.create("serviceaccounts", meta["name"], {"metadata": {"name": "default"}})
            return self._shown(plural, stored), dropped

    def _defaults(self, plural: str, obj: dict[str, Any]) -> None:
        if plural == "jobs":
            obj["metadata"]["generation"] = 1
            default_job(obj, obj["metadata"]["uid"], self.minor)
            obj["status"] = {}
        elif plural == "services":
            self._service_ips += 1
            default_service(obj, f"10.96.{self._service_ips // 250}.{self._service_ips % 250 + 2}")
        elif plural == "limitranges":
            default_limit_range(obj)
        elif plural == "persistentvolumeclaims":
            default_claim(obj)
        elif plural == "namespaces":
            obj["spec"] = {"finalizers": ["kubernetes"]}
            obj["status"] = {"phase": "Active"}
            obj["metadata"].setdefault("labels", {})["kubernetes.io/metadata.name"] = obj["metadata"]["name"]

    # ------------------------------------------------------------------------------------------------ update
    def replace(self, plural: str, namespace: str, name: str, body: Any, dry_run: bool = False,
                field_validation: str | None = None) -> tuple[dict[str, Any], list[str]]:
        res = resource(plural)
        obj, dropped = self.decode(res, body, field_validation)
        if obj["metadata"].get("name") not in (None, name):
            raise bad_request(f"the name of the object ({obj['metadata'].get('name')}) does not match the name on the "
                              f"URL ({name})")
        return self._update(res, namespace, name, obj, dry_run, check_version=True), dropped

    def patch(self, plural: str, namespace: str, name: str, patch: Any, content_type: str, dry_run: bool = False,
              field_validation: str | None = None) -> tuple[dict[str, Any], list[str]]:
        res = resource(plural)
        current = self.get(plural, namespace, name)
        if "json-patch" in content_type:
            if not isinstance(patch, list):
                raise bad_request("the body of a JSON patch must be a list of operations")
            merged = json_patch(current, patch)
        elif "merge-patch" in content_type:
            if not isinstance(patch, dict):
                raise bad_request("the body of a merge patch must be an object")
            merged = merge_patch(current, patch)
        else:
            raise ApiError(415, "UnsupportedMediaType", "the body of the request was in an unknown format - accepted "
                           "media types include: application/json-patch+json, application/merge-patch+json, "
                           "application/apply-patch+yaml", {})
        obj, dropped = self.decode(res, merged, field_validation)
        check = isinstance(patch, dict) and "resourceVersion" in (patch.get("metadata") or {})
        return self._update(res, namespace, name, obj, dry_run, check_version=check), dropped

    def _update(self, res: Resource, namespace: str, name: str, obj: dict[str, Any], dry_run: bool,
                check_version: bool) -> dict[str, Any]:
        plural = res.plural
        namespace = namespace if res.namespaced else ""
        with self.store.lock:
            old = self.store.get(plural, namespace, name)
            if old is None:
                raise not_found(plural, res.group, name)
            meta = obj["metadata"]
            if check_version and meta.get("resourceVersion") not in (None, "", old["metadata"]["resourceVersion"]):
                raise conflict(plural, res.group, name)
            for key in ("name", "namespace", "uid", "creationTimestamp", "generation", "deletionTimestamp",
                        "deletionGracePeriodSeconds", "generateName"):
                if key in old["metadata"]:
                    meta[key] = old["metadata"][key]
            if "status" in old:
                obj["status"] = old["status"]  # the main resource does not write status
            errors = self._update_errors(plural, obj, old)
            if errors:
                raise invalid(res.kind, res.group, name, errors)
            if obj.get("spec") != old.get("spec") and "generation" in meta:
                meta["generation"] += 1
            if dry_run:
                return obj
            stored = self.store.put(plural, obj)
            self.settle(plural, namespace, name)
            return self._shown(plural, stored)

    def _update_errors(self, plural: str, new: dict[str, Any], old: dict[str, Any]) -> list[FieldError]:
        if plural == "jobs":
            default_pod_spec(new.setdefault("spec", {}).setdefault("template", {}).setdefault("spec", {}))
            return job_update_errors(new, old, self.minor)
        if plural == "pods":
            spec, old_spec = copy.deepcopy(new.get("spec") or {}), copy.deepcopy(old.get("spec") or {})
            for key in POD_MUTABLE_SPEC:
                spec.pop(key, None)
                old_spec.pop(key, None)
            for container in [*(spec.get("containers") or []), *(spec.get("initContainers") or []),
                              *(old_spec.get("containers") or []), *(old_spec.get("initContainers") or [])]:
                container.pop("image", None)
            if spec != old_spec:
                return [FieldError("Forbidden", "spec", "pod updates may not change fields other than "
                                   "`spec.containers[*].image`,`spec.initContainers[*].image`,"
                                   "`spec.activeDeadlineSeconds`,`spec.tolerations` (only additions to existing "
                                   "tolerations),`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it "
                                   "was previously negative)")]
            return []
        return errors_for(plural, new, self.minor)

    # ------------------------------------------------------------------------------------------------ delete
    def delete(self, plural: str, namespace: str, name: str, options: dict[str, Any] | None = None,
               dry_run: bool = False) -> dict[str, Any]:
        """Delete (or begin to); returns the object while it lingers, else a ``Success`` Status."""
        res = resource(plural)
        namespace = namespace if res.namespaced else ""
        options = options or {}
        with self.store.lock:
            obj = self.store.get(plural, namespace, name)
            if obj is None:
                raise not_found(plural, res.group, name)
            preconditions = options.get("preconditions") or {}
            for key in ("uid", "resourceVersion"):
                if preconditions.get(key) not in (None, obj["metadata"].get(key)):
                    raise conflict(plural, res.group, name)
            policy = options.get("propagationPolicy") or (ORPHAN if plural == "jobs" else "Background")
            if options.get("orphanDependents") is not None:
                policy = ORPHAN if options["orphanDependents"] else "Background"
            if policy not in ("Foreground", "Background", ORPHAN, "Orphan"):
                raise invalid("DeleteOptions", "meta.k8s.io", "", [FieldError(
                    "NotSupported", "propagationPolicy", value=policy, supported=["Foreground", "Background",
                                                                                   "Orphan", "nil"])])
            meta = obj["metadata"]
            finalizers = list(meta.get("finalizers") or [])
            if policy == "Foreground" and FOREGROUND not in finalizers:
                finalizers.append(FOREGROUND)
            if policy in ("Orphan", ORPHAN) and ORPHAN not in finalizers and plural != "pods":
                finalizers.append(ORPHAN)
            meta["finalizers"] = finalizers
            if not finalizers:
                meta.pop("finalizers")
            grace = options.get("gracePeriodSeconds")
            if plural == "pods":
                grace = (obj.get("spec") or {}).get("terminationGracePeriodSeconds", 30) if grace is None else grace
                if not (obj.get("spec") or {}).get("nodeName") or self.pod_terminal(obj):
                    grace = 0
            else:
                grace = 0
            if meta.get("deletionTimestamp") is None:
                meta["deletionTimestamp"] = now()
                meta["deletionGracePeriodSeconds"] = grace
            if dry_run:
                return self._shown(plural, obj)
            if not finalizers and grace == 0:
                gone = self.store.remove(plural, namespace, name)
                if plural == "pods":  # the pod registry answers with the deleted object
                    return self._shown(plural, gone or obj)
                return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                        "details": {"name": name, "group": res.group, "kind": plural,
                                    "uid": (gone or obj)["metadata"]["uid"]}}
            return self._shown(plural, self.store.put(plural, obj))

    @staticmethod
    def pod_terminal(pod: dict[str, Any]) -> bool:
        return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")

    def settle(self, plural: str, namespace: str, name: str) -> None:
        """Remove an object being deleted once nothing holds it: no finalizers and, for a pod, nothing running."""
        with self.store.lock:
            obj = self.store.get(plural, namespace, name)
            if obj is None or not obj["metadata"].get("deletionTimestamp") or obj["metadata"].get("finalizers"):
                return
            if plural == "pods" and (obj.get("spec") or {}).get("nodeName") and not self.pod_terminal(obj):
                return
            self.store.remove(plural, namespace, name)

    def remove_finalizer(self, plural: str, namespace: str, name: str, finalizer: str) -> None:
        def drop(obj: dict[str, Any]) -> None:
            remaining = [f for f in obj["metadata"].get("finalizers") or [] if f != finalizer]
            obj["metadata"]["finalizers"] = remaining
            if not remaining:
                obj["metadata"].pop("finalizers")

        self.store.update(plural, namespace, name, drop)
        self.settle(plural, namespace, name)

    def evict(self, namespace: str, name: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
        """The Eviction API: mark the pod ``DisruptionTarget`` (``EvictionByEvictionAPI``), then delete it."""
        pod = self.get("pods", namespace, name)
        if not self.pod_terminal(pod):
            def mark(obj: dict[str, Any]) -> None:
                conditions = [c for c in obj.setdefault("status", {}).get("conditions") or []
                              if c["type"] != "DisruptionTarget"]
                conditions.append({"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI",
                                   "message": "Eviction API: evicting", "lastProbeTime": None,
                                   "lastTransitionTime": now()})
                obj["status"]["conditions"] = conditions

            self.store.update("pods", namespace, name, mark)
        self.delete("pods", namespace, name, options)
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}
