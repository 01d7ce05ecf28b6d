"""DiffSynth-Studio's own steps over data of several shapes: one ``split()``, one ``cache()``
over a mixed loader, an epoch of stage 2 from ``CachedDataset.loader``, every batch bit-equal
to the unsplit step (:func:`tests.signatures.epoch.epoch_exact`).

- Wan 2.1 text-to-video LoRA (tiny) over clips of 5 and 9 frames: one plan. DiffSynth's
  noise shape ``length = (num_frames - 1) // 4 + 1`` is read off the cached latents, whose
  frame count it is, and stage 1 checks the two agree (planning/cut/number_twins.py); the
  loader batches clips of one length together.
- Qwen-Image LoRA (DiffSynth's widths, one block) over prompts of 8, 10 and 13 tokens: the plan
  holds the value ``txt_seq_lens`` read off the frozen prompt mask (``.tolist()``), so each
  prompt length gets a plan; stage 2 runs each batch on the plan its cached rows name.
- FLUX.1 LoRA (DiffSynth's widths, one block each) over 32x32 and 32x48 images: one plan, its
  latent sizes read off the cached latents as Wan's.

DiffSynth trains one sample per batch (``collate_fn=lambda x: x[0]``): so do the loaders here.
Needs ``diffsynth==2.1.12`` (skipped with the reason printed where it cannot import).
"""

from __future__ import annotations

import sys

import pytest
import torch

from examples.diffsynth.steps import DIFFSYNTH, WHY_NOT

if not DIFFSYNTH:
    print(f"tests/signatures/test_diffsynth_shapes.py skipped: {WHY_NOT}", file=sys.stderr)
    pytest.skip(WHY_NOT, allow_module_level=True)

import graphsplit
from examples.diffsynth.steps import wan_batch, wan_t2v_lora_step
from tests.signatures.epoch import epoch_exact


def _clip(seed: int, frames: int) -> dict[str, torch.Tensor]:
    batch = wan_batch(seed)
    generator = torch.Generator().manual_seed(100 + seed)
    batch["video"] = torch.rand(1, 3, frames, 32, 32, generator=generator) * 2 - 1
    return batch


def _values(split: graphsplit.Split, what: str) -> list:
    return sorted(plan.signature.as_dict()[what] for plan in split.plans)


def test_wan_over_clips_of_5_and_9_frames_trains_exactly_from_one_cache(tmp_path):
    step, example = wan_t2v_lora_step(seed=0)
    split = graphsplit.split(step, kwargs=example)
    batches = [_clip(i, frames) for i, frames in enumerate((5, 9, 9, 5, 9))]
    result = epoch_exact(step, split, batches, tmp_path / "cache", batch_size=1)
    twin = "pipe_vae.encode(video.to('cpu').to(torch.float32)).to().shape[2]"
    assert _values(split, "((video.shape[2] - 1) // 4) + 1") == [{"read off": twin}]
    assert {shape["video"][2] for shape in result.shapes} == {5, 9}
    assert result.cached.manifest.plans is None  # a cache of one plan, as it always was
    # The plans run one sample per batch (DiffSynth's): stage 2 refuses a batch of two clearly.
    batch = next(b for b in result.cached.loader(batch_size=2) if len(b["to_5"]) == 2)
    with pytest.raises(graphsplit.SplitError) as caught:
        split.stage2(**batch)
    message = str(caught.value)
    assert "stage 2 got 2 samples in 'to_5'" in message
    assert "but this plan runs one sample per batch" in message
    assert "fix:    read the cache one sample per batch: CachedDataset(path, split).loader(" in (
        message
    )


@pytest.mark.slow
def test_qwen_image_over_prompts_of_three_lengths_trains_exactly_from_one_cache(tmp_path):
    from examples.diffsynth.image_steps import qwen_image_batch, qwen_image_lora_step

    step, example = qwen_image_lora_step(seed=0)
    split = graphsplit.split(step, kwargs=example)
    batches = [
        qwen_image_batch(seed=i, prompt_tokens=tokens) for i, tokens in enumerate((8, 10, 13, 10))
    ]
    epoch_exact(step, split, batches, tmp_path / "cache", batch_size=1)
    reads = [plan.signature for plan in split.plans]
    assert all(signature.reads_values for signature in reads)
    values = sorted(str(signature) for signature in reads)
    assert [value.rsplit("= ", 1)[-1] for value in values] == ["[187]", "[189]", "[192]"]


@pytest.mark.slow
def test_flux_over_32x32_and_32x48_trains_exactly_from_one_cache(tmp_path):
    from examples.diffsynth.image_steps import flux_batch, flux_lora_step

    step, example = flux_lora_step(seed=0)
    split = graphsplit.split(step, kwargs=example)

    def image(seed: int, width: int) -> dict[str, torch.Tensor]:
        batch = flux_batch(seed)
        generator = torch.Generator().manual_seed(200 + seed)
        batch["image"] = torch.rand(1, 3, 32, width, generator=generator) * 2 - 1
        return batch

    batches = [image(i, width) for i, width in enumerate((32, 48, 48))]
    result = epoch_exact(step, split, batches, tmp_path / "cache", batch_size=1)
    assert len(split.plans) == 1
    assert {shape["image"][3] for shape in result.shapes} == {32, 48}
