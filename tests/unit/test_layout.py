"""The layout stays readable: imports point one way, and modules and functions stay small."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from harness.launch import ROOT

SERVICE = ROOT / "service"
# what each part may not import: only service.app and service.http speak HTTP (flask, werkzeug); the engine
# knows nothing of HTTP, balancing or the pipeline, the pipeline nothing of HTTP or balancing, balancing
# nothing of the engine's insides, and nothing imports the harness
HTTP = ("service.http", "flask", "werkzeug")
FORBIDDEN = {
    "engine": ("service.app", *HTTP, "service.balance", "service.pipeline"),
    "pipeline": ("service.app", *HTTP, "service.balance"),
    "balance": ("service.app", *HTTP, "service.pipeline", "service.engine", "torch"),
    "top level": HTTP,  # settings, errors, logs, metrics, cli
}
NEVER = ("bench", "tests", "harness")
MAX_MODULE_LINES = 330
MAX_FUNCTION_LINES = 45


def _modules() -> list[Path]:
    return sorted(SERVICE.rglob("*.py"))


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SERVICE)))
def test_imports_point_one_way(path: Path) -> None:
    part = path.relative_to(SERVICE).parts[0]
    if part.endswith(".py"):
        part = "app" if part == "app.py" else "top level"
    forbidden = FORBIDDEN.get(part, ()) + NEVER
    wrong = sorted(n for n in _imports(path) if any(n == f or n.startswith(f + ".") for f in forbidden))
    assert not wrong, f"{path.relative_to(SERVICE)} imports {wrong}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SERVICE)))
def test_modules_and_functions_stay_small(path: Path) -> None:
    source = path.read_text()
    assert source.count("\n") <= MAX_MODULE_LINES, f"{path.name} does more than one job?"
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            assert length <= MAX_FUNCTION_LINES, f"{path.name}:{node.name} is {length} lines"


def _module_name(path: Path) -> str:
    parts = path.relative_to(SERVICE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    """service module → the service modules it imports (``from service.x import y`` names y if it is one)."""
    names = {_module_name(p) for p in _modules()}
    graph: dict[str, set[str]] = {}
    for path in _modules():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in names}
            elif isinstance(node, ast.ImportFrom) and node.module in names:
                subs = {f"{node.module}.{a.name}" for a in node.names} & names
                edges |= subs or {node.module}
        graph[_module_name(path)] = edges - {_module_name(path)}
    return graph


def test_the_import_graph_has_no_cycle() -> None:
    """Imports inside functions count too: a lazy import is still a circle to read."""
    graph, state, path = _graph(), {}, []

    def visit(name: str) -> None:
        state[name] = "open"
        path.append(name)
        for dep in sorted(graph.get(name, ())):
            if state.get(dep) == "open":
                raise AssertionError(" -> ".join(path[path.index(dep):] + [dep]))
            if dep not in state:
                visit(dep)
        state[name] = "done"
        path.pop()

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_the_engines_unit_tests_never_sleep_to_let_something_happen() -> None:
    """They decide by a view in and a decision out, or wait on an event or a polled condition
    (``harness.polling``): a test that sleeps and hopes is slow on a quiet host and flaky on a busy one."""
    engine_tests = SERVICE.parent / "tests" / "unit" / "engine"
    sleeping = [f"{p.relative_to(engine_tests)}:{n}" for p in sorted(engine_tests.rglob("*.py"))
                for n, line in enumerate(p.read_text().splitlines(), 1) if "sleep(" in line]
    assert sleeping == []
