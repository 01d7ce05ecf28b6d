"""How ``graphsplit.split()`` scales with the size of the traced graph.

The step is a chain with skip connections, the shape the min-cut finds hardest: blocks of
``Linear -> tanh -> add(skip)`` where each add reaches back one block; the first 60% of the
blocks are frozen and the rest trainable, so the cut falls in the middle of the chain. For each
size it records the wall time of ``split()`` (best of ``--repeat``, after a warm-up split that
pays torch's and fx's first-call costs) and its peak memory: the
Python heap at its highest during the call (tracemalloc, measured in a separate run because
tracing allocations slows the call down) and the process's maximum resident set size so far.

    python -m benchmarks.bench_split_scale                  # 10, 100, 1000 nodes
    python -m benchmarks.bench_split_scale --full           # ... and 10000
    python -m benchmarks.bench_split_scale --sizes 50 500 --out /tmp/results

Writes ``bench_split_scale.json`` and ``bench_split_scale.md`` (a table) to ``--out``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

import graphsplit
from benchmarks.common import (
    environment,
    markdown_table,
    mib,
    parser,
    peak_rss_bytes,
    python_heap_peak_bytes,
    report,
    write_results,
)

DEFAULT_SIZES = (10, 100, 1000)
FULL_SIZES = (*DEFAULT_SIZES, 10000)
NODES_PER_BLOCK = 3  # Linear, tanh, add
FROZEN_SHARE = 0.6
WIDTH = 8
BATCH = 4


class ChainWithSkips(nn.Module):
    """``blocks`` blocks of ``h = tanh(linear(h)) + previous_h``; the head returns a loss."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(blocks))
        for layer in self.layers[: round(blocks * FROZEN_SHARE)]:
            layer.requires_grad_(False)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        hidden = x
        for layer in self.layers:
            hidden = torch.tanh(layer(hidden)) + hidden
        return self.head(hidden).pow(2).mean()


def build_step(nodes: int) -> tuple[ChainWithSkips, tuple[torch.Tensor]]:
    """A step whose traced graph has about ``nodes`` nodes, and an example batch."""
    torch.manual_seed(0)
    blocks = max(1, (nodes - 4) // NODES_PER_BLOCK)
    return ChainWithSkips(blocks), (torch.randn(BATCH, WIDTH),)


def measure(nodes: int, *, repeat: int = 1) -> dict[str, Any]:
    """Time and peak memory of ``split()`` on a chain-with-skips step of about ``nodes`` nodes."""
    model, args = build_step(nodes)
    seconds = []
    for _ in range(max(1, repeat)):
        start = time.perf_counter()
        split = graphsplit.split(model, args)
        seconds.append(time.perf_counter() - start)
    peak = python_heap_peak_bytes(lambda: graphsplit.split(model, args))
    return {
        "nodes": nodes,
        "graph_nodes": len(split.graph.nodes),
        "boundary_tensors": len(split.boundary),
        "stage2_nodes": len(split.cut.stage2),
        "seconds": min(seconds),
        "seconds_all": seconds,
        "peak_python_mib": mib(peak),
        "max_rss_mib": mib(peak_rss_bytes()),
    }


def to_markdown(results: list[dict[str, Any]], where: dict[str, Any]) -> str:
    """The page: a title, where it ran, and one row per graph size."""
    header = ["nodes", "graph nodes", "boundary", "stage-2 nodes", "split() s",
              "peak Python MiB", "max RSS MiB"]  # fmt: skip
    rows = [
        [row["nodes"], row["graph_nodes"], row["boundary_tensors"], row["stage2_nodes"],
         f"{row['seconds']:.3f}", f"{row['peak_python_mib']:.1f}", f"{row['max_rss_mib']:.0f}"]
        for row in results
    ]  # fmt: skip
    return (
        "# graphsplit.split() on chain-with-skips graphs\n\n"
        f"torch {where['torch']}, Python {where['python']}, {where['cpus']} CPUs\n\n"
        + markdown_table(header, rows, "rrrrrrr")
    )


def main(argv: list[str] | None = None) -> int:
    command = parser("bench_split_scale", __doc__)
    command.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        metavar="NODES",
        help=f"graph sizes in nodes (default: {' '.join(map(str, DEFAULT_SIZES))})",
    )
    command.add_argument(
        "--full", action="store_true", help="also run 10000 nodes (ignored with --sizes)"
    )
    command.add_argument(
        "--repeat", type=int, default=3, help="timed runs per size; the best is kept (default 3)"
    )
    options = command.parse_args(argv)
    sizes = options.sizes or (FULL_SIZES if options.full else DEFAULT_SIZES)
    graphsplit.split(*build_step(10))  # warm-up: first-call costs of torch and fx
    results = []
    for nodes in sizes:
        row = measure(nodes, repeat=options.repeat)
        results.append(row)
        print(
            f"{nodes:>6} nodes ({row['graph_nodes']} traced): {row['seconds']:.3f} s, "
            f"peak Python {row['peak_python_mib']:.1f} MiB",
            flush=True,
        )
    where = environment("graphsplit", "torch", torch_threads=True)
    payload = report("split_scale", results, where)
    write_results(options.out, "bench_split_scale", payload, to_markdown(results, where))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
