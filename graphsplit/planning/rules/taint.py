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
    device read: ``x.device``, a ``getattr(x, "device")`` node. A device is not data:
        InstructPix2Pix's ``text_encoder(tokenize([""]).to(latents.device))[0]`` is a
        per-dataset constant although ``latents`` is drawn. Taint follows every input, so it
        would keep the text encoder in stage 2, held and re-run every step, where
        ``recompute="never"`` keeps frozen work in stage 1. :func:`read_devices_off_inputs`
        points such frozen work (and the nodes it reads that only a device read of a tainted
        node taints) at the device of a stage-1 input, the device the frozen work runs on there
        (stage 2 gets the value moved to its device, as every boundary value); every other
        node keeps its device read, so a step without such work keeps its graph as it was.

In: a graph whose nodes carry ``meta["facts"]``, the trainable parameter names.
Out:

    compute_taint(graph, trainable) -> {node: Taint}
    read_devices_off_inputs(graph, taint) -> bool   # True: it changed the graph; taint again
    is_storable(node, taint), is_banned(node, taint), storage_cost(node), module_owner(node)
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.fx as fx
from torch import nn

from graphsplit.artifacts import NodeFacts, Taint, TaintKind


def facts(node: fx.Node) -> NodeFacts:
    """The analysis's facts about ``node`` (``node.meta["facts"]``)."""
    return node.meta["facts"]


def compute_taint(graph: fx.Graph, trainable: frozenset[str]) -> Mapping[fx.Node, Taint]:
    """Tainted nodes with their reason, in graph order."""
    taint: dict[fx.Node, Taint] = {}
    for node in graph.nodes:
        if node.op == "output":
            continue
        own = _own_taint(node, trainable)
        if own is not None:
            taint[node] = own
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
    return node not in taint and _is_frozen_work(node)


def _is_frozen_work(node: fx.Node) -> bool:
    """FLOPs, or a call into a module that owns parameters (tainted or not)."""
    if facts(node).flops > 0:
        return True
    owner = module_owner(node)
    return owner is not None and bool(facts(owner).params)


def storage_cost(node: fx.Node) -> int:
    """Bytes per sample; a per-dataset constant is stored once and costs nothing per sample."""
    return facts(node).bytes_per_sample if facts(node).per_sample else 0


# -- device reads (see the glossary) ---------------------------------------------------------
def read_devices_off_inputs(graph: fx.Graph, taint: Mapping[fx.Node, Taint]) -> bool:
    """Point frozen work kept by a device at a stage-1 input's device (see the glossary).

    Kept by a device: a tainted node whose taint reaches it only through device reads of
    tainted nodes (its own property taints nothing: no trainable parameter, draw or mixing).
    """
    kept = _kept_by_a_device(graph, taint)
    work = [
        node
        for node in kept
        if not _is_device_read(node) and "facts" in node.meta and _is_frozen_work(node)
    ]
    anchor = _anchor(graph)
    if not work or anchor is None:
        return False
    rewired = _ancestors_kept(work, kept)
    reads: dict[fx.Node, fx.Node] = {}  # a device read of a tainted node -> the input's read
    for node in rewired:
        for read in [arg for arg in node.all_input_nodes if _is_device_read(arg) and arg in kept]:
            if read not in reads:
                reads[read] = _device_of(anchor, read)
            node.replace_input_with(read, reads[read])
    return bool(reads)


def _is_device_read(node: fx.Node) -> bool:
    return (
        node.op == "call_function"
        and node.target is getattr
        and len(node.args) == 2
        and node.args[1] == "device"
    )


def _kept_by_a_device(graph: fx.Graph, taint: Mapping[fx.Node, Taint]) -> list[fx.Node]:
    """The nodes kept by a device (see the glossary), device reads of tainted nodes included."""
    kept: dict[fx.Node, None] = {}
    for node in graph.nodes:
        if node not in taint:
            continue
        only_through_kept = taint[node].origin is not node and all(
            arg not in taint or arg in kept for arg in node.all_input_nodes
        )
        if _is_device_read(node) or only_through_kept:
            kept[node] = None
    return list(kept)


def _ancestors_kept(work: list[fx.Node], kept: list[fx.Node]) -> list[fx.Node]:
    """``work`` and the nodes kept by a device that it reads, transitively, in graph order."""
    kept_set, found = set(kept), set(work)
    pending = list(work)
    while pending:
        for arg in pending.pop().all_input_nodes:
            if arg in kept_set and arg not in found and not _is_device_read(arg):
                found.add(arg)
                pending.append(arg)
    return [node for node in kept if node in found]


def _anchor(graph: fx.Graph) -> fx.Node | None:
    """The first input of the step that is a tensor: stage 1 always has it."""
    for node in graph.nodes:
        if node.op != "placeholder":
            break
        if isinstance(node.meta.get("val"), torch.Tensor):
            return node
    return None


def _device_of(anchor: fx.Node, read: fx.Node) -> fx.Node:
    """A new ``anchor.device`` node after the inputs, carrying ``read``'s facts."""
    graph = anchor.graph
    last_input = [node for node in graph.nodes if node.op == "placeholder"][-1]
    with graph.inserting_after(last_input):
        node = graph.create_node(
            "call_function", getattr, (anchor, "device"), name=f"{anchor.name}_device"
        )
    node.meta = dict(read.meta)
    return node
