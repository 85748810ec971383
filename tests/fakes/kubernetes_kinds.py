"""Defaults and validation of the kinds around a Job: Services, ConfigMaps, Secrets, PersistentVolumeClaims,
LimitRanges, ResourceQuotas, Namespaces, PriorityClasses (pkg/apis/core/validation, with the real messages), and
:func:`errors_for`, the validation of a new object of any kind the fake serves."""

from __future__ import annotations

import base64
import binascii
from typing import Any

from fakes.kubernetes_rules import (
    FieldError,
    Quantity,
    QuantityError,
    config_key,
    dns1035_label,
    dns1123_label,
    label_errors,
)
from fakes.kubernetes_validation import job_errors, meta_errors, pod_spec_errors, quantity_maps


def service_errors(service: dict[str, Any]) -> list[FieldError]:
    errors = meta_errors(service["metadata"], name_rule=dns1035_label)
    spec = service.get("spec") or {}
    names: set[str] = set()
    ports = spec.get("ports") or []
    if not ports and spec.get("clusterIP") != "None":
        errors.append(FieldError("Required", "spec.ports"))
    for i, port in enumerate(ports):
        number = port.get("port")
        if not isinstance(number, int) or not 1 <= number <= 65535:
            errors.append(FieldError("Invalid", f"spec.ports[{i}].port", "must be between 1 and 65535, inclusive",
                                     number))
        if len(ports) > 1 and not port.get("name"):
            errors.append(FieldError("Required", f"spec.ports[{i}].name"))
        if port.get("name") in names:
            errors.append(FieldError("Duplicate", f"spec.ports[{i}].name", value=port["name"]))
        names.add(port.get("name"))
    errors += label_errors(spec.get("selector"), "spec.selector")
    return errors


def default_service(service: dict[str, Any], cluster_ip: str) -> None:
    spec = service.setdefault("spec", {})
    spec.setdefault("type", "ClusterIP")
    spec.setdefault("sessionAffinity", "None")
    if spec.get("clusterIP") != "None":
        spec["clusterIP"] = cluster_ip
    spec["clusterIPs"] = [spec["clusterIP"]]
    spec.setdefault("ipFamilies", ["IPv4"])
    spec.setdefault("ipFamilyPolicy", "SingleStack")
    spec.setdefault("internalTrafficPolicy", "Cluster")
    for port in spec.get("ports") or []:
        port.setdefault("protocol", "TCP")
        port.setdefault("targetPort", port.get("port"))
    service["status"] = {"loadBalancer": {}}


def config_map_errors(config_map: dict[str, Any]) -> list[FieldError]:
    errors = meta_errors(config_map["metadata"])
    size = 0
    for section in ("data", "binaryData"):
        for key, value in (config_map.get(section) or {}).items():
            errors += [FieldError("Invalid", f"{section}[{key}]", m, key) for m in config_key(key)]
            size += len(key) + len(value)
    if size > 1024 * 1024:
        errors.append(FieldError("TooLong", "", "must have at most 1048576 bytes"))
    return errors


def default_limit_range(limit_range: dict[str, Any]) -> None:
    """A container item's default limit from max, default request from the default limit, then from min."""
    for item in (limit_range.get("spec") or {}).get("limits") or []:
        if item.get("type") != "Container":
            continue
        default = item.setdefault("default", {})
        request = item.setdefault("defaultRequest", {})
        for source, target in ((item.get("max") or {}, default), (default, request), (item.get("min") or {}, request)):
            for name, value in source.items():
                target.setdefault(name, value)


def quantity_errors(plural: str, obj: dict[str, Any]) -> list[FieldError]:
    """Negative quantities in a LimitRange or ResourceQuota."""
    errors = []
    for resources in quantity_maps(plural, obj):
        for name, text in resources.items():
            try:
                if Quantity.parse(text).value < 0:
                    errors.append(FieldError("Invalid", f"spec[{name}]", "must be greater than or equal to 0", text))
            except QuantityError:
                pass
    return errors


def decode_secret(secret: dict[str, Any]) -> None:
    """``stringData`` merged into ``data`` (base64), as the server stores a Secret; ``ValueError`` for ``data`` that
    is not base64 (the server cannot decode the body: 400)."""
    data = secret.setdefault("data", {})
    for key, value in data.items():
        try:
            base64.b64decode(value, validate=True)
        except (binascii.Error, TypeError):
            raise ValueError(f"illegal base64 data at input byte 0 (key {key})") from None
    for key, value in (secret.pop("stringData", None) or {}).items():
        data[key] = base64.b64encode(str(value).encode()).decode()
    secret.setdefault("type", "Opaque")


def secret_errors(secret: dict[str, Any]) -> list[FieldError]:
    errors = meta_errors(secret["metadata"])
    for key in secret.get("data") or {}:
        errors += [FieldError("Invalid", f"data[{key}]", m, key) for m in config_key(key)]
    return errors


def claim_errors(claim: dict[str, Any]) -> list[FieldError]:
    errors = meta_errors(claim["metadata"])
    spec = claim.get("spec") or {}
    if not spec.get("accessModes"):
        errors.append(FieldError("Required", "spec.accessModes", "at least 1 access mode is required"))
    for mode in spec.get("accessModes") or []:
        if mode not in ("ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod"):
            errors.append(FieldError("NotSupported", "spec.accessModes", value=mode, supported=[
                "ReadOnlyMany", "ReadWriteMany", "ReadWriteOnce", "ReadWriteOncePod"]))
    if "storage" not in ((spec.get("resources") or {}).get("requests") or {}):
        errors.append(FieldError("Required", "spec.resources[storage]"))
    return errors


def default_claim(claim: dict[str, Any]) -> None:
    """A claim is bound at once (the fake has a provisioner for every class)."""
    spec = claim.setdefault("spec", {})
    spec.setdefault("volumeMode", "Filesystem")
    spec.setdefault("storageClassName", "standard")
    spec["volumeName"] = f"pvc-{claim['metadata']['uid']}"
    claim["status"] = {"phase": "Bound", "accessModes": list(spec.get("accessModes") or []),
                       "capacity": dict((spec.get("resources") or {}).get("requests") or {})}


def errors_for(plural: str, obj: dict[str, Any], minor: int) -> list[FieldError]:
    """Validation of a new object of any kind the fake serves."""
    if plural == "jobs":
        return job_errors(obj, minor)
    if plural == "pods":
        return meta_errors(obj["metadata"]) + pod_spec_errors(obj.get("spec") or {}, "spec")
    if plural == "services":
        return service_errors(obj)
    if plural == "configmaps":
        return config_map_errors(obj)
    if plural == "secrets":
        return secret_errors(obj)
    if plural == "persistentvolumeclaims":
        return claim_errors(obj) + quantity_errors(plural, obj)
    if plural == "namespaces":
        return meta_errors(obj["metadata"], name_rule=dns1123_label)
    if plural == "priorityclasses":
        errors = meta_errors(obj["metadata"])
        if not isinstance(obj.get("value"), int):
            errors.append(FieldError("Required", "value"))
        return errors
    return meta_errors(obj["metadata"]) + quantity_errors(plural, obj)
