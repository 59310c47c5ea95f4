"""The module graph stays a DAG and the library stays free of entry-layer concerns (STYLE.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.unit

PACKAGE = REPO / "distaccum"
ENTRY = {"cli", "verify_cli", "report_cli", "submit_cli", "__main__"}
ENTRY_ONLY_PACKAGES = {"hydra", "omegaconf"}


def _imports(path: Path, *, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _modules() -> dict[str, Path]:
    return {p.stem: p for p in PACKAGE.glob("*.py")}


def test_library_never_imports_the_entry_layer_or_hydra() -> None:
    for name, path in _modules().items():
        if name in ENTRY:
            continue
        for imported in _imports(path, top_level_only=False):
            root, _, leaf = imported.partition(".")
            assert root not in ENTRY_ONLY_PACKAGES, f"distaccum.{name} imports {imported} (entry layer only)"
            if root == "distaccum":
                assert leaf not in ENTRY, f"library module distaccum.{name} imports entry module {imported}"
        assert "sys.exit" not in path.read_text(), f"distaccum.{name} calls sys.exit (entry layer only)"


def test_module_level_imports_form_a_dag() -> None:
    graph = {name: {i.split(".", 1)[1] for i in _imports(path, top_level_only=True)
                    if i.startswith("distaccum.")} for name, path in _modules().items()}
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        if state.get(node) == 2:
            return
        assert state.get(node) != 1, "import cycle: " + " -> ".join([*trail, node])
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            visit(dep, [*trail, node])
        state[node] = 2

    for module in sorted(graph):
        visit(module, [])


def test_no_module_outgrows_its_concept() -> None:
    for name, path in _modules().items():
        lines = len(path.read_text().splitlines())
        assert lines <= 600, f"distaccum/{name}.py has {lines} lines: split it by concept"
