"""One way to build an error: every user-facing error goes through ``user_error``.

Read from the package's source (the AST of every module), so a raise the tests never reach is
checked as well. Outside ``graphsplit/errors.py``:

- no :class:`~graphsplit.errors.GraphsplitError` subclass is constructed (or raised) directly:
  ``raise user_error(ErrorType, reason, fix=..., node=..., source=...)`` builds it;
- ``user_error``'s ``fix=`` is typed: a ``Fix(...)`` call, a ``Remedy.X`` member, a module-level
  constant named ``*_FIX`` that is itself a ``Fix(...)`` call, or a conditional choosing
  between those;
- no ``remedy=`` keyword to ``user_error`` (the option is the ``Fix``'s);
- no string holds a hand-written ``fix:`` line (``user_error`` writes that line).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import graphsplit.errors
from graphsplit.errors import Fix, GraphsplitError, Remedy, SplitError, user_error
from tests.test_imports import PACKAGE

ERRORS_MODULE = PACKAGE / "errors.py"

FIX_LINE = re.compile(r"\bfix:")


def _relative(path: Path) -> str:
    return path.relative_to(PACKAGE.parent).as_posix()


def _checked_sources() -> dict[str, ast.Module]:
    """The package's modules (but errors.py and those not yet converted), parsed."""
    trees = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _relative(path)
        if path == ERRORS_MODULE:
            continue
        trees[name] = ast.parse(path.read_text(), filename=str(path))
    return trees


def _all_trees() -> dict[str, ast.Module]:
    return {
        _relative(path): ast.parse(path.read_text(), filename=str(path))
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def _called_name(call: ast.Call) -> str | None:
    if isinstance(call.func, ast.Name):
        return call.func.id
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    return None


def error_class_names() -> set[str]:
    """Every GraphsplitError subclass: those of graphsplit.errors and, to a fixed point, the
    classes anywhere in the package whose bases name one of them."""
    names = {
        name
        for name, value in vars(graphsplit.errors).items()
        if isinstance(value, type) and issubclass(value, GraphsplitError)
    }
    classes = [
        node
        for tree in _all_trees().values()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    ]
    grown = True
    while grown:
        grown = False
        for node in classes:
            bases = {
                base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
                for base in node.bases
            }
            if node.name not in names and bases & names:
                names.add(node.name)
                grown = True
    return names


def fix_constants() -> set[str]:
    """Module-level names ``*_FIX`` bound to a ``Fix(...)`` call, anywhere in the package."""
    names = set()
    for tree in _all_trees().values():
        for statement in tree.body:
            targets = []
            if isinstance(statement, ast.Assign):
                targets, value = statement.targets, statement.value
            elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
                targets, value = [statement.target], statement.value
            for target in targets:
                if (
                    isinstance(target, ast.Name)
                    and target.id.endswith("_FIX")
                    and isinstance(value, ast.Call)
                    and _called_name(value) == "Fix"
                ):
                    names.add(target.id)
    return names


def _typed_fix(
    value: ast.expr, constants: set[str], tree: ast.AST | None = None, seen: frozenset = frozenset()
) -> bool:
    """Whether ``value`` is a typed fix: ``Fix(...)``, ``Remedy.X``, a ``*_FIX`` constant, the
    ``.fix`` another error carries, a choice between those, or a local name every plain
    assignment in ``tree`` binds to one (a name unpacked from a tuple is left to
    :func:`~graphsplit.errors.user_error`'s own check, which refuses a str at run time)."""
    if isinstance(value, ast.Call):
        return _called_name(value) == "Fix"
    if isinstance(value, ast.Attribute):
        return value.attr == "fix" or (
            isinstance(value.value, ast.Name) and value.value.id == "Remedy"
        )
    if isinstance(value, ast.IfExp):
        return _typed_fix(value.body, constants, tree, seen) and _typed_fix(
            value.orelse, constants, tree, seen
        )
    if isinstance(value, ast.BoolOp) and isinstance(value.op, ast.Or):
        return all(_typed_fix(item, constants, tree, seen) for item in value.values)
    if isinstance(value, ast.Name):
        if value.id in constants:
            return True
        if tree is None or value.id in seen:
            return False
        bound = [
            node.value
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == value.id for t in node.targets)
        ]
        seen = seen | {value.id}
        return bool(bound) and all(_typed_fix(item, constants, tree, seen) for item in bound)
    return False


def _innermost_scopes(tree: ast.Module) -> dict[ast.AST, ast.AST]:
    """Each node's innermost enclosing function (or the module): where its local names live."""
    scope_of: dict[ast.AST, ast.AST] = {}
    pending: list[tuple[ast.AST, ast.AST]] = [(tree, tree)]
    while pending:
        node, scope = pending.pop()
        scope_of[node] = scope
        inner = node if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else scope
        pending.extend((child, inner) for child in ast.iter_child_nodes(node))
    return scope_of


def _where(name: str, node: ast.AST) -> str:
    return f"{name}:{node.lineno}"


def direct_constructions(tree: ast.AST, errors: set[str]) -> list[tuple[ast.AST, str]]:
    """``(node, what)`` for each call of an error class, and each raise of the class itself."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _called_name(node) in errors:
            found.append((node, f"{_called_name(node)}(...)"))
        elif isinstance(node, ast.Raise) and isinstance(node.exc, ast.Name | ast.Attribute):
            raised = node.exc.id if isinstance(node.exc, ast.Name) else node.exc.attr
            if raised in errors:
                found.append((node, f"raise {raised}"))
    return found


def test_no_error_is_constructed_directly():
    errors = error_class_names()
    assert {"SplitError", "CacheError", "SpecError", "LaunchError"} <= errors
    direct = [
        f"{_where(name, node)}  {what}"
        for name, tree in _checked_sources().items()
        for node, what in direct_constructions(tree, errors)
    ]
    assert not direct, "build these with user_error(...):\n" + "\n".join(direct)


def test_every_user_error_has_a_typed_fix_and_no_remedy_argument():
    constants = fix_constants()
    wrong = []
    for name, tree in _checked_sources().items():
        scope_of = _innermost_scopes(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and _called_name(node) == "user_error"):
                continue
            keywords = {keyword.arg: keyword.value for keyword in node.keywords}
            if "remedy" in keywords:
                wrong.append(f"{_where(name, node)}  remedy= (put the option in the Fix)")
            if "fix" not in keywords:
                wrong.append(f"{_where(name, node)}  no fix=")
            elif not _typed_fix(keywords["fix"], constants, scope_of[node]):
                wrong.append(f"{_where(name, node)}  fix={ast.unparse(keywords['fix'])}")
    assert not wrong, "user_error calls whose fix is not typed:\n" + "\n".join(wrong)


def test_no_string_writes_a_fix_line_by_hand():
    by_hand = [
        f"{_where(name, node)}  {node.value[:60]!r}"
        for name, tree in _checked_sources().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and FIX_LINE.search(node.value)
    ]
    assert not by_hand, "strings with a 'fix:' line (user_error writes it):\n" + "\n".join(by_hand)


# -- the rules catch what they are about ---------------------------------------------------------
@pytest.mark.parametrize(
    ("source", "caught"),
    [
        ("raise SplitError('bad')", True),
        ("raise SplitError", True),
        ("error = SpecError(f'{x}')", True),
        ("raise user_error(SplitError, 'bad', fix=Fix('do this'))", False),
        ("except SplitError: pass", None),
    ],
)
def test_the_direct_construction_rule(source, caught):
    if caught is None:
        source = f"try:\n    pass\n{source}"
    found = direct_constructions(ast.parse(source), error_class_names())
    assert bool(found) is bool(caught)


@pytest.mark.parametrize(
    ("fix", "typed"),
    [
        ("Fix('pass a smaller batch')", True),
        ("Fix('pass {remedy}', Remedy.OVERWRITE)", True),
        ("Remedy.OVERWRITE", True),
        ("INFERENCE_MODE_FIX", True),
        ("INFERENCE_MODE_FIX if a else Remedy.OVERWRITE", True),
        ("'pass a smaller batch'", False),
        ("_FIX", False),
        ("fix", False),
        ("_FIX + 'more'", False),
        ("error.fix or Remedy.OVERWRITE", True),
        ("error.fix or 'rerun'", False),
    ],
)
def test_the_typed_fix_rule(fix, typed):
    assert "INFERENCE_MODE_FIX" in fix_constants()
    value = ast.parse(fix, mode="eval").body
    assert _typed_fix(value, fix_constants()) is typed


@pytest.mark.parametrize(
    ("body", "typed"),
    [
        ("fix = Fix('a') if x else Fix('b')", True),
        ("fix = Fix('a')\nif x:\n    fix = Remedy.OVERWRITE", True),
        ("fix = Fix('a')\nif x:\n    fix = 'rerun'", False),
        ("fix = f'rerun {x}'", False),
        ("pass", False),  # a parameter or an unknown name
    ],
)
def test_a_local_fix_is_typed_when_every_assignment_is(body, typed):
    tree = ast.parse(body)
    assert _typed_fix(ast.Name("fix"), set(), tree) is typed


# -- the message a user reads ---------------------------------------------------------------------
def test_the_message_layout_reason_node_source_fix():
    import torch.fx

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    node = graph.call_function(torch.relu, (x,))
    node.meta["source"] = "train.py:12"
    node.meta["source_code"] = "y = torch.relu(x)"
    error = user_error(
        SplitError, "the step cannot be cut here", fix=Fix("cut it elsewhere"), node=node
    )
    assert str(error).splitlines() == [
        "the step cannot be cut here",
        "  node:   relu : [num_users=0] = call_function[target=torch.relu]"
        "(args = (%x,), kwargs = {})",
        "  source: train.py:12  y = torch.relu(x)",
        "  fix:    cut it elsewhere",
    ]
    assert error.reason == "the step cannot be cut here"
    assert error.fix == Fix("cut it elsewhere") and error.remedy is None
    # An explicit source wins over the node's; a message without a node has no node line.
    plain = user_error(SplitError, "bad argument", fix=Fix("pass another"), source="a.py:3")
    assert str(plain).splitlines() == ["bad argument", "  source: a.py:3", "  fix:    pass another"]


def test_a_fix_names_its_option_with_the_slot_iff_it_has_one():
    with pytest.raises(ValueError, match="remedy"):
        Fix("pass {remedy}")
    with pytest.raises(ValueError, match="remedy"):
        Fix("rebuild it", Remedy.OVERWRITE)
    assert Fix.of(Remedy.NUM_WORKERS_0) == Fix("pass {remedy}", Remedy.NUM_WORKERS_0)
