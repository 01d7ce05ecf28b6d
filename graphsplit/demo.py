"""The built-in demo: split a real (tiny, random-weight) text-to-image LoRA step and verify it.

Uses diffusers' AutoencoderKL and UNet2DConditionModel and transformers' CLIPTextModel from
small configs, so it runs on a laptop CPU with nothing downloaded.
"""

from __future__ import annotations

import time

import torch

import graphsplit


def run_demo(*, batch_size: int = 2, resolution: int = 32) -> int:
    """Print the split report, then check stage 2 reproduces the step bit for bit."""
    from graphsplit.zoo import CaptionedImages, build_sd_lora_step

    step = build_sd_lora_step(seed=0)
    dataset = CaptionedImages(length=batch_size, resolution=resolution, seed=0)
    items = [dataset[index] for index in range(batch_size)]
    pixels = torch.stack([item["pixel_values"] for item in items])
    input_ids = torch.stack([item["input_ids"] for item in items])
    started = time.perf_counter()
    split = graphsplit.split(step, (pixels, input_ids))
    elapsed = time.perf_counter() - started
    print(split.report())
    print(f"\nsplit() took {elapsed:.2f} s")
    comparisons = graphsplit.verify(step, split, (pixels, input_ids), seed=0)
    print(f"verify(): loss and {len(comparisons) - 1} LoRA gradients equal bit for bit")
    return 0
