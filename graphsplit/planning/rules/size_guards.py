"""Recheck the Python values the trace derived from sizes: a plan is made for one size.

Tracing turns some traced sizes into Python values: ints (a slice bound through
``__index__``, ``range(frames)``; ``int(h)`` of an int size stays traced where
planning/tracing/int_calls.py can rebind the caller), booleans (``if h.shape[-1] % 16 != 0``),
floats (``float(w) / 16``), ``int()`` of size arithmetic (``int(w * 1.5)``) and strings
(``f"block_{w}"``); the plan then holds that value: a plan made for 64×64 latents holds ``64``.
The analysis refuses values that follow the batch size; values that follow the resolution or
frame count are legitimate, but a batch at another resolution would then fail deep inside (an
einops or ``view`` error) or, worse, run a program traced for another shape and return another
number. Each such value is therefore recomputed by the stage code that can (stage 2 from the
values it has; stage 1, which runs first, from its inputs and frozen work, so a batch no plan
could train stops before anything is cached) and checked, stopping with a
:class:`~graphsplit.errors.SplitError` naming the value, the user's line and the fix. A value
neither stage can recompute is refused at split time. Sizes that only flow through torch ops
stay symbolic and are not checked.

Glossary:
    size guard: a guard (``node.meta["guards"]``, written by the tracer) whose value is an int
        read with ``int()`` / ``__index__`` / ``range()`` from an int (a chunk loop's
        iteration count, ``len(range(0, x.shape[0], chunk))``, among them), or ``len()`` of a
        tensor;
        checked with ``graphsplit_runtime_check_size(value, expected, what, where)``.
    size reading: a guard that read ``bool()``, ``float()``, ``int()`` of a float, ``str()``
        or ``format()`` of a plain value computed from a tensor's sizes (:func:`reading_of`);
        checked with ``graphsplit_runtime_check_size_read(value, reading, expected, what,
        where)``. Ranks (``len(x.shape)``, ``x.ndim == 4``) are not sizes and not rechecked.
    inspection node: a node that only reads sizes (``x.shape``, ``[k]``, ``x.size(d)``, ``//``,
        ``%``, ``==``, ``math.ceil``): a stage may run it to recompute a guard even if the step
        did not need it there.

In: the traced graph, the cut, the stage graph being built and its node map. Out: the stage
graph, with a check inserted right after each recomputable guard's value:

    recheck_size_guards(stage, graph, cut, env) -> None             # stage 2
    recheck_size_guards_in_stage1(stage, graph, cut, env, sources)   # stage 1: every one it can
    refuse_unchecked_size_guards(graph, cut) -> None                 # neither stage can: refused
    hoist_checks(stage) -> None            # stage 1: checks of input sizes before frozen work
    is_size_read(node) -> bool             # x.shape, x.size(...), x.numel()
"""

from __future__ import annotations

import operator
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from graphsplit.artifacts import Cut, Guard
from graphsplit.errors import Fix, SplitError, user_error
from graphsplit.planning.rules.node_inputs import reads_through
from graphsplit.planning.rules.weight_sizes import is_weight_size
from graphsplit.runtime import check_size, check_size_read

# Where the tracer lists the guards read from a node (see trace.trace_step).
GUARDS = "guards"

_COMPARISONS = {
    operator.eq: "==",
    operator.ne: "!=",
    operator.lt: "<",
    operator.le: "<=",
    operator.gt: ">",
    operator.ge: ">=",
}
_OPERATORS = {
    operator.add: "+",
    operator.sub: "-",
    operator.mul: "*",
    operator.floordiv: "//",
    operator.mod: "%",
    operator.truediv: "/",
    operator.pow: "**",
    **_COMPARISONS,
}
_INSPECTION_FUNCTIONS = frozenset(
    {
        getattr,
        len,
        range,  # a chunk loop's count is len(range(0, x.shape[0], chunk))
        operator.getitem,
        operator.neg,
        operator.pos,
        operator.not_,
        abs,
        *_OPERATORS,
    }
)
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


@dataclass(frozen=True)
class Formatted:
    """``format(value, spec)``: how an f-string or ``str.format`` read a traced value."""

    spec: str

    def __call__(self, value: Any) -> str:
        return format(value, self.spec)


def reading_of(guard: Guard) -> str | None:
    """The reading ``check_size_read`` repeats for a size reading (see the glossary), or None
    (an int :func:`is_size_guard` covers, a read of a tensor's value, a container's length)."""
    value, convert = guard.node.meta.get("val"), guard.convert
    if is_size_guard(guard) or not _is_plain(value):
        return None
    if isinstance(convert, Formatted):
        return f"format:{convert.spec}"
    if convert is int:
        return "int" if isinstance(value, float) else None
    return {bool: "bool", float: "float", str: "str"}.get(convert)


def _is_plain(value: Any) -> bool:
    """A Python number, or a tuple of them (a ``torch.Size``): what a size computes to."""
    if isinstance(value, tuple):
        return all(type(item) in (int, float, bool) for item in value)
    return type(value) in (int, float, bool)


def _checked_guards(graph: fx.Graph) -> list[tuple[fx.Node, Guard]]:
    """Each node's guards a stage must recheck, one per node and reading, in graph order.

    An int the stage checks fixes the node's value, so other readings of it are implied.
    """
    data = _depends_on_inputs(graph)
    found = []
    for node in graph.nodes:
        guards = node.meta.get(GUARDS, ())
        exact = next((guard for guard in guards if is_size_guard(guard)), None)
        if exact is not None:
            found.append((node, exact))
            continue
        readings: set[tuple[str, Any]] = set()
        for guard in guards:
            reading = reading_of(guard)
            if reading is None or (reading, guard.value) in readings:
                continue
            if not readings and not _reads_a_size(node, data):
                break
            readings.add((reading, guard.value))
            found.append((node, guard))
    return found


def _depends_on_inputs(graph: fx.Graph) -> set[fx.Node]:
    """The nodes computed from the step's inputs (a parameter's shape never changes)."""
    data: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder" or any(arg in data for arg in node.all_input_nodes):
            data.add(node)
    return data


def _reads_a_size(node: fx.Node, data: Collection[fx.Node]) -> bool:
    """Whether ``node``'s plain value is computed from the size of a tensor of the batch."""

    def is_plain_arithmetic(producer: fx.Node) -> bool:
        is_tensor = isinstance(producer.meta.get("val"), torch.Tensor)
        return not (is_size_read(producer) or is_tensor)

    if not is_plain_arithmetic(node):
        return is_size_read(node) and node.args[0] in data
    _, ends = reads_through(node, is_plain_arithmetic)
    return any(is_size_read(end) and end.args[0] in data for end in ends)


def is_size_read(node: fx.Node) -> bool:
    """``x.shape``, ``x.size(...)`` or ``x.numel()``: a read of a tensor's sizes."""
    if node.op == "call_function" and node.target is getattr:
        return node.args[1] == "shape"
    return node.op == "call_method" and node.target in ("size", "numel")


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
        # First after the inputs again: checks inserted there since (Mllama's input sizes
        # compared) would otherwise read the table before it is fetched.
        _after_placeholders(self.stage, None).append(self.table)
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
    """Insert a check after each guard stage 2 can recompute (see the module docstring)."""
    _insert_checks(stage, graph, env)


def recheck_size_guards_in_stage1(
    stage: fx.Graph,
    graph: fx.Graph,
    cut: Cut,
    env: dict[fx.Node, fx.Node],
    sources: CheckSources,
    *,
    as_in_0_2: bool = False,
) -> None:
    """Check in stage 1 each guard stage 1 can recompute, stage 2's included.

    Stage 1 runs first, and ``cache()`` writes what it returns: a batch at a size no plan
    could train stops here, before its frozen work is written, rather than at the first
    stage-2 batch after hours of caching. A guard read from a value only stage 1 has (frozen
    work traced through, a raw input whose number the cut baked into stage 2, see
    :mod:`graphsplit.planning.rules.baked_sizes`) is checked nowhere else.

    With ``as_in_0_2``, only what graphsplit 0.2 checked here: the int guards stage 2 cannot
    recompute. Stage 1's code is the cache's ``code`` fingerprint, and checks change no value:
    the code 0.2 generated is kept as an alias, so its caches stay this split's own.
    """
    if not as_in_0_2:
        _insert_checks(stage, graph, env, sources=sources)
        return
    in_stage2 = set(cut.stage2) | set(cut.boundary) | set(cut.reanchored)
    skip = {
        node
        for node in graph.nodes
        if any(is_size_guard(guard) for guard in node.meta.get(GUARDS, ()))
        and _recomputation(node, in_stage2, weights=False) is not None
    }
    _insert_checks(stage, graph, env, sources=sources, skip=skip, readings=False)


def refuse_unchecked_size_guards(graph: fx.Graph, cut: Cut) -> None:
    """Refuse a value read from a size that neither stage can recompute: a plan would run a
    program traced for another size, silently, where a batch of another size came."""
    in_stage1 = {n for n in graph.nodes if n.op == "placeholder"} | set(cut.stage1)
    in_stage2 = set(cut.stage2) | set(cut.boundary) | set(cut.reanchored)
    data = _depends_on_inputs(graph)
    for node, guard in _checked_guards(graph):
        if node in cut.baked or not _reads_a_size(node, data):
            continue
        if any(_recomputation(node, have) is not None for have in (in_stage1, in_stage2)):
            continue
        raise user_error(
            SplitError,
            f"the step turned {_what(node, guard)} (computed from a tensor's size) into the "
            f"Python value {guard.value!r}, and neither stage can recompute it from the values "
            "it has, so a batch of another size would run a plan made for this one unchecked.",
            node=node,
            source=_where(node, guard),
            fix=Fix(
                "keep the size inside tensor ops (x.view(x.shape[0], -1), torch.where), or "
                "compute the value from an input's shape rather than from an intermediate "
                "result the plan does not keep"
            ),
        )


def hoist_checks(stage: fx.Graph) -> None:
    """Move each check that reads only the stage's inputs' sizes to right after the inputs.

    Stage 1 then stops at a batch of another size before running any frozen work on it (a
    text encoder or VAE at the wrong resolution costs seconds, only to be refused).
    """
    cursor = _after_placeholders(stage, None)
    hoisted: set[fx.Node] = set()
    checks = [n for n in stage.nodes if n.op == "call_function" and n.target in SIZE_CHECKS]
    for check in checks:
        closure = _inputs_closure(check)
        if closure is None:
            continue
        for node in [n for n in stage.nodes if n in closure] + [check]:
            if node.op != "placeholder" and node not in hoisted:
                cursor.append(node)
                cursor = node
                hoisted.add(node)


SIZE_CHECKS = (check_size, check_size_read)  # the runtime helpers a size check calls


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
    sources: CheckSources | None = None,
    skip: Collection[fx.Node] = (),
    readings: bool = True,
) -> None:
    cursor: fx.Node | None = None  # the last node inserted: checks keep the step's order
    for node, guard in _checked_guards(graph):
        if node in skip or (not readings and reading_of(guard) is not None):
            continue
        chain = _recomputation(node, _nodes_in(env))
        if chain is None:
            continue
        for needed in chain:
            if any(arg not in env for arg in needed.all_input_nodes):  # a weight size
                env[needed] = needed.meta["val"]
                continue
            with stage.inserting_after(_insertion_point(stage, needed, env, cursor)):
                env[needed] = cursor = stage.node_copy(needed, env.__getitem__)
        point = _insertion_point(stage, node, env, cursor, itself=True)
        reading = reading_of(guard)
        if reading is None:
            arguments: tuple[Any, ...] = (env[node], guard.value, expression(node))
        else:
            arguments = (env[node], reading, guard.value, _what(node, guard))
        helper = check_size if reading is None else check_size_read
        cursor = insert_check(stage, point, arguments, _where(node, guard), sources, helper)


def insert_check(
    stage: fx.Graph,
    after: fx.Node,
    arguments: tuple[Any, ...],
    where: str,
    sources: CheckSources | None,
    helper: Any = check_size,
) -> fx.Node:
    """Insert ``helper(*arguments, where)`` after ``after``; ``where`` read from ``sources``
    when given (stage 1), else written into the code (stage 2)."""
    after = _after_placeholders(stage, after)
    located: Any = where
    if sources is not None:
        located = after = sources.node_for(where, after)
    with stage.inserting_after(after):
        return stage.call_function(helper, (*arguments, located), {})


def _what(node: fx.Node, guard: Guard) -> str:
    """The value a size reading read, as the user wrote it: ``h.shape[3] % 16 != 0``."""
    text, reading = expression(node), reading_of(guard) or ""
    if reading == "bool" and node.op == "call_function" and node.target in _COMPARISONS:
        return text
    if reading.startswith("format:"):
        spec = reading.removeprefix("format:")
        return "f'{" + text + (f":{spec}" if spec else "") + "}'"
    return f"{reading or 'int'}({text})"


def _recomputation(
    node: fx.Node, available: Collection[fx.Node], *, weights: bool = True
) -> list[fx.Node] | None:
    """Nodes a stage must add to compute ``node`` (in graph order), or None if it cannot;
    with ``weights``, a weight size it cannot compute is among them, written as its value."""
    needed: dict[fx.Node, None] = {}
    pending = [node]
    while pending:
        current = pending.pop()
        if current in available or current in needed:
            continue
        if _written_as_value(current, node, available, weights):
            needed[current] = None  # see weight_sizes: no stage need hold the weight
            continue
        if not _is_inspection(current):
            return None
        needed[current] = None
        pending.extend(current.all_input_nodes)
    order = {n: index for index, n in enumerate(node.graph.nodes)}
    return sorted(needed, key=order.__getitem__)


def _written_as_value(
    current: fx.Node, node: fx.Node, available: Collection[fx.Node], weights: bool
) -> bool:
    if not weights or current is node or not is_weight_size(current, _is_inspection):
        return False
    return _recomputation(current, available, weights=False) is None


def _is_inspection(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target in _INSPECTION_FUNCTIONS:
        return node.target is not getattr or node.args[1] in _SIZE_ATTRIBUTES
    if node.op == "call_function" and getattr(node.target, "__module__", None) == "math":
        return True  # math.ceil(h / 8): the tracer records math's functions as calls
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
    inputs = [] if itself else [env[arg] for arg in node.all_input_nodes]
    candidates = [env[node]] if itself else [i for i in inputs if isinstance(i, fx.Node)]
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
    if node.target in (len, range) or getattr(node.target, "__module__", None) == "math":
        plain = node.target in (len, range)
        name = node.target.__name__ if plain else f"math.{node.target.__name__}"
        return f"{name}({', '.join(expression(arg, depth + 1) for arg in args)})"
    if node.target in _OPERATORS and len(args) == 2:
        text = f" {_OPERATORS[node.target]} ".join(expression(arg, depth + 1) for arg in args)
        return f"({text})" if depth else text
    return node.name
