"""sink_side against networkx's own minimum_cut, and its refusal of unbounded networks."""

from __future__ import annotations

import itertools
import random

import networkx as nx
import pytest

from graphsplit.planning.cut.min_cut import Unbounded, sink_side


def _random_network(seed: int, nodes: int = 30) -> dict[tuple[str, str], int | None]:
    """A layered network: forward edges only (no s-t path of infinite edges), many of them
    infinite, capacities drawn from a few values so that equal-cost cuts are common."""
    rng = random.Random(seed)
    names = ["s", *(f"n{index}" for index in range(nodes)), "t"]
    edges: dict[tuple[str, str], int | None] = {}
    for position, u in enumerate(names[:-1]):
        for v in rng.sample(names[position + 1 :], k=min(3, len(names) - position - 1)):
            edges[u, v] = None if rng.random() < 0.25 else rng.choice([0, 1, 2, 2, 3, 5, 8])
    return edges


def _networkx_sink_side(edges, source: str, sink: str) -> set[str]:
    network = nx.DiGraph()
    network.add_nodes_from((source, sink))
    for (u, v), capacity in edges.items():
        network.add_edge(u, v, **({} if capacity is None else {"capacity": capacity}))
    _, (_, side) = nx.minimum_cut(network, source, sink, flow_func=nx.algorithms.flow.dinitz)
    return set(side)


@pytest.mark.parametrize("seed", range(60))
def test_sink_side_is_networkx_minimum_cut_partition(seed):
    edges = _random_network(seed)
    try:
        expected = _networkx_sink_side(edges, "s", "t")
    except nx.NetworkXUnbounded:
        with pytest.raises(Unbounded):
            sink_side(edges, "s", "t")
        return
    assert sink_side(edges, "s", "t") == expected


def test_tied_nodes_take_their_terminal_side():
    # a and b are tied to the source, d to the sink; b->c and c->d cost the same, and the
    # smallest sink side is taken.
    edges = {("s", "a"): None, ("a", "b"): None, ("b", "c"): 4, ("c", "d"): 4, ("d", "t"): None}
    assert sink_side(edges, "s", "t") == _networkx_sink_side(edges, "s", "t") == {"d", "t"}


def test_parallel_edges_into_a_terminal_are_summed():
    # Both a's edges end in the sink once d and e are contracted: 2 + 2 > 3, so the cut is s->a.
    edges = {("s", "a"): 3, ("a", "d"): 2, ("a", "e"): 2, ("d", "t"): None, ("e", "t"): None}
    expected = {"a", "d", "e", "t"}
    assert sink_side(edges, "s", "t") == _networkx_sink_side(edges, "s", "t") == expected


def test_infinite_path_between_terminals_is_unbounded():
    edges = {("s", "a"): None, ("a", "t"): None, ("s", "b"): 1, ("b", "t"): 1}
    with pytest.raises(Unbounded):
        sink_side(edges, "s", "t")


def _random_digraph(seed: int) -> dict[tuple[str, str], int | None]:
    """Any direction (cycles, edges back into the source and out of the sink, both directions
    of a pair), sizes up to 150 nodes, capacities from 0 to large byte counts."""
    rng = random.Random(seed)
    count = rng.randint(2, 150)
    names = ["s", "t", *(f"n{index}" for index in range(count))]
    edges: dict[tuple[str, str], int | None] = {}
    for _ in range(rng.randint(count, 4 * count)):
        u, v = rng.sample(names, 2)
        roll = rng.random()
        if roll < 0.15:
            edges[u, v] = None
        elif roll < 0.5:
            edges[u, v] = rng.choice([0, 1, 2, 4, 4, 8])
        else:
            edges[u, v] = rng.randint(1, 10**12)
    return edges


@pytest.mark.parametrize("seed", range(150))
def test_sink_side_on_any_digraph_is_networkx_minimum_cut_partition(seed):
    # The contraction of tied nodes and the residual walk against networkx's own
    # minimum_cut on networks with cycles, edges back into the source and out of the sink.
    edges = _random_digraph(seed)
    try:
        expected = _networkx_sink_side(edges, "s", "t")
    except nx.NetworkXUnbounded:
        with pytest.raises(Unbounded):
            sink_side(edges, "s", "t")
        return
    assert sink_side(edges, "s", "t") == expected


def test_a_long_chain_is_cut_at_its_cheapest_link():
    # Paths thousands of arcs long (a 10k-node chain's): no recursion, and the cheapest link
    # nearest the sink decides the smallest sink side.
    names = ["s", *(f"n{index}" for index in range(5000)), "t"]
    edges = {(u, v): 7 for u, v in itertools.pairwise(names)}
    edges["n1000", "n1001"] = 3
    edges["n4000", "n4001"] = 3
    expected = {f"n{index}" for index in range(4001, 5000)} | {"t"}
    assert sink_side(edges, "s", "t") == _networkx_sink_side(edges, "s", "t") == expected
