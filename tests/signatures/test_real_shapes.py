"""Real classes over data of several shapes, as their training scripts batch it: one
``split()``, one ``cache()`` over the mixed loader, an epoch of stage 2 from
``CachedDataset.loader`` (no bucket loop of the test's), every batch's loss and trainable
gradients bit-equal to the unsplit step on the same raw rows
(:func:`tests.signatures.epoch.epoch_exact`).

- SD-1.5 LoRA (``train_text_to_image_lora.py``'s loop body) over three aspect buckets;
- SDXL LoRA over two buckets, ``add_time_ids`` per sample from the collate;
- FLUX full fine-tune (``train_dreambooth_flux.py``) over 32x32 and 32x48 images: the latent
  packing's size arithmetic is checked per plan;
- GPT-2 distillation from a frozen teacher over batches padded to their longest (a collate
  doing what ``DataCollatorWithPadding(padding="longest")`` does);
- DPO with a frozen reference model over preference pairs padded to the pair batch's longest.

The steps are the conformance matrix's (tests/conformance), built at tiny size.
"""

from __future__ import annotations

import pytest
import torch

import graphsplit
from tests.signatures.epoch import epoch_exact

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tests.conformance.matrix import ids_and_mask  # noqa: E402
from tests.conformance.test_flux import FluxFineTuneStep  # noqa: E402
from tests.conformance.test_sd import SDXLLoRAStep, TextToImageLoRAStep  # noqa: E402
from tests.conformance.test_transformers import (  # noqa: E402
    VOCAB,
    DirectPreference,
    DistillFromFrozenTeacher,
    _gpt2,
)
from tests.zoo import tokenize  # noqa: E402


def _pixels(size: int, height: int, width: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(size, 3, height, width, generator=generator) * 2 - 1


def _captions(size: int, seed: int) -> torch.Tensor:
    return torch.stack([tokenize(f"a red circle number {seed} {i}") for i in range(size)])


# -- diffusers -------------------------------------------------------------------------------
def test_sd15_lora_over_three_aspect_buckets_trains_exactly_from_one_cache(tmp_path):
    torch.manual_seed(0)
    step = TextToImageLoRAStep()
    split = graphsplit.split(step, (_pixels(2, 32, 32, 0), _captions(2, 0)))
    sizes = [(32, 32), (32, 48), (48, 32)]  # a batch of each bucket (aspect ratio)
    batches = [
        {"pixel_values": _pixels(2, h, w, seed), "input_ids": _captions(2, seed)}
        for seed, (h, w) in enumerate(sizes, start=1)
    ]
    result = epoch_exact(step, split, batches, tmp_path / "cache", batch_size=2)
    assert {shape["pixel_values"][2:] for shape in result.shapes} == set(sizes)
    assert len(result.cached.buckets()) == 3
    assert len(split.plans) == 1  # the sizes flow through torch ops: one plan serves all


def _time_ids(step: SDXLLoRAStep, size: int, seed: int) -> torch.Tensor:
    original = [(40 + 8 * i + seed, 48) for i in range(size)]
    crops = [(4 * i, 0) for i in range(size)]
    return torch.cat([step.compute_time_ids(s, c) for s, c in zip(original, crops, strict=True)])


def test_sdxl_lora_over_two_buckets_trains_exactly_from_one_cache(tmp_path):
    torch.manual_seed(0)
    step = SDXLLoRAStep(time_ids_in_collate=True)  # original_sizes / crop_top_lefts: None

    def batch(seed: int, height: int, width: int) -> dict[str, torch.Tensor]:
        ids = _captions(2, seed)
        return {
            "pixel_values": _pixels(2, height, width, seed),
            "input_ids_one": ids,
            "input_ids_two": ids.flip(1),
            "add_time_ids": _time_ids(step, 2, seed),
        }

    split = graphsplit.split(step, kwargs=batch(0, 32, 32))
    batches = [batch(seed, 32, w) for seed, w in enumerate((32, 48, 48, 32), start=1)]
    result = epoch_exact(step, split, batches, tmp_path / "cache", batch_size=2)
    assert {shape["pixel_values"][3] for shape in result.shapes} == {32, 48}


def test_flux_over_32x32_and_32x48_trains_exactly_from_one_cache(tmp_path):
    torch.manual_seed(0)
    step = FluxFineTuneStep(sigmas_by_index=True)  # prompts: None, as the batches carry none

    def batch(seed: int, width: int) -> dict[str, torch.Tensor]:
        tokens_one, _ = ids_and_mask(2, vocab=VOCAB, seed=seed)
        tokens_two, _ = ids_and_mask(2, vocab=VOCAB, seed=seed + 50)
        return {
            "pixel_values": _pixels(2, 32, width, seed),
            "tokens_one": tokens_one,
            "tokens_two": tokens_two,
        }

    split = graphsplit.split(step, kwargs=batch(0, 32))
    batches = [batch(seed, w) for seed, w in enumerate((32, 48, 48, 32), start=1)]
    result = epoch_exact(step, split, batches, tmp_path / "cache", batch_size=2)
    assert {shape["pixel_values"][3] for shape in result.shapes} == {32, 48}
    # The unpacking's int(width) stays traced (planning/tracing/int_calls.py): the plan holds
    # no size, so one plan trains both widths and the cache records no plan table.
    assert len(split.plans) == 1 and result.cached.manifest.plans is None
    assert split.plans[0].signature.as_dict() == {}


# -- transformers ----------------------------------------------------------------------------
def _padded_to_longest(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``DataCollatorWithPadding(padding="longest")`` makes of samples of these lengths:
    right padding (id 0, mask 0) to the batch's longest."""
    generator = torch.Generator().manual_seed(seed)
    longest = max(lengths)
    ids = torch.zeros(len(lengths), longest, dtype=torch.long)
    mask = torch.zeros(len(lengths), longest, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, :length] = torch.randint(1, VOCAB, (length,), generator=generator)
        mask[row, :length] = 1
    return ids, mask


def test_lm_distillation_over_batches_padded_to_the_longest_trains_exactly(tmp_path):
    torch.manual_seed(0)
    step = DistillFromFrozenTeacher(_gpt2(), _gpt2())
    ids, mask = _padded_to_longest([5, 7], seed=0)
    split = graphsplit.split(step, kwargs={"input_ids": ids, "attention_mask": mask})
    lengths = [[4, 6], [9, 7], [6, 3], [5, 9], [2, 6]]
    batches = []
    for seed, batch_lengths in enumerate(lengths, start=1):
        ids, mask = _padded_to_longest(batch_lengths, seed)
        batches.append({"input_ids": ids, "attention_mask": mask})
    result = epoch_exact(step, split, batches, tmp_path / "cache", batch_size=2)
    assert {shape["input_ids"][1] for shape in result.shapes} == {6, 9}


def test_dpo_reference_model_over_pairs_padded_to_the_longest_trains_exactly(tmp_path):
    torch.manual_seed(0)
    step = DirectPreference()

    def pairs(chosen: list[int], rejected: list[int], seed: int) -> dict[str, torch.Tensor]:
        longest = max(chosen + rejected)  # TRL pads chosen and rejected to one length
        ids, mask = _padded_to_longest([*chosen, *rejected, longest], seed)
        rows = len(chosen)
        return {
            "chosen_ids": ids[:rows],
            "chosen_mask": mask[:rows],
            "rejected_ids": ids[rows : 2 * rows],
            "rejected_mask": mask[rows : 2 * rows],
        }

    split = graphsplit.split(step, kwargs=pairs([5, 6], [4, 6], seed=0))
    shapes = [([5, 8], [7, 6]), ([4, 5], [6, 3]), ([8, 2], [3, 4]), ([6, 6], [5, 2])]
    batches = [pairs(c, r, seed) for seed, (c, r) in enumerate(shapes, start=1)]
    result = epoch_exact(step, split, batches, tmp_path / "cache", batch_size=2)
    assert {shape["chosen_ids"][1] for shape in result.shapes} == {6, 8}
