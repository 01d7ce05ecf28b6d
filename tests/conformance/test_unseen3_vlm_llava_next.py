"""Conformance: LLaVA-NeXT SFT with TRL, the CLIP tower frozen (anyres image crops).

``LlavaNextForConditionalGeneration`` (transformers ``models/llava_next/modeling_llava_next.py``)
with LoRA on the language model, the loss ``model(**inputs).loss`` as ``Trainer.compute_loss``
takes it (``SFTTrainer``'s own fused LM head is the Idefics3 file's step). Batches come
from ``LlavaNextProcessor`` (anyres: each image is resized to the best of
``image_grid_pinpoints``, cut into 16 px crops plus the whole image,
``pixel_values`` ``(batch, max crops, 3, 16, 16)`` padded with zero crops, ``image_sizes`` per
sample, the ``<image>`` token expanded to the unpadded feature count) through TRL's
``DataCollatorForVisionLanguageModeling``.

``get_image_features`` reads ``image_sizes`` (``.tolist()``) to cut each sample's crops out of
the padded batch, runs the tower on all of them at once, and unpads each image's grid:

- LoRA only (tower, projector and ``image_newline`` frozen, TRL's ``peft_config`` default): one
  sample per batch, the whole function is one opaque stage-1 step and the merged embeddings are
  cached; at two samples its rows are the batch's crops (3 and 5), not samples, and the trace
  refuses naming it and the fix (plan at batch 1); the module-level path keeps the tower.
- the projector trained as well (LLaVA's own recipe): the function reads a trainable weight, so
  the read of ``image_sizes`` is answered with the example's value at batch 1 and the trace goes
  on into ``pack_image_features``, whose ``np.prod(image_feature.shape)`` NumPy cannot take
  from a traced shape: refused naming transformers' line; the module-level path runs the step,
  the tower's input being the batch's crops.

Tiny configs from transformers' own ``test_modeling_llava_next.py`` (4 px patches instead of 2,
so a crop is 16 features; dropout 0), random weights.
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

IMAGE_TOKEN = 2  # "<image>", after <pad> and <unk>
PINPOINTS = [[16, 32], [32, 16], [32, 32]]
FIELDS = ("input_ids", "attention_mask", "pixel_values", "image_sizes", "labels")
TEXTS = [
    "<image> what is this picture of the cat sat",
    "describe <image> it red",
    "<image> a small dog on the mat",
]


def _collator():
    image_processor = transformers.LlavaNextImageProcessorPil(
        size={"shortest_edge": 16},
        crop_size={"height": 16, "width": 16},
        image_grid_pinpoints=PINPOINTS,
    )
    processor = transformers.LlavaNextProcessor(
        image_processor,
        tiny_tokenizer(["<image>"]),
        patch_size=4,
        vision_feature_select_strategy="default",
        image_token="<image>",
        num_additional_image_tokens=1,
    )
    return trl_sft.DataCollatorForVisionLanguageModeling(processor)


COLLATOR = _collator()


def _batch(shapes: list[tuple[int, int]], seed: int = 0) -> tuple[torch.Tensor, ...]:
    texts = TEXTS[seed % 3 :] + TEXTS[: seed % 3]
    examples = [{"images": [im], "text": t} for im, t in zip(images(shapes, seed=seed), texts)]
    batch = COLLATOR(examples)
    return tuple(batch[field] for field in FIELDS)


def _config() -> transformers.LlavaNextConfig:
    return transformers.LlavaNextConfig(
        text_config={
            "model_type": "llama",
            "vocab_size": 99,
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 37,
            "hidden_act": "gelu",
            "max_position_embeddings": 580,
            "pad_token_id": 0,
        },
        vision_config={
            "image_size": 16,
            "patch_size": 4,
            "num_channels": 3,
            "hidden_size": 32,
            "projection_dim": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 37,
            "dropout": 0.0,
            "attention_dropout": 0.0,
        },
        image_token_index=IMAGE_TOKEN,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        image_grid_pinpoints=PINPOINTS,
    )


class LlavaNextSFT(nn.Module):
    def __init__(self, train_projector: bool = False) -> None:
        super().__init__()
        lora = peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj)"
        )
        model = transformers.LlavaNextForConditionalGeneration(_config())
        self.model = random_lora_b(peft.get_peft_model(model, lora))
        if train_projector:  # peft's modules_to_save, as LLaVA trains it
            self.model.base_model.model.model.multi_modal_projector.requires_grad_(True)

    def forward(self, input_ids, attention_mask, pixel_values, image_sizes, labels):
        inputs = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "pixel_values": pixel_values,
            "image_sizes": image_sizes,
            "labels": labels,
        }
        return self.model(**inputs).loss


def _tower(names: set[str]) -> set[str]:
    return {name for name in names if ".vision_tower." in name}


def test_the_collated_batch_is_the_processors_layout():
    ids, mask, pixels, sizes, labels = _batch([(16, 32), (30, 30)])
    # A 1x2 grid and a 2x2 grid, each with the whole image: 3 and 5 crops, zero-padded.
    assert pixels.shape == (2, 5, 3, 16, 16) and sizes.tolist() == [[16, 32], [30, 30]]
    assert (pixels[0, 3:] == 0).all()
    assert (ids == IMAGE_TOKEN).sum(1).tolist() == [52, 88]
    assert torch.equal(labels == -100, mask == 0)


def test_one_sample_per_batch_caches_the_merged_embeddings_past_the_tower(tmp_path):
    torch.manual_seed(0)
    step = LlavaNextSFT().train()
    example = _batch([(16, 32)])
    split = split_and_verify(step, example)
    assert split.path == "trace" and split.batch_sizes == (1, 1)
    assert "LlavaNextModel.get_image_features runs eagerly in stage 1" in split.report()
    assert split.boundary["masked_scatter"].shape == (1, 60, 32)
    frozen = {n for n, p in step.named_parameters() if not p.requires_grad}
    assert _tower(frozen) and not _tower(stage2_params(split))
    assert "model.base_model.model.model.image_newline" not in stage2_params(split)
    other = _batch([(16, 30)], seed=1)  # other pixels, the same grid, other text
    assert all(c.ok for c in graphsplit.verify(step, split, other))
    assert_trains_from_its_cache(step, split, [example, other], tmp_path / "c")


def test_crops_of_several_samples_keep_the_tower_in_stage2_naming_why(tmp_path):
    torch.manual_seed(0)
    step = LlavaNextSFT().train()
    example = _batch([(16, 32), (30, 30)])
    split = split_and_verify(step, example)
    assert split.path == "calls"
    assert split.reason.startswith(
        "LlavaNextModel.forward reads tensor values and reads the trainable parameter "
    )
    assert (
        "It was tried as the caller of: LlavaNextModel.get_image_features reads tensor values "
        "and mixes the samples of a batch: run on the whole example batch of 2"
    ) in split.reason
    assert "fix:    plan at batch 1: pass an example batch of one sample" in split.reason
    verdicts = {v.path: v for v in split.plan.verdicts if v.index == 0}
    tower = verdicts["model.base_model.model.model.vision_tower"]
    assert not tower.cached and "an output has no batch dimension first" in tower.line()
    assert verdicts["model.base_model.model.model.language_model.embed_tokens"].cached
    assert _tower(stage2_params(split))
    other = _batch([(30, 30), (32, 16)], seed=1)
    assert all(c.ok for c in graphsplit.verify(step, split, other))
    assert_trains_from_its_cache(step, split, [example, other], tmp_path / "c")


def test_a_trained_projector_meets_numpy_on_a_traced_shape_naming_transformers_line():
    torch.manual_seed(0)
    step = LlavaNextSFT(train_projector=True).train()
    example = _batch([(16, 32)])
    split = split_and_verify(step, example)
    assert split.path == "calls"
    # The image_sizes read was answered (one sample per batch), so the trace reached NumPy:
    # the line named is transformers' own, not NumPy's internals.
    assert "AttributeError: 'torch.Size' object has no attribute 'prod'" in split.reason
    assert "modeling_llava_next.py" in split.reason
    assert "np.prod(image_feature.shape)" in split.reason
    assert "numpy" not in split.reason.split("source: ", 1)[1].split("\n")[0].split(".py")[0]
    held = stage2_params(split)
    assert "model.base_model.model.model.multi_modal_projector.linear_1.weight" in held
    # At batch 1 the tower's input is the sample's 3 crops: no batch dimension first.
    verdicts = {v.path: v for v in split.plan.verdicts if v.index == 0}
    assert not verdicts["model.base_model.model.model.vision_tower"].cached
