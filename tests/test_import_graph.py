"""The library's modules import each other without a circle (module-level and function-level imports alike),
and the layers depend downwards only: kernels on nothing of h2o_cli, settings on no policy, the cache on no
model loader, the library on no terminal package."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

PACKAGE = REPO / "h2o_cli"
KERNELS = REPO / "kernels" / "h2o_kernels"
TERMINAL_PACKAGES = ("typer", "rich", "prompt_toolkit")  # the CLI's; `h2o_cli/cli/` alone may import them


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


def imported_names(path: Path) -> set[str]:
    """Every module name `path` names in an import statement, at any depth (`from a.b import c`: `a.b`)."""
    names = set()
    for node in runtime_nodes(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for edge in graph[todo.pop()] - seen:
            seen.add(edge)
            todo.append(edge)
    return seen


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


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


@pytest.mark.heavy  # a fresh interpreter importing torch and transformers
@pytest.mark.parametrize("first", ["h2o_cli.memory", "h2o_cli.cache.families", "h2o_cli.config"])
def test_each_entry_module_imports_first_in_a_fresh_interpreter(first):
    code = f"import {first}; import h2o_cli.cache, h2o_cli.models, h2o_cli.memory, h2o_cli.runtime"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120)


def test_the_rules_see_a_breach():
    graph = {
        "h2o_cli.config": {"h2o_cli.x"},
        "h2o_cli.x": {"h2o_cli.policies.h2o"},
        "h2o_cli.policies.h2o": set(),
    }
    assert reachable(graph, "h2o_cli.config") == {"h2o_cli.x", "h2o_cli.policies.h2o"}
    assert within("h2o_cli.policies.h2o", "h2o_cli.policies") and not within(
        "h2o_cli.policy_registry", "h2o_cli.policies"
    )
    assert "rich.text" in imported_names(PACKAGE / "cli" / "panel.py")


def test_kernels_import_nothing_of_h2o_cli():
    """The kernels take buffers and shapes; they know nothing of the library's classes."""
    found = {
        f"{path.relative_to(REPO)}: {name}"
        for path in sorted(KERNELS.rglob("*.py"))
        for name in imported_names(path)
        if within(name, "h2o_cli")
    }
    assert not found, sorted(found)


def test_settings_import_no_policy():
    """Policies are built from the settings, not the reverse: `h2o_cli.config` reaches a policy by its name
    (`h2o_cli.policy_registry`), and imports no policy module, directly or through another."""
    found = {name for name in reachable(import_graph(), "h2o_cli.config") if within(name, "h2o_cli.policies")}
    assert not found, sorted(found)


def test_the_cache_imports_no_model_loader():
    """The cache takes a model and its shape; loading models is `h2o_cli.models`'s, which may use the cache."""
    graph = import_graph()
    found = {
        f"{name} -> {edge}"
        for name in graph
        if within(name, "h2o_cli.cache")
        for edge in reachable(graph, name)
        if within(edge, "h2o_cli.models")
    }
    assert not found, sorted(found)


def test_the_library_imports_no_terminal_package():
    """typer, rich and prompt_toolkit belong to the CLI (`h2o_cli/cli/`); the library below it never imports
    them, so it works (and imports) without a terminal."""
    found = {
        f"{path.relative_to(REPO)}: {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if "cli" not in path.relative_to(PACKAGE).parts[:-1]
        for name in imported_names(path)
        if any(within(name, package) for package in TERMINAL_PACKAGES)
    }
    assert not found, sorted(found)


@pytest.mark.heavy  # a fresh interpreter importing torch
def test_settings_check_policy_names_in_a_fresh_interpreter():
    """`h2o_cli.config` imports no policy, yet the built-in ones are registered before any settings exist."""
    code = (
        "from h2o_cli.config import CacheSettings\n"
        "from h2o_cli.errors import UsageError\n"
        "assert CacheSettings(budget=8, policy='sink', sinks=2).heavy == 2\n"
        "try:\n    CacheSettings(budget=8, policy='nope')\nexcept UsageError as error:\n    print(error)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=REPO, timeout=120, capture_output=True, text=True
    )
    assert "--policy 'nope' is unknown; choose one of h2o, local, sink, tova, full, recall" in done.stdout


CACHE_INSIDES = {"stores", "store", "recall_index"}  # the cache's layers' stores and recall slots
OWNERS = {"policy", "archive"}  # `cache.policy.x`, `layer.archive.x`: a policy's or an archive's fields
SUMMARIES = {"report"}  # `report.archive.x`: a field of the cache's public summary (`ArchiveReport`)


def inside_reads(tree: ast.AST) -> list[int]:
    """Lines of `tree` that read a cache's insides: a store or recall slots, its layers (`….cache.layers`), a
    field of its policy or archive."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", "")
        if (
            node.attr in CACHE_INSIDES
            or (node.attr == "layers" and owner.endswith("cache"))
            or (
                isinstance(node.value, ast.Attribute)
                and node.value.attr in OWNERS
                and getattr(node.value.value, "id", "") not in SUMMARIES
            )
        ):
            lines.append(node.lineno)
    return sorted(lines)


def test_the_inside_reads_rule_sees_them():
    code = "a = cache.stores[0].budget\nb = cache.policy.recall_slots\nc = self.cache.layers[0]\nd = cache.report()\n"
    assert inside_reads(ast.parse(code)) == [1, 2, 3]
    assert inside_reads(ast.parse("e = layer.archive.tokens\nf = report.archive.archive_oldest\n")) == [1]
    assert inside_reads(ast.parse("model.model.layers = settings.archive\n")) == []


def test_only_the_cache_reads_its_layers():
    """Commands, the panel, the eval tables and the analyses read `H2OCache.report()` and `layer_slots()`,
    never the cache's layers, stores, archive or policy: what they print cannot depend on how it keeps things."""
    found = [
        f"{path.relative_to(REPO)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] not in ("cache", "policies")
        for line in inside_reads(ast.parse(path.read_text(encoding="utf-8")))
    ]
    assert not found, found
