"""Why a node must run in stage 2, and what stage 2 may not redo: the cut's predicates.

Glossary:
    tainted: a node that reads a trainable parameter, draws random numbers, mixes samples of a
        batch, or depends on a tainted node. Tainted nodes run in stage 2, every step.
    storable: an untainted tensor with one row per sample along a known batch dim, or a
        per-dataset constant. Only storable values can be boundary values.
    banned (frozen work): untainted work that runs FLOPs (matmuls, convolutions, attention) or
        calls a module that owns frozen parameters. With ``recompute="never"`` stage 2 never
        redoes it; ``recompute="auto"`` prices some of it
        (:mod:`graphsplit.planning.cut.recompute`).

In: a graph whose nodes carry ``meta["facts"]``, the trainable parameter names.
Out:

    compute_taint(graph, trainable) -> {node: Taint}
    is_storable(node, taint), is_banned(node, taint), storage_cost(node), module_owner(node)
"""

from __future__ import annotations

from collections.abc import Mapping

import torch.fx as fx
from torch import nn

from graphsplit.artifacts import NodeFacts, Taint, TaintKind


def facts(node: fx.Node) -> NodeFacts:
    """The analysis's facts about ``node`` (``node.meta["facts"]``)."""
    return node.meta["facts"]


def compute_taint(
    graph: fx.Graph, trainable: frozenset[str], *, clean: frozenset[fx.Node] = frozenset()
) -> Mapping[fx.Node, Taint]:
    """Tainted nodes with their reason, in graph order.

    ``clean`` nodes inherit no taint from what they read (only their own): the
    :mod:`~graphsplit.planning.rules.metadata_reads` rule asks what would be untainted if a
    device or dtype read did not carry its tensor's taint.
    """
    taint: dict[fx.Node, Taint] = {}
    for node in graph.nodes:
        if node.op == "output":
            continue
        own = _own_taint(node, trainable)
        if own is not None:
            taint[node] = own
            continue
        if node in clean:
            continue
        for producer in node.all_input_nodes:
            if producer in taint:
                taint[node] = taint[producer]
                break
    return taint


def _own_taint(node: fx.Node, trainable: frozenset[str]) -> Taint | None:
    node_facts = facts(node)
    read = tuple(sorted(node_facts.params & trainable))
    if read:
        return Taint(TaintKind.TRAINABLE, node, trainable_parameters=read)
    if node_facts.random_ops:
        return Taint(TaintKind.RANDOM, node, random_ops=node_facts.random_ops)
    if node_facts.mixing is not None:
        return Taint(TaintKind.MIXING, node, mixing=node_facts.mixing)
    return None


def is_storable(node: fx.Node, taint: Mapping[fx.Node, Taint]) -> bool:
    node_facts = facts(node)
    return (
        node not in taint
        and node.op != "get_attr"
        and node_facts.is_tensor
        and (node_facts.per_sample or node_facts.is_constant)
    )


def module_owner(node: fx.Node) -> fx.Node | None:
    """The node naming the module a call runs: ``self.unet(x)`` itself, ``vae`` for
    ``vae.encode(x)``; None for anything that is not a module call."""
    if node.op == "call_module":
        return node
    if node.op == "call_method" and node.args and isinstance(node.args[0], fx.Node):
        handle = node.args[0]
        if handle.op == "get_attr" and isinstance(handle.meta.get("val"), nn.Module):
            return handle
    return None


def is_banned(node: fx.Node, taint: Mapping[fx.Node, Taint]) -> bool:
    """Untainted work stage 2 must not redo: FLOPs, or a call into a frozen module."""
    if node in taint:
        return False
    if facts(node).flops > 0:
        return True
    owner = module_owner(node)
    return owner is not None and bool(facts(owner).params)


def storage_cost(node: fx.Node) -> int:
    """Bytes per sample; a per-dataset constant is stored once and costs nothing per sample."""
    return facts(node).bytes_per_sample if facts(node).per_sample else 0
