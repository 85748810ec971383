"""What the fake API server fills in and refuses in Pods and Jobs: metadata, quantities, pod specs, the Job's
defaults and generated selector, and validation with the real field paths and messages (pkg/apis/core/validation,
pkg/apis/batch/validation, v1.31 unless the server's version says otherwise). The other kinds: kubernetes_kinds.py.

Each ``*_errors`` function returns a list of :class:`FieldError`; the server answers them as one 422 ``Invalid``.
Simplifications, on purpose: a Job's scheduling directives are immutable even while it is suspended, and only the
container fields a batch workload uses are checked (names, image, env, resources, ports, volume mounts).
"""

from __future__ import annotations

import re
from typing import Any

from fakes.kubernetes_jobs import (
    CONTROLLER_UID_LABEL,
    JOB_NAME_LABEL,
    LEGACY_CONTROLLER_UID_LABEL,
    LEGACY_JOB_NAME_LABEL,
)
from fakes.kubernetes_rules import (
    FieldError,
    Quantity,
    annotation_errors,
    dns1123_label,
    dns1123_subdomain,
    env_var_name,
    label_errors,
    qualified_name,
)

FIELD_PATHS = ["metadata.name", "metadata.namespace", "metadata.uid", "spec.nodeName", "spec.serviceAccountName",
               "status.hostIP", "status.hostIPs", "status.podIP", "status.podIPs"]
VOLUME_SOURCES = ("emptyDir", "hostPath", "persistentVolumeClaim", "nfs", "configMap", "secret", "csi", "projected",
                  "downwardAPI", "azureFile", "ephemeral", "image")
OVERCOMMITTABLE = ("cpu", "memory", "ephemeral-storage")  # requests may be below limits; others must equal them

# ------------------------------------------------------------------------------------------------------ metadata


def meta_errors(meta: dict[str, Any], name_rule=dns1123_subdomain, path: str = "metadata") -> list[FieldError]:
    """Name (or generateName), labels and annotations of any object."""
    errors: list[FieldError] = []
    name, prefix = meta.get("name"), meta.get("generateName")
    if not name and not prefix:
        errors.append(FieldError("Required", f"{path}.name", "name or generateName is required"))
    elif name:
        errors += [FieldError("Invalid", f"{path}.name", m, name) for m in name_rule(name)]
    if prefix:  # checked as a prefix: without its trailing dash
        errors += [FieldError("Invalid", f"{path}.generateName", m, prefix) for m in name_rule(prefix.rstrip("-") or "a")]
    errors += label_errors(meta.get("labels"), f"{path}.labels")
    errors += annotation_errors(meta.get("annotations"), f"{path}.annotations")
    return errors


# ----------------------------------------------------------------------------------------------------- quantities

def quantity_maps(plural: str, obj: dict[str, Any]) -> list[dict[str, Any]]:
    """The resource lists of an object (where quantities live)."""
    spec = obj.get("spec") or {}
    if plural in ("pods", "jobs"):
        pod_spec = spec if plural == "pods" else (spec.get("template") or {}).get("spec") or {}
        maps = []
        for container in [*(pod_spec.get("initContainers") or []), *(pod_spec.get("containers") or [])]:
            resources = container.get("resources") or {}
            maps += [resources[k] for k in ("requests", "limits") if isinstance(resources.get(k), dict)]
        return maps
    if plural == "limitranges":
        return [item[k] for item in spec.get("limits") or [] for k in ("default", "defaultRequest", "max", "min",
                                                                        "maxLimitRequestRatio")
                if isinstance(item.get(k), dict)]
    if plural == "resourcequotas":
        return [spec["hard"]] if isinstance(spec.get("hard"), dict) else []
    if plural == "persistentvolumeclaims":
        resources = spec.get("resources") or {}
        return [resources[k] for k in ("requests", "limits") if isinstance(resources.get(k), dict)]
    return []


def canonicalize_quantities(plural: str, obj: dict[str, Any]) -> None:
    """Rewrite every quantity in its canonical form (``1.5`` → ``1500m``); :class:`QuantityError` for one that does
    not parse (the server cannot decode the body: 400)."""
    for resources in quantity_maps(plural, obj):
        for key, value in resources.items():
            resources[key] = str(Quantity.parse(value))


# ---------------------------------------------------------------------------------------------------------- pods

def _is_extended(resource: str) -> bool:
    return "/" in resource and not resource.startswith("kubernetes.io/")


def resources_errors(resources: dict[str, Any], path: str) -> list[FieldError]:
    errors: list[FieldError] = []
    requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
    for section, values in (("limits", limits), ("requests", requests)):
        for name, text in values.items():
            where = f"{path}.{section}[{name}]"
            errors += [FieldError("Invalid", where, m, name) for m in qualified_name(name)]
            value = Quantity.parse(text)
            if value.value < 0:
                errors.append(FieldError("Invalid", where, "must be greater than or equal to 0", text))
            if _is_extended(name) and value.value.denominator != 1:
                errors.append(FieldError("Invalid", where, "must be an integer", text))
    for name, text in requests.items():
        request = Quantity.parse(text)
        if name in limits:
            limit = Quantity.parse(limits[name])
            if name not in OVERCOMMITTABLE and request.value != limit.value:
                errors.append(FieldError("Invalid", f"{path}.requests", f"must be equal to {name} limit of {limit}", text))
            elif request.value > limit.value:
                errors.append(FieldError("Invalid", f"{path}.requests",
                                         f"must be less than or equal to {name} limit of {limit}", text))
        elif name not in OVERCOMMITTABLE:
            errors.append(FieldError("Required", f"{path}.limits", "Limit must be set for non overcommitable resources"))
    return errors


def _env_errors(env: list[dict[str, Any]], path: str) -> list[FieldError]:
    errors: list[FieldError] = []
    for i, var in enumerate(env):
        where = f"{path}[{i}]"
        if not var.get("name"):
            errors.append(FieldError("Required", f"{where}.name"))
        else:
            errors += [FieldError("Invalid", f"{where}.name", m, var["name"]) for m in env_var_name(var["name"])]
        source = var.get("valueFrom")
        if source is None:
            continue
        if var.get("value"):
            errors.append(FieldError("Invalid", f"{where}.valueFrom", "may not be specified when `value` is not empty",
                                     ""))
        field_ref = source.get("fieldRef")
        if field_ref is not None:
            field_path = field_ref.get("fieldPath", "")
            keyed = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", field_path)
            if not keyed and field_path not in FIELD_PATHS:
                supported = sorted([*FIELD_PATHS, "metadata.annotations", "metadata.labels"])
                errors.append(FieldError("NotSupported", f"{where}.valueFrom.fieldRef.fieldPath", value=field_path,
                                         supported=supported))
    return errors


def _container_errors(container: dict[str, Any], path: str, volumes: set[str], is_pod: bool) -> list[FieldError]:
    errors: list[FieldError] = []
    name = container.get("name")
    if not name:
        errors.append(FieldError("Required", f"{path}.name"))
    else:
        errors += [FieldError("Invalid", f"{path}.name", m, name) for m in dns1123_label(name)]
    if is_pod and not container.get("image"):
        errors.append(FieldError("Required", f"{path}.image"))
    errors += _env_errors(container.get("env") or [], f"{path}.env")
    errors += resources_errors(container.get("resources") or {}, f"{path}.resources")
    for i, port in enumerate(container.get("ports") or []):
        number = port.get("containerPort")
        if not isinstance(number, int) or not 1 <= number <= 65535:
            errors.append(FieldError("Invalid", f"{path}.ports[{i}].containerPort",
                                     "must be between 1 and 65535, inclusive", number))
    paths: set[str] = set()
    for i, mount in enumerate(container.get("volumeMounts") or []):
        where = f"{path}.volumeMounts[{i}]"
        if not mount.get("name"):
            errors.append(FieldError("Required", f"{where}.name"))
        elif mount["name"] not in volumes:
            errors.append(FieldError("NotFound", f"{where}.name", value=mount["name"]))
        mount_path = mount.get("mountPath")
        if not mount_path:
            errors.append(FieldError("Required", f"{where}.mountPath"))
        elif mount_path in paths:
            errors.append(FieldError("Invalid", f"{where}.mountPath", "must be unique", mount_path))
        paths.add(mount_path or "")
    return errors


def _volume_errors(volumes: list[dict[str, Any]], path: str) -> list[FieldError]:
    errors: list[FieldError] = []
    seen: set[str] = set()
    for i, volume in enumerate(volumes):
        where, name = f"{path}[{i}]", volume.get("name")
        if not name:
            errors.append(FieldError("Required", f"{where}.name"))
        else:
            errors += [FieldError("Invalid", f"{where}.name", m, name) for m in dns1123_label(name)]
            if name in seen:
                errors.append(FieldError("Duplicate", f"{where}.name", value=name))
            seen.add(name)
        sources = [s for s in VOLUME_SOURCES if volume.get(s) is not None]
        if not sources:
            errors.append(FieldError("Required", where, "must specify a volume type"))
        elif len(sources) > 1:
            errors.append(FieldError("Forbidden", f"{where}.{sources[1]}", "may not specify more than 1 volume type"))
        claim = volume.get("persistentVolumeClaim")
        if claim is not None and not claim.get("claimName"):
            errors.append(FieldError("Required", f"{where}.persistentVolumeClaim.claimName"))
        nfs = volume.get("nfs")
        if nfs is not None:
            if not nfs.get("server"):
                errors.append(FieldError("Required", f"{where}.nfs.server"))
            if not str(nfs.get("path", "")).startswith("/"):
                errors.append(FieldError("Invalid", f"{where}.nfs.path", "must be an absolute path", nfs.get("path")))
    return errors


def pod_spec_errors(spec: dict[str, Any], path: str, is_pod: bool = True) -> list[FieldError]:
    """A pod's spec (``is_pod``) or a pod template's spec."""
    errors = _volume_errors(spec.get("volumes") or [], f"{path}.volumes")
    volumes = {v.get("name") for v in spec.get("volumes") or []}
    containers = spec.get("containers") or []
    if not containers:
        errors.append(FieldError("Required", f"{path}.containers"))
    names: set[str] = set()
    for group in ("initContainers", "containers"):
        for i, container in enumerate(spec.get(group) or []):
            errors += _container_errors(container, f"{path}.{group}[{i}]", volumes, is_pod)
            if container.get("name") in names:
                errors.append(FieldError("Duplicate", f"{path}.{group}[{i}].name", value=container["name"]))
            names.add(container.get("name"))
    policy = spec.get("restartPolicy", "Always")
    if policy not in ("Always", "OnFailure", "Never"):
        errors.append(FieldError("NotSupported", f"{path}.restartPolicy", value=policy,
                                 supported=["Always", "OnFailure", "Never"]))
    for key in ("hostname", "subdomain"):
        if spec.get(key):
            errors += [FieldError("Invalid", f"{path}.{key}", m, spec[key]) for m in dns1123_label(spec[key])]
    errors += label_errors(spec.get("nodeSelector"), f"{path}.nodeSelector")
    for i, toleration in enumerate(spec.get("tolerations") or []):
        operator = toleration.get("operator", "Equal")
        if operator not in ("Equal", "Exists"):
            errors.append(FieldError("NotSupported", f"{path}.tolerations[{i}].operator", value=operator,
                                     supported=["Equal", "Exists"]))
        effect = toleration.get("effect")
        if effect and effect not in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
            errors.append(FieldError("NotSupported", f"{path}.tolerations[{i}].effect", value=effect,
                                     supported=["NoExecute", "NoSchedule", "PreferNoSchedule"]))
    return errors


def default_pod_spec(spec: dict[str, Any]) -> None:
    """The defaults the API server fills into every pod spec (pod or template)."""
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("securityContext", {})
    for container in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        container.setdefault("terminationMessagePath", "/dev/termination-log")
        container.setdefault("terminationMessagePolicy", "File")
        image = container.get("image", "")
        latest = ":" not in image.rpartition("/")[2] or image.endswith(":latest")
        container.setdefault("imagePullPolicy", "Always" if latest and "@" not in image else "IfNotPresent")
        container.setdefault("resources", {})
    for volume in spec.get("volumes") or []:
        for source in ("configMap", "secret"):
            if isinstance(volume.get(source), dict):
                volume[source].setdefault("defaultMode", 420)


def default_pod(pod: dict[str, Any]) -> None:
    """A Pod's own defaults: its spec's, requests from limits where unset, and the status of a new pod."""
    spec = pod.setdefault("spec", {})
    default_pod_spec(spec)
    spec.setdefault("serviceAccountName", spec.get("serviceAccount", "default"))
    spec.setdefault("enableServiceLinks", True)
    spec.setdefault("preemptionPolicy", "PreemptLowerPriority")
    for container in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        resources = container["resources"]
        for name, value in (resources.get("limits") or {}).items():
            resources.setdefault("requests", {}).setdefault(name, value)
    pod["status"] = {"phase": "Pending", "qosClass": qos_class(spec)}


def qos_class(spec: dict[str, Any]) -> str:
    containers = [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
    sections = [c.get("resources") or {} for c in containers]
    if not any(s.get("requests") or s.get("limits") for s in sections):
        return "BestEffort"
    guaranteed = all(all(name in (s.get("limits") or {}) for name in ("cpu", "memory"))
                     and all(Quantity.parse(v).value == Quantity.parse((s.get("limits") or {}).get(k, v)).value
                             for k, v in (s.get("requests") or {}).items()) for s in sections)
    return "Guaranteed" if guaranteed else "Burstable"


# ---------------------------------------------------------------------------------------------------------- jobs

def default_job(job: dict[str, Any], uid: str, minor: int) -> None:
    """The Job's defaults, then the selector and template labels that the server generates (``PrepareForCreate``)."""
    spec = job.setdefault("spec", {})
    template = spec.setdefault("template", {})
    template_meta = template.setdefault("metadata", {})
    default_pod_spec(template.setdefault("spec", {}))
    if spec.get("completions") is None and spec.get("parallelism") is None:
        spec["completions"] = 1
    spec.setdefault("parallelism", 1)
    spec.setdefault("backoffLimit", 2**31 - 1 if spec.get("backoffLimitPerIndex") is not None else 6)
    spec.setdefault("completionMode", "NonIndexed")
    spec.setdefault("suspend", False)
    if minor >= 29:
        spec.setdefault("podReplacementPolicy", "Failed" if spec.get("podFailurePolicy") else "TerminatingOrFailed")
    for rule in (spec.get("podFailurePolicy") or {}).get("rules") or []:
        for pattern in rule.get("onPodConditions") or []:
            pattern.setdefault("status", "True")
    meta = job["metadata"]
    if not meta.get("labels") and template_meta.get("labels"):
        meta["labels"] = dict(template_meta["labels"])
    if spec.get("manualSelector"):
        return
    labels = template_meta.setdefault("labels", {})
    name = meta["name"]
    pairs = [(LEGACY_JOB_NAME_LABEL, name), (LEGACY_CONTROLLER_UID_LABEL, uid)]
    if minor >= 27:
        pairs += [(JOB_NAME_LABEL, name), (CONTROLLER_UID_LABEL, uid)]
    for key, value in pairs:
        labels.setdefault(key, value)
    match = spec.setdefault("selector", {}).setdefault("matchLabels", {})
    match.setdefault(CONTROLLER_UID_LABEL if minor >= 27 else LEGACY_CONTROLLER_UID_LABEL, uid)


def _selector_matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, op, values = expression.get("key"), expression.get("operator"), expression.get("values") or []
        ok = {"In": labels.get(key) in values, "NotIn": labels.get(key) not in values, "Exists": key in labels,
              "DoesNotExist": key not in labels}.get(op, False)
        if not ok:
            return False
    return True


def job_errors(job: dict[str, Any], minor: int) -> list[FieldError]:
    """ValidateJob: metadata, the generated selector, the spec, and the pod hostnames of an Indexed Job."""
    meta, spec = job["metadata"], job.get("spec") or {}
    errors = meta_errors(meta)
    template = spec.get("template") or {}
    labels = (template.get("metadata") or {}).get("labels") or {}
    selector = spec.get("selector")
    if not spec.get("manualSelector") and selector is not None:
        expected = {LEGACY_CONTROLLER_UID_LABEL: meta.get("uid"), LEGACY_JOB_NAME_LABEL: meta["name"]}
        if minor >= 27:
            expected |= {CONTROLLER_UID_LABEL: meta.get("uid"), JOB_NAME_LABEL: meta["name"]}
        for key, value in expected.items():
            if labels.get(key) != value:
                where = f"spec.template.metadata.labels[{key}]"
                errors.append(FieldError("Invalid", where, f"must be '{value}'", labels[key]) if key in labels else
                              FieldError("Required", where, f"must be '{value}'"))
        if not _selector_matches(selector, expected):
            errors.append(FieldError("Invalid", "spec.selector", "`selector` not auto-generated", selector))
    errors += job_spec_errors(spec, minor)
    completions = spec.get("completions")
    if spec.get("completionMode") == "Indexed" and isinstance(completions, int) and completions > 0:
        hostname = f"{meta['name']}-{completions - 1}"
        if dns1123_label(hostname):
            errors.append(FieldError("Invalid", "metadata.name",
                                     f"will not able to create pod with invalid DNS label: {hostname}", meta["name"]))
    return errors


def job_spec_errors(spec: dict[str, Any], minor: int) -> list[FieldError]:
    errors: list[FieldError] = []
    for key in ("parallelism", "completions", "activeDeadlineSeconds", "backoffLimit", "ttlSecondsAfterFinished",
                "backoffLimitPerIndex", "maxFailedIndexes"):
        if isinstance(spec.get(key), int) and spec[key] < 0:
            errors.append(FieldError("Invalid", f"spec.{key}", "must be greater than or equal to 0", spec[key]))
    if spec.get("maxFailedIndexes") is not None and spec.get("backoffLimitPerIndex") is None:
        errors.append(FieldError("Required", "spec.backoffLimitPerIndex", "when maxFailedIndexes is specified"))
    mode = spec.get("completionMode", "NonIndexed")
    if mode not in ("NonIndexed", "Indexed"):
        errors.append(FieldError("NotSupported", "spec.completionMode", value=mode, supported=["NonIndexed", "Indexed"]))
    if mode == "Indexed":
        if spec.get("completions") is None:
            errors.append(FieldError("Required", "spec.completions", "when completion mode is Indexed"))
        if (spec.get("parallelism") or 0) > 100000:
            errors.append(FieldError("Invalid", "spec.parallelism",
                                     "must be less than or equal to 100000 when completion mode is Indexed",
                                     spec["parallelism"]))
        if (spec.get("completions") is not None and spec.get("maxFailedIndexes") is not None
                and spec["maxFailedIndexes"] > spec["completions"]):
            errors.append(FieldError("Invalid", "spec.maxFailedIndexes", "must be less than or equal to completions",
                                     spec["maxFailedIndexes"]))
    else:
        for key in ("backoffLimitPerIndex", "maxFailedIndexes"):
            if spec.get(key) is not None:
                errors.append(FieldError("Invalid", f"spec.{key}", "requires indexed completion mode", spec[key]))
        if spec.get("successPolicy") is not None:
            errors.append(FieldError("Invalid", "spec.successPolicy", "requires indexed completion mode",
                                     spec["successPolicy"]))
    template = spec.get("template") or {}
    if not template.get("spec"):
        errors.append(FieldError("Required", "spec.template.spec.containers"))
    pod_spec = template.get("spec") or {}
    errors += label_errors((template.get("metadata") or {}).get("labels"), "spec.template.metadata.labels")
    errors += annotation_errors((template.get("metadata") or {}).get("annotations"),
                                "spec.template.metadata.annotations")
    errors += pod_spec_errors(pod_spec, "spec.template.spec", is_pod=False)
    policy = pod_spec.get("restartPolicy", "Always")
    if policy in ("Always", ""):
        errors.append(FieldError("Required", "spec.template.spec.restartPolicy", 'valid values: "OnFailure", "Never"'))
    elif policy not in ("OnFailure", "Never"):
        errors.append(FieldError("NotSupported", "spec.template.spec.restartPolicy", value=policy,
                                 supported=["OnFailure", "Never"]))
    elif spec.get("podFailurePolicy") is not None and policy != "Never":
        errors.append(FieldError("Invalid", "spec.template.spec.restartPolicy",
                                 'only "Never" is supported when podFailurePolicy is specified', policy))
    if spec.get("podFailurePolicy") is not None:
        errors += _pod_failure_policy_errors(spec, minor)
    return errors


def _pod_failure_policy_errors(spec: dict[str, Any], minor: int) -> list[FieldError]:
    errors: list[FieldError] = []
    actions = ["Count", "FailIndex", "FailJob", "Ignore"] if minor >= 29 else ["Count", "FailJob", "Ignore"]
    pod_spec = (spec.get("template") or {}).get("spec") or {}
    names = {c.get("name") for c in [*(pod_spec.get("containers") or []), *(pod_spec.get("initContainers") or [])]}
    for i, rule in enumerate(spec["podFailurePolicy"].get("rules") or []):
        path = f"spec.podFailurePolicy.rules[{i}]"
        action = rule.get("action", "")
        if not action:
            errors.append(FieldError("Required", f"{path}.action", "valid values: " + str(actions).replace("'", '"')))
        elif action not in actions:
            errors.append(FieldError("NotSupported", f"{path}.action", value=action, supported=actions))
        elif action == "FailIndex" and spec.get("backoffLimitPerIndex") is None:
            errors.append(FieldError("Invalid", f"{path}.action", "requires the backoffLimitPerIndex to be set", action))
        on_codes, on_conditions = rule.get("onExitCodes"), rule.get("onPodConditions") or []
        if on_codes is not None:
            errors += _exit_codes_errors(on_codes, f"{path}.onExitCodes", names)
        if on_codes is not None and on_conditions:
            errors.append(FieldError("Invalid", path, "specifying both OnExitCodes and OnPodConditions is not supported",
                                     "{}"))
        if on_codes is None and not on_conditions:
            errors.append(FieldError("Invalid", path, "specifying one of OnExitCodes and OnPodConditions is required",
                                     "{}"))
        for j, pattern in enumerate(on_conditions):
            if pattern.get("status", "True") not in ("True", "False", "Unknown"):
                errors.append(FieldError("NotSupported", f"{path}.onPodConditions[{j}].status",
                                         value=pattern.get("status"), supported=["False", "True", "Unknown"]))
    return errors


def _exit_codes_errors(on_codes: dict[str, Any], path: str, names: set[str]) -> list[FieldError]:
    errors: list[FieldError] = []
    operator = on_codes.get("operator", "")
    if operator not in ("In", "NotIn"):
        errors.append(FieldError("NotSupported", f"{path}.operator", value=operator, supported=["In", "NotIn"]))
    container = on_codes.get("containerName")
    if container is not None and container not in names:
        errors.append(FieldError("Invalid", f"{path}.containerName",
                                 "must be one of the container or initContainer names in the pod template", container))
    values = on_codes.get("values") or []
    if not values:
        errors.append(FieldError("Invalid", f"{path}.values", "at least one value is required", values))
    for j, value in enumerate(values):
        if operator == "In" and value == 0:
            errors.append(FieldError("Invalid", f"{path}.values[{j}]", "must not be 0 for the In operator", value))
        if value in values[:j]:
            errors.append(FieldError("Duplicate", f"{path}.values[{j}]", value=value))
    if values != sorted(values):
        errors.append(FieldError("Invalid", f"{path}.values", "must be ordered", values))
    return errors


def job_update_errors(new: dict[str, Any], old: dict[str, Any], minor: int) -> list[FieldError]:
    """ValidateJobUpdate: the spec again, and the fields that may not change."""
    errors = job_errors(new, minor)
    spec, old_spec = new.get("spec") or {}, old.get("spec") or {}
    for key in ("selector", "template", "completionMode", "podFailurePolicy", "backoffLimitPerIndex"):
        if spec.get(key) != old_spec.get(key):
            errors.append(FieldError("Invalid", f"spec.{key}", "field is immutable", spec.get(key)))
    completions = spec.get("completions")
    if completions != old_spec.get("completions"):  # elastic Indexed Jobs: only together with parallelism
        if spec.get("completionMode") != "Indexed":
            errors.append(FieldError("Invalid", "spec.completions", "field is immutable", completions))
        elif completions is not None and completions != spec.get("parallelism"):
            errors.append(FieldError("Invalid", "spec.completions",
                                     "can only be modified in tandem with spec.parallelism", completions))
    return errors
