"""Peak memory: the unsplit training process vs graphsplit's stage 2 vs a hand-written split.

Each variant runs in its own fresh interpreter (``--child VARIANT``) and reports its own peak
resident set size (:func:`benchmarks.common.peak_rss_bytes`: ``VmHWM`` on Linux, ``ru_maxrss``
elsewhere) after ``--steps`` training steps (forward, backward, AdamW on the trainable LoRA
weights):

- ``unsplit``: the zoo's SD LoRA step built with real weights, trained on the raw batch.
- ``graphsplit_stage2``: the same step built with ``frozen_on_meta=True`` (VAE and text encoder
  never get real weights), ``graphsplit.split(...)`` in the process, and ``split.stage2``
  trained on the boundary tensors that the parent computed with ``split.stage1`` of a real
  build and saved with ``safetensors.torch.save_file``.
- ``hand_written``: only the LoRA UNet and the scheduler are built; the denoiser-only step a
  user writes by hand trains on the same precomputed tensors (VAE distribution parameters and
  text embedding), also read from a safetensors file.
- ``baseline``: a process that only imports the same libraries (torch, diffusers,
  transformers, peft, safetensors, graphsplit). At small sizes it dominates every RSS, so the
  table also shows each variant's RSS minus the baseline: the share of weights and activations.

    python -m benchmarks.bench_memory                      # sizes heavy_frozen and small
    python -m benchmarks.bench_memory --sizes tiny --steps 1 --out /tmp/results
    python -m benchmarks.bench_memory --quick --out /tmp/results        # the same, shorter

Every child runs on ``--threads`` torch threads (default 1): each intra-op thread holds its own
allocator arenas and scratch buffers, so the thread count is part of what a peak RSS measures
and is kept the same for every variant.

Peak RSS moves a little from one process to the next (allocator arenas, import order,
lazily loaded kernels), so each variant runs ``--repeats`` times (default 3), the repeats
interleaved (all variants once, then all again); the table gives medians, the ratios are
medians of same-repeat ratios, and the JSON keeps every reading with its IQR.

Writes ``memory.json`` and ``memory.md`` to ``--out`` (default ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.common import (
    ChildFailed,
    environment,
    markdown_table,
    mib,
    parser,
    peak_rss_bytes,
    reply_to_parent,
    report,
    run_child,
    spread,
    write_results,
)
from benchmarks.hand_written import build_unet, denoising_loss, example_batch, frozen_outputs

VARIANTS = ("baseline", "unsplit", "graphsplit_stage2", "hand_written")
PREPARE = "prepare"
DEFAULT_SIZES = ("heavy_frozen", "small")
SEED = 0
LEARNING_RATE = 1e-4


def _import_libraries() -> None:
    """What every variant imports, and all the baseline does."""
    import diffusers  # noqa: F401
    import peft  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import tests.zoo  # noqa: F401


# -- the child process ------------------------------------------------------------------------
def _train(loss_fn, params, steps: int) -> float:
    import torch

    optimizer = torch.optim.AdamW(params, lr=LEARNING_RATE)
    loss = torch.tensor(float("nan"))
    for index in range(steps):
        torch.manual_seed(index)
        loss = loss_fn()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return float(loss)


def run_child_variant(
    variant: str, size: str, steps: int, data: Path, threads: int = 1
) -> dict[str, Any]:
    """Run one variant in this (fresh) process; its peak RSS and what it held."""
    _import_libraries()
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
    row: dict[str, Any] = {"variant": variant, "size": size, "torch_threads": threads}
    if variant == "baseline":
        row["max_rss_mib"] = mib(peak_rss_bytes())
        return row
    import torch
    from safetensors.torch import load_file

    import graphsplit
    from tests.zoo import build_sd_lora_step

    batch = load_file(str(data / "batch.safetensors"))
    if variant == "unsplit":
        step = build_sd_lora_step(seed=SEED, size=size)
        module: torch.nn.Module = step
        loss = _train(
            lambda: step(batch["pixel_values"], batch["input_ids"]), _trainable(step), steps
        )
    elif variant == "graphsplit_stage2":
        step = build_sd_lora_step(seed=SEED, size=size, frozen_on_meta=True)
        split = graphsplit.split(step, (batch["pixel_values"], batch["input_ids"]))
        boundary = load_file(str(data / "boundary.safetensors"))
        if set(boundary) != set(split.boundary):
            raise RuntimeError(f"boundary {sorted(split.boundary)} != cached {sorted(boundary)}")
        del batch
        module = split.stage2
        loss = _train(lambda: split.stage2(**boundary), _trainable(step), steps)
    elif variant == "hand_written":
        unet, scheduler = build_unet(size, seed=SEED)
        cached = load_file(str(data / "hand_written.safetensors"))
        del batch
        module = unet
        loss = _train(lambda: denoising_loss(unet, scheduler, **cached), _trainable(unet), steps)
    else:
        raise ValueError(f"unknown variant {variant!r}")
    params = list(module.parameters())
    row["real_param_mib"] = mib(sum(p.numel() * p.element_size() for p in params if not p.is_meta))
    row["meta_param_mib"] = mib(sum(p.numel() * p.element_size() for p in params if p.is_meta))
    row["last_loss"] = loss
    row["max_rss_mib"] = mib(peak_rss_bytes())
    return row


def _trainable(module) -> list:
    return [param for param in module.parameters() if param.requires_grad]


# -- the parent process -----------------------------------------------------------------------
def prepare_data(size: str, folder: Path) -> dict[str, Any]:
    """Write the batch, stage 1's boundary and the hand-written step's inputs as safetensors."""
    import torch
    from safetensors.torch import save_file

    import graphsplit
    from tests.zoo import SD_SIZES, build_sd_lora_step

    config = SD_SIZES[size]
    pixels, ids = example_batch(size)
    step = build_sd_lora_step(seed=SEED, size=size)
    split = graphsplit.split(step, (pixels, ids))
    with torch.no_grad():
        boundary = split.stage1(pixels, ids)
    hand = frozen_outputs(step, pixels, ids)
    save_file({"pixel_values": pixels, "input_ids": ids}, str(folder / "batch.safetensors"))
    save_file(_contiguous(boundary), str(folder / "boundary.safetensors"))
    save_file(_contiguous(hand), str(folder / "hand_written.safetensors"))
    params = {
        name: mib(sum(p.numel() * p.element_size() for p in module.parameters()))
        for name, module in step.named_children()
        if next(module.parameters(), None) is not None
    }
    return {
        "batch_size": config.batch_size,
        "resolution": config.resolution,
        "boundary": {key: list(value.shape) for key, value in boundary.items()},
        "component_param_mib": params,
    }


def _contiguous(tensors: dict) -> dict:
    return {key: value.detach().contiguous() for key, value in tensors.items()}


def run_variant(
    variant: str, size: str, steps: int, data: Path, threads: int = 1
) -> dict[str, Any]:
    """Run ``--child variant`` in a fresh interpreter and read its JSON line.

    The parent stays small on purpose (it never imports torch): where the peak is read from
    ``ru_maxrss`` (not Linux), a child starts from the size of the process that forked it.
    """
    argv = ["--child", variant, "--sizes", size, "--steps", str(steps), "--data", str(data)]
    argv += ["--threads", str(threads)]
    try:
        return run_child("benchmarks.bench_memory", argv)
    except ChildFailed as failure:
        raise RuntimeError(f"{variant} ({size}) {failure}") from None


def measure(
    size: str, steps: int, jobs: int = 2, threads: int = 1, repeats: int = 1
) -> dict[str, Any]:
    """Peak RSS of each variant in ``repeats`` fresh processes each, and the ratios.

    Peak RSS is per process, so running ``jobs`` children at once does not change it.
    """
    readings: list[dict[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="graphsplit-bench-memory-") as folder:
        data = Path(folder)
        prepared = run_variant(PREPARE, size, steps, data)
        result: dict[str, Any] = {"size": size, "steps": steps, "torch_threads": threads}
        result.update(prepared)
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            for _ in range(max(1, repeats)):
                futures = {
                    v: pool.submit(run_variant, v, size, steps, data, threads) for v in VARIANTS
                }
                readings.append({variant: future.result() for variant, future in futures.items()})
    rows = readings[0]
    each = {v: [reading[v]["max_rss_mib"] for reading in readings] for v in VARIANTS}
    above_each = {
        v: [r - b for r, b in zip(each[v], each["baseline"])] for v in VARIANTS if v != "baseline"
    }
    rss = {variant: spread(values).median for variant, values in each.items()}
    above = {variant: spread(values).median for variant, values in above_each.items()}

    def same_repeat(a: list[float], b: list[float]) -> dict[str, float]:
        return spread([_ratio(x, y) for x, y in zip(a, b)]).to_json()

    ratios = {
        "stage2_over_hand_written": same_repeat(each["graphsplit_stage2"], each["hand_written"]),
        "stage2_over_unsplit": same_repeat(each["graphsplit_stage2"], each["unsplit"]),
        "above_baseline_stage2_over_hand_written": same_repeat(
            above_each["graphsplit_stage2"], above_each["hand_written"]
        ),
        "above_baseline_stage2_over_unsplit": same_repeat(
            above_each["graphsplit_stage2"], above_each["unsplit"]
        ),
    }
    result.update(
        repeats=len(readings),
        max_rss_mib=rss,
        max_rss_all_mib={v: {**spread(x).to_json(), "values": x} for v, x in each.items()},
        above_baseline_mib=above,
        real_param_mib={v: rows[v]["real_param_mib"] for v in VARIANTS if v != "baseline"},
        meta_param_mib={v: rows[v]["meta_param_mib"] for v in VARIANTS if v != "baseline"},
        ratios=ratios,
        **{key: value["median"] for key, value in ratios.items()},
    )
    return result


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def to_markdown(results: list[dict[str, Any]]) -> str:
    header = ["mix", "batch × px", "steps", "imports only MiB", "unsplit MiB", "stage 2 MiB",
              "hand-written MiB", "stage2 / hand (≤ 1.05)", "stage2 / unsplit",
              "above imports: unsplit / stage 2 / hand MiB", "above imports: stage2 / hand",
              "above imports: stage2 / unsplit"]  # fmt: skip
    rows = []
    for r in results:
        m, a, q = r["max_rss_mib"], r["above_baseline_mib"], r["ratios"]
        rows.append([
            r["size"], f"{r['batch_size']} × {r['resolution']}", r["steps"],
            f"{m['baseline']:.0f}", f"{m['unsplit']:.0f}", f"{m['graphsplit_stage2']:.0f}",
            f"{m['hand_written']:.0f}", _cell(q["stage2_over_hand_written"]),
            _cell(q["stage2_over_unsplit"]),
            f"{a['unsplit']:.0f} / {a['graphsplit_stage2']:.0f} / {a['hand_written']:.0f}",
            _cell(q["above_baseline_stage2_over_hand_written"]),
            _cell(q["above_baseline_stage2_over_unsplit"]),
        ])  # fmt: skip
    repeats = results[0]["repeats"] if results else 0
    return (
        f"Medians of {repeats} fresh processes per variant; ratios: median (IQR) of same-repeat "
        "ratios.\n\n" + markdown_table(header, rows, "llrrrrrrrlrr")
    )


def _cell(value: dict[str, float]) -> str:
    return f"{value['median']:.3f} ({value['q1']:.3f}–{value['q3']:.3f})"


def main(argv: list[str] | None = None) -> int:
    command = parser("bench_memory", __doc__)
    command.add_argument(
        "--sizes",
        nargs="+",
        default=list(DEFAULT_SIZES),
        help="zoo SD sizes to measure (default: heavy_frozen small)",
    )
    command.add_argument(
        "--steps", type=int, default=3, help="training steps per process (default 3)"
    )
    command.add_argument(
        "--jobs",
        type=int,
        default=2,
        help="variant processes run at once; peak RSS is per process (default 2)",
    )
    command.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads in every variant's process; 0 keeps torch's default (default: 1)",
    )
    command.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="fresh processes per variant; the table shows medians (default 3)",
    )
    command.add_argument(
        "--quick", action="store_true", help="the tiny size, one step, once: for smoke tests"
    )
    command.add_argument("--child", choices=(*VARIANTS, PREPARE), help=argparse.SUPPRESS)
    command.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    options = command.parse_args(argv)
    if options.child == PREPARE:
        reply_to_parent(prepare_data(options.sizes[0], options.data))
        return 0
    if options.child:
        reply_to_parent(
            run_child_variant(
                options.child, options.sizes[0], options.steps, options.data, options.threads
            )
        )
        return 0
    if options.quick:
        options.sizes, options.steps, options.repeats = ["tiny"], 1, 1
    results = []
    for size in options.sizes:
        result = measure(size, options.steps, options.jobs, options.threads, options.repeats)
        results.append(result)
        print(f"{size}: {json.dumps(result['max_rss_mib'])}", flush=True)
    payload = report("memory", results, environment("torch", "diffusers"))
    write_results(options.out, "memory", payload, to_markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
