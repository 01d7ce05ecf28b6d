"""Conformance: Qwen2-VL with a frozen vision tower and LoRA on the language model.

The step is SFT of a Qwen2-VL as its processor lays a batch out: ``pixel_values`` holds the
patches of *every* image of the batch concatenated, ``(sum of patches, channels * patch
volume)``, and ``image_grid_thw`` says how many belong to each image; the mrope positions
come from ``get_rope_index``, a Python loop over the batch with ``.tolist()``. Neither path can
cache the vision tower per sample:

- the whole-step trace cannot run the model's mixed call on values-free tensors (``tolist()``
  reads values);
- the module-level path finds the tower's output, ``(sum of merged patches, hidden)``, has no
  batch dimension first: a row of it is a patch, not a sample, so it cannot be stored per
  sample.

The step cannot run one sample alone either (the packed patches are not cut per sample), so
the module-level path checks its calls at the batch's own size, its samples reordered: only the
text embeddings are cached. The test pins that the trace's refusal names the user's line, the
tower's verdict says why it stays in stage 2, and the split is exact.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import line_of, split_and_verify

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


def _batch(size: int) -> tuple[torch.Tensor, ...]:
    """One 4x4-patch image per sample (4 tokens after the 2x2 merge) inside its text."""
    generator = torch.Generator().manual_seed(0)
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
    # The whole-step trace refused: a value read inside the model, at the user's line.
    assert split.path == "calls"
    assert line_of(VisionLanguageSFT.forward, "return self.model(") in split.reason
    # A value read inside the model, typed as one, naming the library's line (transformers'
    # own .tolist() of the image grid), not "make the step device-agnostic".
    assert "The step reads the value of a tensor (Tensor.tolist() reads" in split.reason
    read_at = split.reason.split("reads the tensor's values, at ", 1)[1].split("\n")[0]
    assert "transformers" in read_at and "tolist()" in read_at
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
