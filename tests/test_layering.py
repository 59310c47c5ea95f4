"""The module graph stays a DAG and the library stays free of entry-layer concerns (STYLE.md).

Imports are read from the source (``ast``), module level *and* inside function bodies, so a cycle
"dodged" with a function-local import is still a cycle here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.unit

PACKAGE = REPO / "distaccum"
ENTRY_PREFIXES = ("distaccum.cli", "distaccum.__main__")
ENTRY_ONLY_PACKAGES = {"hydra", "omegaconf"}


def _name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_name(p): p for p in PACKAGE.rglob("*.py") if "configs" not in p.parts}


def _imports(path: Path, module: str) -> set[str]:
    """Every module imported anywhere in ``path`` (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return names


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {i for i in _imports(path, name) if i in modules and i != name}
            for name, path in modules.items()}


def test_library_never_imports_the_entry_layer_or_hydra() -> None:
    for name, path in _modules().items():
        if name.startswith(ENTRY_PREFIXES):
            continue
        for imported in _imports(path, name):
            assert imported.split(".")[0] not in ENTRY_ONLY_PACKAGES, f"{name} imports {imported} (entry layer only)"
            assert not imported.startswith(ENTRY_PREFIXES), f"library module {name} imports entry module {imported}"
        assert "sys.exit" not in path.read_text(), f"{name} calls sys.exit (entry layer only)"


def test_imports_form_a_dag_including_function_local_ones() -> None:
    graph = _graph()
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        if state.get(node) == 2:
            return
        assert state.get(node) != 1, "import cycle: " + " -> ".join([*trail, node])
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if dep == "distaccum" or node == "distaccum":  # the package's lazy exports
                continue
            visit(dep, [*trail, node])
        state[node] = 2

    for module in sorted(graph):
        visit(module, [])


def test_the_checker_sees_cycles_hidden_in_function_bodies(tmp_path: Path) -> None:
    source = "def f():\n    from distaccum.loop import train\n"
    (tmp_path / "x.py").write_text(source)
    assert "distaccum.loop" in _imports(tmp_path / "x.py", "distaccum.x")


def test_engines_import_only_the_engine_base_and_leaf_modules() -> None:
    graph = _graph()
    for name, deps in graph.items():
        if name.startswith("distaccum.engines.") and name != "distaccum.engines.base":
            other_engines = {d for d in deps if d.startswith("distaccum.engines.")} - {
                "distaccum.engines.base", "distaccum.engines.comm_tap", "distaccum.engines.deepspeed_config",
                "distaccum.engines.ddp"}
            assert not other_engines, f"{name} imports {other_engines}"
            assert "distaccum.loop" not in deps and "distaccum.trainer" not in deps, name


def test_no_module_outgrows_its_concept() -> None:
    for name, path in _modules().items():
        lines = len(path.read_text().splitlines())
        assert lines <= 600, f"{name} has {lines} lines: split it by concept"
