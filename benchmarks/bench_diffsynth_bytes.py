"""Bytes on disk per sample: graphsplit's cache against DiffSynth-Studio's data_process output.

DiffSynth's ``--task sft:data_process`` runs the units that need no trainable model
(``split_pipeline_units``) and ``torch.save``s what they return, one ``.pth`` per sample (the
pipeline's inputs and the units' outputs: latents, text embedding, the noise it drew, sizes
and settings). Here both are measured on the same sample of DiffSynth's own Wan 2.1
text-to-video LoRA step (``examples/diffsynth/steps.py``, tiny, random weights):

- diffsynth: the bytes ``torch.save`` writes for that sample, as its runner does;
- graphsplit: the bytes of the cache folder ``graphsplit.cache`` writes (safetensors shards and
  manifest) divided by the number of samples, when the step splits on this version; otherwise
  the construct that stops it.

Needs ``diffsynth==2.1.12`` (see ``examples/diffsynth/README.md``).

    python -m benchmarks.bench_diffsynth_bytes --help
"""

from __future__ import annotations

import io
import tempfile
from pathlib import Path

import torch

import graphsplit
from benchmarks.common import markdown_table, parser, write_results

SAMPLES = 4


def diffsynth_bytes(seed: int) -> int:
    """What DiffSynth's data_process task ``torch.save``s for one sample."""
    from examples.diffsynth.steps import wan_batch, wan_t2v_lora_step

    step, _ = wan_t2v_lora_step(seed=0)
    # train.py's constructor with --task sft:data_process: the units that need no LoRA model
    step.pipe = step.split_pipeline_units("sft:data_process", step.pipe, None, "dit")
    step.task = "sft:data_process"
    step.task_to_loss["sft:data_process"] = lambda pipe, *args: args
    with torch.no_grad():
        torch.manual_seed(seed)
        data = step(**wan_batch(seed))
    buffer = io.BytesIO()
    torch.save(data, buffer)
    return buffer.getbuffer().nbytes


def graphsplit_bytes(samples: int = SAMPLES) -> tuple[int | None, str]:
    """Bytes per sample of graphsplit's cache of the same samples, or why there is none."""
    from examples.diffsynth.steps import wan_batch, wan_t2v_lora_step

    step, batch = wan_t2v_lora_step(seed=0)
    try:
        split = graphsplit.split(step, kwargs=batch)
    except graphsplit.GraphsplitError as exc:
        return None, str(exc).splitlines()[0] + " " + _source_line(str(exc))
    loader = [dict(wan_batch(seed), key=[f"sample{seed}"]) for seed in range(samples)]
    with tempfile.TemporaryDirectory() as folder:
        graphsplit.cache(split, loader, Path(folder) / "cache", progress=False)
        total = sum(path.stat().st_size for path in Path(folder).rglob("*") if path.is_file())
    return total // samples, ", ".join(split.boundary)


def _source_line(message: str) -> str:
    return next((line.strip() for line in message.splitlines() if "source:" in line), "")


def measure(samples: int = SAMPLES) -> dict:
    diffsynth = [diffsynth_bytes(seed) for seed in range(samples)]
    ours, detail = graphsplit_bytes(samples)
    return {
        "step": "Wan 2.1 T2V LoRA (tiny: 5x32x32 video, 8 tokens)",
        "diffsynth_bytes_per_sample": sum(diffsynth) // samples,
        "graphsplit_bytes_per_sample": ours,
        "graphsplit_detail": detail,
    }


def to_markdown(result: dict) -> str:
    ours = result["graphsplit_bytes_per_sample"]
    theirs = result["diffsynth_bytes_per_sample"]
    row = [
        result["step"],
        f"{theirs}",
        "—" if ours is None else f"{ours}",
        "—" if ours is None else f"{(ours - theirs) / theirs:+.0%}",
        result["graphsplit_detail"],
    ]
    header = ["step", "DiffSynth .pth B/sample", "graphsplit B/sample", "change", "boundary"]
    return markdown_table(header, [row], "lrrrl")


def main(argv: list[str] | None = None) -> int:
    command = parser("bench_diffsynth_bytes", __doc__)
    command.add_argument("--quick", action="store_true", help="one sample instead of four")
    args = command.parse_args(argv)
    from examples.diffsynth.steps import DIFFSYNTH, WHY_NOT

    if not DIFFSYNTH:
        print(f"bench_diffsynth_bytes skipped: {WHY_NOT}")
        return 0
    result = measure(1 if args.quick else SAMPLES)
    write_results(args.out, "diffsynth_bytes", result, to_markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
