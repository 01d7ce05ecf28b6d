"""Run every benchmark: the ``--quick`` versions by default (a few minutes on 2 CPU cores; their
numbers mean nothing), ``--full`` for the sizes reported in docs/benchmarks.md. The GPU
benchmark (``python -m benchmarks.gpu``) is not part of it: it needs a GPU.

    python -m benchmarks.run_all [--full] [--out benchmarks/results]
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from benchmarks.common import parser

# Each benchmark runs in its own interpreter: the memory benchmark measures child processes,
# whose peak RSS would otherwise start from this one's (torch imported) at fork time.
bench_step_time = "benchmarks.bench_step_time"
bench_memory = "benchmarks.bench_memory"
bench_cache_io = "benchmarks.bench_cache_io"
bench_fingerprint = "benchmarks.bench_fingerprint"
bench_cache_bytes = "benchmarks.bench_cache_bytes"
bench_split_scale = "benchmarks.bench_split_scale"
bench_plan_scale = "benchmarks.bench_plan_scale"
bench_diffsynth_bytes = "benchmarks.bench_diffsynth_bytes"
bench_live_cache = "benchmarks.bench_live_cache"
bench_safe_items = "benchmarks.bench_safe_items"
bench_dpo_reference = "benchmarks.bench_dpo_reference"
bench_signatures = "benchmarks.bench_signatures"
bench_calls_overhead = "benchmarks.bench_calls_overhead"
bench_trainer_live = "benchmarks.bench_trainer_live"
bench_cache_overlap = "benchmarks.bench_cache_overlap"
bench_dispatch = "benchmarks.bench_dispatch"
bench_field_bytes = "benchmarks.bench_field_bytes"
bench_stage1_state = "benchmarks.bench_stage1_state"
bench_lm_lengths = "benchmarks.bench_lm_lengths"
bench_row_pairing = "benchmarks.bench_row_pairing"


def plan(full: bool, out: Path) -> list[tuple[str, str, list[str]]]:
    """(name, module, argv) for each benchmark at the chosen size."""
    target = ["--out", str(out)]
    if full:
        return [
            ("step time", bench_step_time, ["--rounds", "40", *target]),
            ("memory", bench_memory, ["--steps", "3", *target]),
            ("cache I/O", bench_cache_io, ["--samples", "256", "--rounds", "15", *target]),
            ("weights fingerprint", bench_fingerprint, [*target]),
            ("cache bytes", bench_cache_bytes, ["--cases", "tiny", "sdxl", *target]),
            ("planning, synthetic", bench_split_scale, ["--full", "--rounds", "3", *target]),
            ("planning, full size", bench_plan_scale,
             ["--cases", "sdxl", "flux", "flux_diffusers_ids", "wan", "--rounds", "3", *target]),
            ("DiffSynth cache bytes", bench_diffsynth_bytes, [*target]),
            ("cache while training", bench_live_cache, ["--rounds", "10", *target]),
            ("safe items", bench_safe_items, [*target]),
            ("DPO reference log-probs", bench_dpo_reference, [*target]),
            ("a new shape signature", bench_signatures,
             ["--cases", "branch", "flux", "wan", "--rounds", "5", *target]),
            ("module-level path", bench_calls_overhead, ["--rounds", "40", *target]),
            ("Trainer, cache while training", bench_trainer_live, ["--rounds", "10", *target]),
            ("cache() against stage 1", bench_cache_overlap, ["--rounds", "9", *target]),
            ("stage-2 dispatch", bench_dispatch, ["--rounds", "15", *target]),
            ("module-level cached fields", bench_field_bytes, [*target]),
            ("stage 1, state put back", bench_stage1_state, ["--rounds", "15", *target]),
            ("LoRA LM over many lengths", bench_lm_lengths, ["--rounds", "3", *target]),
            ("rows paired by position", bench_row_pairing, ["--rounds", "9", *target]),
        ]  # fmt: skip
    return [
        ("step time", bench_step_time, ["--quick", *target]),
        ("memory", bench_memory, ["--quick", *target]),
        ("cache I/O", bench_cache_io, ["--quick", *target]),
        ("weights fingerprint", bench_fingerprint, ["--quick", *target]),
        ("cache bytes", bench_cache_bytes, ["--cases", "tiny", *target]),
        ("planning, synthetic", bench_split_scale, ["--quick", *target]),
        ("planning, full size", bench_plan_scale, ["--quick", *target]),
        ("DiffSynth cache bytes", bench_diffsynth_bytes, ["--quick", *target]),
        ("cache while training", bench_live_cache, ["--quick", *target]),
        ("safe items", bench_safe_items, ["--quick", *target]),
        ("DPO reference log-probs", bench_dpo_reference, ["--quick", *target]),
        ("a new shape signature", bench_signatures, ["--quick", *target]),
        ("module-level path", bench_calls_overhead, ["--quick", *target]),
        ("Trainer, cache while training", bench_trainer_live, ["--quick", *target]),
        ("cache() against stage 1", bench_cache_overlap, ["--quick", *target]),
        ("stage-2 dispatch", bench_dispatch, ["--quick", *target]),
        ("module-level cached fields", bench_field_bytes, ["--quick", *target]),
        ("stage 1, state put back", bench_stage1_state, ["--quick", *target]),
        ("LoRA LM over many lengths", bench_lm_lengths, ["--quick", *target]),
        ("rows paired by position", bench_row_pairing, ["--quick", *target]),
    ]


def main(argv: list[str] | None = None) -> int:
    command = parser("run_all", __doc__)
    command.add_argument("--full", action="store_true", help="the sizes in docs/benchmarks.md")
    args = command.parse_args(argv)
    failures = 0
    for name, module, module_argv in plan(args.full, args.out):
        print(f"\n== {name}: python -m {module} {' '.join(module_argv)}", flush=True)
        failures += int(
            subprocess.run([sys.executable, "-m", module, *module_argv]).returncode != 0
        )
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
