"""Conformance: Gemma 3 SFT with TRL, the SigLIP tower frozen, LoRA on the language model.

``Gemma3ForConditionalGeneration`` (transformers ``models/gemma3/modeling_gemma3.py``) with
LoRA on the language model's projections, the loss ``model(**inputs).loss`` as
``Trainer.compute_loss`` takes it. Batches come from ``Gemma3Processor`` (``<start_of_image>``
expanded to ``<image_soft_token>`` times ``mm_tokens_per_image`` between the image markers,
``token_type_ids`` 1 on the image tokens, ``pixel_values`` ``(batch, 3, H, W)``) through TRL's
``DataCollatorForVisionLanguageModeling``.

During training the image tokens attend to each other bidirectionally: the model builds that
mask with transformers' ``sdpa_mask``, which ``torch.vmap``s the mask function over the batch,
heads and positions. fx cannot trace ``vmap`` (``_add_batch_dim`` refuses a Proxy), so the
whole-step trace keeps the peft-wrapped ``Gemma3Model`` whole, and with it the frozen tower:
the split is exact but caches only the inputs (the report's note says why). ``path="calls"``
caches the tower and projector per sample (the tower is batched, one image per row). ``auto``
keeps the trace that caches nothing: pinned as an expected failure below.

Tiny configs from transformers' own ``test_modeling_gemma3.py`` (16 px images with 4 px
patches pooled to 4 tokens; dropout 0), random weights.
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

BOI, EOI, IMAGE_TOKEN = 2, 3, 4  # after <pad> and <unk>
FIELDS = ("input_ids", "attention_mask", "token_type_ids", "pixel_values", "labels")
TEXTS = [
    "<start_of_image> what is this picture of the cat sat",
    "describe <start_of_image> it red",
    "<start_of_image> a small dog on the mat",
]


def _collator():
    tokenizer = tiny_tokenizer(
        ["<start_of_image>", "<end_of_image>", "<image_soft_token>", "<bos>", "<eos>"],
        bos_token="<bos>",
        eos_token="<eos>",
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    )
    image_processor = transformers.Gemma3ImageProcessorPil(size={"height": 16, "width": 16})
    processor = transformers.Gemma3Processor(image_processor, tokenizer, image_seq_length=4)
    return trl_sft.DataCollatorForVisionLanguageModeling(processor)


COLLATOR = _collator()


def _batch(shapes: list[tuple[int, int]], seed: int = 0) -> tuple[torch.Tensor, ...]:
    texts = TEXTS[seed % 3 :] + TEXTS[: seed % 3]
    examples = [{"images": [im], "text": t} for im, t in zip(images(shapes, seed=seed), texts)]
    batch = COLLATOR(examples)
    return tuple(batch[field] for field in FIELDS)


def _config() -> transformers.Gemma3Config:
    return transformers.Gemma3Config(
        text_config={
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
            "bos_token_id": 5,
            "eos_token_id": 6,
            "sliding_window": 4,
            "layer_types": ["sliding_attention", "full_attention"],
        },
        vision_config={
            "image_size": 16,
            "patch_size": 4,
            "num_channels": 3,
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 37,
            "dropout": 0.0,
            "attention_dropout": 0.0,
        },
        mm_tokens_per_image=4,
        image_token_index=IMAGE_TOKEN,
        boi_token_index=BOI,
        eoi_token_index=EOI,
    )


class Gemma3SFT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        lora = peft.LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)",
        )
        model = transformers.Gemma3ForConditionalGeneration(_config())
        self.model = random_lora_b(peft.get_peft_model(model, lora))

    def forward(self, input_ids, attention_mask, token_type_ids, pixel_values, labels):
        inputs = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "token_type_ids": token_type_ids,
            "pixel_values": pixel_values,
            "labels": labels,
        }
        return self.model(**inputs).loss


def _tower(names: set[str]) -> set[str]:
    return {n for n in names if ".vision_tower." in n or ".multi_modal_projector." in n}


def test_the_collated_batch_is_the_processors_layout():
    ids, mask, types, pixels, labels = _batch([(16, 32), (30, 30)])
    assert pixels.shape == (2, 3, 16, 16)
    assert torch.equal(types == 1, ids == IMAGE_TOKEN) and (types.sum(1) == 4).all()
    assert torch.equal(labels == -100, mask == 0)


def test_the_vmapped_bidirectional_mask_keeps_the_model_whole_in_the_trace():
    torch.manual_seed(0)
    step = Gemma3SFT().train()
    example = _batch([(16, 32), (30, 30)])
    split = split_and_verify(step, example, path="trace")
    assert set(split.boundary) == set(split.input_names)  # nothing but the inputs
    assert _tower(stage2_params(split))
    note = next(n for n in split.notes if n.startswith("kept model.base_model.model.model"))
    assert "tracing into it failed (TypeError: _add_batch_dim(): incompatible" in note
    assert note in split.report()


@pytest.mark.parametrize("shapes", [[(16, 32)], [(16, 32), (30, 30)], [(30, 30), (16, 16), (8, 8)]])
def test_the_module_level_path_caches_tower_and_projector_per_sample(shapes, tmp_path):
    torch.manual_seed(0)
    step = Gemma3SFT().train()
    example = _batch(shapes)
    split = split_and_verify(step, example, path="calls")
    verdicts = {v.path: v for v in split.plan.verdicts if v.index == 0}
    assert verdicts["model.base_model.model.model.multi_modal_projector"].cached
    assert "model_base_model_model_model_multi_modal_projector__0__out" in split.boundary
    assert not _tower(stage2_params(split))
    other = _batch(shapes[::-1], seed=1)
    assert all(c.ok for c in graphsplit.verify(step, split, other))
    assert_trains_from_its_cache(step, split, [example, other], tmp_path / "c")


def test_auto_caches_the_tower():
    """The trace keeps ``Gemma3Model`` whole (fx cannot trace its vmapped mask), so its stage 2
    would run the frozen vision tower every step; ``auto`` compares on that typed signal
    (``Plan.kept_whole``) and takes the module-level path, which caches the tower's call."""
    torch.manual_seed(0)
    step = Gemma3SFT().train()
    example = _batch([(16, 32), (30, 30)])
    split = graphsplit.split(step, example)
    assert split.path == "calls"
    assert not _tower(stage2_params(split))
    assert "kept model.base_model.model.model whole (tracing into it failed" in split.report()
    assert all(c.ok for c in graphsplit.verify(step, split, example))
