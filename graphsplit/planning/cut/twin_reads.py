"""A size or device read off a frozen call's output is read off a boundary tensor in stage 2.

:mod:`~graphsplit.planning.cut.sized_constants` lets stage 2 recompute a per-dataset constant
made from the batch's length when everything the constant reads is a tensor stage 2 has. OPT
and BART build their causal / bidirectional mask piece from ``inputs_embeds.shape`` and
``inputs_embeds.device``, where ``inputs_embeds = embed_tokens(input_ids)``: the frozen
embedding's output, which is not on the boundary (the boundary carries ``inputs_embeds +
positions``, or BART's ``layernorm_embedding`` of it). The mask then stayed a stored constant,
its length guarded, and every padded length was a plan of its own.

Stage 2 does not need ``inputs_embeds`` to read its length: a boundary tensor computed from it
(its *twin*) has the same shape and device. Stage 2 makes the read on the twin; stage 1, which
holds both tensors, checks on every batch that the read gives the same value on each
(:func:`graphsplit.runtime.check_same_read`), so nothing is cached under a plan whose stage 2
would read another value; a batch where they differ stops with a
:class:`~graphsplit.runtime.PlanMismatch`, and the dispatcher makes it a plan of its own.

Glossary:
    read: a node that reads only the metadata of one tensor ``x``: ``x.shape``, ``x.device``,
        ``x.dtype`` (``getattr``), ``x.size(...)``, ``x.dim()``; or one entry of a shape read,
        ``x.shape[-1]``, where the constant reads nothing else of the shape (BART's
        ``kv_length = attention_mask.shape[-1]`` is the last size of its 4-d mask, whose
        whole shape differs).
    twin: a per-sample boundary tensor computed from ``x`` (``x`` is one of its ancestors),
        with ``x``'s batch dimension, on which every read of ``x`` the constant needs gives
        what it gave on ``x`` at the example batch. The nearest such tensor after ``x`` in the
        graph is chosen.

In and out::

    twins_for(end, walked, boundary) -> {read: twin} | None       # sized_constants asks
    check_twin_reads(stage, cut, env, sources) -> None            # stage 1's checks
    read_on(stage, read, tensor) -> node                          # stage 2's read
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Sequence
from typing import Any

import torch
import torch.fx as fx

from graphsplit.artifacts import Cut
from graphsplit.planning.rules.metadata_reads import is_metadata_read
from graphsplit.planning.rules.node_inputs import reads_through
from graphsplit.planning.rules.size_guards import (
    CheckSources,
    expression,
    insert_check,
    is_size_read,
    where_read,
)
from graphsplit.planning.rules.taint import facts
from graphsplit.runtime import check_same_read

__all__ = ["check_twin_reads", "computed_from", "is_read", "read_on", "read_tensor", "twins_for"]


def is_read(node: fx.Node, tensor: fx.Node) -> bool:
    """Whether ``node`` reads only ``tensor``'s metadata (see the glossary)."""
    if not node.args or node.args[0] is not tensor or node.kwargs:
        return False
    if node.op == "call_method":
        return node.target in ("size", "dim") and all(isinstance(a, int) for a in node.args[1:])
    return is_size_read(node) or is_metadata_read(node)


def _is_entry(node: fx.Node, read: fx.Node) -> bool:
    """Whether ``node`` is ``read[k]`` of a shape ``read`` (``x.shape[1]``, ``x.size()[-1]``)."""
    return (
        node.op == "call_function"
        and node.target is operator.getitem
        and node.args[0] is read
        and isinstance(node.args[1], (int, slice))
        and not node.kwargs
        and is_size_read(read)
    )


def twins_for(
    end: fx.Node, walked: Collection[fx.Node], boundary: Sequence[fx.Node]
) -> dict[fx.Node, fx.Node] | None:
    """``{read: twin}`` covering every node of ``walked`` that reads ``end``, or None when stage
    2 cannot make one of them on the boundary. A shape read no twin matches whole may be made
    entry by entry (``x.shape[1]``), when the walk reads nothing else of it."""
    readers = [user for user in end.users if user in walked]
    if not readers or not all(is_read(reader, end) for reader in readers):
        return None
    if "facts" not in end.meta or not facts(end).per_sample:
        return None
    candidates = _candidates(end, boundary)
    found: dict[fx.Node, fx.Node] = {}
    for reader in readers:
        twin = _serving(reader, candidates)
        if twin is not None:
            found[reader] = twin
            continue
        entries = [user for user in reader.users if user in walked]
        if not entries or not all(_is_entry(entry, reader) for entry in entries):
            return None
        for entry in entries:
            twin = _serving(entry, candidates)
            if twin is None:
                return None
            found[entry] = twin
    return found


def _serving(read: fx.Node, candidates: Sequence[fx.Node]) -> fx.Node | None:
    return next((twin for twin in candidates if _same_value(read, twin)), None)


def _candidates(end: fx.Node, boundary: Sequence[fx.Node]) -> list[fx.Node]:
    """Per-sample boundary tensors of ``end``'s batch dimension computed from ``end``,
    nearest first."""
    position = {node: index for index, node in enumerate(end.graph.nodes)}
    batch_dim = facts(end).batch_dim
    found = [
        node
        for node in boundary
        if "facts" in node.meta
        and facts(node).per_sample
        and facts(node).batch_dim == batch_dim
        and isinstance(node.meta.get("val"), torch.Tensor)
        and computed_from(node, end, position)
    ]
    return sorted(found, key=position.__getitem__)


def computed_from(node: fx.Node, ancestor: fx.Node, position: dict[fx.Node, int]) -> bool:
    """Whether ``ancestor`` is among the nodes ``node`` reads, transitively (nodes before
    ``ancestor`` in the graph cannot lead to it, so the walk stops there)."""
    start = position[ancestor]
    _, ends = reads_through(node, lambda read: read is not ancestor and position[read] > start)
    return ancestor in ends


def _same_value(read: fx.Node, twin: fx.Node) -> bool:
    """Whether ``read`` made on ``twin``'s example value gives what it gave on its own."""
    if "val" not in read.meta:
        return False
    try:
        value = _read(read, twin.meta["val"])
    except (TypeError, IndexError, RuntimeError):
        return False
    expected = read.meta["val"]
    return type(value) is type(expected) and value == expected


def _read(read: fx.Node, tensor: torch.Tensor) -> Any:
    if read.target is operator.getitem:
        inner = read.args[0]
        assert isinstance(inner, fx.Node)
        return _read(inner, tensor)[read.args[1]]
    with torch._C.DisableTorchFunction():
        if read.op == "call_function":
            return getattr(tensor, str(read.args[1]))
        return getattr(tensor, str(read.target))(*read.args[1:])


def check_twin_reads(
    stage: fx.Graph, cut: Cut, env: dict[fx.Node, fx.Node], sources: CheckSources
) -> None:
    """Insert into stage 1 the check of each read stage 2 makes on a twin: the read made on
    the tensor itself and on its twin must agree for the batch (see the module docstring)."""
    for read, twin in cut.twin_reads.items():
        tensor = read_tensor(read)
        # The twin is computed from the tensor, so it comes after it in stage 1.
        with stage.inserting_before(env[twin].next):  # in order, unlike inserting_after
            on_twin = read_on(stage, read, env[twin])
            on_tensor = read_on(stage, read, env[tensor])
        arguments = (on_twin, on_tensor, expression(read), expression(twin))
        insert_check(stage, on_tensor, arguments, where_read(read), sources, check_same_read)


def read_tensor(read: fx.Node) -> fx.Node:
    """The tensor ``read`` (a read, or an entry of one) reads."""
    inner = read.args[0]
    assert isinstance(inner, fx.Node)
    return read_tensor(inner) if read.target is operator.getitem else inner


def read_on(stage: fx.Graph, read: fx.Node, tensor: fx.Node) -> fx.Node:
    """``read`` made on ``tensor`` (a node of ``stage``), at the stage's insertion point."""
    if read.target is operator.getitem:
        inner = read.args[0]
        assert isinstance(inner, fx.Node)
        tensor = read_on(stage, inner, tensor)
    made = stage.create_node(read.op, read.target, (tensor, *read.args[1:]), name=read.name)
    made.meta = dict(read.meta)
    return made
