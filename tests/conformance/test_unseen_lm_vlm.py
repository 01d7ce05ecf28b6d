"""Conformance: Qwen2-VL with a frozen vision tower and LoRA on the language model: refused.

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

The test pins that the refusal names the user's line, both paths' reasons and a fix, rather
than caching anything wrong.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphsplit
from tests.helpers import line_of

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


def test_packed_image_patches_are_refused_naming_the_line_and_both_paths():
    torch.manual_seed(0)
    step = VisionLanguageSFT()
    batch = _batch(2)
    with torch.no_grad():
        assert torch.isfinite(step(*batch))  # the step itself runs
    with pytest.raises(graphsplit.GraphsplitError) as caught:
        graphsplit.split(step, batch)
    trace_refusal = str(caught.value)
    assert line_of(VisionLanguageSFT.forward, "return self.model(") in trace_refusal
    # The whole-step trace: a value read inside the model, typed as one, naming the library's
    # line (transformers' own .tolist() of the image grid), not "make the step device-agnostic".
    assert "The step reads the value of a tensor (Tensor.tolist() reads" in trace_refusal
    read_at = trace_refusal.split("reads the tensor's values, at ", 1)[1].split("\n")[0]
    assert "transformers" in read_at and "tolist()" in read_at
    assert "device-agnostic" not in trace_refusal
    assert "fix:" in trace_refusal
    # The note says the module-level path refused too; its own error (the cause, printed
    # with the traceback) gives each frozen call's reason and its fix.
    (note,) = caught.value.__notes__
    assert 'module-level path (path="calls"), which refused too' in note
    calls_refusal = str(caught.value.__cause__)
    assert "model.model.visual call 0" in calls_refusal
    assert "an output has no batch dimension first" in calls_refusal
    assert "fix:" in calls_refusal
