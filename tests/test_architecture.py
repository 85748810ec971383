"""The layout's promises, checked on the source: small modules and functions, no import cycles (counting the imports
inside functions too), layers that only import downwards, imports at the top of modules, one place for share paths,
one secret-name rule, no branch on a backend's name outside the registry (nor an import of a named backend's package),
one builder of run-one's command."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "nbbatch"
MODULES = sorted(SRC.rglob("*.py"))
MAX_LINES = 600
MAX_FUNCTION_LINES = 120

# The pipeline's layers, lowest first: a module imports only from its own layer or lower ones.
LAYERS = (
    ("nbbatch", "nbbatch.errors", "nbbatch.redact", "nbbatch.metrics", "nbbatch.data", "nbbatch.artifacts"),
    ("nbbatch.spec",),
    ("nbbatch.store",),
    ("nbbatch.plan",),
    ("nbbatch.execute",),
    ("nbbatch.containers",),
    ("nbbatch.backends",),
    ("nbbatch.results",),
    ("nbbatch.search",),
    ("nbbatch.drivers",),
    ("nbbatch.api",),
    ("nbbatch.ui", "nbbatch.widgets", "nbbatch.__main__"),
)

# What may be imported inside a function: the optional extras (pyproject's optional-dependencies), loaded only when a
# feature that needs them runs, and nbbatch's own modules that import an extra at their top.
OPTIONAL_EXTRAS = ("pandas", "matplotlib", "nbdime", "jinja2", "ipywidgets", "azure", "ray", "mlflow", "psutil",
                   "playwright", "optuna", "sklearn",
                   "IPython")  # the kernel's own: the widgets show through it, and `import nbbatch.widgets` must not load it
EXTRA_LOADERS = ("nbbatch.results.compare", "nbbatch.results.diff", "nbbatch.results.render", "nbbatch.ui.widgets",
                 "nbbatch.backends.azureml", "nbbatch.backends.ray")
# What takes a second to import loads when it is needed, so the front ends (`nbbatch --help`, `status`, `import
# nbbatch.api` and the widgets) start without it: the notebook runtime (papermill, nbclient, jupyter_client: when a
# command runs a notebook; tests/test_cli.py checks it) and jsonschema, also under nbformat's validator (its format
# checkers import rfc3987_syntax, which builds a grammar: when an experiment or a notebook is validated).
SLOW_TO_IMPORT = ("papermill", "nbclient", "jupyter_client", "jsonschema", "nbformat", "nbbatch.execute.attempts",
                  "nbbatch.execute.engine")
FAST_STARTING = ("nbbatch.api", "nbbatch.ui", "nbbatch.plan", "nbbatch.spec.schema")


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


NAMES = {_module_name(p): p for p in MODULES}


def _imported(node: ast.Import | ast.ImportFrom) -> set[str]:
    """The modules an import statement names (``from nbbatch.x import y`` names nbbatch.x and, if a module, nbbatch.x.y)."""
    if isinstance(node, ast.ImportFrom):
        if node.level or not node.module:
            return set()
        return {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return {a.name for a in node.names}


def _type_checking_only(tree: ast.Module) -> set[int]:
    return {id(inner) for node in tree.body if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for inner in ast.walk(node)}


def _imports(path: Path) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement of a module that runs (not under TYPE_CHECKING), and whether it sits inside a function."""
    tree = ast.parse(path.read_text())
    skipped = _type_checking_only(tree)
    in_function = {id(inner) for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for inner in ast.walk(node)}
    return [(node, id(node) in in_function) for node in ast.walk(tree)
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skipped]


def _graph(top_level_only: bool) -> dict[str, set[str]]:
    return {name: {m for node, inside in _imports(path) if not (top_level_only and inside)
                   for m in _imported(node) if m in NAMES and m != name}
            for name, path in NAMES.items()}


def _layer(module: str) -> int:
    best = max(((len(prefix), i) for i, layer in enumerate(LAYERS) for prefix in layer
                if module == prefix or module.startswith(prefix + ".")), default=None)
    assert best is not None, f"{module} belongs to no layer: add it to LAYERS"
    return best[1]


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _allowed_inside_function(importer: str, module: str) -> bool:
    return module.split(".")[0] in OPTIONAL_EXTRAS or _within(module, EXTRA_LOADERS) or \
        (_within(importer, FAST_STARTING) and _within(module, SLOW_TO_IMPORT))


def test_no_module_is_over_600_lines():
    long = {str(p.relative_to(SRC)): n for p in MODULES if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these modules by concern: {long}"


def test_no_function_is_over_120_lines():
    long = {f"{p.relative_to(SRC)}:{node.name}": node.end_lineno - node.lineno + 1 for p in MODULES
            for node in ast.walk(ast.parse(p.read_text())) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES}
    assert not long, f"split these functions into steps: {long}"


@pytest.mark.parametrize("top_level_only", [True, False], ids=["at-import", "counting-imports-in-functions"])
def test_no_import_cycles(top_level_only):
    graph = _graph(top_level_only)
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


def test_layers_import_only_downwards():
    upward = sorted(f"{name} → {dep}" for name, deps in _graph(top_level_only=False).items() for dep in deps
                    if _layer(dep) > _layer(name))
    assert not upward, "these imports run back up the pipeline's layers (move the code they need down): " + \
        "; ".join(upward)


def _loaded(node: ast.Import | ast.ImportFrom) -> set[str]:
    """The modules an import statement loads for what it names: ``from nbbatch.x import y`` loads nbbatch.x.y when that
    is a module, else nbbatch.x."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names}
    return {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in NAMES else str(node.module) for a in node.names}


def test_imports_sit_at_the_top_of_modules():
    inside = sorted(f"{p.relative_to(SRC)}:{node.lineno} {ast.unparse(node)}" for p in MODULES
                    for node, in_function in _imports(p) if in_function
                    and not all(_allowed_inside_function(_module_name(p), m) for m in _loaded(node)))
    assert not inside, ("import these at the top of the module (only the optional extras' loaders may wait until a "
                        "function runs): " + "; ".join(inside))


SHARE_NAMES = re.compile(r"""["'](output\.ipynb|run\.json|log\.txt|telemetry\.json|CANCEL|experiment\.json)["']""")


def test_only_the_store_layout_names_share_files():
    offenders = [f"{p.relative_to(SRC)}:{i}" for p in MODULES if p.name != "layout.py"
                 for i, line in enumerate(p.read_text().splitlines(), 1) if SHARE_NAMES.search(line)]
    assert not offenders, f"use nbbatch.store.layout instead of literal share file names: {offenders}"


def test_one_secret_name_rule():
    offenders = [str(p.relative_to(SRC)) for p in MODULES if p.name != "redact.py" and '"PASSWORD"' in p.read_text()]
    assert not offenders, f"use nbbatch.redact.is_secret_name: {offenders}"


BUILT_IN_BACKENDS = ("local", "azureml", "ray", "slurm", "kubernetes")
REGISTRY = "nbbatch.backends"  # registers the built-in backends by name (nbbatch/backends/__init__.py)


def _is_backend_name(node: ast.AST) -> bool:
    """A backend's name as a literal, or a tuple, list or set holding one (``name in ("azureml", "ray")``)."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_backend_name(item) for item in node.elts)
    return isinstance(node, ast.Constant) and node.value in BUILT_IN_BACKENDS


def _backend_name_branches(tree: ast.Module) -> list[int]:
    """Lines that choose by a backend's name: comparisons with it (``==``, ``!=``, ``in``, ``match``), look-ups by it
    (``.get("azureml")``, ``table["slurm"]``) and tables keyed by it (``{"azureml": …}``)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            hit = any(_is_backend_name(operand) for operand in (node.left, *node.comparators))
        elif isinstance(node, ast.Call):
            hit = isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "pop", "setdefault") and \
                bool(node.args) and _is_backend_name(node.args[0])
        elif isinstance(node, ast.Subscript):
            hit = _is_backend_name(node.slice)
        elif isinstance(node, ast.Dict):
            hit = any(key is not None and _is_backend_name(key) for key in node.keys)
        elif isinstance(node, ast.MatchValue):
            hit = _is_backend_name(node.value)
        else:
            hit = False
        if hit:
            lines.append(node.lineno)
    return lines


def test_nothing_branches_on_a_backends_name():
    """Only the registry knows the backends by name: the rest asks a backend's class (capabilities, settings, hooks)."""
    offenders = [f"{p.relative_to(SRC)}:{line}" for p in MODULES if _module_name(p) != REGISTRY
                 for line in _backend_name_branches(ast.parse(p.read_text()))]
    assert not offenders, ("ask backend_class(name) (its capabilities, settings or hooks) instead of branching on a "
                           f"backend's name: {offenders}")


def test_only_the_registry_and_a_backends_own_package_import_it():
    """A named backend's package is imported by its own modules and the registry only (a new backend touches its own
    package plus one registration line)."""
    offenders = []
    for path in MODULES:
        importer = _module_name(path)
        for node, _inside in _imports(path):
            for module in _imported(node):
                named = next((f"{REGISTRY}.{b}" for b in BUILT_IN_BACKENDS if _within(module, (f"{REGISTRY}.{b}",))), None)
                if named and importer != REGISTRY and not _within(importer, (named,)):
                    offenders.append(f"{path.relative_to(SRC)}:{node.lineno} imports {module}")
    assert not offenders, f"reach a backend through the registry (nbbatch.backends) instead: {offenders}"


def test_the_built_in_backends_are_the_registrys():
    from nbbatch.backends import _BUILTIN

    assert set(BUILT_IN_BACKENDS) == set(_BUILTIN)


def test_the_guards_see_every_form_of_a_backend_name_branch():
    samples = ['if backend == "azureml": pass', 'if "slurm" != name: pass', 'ok = name in ("azureml", "ray")',
               'hook = table.get("azureml")', 'hook = table["slurm"]', 'table = {"local": None}',
               'match name:\n    case "ray": pass']
    assert all(_backend_name_branches(ast.parse(sample)) for sample in samples)
    assert not _backend_name_branches(ast.parse('record = new_record(run, backend="ray")\nbackend: str = "local"'))


# run-one's command as a backend once wrote it: the subcommand as a word of a command, followed by its options
RUN_ONE_COMMAND = re.compile(r"""^run-one$|\brun-one\s+(--|'|\{)"""
                             r"|--(spec-file|placement-file|container-image|container-engine|shared-gpu)\b")


def test_one_module_composes_run_ones_command():
    """Backends fill a LaunchSpec and ask nbbatch.execute.launch for the command; they never write run-one's words."""
    offenders = [f"{p.relative_to(SRC)}:{node.lineno}" for p in MODULES if p.relative_to(SRC) != Path("execute/launch.py")
                 for node in ast.walk(ast.parse(p.read_text()))
                 if isinstance(node, ast.Constant) and isinstance(node.value, str) and RUN_ONE_COMMAND.search(node.value)]
    assert not offenders, f"build run-one's command with nbbatch.execute.launch.launch_command: {offenders}"


MAX_PARALLEL_READ = re.compile(r"(options|settings)\.max_parallel\b")


def test_one_rule_for_max_parallel():
    offenders = [f"{p.relative_to(SRC)}:{i}" for p in MODULES if p.relative_to(SRC).as_posix() != "backends/base.py"
                 for i, line in enumerate(p.read_text().splitlines(), 1) if MAX_PARALLEL_READ.search(line)]
    assert not offenders, f"ask Backend.parallel_limit(options) how many runs go at once (one rule): {offenders}"
