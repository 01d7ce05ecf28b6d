"""The package's import graph: no cycles, and the core never imports its integrations.

Read from the source (the AST of every module, imports inside functions included, imports under
``if TYPE_CHECKING:`` left out since they never run), so a lazy import cannot hide a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parent.parent / "graphsplit"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(tree: ast.AST, importer: str, modules: set[str]) -> set[str]:
    """The package modules ``tree`` imports (``from graphsplit.x import y`` -> ``x.y`` if a
    module, else ``x``), skipping ``if TYPE_CHECKING:`` blocks."""
    found: set[str] = set()
    pending = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            pending.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the importing package
                package = importer.split(".")[: -node.level or None]
                base = ".".join([*package, *([base] if base else [])])
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.add(child if child in modules else base)
        pending.extend(ast.iter_child_nodes(node))
    return {name for name in found if name in modules}


def import_graph() -> nx.DiGraph:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(path) for path in paths}
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for path in paths:
        importer = _module_name(path)
        tree = ast.parse(path.read_text(), filename=str(path))
        for imported in _imported(tree, importer, modules):
            if imported != importer:
                graph.add_edge(importer, imported)
    return graph


def test_the_graph_sees_function_level_imports_and_skips_type_checking_blocks():
    graph = import_graph()
    assert graph.has_edge("graphsplit.api", "graphsplit.planning.cut.boundary")
    assert not graph.has_edge("graphsplit.report", "graphsplit.api")  # under TYPE_CHECKING
    # The package has no function-level import of its own modules left; check the reader on
    # one, so a lazy import added later cannot hide a cycle.
    source = "def later():\n    from graphsplit.api import split\n"
    modules = {"graphsplit.api", "graphsplit.tools.cli"}
    assert _imported(ast.parse(source), "graphsplit.tools.cli", modules) == {"graphsplit.api"}


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, f"import cycles: {cycles}"


def test_planning_never_imports_its_integrations():
    graph = import_graph()
    planning = [name for name in graph if name.startswith("graphsplit.planning")]
    for module in planning:
        reached = nx.descendants(graph, module)
        integrations = sorted(
            name
            for name in reached
            if name.startswith(
                ("graphsplit.caching", "graphsplit.tools", "graphsplit.integrations")
            )
        )
        assert not integrations, f"{module} imports {integrations}"
