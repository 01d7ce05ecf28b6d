"""Recheck, in stage 2, the Python ints the trace read: a plan is made for one size.

Tracing turns some traced sizes into Python ints (a slice bound through ``__index__``,
``int(h)``, ``range(frames)``), and the plan then holds that number: a plan made for 64×64
latents holds ``64``. The analysis refuses ints that follow the batch size; ints that follow
the resolution or frame count are legitimate, but a batch at another resolution would then
fail deep inside (an einops or ``view`` error) or, worse, run a program traced for another
shape. Stage 2 therefore recomputes each such int from the values it has and stops with
a :class:`~graphsplit.errors.SplitError` naming the value, the user's line and the fix.

Glossary:
    size guard: a guard (``node.meta["guards"]``, written by the tracer) whose value is an int
        read with ``int()`` / ``__index__`` / ``range()`` from an int, or ``len()`` of a tensor.
        Ranks (``len(x.shape)``) and booleans are not rechecked: they do not follow a size.
    inspection node: a node that only reads sizes (``x.shape``, ``[k]``, ``x.size(d)``, ``//``):
        stage 2 may run it to recompute a guard even if the step did not need it there.

In: the traced graph, the cut, the stage-2 graph being built and its node map. Out: the stage-2
graph, with a ``graphsplit_runtime_check_size(value, expected, what, where)`` call inserted
right after each recomputable size guard's value:

    recheck_size_guards(stage, graph, cut, env) -> None
"""

from __future__ import annotations

import operator
from collections.abc import Collection
from typing import Any

import torch
import torch.fx as fx

from graphsplit.artifacts import Cut, Guard
from graphsplit.planning.rules.node_inputs import reads_through
from graphsplit.runtime import check_size

# Where the tracer lists the guards read from a node (see trace.trace_step).
GUARDS = "guards"

_INSPECTION_FUNCTIONS = frozenset(
    {
        getattr,
        len,
        operator.getitem,
        operator.add,
        operator.sub,
        operator.mul,
        operator.floordiv,
        operator.mod,
        operator.neg,
    }
)
_OPERATORS = {
    operator.add: "+",
    operator.sub: "-",
    operator.mul: "*",
    operator.floordiv: "//",
    operator.mod: "%",
}
_INSPECTION_METHODS = frozenset({"size", "dim", "numel"})
_SIZE_ATTRIBUTES = frozenset({"shape", "ndim"})


def is_size_guard(guard: Guard) -> bool:
    """Whether ``guard`` is an int read from a size (see the glossary)."""
    value = guard.node.meta.get("val")
    if isinstance(guard.value, bool) or not isinstance(guard.value, int):
        return False
    if guard.convert is len:
        return isinstance(value, torch.Tensor)
    return guard.convert in (int, operator.index) and isinstance(value, int)


class CheckSources:
    """The user's lines that stage-1 checks name, held beside stage 1's code, not in it.

    Stage 1's code is part of the cache fingerprint, and a ``file:line`` in it would make a
    cache stale when the script moves or gains a line above. Each check reads its line from
    the stage's attribute :attr:`ATTRIBUTE` instead; :meth:`held` is that attribute's value.
    """

    ATTRIBUTE = "graphsplit_check_sources"

    def __init__(self, stage: fx.Graph) -> None:
        self.stage = stage
        self.lines: list[str] = []
        self.table: fx.Node | None = None

    def node_for(self, where: str, after: fx.Node) -> fx.Node:
        """A node, inserted after ``after``, whose value is ``where``."""
        if self.table is None:
            with self.stage.inserting_after(_after_placeholders(self.stage, None)):
                self.table = self.stage.get_attr(self.ATTRIBUTE)
        after = self.table if after.op == "placeholder" else after
        self.lines.append(where)
        with self.stage.inserting_after(after):
            return self.stage.call_function(operator.getitem, (self.table, len(self.lines) - 1))

    def held(self) -> dict[str, tuple[str, ...]]:
        """The attribute stage 1 must hold (nothing when no check was inserted)."""
        return {self.ATTRIBUTE: tuple(self.lines)} if self.lines else {}


def recheck_size_guards(
    stage: fx.Graph, graph: fx.Graph, cut: Cut, env: dict[fx.Node, Any]
) -> None:
    """Insert a check after each size guard stage 2 can recompute (see the module docstring)."""
    _insert_checks(stage, graph, env)


def recheck_size_guards_in_stage1(
    stage: fx.Graph, graph: fx.Graph, cut: Cut, env: dict[fx.Node, fx.Node], sources: CheckSources
) -> None:
    """Check in stage 1 each size guard stage 2 cannot recompute, where stage 1 can.

    Such a size was read from a value only stage 1 has: frozen work traced through, or a raw
    input whose number the cut baked into stage 2 (:mod:`graphsplit.planning.rules.baked_sizes`).
    Checking it here keeps the promise that a batch at another size stops with a clear error.
    """
    in_stage2 = set(cut.stage2) | set(cut.boundary) | set(cut.reanchored)
    skip = {
        node
        for node in graph.nodes
        if any(is_size_guard(guard) for guard in node.meta.get(GUARDS, ()))
        and _recomputation(node, in_stage2) is not None
    }
    _insert_checks(stage, graph, env, skip=skip, sources=sources)


def hoist_checks(stage: fx.Graph) -> None:
    """Move each check that reads only the stage's inputs' sizes to right after the inputs.

    Stage 1 then stops at a batch of another size before running any frozen work on it (a
    text encoder or VAE at the wrong resolution costs seconds, only to be refused).
    """
    cursor = _after_placeholders(stage, None)
    hoisted: set[fx.Node] = set()
    for check in [n for n in stage.nodes if n.op == "call_function" and n.target is check_size]:
        closure = _inputs_closure(check)
        if closure is None:
            continue
        for node in [n for n in stage.nodes if n in closure] + [check]:
            if node.op != "placeholder" and node not in hoisted:
                cursor.append(node)
                cursor = node
                hoisted.add(node)


def _inputs_closure(check: fx.Node) -> set[fx.Node] | None:
    """What ``check`` reads, transitively, if that is size inspections of the stage's inputs
    (and the table of user lines); else None."""

    def is_inspection_or_table(node: fx.Node) -> bool:
        is_table = node.op == "get_attr" and node.target == CheckSources.ATTRIBUTE
        return node.op != "placeholder" and (is_table or _is_inspection(node))

    passed, ends = reads_through(check, is_inspection_or_table)
    if any(node.op != "placeholder" for node in ends):
        return None
    return passed | ends


def _nodes_in(env: dict[fx.Node, Any]) -> set[fx.Node]:
    """What a stage has as nodes: a baked number (a literal in ``env``) is checked elsewhere."""
    return {node for node, value in env.items() if isinstance(value, fx.Node)}


def _insert_checks(
    stage: fx.Graph,
    graph: fx.Graph,
    env: dict[fx.Node, Any],
    *,
    skip: Collection[fx.Node] = (),
    sources: CheckSources | None = None,
) -> None:
    checked: set[fx.Node] = set(skip)
    cursor: fx.Node | None = None  # the last node inserted: checks keep the step's order
    for node in graph.nodes:
        for guard in node.meta.get(GUARDS, ()):
            if node in checked or not is_size_guard(guard):
                continue
            chain = _recomputation(node, _nodes_in(env))
            if chain is None:
                continue
            checked.add(node)
            for needed in chain:
                with stage.inserting_after(_insertion_point(stage, needed, env, cursor)):
                    env[needed] = cursor = stage.node_copy(needed, env.__getitem__)
            point = _insertion_point(stage, node, env, cursor, itself=True)
            cursor = insert_check(
                stage,
                point,
                (env[node], guard.value, expression(node)),
                _where(node, guard),
                sources,
            )


def insert_check(
    stage: fx.Graph,
    after: fx.Node,
    arguments: tuple[Any, Any, str],
    where: str,
    sources: CheckSources | None,
) -> fx.Node:
    """Insert ``check_size(*arguments, where)`` after ``after``; ``where`` read from
    ``sources`` when given (stage 1), else written into the code (stage 2)."""
    after = _after_placeholders(stage, after)
    located: Any = where
    if sources is not None:
        located = after = sources.node_for(where, after)
    with stage.inserting_after(after):
        return stage.call_function(check_size, (*arguments, located), {})


def _recomputation(node: fx.Node, available: Collection[fx.Node]) -> list[fx.Node] | None:
    """Nodes a stage must add to compute ``node`` (in graph order), or None if it cannot."""
    needed: dict[fx.Node, None] = {}
    pending = [node]
    while pending:
        current = pending.pop()
        if current in available or current in needed:
            continue
        if not _is_inspection(current):
            return None
        needed[current] = None
        pending.extend(current.all_input_nodes)
    order = {n: index for index, n in enumerate(node.graph.nodes)}
    return sorted(needed, key=order.__getitem__)


def _is_inspection(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target in _INSPECTION_FUNCTIONS:
        return node.target is not getattr or node.args[1] in _SIZE_ATTRIBUTES
    return node.op == "call_method" and node.target in _INSPECTION_METHODS


def _insertion_point(
    stage: fx.Graph,
    node: fx.Node,
    env: dict[fx.Node, fx.Node],
    cursor: fx.Node | None,
    *,
    itself: bool = False,
) -> fx.Node:
    """The stage node to insert after: the latest of ``node``'s inputs (or ``node`` itself,
    for its check) and the last node inserted, never among the placeholders."""
    order = {n: index for index, n in enumerate(stage.nodes)}
    candidates = [env[node]] if itself else [env[arg] for arg in node.all_input_nodes]
    if cursor is not None:
        candidates.append(cursor)
    latest = max(candidates, key=order.__getitem__) if candidates else None
    return _after_placeholders(stage, latest)


def _after_placeholders(stage: fx.Graph, node: fx.Node | None) -> fx.Node:
    """``node``, or the last placeholder if ``node`` is one (stage inputs stay first)."""
    if node is not None and node.op != "placeholder":
        return node
    placeholders = [n for n in stage.nodes if n.op == "placeholder"]
    return placeholders[-1] if placeholders else next(iter(stage.nodes))


def _where(node: fx.Node, guard: Guard) -> str:
    """The user's ``file:line  code`` where the int was read."""
    code = node.meta.get("source_code") if node.meta.get("source") == guard.source else None
    return f"{guard.source}  {code}" if code else guard.source


def where_read(node: fx.Node) -> str:
    """The user's ``file:line  code`` that computed ``node``."""
    source, code = node.meta.get("source") or "<unknown>", node.meta.get("source_code")
    return f"{source}  {code}" if code else source


def expression(node: Any, depth: int = 0) -> str:
    """``node`` as the user would write it: ``pixel_values.shape[2]``, ``len(x)``."""
    if isinstance(node, slice):
        return ":".join("" if part is None else str(part) for part in (node.start, node.stop))
    if not isinstance(node, fx.Node):
        return repr(node)
    if depth > 6 or node.op not in ("call_function", "call_method"):
        return node.name
    args = node.args
    if node.target is getattr:
        return f"{expression(args[0], depth + 1)}.{args[1]}"
    if node.target is operator.getitem:
        return f"{expression(args[0], depth + 1)}[{expression(args[1], depth + 1)}]"
    if node.op == "call_method":
        rest = ", ".join(expression(arg, depth + 1) for arg in args[1:])
        return f"{expression(args[0], depth + 1)}.{node.target}({rest})"
    if node.target is len:
        return f"len({expression(args[0], depth + 1)})"
    if node.target in _OPERATORS and len(args) == 2:
        text = f" {_OPERATORS[node.target]} ".join(expression(arg, depth + 1) for arg in args)
        return f"({text})" if depth else text
    return node.name
