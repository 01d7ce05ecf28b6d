"""How long networkx's maximum-flow functions take on the network a split's cut solves.

The cut (:mod:`graphsplit.planning.cut.min_cut`) runs networkx's ``dinitz`` on the network
left after the tied nodes are contracted. This captures that network from a real split of the
chain benchmark (:func:`benchmarks.bench_split_scale.build_step`) and times each networkx
maximum-flow function on it, checking that each leaves the same sink side (it must: the
smallest sink side is the same for every maximum flow). It is what docs/benchmarks.md's
"Planning time of a 10k-node chain" section quotes for the flow functions.

In and out::

    flow_profile(nodes, functions, repeat) -> dict   network size, CPU seconds per function
"""

from __future__ import annotations

import time
from typing import Any

import networkx as nx
from networkx.algorithms import flow

FUNCTIONS = ("dinitz", "edmonds_karp", "shortest_augmenting_path", "preflow_push")


def captured_network(nodes: int) -> tuple[dict[tuple[str, str], int | None], str, str]:
    """The largest contracted network the cut solves in a split of the ``nodes``-node chain."""
    import graphsplit
    from benchmarks.bench_split_scale import build_step
    from graphsplit.planning.cut import min_cut

    seen: list[tuple[dict[tuple[str, str], int | None], str, str]] = []
    solve = min_cut._residual_sink_side

    def capture(edges, source, sink):
        seen.append((dict(edges), source, sink))
        return solve(edges, source, sink)

    min_cut._residual_sink_side = capture
    try:
        step, args = build_step(nodes)
        graphsplit.split(step, *args)
    finally:
        min_cut._residual_sink_side = solve
    return max(seen, key=lambda network: len(network[0]))


def _timed_sink_side(function: Any, edges, source: str, sink: str) -> tuple[float, set[str]]:
    network = nx.DiGraph()
    network.add_nodes_from((source, sink))
    network.add_edges_from(
        (u, v, {} if capacity is None else {"capacity": capacity})
        for (u, v), capacity in edges.items()
    )
    started = time.process_time()
    _, (_, side) = nx.minimum_cut(network, source, sink, flow_func=function)
    return time.process_time() - started, set(side)


def flow_profile(nodes: int, functions: tuple[str, ...] = FUNCTIONS, repeat: int = 3) -> dict:
    """CPU seconds of ``nx.minimum_cut`` with each of ``functions`` on the captured network
    (each repeated ``repeat`` times), and whether each gave ``dinitz``'s sink side."""
    edges, source, sink = captured_network(nodes)
    _, expected = _timed_sink_side(flow.dinitz, edges, source, sink)
    seconds: dict[str, list[float]] = {}
    same: dict[str, bool] = {}
    for name in functions:
        runs = [_timed_sink_side(getattr(flow, name), edges, source, sink) for _ in range(repeat)]
        seconds[name] = [round(elapsed, 4) for elapsed, _ in runs]
        same[name] = all(side == expected for _, side in runs)
    nodes_in_network = {node for edge in edges for node in edge}
    return {
        "chain_nodes": nodes,
        "network_nodes": len(nodes_in_network),
        "network_edges": len(edges),
        "cpu_s": seconds,
        "same_sink_side": same,
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.flow_profile [--nodes N] [--repeat N]``: one JSON line."""
    import argparse
    import json

    from benchmarks.common import torch_threads

    command = argparse.ArgumentParser(prog="python -m benchmarks.flow_profile")
    command.add_argument("--nodes", type=int, default=10_000)
    command.add_argument("--repeat", type=int, default=3)
    command.add_argument("--functions", nargs="+", default=list(FUNCTIONS), choices=FUNCTIONS)
    args = command.parse_args(argv)
    with torch_threads(1):
        row = flow_profile(args.nodes, tuple(args.functions), args.repeat)
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
