"""The rules a Kubernetes API server applies to every object, with its own wording: ``Status`` errors, field errors,
names, labels, resource quantities, and the fields a server of a given version knows.

The messages are the API server's (k8s.io/apimachinery/pkg/util/validation and .../api/errors), so that a client
that shows a refusal shows what a real cluster would say. One simplification: a field error's value that is not a
string or a number is written as JSON, where the server prints its Go value.
"""

from __future__ import annotations

import json
import re
import typing
from dataclasses import dataclass, field
from datetime import datetime, timezone
from fractions import Fraction
from typing import Any

from kubernetes.client import models as client_models

# ---------------------------------------------------------------------------------------------------------- errors


class ApiError(Exception):
    """A refusal: the HTTP code and the ``Status`` body the server answers."""

    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any] | None = None):
        super().__init__(message)
        self.code = code
        self.status: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                       "message": message, "reason": reason, "code": code}
        if details is not None:
            self.status["details"] = details


def _details(resource: str, group: str, name: str) -> dict[str, Any]:
    details = {"name": name, "kind": resource}
    if group:
        details["group"] = group
    return details


def qualified(resource_or_kind: str, group: str) -> str:
    """``jobs.batch`` / ``Job.batch``, or the bare name for the core group."""
    return f"{resource_or_kind}.{group}" if group else resource_or_kind


def not_found(resource: str, group: str, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{qualified(resource, group)} "{name}" not found', _details(resource, group, name))


def already_exists(resource: str, group: str, name: str) -> ApiError:
    return ApiError(409, "AlreadyExists", f'{qualified(resource, group)} "{name}" already exists',
                    _details(resource, group, name))


def conflict(resource: str, group: str, name: str) -> ApiError:
    return ApiError(409, "Conflict", f'Operation cannot be fulfilled on {qualified(resource, group)} "{name}": the '
                    "object has been modified; please apply your changes to the latest version and try again",
                    _details(resource, group, name))


def forbidden(resource: str, group: str, name: str, why: str) -> ApiError:
    return ApiError(403, "Forbidden", f'{qualified(resource, group)} "{name}" is forbidden: {why}',
                    _details(resource, group, name))


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def aggregate(messages: list[str]) -> str:
    """Several errors in one line, as the server's aggregate error writes them."""
    return messages[0] if len(messages) == 1 else "[" + ", ".join(messages) + "]"


@dataclass
class FieldError:
    """One field's error (k8s.io/apimachinery/pkg/util/validation/field.Error)."""

    kind: str  # Invalid | Required | NotSupported | Forbidden | Duplicate | TooLong | TooMany | NotFound
    field: str
    detail: str = ""
    value: Any = None
    supported: list[str] = field(default_factory=list)  # for NotSupported

    REASONS = {"Invalid": "FieldValueInvalid", "Required": "FieldValueRequired", "NotSupported": "FieldValueNotSupported",
               "Forbidden": "FieldValueForbidden", "Duplicate": "FieldValueDuplicate", "TooLong": "FieldValueTooLong",
               "TooMany": "FieldValueTooMany", "NotFound": "FieldValueNotFound"}

    def body(self) -> str:
        value = render_value(self.value)
        if self.kind == "Invalid":
            return f"Invalid value: {value}" + (f": {self.detail}" if self.detail else "")
        if self.kind == "Required":
            return "Required value" + (f": {self.detail}" if self.detail else "")
        if self.kind == "NotSupported":
            return f"Unsupported value: {value}: supported values: " + ", ".join(json.dumps(s) for s in self.supported)
        if self.kind == "Duplicate":
            return f"Duplicate value: {value}"
        if self.kind == "NotFound":
            return f"Not found: {value}"
        label = {"Forbidden": "Forbidden", "TooLong": "Too long", "TooMany": "Too many"}[self.kind]
        return f"{label}: {self.detail}"

    def __str__(self) -> str:
        return f"{self.field}: {self.body()}"


def render_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    return json.dumps(value, separators=(",", ":"))


def invalid(kind: str, group: str, name: str, errors: list[FieldError]) -> ApiError:
    """422 Invalid with one cause per field error, e.g. ``Job.batch "x" is invalid: metadata.name: Invalid value: …``."""
    details = {"name": name, "kind": kind, "causes": [{"reason": FieldError.REASONS[e.kind], "message": e.body(),
                                                       "field": e.field} for e in errors]}
    if group:
        details["group"] = group
    return ApiError(422, "Invalid", f'{qualified(kind, group)} "{name}" is invalid: '
                    f"{aggregate([str(e) for e in errors])}", details)


# ------------------------------------------------------------------------------------------------ names and labels

DNS1123_LABEL = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS1123_SUBDOMAIN = DNS1123_LABEL + r"(\." + DNS1123_LABEL + ")*"
DNS1035_LABEL = "[a-z]([-a-z0-9]*[a-z0-9])?"
QUALIFIED_NAME = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
LABEL_VALUE = "(" + QUALIFIED_NAME + ")?"
ENV_VAR_NAME = "[-._a-zA-Z][-._a-zA-Z0-9]*"
CONFIG_KEY = "[-._a-zA-Z0-9]+"


def regex_error(message: str, pattern: str, *examples: str) -> str:
    """The validation library's wording: ``… (e.g. 'my-name',  or '123-abc', regex used for validation is '…')``."""
    shown = " or ".join(f"'{e}', " for e in examples)
    return f"{message} (e.g. {shown}regex used for validation is '{pattern}')"


def max_len(limit: int) -> str:
    return f"must be no more than {limit} characters"


def _check(value: str, pattern: str, limit: int, message: str, *examples: str) -> list[str]:
    errors = [max_len(limit)] if len(value) > limit else []
    if not re.fullmatch(pattern, value):
        errors.append(regex_error(message, pattern, *examples))
    return errors


def dns1123_label(value: str) -> list[str]:
    return _check(value, DNS1123_LABEL, 63, "a lowercase RFC 1123 label must consist of lower case alphanumeric "
                  "characters or '-', and must start and end with an alphanumeric character", "my-name", "123-abc")


def dns1123_subdomain(value: str) -> list[str]:
    return _check(value, DNS1123_SUBDOMAIN, 253, "a lowercase RFC 1123 subdomain must consist of lower case "
                  "alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character",
                  "example.com")


def dns1035_label(value: str) -> list[str]:
    return _check(value, DNS1035_LABEL, 63, "a DNS-1035 label must consist of lower case alphanumeric characters or "
                  "'-', start with an alphabetic character, and end with an alphanumeric character", "my-name",
                  "abc-123")


def qualified_name(value: str) -> list[str]:
    """A label or annotation key: an optional DNS subdomain prefix and ``/``, then a name of at most 63 characters."""
    prefix, slash, name = value.rpartition("/")
    errors: list[str] = []
    if slash:
        if not prefix:
            errors.append("prefix part must be non-empty")
        else:
            errors += ["prefix part " + e for e in dns1123_subdomain(prefix)]
    if not name:
        errors.append("name part must be non-empty")
        return errors
    if len(name) > 63:
        errors.append("name part " + max_len(63))
    if not re.fullmatch(QUALIFIED_NAME, name):
        errors.append("name part " + regex_error("must consist of alphanumeric characters, '-', '_' or '.', and must "
                                                 "start and end with an alphanumeric character", QUALIFIED_NAME,
                                                 "MyName", "my.name", "123-abc"))
    return errors


def label_value(value: str) -> list[str]:
    return _check(value, LABEL_VALUE, 63, "a valid label must be an empty string or consist of alphanumeric "
                  "characters, '-', '_' or '.', and must start and end with an alphanumeric character", "MyValue",
                  "my_value", "12345")


def env_var_name(value: str) -> list[str]:
    if not re.fullmatch(ENV_VAR_NAME, value):
        return [regex_error("a valid environment variable name must consist of alphabetic characters, digits, '_', "
                            "'-', or '.', and must not start with a digit", ENV_VAR_NAME, "my.env-name", "MY_ENV.NAME",
                            "MyEnvName1")]
    return []


def config_key(value: str) -> list[str]:
    return _check(value, CONFIG_KEY, 253, "a valid config key must consist of alphanumeric characters, '-', '_' or "
                  "'.'", "key.name", "KEY_NAME", "key-name")


def label_errors(labels: Any, path: str) -> list[FieldError]:
    errors: list[FieldError] = []
    for key, value in (labels or {}).items():
        errors += [FieldError("Invalid", path, m, key) for m in qualified_name(key)]
        errors += [FieldError("Invalid", path, m, value) for m in label_value(str(value))]
    return errors


ANNOTATIONS_LIMIT = 256 * 1024


def annotation_errors(annotations: Any, path: str) -> list[FieldError]:
    errors: list[FieldError] = []
    for key in annotations or {}:
        errors += [FieldError("Invalid", path, m, key) for m in qualified_name(key.lower())]
    size = sum(len(k) + len(str(v)) for k, v in (annotations or {}).items())
    if size > ANNOTATIONS_LIMIT:
        errors.append(FieldError("TooLong", path, f"must have at most {ANNOTATIONS_LIMIT} bytes"))
    return errors


# ------------------------------------------------------------------------------------------------------ quantities

QUANTITY_PATTERN = "^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


class QuantityError(ValueError):
    """A string that is no resource quantity; the message is the API server's."""


@dataclass(frozen=True)
class Quantity:
    """A resource quantity: its exact value and whether it was written in binary (``Ki``…) or decimal units."""

    value: Fraction
    binary: bool = False

    @classmethod
    def parse(cls, text: Any) -> Quantity:
        if isinstance(text, bool) or not isinstance(text, (str, int, float)):
            raise QuantityError("cannot unmarshal into Quantity: quantities must be strings or numbers")
        match = re.match(QUANTITY_PATTERN, str(text))
        if not match:
            raise QuantityError(f"quantities must match the regular expression '{QUANTITY_PATTERN}'")
        number, suffix = match.groups()
        if not re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)", number):
            raise QuantityError("unable to parse numeric part of quantity")
        value = Fraction(number)
        if suffix in _BINARY:
            return cls(value * _BINARY[suffix], True)
        if suffix in _DECIMAL:
            return cls(value * Fraction(10) ** _DECIMAL[suffix])
        if re.fullmatch(r"[eE][-+]?\d+", suffix):
            return cls(value * Fraction(10) ** int(suffix[1:]))
        raise QuantityError("unable to parse quantity's suffix")

    def __add__(self, other: Quantity) -> Quantity:
        return Quantity(self.value + other.value, self.binary)

    def __str__(self) -> str:
        """The canonical form the server writes back (``1.5`` → ``1500m``, ``1024Mi`` → ``1Gi``)."""
        value = self.value
        if value == 0:
            return "0"
        sign = "-" if value < 0 else ""
        value = abs(value)
        if self.binary and value.denominator == 1:
            for suffix, size in reversed(_BINARY.items()):
                if value % size == 0:
                    return f"{sign}{value // size}{suffix}"
            return f"{sign}{value}"
        nanos = -(-value * 10**9 // 1)  # the server rounds up below a nano unit
        for suffix, exponent in sorted(_DECIMAL.items(), key=lambda item: -item[1]):
            scale = 10 ** (exponent + 9)
            if nanos % scale == 0:
                return f"{sign}{nanos // scale}{suffix}"
        return f"{sign}{nanos}n"


def quantity(text: Any) -> Quantity:
    return Quantity.parse(text)


def cannot_decode(kind: str, error: Exception) -> ApiError:
    """400 for a body the server cannot decode into its type (a bad quantity, a string where a number goes)."""
    return bad_request(f'{kind} in version "v1" cannot be handled as a {kind}: {error}')


# ------------------------------------------------------------------------------------ the fields a version knows

# (kind, path) -> the first minor version (1.x) whose default feature gates keep the field; older ones drop it.
GATED_FIELDS: dict[tuple[str, tuple[str, ...]], int] = {
    ("Job", ("spec", "backoffLimitPerIndex")): 29,  # JobBackoffLimitPerIndex: alpha 1.28, beta 1.29
    ("Job", ("spec", "maxFailedIndexes")): 29,
    ("Job", ("spec", "podReplacementPolicy")): 29,  # JobPodReplacementPolicy: beta 1.29
    ("Job", ("spec", "successPolicy")): 31,  # JobSuccessPolicy: beta 1.31
    ("Job", ("spec", "managedBy")): 32,  # JobManagedBy: beta 1.32
}


def minor_version(version: str) -> int:
    """``"1.31"`` → 31."""
    major, _, minor = version.lstrip("v").partition(".")
    if major != "1" or not minor.split(".")[0].isdigit():
        raise ValueError(f"version {version!r}: give the server's version as '1.MINOR', e.g. '1.31'")
    return int(minor.split(".")[0])


def drop_gated_fields(kind: str, obj: dict[str, Any], minor: int) -> list[str]:
    """Remove the fields that a server of version 1.``minor`` does not keep; returns their paths."""
    dropped = []
    for (gated_kind, path), since in GATED_FIELDS.items():
        if gated_kind != kind or minor >= since:
            continue
        parent = obj
        for key in path[:-1]:
            parent = parent.get(key) if isinstance(parent, dict) else None
        if isinstance(parent, dict) and path[-1] in parent:
            del parent[path[-1]]
            dropped.append(".".join(path))
    return dropped


def _model(annotation: Any) -> tuple[str, Any]:
    """What an annotation of the client's models holds: ("model", cls) | ("list", inner) | ("map", inner) | ("", None)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union:
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _model(inner[0]) if len(inner) == 1 else ("", None)
    if origin is typing.Annotated:
        return _model(typing.get_args(annotation)[0])
    if origin in (list, typing.List):  # noqa: UP006 (the client's annotations use typing.List)
        return "list", typing.get_args(annotation)[0]
    if origin in (dict, typing.Dict):  # noqa: UP006
        return "map", typing.get_args(annotation)[1]
    if isinstance(annotation, type) and hasattr(annotation, "from_dict") and hasattr(annotation, "model_fields"):
        return "model", annotation
    return "", None


def _properties(model: type) -> dict[str, Any]:
    names = getattr(model, f"_{model.__name__}__properties", None) or []
    return dict(zip(names, (f.annotation for f in model.model_fields.values()), strict=True))


def drop_unknown_fields(obj: Any, model_name: str, path: str = "") -> list[str]:
    """Remove the fields that the API's schema does not have (the client's models are that schema); returns their
    paths, as the server's ``unknown field "spec.x"`` warnings name them."""
    model = getattr(client_models, model_name, None)
    return _drop(obj, model, path) if model is not None else []


def _drop(obj: Any, model: type, path: str) -> list[str]:
    if not isinstance(obj, dict):
        return []
    known = _properties(model)
    dropped = []
    for key in list(obj):
        where = f"{path}.{key}" if path else key
        if key not in known:
            del obj[key]
            dropped.append(where)
            continue
        shape, inner = _model(known[key])
        value = obj[key]
        if shape == "model":
            dropped += _drop(value, inner, where)
        elif shape in ("list", "map"):
            inner_shape, inner_model = _model(inner)
            items = enumerate(value) if shape == "list" and isinstance(value, list) else \
                value.items() if shape == "map" and isinstance(value, dict) else []
            if inner_shape == "model":
                for index, item in items:
                    dropped += _drop(item, inner_model, f"{where}[{index}]")
    return dropped


# ----------------------------------------------------------------------------------------------------------- time

def now() -> str:
    """A timestamp as the API writes them (RFC 3339, seconds, UTC)."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str) -> datetime:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
