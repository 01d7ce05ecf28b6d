"""The house rules of the package's layout, checked from the source.

- **Folders import only downward.** :data:`LAYERS` lists the package's rooms from the bottom
  up; a module may import from its own room and from rooms below it, never from one above.
  Imports under ``if TYPE_CHECKING:`` count too: a circle that only type checkers see is still
  a circle a reader has to untangle.
- **No circle** among modules, ``TYPE_CHECKING`` imports included.
- **Small rooms, small modules:** no folder holds more than :data:`MAX_MODULES_PER_FOLDER`
  modules; a module is at most :data:`MAX_LINES` lines unless :data:`LONG_MODULES` names it,
  with a reason that its own docstring states too.
- **Names that explain themselves:** no module is named like a standard-library module or a
  builtin (``numbers.py``, ``callable.py``), so neither is shadowed for a reader.
- **The map is whole:** docs/algorithm.md's "Where the code lives" names every module.
"""

from __future__ import annotations

import ast
import builtins
import sys
from pathlib import Path

import networkx as nx
import pytest

from tests.test_imports import PACKAGE, _module_name

ROOT = PACKAGE.parent
MAX_LINES = 500
MAX_MODULES_PER_FOLDER = 15

# The rooms from the bottom up. A module belongs to the longest prefix that names it.
LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "graphsplit.version",
        "graphsplit.units",
        "graphsplit.errors",
        "graphsplit.artifacts",
        "graphsplit.batch_invariance",
    ),
    ("graphsplit.runtime",),
    ("graphsplit.planning.rules",),
    ("graphsplit.planning.patching",),
    ("graphsplit.planning.meta",),
    ("graphsplit.planning.step",),
    ("graphsplit.planning.opaque",),
    ("graphsplit.planning.tracing",),
    ("graphsplit.planning.analyse",),
    ("graphsplit.planning.cut",),
    ("graphsplit.planning.codegen",),
    ("graphsplit.planning",),
    ("graphsplit.signatures",),
    ("graphsplit.report",),
    ("graphsplit.calls",),
    ("graphsplit.row_pairing",),
    ("graphsplit.api",),
    ("graphsplit.verify",),
    ("graphsplit.caching.format",),
    ("graphsplit.caching.store",),
    ("graphsplit.caching.loader",),
    ("graphsplit.caching.write",),
    ("graphsplit.caching.read",),
    ("graphsplit.caching",),
    ("graphsplit.tools",),
    ("graphsplit.integrations",),
    ("graphsplit",),
)

# Modules allowed over MAX_LINES, each with its reason (the module's docstring says it too).
LONG_MODULES: dict[str, str] = {}


def _imports(tree: ast.AST, importer: str, modules: set[str]) -> set[str]:
    """Every package module ``tree`` imports, ``TYPE_CHECKING`` blocks and functions included."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = importer.split(".")[: -node.level or None]
                base = ".".join([*package, *([base] if base else [])])
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.add(child if child in modules else base)
    return {name for name in found if name in modules and name != importer}


def _sources() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def full_import_graph() -> nx.DiGraph:
    sources = _sources()
    graph = nx.DiGraph()
    graph.add_nodes_from(sources)
    for name, path in sources.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        graph.add_edges_from((name, imported) for imported in _imports(tree, name, set(sources)))
    return graph


def layer_of(module: str) -> int:
    best, best_length = None, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_length:
                best, best_length = index, len(prefix)
    assert best is not None, f"{module} is in no layer of tests/test_layout.py"
    return best


def test_every_module_has_a_layer():
    for module in _sources():
        layer_of(module)


def test_folders_import_only_downward_type_checking_imports_included():
    upward = [
        f"{importer} -> {imported}"
        for importer, imported in full_import_graph().edges
        if layer_of(imported) > layer_of(importer)
    ]
    assert not upward, "imports that go up a layer:\n" + "\n".join(sorted(upward))


def test_no_import_circle_type_checking_imports_included():
    cycles = sorted(sorted(cycle) for cycle in nx.simple_cycles(full_import_graph()))
    assert not cycles, f"import circles: {cycles}"


def test_no_folder_holds_more_than_fifteen_modules():
    for folder in sorted({path.parent for path in PACKAGE.rglob("*.py")}):
        modules = [path for path in folder.glob("*.py") if path.name != "__init__.py"]
        assert len(modules) <= MAX_MODULES_PER_FOLDER, f"{folder}: {len(modules)} modules"


def test_modules_fit_the_line_budget_or_say_why_not():
    assert len(LONG_MODULES) <= 3
    too_long = []
    for module, path in _sources().items():
        lines = len(path.read_text().splitlines())
        if module in LONG_MODULES:
            docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
            assert "500 lines" in docstring, f"{module} must say at its top why it is long"
        elif lines > MAX_LINES:
            too_long.append(f"{module}: {lines} lines")
    assert not too_long, "modules over the budget:\n" + "\n".join(too_long)


def test_no_module_shadows_the_standard_library_or_a_builtin():
    # A module file is checked against both; a folder against the standard library's modules
    # (``caching/format/`` names the format a cache is written in, as mosaicml streaming's
    # ``format/`` does, and ``format()`` is never imported from it).
    shadowing = []
    for module, path in _sources().items():
        name = module.rsplit(".", 1)[-1]
        if path.name == "__init__.py":
            taken = set(sys.stdlib_module_names)
        else:
            taken = set(sys.stdlib_module_names) | set(dir(builtins))
        if name in taken and name != "__main__":
            shadowing.append(module)
    assert not shadowing, f"modules named like the standard library or a builtin: {shadowing}"


def _where_the_code_lives() -> str:
    text = (ROOT / "docs" / "algorithm.md").read_text()
    start = text.index("## Where the code lives")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def test_the_docs_map_names_every_module():
    section = _where_the_code_lives()
    missing = []
    for path in _sources().values():
        if path.name == "__init__.py":
            continue
        relative = path.relative_to(PACKAGE).as_posix()
        if path.stem not in section or path.parent.name not in section:
            missing.append(relative)
    assert not missing, f"docs/algorithm.md's map does not name: {missing}"


@pytest.mark.parametrize("module", ["graphsplit.planning.rules.taint", "graphsplit.caching"])
def test_layer_of_reads_the_longest_prefix(module):
    assert LAYERS[layer_of(module)][0] in module
