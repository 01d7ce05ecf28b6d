"""The sink side of a minimum s-t cut, with the nodes infinite edges tie to a terminal contracted.

Glossary:
    edge list: ``{(u, v): capacity}``; a capacity of ``None`` is infinite (networkx's reading
        of an edge without a ``capacity`` attribute).
    sink side: the nodes that can still reach the sink in the residual network of a maximum
        flow. It is the same set for every maximum flow (the smallest sink side of all minimum
        cuts), which is what makes the plan independent of the flow algorithm's internals;
        ``networkx.minimum_cut`` returns the same partition.
    tied node: one an infinite-capacity path joins to a terminal: from the source (a frozen
        layer's input, which stage 1 must compute) or to the sink (a tainted value). No finite
        cut separates it from that terminal, so every minimum cut has it on that side.

Contracting the tied nodes into their terminal (parallel edges summed, edges inside one
terminal dropped) leaves the finite cuts and their capacities as they were, so the smallest
sink side is the same; only the flow runs on a smaller network. On the 10k-node chain
(:mod:`benchmarks.bench_split_scale`) the trainable 40% and the frozen layers' inputs are tied
and the network loses about half its nodes.

In: an edge list and the terminals' names. Out: the sink side, or :class:`Unbounded` when an
infinite path joins the terminals (no finite cut exists):

    sink_side(edges, source, sink) -> set[str]
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import networkx as nx

Edges = Mapping[tuple[str, str], int | None]


class Unbounded(Exception):
    """An infinite-capacity path joins source and sink: every cut is infinite."""


def sink_side(edges: Edges, source: str, sink: str) -> set[str]:
    """The nodes that reach ``sink`` in the residual network of a maximum flow.

    Example:
        >>> sorted(sink_side({("s", "a"): None, ("a", "b"): 3, ("b", "t"): None}, "s", "t"))
        ['b', 't']
    """
    infinite = [(u, v) for (u, v), capacity in edges.items() if capacity is None]
    from_source = _reachable(source, infinite)
    if sink in from_source:
        raise Unbounded
    to_sink = _reachable(sink, [(v, u) for u, v in infinite])
    contracted = _contracted(edges, from_source, to_sink, source, sink)
    return to_sink | _residual_sink_side(contracted, source, sink)


def _reachable(start: str, edges: Iterable[tuple[str, str]]) -> set[str]:
    """The nodes reachable from ``start`` along ``edges``."""
    successors: dict[str, list[str]] = {}
    for u, v in edges:
        successors.setdefault(u, []).append(v)
    seen = {start}
    pending = [start]
    while pending:
        for successor in successors.get(pending.pop(), ()):
            if successor not in seen:
                seen.add(successor)
                pending.append(successor)
    return seen


def _contracted(
    edges: Edges, from_source: set[str], to_sink: set[str], source: str, sink: str
) -> dict[tuple[str, str], int | None]:
    """``edges`` with the tied nodes merged into their terminal.

    Edges into the source or out of the sink are dropped: no flow uses them, and no path to
    the sink in the residual network goes through the source (it would augment the flow).
    """
    merged: dict[tuple[str, str], int | None] = {}
    for (u, v), capacity in edges.items():
        u = source if u in from_source else sink if u in to_sink else u
        v = source if v in from_source else sink if v in to_sink else v
        if u in (v, sink) or v == source:
            continue
        key = (u, v)
        if key in merged:
            known = merged[key]
            capacity = None if known is None or capacity is None else known + capacity
        merged[key] = capacity
    return merged


def _residual_sink_side(
    edges: dict[tuple[str, str], int | None], source: str, sink: str
) -> set[str]:
    """networkx's ``dinitz`` maximum flow, then the nodes that reach the sink in its residual
    network (``networkx.minimum_cut``'s partition, computed without its edge views)."""
    network = nx.DiGraph()
    network.add_nodes_from((source, sink))
    network.add_edges_from(
        (u, v, {} if capacity is None else {"capacity": capacity})
        for (u, v), capacity in edges.items()
    )
    residual = nx.algorithms.flow.dinitz(network, source, sink, capacity="capacity")
    predecessors = residual._pred
    side = {sink}
    pending = [sink]
    while pending:
        v = pending.pop()
        for u, attributes in predecessors[v].items():
            # A saturated edge (flow == capacity) is not in the residual network; the reverse
            # edges networkx adds have capacity 0 and carry the negated flow.
            if u not in side and attributes["flow"] != attributes["capacity"]:
                side.add(u)
                pending.append(u)
    # The network's edge view refers back to the network (a reference cycle): empty both
    # graphs so their dicts are freed by reference counting, not by the cyclic collector.
    network.clear()
    residual.clear()
    return side
