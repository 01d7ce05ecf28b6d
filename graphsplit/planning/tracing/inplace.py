"""Turn in-place writes on traced values into plain dataflow, or refuse them naming the line.

Glossary:
    write: a node that changed the values of one of its input tensors. The tracer sees it at
        the ATen level: the tensor's version counter moved while the node ran
        (``node.meta["writes"]``, :mod:`graphsplit.planning.meta.tracing_interpreter`). This
        catches every in-place op (``h.mul_(2)``, ``x[k] = v``, ``h += 1``,
        ``F.relu(h, inplace=True)``) and modules that mutate their arguments, whatever their
        spelling.
    aliases: graph values sharing the written tensor's memory (the tensor, its base, its
        views). Which node views which input is read once from the fake values the tracer
        computed (shared storage) and kept by argument position (:class:`_AliasMap`), so it
        stays true while the rewrite reroutes arguments.
    later reader: a node after the write that reads an alias. Eager code sees the new values
        there; a dataflow graph sees them only if the reader is rerouted to a new node.
    functional form: the write as a new value: ``functional_inplace(h, "mul_", 2)`` (a copy,
        then the same in-place kernel, so the bits and random draws are the step's own),
        ``functional_setitem(h, k, v)``, or the call with ``inplace=False``.
    write through a view: ``h[:, 0].mul_(2)`` also changes ``h``. When every view between the
        written tensor and its base is an indexing (``getitem``) view, the base's new value is
        ``functional_setitem(base, key, new view value)``, and later readers of the base (and of
        the views, re-derived from the new base) are rerouted. Other views are refused.

Refused, with the user's line: writes into a step input or a module's parameter or buffer
(stage code would mutate the user's batch or the model), writes through a non-indexing view
whose base is read later, and writes by other operations (a module mutating its argument, an
``out=`` argument) when another node reads the written tensor afterwards.

In: a traced graph whose nodes carry ``meta["val"]`` (fake tensors) and ``meta["writes"]``.
Out: the same graph with no write left that any later node could observe:

    functionalize_inplace(graph) -> None
"""

from __future__ import annotations

import enum
import itertools
import operator
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef

from graphsplit.errors import Fix, TraceError, user_error
from graphsplit.planning.meta.analysis_view import meta_execution
from graphsplit.planning.meta.tracing_interpreter import WRITES
from graphsplit.runtime import functional_inplace, functional_setitem

WRITE_A_COPY_FIX = Fix(
    "compute a new tensor instead of writing into this one (h = h * 2, "
    "h = h.masked_fill(mask, 0), torch.where), or .clone() it before writing"
)


class _WriteKind(enum.Enum):
    """How a write is spelled, which decides its functional form."""

    SETITEM = "x[k] = v"
    METHOD = "an in-place method, x.op_(...)"
    INPLACE_FLAG = "a call with inplace=True"
    OTHER = "another operation that writes its argument"


def functionalize_inplace(graph: fx.Graph) -> None:
    """Replace every observable write in ``graph`` by its functional form (or refuse it).

    The alias map is read at the first write, before any rewrite, as it would be up front: a
    graph with no write (most) skips its walk of every node's storages.
    """
    aliases: _AliasMap | None = None
    for node in list(graph.nodes):
        kind = _write_kind(node)
        if kind is None:
            continue
        if aliases is None:
            aliases = _AliasMap(graph)
        order = {n: index for index, n in enumerate(graph.nodes)}
        target = node.args[0] if kind is not _WriteKind.OTHER else node.meta[WRITES][0]
        chain = aliases.indexing_chain(target)
        _refuse_unsupported(node, kind, target, chain, aliases.before(target, node, order), order)
        if kind is not _WriteKind.OTHER:  # OTHER writes nobody reads afterwards are harmless
            _rewrite(graph, node, kind, chain, aliases, order)


def _write_kind(node: fx.Node) -> _WriteKind | None:
    if node.op == "call_function" and node.target is operator.setitem:
        return _WriteKind.SETITEM
    writes = node.meta.get(WRITES, ())
    if not writes:
        return None
    first = node.args[0] if node.args else None
    if node.op == "call_method" and str(node.target).endswith("_") and first in writes:
        return _WriteKind.METHOD
    if node.op == "call_function" and node.kwargs.get("inplace") is True and first in writes:
        return _WriteKind.INPLACE_FLAG
    return _WriteKind.OTHER


# -- aliases ------------------------------------------------------------------------------------
def _storages(value: Any) -> set[StorageWeakRef]:
    return {
        StorageWeakRef(leaf.untyped_storage())
        for leaf in pytree.tree_leaves(value)
        if isinstance(leaf, torch.Tensor)
    }


class _AliasMap:
    """Which input each node's value is a view of, by position among its inputs.

    Read from the traced fake values (shared storage) before any rewrite; positions survive
    ``replace_input_with``, so a view of a rewritten tensor is a view of its new value.
    """

    def __init__(self, graph: fx.Graph) -> None:
        self.views_input: dict[fx.Node, int] = {}
        for node in graph.nodes:
            mine = _storages(node.meta.get("val"))
            for index, arg in enumerate(node.all_input_nodes):
                if mine and mine & _storages(arg.meta.get("val")):
                    self.views_input[node] = index
                    break

    def base(self, node: fx.Node) -> fx.Node | None:
        index = self.views_input.get(node)
        return None if index is None else node.all_input_nodes[index]

    def root(self, node: fx.Node) -> fx.Node:
        while (base := self.base(node)) is not None:
            node = base
        return node

    def before(self, target: fx.Node, write: fx.Node, order: dict[fx.Node, int]) -> list[fx.Node]:
        """Nodes before ``write`` sharing ``target``'s memory (``target`` included)."""
        root = self.root(target)
        return [n for n in order if order[n] < order[write] and self.root(n) is root]

    def indexing_chain(self, target: fx.Node) -> list[fx.Node]:
        """``[target, its base, ...]`` while each is its base tensor indexed (``h[:, 0]``)."""
        chain = [target]
        while _is_indexing_view(chain[-1]) and self.base(chain[-1]) is chain[-1].args[0]:
            chain.append(chain[-1].args[0])
        return chain

    def mark_view(self, node: fx.Node) -> None:
        self.views_input[node] = 0


def _is_indexing_view(node: fx.Node) -> bool:
    return (
        node.op == "call_function"
        and node.target is operator.getitem
        and isinstance(node.args[0], fx.Node)
        and isinstance(node.args[0].meta.get("val"), torch.Tensor)
    )


def _read_later(node: fx.Node, write: fx.Node, order: dict[fx.Node, int]) -> list[fx.Node]:
    return [user for user in node.users if order.get(user, -1) > order[write]]


def _refuse_unsupported(
    node: fx.Node,
    kind: _WriteKind,
    target: fx.Node,
    chain: list[fx.Node],
    aliases: list[fx.Node],
    order: dict[fx.Node, int],
) -> None:
    if any(alias.op in ("placeholder", "get_attr") for alias in aliases):
        raise user_error(
            TraceError,
            "The step writes in place into one of its inputs or into a module's parameter or "
            "buffer; split stages would change your batch or your model as a side effect, "
            "and a cached value would differ from the one the step read.",
            node=node,
            fix=WRITE_A_COPY_FIX,
        )
    observers = [alias for alias in aliases if _read_later(alias, node, order)]
    if kind is _WriteKind.OTHER and observers:
        raise user_error(
            TraceError,
            f"This operation writes into its argument {target.name!r}, which the step reads "
            "again afterwards; graphsplit traces dataflow and cannot follow the write.",
            node=node,
            fix=WRITE_A_COPY_FIX,
        )
    for alias in observers:
        if _indexing_path(alias, chain[-1]) is None:
            raise user_error(
                TraceError,
                f"The step writes in place into {target.name!r}, and {alias.name!r}, which "
                "shares its memory, is read afterwards; graphsplit follows writes through "
                "indexing views (h[:, 0].mul_(2)) but not through other views "
                "(.view(), .transpose(), .chunk(), ...).",
                node=node,
                fix=WRITE_A_COPY_FIX,
            )


def _indexing_path(view: fx.Node, root: fx.Node) -> list[fx.Node] | None:
    """``[view, its base, ..., root]`` if ``view`` is ``root`` indexed (getitem) repeatedly."""
    path = [view]
    while path[-1] is not root:
        if not _is_indexing_view(path[-1]):
            return None
        path.append(path[-1].args[0])
    return path


# -- the rewrite --------------------------------------------------------------------------------
def _rewrite(
    graph: fx.Graph,
    node: fx.Node,
    kind: _WriteKind,
    chain: list[fx.Node],
    aliases: _AliasMap,
    order: dict[fx.Node, int],
) -> None:
    """Insert the functional form of ``node``; reroute every later reader of its aliases."""
    root = chain[-1]
    with graph.inserting_before(node):
        value = _functional(graph, node, kind)
        _copy_meta(node, value, _fresh_like(chain[0]))
        # Up the chain of indexing views: each base's new value holds its view's new value.
        newest = value
        for view, base in itertools.pairwise(chain):
            newest = graph.call_function(functional_setitem, (base, view.args[1], newest))
            _copy_meta(node, newest, _fresh_like(base))
        replaced = {root: newest}

        def rederive(view: fx.Node) -> fx.Node:
            # A later reader of a view of the root reads it from the root's new value, so a
            # later write through that view still lands in the root.
            if view not in replaced:
                base = rederive(view.args[0])
                replaced[view] = graph.call_function(operator.getitem, (base, view.args[1]))
                aliases.mark_view(replaced[view])
                with meta_execution():
                    view_value = base.meta["val"][view.args[1]]
                _copy_meta(node, replaced[view], view_value)
            return replaced[view]

        for alias in aliases.before(chain[0], node, order):
            later = _read_later(alias, node, order)
            if later:
                replacement = rederive(alias)
                for user in later:
                    _reroute(user, alias, replacement)
        if kind is not _WriteKind.SETITEM and node.users:
            result = rederive(chain[0])
            for user in list(node.users):
                _reroute(user, node, result)
    graph.erase_node(node)


def _reroute(user: fx.Node, old: fx.Node, new: fx.Node) -> None:
    """``user`` reads ``new`` where it read ``old`` (also in the writes the tracer saw)."""
    user.replace_input_with(old, new)
    if WRITES in user.meta:
        user.meta[WRITES] = tuple(new if seen is old else seen for seen in user.meta[WRITES])


def _functional(graph: fx.Graph, node: fx.Node, kind: _WriteKind) -> fx.Node:
    if kind is _WriteKind.SETITEM:
        return graph.call_function(functional_setitem, node.args)
    if kind is _WriteKind.METHOD:
        target, *rest = node.args
        return graph.call_function(
            functional_inplace, (target, node.target, *rest), dict(node.kwargs)
        )
    return graph.call_function(node.target, node.args, {**node.kwargs, "inplace": False})


def _fresh_like(node: fx.Node) -> Any:
    """A fake value of ``node``'s shape with memory of its own."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return value
    with meta_execution():
        return torch.empty_like(value)


def _copy_meta(node: fx.Node, new: fx.Node, value: Any) -> None:
    """Keep the user's line; the op record of the in-place op does not describe the copy."""
    new.meta = {key: node.meta[key] for key in ("source", "source_code") if key in node.meta}
    new.meta["val"] = value
