"""Decide which values cross from stage 1 to stage 2: taint, then a min-cut on bytes per sample.

Glossary (the predicates live in :mod:`graphsplit.planning.rules.taint`, the prices in
:mod:`graphsplit.planning.cut.recompute`):
    tainted: must run in stage 2 (reads a trainable parameter, draws random numbers, mixes
        samples, or depends on such a node).
    storable: an untainted per-sample tensor or per-dataset constant: a possible boundary value.
    banned (frozen work): untainted work with FLOPs, or a call of a module owning frozen
        parameters. With ``recompute="never"`` stage 2 never redoes it; with ``"auto"`` the
        candidates among it (one layer whose inputs are already on the boundary) have a price.
    fixed number: an untainted int / ``torch.Size`` read off tensor sizes, the same at both
        probe batch sizes (:mod:`graphsplit.planning.rules.baked_sizes`). Cutting one bakes it into
        stage 2 as a literal (``Cut.baked``, checked in stage 1): no bytes, nothing cached.

The min-cut (node splitting as in functorch's rematerialisation partitioner): every node ``v``
becomes ``v_in -> v_out`` whose capacity is the cost of storing ``v`` (infinite if it cannot be
stored); data edges ``u_out -> v_in`` are infinite. The stage-1 terminal feeds inputs and banned
nodes (they stay in stage 1); tainted nodes and the step's outputs drain to the stage-2 terminal
(they are needed in stage 2). A cut edge ``v_in -> v_out`` is a boundary value. (The flow's
source and sink are called the stage-1 and stage-2 terminals here: "source" elsewhere in
graphsplit means the user's ``file:line``.)

With ``recompute="auto"`` a candidate's edge from the stage-1 terminal costs its FLOPs in
byte-equivalents instead of being infinite, and each frozen parameter a candidate reads becomes
a node ``weight:<name>`` fed by the stage-1 terminal at the price of holding it and feeding
every node that reads it: stage 2 pays for a weight once, however many of its readers it runs.

Costs are integers, ordered so that bytes dominate everything else:
``bytes_per_sample * W + 2`` per stored value, ``price * W + 1`` per candidate stage 2 redoes,
``price * W`` per priced weight it holds, ``B`` per baked number, and ``1`` per other node
stage 2 recomputes, with ``B`` larger than every other tie-breaker together and ``W`` larger
than every baked number together. Among cuts with equal bytes this bakes the fewest numbers (a
size stage 2 can read off a tensor it has stays computed), then prefers fewer stage-2
operations, then fewer boundary tensors. networkx returns the cut whose sink side is
smallest (nodes that can reach the sink in the residual network); that set is the same for every
maximum flow, so the plan does not depend on the flow algorithm's internals.

In: a graph whose nodes carry ``meta["facts"]``, the trainable parameter names, and (for
``recompute="auto"``) the model, whose parameter sizes price the weights.
Out: :class:`~graphsplit.artifacts.Cut`, and the boundary's public description:

    choose_boundary(graph, trainable, recompute=, model=) -> Cut
    cheapest_cut(graph, trainable, recompute=, model=) -> Cut   # the min-cut alone
    stages_for(graph, boundary, taint, baked=) -> Cut   # any boundary: tests hand-write them
    boundary_specs(cut) -> dict[str, BoundarySpec]

A boundary constant made from a size of the batch leaves the boundary when stage 2 can compute
it cheaply (:mod:`graphsplit.planning.cut.sized_constants`): one plan serves every length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch.fx as fx
from torch import nn

from graphsplit.artifacts import BoundarySpec, Cut, Recomputation, Taint
from graphsplit.errors import Fix, SplitError, user_error
from graphsplit.planning.cut.min_cut import Unbounded, sink_side
from graphsplit.planning.cut.number_twins import numbers_on_twins
from graphsplit.planning.cut.recompute import (
    AUTO,
    CostModel,
    Prices,
    Recompute,
    check_recompute,
    price,
    traced_batch_size,
    weights_read,
)
from graphsplit.planning.cut.sized_constants import (
    numbers_read_off_twins,
    recomputable_constants,
)
from graphsplit.planning.opaque.value_reads import value_checks
from graphsplit.planning.patching.patcher import cyclic_gc_paused
from graphsplit.planning.rules.baked_sizes import is_fixed_number
from graphsplit.planning.rules.constant_names import name_constants
from graphsplit.planning.rules.metadata_reads import anchor_metadata_reads
from graphsplit.planning.rules.node_inputs import reads_through
from graphsplit.planning.rules.taint import (
    compute_taint,
    facts,
    is_banned,
    is_storable,
    module_owner,
    storage_cost,
)

__all__ = [
    "boundary_specs",
    "cheapest_cut",
    "choose_boundary",
    "compute_taint",
    "facts",
    "is_banned",
    "is_storable",
    "module_owner",
    "stages_for",
    "storage_cost",
]

# The flow network's terminals (its source and sink).
_STAGE1_TERMINAL, _STAGE2_TERMINAL = "source", "sink"
_NO_PRICES = Prices(work={}, weights={}, readers={})


def _is_batch_size(node: fx.Node, taint: Mapping[fx.Node, Taint]) -> bool:
    return node not in taint and "facts" in node.meta and facts(node).is_batch_size


def _flow_network(
    graph: fx.Graph, taint: Mapping[fx.Node, Taint], prices: Prices, *, anchorable: bool
) -> dict[tuple[str, str], int | None]:
    """The node-split network as an edge list (capacity ``None``: infinite); with
    ``anchorable``, batch-size values need no inputs."""
    nodes = [node for node in graph.nodes if node.op != "output"]
    live = _live(graph)
    # Tie-breakers: 1 per node stage 2 recomputes, 2 per boundary tensor (at most 3n together);
    # a baked number costs more than all of those, so stage 2 computes a size itself when it
    # has what it is read from; bytes cost more than every baked number together.
    bake = 3 * len(nodes) + 1
    weight = bake * (len(nodes) + 1)
    network: dict[tuple[str, str], int | None] = {}
    for node in nodes:
        v_in, v_out = f"{node.name}:in", f"{node.name}:out"
        if is_storable(node, taint):
            network[v_in, v_out] = storage_cost(node) * weight + 2
        elif is_fixed_number(node, taint):
            network[v_in, v_out] = bake
        else:
            network[v_in, v_out] = None
        if node in taint and node in live:  # a dead one (a VQ loss nobody reads) runs nowhere
            network[v_in, _STAGE2_TERMINAL] = None
        elif node in prices.work:
            network[_STAGE1_TERMINAL, v_in] = prices.work[node] * weight + 1
        elif node.op == "placeholder" or is_banned(node, taint):
            network[_STAGE1_TERMINAL, v_in] = None
        else:
            network[_STAGE1_TERMINAL, v_in] = 1
        for user in node.users:
            if user.op == "output":
                network[v_out, _STAGE2_TERMINAL] = None
            elif not (anchorable and _is_batch_size(user, taint)):
                network[v_out, f"{user.name}:in"] = None
    for name, cost in prices.weights.items():
        network[_STAGE1_TERMINAL, f"weight:{name}"] = cost * weight
        for reader in prices.readers[name]:
            network[f"weight:{name}", f"{reader.name}:in"] = None
    return network


def choose_boundary(
    graph: fx.Graph,
    trainable: frozenset[str],
    *,
    recompute: Recompute = "never",
    model: nn.Module | None = None,
    costs: CostModel = AUTO,
) -> Cut:
    """The cheapest exact boundary; raises :class:`SplitError` when none exists.

    ``recompute="auto"`` (``model`` required) lets stage 2 redo candidate frozen work when its
    price in ``costs`` is below the bytes it saves; the cut's ``recomputation`` says what was
    traded against the ``"never"`` plan.
    """
    cut = cheapest_cut(graph, trainable, recompute=recompute, model=model, costs=costs)
    cut = _recompute_sized_constants(graph, cut)
    name_constants(cut)
    return cut


def cheapest_cut(
    graph: fx.Graph,
    trainable: frozenset[str],
    *,
    recompute: Recompute = "never",
    model: nn.Module | None = None,
    costs: CostModel = AUTO,
) -> Cut:
    """The min-cut's own choice, optimal in the cost model (tests/planning/test_cut_property.py
    checks it by brute force); :func:`choose_boundary` then lets stage 2 compute the sized
    constants and read the numbers off twins it can (outside the cost model: they trade a
    stored constant or a baked literal for a plan that serves every length)."""
    check_recompute(recompute)
    anchor_metadata_reads(graph, trainable)  # frozen work a device read would make per step
    return _choose(graph, trainable, recompute, model, costs)


def _recompute_sized_constants(graph: fx.Graph, cut: Cut) -> Cut:
    """``cut`` less the constants made from a batch size that stage 2 computes itself
    (:mod:`graphsplit.planning.cut.sized_constants`), and less the baked numbers stage 2 reads
    off a twin (:mod:`graphsplit.planning.cut.twin_reads`) or as a twin's size
    (:mod:`graphsplit.planning.cut.number_twins`): stored or baked, each would make every
    padded length a plan of its own."""
    constants, twin_reads = recomputable_constants(graph, cut)
    numbers, number_reads = numbers_read_off_twins(cut)
    on_twins = numbers_on_twins(cut, (node for node in cut.baked if node not in numbers))
    if not constants and not numbers and not on_twins:
        return cut
    moved = set(constants)
    boundary = tuple(node for node in cut.boundary if node not in moved)
    baked = tuple(node for node in cut.baked if node not in numbers and node not in on_twins)
    reads = {**twin_reads, **number_reads}
    recomputed = stages_for(
        graph, boundary, cut.taint, baked=baked, twin_reads=reads, number_twins=on_twins
    )
    if recomputed.reanchored and recomputed.anchor is None:
        return cut  # a batch size stage 2 would need has nothing per-sample to be read off
    return dataclasses.replace(recomputed, recomputation=cut.recomputation)


def _choose(
    graph: fx.Graph,
    trainable: frozenset[str],
    recompute: Recompute,
    model: nn.Module | None,
    costs: CostModel,
) -> Cut:
    taint = compute_taint(graph, trainable)
    if recompute == "never":
        return _cheapest(graph, taint, _NO_PRICES)
    assert model is not None, 'recompute="auto" prices weights: pass the model'
    weight_bytes = {name: p.numel() * p.element_size() for name, p in model.named_parameters()}
    prices = price(graph, taint, weight_bytes, costs)
    if not prices.work:
        return _cheapest(graph, taint, _NO_PRICES)
    traded = _cheapest(graph, taint, prices)
    try:
        stored: Cut | None = _cheapest(graph, taint, _NO_PRICES)
    except SplitError:  # only redoing frozen work makes this step splittable
        stored = None
    trade = _trade(graph, stored, traded, taint, weight_bytes)
    return dataclasses.replace(traded, recomputation=trade)


def _cheapest(graph: fx.Graph, taint: Mapping[fx.Node, Taint], prices: Prices) -> Cut:
    cut = _stages_for_cut(graph, _min_cut(graph, taint, prices, anchorable=True), taint)
    if cut.reanchored and cut.anchor is None:  # nothing per-sample to read the batch size off
        cut = _stages_for_cut(graph, _min_cut(graph, taint, prices, anchorable=False), taint)
    return cut


def _stages_for_cut(
    graph: fx.Graph, cut_nodes: tuple[fx.Node, ...], taint: Mapping[fx.Node, Taint]
) -> Cut:
    """The cut's values split into cached tensors and numbers baked into stage 2."""
    numbers = tuple(node for node in cut_nodes if not is_storable(node, taint))
    boundary = tuple(node for node in cut_nodes if node not in numbers)
    return stages_for(graph, boundary, taint, baked=numbers)


def _trade(
    graph: fx.Graph,
    stored: Cut | None,
    traded: Cut,
    taint: Mapping[fx.Node, Taint],
    weight_bytes: Mapping[str, int],
) -> Recomputation | None:
    """What ``traded`` redoes in stage 2, and what that bought, against ``stored`` (None when
    no plan without recomputation exists)."""
    redone = tuple(node for node in graph.nodes if node in traded.stage2 and is_banned(node, taint))
    if not redone:
        return None
    read = set().union(*(weights_read(node, taint) for node in redone))
    added = sorted(read - (held_weights(stored) if stored else frozenset()))
    return Recomputation(
        nodes=redone,
        bytes_saved_per_sample=boundary_bytes(stored) - boundary_bytes(traded) if stored else None,
        flops_per_sample=sum(facts(node).flops for node in redone) // traced_batch_size(graph),
        weights=tuple(added),
        weight_bytes=sum(weight_bytes[name] for name in added),
    )


def boundary_bytes(cut: Cut) -> int:
    """Bytes per sample the cut's boundary stores."""
    return sum(storage_cost(node) for node in cut.boundary)


def held_weights(cut: Cut) -> frozenset[str]:
    """Parameters stage 2 holds (those its nodes read), by qualified name."""
    return frozenset(
        name for node in cut.stage2 if "facts" in node.meta for name in facts(node).params
    )


def _min_cut(
    graph: fx.Graph, taint: Mapping[fx.Node, Taint], prices: Prices, *, anchorable: bool
) -> tuple[fx.Node, ...]:
    with cyclic_gc_paused():
        network = _flow_network(graph, taint, prices, anchorable=anchorable)
        try:
            stage2_side = sink_side(network, _STAGE1_TERMINAL, _STAGE2_TERMINAL)
        except Unbounded:
            raise _infeasible(graph, taint) from None
        del network  # freed by reference counting, before the collector runs again
    return tuple(
        node
        for node in graph.nodes
        if node.op != "output"
        and f"{node.name}:in" not in stage2_side
        and f"{node.name}:out" in stage2_side
    )


def stages_for(
    graph: fx.Graph,
    boundary: tuple[fx.Node, ...],
    taint: Mapping[fx.Node, Taint] | None = None,
    *,
    baked: tuple[fx.Node, ...] = (),
    twin_reads: Mapping[fx.Node, fx.Node] | None = None,
    number_twins: Mapping[fx.Node, tuple[fx.Node, int]] | None = None,
) -> Cut:
    """The nodes each stage runs for a given boundary (any boundary: tests hand-write them).

    ``baked``: fixed numbers stage 2 holds as literals
    (:mod:`graphsplit.planning.rules.baked_sizes`); stage 1 computes them, to check them against the
    plan. ``twin_reads``: reads stage 2 makes on a boundary tensor instead of the tensor they
    read (:mod:`graphsplit.planning.cut.twin_reads`), and ``number_twins`` numbers it reads as
    a size of one (:mod:`graphsplit.planning.cut.number_twins`); stage 1 checks them.
    """
    twin_reads, number_twins = twin_reads or {}, number_twins or {}
    read_off = {**twin_reads, **{number: twin for number, (twin, _) in number_twins.items()}}
    taint = taint if taint is not None else {}
    assert all(is_fixed_number(node, taint) for node in baked), "only fixed numbers are baked"
    # Stage 1 also runs the checks of values the plan holds (nothing uses them: value_reads).
    boundary_set = set(boundary) | set(baked) | set(value_checks(graph))
    stage2: set[fx.Node] = set()
    pending = _stage2_roots(graph)
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
        pending.extend((read_off[node],) if node in read_off else node.all_input_nodes)
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
    pending = [*boundary_set, *number_twins]
    while pending:
        node = pending.pop()
        if node not in stage1:
            stage1.add(node)
            pending.extend(node.all_input_nodes)
    baked_set = set(baked)
    numbers = {node: facts(node).number for node in graph.nodes if node in baked_set}
    return Cut(
        boundary,
        frozenset(stage1),
        frozenset(stage2),
        taint,
        frozenset(reanchored),
        anchor,
        baked=numbers,
        twin_reads=dict(twin_reads),
        number_twins=dict(number_twins),
    )


def _stage2_roots(graph: fx.Graph) -> list[fx.Node]:
    """What stage 2 must run: the step's outputs, and every random draw, used or not
    (skipping one would shift the draws after it)."""
    output = next(node for node in graph.nodes if node.op == "output")
    draws = [n for n in graph.nodes if "facts" in n.meta and facts(n).random_ops]
    return list(output.all_input_nodes) + draws


def _live(graph: fx.Graph) -> set[fx.Node]:
    """The nodes :func:`stages_for` may put in stage 2: the roots and all they read. A tainted
    node outside it runs in neither stage, so it must not pull its inputs onto the boundary."""
    live: set[fx.Node] = set()
    pending = _stage2_roots(graph)
    while pending:
        node = pending.pop()
        if node not in live:
            live.add(node)
            pending.extend(node.all_input_nodes)
    return live


def _size_inputs(node: fx.Node, available: set[fx.Node]) -> set[fx.Node] | None:
    """The shape-reading nodes between ``node`` and tensors stage 2 has, or None if missing
    (reading a size would need a tensor stage 2 does not have, or a raw input)."""

    def reads_a_size(producer: fx.Node) -> bool:
        is_tensor = "facts" in producer.meta and facts(producer).is_tensor
        return producer not in available and not is_tensor and producer.op != "placeholder"

    needed, ends = reads_through(node, reads_a_size)
    return None if any(end not in available for end in ends) else needed


def _infeasible(graph: fx.Graph, taint: Mapping[fx.Node, Taint]) -> SplitError:
    """Find the value stage 2 needs that can be neither stored nor recomputed, and say why."""
    needed = [node for node in graph.nodes if node in taint]
    needed += next(n for n in graph.nodes if n.op == "output").all_input_nodes
    seen: set[fx.Node] = set()
    for start in needed:
        unbatched: list[fx.Node] = []
        culprit = _unreachable_input(start, taint, seen, unbatched)
        if culprit is not None:
            # A tensor on the way that could not be stored for want of a batch dimension is
            # the cause, not the non-tensor its frozen producer returned (BertForMultipleChoice:
            # BERT's ModelOutput on batch x choices rows, read through ``outputs[1]``).
            if unbatched and not facts(culprit).is_tensor:
                return _explain(unbatched[0])
            return _explain(culprit)
    return user_error(
        SplitError,
        "no exact split exists for this step (internal: unexplained infinite cut)",
        fix=Fix(
            "please report the step; freezing fewer modules (frozen=...) may leave a cut "
            "graphsplit can explain"
        ),
    )


def _unreachable_input(
    start: fx.Node,
    taint: Mapping[fx.Node, Taint],
    seen: set[fx.Node],
    unbatched: list[fx.Node],
) -> fx.Node | None:
    """The placeholder or banned node stage 2 would need to recompute ``start``; ``unbatched``
    gets the tensors passed on the way that are not stored for want of a batch dimension."""
    pending = [start] if start not in taint else list(start.all_input_nodes)
    while pending:
        node = pending.pop()
        if node in seen or node in taint:
            continue
        seen.add(node)
        if is_storable(node, taint) or is_fixed_number(node, taint):
            continue
        if node.op == "placeholder" or is_banned(node, taint):
            return node
        if node.op != "get_attr" and facts(node).is_tensor:
            unbatched.append(node)
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
            fix=Fix(
                "register a codec for the type with graphsplit.register_codec(type, encode, "
                "decode), or make the step pass tensors (e.g. use .sample / [0] on outputs)"
            ),
        )
    return user_error(
        SplitError,
        f"Stage 2 needs this tensor (shape {tuple(node_facts.shape or ())}), but it does not hold"
        " one row per sample along a single batch dimension, so it cannot be cached per sample.",
        node=node,
        fix=Fix(
            "keep the batch as its own dimension in frozen code (avoid folding it into other "
            "dims or repeating it, e.g. for classifier-free guidance) before the trainable part"
        ),
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
