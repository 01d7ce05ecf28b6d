"""Does caching keep up with stage 1? ``cache()`` over a loader against stage 1 alone on the
same batches (issue 27's target: <= 1.03x).

The demo's step (the zoo's SD LoRA step, ``heavy_frozen`` size) at 64 px, 32 samples in
batches of 4, collated beforehand (the loader's work is in neither variant). Each round runs,
in alternating order: stage 1 alone (``split.stage1`` under ``torch.inference_mode()`` on
every batch, as ``cache()`` calls it), ``cache()`` durable (the default) and
``cache(durable=False)``, each into an emptied folder. The figure is the median (IQR) of the
same-round ratios "cache() / stage 1 alone", wall and CPU time (all threads of the process).
The files' SHA-256 (every file but the manifest and the resume records, which hold times and
the boot) is reported, so that a change to the writer can be checked byte-identical.

    python -m benchmarks.bench_cache_overlap --help
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import (
    environment,
    interleaved,
    markdown_table,
    parser,
    ratio_text,
    report,
    timing_options,
    torch_threads,
    write_results,
)


def _batches(samples: int, batch_size: int, resolution: int) -> list[dict[str, Any]]:
    from torch.utils.data import default_collate

    from tests.zoo import CaptionedImages

    dataset = CaptionedImages(length=samples, resolution=resolution, seed=0)
    return [
        default_collate([dataset[i] for i in range(first, min(first + batch_size, samples))])
        for first in range(0, samples, batch_size)
    ]


def _shard_digest(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*.safetensors")):
        digest.update(path.relative_to(folder).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def measure(samples: int, batch_size: int, resolution: int, size: str, rounds: int) -> dict:
    import torch

    import graphsplit
    from tests.zoo import build_sd_lora_step

    step = build_sd_lora_step(seed=0, size=size)
    batches = _batches(samples, batch_size, resolution)
    first = batches[0]
    split = graphsplit.split(step, (first["pixel_values"], first["input_ids"]))
    names = split.input_names
    root = Path(tempfile.mkdtemp(prefix="bench_cache_overlap_"))
    folders = {"cache()": root / "durable", "cache(durable=False)": root / "fast"}
    digests: dict[str, set[str]] = {name: set() for name in folders}

    def stage1_alone() -> None:
        with torch.inference_mode():
            for batch in batches:
                split.stage1(**{name: batch[name] for name in names})

    def run_cache(name: str, durable: bool) -> Any:
        def run() -> None:
            graphsplit.cache(split, batches, folders[name], progress=False, durable=durable)

        return run

    def before_each(name: str, index: int) -> None:
        for other, folder in folders.items():
            if folder.exists():
                digests[other].add(_shard_digest(folder))
                shutil.rmtree(folder)

    try:
        timings = interleaved(
            {
                "stage 1 alone": stage1_alone,
                "cache()": run_cache("cache()", True),
                "cache(durable=False)": run_cache("cache(durable=False)", False),
            },
            rounds=rounds,
            before_each=before_each,
        )
        before_each("", 0)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "samples": samples,
        "batch_size": batch_size,
        "resolution": resolution,
        "size": size,
        "timings": timings.to_json(),
        "stage1_s": timings.spread("stage 1 alone", "cpu").to_json(),
        "over_stage1": {
            name: {
                clock: timings.ratio(name, "stage 1 alone", clock).to_json()
                for clock in ("wall", "cpu")
            }
            for name in folders
        },
        "shard_sha256": {name: sorted(found) for name, found in digests.items()},
    }


def to_markdown(result: dict[str, Any]) -> str:
    header = ["variant", "stage 1 alone, CPU s", "/ stage 1 alone (wall)", "/ stage 1 alone (CPU)"]
    rows = [
        [
            name,
            f"{result['stage1_s']['median']:.3f}",
            ratio_text(figures["wall"]),
            ratio_text(figures["cpu"]),
        ]
        for name, figures in result["over_stage1"].items()
    ]
    return markdown_table(header, rows, "lrrr")


def main(argv: list[str] | None = None) -> int:
    command = timing_options(parser("bench_cache_overlap", __doc__), rounds=9)
    command.add_argument("--samples", type=int, default=32)
    command.add_argument("--batch-size", type=int, default=4)
    command.add_argument("--resolution", type=int, default=64)
    command.add_argument("--size", default="heavy_frozen", help="a key of tests.zoo.SD_SIZES")
    args = command.parse_args(argv)
    if args.quick:
        samples, resolution, size, rounds = 4, 32, "tiny", 1
    else:
        samples, resolution, size, rounds = args.samples, args.resolution, args.size, args.rounds
    with torch_threads(args.threads) as threads:
        result = measure(samples, args.batch_size, resolution, size, rounds)
    payload = report(
        "cache_overlap",
        result,
        {**environment("torch", "diffusers", "transformers", "peft"), "threads": threads},
    )
    write_results(args.out, "cache_overlap", payload, to_markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
