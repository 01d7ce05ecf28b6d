"""Conformance: Mllama (Llama 3.2 Vision) SFT with TRL, the vision tower frozen.

``MllamaForConditionalGeneration`` (transformers ``models/mllama/modeling_mllama.py``) with
LoRA on the language model's self- and cross-attention projections (the tower and the
projector frozen by peft), the loss ``model(**inputs).loss`` as ``Trainer.compute_loss`` takes
it. Batches come from ``MllamaProcessor`` (each image resized to the best tile grid, cut into
16 px tiles, ``pixel_values`` ``(batch, images, max tiles, 3, 16, 16)`` with
``aspect_ratio_ids``, ``aspect_ratio_mask`` and ``cross_attention_mask`` ``(batch, tokens,
images, tiles)``) through TRL's ``DataCollatorForVisionLanguageModeling``.

Unlike the models that scatter image features into the text, Mllama's language model reads the
tower's output through cross-attention layers, and the tower keeps one row per sample (tiles
are padded, not packed): the whole step traces, and the projected vision states (``(images,
tiles, patches + 1, hidden)`` per sample) are cached; the LoRA'd cross-attention reads them in
stage 2. Stage 1 checks the processor's shapes before the tower runs (``cross_attention_mask``
against ``input_ids``): the check's generated code once read its line table before fetching
it (planning/rules/size_guards.py). Tiny configs from transformers' own
``test_modeling_mllama.py`` (16 px tiles with 4 px patches, a cross-attention layer at 1, one
global vision layer; dropout 0), random weights.
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

IMAGE_TOKEN = 2  # "<|image|>", after <pad> and <unk>
FIELDS = (
    "input_ids",
    "attention_mask",
    "cross_attention_mask",
    "pixel_values",
    "aspect_ratio_ids",
    "aspect_ratio_mask",
    "labels",
)
TEXTS = [
    "<|image|> what is this picture of the cat sat",
    "<|image|> describe it red",
    "<|image|> a small dog on the mat",
]


def _collator():
    tokenizer = tiny_tokenizer(
        ["<|image|>", "<|begin_of_text|>", "<|eot_id|>"],
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
    )
    image_processor = transformers.MllamaImageProcessorPil(
        size={"height": 16, "width": 16}, max_image_tiles=4
    )
    processor = transformers.MllamaProcessor(image_processor, tokenizer)
    return trl_sft.DataCollatorForVisionLanguageModeling(processor)


COLLATOR = _collator()


def _batch(shapes: list[tuple[int, int]], seed: int = 0) -> tuple[torch.Tensor, ...]:
    texts = TEXTS[seed % 3 :] + TEXTS[: seed % 3]
    examples = [{"images": [im], "text": t} for im, t in zip(images(shapes, seed=seed), texts)]
    batch = COLLATOR(examples)
    return tuple(batch[field] for field in FIELDS)


def _config() -> transformers.MllamaConfig:
    return transformers.MllamaConfig(
        text_config={
            "vocab_size": 99,
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "intermediate_size": 37,
            "hidden_act": "gelu",
            "max_position_embeddings": 512,
            "pad_token_id": 0,
            "rope_scaling": {"rope_type": "default"},
            "bos_token_id": 3,
            "eos_token_id": 4,
            "cross_attention_layers": [1],
        },
        vision_config={
            "image_size": 16,
            "patch_size": 4,
            "num_channels": 3,
            "hidden_size": 16,
            "intermediate_layers_indices": [0],
            "vision_output_dim": 32,
            "num_hidden_layers": 2,
            "num_global_layers": 1,
            "num_attention_heads": 4,
            "intermediate_size": 37,
            "max_num_tiles": 4,
        },
        image_token_index=IMAGE_TOKEN,
    )


class MllamaSFT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        lora = peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj)"
        )
        model = transformers.MllamaForConditionalGeneration(_config())
        self.model = random_lora_b(peft.get_peft_model(model, lora))

    def forward(
        self,
        input_ids,
        attention_mask,
        cross_attention_mask,
        pixel_values,
        aspect_ratio_ids,
        aspect_ratio_mask,
        labels,
    ):
        inputs = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "cross_attention_mask": cross_attention_mask,
            "pixel_values": pixel_values,
            "aspect_ratio_ids": aspect_ratio_ids,
            "aspect_ratio_mask": aspect_ratio_mask,
            "labels": labels,
        }
        return self.model(**inputs).loss


def test_the_collated_batch_is_the_processors_layout():
    ids, mask, cross, pixels, ratio_ids, ratio_mask, labels = _batch([(16, 32), (30, 30)])
    # A 1x2 tile grid (two tiles of four used) and a 2x2 grid, padded to 4 tiles.
    assert pixels.shape == (2, 1, 4, 3, 16, 16) and ratio_ids.shape == (2, 1)
    assert ratio_mask.tolist() == [[[1, 1, 0, 0]], [[1, 1, 1, 1]]]
    assert cross.shape == (2, ids.shape[1], 1, 4)
    assert torch.equal(labels == -100, mask == 0)


@pytest.mark.parametrize(
    "shapes", [[(16, 32)], [(16, 32), (30, 30)], [(30, 30), (16, 16), (32, 16)]], ids=str
)
def test_the_tower_feeding_cross_attention_is_cached_per_sample(shapes, tmp_path):
    torch.manual_seed(0)
    step = MllamaSFT().train()
    example = _batch(shapes)
    split = split_and_verify(step, example)
    assert split.path == "trace"
    # The projected vision states the cross-attention layer reads, one row per sample.
    projected = split.boundary["model_base_model_model_model_multi_modal_projector"]
    assert projected.batch_dim == 0 and projected.shape[1:] == (1, 4, 17, 32)
    assert "pixel_values" not in split.boundary
    frozen = {n for n, p in step.named_parameters() if not p.requires_grad}
    tower = {n for n in frozen if ".vision_model." in n or ".multi_modal_projector." in n}
    assert tower and not tower & stage2_params(split)
    held = stage2_params(split)
    assert any("cross_attn.q_proj.lora_A" in name for name in held)
    other = _batch(shapes[::-1], seed=1)  # other pixels, tile grids, text and padding
    assert all(c.ok for c in graphsplit.verify(step, split, other))
    assert_trains_from_its_cache(step, split, [example, other], tmp_path / "c")
