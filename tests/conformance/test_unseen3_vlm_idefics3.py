"""Conformance: SmolVLM / Idefics3 SFT with TRL, the vision tower frozen, LoRA on the text model.

``Idefics3ForConditionalGeneration`` (transformers ``models/idefics3/modeling_idefics3.py``)
wrapped by peft with LoRA on the text model's projections (the SmolVLM fine-tuning recipe; the
SigLIP tower and the connector stay frozen), the fused LM head ``SFTTrainer`` patches on, and
the loss as ``SFTTrainer.compute_loss`` takes it. Batches come from the model's own processor
(``Idefics3Processor``: each image split into a grid of sub-images plus a global one, the
``<image>`` tokens expanded per sub-image, ``pixel_values`` ``(batch, images, 3, H, W)`` padded
with all-zero images, ``pixel_attention_mask``) through TRL's
``DataCollatorForVisionLanguageModeling``.

``get_image_features`` drops the padding images by a boolean index and splits the features
per sample with ``.tolist()``: frozen code that reads values. The peft model is traced into and
that function is one opaque stage-1 step (planning/opaque/). One sample per batch, it is the
sample's own, and the merged input embeddings (text, and the connector's pixel-shuffled
features scattered in) are cached: stage 2 holds no weight of the tower or the connector. At
two or three samples its rows are sub-images, not samples (4 for one image, 10 for another):
nothing of the tower can be stored per sample. The trace refuses naming the function, the
library's line and the fix (plan at batch 1), and the module-level path caches the text
embeddings and the first layer's frozen projections only; the vision tower's verdict says why.
Tiny configs from transformers' own ``test_modeling_idefics3.py`` (dropout 0, as the released
SmolVLM checkpoints), random weights.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphsplit
from tests.conformance.test_unseen_lm import assert_trains_from_its_cache
from tests.conformance.unseen3_vlm_checks import (
    images,
    random_lora_b,
    stage2_params,
    tiny_tokenizer,
)
from tests.helpers import split_and_verify

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
trl_sft = pytest.importorskip("trl.trainer.sft_trainer")
trl_utils = pytest.importorskip("trl.trainer.utils")

SPECIALS = [
    "<fake_token_around_image>",
    "<image>",
    "<global-img>",
    "<end_of_utterance>",
    *(f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)),
]
IMAGE_TOKEN = 3  # "<image>": after <pad>, <unk>, <fake_token_around_image>
FIELDS = ("input_ids", "attention_mask", "pixel_values", "pixel_attention_mask", "labels")


def _processor():
    tokenizer = tiny_tokenizer(SPECIALS)
    assert tokenizer.convert_tokens_to_ids("<image>") == IMAGE_TOKEN
    image_processor = transformers.Idefics3ImageProcessorPil(
        size={"longest_edge": 48}, max_image_size={"longest_edge": 16}, do_image_splitting=True
    )
    # image_seq_len = (16 // 4) ** 2 / scale_factor ** 2 = 4 tokens per sub-image
    return transformers.Idefics3Processor(image_processor, tokenizer, image_seq_len=4)


COLLATOR = trl_sft.DataCollatorForVisionLanguageModeling(_processor())
TEXTS = [
    "<image> what is this picture of the cat sat",
    "describe <image> it red",
    "<image> a small dog on the mat and a big cat",
]


def _batch(shapes: list[tuple[int, int]], seed: int = 0) -> tuple[torch.Tensor, ...]:
    """``SFTTrainer``'s collated batch: one image per sample, of the given (height, width)."""
    pictures = images(shapes, seed=seed)
    texts = TEXTS[seed % 3 :] + TEXTS[: seed % 3]
    examples = [{"images": [image], "text": text} for image, text in zip(pictures, texts)]
    batch = COLLATOR(examples)
    return tuple(batch[field] for field in FIELDS)


def _config() -> transformers.Idefics3Config:
    return transformers.Idefics3Config(
        use_cache=False,
        image_token_id=IMAGE_TOKEN,
        tie_word_embeddings=False,
        scale_factor=2,
        vision_config={
            "image_size": 16,
            "patch_size": 4,
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 32,
            "dropout": 0.0,
            "attention_dropout": 0.0,
        },
        text_config={
            "vocab_size": 100,
            "hidden_size": 64,
            "intermediate_size": 56,
            "num_hidden_layers": 3,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "hidden_act": "silu",
            "max_position_embeddings": 256,
            "rms_norm_eps": 1e-6,
            "pad_token_id": 0,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "tie_word_embeddings": False,
            "attention_dropout": 0.0,
        },
    )


class SmolVLMSFT(nn.Module):
    """``SFTTrainer(model, peft_config=LoraConfig(...))``: peft wraps the model, then
    ``add_fused_lm_head`` patches the base model; ``compute_loss``'s default branch."""

    def __init__(self) -> None:
        super().__init__()
        lora = peft.LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=r".*text_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)",
        )
        model = transformers.Idefics3ForConditionalGeneration(_config())
        self.model = random_lora_b(peft.get_peft_model(model, lora))
        trl_utils.add_fused_lm_head(
            self.model.get_base_model(), outputs=("log_probs", "entropy", "is_top1")
        )

    def forward(self, input_ids, attention_mask, pixel_values, pixel_attention_mask, labels):
        inputs = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "pixel_values": pixel_values,
            "pixel_attention_mask": pixel_attention_mask,
            "labels": labels,
        }
        inputs["use_cache"] = False
        outputs = self.model(**inputs, fused_lm_head=True)
        per_token_loss = -outputs.log_probs  # zero on ignored positions
        num_tokens = outputs.label_mask.sum()
        return per_token_loss.sum() / torch.as_tensor(num_tokens).clamp(min=1)


def _frozen_tower(step: SmolVLMSFT) -> set[str]:
    return {
        name
        for name, param in step.named_parameters()
        if ".vision_model." in name or ".connector." in name
    }


def test_the_collated_batch_is_the_processors_layout():
    ids, mask, pixels, pixel_mask, labels = _batch([(16, 48), (40, 40)])
    # A 1x3 grid and a 3x3 grid, each with its global image: 4 and 10 sub-images, the first
    # sample padded with 6 all-zero images; 4 <image> tokens per sub-image.
    assert pixels.shape == (2, 10, 3, 16, 16) and pixel_mask.shape == (2, 10, 16, 16)
    assert (pixels[0, 4:] == 0).all() and not (pixels[1] == 0).all(-1).all(-1).all(-1).any()
    assert (ids == IMAGE_TOKEN).sum(1).tolist() == [16, 40]
    assert torch.equal(labels == -100, mask == 0)  # TRL masks the padding only


def test_one_sample_per_batch_caches_the_merged_embeddings_past_tower_and_connector(tmp_path):
    torch.manual_seed(0)
    step = SmolVLMSFT().train()
    example = _batch([(16, 48)])
    split = split_and_verify(step, example)
    assert split.path == "trace" and split.batch_sizes == (1, 1)
    assert "Idefics3Model.get_image_features runs eagerly in stage 1" in split.report()
    assert "pixel_values = pixel_values[real_images_inds]" in split.report()
    # The LM's input: text embeddings with the 16 image features scattered in.
    assert split.boundary["masked_scatter"].shape == (1, 33, 64)
    assert not _frozen_tower(step) & stage2_params(split)
    assert any(".vision_model." in name for name in split.stage1.state_dict())
    # Other pixels and other text (another prompt length) on the same grid: the same plan.
    same_grid = _batch([(16, 48)], seed=1)
    assert same_grid[0].shape != example[0].shape
    assert all(c.ok for c in graphsplit.verify(step, split, same_grid))
    # Llama's position_ids and causal-mask indices are per-dataset constants made from the
    # prompt length, read off the merged embeddings (masked_scatter keeps the text's shape):
    # stage 2 builds them itself from the cached embeddings (planning/cut/sized_constants.py),
    # so one plan serves both lengths.
    assert len(split.plans) == 1
    assert_trains_from_its_cache(step, split, [example, same_grid], tmp_path / "c")


def test_another_grid_of_sub_images_is_refused_naming_the_size_and_the_fix():
    """A 2x3 grid (7 sub-images) under the plan made for a 1x3 grid (4): the traced code after
    ``get_image_features`` read its output's size as a number, so stage 1 refuses the batch
    rather than cache it under the wrong plan. Not a new plan: the opaque call's output shape
    is no check of the plan's signature (what a plan per grid would take). The fix: bucket the
    dataset by grid, as by resolution."""
    torch.manual_seed(0)
    step = SmolVLMSFT().train()
    split = graphsplit.split(step, _batch([(16, 48)]))
    other_grid = _batch([(16, 40)], seed=2)
    assert other_grid[2].shape[1] == 7
    with pytest.raises(graphsplit.SplitError) as refused:
        split.stage1(*other_grid)
    assert type(refused.value) is graphsplit.SplitError
    assert str(refused.value).startswith(
        "get_image_features (run eagerly by stage 1: it reads tensor values) returned a tensor "
        "of shape (7, 16, 32), but this plan was made for (4, 16, 32)"
    )
    assert "bucket the dataset by size" in str(refused.value)
    assert len(split.plans) == 1


@pytest.mark.parametrize(
    "shapes", [[(16, 48), (40, 40)], [(40, 40), (16, 48), (16, 16)]], ids=["2", "3"]
)
def test_sub_images_of_several_samples_keep_the_tower_in_stage2_naming_why(shapes, tmp_path):
    torch.manual_seed(0)
    step = SmolVLMSFT().train()
    example = _batch(shapes)
    split = split_and_verify(step, example)
    assert split.path == "calls"
    # The trace's refusal: the tower's function mixes the samples (its output holds the real
    # sub-images of the whole batch, split per sample by .tolist()), so its caller was tried,
    # and that runs the trainable LM: the reason names both, the library line, and the fix.
    assert split.reason.startswith(
        "Idefics3Model.forward reads tensor values and reads the trainable parameter "
    )
    assert (
        "It was tried as the caller of: Idefics3Model.get_image_features reads tensor values "
        f"and mixes the samples of a batch: run on the whole example batch of {len(shapes)}"
    ) in split.reason
    assert "modeling_idefics3.py" in split.reason and "self.get_image_features(" in split.reason
    assert "fix:    plan at batch 1: pass an example batch of one sample" in split.reason
    verdicts = {v.path: v for v in split.plan.verdicts if v.index == 0}
    tower = verdicts["model.base_model.model.model.vision_model"]
    assert not tower.cached
    assert "an output has no batch dimension first" in tower.line()
    assert not verdicts["model.base_model.model.model.connector"].cached
    cached = {path for path, v in verdicts.items() if v.cached}
    assert "model.base_model.model.model.text_model.embed_tokens" in cached
    assert any(".vision_model." in name for name in stage2_params(split))
    other = _batch(shapes[::-1], seed=1)  # other pixels, other grids per row, other text
    assert all(c.ok for c in graphsplit.verify(step, split, other))
    assert_trains_from_its_cache(step, split, [example, other], tmp_path / "c")
