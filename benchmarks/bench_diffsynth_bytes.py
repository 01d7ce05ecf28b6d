"""Bytes on disk per sample: graphsplit's cache against DiffSynth-Studio's data_process output.

DiffSynth's ``--task sft:data_process`` runs the units that need no trainable model
(``split_pipeline_units``) and ``torch.save``s what they return, one ``.pth`` per sample (the
pipeline's inputs and the units' outputs: latents, text embedding, the noise it drew, sizes
and settings). Here both are measured on the same samples of DiffSynth's own Wan 2.1
text-to-video LoRA step (``examples/diffsynth/steps.py``, tiny, random weights), and its FLUX.1
and Qwen-Image LoRA steps (``examples/diffsynth/image_steps.py``: DiffSynth's 3072-wide classes
with one block of each kind, real random weights, about 4 and 5.4 GB; every Qwen sample has a
prompt of 8 tokens, since one plan serves one prompt length; ``--quick`` measures Wan only):

- diffsynth: the bytes ``torch.save`` writes for that sample, as its runner does;
- graphsplit: the bytes of the cache folder ``graphsplit.cache`` writes (safetensors shards and
  manifest) divided by the number of samples, when the step splits on this version; otherwise
  the construct that stops it.

Needs ``diffsynth==2.1.12`` (see ``examples/diffsynth/README.md``).

    python -m benchmarks.bench_diffsynth_bytes --help
"""

from __future__ import annotations

import importlib
import io
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import graphsplit
from benchmarks.common import environment, markdown_table, parser, report, write_results

SAMPLES = 4


@dataclass(frozen=True)
class Family:
    """One of DiffSynth's training steps: where its builder and its batches come from."""

    title: str
    module: str
    step: str  # step(seed=0) -> (training module, example batch)
    batch: str  # batch(seed) -> one sample as the data loader hands it over

    def build(self) -> tuple[Any, dict[str, torch.Tensor]]:
        return getattr(importlib.import_module(self.module), self.step)(seed=0)

    def sample(self, seed: int) -> dict[str, torch.Tensor]:
        return getattr(importlib.import_module(self.module), self.batch)(seed)


FAMILIES = {
    "wan": Family(
        "Wan 2.1 T2V LoRA (tiny: 5x32x32 video, 8 tokens)",
        "examples.diffsynth.steps",
        "wan_t2v_lora_step",
        "wan_batch",
    ),
    "flux": Family(
        "FLUX.1 LoRA (3072 wide, 1+1 DiT blocks, T5 1 block, 32x32 image, 32 T5 tokens)",
        "examples.diffsynth.image_steps",
        "flux_lora_step",
        "flux_batch",
    ),
    "qwen": Family(
        "Qwen-Image LoRA (3072 wide, 1 DiT block, Qwen2.5-VL 1 layer, 32x32 image, 8 tokens)",
        "examples.diffsynth.image_steps",
        "qwen_image_lora_step",
        "qwen_image_batch",
    ),
}


def diffsynth_bytes(family: Family, seeds: range) -> list[int]:
    """What DiffSynth's data_process task ``torch.save``s for each sample."""
    step, _ = family.build()
    # train.py's constructor with --task sft:data_process: the units that need no LoRA model
    step.pipe = step.split_pipeline_units("sft:data_process", step.pipe, None, "dit")
    step.task = "sft:data_process"
    step.task_to_loss["sft:data_process"] = lambda pipe, *args: args
    sizes = []
    for seed in seeds:
        with torch.no_grad():
            torch.manual_seed(seed)
            data = step(**family.sample(seed))
        buffer = io.BytesIO()
        torch.save(data, buffer)
        sizes.append(buffer.getbuffer().nbytes)
    return sizes


def graphsplit_bytes(family: Family, samples: int = SAMPLES) -> tuple[int | None, str]:
    """Bytes per sample of graphsplit's cache of the same samples, or why there is none."""
    step, batch = family.build()
    try:
        split = graphsplit.split(step, kwargs=batch)
    except graphsplit.GraphsplitError as exc:
        return None, str(exc).splitlines()[0] + " " + _source_line(str(exc))
    loader = [dict(family.sample(seed), key=[f"sample{seed}"]) for seed in range(samples)]
    with tempfile.TemporaryDirectory() as folder:
        graphsplit.cache(split, loader, Path(folder) / "cache", progress=False)
        total = sum(path.stat().st_size for path in Path(folder).rglob("*") if path.is_file())
    return total // samples, ", ".join(split.boundary)


def _source_line(message: str) -> str:
    return next((line.strip() for line in message.splitlines() if "source:" in line), "")


def measure(family: Family, samples: int = SAMPLES) -> dict:
    diffsynth = diffsynth_bytes(family, range(samples))
    ours, detail = graphsplit_bytes(family, samples)
    return {
        "step": family.title,
        "diffsynth_bytes_per_sample": sum(diffsynth) // samples,
        "graphsplit_bytes_per_sample": ours,
        "graphsplit_detail": detail,
    }


def to_markdown(results: list[dict]) -> str:
    rows = []
    for result in results:
        ours = result["graphsplit_bytes_per_sample"]
        theirs = result["diffsynth_bytes_per_sample"]
        rows.append([
            result["step"],
            f"{theirs}",
            "—" if ours is None else f"{ours}",
            "—" if ours is None else f"{(ours - theirs) / theirs:+.0%}",
            result["graphsplit_detail"],
        ])  # fmt: skip
    header = ["step", "DiffSynth .pth B/sample", "graphsplit B/sample", "change", "boundary"]
    return markdown_table(header, rows, "lrrrl")


def main(argv: list[str] | None = None) -> int:
    command = parser("bench_diffsynth_bytes", __doc__)
    command.add_argument(
        "--quick", action="store_true", help="one sample instead of four, Wan only"
    )
    command.add_argument(
        "--families",
        nargs="+",
        choices=sorted(FAMILIES),
        help="steps to measure (default: all; FLUX builds 3072-wide blocks, about 4 GB)",
    )
    args = command.parse_args(argv)
    from examples.diffsynth.steps import DIFFSYNTH, WHY_NOT

    if not DIFFSYNTH:
        print(f"bench_diffsynth_bytes skipped: {WHY_NOT}")
        return 0
    names = args.families or (["wan"] if args.quick else list(FAMILIES))
    results = [measure(FAMILIES[name], 1 if args.quick else SAMPLES) for name in names]
    where = environment("torch", "diffsynth")
    payload = report("diffsynth_bytes", results, where)
    write_results(args.out, "diffsynth_bytes", payload, to_markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
