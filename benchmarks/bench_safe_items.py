"""What safe-by-default reading costs: items that are copies, and weight hashes that sample.

Two changes made reading a cache safe by default (issue 26, item 5), and this measures each
against the unsafe way in the same process, interleaved round by round, on one torch thread:

    items      ``CachedDataset[i]`` now copies each row out of the shard's memory map (so an
               item changed in place does not change the next epoch); the baseline reads the
               same rows as views of the map, as graphsplit did before. Timed per epoch of
               single items, and per epoch of batches (``collate`` of ``--batch`` items, which
               copies once more into the batch: what a training loop pays).
    fingerprint  a remembered weights fingerprint (a process's second one: every tensor's
               hash is reused) now also samples 256 elements of each tensor, so writes through
               ``.data`` (an EMA teacher) are seen; the baseline reuses hashes on the version
               counter alone. Timed over ``--tensors`` frozen tensors of ``--tensor-mb`` MiB.

The rows are a latent diffusion model's at 512 px: latents 4x64x64 and text 77x768, float32
(64 KiB + 231 KiB per sample), in the page cache. The report gives the median and IQR of the
per-round seconds, wall-clock and CPU time, and the same-round ratio safe / unsafe.

    python -m benchmarks.bench_safe_items --help
    python -m benchmarks.bench_safe_items --quick --out /tmp/results     # smoke test
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from benchmarks.common import (
    environment,
    interleaved,
    markdown_table,
    parser,
    report,
    timing_options,
    torch_threads,
    write_results,
)
from graphsplit.caching.format import fingerprint as fingerprints
from graphsplit.caching.format.memory_order import inverse, row_order
from graphsplit.caching.read.collation import CachedSample, collate
from graphsplit.caching.read.dataset import CachedDataset
from graphsplit.caching.write.cache_run import cache


class _Rows(torch.utils.data.Dataset):
    """Samples whose stage 1 is the identity: the cache holds these rows as they are."""

    def __init__(self, count: int, side: int, tokens: int, width: int) -> None:
        self.count, self.side, self.tokens, self.width = count, side, tokens, width

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, Any]:
        generator = torch.Generator().manual_seed(index)
        return {
            "latents": torch.randn(4, self.side, self.side, generator=generator),
            "text": torch.randn(self.tokens, self.width, generator=generator),
            "key": f"s{index:06d}",
        }


class _Identity(nn.Module):
    def forward(self, latents: torch.Tensor, text: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"latents": latents * 1.0, "text": text * 1.0}


def _split(dataset: _Rows) -> SimpleNamespace:
    from graphsplit.artifacts import BoundarySpec

    side, tokens, width = dataset.side, dataset.tokens, dataset.width
    stage1 = torch.fx.symbolic_trace(_Identity())
    boundary = {
        "latents": BoundarySpec(
            "latents", (2, 4, side, side), torch.float32, 0, 4 * side * side * 4, "x:1"
        ),
        "text": BoundarySpec(
            "text", (2, tokens, width), torch.float32, 0, tokens * width * 4, "x:2"
        ),
    }
    return SimpleNamespace(
        stage1=stage1, stage2=nn.Identity(), boundary=boundary, input_names=("latents", "text")
    )


def _view_item(cached: CachedDataset, index: int) -> CachedSample:
    """``cached[index]`` as graphsplit read it before: rows as views of the shard's map."""
    shard, row = cached._locate(index)
    handle = cached._handles.get(shard) or cached._open(shard)
    item = CachedSample(key=cached.keys[cached._starts[shard] + row])
    item.collation = cached.collation
    item.signature = cached.signatures[index]
    orders = cached.manifest.shards[shard].row_orders[row]
    for name, stored_name in cached._tensor_names[row]:
        item[name] = handle.get_tensor(stored_name)
    if any(orders):
        item.dim_orders = orders
        for (name, batch_dim, _), order in zip(cached.collation.rows, orders):
            if order is not None:
                item[name] = item[name].permute(inverse(row_order(order, batch_dim)))
    return item


def measure_items(samples: int, batch: int, rounds: int, folder: Path) -> dict[str, Any]:
    dataset = _Rows(samples, 64, 77, 768) if samples >= 64 else _Rows(samples, 8, 7, 16)
    loader = torch.utils.data.DataLoader(dataset, batch_size=8)
    cache(_split(dataset), loader, folder, progress=False)
    cached = CachedDataset(folder, verify=False)
    for index in range(len(cached)):  # map every shard first: opening is not what is timed
        cached[index]
    starts = range(0, len(cached) - batch + 1, batch)
    variants = {
        "view items": lambda: [_view_item(cached, i) for i in range(len(cached))],
        "copied items": lambda: [cached[i] for i in range(len(cached))],
        "view batches": lambda: [
            collate([_view_item(cached, i) for i in range(s, s + batch)]) for s in starts
        ],
        "copied batches": lambda: [
            collate([cached[i] for i in range(s, s + batch)]) for s in starts
        ],
    }
    timings = interleaved(variants, rounds=rounds)
    row_bytes = sum(
        value.numel() * value.element_size() for name, value in cached[0].items() if name != "key"
    )
    return {
        "samples": len(cached),
        "bytes_per_sample": row_bytes,
        "batch": batch,
        "timings": timings.to_json(),
        "ratios": {
            clock: {
                "items": timings.ratio("copied items", "view items", clock).to_json(),
                "batches": timings.ratio("copied batches", "view batches", clock).to_json(),
            }
            for clock in ("wall", "cpu")
        },
    }


class _Frozen(nn.Module):
    code = "def forward(self, x):\n    return {}\n"

    def __init__(self, tensors: int, tensor_megabytes: float) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        numel = max(1, int(tensor_megabytes * 2**20) // 4)
        for index in range(tensors):
            self.register_buffer(f"w{index:04d}", torch.randn(numel, generator=generator))


def measure_fingerprint(tensors: int, tensor_megabytes: float, rounds: int) -> dict[str, Any]:
    split = SimpleNamespace(stage1=_Frozen(tensors, tensor_megabytes), boundary={})
    sampling = fingerprints._probe
    variants = {
        "version counter only": lambda: fingerprints.fingerprint(split),
        "with sampled elements": lambda: fingerprints.fingerprint(split),
    }

    def before_each(name: str, index: int) -> None:
        fingerprints._probe = sampling if name == "with sampled elements" else (lambda t: b"")
        fingerprints.WEIGHT_HASHES.forget()
        fingerprints.fingerprint(split)  # untimed: the process's first fingerprint

    try:
        timings = interleaved(variants, rounds=rounds, before_each=before_each)
    finally:
        fingerprints._probe = sampling
    return {
        "tensors": tensors,
        "tensor_mib": tensor_megabytes,
        "timings": timings.to_json(),
        "ratios": {
            clock: timings.ratio("with sampled elements", "version counter only", clock).to_json()
            for clock in ("wall", "cpu")
        },
    }


def _ms(value: dict[str, float]) -> str:
    return f"{value['median'] * 1e3:.2f} ({value['q1'] * 1e3:.2f}–{value['q3'] * 1e3:.2f})"


def _ratio(value: dict[str, float]) -> str:
    return f"{value['median']:.2f} ({value['q1']:.2f}–{value['q3']:.2f})"


def to_markdown(result: dict[str, Any], threads: int) -> str:
    items, prints = result["items"], result["fingerprint"]
    wall, cpu = items["timings"]["wall"], items["timings"]["cpu"]
    rows = []
    for kind, safe, unsafe in (
        ("items", "copied items", "view items"),
        ("batches", "copied batches", "view batches"),
    ):
        rows.append(
            [
                f"epoch of {kind}"
                + (f" (collate of {items['batch']})" if kind == "batches" else ""),
                _ms(wall[unsafe]),
                _ms(wall[safe]),
                _ms(cpu[unsafe]),
                _ms(cpu[safe]),
                _ratio(items["ratios"]["cpu"][kind]),
            ]
        )
    fwall, fcpu = prints["timings"]["wall"], prints["timings"]["cpu"]
    rows.append(
        [
            f"remembered fingerprint, {prints['tensors']} tensors of {prints['tensor_mib']:g} MiB",
            _ms(fwall["version counter only"]),
            _ms(fwall["with sampled elements"]),
            _ms(fcpu["version counter only"]),
            _ms(fcpu["with sampled elements"]),
            _ratio(prints["ratios"]["cpu"]),
        ]
    )
    header = [
        "what",
        "unsafe, ms wall",
        "safe, ms wall",
        "unsafe, ms CPU",
        "safe, ms CPU",
        "safe / unsafe, CPU",
    ]
    return (
        f"{items['samples']} samples of {items['bytes_per_sample'] / 1024:.0f} KiB, "
        f"{threads} torch thread(s); median (IQR) of {result['rounds']} interleaved rounds\n\n"
        + markdown_table(header, rows, "lrrrrr")
    )


def main(argv: list[str] | None = None) -> int:
    command = timing_options(parser("bench_safe_items", __doc__), rounds=9)
    command.add_argument("--samples", type=int, default=512, help="cached samples (default: 512)")
    command.add_argument("--batch", type=int, default=16, help="batch size (default: 16)")
    command.add_argument("--tensors", type=int, default=400, help="frozen tensors (default: 400)")
    command.add_argument(
        "--tensor-mb", type=float, default=1.0, help="MiB per frozen tensor (default: 1)"
    )
    args = command.parse_args(argv)
    if args.quick:
        args.samples, args.batch, args.tensors, args.tensor_mb, args.rounds = 16, 4, 8, 0.01, 1
    with torch_threads(args.threads) as threads, tempfile.TemporaryDirectory() as folder:
        result = {
            "rounds": args.rounds,
            "items": measure_items(args.samples, args.batch, args.rounds, Path(folder)),
            "fingerprint": measure_fingerprint(args.tensors, args.tensor_mb, args.rounds),
        }
        where = environment("torch", "safetensors", torch_threads=True)
    write_results(
        args.out, "safe_items", report("safe_items", result, where), to_markdown(result, threads)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
