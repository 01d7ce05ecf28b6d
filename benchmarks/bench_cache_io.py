"""Cache I/O: graphsplit.cache and CachedDataset vs raw safetensors on the same tensors.

Writing: ``graphsplit.cache`` (rows cut from batches, input digests, a checksum computed while
writing and an fsync per shard, atomic renames, the manifest) with a stage 1 that only looks the
rows up, against ``safetensors.torch.save_file`` writing the same rows into the same shards,
once bare (the bytes stay in the page cache), once with an ``fsync`` of each file before the
next is written (durable, as graphsplit's shards are) and once with each file's ``fsync``
overlapping the writing of the next (durable, the way graphsplit writes). The last, against
bare ``save_file``, says how close to bare a durable writer can come on this disk. Like for
like, ``cache(..., durable=False)`` (no fsync, the same files) against bare ``save_file``.
On caches larger than the page cache the baselines converge.
Reading: one shuffled epoch of ``CachedDataset`` items against raw ``safe_open(...).get_tensor``
reads of the same rows, handles already open, every byte touched; with ``verify=False`` (or
after the first epoch) and with the first-epoch checksums. Before each write (untimed) the rows
of both writers are read once, so that each starts from memory just touched, as a writer fed
by stage 1 does, and ``os.sync()`` flushes what the previous variant left dirty, so that no
write runs beside the flushing of another's. Variants run interleaved round by
round, on one torch thread by default; the report gives the median and IQR of same-round ratios
(baseline seconds / graphsplit seconds, so 1.0 is "as fast as safetensors") on wall-clock and
CPU time (all threads of the process, graphsplit's writer threads included), files in the page
cache. Two sizes are measured: the small one (default 256 samples, ~78 MB, where a
``cache()`` call's fixed cost shows) and a realistic one (``--large-mb``, default 1 GiB in
256 MiB shards, still in the page cache, where the per-byte cost dominates).

    python -m benchmarks.bench_cache_io --help
    python -m benchmarks.bench_cache_io --quick --out /tmp/results     # smoke test
"""

from __future__ import annotations

import os
import shutil
import tempfile
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

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
from graphsplit.artifacts import BoundarySpec
from graphsplit.caching import CachedDataset, cache
from graphsplit.caching.store.record_files import read_manifest

# One Stable-Diffusion-like sample: 64x64 latents and a 77-token text embedding, float32.
SHAPES = {"latents": (4, 64, 64), "text": (77, 768)}


class _Lookup(torch.nn.Module):
    """A stage 1 that costs nothing: it returns precomputed batches, so only I/O is measured."""

    code = "def forward(self, index):\n    return batches[index[0] // batch_size]\n"

    def __init__(self, batches: list[dict[str, torch.Tensor]], batch_size: int) -> None:
        super().__init__()
        self._batches = batches  # a plain list: not buffers, so not part of the fingerprint
        self._batch_size = batch_size

    def forward(self, index: torch.Tensor) -> dict[str, torch.Tensor]:
        return self._batches[int(index[0]) // self._batch_size]


def _workload(samples: int, batch_size: int) -> tuple[SimpleNamespace, list[dict], int]:
    generator = torch.Generator().manual_seed(0)
    starts = range(0, samples, batch_size)
    outputs = [
        {
            name: torch.randn(min(batch_size, samples - start), *shape, generator=generator)
            for name, shape in SHAPES.items()
        }
        for start in starts
    ]
    boundary = {
        name: BoundarySpec(name, (batch_size, *shape), torch.float32, 0, 4 * _numel(shape), "bench")
        for name, shape in SHAPES.items()
    }
    split = SimpleNamespace(
        stage1=_Lookup(outputs, batch_size), boundary=boundary, input_names=("index",)
    )
    batches = [{"index": torch.arange(start, min(start + batch_size, samples))} for start in starts]
    row_bytes = sum(4 * _numel(shape) for shape in SHAPES.values())
    return split, batches, row_bytes * samples


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _raw_shards(split: SimpleNamespace, folder: Path) -> list[dict[str, torch.Tensor]]:
    """The rows of each shard of the graphsplit cache in ``folder``, under the same names."""
    rows = [
        {name: values[row].clone() for name, values in batch.items()}
        for batch in split.stage1._batches
        for row in range(len(batch["latents"]))
    ]
    shards, index = [], 0
    for record in read_manifest(folder).shards:
        shard = {}
        for row in range(len(record.keys)):
            for name in SHAPES:
                shard[f"{row}/{name}"] = rows[index][name]
            index += 1
        shards.append(shard)
    return shards


def _write_raw(shards: list[dict[str, torch.Tensor]], folder: Path, *, fsync: str) -> None:
    """``save_file`` each shard; ``fsync``: ``"none"``, ``"after"`` (each file fsync'd before
    the next is written) or ``"overlapped"`` (as graphsplit does: each file fsync'd on one of
    two threads while the next is written, at most two waiting)."""
    syncing: list[Future[None]] = []
    with ThreadPoolExecutor(2) as syncer:
        for number, rows in enumerate(shards):
            path = folder / f"raw-{number:05d}.safetensors"
            save_file(rows, path)
            if fsync == "after":
                _fsync(path)
            elif fsync == "overlapped":
                syncing = [future for future in syncing if not future.done()]
                if len(syncing) >= 2:
                    wait(syncing, return_when=FIRST_COMPLETED)
                syncing.append(syncer.submit(_fsync, path))
        for future in syncing:
            future.result()


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _warm(tensors: list[dict[str, torch.Tensor]]) -> None:
    """Read every byte of ``tensors`` (untimed). A writer's input is what stage 1 has just
    computed, so it is in memory that was just touched; in a VM, memory left idle for seconds
    can be slower to read at first (rows idle for one round of the 1 GiB size took up to 3x
    longer to write than the same rows just read), which would charge whichever variant
    touched its rows last."""
    for rows in tensors:
        for tensor in rows.values():
            _touch(tensor)


def _touch(tensor: torch.Tensor) -> None:
    """Read every byte once (numpy: no torch kernel launch in the measurement)."""
    tensor.numpy().sum()


def _read_cached(cached: CachedDataset, order: list[int]) -> None:
    for index in order:
        item = cached[index]
        for name in SHAPES:
            _touch(item[name])


def _open_raw(folder: Path, shards: list[dict[str, torch.Tensor]]):
    handles = [
        safe_open(str(folder / f"raw-{number:05d}.safetensors"), framework="pt")
        for number in range(len(shards))
    ]
    where = [(number, row) for number, rows in enumerate(shards) for row in range(len(rows) // 2)]
    return handles, where


def _read_raw(opened, order: list[int]) -> None:
    handles, where = opened
    for index in order:
        number, row = where[index]
        for name in SHAPES:
            _touch(handles[number].get_tensor(f"{row}/{name}"))


def _fresh(folder: Path) -> Path:
    folder.mkdir()
    return folder


# Each write variant sits next to graphsplit's writer, and each read variant next to the raw
# read, in both orders of a round (see benchmarks.common.interleaved).
VARIANTS = (
    "write_save_file",
    "write_graphsplit_non_durable",
    "write_graphsplit",
    "write_save_file_fsync",
    "write_save_file_fsync_overlapped",
    "read_graphsplit",
    "read_safe_open",
    "read_graphsplit_verified",
)
# (name, faster-is-this baseline, graphsplit's variant): ratio = baseline / graphsplit seconds.
RATIOS = {
    "write_ratio_non_durable": ("write_save_file", "write_graphsplit_non_durable"),
    "write_ratio": ("write_save_file", "write_graphsplit"),
    "write_ratio_vs_fsync": ("write_save_file_fsync", "write_graphsplit"),
    "write_ratio_vs_overlapped_fsync": ("write_save_file_fsync_overlapped", "write_graphsplit"),
    # Not graphsplit: how close to bare save_file a durable save_file can come on this disk.
    "durable_save_file_ratio": ("write_save_file", "write_save_file_fsync_overlapped"),
    "read_ratio": ("read_safe_open", "read_graphsplit"),
    "read_ratio_verified": ("read_safe_open", "read_graphsplit_verified"),
}


def measure(
    samples: int, batch_size: int, shard_mb: float, rounds: int, folder: Path | None = None
) -> dict[str, Any]:
    """Seconds of each variant over ``rounds`` interleaved rounds, and same-round ratios."""
    split, batches, total_bytes = _workload(samples, batch_size)
    shard_bytes = int(shard_mb * 2**20)
    root = Path(tempfile.mkdtemp(prefix="graphsplit-bench-", dir=folder))
    try:
        ours, raw = root / "cache", root / "raw"
        cache(split, batches, ours, shard_bytes=shard_bytes, progress=False)
        shards = _raw_shards(split, ours)
        raw.mkdir()
        order = torch.randperm(samples, generator=torch.Generator().manual_seed(1)).tolist()
        _write_raw(shards, raw, fsync="none")
        cached = CachedDataset(ours, verify=False)
        opened = _open_raw(raw, shards)
        fresh: list[CachedDataset] = []  # verification happens once per dataset object
        variants = {
            "write_graphsplit": lambda: cache(
                split, batches, _fresh(root / "w"), shard_bytes=shard_bytes, progress=False
            ),
            "write_graphsplit_non_durable": lambda: cache(
                split,
                batches,
                _fresh(root / "w"),
                shard_bytes=shard_bytes,
                progress=False,
                durable=False,
            ),
            "write_save_file": lambda: _write_raw(shards, _fresh(root / "w"), fsync="none"),
            "write_save_file_fsync": lambda: _write_raw(shards, _fresh(root / "w"), fsync="after"),
            "write_save_file_fsync_overlapped": lambda: _write_raw(
                shards, _fresh(root / "w"), fsync="overlapped"
            ),
            "read_graphsplit": lambda: _read_cached(cached, order),
            "read_graphsplit_verified": lambda: _read_cached(fresh.pop(), order),
            "read_safe_open": lambda: _read_raw(opened, order),
        }

        def before_each(name: str, index: int) -> None:
            shutil.rmtree(root / "w", ignore_errors=True)  # every write starts empty
            if name.startswith("write_"):  # every writer starts from memory just touched
                _warm(split.stage1._batches)
                _warm(shards)
                os.sync()  # and with no earlier write still being flushed beside it
            if name == "read_graphsplit_verified":
                fresh.append(CachedDataset(ours, verify=True))

        timings = interleaved(
            {name: variants[name] for name in VARIANTS}, rounds=rounds, before_each=before_each
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result: dict[str, Any] = {
        "samples": samples,
        "batch_size": batch_size,
        "bytes_per_sample": total_bytes // samples,
        "shard_mb": shard_mb,
        "num_shards": len(shards),
        "rounds": rounds,
        "timings": timings.to_json(),
    }
    for clock in ("wall", "cpu"):
        result[clock] = {
            "median_seconds": {name: timings.spread(name, clock).median for name in VARIANTS},
            **{
                key: timings.ratio(baseline, ours_, clock).to_json()
                for key, (baseline, ours_) in RATIOS.items()
            },
        }
    result["throughput_mb_s"] = {
        name: total_bytes / seconds / 1e6
        for name, seconds in result["wall"]["median_seconds"].items()
    }
    return result


def _samples_for(megabytes: float) -> int:
    """How many samples make about ``megabytes`` MiB."""
    row_bytes = sum(4 * _numel(shape) for shape in SHAPES.values())
    return max(2, round(megabytes * 2**20 / row_bytes))


def _cell(value: dict[str, float]) -> str:
    return f"{value['median']:.2f} ({value['q1']:.2f}–{value['q3']:.2f})"


def to_markdown(result: dict[str, Any], threads: int) -> str:
    tables = [_table(result, threads)]
    if "large" in result:
        tables.append(_table(result["large"], threads))
    return "\n\n".join(tables)


def _table(result: dict[str, Any], threads: int) -> str:
    mb, wall, cpu = result["throughput_mb_s"], result["wall"], result["cpu"]
    lines = [
        ("write, durable=False (vs save_file)", "write_graphsplit_non_durable", "write_save_file",
         "write_ratio_non_durable"),
        ("write (vs save_file)", "write_graphsplit", "write_save_file", "write_ratio"),
        ("write (vs save_file + fsync)", "write_graphsplit", "write_save_file_fsync",
         "write_ratio_vs_fsync"),
        ("write (vs save_file + overlapped fsync)", "write_graphsplit",
         "write_save_file_fsync_overlapped", "write_ratio_vs_overlapped_fsync"),
        ("*save_file + overlapped fsync (vs save_file)*", "write_save_file_fsync_overlapped",
         "write_save_file", "durable_save_file_ratio"),
        ("shuffled read (verify=False)", "read_graphsplit", "read_safe_open", "read_ratio"),
        ("shuffled read, first epoch (verify=True)", "read_graphsplit_verified",
         "read_safe_open", "read_ratio_verified"),
    ]  # fmt: skip
    rows = [
        [label, f"{mb[ours]:.0f}", f"{mb[theirs]:.0f}", _cell(wall[key]), _cell(cpu[key])]
        for label, ours, theirs, key in lines
    ]
    header = ["", "MB/s", "baseline MB/s", "ratio, wall", "ratio, CPU time"]
    return (
        f"{result['samples']} samples × {result['bytes_per_sample'] / 1e3:.0f} KB in "
        f"{result['num_shards']} shards, page cache warm, {threads} torch thread(s); MB/s from "
        f"median wall seconds; ratios: median (IQR) of {result['rounds']} same-round ratios\n\n"
        + markdown_table(header, rows, "lrrrr")
    )


def main(argv: list[str] | None = None) -> int:
    command = timing_options(parser("bench_cache_io", __doc__), rounds=15)
    command.add_argument("--samples", type=int, default=256, help="samples (default: 256, ~80 MB)")
    command.add_argument("--batch-size", type=int, default=8, help="loader batch size (default: 8)")
    command.add_argument(
        "--shard-mb", type=float, default=16.0, help="shard size (default: 16 MiB)"
    )
    command.add_argument(
        "--large-mb",
        type=float,
        default=1024.0,
        help="also measure a cache of about this many MiB (default: 1024; 0: skip)",
    )
    command.add_argument(
        "--large-shard-mb", type=float, default=256.0, help="its shard size (default: 256 MiB)"
    )
    command.add_argument("--large-rounds", type=int, default=3, help="its rounds (default: 3)")
    command.add_argument(
        "--dir", type=Path, help="where to write the caches (default: the temporary folder)"
    )
    args = command.parse_args(argv)
    if args.quick:
        args.samples, args.batch_size, args.shard_mb, args.rounds = 12, 4, 1.0, 1
        args.large_mb, args.large_shard_mb, args.large_rounds = 8.0, 4.0, 1
    with torch_threads(args.threads) as threads:
        result = measure(args.samples, args.batch_size, args.shard_mb, args.rounds, args.dir)
        if args.large_mb > 0:
            large = _samples_for(args.large_mb)
            result["large"] = measure(
                large, args.batch_size, args.large_shard_mb, args.large_rounds, args.dir
            )
        where = environment("torch", "safetensors", torch_threads=True)
    write_results(
        args.out, "cache_io", report("cache_io", result, where), to_markdown(result, threads)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
