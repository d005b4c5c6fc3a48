"""The layout stays readable: imports point one way, and modules and functions stay small."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SERVICE = Path(__file__).resolve().parent.parent / "service"
# what each part may not import: the engine knows nothing of HTTP, balancing or the pipeline, the pipeline
# nothing of Flask or balancing, balancing nothing of the engine's insides, and nothing imports the harness
FORBIDDEN = {
    "engine": ("service.api", "service.app", "service.balance", "service.pipeline", "service.connection", "flask"),
    "pipeline": ("service.api", "service.app", "service.balance", "flask"),
    "balance": ("service.api", "service.app", "service.pipeline", "service.engine", "flask", "torch"),
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
