"""Reading a notebook before it runs: its ``parameters`` cell, its kernel, and checking a run's
parameters against it (names with "did you mean", types where the default gives one)."""

from __future__ import annotations

import ast
import copy
import datetime
import json
import math
import reprlib
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from nbbatch.errors import ValidationError, did_you_mean

PARAMETERS_TAG = "parameters"
NBFORMAT = 4  # the major notebook format nbbatch, papermill and nbclient read (any 4.x)


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
    imports: frozenset[str] = frozenset()  # the modules its code cells import, dotted ones with their parents


def _read(path: Path) -> tuple[bytes, dict[str, Any]]:
    if not path.exists():
        raise ValidationError(f"notebook {path} does not exist; check the path in the experiment (relative paths "
                              "are resolved from the experiment file's folder)")
    if not path.is_file():
        raise ValidationError(f"{path} is not a notebook file (it is a folder or a special file)")
    try:
        content = path.read_bytes()
    except OSError as exc:
        raise ValidationError(f"cannot read the notebook {path}: {exc.strerror or exc}") from exc
    try:
        data = json.loads(content)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValidationError(f"{path} is not a notebook: it is not JSON ({exc})") from exc
    if not isinstance(data, dict) or "nbformat" not in data:
        raise ValidationError(f"{path} is not a notebook: it has no `cells`/`nbformat` (is it an .ipynb file?)")
    version = data["nbformat"]
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValidationError(f"{path} is not a notebook: its `nbformat` is {version!r}, not a version number")
    if version != NBFORMAT:  # checked before `cells`: nbformat 3 keeps its cells in `worksheets`
        raise ValidationError(_version_problem(path, version))
    if not isinstance(data.get("cells"), list):
        raise ValidationError(f"{path} is not a notebook: it has no `cells`/`nbformat` (is it an .ipynb file?)")
    problem = _schema_problem(data)
    if problem:
        raise ValidationError(f"{path} is not a valid notebook: {problem}. Open and save it in Jupyter, or fix it by hand")
    return content, data


def _version_problem(path: Path, version: int) -> str:
    """Why a notebook of another major nbformat version is refused, and what to do."""
    if version < NBFORMAT:
        return (f"{path} is nbformat {version}; convert it to nbformat {NBFORMAT}, the notebook format nbbatch reads: "
                f"`jupyter nbconvert --to notebook --nbformat {NBFORMAT} --inplace {path}` (or open and save it in Jupyter)")
    return (f"{path} is nbformat {version}, a notebook format newer than nbbatch knows; nbbatch "
            f"reads nbformat {NBFORMAT}: save it as nbformat {NBFORMAT} with the tool that wrote it")


def _schema_problem(data: dict[str, Any]) -> str | None:
    """The first way the notebook breaks the nbformat schema (what papermill would trip on later), or None."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. cells without ids in nbformat 4.5: nbformat fills them in
            import nbformat  # its validator imports jsonschema (a second): only when a notebook is planned

            nbformat.validate(copy.deepcopy(data))
    except nbformat.ValidationError as exc:
        message = getattr(exc, "message", None) or str(exc)
        return str(message).strip().splitlines()[0][:300]
    except Exception as exc:  # noqa: BLE001 - nbformat's validator itself trips on some shapes (cells that are numbers)
        return f"its structure is broken ({type(exc).__name__}: {str(exc)[:200]})"
    return None


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
    imports = _imports(_source(c) for c in data["cells"] if c.get("cell_type") == "code")
    return NotebookInfo(path, content, kernelspec.get("name"), language, bool(tagged), params, imports)


def _imports(sources: Iterable[str]) -> frozenset[str]:
    """Every module the cells import (``from a.b import c`` gives a, a.b and a.b.c: c may be a module). IPython's
    magics and shell lines are blanked first; a cell that still does not parse is skipped."""
    found: set[str] = set()
    for source in sources:
        code = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())
        try:
            tree = ast.parse(code)
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [f"{node.module}.{alias.name}" for alias in node.names if alias.name != "*"] or [node.module]
            else:
                continue
            for name in names:
                parts = name.split(".")
                found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return frozenset(found)


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


def check_literal(name: str, value: Any, non_finite: bool = False) -> None:
    """Parameters must be plain literals papermill injects as they are: numbers, strings, booleans, None,
    and lists or string-keyed dicts of those (what YAML and JSON hold). Anything else is refused, so the
    notebook never receives a value other than the one given (papermill would turn a tuple, set, bytes or
    object into its string). ``non_finite``: nan and ±inf are numbers too (papermill writes them as
    ``float('nan')`` in Python; a run's record, which is JSON, cannot hold them)."""
    try:
        problem = _not_literal(value, set(), non_finite)
    except RecursionError:
        problem = "nested too deeply"
    if problem:
        raise ValidationError(f"parameter `{name}` = {safe_repr(value)} is not a literal value ({problem}); parameters "
                              "must be numbers, strings, booleans, None, or lists/dicts (with string keys) of those")


def safe_repr(value: Any) -> str:
    """A short repr for messages (huge or odd values included)."""
    try:
        return reprlib.repr(value)
    except Exception:  # noqa: BLE001 - e.g. an int too large to print, an object whose __repr__ fails
        return f"<{type(value).__name__}>"


def _type_path(value: Any) -> str:
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _not_literal(value: Any, seen: set[int], non_finite: bool = False) -> str | None:
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        try:
            repr(value)
        except ValueError:
            return "an integer too large to write out"
        return None if type(value) is int else f"a {_type_path(value)}; convert it with int()"
    if isinstance(value, float):
        if type(value) is not float:
            return f"a {_type_path(value)}; convert it with float()"
        return None if non_finite or math.isfinite(value) else "not a finite number"
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return "a string that is not valid Unicode text"
        return None
    if isinstance(value, (list, dict)):
        if id(value) in seen:
            return "it contains itself"
        seen = seen | {id(value)}
        if isinstance(value, dict):
            bad = next((k for k in value if not isinstance(k, str)), None)
            if bad is not None:
                return f"dict key {safe_repr(bad)} is not a string"
            items = list(value.values())
        else:
            items = value
        for item in items:
            problem = _not_literal(item, seen, non_finite)
            if problem:
                return problem
        return None
    if isinstance(value, (datetime.date, datetime.time)):
        return f"a {_type_path(value)}; quote it in YAML to pass a string"
    return f"a {_type_path(value)}" + ("; use a list" if isinstance(value, (tuple, set, frozenset)) else "")


def validate_parameters(info: NotebookInfo, parameters: dict[str, Any], non_finite: bool = False) -> list[str]:
    """Check names and types against the parameters cell; return warnings (e.g. no parameters cell).
    ``non_finite``: accept nan and ±inf (see :func:`check_literal`)."""
    warnings: list[str] = []
    for name, value in parameters.items():
        check_literal(name, value, non_finite)
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
                f"(its default is {safe_repr(declared.default)}) but was given {_type_name(value)} {safe_repr(value)}"
            )
    return warnings
