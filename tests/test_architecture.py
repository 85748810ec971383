"""The layout's promises, checked on the source: small modules, no import cycles, one place for share
paths, one secret-name rule, front ends that ask a backend's capabilities instead of its name."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "nbbatch"
MODULES = sorted(SRC.rglob("*.py"))
MAX_LINES = 600


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(path: Path) -> set[str]:
    """nbbatch modules imported when ``path`` is imported (imports inside functions run later: not counted)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for inner in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
            if isinstance(inner, ast.ImportFrom) and inner.level == 0 and (inner.module or "").startswith("nbbatch"):
                found.add(inner.module)
                found.update(f"{inner.module}.{a.name}" for a in inner.names)  # `from nbbatch.x import module`
            elif isinstance(inner, ast.Import):
                found.update(a.name for a in inner.names if a.name.startswith("nbbatch"))
    return found


def test_no_module_is_over_600_lines():
    long = {str(p.relative_to(SRC)): n for p in MODULES if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these modules by concern: {long}"


def test_no_import_cycles():
    names = {_module_name(p): p for p in MODULES}
    graph = {name: {m for m in _top_level_imports(path) if m in names and m != name} for name, path in names.items()}
    state: dict[str, int] = {}

    def visit(name: str, stack: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep):] + [dep] if dep in stack else [name, dep]
                pytest.fail("import cycle: " + " → ".join(cycle))
            if dep not in state:
                visit(dep, [*stack, dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


SHARE_NAMES = re.compile(r"""["'](output\.ipynb|run\.json|log\.txt|telemetry\.json|CANCEL|experiment\.json)["']""")


def test_only_the_store_layout_names_share_files():
    offenders = [f"{p.relative_to(SRC)}:{i}" for p in MODULES if p.name != "layout.py"
                 for i, line in enumerate(p.read_text().splitlines(), 1) if SHARE_NAMES.search(line)]
    assert not offenders, f"use nbbatch.store.layout instead of literal share file names: {offenders}"


def test_one_secret_name_rule():
    offenders = [str(p.relative_to(SRC)) for p in MODULES if p.name != "redact.py" and '"PASSWORD"' in p.read_text()]
    assert not offenders, f"use nbbatch.redact.is_secret_name: {offenders}"


BACKEND_NAME_BRANCH = re.compile(r"""backend\s*[!=]=\s*["'](local|azureml|ray)["']""")


def test_front_ends_ask_capabilities_not_backend_names():
    front = [p for p in MODULES if "ui" in p.relative_to(SRC).parts or p.name == "api.py"]
    offenders = [f"{p.relative_to(SRC)}:{i}" for p in front
                 for i, line in enumerate(p.read_text().splitlines(), 1) if BACKEND_NAME_BRANCH.search(line)]
    assert not offenders, f"ask backend_class(name).capabilities instead: {offenders}"
