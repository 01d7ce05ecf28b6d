"""A step spec for the command line: a Stable-Diffusion LoRA step over captioned images.

From the repository root::

    graphsplit inspect examples/sd_spec.py:step --out plan/     # report, stage code, picture
    graphsplit cache examples/sd_spec.py:step --out cache/ --verify
    graphsplit check-cache cache/

The step is graphsplit's zoo step (``tests.zoo.build_sd_lora_step``: real diffusers
``AutoencoderKL`` and ``UNet2DConditionModel``, a transformers ``CLIPTextModel``, a peft LoRA
on the UNet's attention; tiny configs, random weights) and the data are procedural captioned
images, so nothing is downloaded (it needs the ``hf`` extra). For your own step, return your
module, one example batch and your data; the command line does the rest.

Data: ``dataset=`` lets the command line batch it (``--batch-size``, ``--num-workers``, the
spec's ``collate_fn``); to keep your own pipeline (bucketing sampler, custom collate), return
``loader=DataLoader(...)`` instead (not shuffled). ``storage_dtype=torch.bfloat16`` halves the
cache at a recorded rounding error; ``--storage-dtype`` overrides it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from torch.utils.data import default_collate

import graphsplit

try:
    from tests.zoo import CaptionedImages, build_sd_lora_step
except ImportError:  # run as a file by the `graphsplit` script: the zoo is in this repo's tests/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.zoo import CaptionedImages, build_sd_lora_step

BATCH_SIZE = 2
SAMPLES = 8


def step() -> graphsplit.StepSpec:
    """The LoRA step, an example batch of ``BATCH_SIZE`` and ``SAMPLES`` captioned images."""
    model = build_sd_lora_step(seed=0)  # VAE and text encoder frozen; only LoRA weights train
    dataset = CaptionedImages(length=SAMPLES, resolution=32, max_tokens=16)
    example = default_collate([dataset[i] for i in range(BATCH_SIZE)])
    return graphsplit.StepSpec(
        model,
        example_args=(example["pixel_values"], example["input_ids"]),
        dataset=dataset,  # items: {"key", "pixel_values", "input_ids"}
        collate_fn=default_collate,
        num_workers=0,
    )
