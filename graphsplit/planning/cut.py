"""Decide which values cross from stage 1 to stage 2: taint, then a min-cut on bytes per sample.

Glossary:
    tainted: a node that reads a trainable parameter, draws random numbers, mixes samples of a
        batch, or depends on a tainted node. Tainted nodes run in stage 2, every step.
    storable: an untainted tensor with one row per sample along a known batch dim, or a
        per-dataset constant. Only storable values can be boundary values.
    banned: untainted work that stage 2 must never redo: anything that runs FLOPs (matmuls,
        convolutions, attention) and any call of a module that owns frozen parameters.

The min-cut (node splitting as in functorch's rematerialisation partitioner): every node ``v``
becomes ``v_in -> v_out`` whose capacity is the cost of storing ``v`` (infinite if it cannot be
stored); data edges ``u_out -> v_in`` are infinite. The stage-1 terminal feeds inputs and banned
nodes (they stay in stage 1); tainted nodes and the step's outputs drain to the stage-2 terminal
(they are needed in stage 2). A cut edge ``v_in -> v_out`` is a boundary value. (The flow's
source and sink are called the stage-1 and stage-2 terminals here: "source" elsewhere in
graphsplit means the user's ``file:line``.)

Costs are integers, ordered so that bytes dominate everything else:
``bytes_per_sample * W + 2`` per stored value and ``1`` per node stage 2 recomputes, with ``W``
larger than every tie-breaker together. Among cuts with equal bytes this prefers fewer stage-2
operations, then fewer boundary tensors. networkx returns the cut whose sink side is smallest
(nodes that can reach the sink in the residual network); that set is the same for every maximum
flow, so the plan does not depend on the flow algorithm's internals.

In: a graph whose nodes carry ``meta["facts"]``, the trainable parameter names.
Out: :class:`~graphsplit.artifacts.Cut`, and the boundary's public description:

    choose_boundary(graph, trainable) -> Cut
    stages_for(graph, boundary, taint) -> Cut      # any boundary: tests hand-write them
    boundary_specs(cut) -> dict[str, BoundarySpec]
"""

from __future__ import annotations

from collections.abc import Mapping

import networkx as nx
import torch.fx as fx
from torch import nn

from graphsplit.artifacts import BoundarySpec, Cut, NodeFacts, Taint, TaintKind
from graphsplit.errors import SplitError, user_error

# The flow network's terminals (its source and sink).
_STAGE1_TERMINAL, _STAGE2_TERMINAL = "source", "sink"


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
    if node in taint:
        return False
    if facts(node).flops > 0:
        return True
    owner = module_owner(node)
    return owner is not None and bool(facts(owner).params)


def storage_cost(node: fx.Node) -> int:
    """Bytes per sample; a per-dataset constant is stored once and costs nothing per sample."""
    return facts(node).bytes_per_sample if facts(node).per_sample else 0


def _is_batch_size(node: fx.Node, taint: Mapping[fx.Node, Taint]) -> bool:
    return node not in taint and "facts" in node.meta and facts(node).is_batch_size


def _flow_network(
    graph: fx.Graph, taint: Mapping[fx.Node, Taint], *, anchorable: bool
) -> nx.DiGraph:
    """The node-split network; with ``anchorable``, batch-size values need no inputs."""
    nodes = [node for node in graph.nodes if node.op != "output"]
    weight = 3 * len(nodes) + 1
    network = nx.DiGraph()
    for node in nodes:
        v_in, v_out = f"{node.name}:in", f"{node.name}:out"
        if is_storable(node, taint):
            network.add_edge(v_in, v_out, capacity=storage_cost(node) * weight + 2)
        else:
            network.add_edge(v_in, v_out)
        if node in taint:
            network.add_edge(v_in, _STAGE2_TERMINAL)
        elif node.op == "placeholder" or is_banned(node, taint):
            network.add_edge(_STAGE1_TERMINAL, v_in)
        else:
            network.add_edge(_STAGE1_TERMINAL, v_in, capacity=1)
        for user in node.users:
            if user.op == "output":
                network.add_edge(v_out, _STAGE2_TERMINAL)
            elif not (anchorable and _is_batch_size(user, taint)):
                network.add_edge(v_out, f"{user.name}:in")
    return network


def choose_boundary(graph: fx.Graph, trainable: frozenset[str]) -> Cut:
    """The cheapest exact boundary; raises :class:`SplitError` when none exists."""
    taint = compute_taint(graph, trainable)
    cut = stages_for(graph, _min_cut(graph, taint, anchorable=True), taint)
    if cut.reanchored and cut.anchor is None:  # nothing per-sample to read the batch size off
        cut = stages_for(graph, _min_cut(graph, taint, anchorable=False), taint)
    return cut


def _min_cut(
    graph: fx.Graph, taint: Mapping[fx.Node, Taint], *, anchorable: bool
) -> tuple[fx.Node, ...]:
    network = _flow_network(graph, taint, anchorable=anchorable)
    try:
        _, (stage1_side, _) = nx.minimum_cut(
            network, _STAGE1_TERMINAL, _STAGE2_TERMINAL, flow_func=nx.algorithms.flow.dinitz
        )
    except nx.NetworkXUnbounded:
        raise _infeasible(graph, taint) from None
    return tuple(
        node
        for node in graph.nodes
        if node.op != "output"
        and f"{node.name}:in" in stage1_side
        and f"{node.name}:out" not in stage1_side
    )


def stages_for(
    graph: fx.Graph, boundary: tuple[fx.Node, ...], taint: Mapping[fx.Node, Taint] | None = None
) -> Cut:
    """The nodes each stage runs for a given boundary (any boundary: tests hand-write them)."""
    taint = taint if taint is not None else {}
    boundary_set = set(boundary)
    output = next(node for node in graph.nodes if node.op == "output")
    stage2: set[fx.Node] = set()
    # Every random draw runs in stage 2, used or not: skipping one would shift the draws after it.
    draws = [n for n in graph.nodes if "facts" in n.meta and facts(n).random_ops]
    pending = list(output.all_input_nodes) + draws
    deferred: list[fx.Node] = []  # batch-size values: their inputs are needed only maybe
    while pending:
        node = pending.pop()
        if node in stage2 or node in boundary_set:
            continue
        if _is_batch_size(node, taint):
            if node not in deferred:
                deferred.append(node)
            continue
        if node.op == "placeholder":
            raise AssertionError(f"stage 2 would need input {node.name}: boundary is not a cut")
        stage2.add(node)
        pending.extend(node.all_input_nodes)
    reanchored = set()
    for node in deferred:
        needed = _size_inputs(node, stage2 | boundary_set)
        if needed is None:
            reanchored.add(node)
        else:
            stage2 |= needed | {node}
    anchor = next((n for n in boundary if "facts" in n.meta and facts(n).per_sample), None)
    stage2 |= reanchored
    stage1: set[fx.Node] = {node for node in graph.nodes if node.op == "placeholder"}
    pending = list(boundary)
    while pending:
        node = pending.pop()
        if node not in stage1:
            stage1.add(node)
            pending.extend(node.all_input_nodes)
    return Cut(boundary, frozenset(stage1), frozenset(stage2), taint, frozenset(reanchored), anchor)


def _size_inputs(node: fx.Node, available: set[fx.Node]) -> set[fx.Node] | None:
    """The shape-reading nodes between ``node`` and tensors stage 2 has, or None if missing."""
    needed: set[fx.Node] = set()
    pending = list(node.all_input_nodes)
    while pending:
        producer = pending.pop()
        if producer in available or producer in needed:
            continue
        if "facts" in producer.meta and facts(producer).is_tensor:
            return None  # reading this size would need a tensor stage 2 does not have
        if producer.op == "placeholder":
            return None
        needed.add(producer)
        pending.extend(producer.all_input_nodes)
    return needed


def _infeasible(graph: fx.Graph, taint: Mapping[fx.Node, Taint]) -> SplitError:
    """Find the value stage 2 needs that can be neither stored nor recomputed, and say why."""
    needed = [node for node in graph.nodes if node in taint]
    needed += next(n for n in graph.nodes if n.op == "output").all_input_nodes
    seen: set[fx.Node] = set()
    for start in needed:
        culprit = _unreachable_input(start, taint, seen)
        if culprit is not None:
            return _explain(culprit)
    return SplitError("no exact split exists for this step (internal: unexplained infinite cut)")


def _unreachable_input(
    start: fx.Node, taint: Mapping[fx.Node, Taint], seen: set[fx.Node]
) -> fx.Node | None:
    pending = [start] if start not in taint else list(start.all_input_nodes)
    while pending:
        node = pending.pop()
        if node in seen or node in taint:
            continue
        seen.add(node)
        if is_storable(node, taint):
            continue
        if node.op == "placeholder" or is_banned(node, taint):
            return node
        pending.extend(node.all_input_nodes)
    return None


def _explain(node: fx.Node) -> SplitError:
    node_facts = facts(node)
    if not node_facts.is_tensor:
        return user_error(
            SplitError,
            f"Stage 2 needs this value, a {node_facts.type_name}, but it is not a tensor, so it "
            "cannot be cached, and recomputing it would rerun frozen work in stage 2.",
            node=node,
            fix="register a codec for the type with graphsplit.register_codec(type, encode, "
            "decode), or make the step pass tensors (e.g. use .sample / [0] on outputs)",
        )
    return user_error(
        SplitError,
        f"Stage 2 needs this tensor (shape {tuple(node_facts.shape or ())}), but it does not hold"
        " one row per sample along a single batch dimension, so it cannot be cached per sample.",
        node=node,
        fix="keep the batch as its own dimension in frozen code (avoid folding it into other "
        "dims or repeating it, e.g. for classifier-free guidance) before the trainable part",
    )


def boundary_specs(cut: Cut) -> dict[str, BoundarySpec]:
    """The public description of each boundary value, keyed by its node's name."""
    return {node.name: _spec(node) for node in cut.boundary}


def _spec(node: fx.Node) -> BoundarySpec:
    node_facts = facts(node)
    return BoundarySpec(
        name=node.name,
        shape=tuple(node_facts.shape),
        dtype=node_facts.dtype,
        batch_dim=node_facts.batch_dim if node_facts.per_sample else None,
        bytes_per_sample=node_facts.bytes_per_sample if node_facts.per_sample else 0,
        source=node.meta.get("source") or "<unknown>",
    )
