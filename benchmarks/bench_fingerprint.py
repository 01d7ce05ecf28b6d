"""Weight fingerprint speed: GB/s of ``fingerprint(split)`` per core, by weights digest.

The fingerprint of a split reads every frozen tensor stage 1 holds (see
:mod:`graphsplit.caching.format.fingerprint`); this times it on a stage 1 holding ``--mb`` MiB of
random float32 and bfloat16 weights in tensors of ``--tensor-mb`` MiB (a transformer's layer
sizes), in the page cache of RAM, on one torch thread. Variants, interleaved round by round:

    xxh3             graphsplit's digest, nothing remembered (a process's first fingerprint)
    xxh3_remembered  the same, again in the same process (the per-storage memo answers)
    crc32            the digest of earlier 0.2 caches (a CRC-32 per MiB)
    sha256           graphsplit 0.1's digest (sha256 of the bytes)
    raw_xxh3         xxhash.xxh3_128 of each tensor's memory alone: the floor

The report gives GB/s (10^9 bytes per second) of the weights, from the median and IQR of the
per-round seconds on wall-clock and CPU time (CPU time is the steadier figure on a machine
other jobs share), and each digest's speed relative to ``raw_xxh3`` in the same round.

    python -m benchmarks.bench_fingerprint --help
    python -m benchmarks.bench_fingerprint --quick --out /tmp/results     # smoke test
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import xxhash

from benchmarks.common import (
    environment,
    interleaved,
    markdown_table,
    parser,
    report,
    spread,
    timing_options,
    torch_threads,
    write_results,
)
from graphsplit.caching.format.fingerprint import WEIGHT_HASHES, fingerprint

VARIANTS = ("xxh3", "xxh3_remembered", "crc32", "sha256", "raw_xxh3")


class _Frozen(torch.nn.Module):
    """A stage 1 that holds frozen weights and nothing else (its code is never run)."""

    code = "def forward(self, x):\n    return {}\n"

    def __init__(self, megabytes: float, tensor_megabytes: float) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        count = max(1, round(megabytes / tensor_megabytes))
        for index in range(count):  # every fourth tensor in bfloat16, as mixed checkpoints are
            dtype = torch.bfloat16 if index % 4 == 3 else torch.float32
            numel = int(tensor_megabytes * 2**20) // dtype.itemsize
            weight = torch.randn(numel, generator=generator).to(dtype)
            self.register_buffer(f"layer{index:03d}", weight)
        self.requires_grad_(False)


def _raw(module: torch.nn.Module) -> None:
    for tensor in module.buffers():
        xxhash.xxh3_128(tensor.view(torch.uint8).numpy().data).digest()


def _counting(call: Any, hashed: list[int]) -> Any:
    """``call``, noting the bytes graphsplit's xxh3 read each time (not the memo's answers)."""

    def counted() -> None:
        before = WEIGHT_HASHES.hashed_bytes
        call()
        hashed.append(WEIGHT_HASHES.hashed_bytes - before)

    return counted


def measure(megabytes: float, tensor_megabytes: float, rounds: int) -> dict[str, Any]:
    """Seconds of each variant over ``rounds`` interleaved rounds, as GB/s and ratios."""
    module = _Frozen(megabytes, tensor_megabytes)
    split = SimpleNamespace(stage1=module, boundary={})
    total = sum(tensor.numel() * tensor.element_size() for tensor in module.buffers())
    calls = {
        "xxh3": lambda: fingerprint(split),
        "xxh3_remembered": lambda: fingerprint(split),
        "crc32": lambda: fingerprint(split, weights_algorithm="crc32"),
        "sha256": lambda: fingerprint(split, weights_algorithm="sha256"),
        "raw_xxh3": lambda: _raw(module),
    }
    hashed: dict[str, list[int]] = {name: [] for name in VARIANTS}  # bytes the memo missed
    variants = {name: _counting(call, hashed[name]) for name, call in calls.items()}

    def before_each(name: str, index: int) -> None:
        WEIGHT_HASHES.forget()
        if name == "xxh3_remembered":
            fingerprint(split)  # untimed: the process's first fingerprint

    timings = interleaved(variants, rounds=rounds, before_each=before_each)
    result: dict[str, Any] = {
        "megabytes": total / 2**20,
        "tensors": len(list(module.buffers())),
        "rounds": rounds,
        "hashed_mib_per_call": {name: max(hashed[name]) / 2**20 for name in VARIANTS},
        "timings": timings.to_json(),
    }
    for clock in ("wall", "cpu"):
        result[clock] = {
            "gb_per_s": {
                name: spread(
                    [total / 1e9 / max(s, 1e-9) for s in timings.seconds(name, clock)]
                ).to_json()
                for name in VARIANTS
            },
            "vs_raw_xxh3": {
                name: timings.ratio("raw_xxh3", name, clock).to_json()
                for name in VARIANTS
                if name != "raw_xxh3"
            },
        }
    return result


def _cell(value: dict[str, float], spec: str) -> str:
    return f"{value['median']:{spec}} ({value['q1']:{spec}}–{value['q3']:{spec}})"


def to_markdown(result: dict[str, Any], threads: int) -> str:
    wall, cpu = result["wall"], result["cpu"]
    labels = {
        "xxh3": "xxh3 (graphsplit), first in the process",
        "xxh3_remembered": "xxh3 (graphsplit), again in the process",
        "crc32": "crc32 (earlier 0.2 caches)",
        "sha256": "sha256 (graphsplit 0.1 caches)",
        "raw_xxh3": "xxhash.xxh3_128 of the memory alone",
    }
    rows = [
        [
            labels[name],
            _cell(wall["gb_per_s"][name], ".2f"),
            _cell(cpu["gb_per_s"][name], ".2f"),
            "1.00" if name == "raw_xxh3" else _cell(cpu["vs_raw_xxh3"][name], ".2f"),
        ]
        for name in VARIANTS
    ]
    header = ["weights digest", "GB/s, wall", "GB/s, CPU time", "vs raw xxh3, CPU time"]
    return (
        f"{result['megabytes']:.0f} MiB of frozen weights in {result['tensors']} tensors, in RAM, "
        f"{threads} torch thread(s); median (IQR) of {result['rounds']} interleaved rounds\n\n"
        + markdown_table(header, rows, "lrrr")
    )


def main(argv: list[str] | None = None) -> int:
    command = timing_options(parser("bench_fingerprint", __doc__), rounds=7)
    command.add_argument(
        "--mb", type=float, default=1024.0, help="MiB of frozen weights (default: 1024)"
    )
    command.add_argument(
        "--tensor-mb", type=float, default=16.0, help="MiB per tensor (default: 16)"
    )
    args = command.parse_args(argv)
    if args.quick:
        args.mb, args.tensor_mb, args.rounds = 8.0, 1.0, 1
    with torch_threads(args.threads) as threads:
        result = measure(args.mb, args.tensor_mb, args.rounds)
        where = environment("torch", "xxhash", torch_threads=True)
    write_results(
        args.out, "fingerprint", report("fingerprint", result, where), to_markdown(result, threads)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
