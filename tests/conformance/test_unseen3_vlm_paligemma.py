"""Conformance: PaliGemma fine-tuning as transformers' PaliGemma recipe does it.

``PaliGemmaForConditionalGeneration`` (transformers ``models/paligemma/modeling_paligemma.py``)
with ``model.vision_tower`` and ``model.multi_modal_projector`` frozen (the PaliGemma
fine-tuning notebook's ``requires_grad = False`` loops) and the Gemma language model trained in
full, the loss ``model(**batch).loss`` as ``Trainer.compute_loss`` takes it. The batch is the
notebook's ``collate_fn``: ``PaliGemmaProcessor(text=prefixes, images=images,
suffix=suffixes, padding="longest")``, which puts 16 ``<image>`` tokens and ``<bos>`` before
each prefix, appends the suffix and ``<eos>``, returns ``token_type_ids`` (0 on the prefix, 1 on
the suffix) and ``labels`` (-100 wherever ``token_type_ids`` is 0: image, prefix, padding).

During training the prefix is attended bidirectionally: the model builds its mask with
``block_sequence_ids = torch.where(token_type_ids == 0, 0, -1)``. The whole step traces: the
SigLIP tower and the projector run in stage 1 and their output (16 features per image) is
cached with the prefix mask's comparison; stage 2 holds the trainable Gemma only. Tiny configs
from transformers' own ``test_modeling_paligemma.py`` (the image 16 px with 4 px patches, so 16
image tokens instead of 225; dropout 0, as the released checkpoints), random weights.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphsplit
from tests.conformance.test_unseen_lm import assert_trains_from_its_cache
from tests.conformance.unseen3_vlm_checks import images, stage2_params, tiny_tokenizer
from tests.helpers import split_and_verify

transformers = pytest.importorskip("transformers")

IMAGE_TOKEN = 2  # "<image>", after <pad> and <unk>
FIELDS = ("input_ids", "token_type_ids", "attention_mask", "pixel_values", "labels")
PREFIXES = ["answer en what is this", "describe", "answer en what is the cat on", "describe it"]
SUFFIXES = ["a cat", "a red dog on the mat and a big cat", "the mat", "two small dogs"]


def _processor() -> transformers.PaliGemmaProcessor:
    tokenizer = tiny_tokenizer(["<image>", "<bos>", "<eos>"], bos_token="<bos>", eos_token="<eos>")
    image_processor = transformers.SiglipImageProcessorPil(size={"height": 16, "width": 16})
    image_processor.image_seq_length = 16  # (16 // 4) ** 2, as the hub's preprocessor config
    return transformers.PaliGemmaProcessor(image_processor, tokenizer)


PROCESSOR = _processor()


def _batch(size: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """The notebook's ``collate_fn``: prefixes and suffixes of different lengths, padded."""
    rows = [(seed + index) % len(PREFIXES) for index in range(size)]
    batch = PROCESSOR(
        text=["<image>" + PREFIXES[row] for row in rows],
        images=images([(20 + 4 * row, 30) for row in rows], seed=seed),
        suffix=[SUFFIXES[row] for row in rows],
        return_tensors="pt",
        padding="longest",
    )
    return tuple(batch[field] for field in FIELDS)


def _config() -> transformers.PaliGemmaConfig:
    return transformers.PaliGemmaConfig(
        text_config={
            "model_type": "gemma",
            "vocab_size": 99,
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "intermediate_size": 37,
            "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": 512,
            "pad_token_id": 0,
        },
        vision_config={
            "image_size": 16,
            "patch_size": 4,
            "num_image_tokens": 16,
            "hidden_size": 32,
            "projection_dim": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 37,
            "dropout": 0.0,
            "attention_dropout": 0.0,
        },
        image_token_index=IMAGE_TOKEN,
        projection_dim=32,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
    )


class PaliGemmaFineTuning(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = transformers.PaliGemmaForConditionalGeneration(_config())
        for param in self.model.model.vision_tower.parameters():
            param.requires_grad = False
        for param in self.model.model.multi_modal_projector.parameters():
            param.requires_grad = False

    def forward(self, input_ids, token_type_ids, attention_mask, pixel_values, labels):
        batch = {
            "input_ids": input_ids,
            "token_type_ids": token_type_ids,
            "attention_mask": attention_mask,
            "pixel_values": pixel_values,
            "labels": labels,
        }
        return self.model(**batch).loss


def test_the_collated_batch_is_the_processors_layout():
    ids, types, mask, pixels, labels = _batch(2)
    assert pixels.shape == (2, 3, 16, 16)
    assert (ids[:, :16] == IMAGE_TOKEN).all() and (types[:, :16] == 0).all()
    assert torch.equal(labels != -100, (types == 1) & (mask == 1))  # the suffix only
    assert (mask == 0).any()  # padded to the longest


@pytest.mark.parametrize("size", [1, 2, 3])
def test_the_siglip_tower_and_projector_are_cached_under_a_trained_gemma(size, tmp_path):
    torch.manual_seed(0)
    step = PaliGemmaFineTuning().train()
    example = _batch(size)
    split = split_and_verify(step, example)
    assert split.path == "trace"
    # The projected image features (16 per image) cross, with the prefix mask's comparison
    # (token_type_ids == 0); the pixels do not.
    cached = {key: spec.shape[1:] for key, spec in split.boundary.items()}
    assert cached.pop("model_model_multi_modal_projector") == (16, 32)
    assert "pixel_values" not in cached
    assert "modeling_paligemma.py" in split.boundary["eq_2"].source
    frozen = {n for n, p in step.named_parameters() if not p.requires_grad}
    assert frozen and not frozen & stage2_params(split)
    assert stage2_params(split) == {n for n, p in step.named_parameters() if p.requires_grad}
    other = _batch(size, seed=1)  # other pixels, prefixes, suffixes and padding
    assert all(c.ok for c in graphsplit.verify(step, split, other))
    assert_trains_from_its_cache(step, split, [example, other], tmp_path / "c")
