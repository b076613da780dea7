"""The library's modules import each other without a circle (module-level and function-level imports alike)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

PACKAGE = REPO / "h2o_cli"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_nodes(tree: ast.AST):
    """Every node of `tree` except those under `if TYPE_CHECKING:`."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            yield from (child for orelse in node.orelse for child in [orelse, *runtime_nodes(orelse)])
            continue
        yield node
        yield from runtime_nodes(node)


def import_graph() -> dict[str, set[str]]:
    """Module -> the h2o_cli modules it names in any import statement, at any depth of its code.

    `from h2o_cli.x import y` counts as importing `h2o_cli.x.y` when that is a module, else `h2o_cli.x`.
    A package's own `__init__` running first (Python's doing, not an import statement) is not an edge, nor
    an import under `if TYPE_CHECKING:` (it never runs).
    """
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for node in runtime_nodes(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                edges |= {alias.name for alias in node.names if alias.name in modules}
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("h2o_cli"):
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    edges.add(submodule if submodule in modules else node.module)
        graph[name] = {edge for edge in edges if edge in modules and edge != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a list of modules, or None (depth-first search with colours)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for edge in sorted(graph[node]):
            if state.get(edge) == 1:
                return path[path.index(edge) :] + [edge]
            if edge not in state and (cycle := visit(edge)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_sees_function_level_imports():
    graph = import_graph()
    assert "h2o_cli.models" in graph["h2o_cli.cli.common"]  # `from h2o_cli.models import load_model` …
    assert (
        "h2o_cli.cache.attention" in graph["h2o_cli.cache.model_cache"]
    )  # … and the lazy `from h2o_cli.cache.attention import enable`


def test_library_has_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_memory_is_a_leaf():
    """Memory accounting only does arithmetic on a ModelShape: it imports nothing of h2o_cli."""
    assert import_graph()["h2o_cli.memory"] == set()


@pytest.mark.parametrize("first", ["h2o_cli.memory", "h2o_cli.models.families"])
def test_each_entry_module_imports_first_in_a_fresh_interpreter(first):
    code = f"import {first}; import h2o_cli.cache, h2o_cli.models, h2o_cli.memory, h2o_cli.runtime"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120)
