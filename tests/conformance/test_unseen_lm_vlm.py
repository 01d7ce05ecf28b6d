"""Conformance: Qwen2-VL with a frozen vision tower and LoRA on the language model.

The step is SFT of a Qwen2-VL as its processor lays a batch out: ``pixel_values`` holds the
patches of *every* image of the batch concatenated, ``(sum of patches, channels * patch
volume)``, and ``image_grid_thw`` says how many belong to each image; the mrope positions
come from ``get_rope_index``, a Python loop over the batch with ``.tolist()``.

The peft-wrapped model is a mixed module (frozen tower, LoRA'd LM) whose code reads tensor
values: the trace goes into it and finds ``Qwen2VLModel.get_image_features``, frozen work on
the data, as one opaque stage-1 step. With one sample per batch that step is the sample's own,
and the merged embeddings (text and image, the LM's input) are cached: the tower is stage 1's.
With several, the packed patches cannot be cut per sample (one sample's grid row against the
batch's patches fails), so the function mixes samples and its caller, which runs the trainable
LM, cannot be opaque: the trace refuses, naming both and the fix (plan at batch 1), and the
module-level path takes the step, the tower's output ``(sum of merged patches, hidden)`` having
no batch dimension first: only the text embeddings are cached there.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphsplit
from tests.conformance.test_unseen_lm import assert_trains_from_its_cache
from tests.helpers import split_and_verify

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB = 64
IMAGE, VIDEO, VISION_START, VISION_END = 60, 61, 62, 63


def _config() -> transformers.Qwen2VLConfig:
    vision = {
        "depth": 1,
        "embed_dim": 16,
        "hidden_size": 32,
        "num_heads": 2,
        "patch_size": 2,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
    }
    text = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 64,
        "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3]},
    }
    return transformers.Qwen2VLConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
    )


class VisionLanguageSFT(nn.Module):
    """The vision tower frozen (``model.visual``), LoRA on the language model's q/v."""

    def __init__(self) -> None:
        super().__init__()
        model = transformers.Qwen2VLForConditionalGeneration(_config())
        model.requires_grad_(False)
        lora = peft.LoraConfig(
            r=4, lora_alpha=4, target_modules=r".*language_model.*\.(q_proj|v_proj)"
        )
        self.model = peft.inject_adapter_in_model(lora, model)

    def forward(self, input_ids, attention_mask, pixel_values, image_grid_thw, mm_token_type_ids):
        labels = input_ids.masked_fill(mm_token_type_ids == 1, -100)
        return self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            pixel_values=pixel_values,
            image_grid_thw=image_grid_thw,
            mm_token_type_ids=mm_token_type_ids,
            labels=labels.masked_fill(attention_mask == 0, -100),
        ).loss


def _batch(size: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """One 4x4-patch image per sample (4 tokens after the 2x2 merge) inside its text."""
    generator = torch.Generator().manual_seed(seed)
    text = torch.randint(0, IMAGE - 1, (size, 6), generator=generator)
    column = torch.ones(size, 1, dtype=torch.long)
    ids = torch.cat(
        [text[:, :2], VISION_START * column, IMAGE * column.repeat(1, 4), VISION_END * column,
         text[:, 2:]],
        dim=1,
    )  # fmt: skip
    mask = torch.ones_like(ids)
    mask[0, -2:] = 0
    pixels = torch.randn(size * 16, 3 * 2 * 2 * 2, generator=generator)
    grid = torch.tensor([[1, 4, 4]] * size)
    return ids, mask, pixels, grid, (ids == IMAGE).int()


def test_packed_image_patches_keep_the_vision_tower_in_stage2_naming_why():
    torch.manual_seed(0)
    step = VisionLanguageSFT()
    batch = _batch(2)
    with torch.no_grad():
        assert torch.isfinite(step(*batch))  # the step itself runs
    split = split_and_verify(step, batch)
    # The whole-step trace refused: the tower's function mixes the packed samples, and its
    # caller runs the trainable LM; the reason names both, transformers' line and the fix.
    assert split.path == "calls"
    assert split.reason.startswith(
        "Qwen2VLModel.forward reads tensor values and reads the trainable parameter "
        "model.model.language_model."
    )
    assert (
        "It was tried as the caller of: Qwen2VLModel.get_image_features reads tensor values "
        "and mixes the samples of a batch: run on the whole example batch of 2, it fails on "
        "one sample alone (RuntimeError: "
    ) in split.reason
    assert "modeling_qwen2_vl.py" in split.reason and "self.get_image_features(" in split.reason
    assert "fix:    plan at batch 1: pass an example batch of one sample" in split.reason
    assert "device-agnostic" not in split.reason
    # The module-level path: the packed patches cannot run one sample alone, so the calls are
    # checked at the batch's own size; only the text embeddings follow their samples.
    verdicts = {(v.path, v.index): v for v in split.plan.verdicts}
    assert [call for call, v in verdicts.items() if v.cached] == [
        ("model.model.language_model.embed_tokens", 0)
    ]
    visual = verdicts[("model.model.visual", 0)]
    assert "an output has no batch dimension first" in visual.line()
    held = {name for name, _ in split.stage2.named_parameters()}
    assert any(name.startswith("model.model.visual.") for name in held)


def test_one_sample_per_batch_caches_the_merged_embeddings_past_the_tower(tmp_path):
    torch.manual_seed(0)
    step = VisionLanguageSFT()
    batch = tuple(tensor[:16] if tensor.dim() == 2 and len(tensor) == 32 else tensor[:1]
                  for tensor in _batch(2))  # fmt: skip
    split = split_and_verify(step, batch)
    assert split.path == "trace" and split.batch_sizes == (1, 1)
    assert "Qwen2VLModel.get_image_features runs eagerly in stage 1" in split.report()
    # The LM's input (text embeddings with the image features scattered in) is cached: stage 2
    # holds no weight of the tower and starts at the LoRA'd decoder.
    assert split.boundary["masked_scatter"].shape == (1, 12, 32)
    held = {name for name, _ in split.stage2.named_parameters()}
    assert not any(name.startswith("model.model.visual.") for name in held)
    assert any("lora_A" in name for name in held)
    other = _batch(2, seed=1)
    other = tuple(t[:16] if t.dim() == 2 and len(t) == 32 else t[:1] for t in other)
    assert all(c.ok for c in graphsplit.verify(step, split, other))  # other pixels and text
    assert_trains_from_its_cache(step, split, [batch, other], tmp_path / "cache")
