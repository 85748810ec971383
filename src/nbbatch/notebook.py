"""Reading a notebook before it runs: its ``parameters`` cell, its kernel, and checking a run's
parameters against it (names with "did you mean", types where the default gives one)."""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from .errors import ValidationError, did_you_mean

PARAMETERS_TAG = "parameters"


@dataclass(frozen=True)
class NotebookParameter:
    """One name assigned in the parameters cell, with its default when it is a literal."""

    name: str
    default: Any = None
    has_literal_default: bool = False


@dataclass(frozen=True)
class NotebookInfo:
    """What validation needs to know about a notebook."""

    path: Path
    content: bytes
    kernel: str | None  # from metadata.kernelspec.name
    language: str | None
    has_parameters_cell: bool
    parameters: dict[str, NotebookParameter] = field(default_factory=dict)


def _read(path: Path) -> tuple[bytes, dict[str, Any]]:
    if not path.exists():
        raise ValidationError(f"notebook {path} does not exist; check the path in the experiment (relative paths "
                              "are resolved from the experiment file's folder)")
    content = path.read_bytes()
    try:
        data = json.loads(content)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValidationError(f"{path} is not a notebook: it is not JSON ({exc})") from exc
    if not isinstance(data, dict) or not isinstance(data.get("cells"), list) or "nbformat" not in data:
        raise ValidationError(f"{path} is not a notebook: it has no `cells`/`nbformat` (is it an .ipynb file?)")
    if data.get("nbformat", 0) < 4:
        raise ValidationError(f"{path} is nbformat {data.get('nbformat')}; convert it to nbformat 4 "
                              "(`jupyter nbconvert --to notebook --nbformat 4`)")
    return content, data


def _source(cell: dict[str, Any]) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else str(source)


def _parse_parameters(path: Path, source: str) -> dict[str, NotebookParameter]:
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise ValidationError(f"the parameters cell of {path.name} is not valid Python (line {exc.lineno}: {exc.msg})") from exc
    found: dict[str, NotebookParameter] = {}
    for node in tree.body:
        targets: list[ast.expr] = []
        value: ast.expr | None = None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        for target in targets:
            if isinstance(target, ast.Name) and value is not None:
                try:
                    default, literal = ast.literal_eval(value), True
                except (ValueError, SyntaxError, TypeError):
                    default, literal = None, False
                found[target.id] = NotebookParameter(target.id, default, literal)
    return found


@lru_cache(maxsize=256)
def _inspect_cached(path: Path, mtime_ns: int) -> NotebookInfo:
    content, data = _read(path)
    tagged = [c for c in data["cells"] if PARAMETERS_TAG in (c.get("metadata", {}).get("tags") or [])]
    if len(tagged) > 1:
        raise ValidationError(f"{path.name} has {len(tagged)} cells tagged `parameters`; papermill injects after "
                              "the first only, so keep exactly one (remove the tag from the others)")
    kernelspec = data.get("metadata", {}).get("kernelspec") or {}
    language = (data.get("metadata", {}).get("language_info") or {}).get("name") or kernelspec.get("language")
    params = _parse_parameters(path, _source(tagged[0])) if tagged else {}
    return NotebookInfo(path, content, kernelspec.get("name"), language, bool(tagged), params)


def inspect_notebook(path: str | Path) -> NotebookInfo:
    """Read ``path`` and its parameters cell; raise a clear error when it is not a usable notebook."""
    path = Path(path).resolve()
    mtime = path.stat().st_mtime_ns if path.exists() else 0
    return _inspect_cached(path, mtime)


def _type_name(value: Any) -> str:
    return type(value).__name__


def _compatible(default: Any, value: Any) -> bool:
    if default is None or value is None:
        return True
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(default, bool) and isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float))
    if isinstance(default, int):
        return isinstance(value, int)
    if isinstance(default, (list, tuple)):
        return isinstance(value, (list, tuple))
    return isinstance(value, type(default))


def check_literal(name: str, value: Any) -> None:
    """Parameters must be plain literals (numbers, strings, booleans, None, lists/dicts of them)."""
    try:
        ok = ast.literal_eval(repr(value)) == value
    except (ValueError, SyntaxError, TypeError, RecursionError):
        ok = False
    if not ok:
        raise ValidationError(f"parameter `{name}` = {value!r} is not a literal value; parameters must be numbers, "
                              "strings, booleans, None, or lists/dicts of those")


def validate_parameters(info: NotebookInfo, parameters: dict[str, Any]) -> list[str]:
    """Check names and types against the parameters cell; return warnings (e.g. no parameters cell)."""
    warnings: list[str] = []
    for name, value in parameters.items():
        check_literal(name, value)
    if not info.has_parameters_cell:
        if parameters:
            warnings.append(f"{info.path.name} has no cell tagged `parameters`: the parameters are injected at the "
                            "top and their names cannot be checked")
        return warnings
    for name, value in parameters.items():
        if name not in info.parameters:
            raise ValidationError(
                f"parameter `{name}` is not in {info.path.name}'s parameters cell{did_you_mean(name, info.parameters)}; "
                f"its parameters are: {', '.join(info.parameters) or '(none)'}"
            )
        declared = info.parameters[name]
        if declared.has_literal_default and not _compatible(declared.default, value):
            raise ValidationError(
                f"parameter `{name}` of {info.path.name} expects {_type_name(declared.default)} "
                f"(its default is {declared.default!r}) but was given {_type_name(value)} {value!r}"
            )
    return warnings
