"""How ``graphsplit.split()`` scales with the size of the traced graph.

The step is a chain with skip connections, the shape the min-cut finds hardest: blocks of
``Linear -> tanh -> add(skip)`` where each add reaches back one block; the first 60% of the
blocks are frozen and the rest trainable, so the cut falls in the middle of the chain. For each
size it records the wall-clock and CPU time of ``split()`` (median and IQR of ``--rounds``
calls, after a warm-up split that pays torch's and fx's first-call costs; one torch thread by
default) and its peak memory: the Python heap at its highest during the call (tracemalloc,
measured in a separate run because tracing allocations slows the call down) and the process's
maximum resident set size so far.

    python -m benchmarks.bench_split_scale                  # 10, 100, 1000 nodes
    python -m benchmarks.bench_split_scale --full           # ... and 10000
    python -m benchmarks.bench_split_scale --sizes 50 500 --out /tmp/results
    python -m benchmarks.bench_split_scale --quick --out /tmp/results   # smoke test
    python -m benchmarks.bench_split_scale --sizes 10000 --baseline HEAD~3 --rounds 4
    python -m benchmarks.bench_split_scale --sizes 10000 --baseline HEAD~3 --rounds 4 --repeated 5

With ``--baseline`` (a git revision or a folder holding a ``graphsplit`` package), each size
also runs ``--rounds`` pairs of fresh processes, one importing this checkout's graphsplit and
one the baseline's, alternating which goes first; each splits once after a warm-up, and the
table gains the median (IQR) of the same-round ratios current / baseline and whether both made
the same plan (:func:`benchmarks.bench_plan_scale.plan_digest`). With ``--repeated SPLITS`` each
child instead keeps one split and times SPLITS more in the same process (their median), which is
where a process that already holds a split pays its full garbage collections.

Writes ``bench_split_scale.json`` and ``bench_split_scale.md`` (a table) to ``--out``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

import graphsplit
from benchmarks.common import (
    baseline_code,
    baseline_table,
    compare_with_baseline,
    environment,
    interleaved,
    markdown_table,
    mib,
    parser,
    peak_rss_bytes,
    python_heap_peak_bytes,
    ratio_text,
    reply_to_parent,
    report,
    run_child,
    timing_options,
    torch_threads,
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


def measure(nodes: int, *, rounds: int = 1) -> dict[str, Any]:
    """Time and peak memory of ``split()`` on a chain-with-skips step of about ``nodes`` nodes."""
    model, args = build_step(nodes)
    split = graphsplit.split(model, args)
    timings = interleaved({"split": lambda: graphsplit.split(model, args)}, rounds=rounds, warmup=0)
    peak = python_heap_peak_bytes(lambda: graphsplit.split(model, args))
    wall, cpu = timings.spread("split"), timings.spread("split", "cpu")
    return {
        "nodes": nodes,
        "graph_nodes": len(split.graph.nodes),
        "boundary_tensors": len(split.boundary),
        "stage2_nodes": len(split.cut.stage2),
        "seconds": wall.median,
        "seconds_all": timings.seconds("split"),
        "wall_seconds": wall.to_json(),
        "cpu_seconds": cpu.to_json(),
        "peak_python_mib": mib(peak),
        "max_rss_mib": mib(peak_rss_bytes()),
    }


def measure_once(nodes: int, *, repeated: int = 0) -> dict[str, Any]:
    """One timed ``split()`` after a warm-up, and its plan's digest (a baseline child's row).

    ``repeated``: instead, one untimed split that the process keeps (as a training script
    keeps its split), then ``repeated`` timed splits in the same process, as :func:`measure`
    times them; the row holds their median, each one's seconds, and the kept split's digest.
    """
    from benchmarks.bench_plan_scale import plan_digest

    graphsplit.split(*build_step(10))  # warm-up: first-call costs of torch and fx
    model, args = build_step(nodes)
    if repeated:
        kept = graphsplit.split(model, args)
        timings = interleaved(
            {"split": lambda: graphsplit.split(model, args)}, rounds=repeated, warmup=0
        )
    else:
        made: list[Any] = []
        timings = interleaved(
            {"split": lambda: made.append(graphsplit.split(model, args))}, rounds=1, warmup=0
        )
        kept = made[0]
    return {
        "nodes": nodes,
        "wall": timings.spread("split").median,
        "cpu": timings.spread("split", "cpu").median,
        "cpu_all": timings.seconds("split", "cpu"),
        "plan_digest": plan_digest(kept),
    }


def compare(
    nodes: int, baseline: Path, *, rounds: int, threads: int, repeated: int = 0
) -> dict[str, Any]:
    """Alternating children of this graphsplit and the baseline's on one graph size
    (``repeated``: each child times that many splits in one process, see :func:`measure_once`)."""
    argv = ["--child", str(nodes), "--threads", str(threads)]
    if repeated:
        argv += ["--repeated", str(repeated)]

    def measure_child(code: Path | None) -> tuple[float, float, str]:
        row = run_child("benchmarks.bench_split_scale", argv, cwd=code)
        return row["wall"], row["cpu"], row["plan_digest"]

    return compare_with_baseline(measure_child, baseline, rounds=rounds)


def to_markdown(results: list[dict[str, Any]], where: dict[str, Any]) -> str:
    """The page: a title, where it ran, and one row per graph size."""
    header = ["nodes", "graph nodes", "boundary", "stage-2 nodes", "split() wall s",
              "split() CPU s", "peak Python MiB", "max RSS MiB"]  # fmt: skip
    rows = [
        [row["nodes"], row["graph_nodes"], row["boundary_tensors"], row["stage2_nodes"],
         ratio_text(row["wall_seconds"]), ratio_text(row["cpu_seconds"]),
         f"{row['peak_python_mib']:.1f}", f"{row['max_rss_mib']:.0f}"]
        for row in results
    ]  # fmt: skip
    rounds = results[0]["wall_seconds"]["count"] if results else 0
    page = (
        "# graphsplit.split() on chain-with-skips graphs\n\n"
        f"torch {where['torch']}, Python {where['python']}, {where['cpus']} CPUs, "
        f"{where['torch_threads']} torch thread(s); median (IQR) of {rounds} calls\n\n"
        + markdown_table(header, rows, "rrrrrrrr")
    )
    compared = [
        (_label(row["nodes"], row["versus_baseline"]), row["versus_baseline"])
        for row in results
        if "versus_baseline" in row
    ]
    if not compared:
        return page
    return f"{page}\n{baseline_table(compared, 'nodes', first_align='r')}"


def _label(nodes: int, versus: dict[str, Any]) -> str:
    repeated = versus.get("repeated")
    return f"{nodes}, {repeated} repeated splits per child" if repeated else str(nodes)


def main(argv: list[str] | None = None) -> int:
    command = timing_options(parser("bench_split_scale", __doc__), rounds=3)
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
        "--baseline",
        metavar="REVISION_OR_FOLDER",
        help="also time another graphsplit (a git revision, or a folder holding a graphsplit "
        "package) in --rounds alternating pairs of child processes per size",
    )
    command.add_argument(
        "--repeated",
        type=int,
        default=0,
        metavar="SPLITS",
        help="with --baseline: each child keeps one split and times SPLITS more in the same "
        "process (their median), instead of one split in a fresh process",
    )
    command.add_argument("--child", type=int, help=argparse.SUPPRESS)
    options = command.parse_args(argv)
    if options.child:
        with torch_threads(options.threads):
            reply_to_parent(measure_once(options.child, repeated=options.repeated))
        return 0
    sizes = options.sizes or (FULL_SIZES if options.full else DEFAULT_SIZES)
    if options.quick:
        sizes, options.rounds = (10, 40), 1
    with tempfile.TemporaryDirectory(prefix="graphsplit-baseline-") as folder:
        baseline = baseline_code(options.baseline, Path(folder)) if options.baseline else None
        return _measure_all(sizes, options, baseline)


def _measure_all(sizes, options: argparse.Namespace, baseline: Path | None) -> int:
    with torch_threads(options.threads):
        graphsplit.split(*build_step(10))  # warm-up: first-call costs of torch and fx
        results = []
        for nodes in sizes:
            row = measure(nodes, rounds=options.rounds)
            results.append(row)
            print(
                f"{nodes:>6} nodes ({row['graph_nodes']} traced): "
                f"wall {ratio_text(row['wall_seconds'])} s, "
                f"CPU {ratio_text(row['cpu_seconds'])} s, "
                f"peak Python {row['peak_python_mib']:.1f} MiB",
                flush=True,
            )
            if baseline is not None:
                versus = compare(
                    nodes,
                    baseline,
                    rounds=options.rounds,
                    threads=options.threads,
                    repeated=options.repeated,
                )
                row["versus_baseline"] = {
                    "baseline": options.baseline,
                    "repeated": options.repeated,
                    **versus,
                }
                print(
                    f"{nodes:>6} nodes: current / baseline CPU {ratio_text(versus['cpu_ratio'])}, "
                    f"same plan: {versus['same_plan']}",
                    flush=True,
                )
        where = environment("graphsplit", "torch", torch_threads=True)
    payload = report("split_scale", results, where)
    write_results(options.out, "bench_split_scale", payload, to_markdown(results, where))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
