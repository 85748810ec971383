"""The experiment file's published JSON Schema (``nbbatch schema``), so editors validate ``experiment.yaml``
as people type (e.g. a ``# yaml-language-server: $schema=experiment.schema.json`` first line).

The schema is data (``experiment.schema.json``) and the one description of an experiment's *shape*:
:func:`shape_error` validates a file against it and turns the first error into nbbatch's own sentence
("did you mean" for a misspelt key). Where a generic sentence would not help, a schema node carries
its own ``errorMessage`` (a string, or one per keyword: the convention of VS Code and ajv-errors); ``{where}`` in
it is the failing value's place (``env.SEED``).
"""

from __future__ import annotations

import importlib.resources
import json
import re
import reprlib
from collections.abc import Iterable, Mapping
from functools import cache
from typing import TYPE_CHECKING, Any

from nbbatch.errors import SpecError, did_you_mean

if TYPE_CHECKING:
    import jsonschema
    from jsonschema.exceptions import ValidationError as SchemaError

SCHEMA_FILE = "experiment.schema.json"
_TYPE_WORDS = {"integer": "an integer", "number": "a number", "string": "a string", "boolean": "true or false",
               "object": "a mapping", "array": "a list"}
_DESCRIBED = ("type", "minimum", "exclusiveMinimum", "minItems", "minLength", "const", "oneOf", "anyOf", "pattern")
_JSON_TYPES: dict[str, tuple[type, ...]] = {"integer": (int,), "number": (int, float), "string": (str,),
                                            "boolean": (bool,), "object": (Mapping,), "array": (list,), "null": (type(None),)}


@cache
def experiment_schema() -> dict[str, Any]:
    """The JSON Schema of an experiment file (draft 2020-12)."""
    return json.loads(importlib.resources.files("nbbatch.spec").joinpath(SCHEMA_FILE).read_text("utf-8"))


def keys(*path: str) -> tuple[str, ...]:
    """The property names the schema allows at ``path`` (``keys()``: top level; ``keys("resources")``…)."""
    node = experiment_schema()
    for name in path:
        node = node["properties"][name]
    return tuple(node["properties"])


def parameter_name_problem(name: Any) -> str | None:
    """Why ``name`` cannot be a notebook parameter (papermill sets it as a Python variable), or ``None``: the
    schema's own rule for parameter names, for names that come from elsewhere (``nbbatch run -p NAME VALUE``)."""
    rule = experiment_schema()["$defs"]["identifier"]
    messages = rule["errorMessage"]
    if not isinstance(name, str):
        return messages["type"]
    if not re.fullmatch(rule["pattern"], name):
        return messages["pattern"]
    return messages["not"] if name in rule["not"]["enum"] else None


@cache
def _validator() -> jsonschema.Draft202012Validator:
    # jsonschema loads its format checkers' packages (rfc3987_syntax builds a grammar for a second): only when an
    # experiment is validated, so `import nbbatch.api` and the widgets stay quick
    import jsonschema

    return jsonschema.Draft202012Validator(experiment_schema())


def shape_error(data: Any) -> SpecError | None:
    """The first way ``data`` (an experiment file's YAML structure) breaks the schema, as one sentence; ``None`` if none."""
    first = next(iter(sorted(_validator().iter_errors(data), key=lambda e: _key_order(e.absolute_path))), None)
    return None if first is None else SpecError(_sentence(_closest(first)))


def _key_order(path: Iterable[Any]) -> list[int]:
    """Errors in the order of the schema's top-level keys, so the same file always names the same first mistake."""
    order = keys()
    return [order.index(p) if p in order else len(order) for p in list(path)[:1]]


def _closest(error: SchemaError) -> SchemaError:
    """Into a ``oneOf``/``anyOf``: the error of the one alternative the value's type picks (a list of notebooks, not a
    single one), so the sentence names the real mistake; the combinator itself where the type picks none or several."""
    if error.validator not in ("oneOf", "anyOf") or not error.context:
        return error
    alternatives = [_resolve(alt) for alt in error.validator_value]
    fits = [i for i, alt in enumerate(alternatives) if _type_fits(alt, error.instance)]
    if len(fits) != 1:
        return error
    inner = [e for e in error.context if e.relative_schema_path and e.relative_schema_path[0] == fits[0]]
    return _closest(inner[0]) if inner else error


def _type_fits(node: Mapping[str, Any], value: Any) -> bool:
    if "const" in node:
        return bool(node["const"] == value)
    names = node.get("type")
    if names is None:
        return False
    names = [names] if isinstance(names, str) else names
    if isinstance(value, bool):
        return "boolean" in names
    return any(isinstance(value, _JSON_TYPES[n]) for n in names)


def _resolve(node: Mapping[str, Any]) -> Mapping[str, Any]:
    """``node`` with a local ``$ref`` (``#/$defs/name``) followed."""
    while "$ref" in node:
        target: Any = experiment_schema()
        for part in node["$ref"].lstrip("#/").split("/"):
            target = target[part]
        node = target
    return node


def _error_message(error: SchemaError) -> str | None:
    """The ``errorMessage`` for ``error``: the deepest string one on the way from the schema's root to the failing
    keyword, or the failing node's own one for that keyword (``{"required": "..."}``)."""
    node: Any = experiment_schema()
    path = list(error.absolute_schema_path)
    found = None
    for part in path[:-1]:
        if isinstance(node, Mapping) and part not in node and "$ref" in node:
            node = _resolve(node)
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            return found
        message = _resolve(node).get("errorMessage") if isinstance(node, Mapping) else None
        found = message if isinstance(message, str) else found
    own = _resolve(node).get("errorMessage") if isinstance(node, Mapping) else None
    return own.get(error.validator, found) if isinstance(own, Mapping) else found


def _where(error: SchemaError) -> str:
    return ".".join(str(p) for p in error.absolute_path)


def _sentence(error: SchemaError) -> str:
    where, message, got = _where(error), _error_message(error), reprlib.repr(error.instance)
    if "propertyNames" in error.absolute_schema_path:  # a key of the mapping, not a value, is wrong
        choices = [str(c) for c in _resolve(error.schema).get("enum", ())]
        return f"`{where}`: {message or 'unknown key'} (got {got}){did_you_mean(str(error.instance), choices)}"
    if error.validator == "additionalProperties" and isinstance(error.instance, Mapping):
        allowed = list(error.schema.get("properties", ()))
        key = str(next(k for k in error.instance if k not in allowed))
        if not where:
            return f"unknown key `{key}` in the experiment{did_you_mean(key, allowed)}; known keys: {', '.join(allowed)}"
        return f"unknown key `{where}.{key}`{did_you_mean(key, allowed)}; {message or 'known: ' + ', '.join(allowed)}"
    if message:
        message = message.replace("{where}", where)
        return message if not where else f"{message} (got {got})"
    if error.validator == "enum":
        choices = [str(c) for c in error.validator_value]
        return f"`{where}` must be one of {', '.join(choices)} (got {got}){did_you_mean(str(error.instance), choices)}"
    if error.validator == "required":
        return f"`{where}` needs {error.message.removesuffix(' is a required property')}"
    if error.validator in _DESCRIBED:
        return f"`{where}` must be {_describe(_resolve(error.schema))} (got {got})"
    return f"`{where}`: {error.message}"


def _describe(node: Mapping[str, Any]) -> str:
    """What a schema node accepts, in words: ``an integer ≥ 1 or `auto```."""
    if "oneOf" in node or "anyOf" in node:
        return " or ".join(_describe(_resolve(alt)) for alt in node.get("oneOf") or node["anyOf"])
    if "const" in node:
        return f"`{node['const']}`"
    if "enum" in node:
        return "one of " + ", ".join(map(str, node["enum"]))
    names = node.get("type", ())
    names = [names] if isinstance(names, str) else [n for n in names if n != "null"]
    words = " or ".join(_TYPE_WORDS.get(n, n) for n in names) or "something else"
    if node.get("exclusiveMinimum") == 0:
        return "a positive number"
    if "minimum" in node:
        words += f" ≥ {node['minimum']}"
    if node.get("minItems") == 1:
        words = "a non-empty list"
    return words
