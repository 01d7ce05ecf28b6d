"""Conformance: BLIP-2's Q-Former training as a loop body over the processor's batch.

``Blip2ForConditionalGeneration`` (transformers ``models/blip_2/modeling_blip_2.py``) from a tiny
``Blip2Config`` (ViT 2 layers, Q-Former 2 layers, OPT 2 layers, 32 wide, 4 query tokens), with
``model.vision_model`` and ``model.language_model`` frozen (``requires_grad_(False)``) and the
Q-Former, its query tokens and ``language_projection`` trained. The step is the loop body as a
script writes it, a closure over ``model`` taking the collator's batch (a ``BatchEncoding``:
``pixel_values``, ``input_ids`` with the processor's ``num_query_tokens`` image tokens in front,
``attention_mask``, ``labels``)::

    outputs = model(pixel_values=batch["pixel_values"], input_ids=batch["input_ids"],
                    attention_mask=batch["attention_mask"], labels=batch["labels"])
    loss = outputs.loss

Two ways the frozen parts are left, both real:

- ``trainer``: ``model.train()`` on the whole model (as ``Trainer`` leaves it): OPT's and the
  ViT's dropout are live in the frozen modules (ViT's ``attention_dropout`` is 0.0 by default,
  so the vision tower draws nothing).
- ``lavis``: LAVIS' recipe, the frozen vision encoder and LM in eval mode
  (``disabled_train``): no draw in the frozen modules.

What must hold in both: the step splits exactly (loss and every trainable gradient bit for bit,
on the example and on a batch of another size), the frozen vision tower's patch states are in
the boundary and its weights are not held by stage 2, and a cache written through the disk
trains stage 2 exactly.
"""

from __future__ import annotations

import pytest
import torch

import graphsplit
from tests.conformance.matrix import ids_and_mask
from tests.helpers import assert_stage1_holds_no_trainable

transformers = pytest.importorskip("transformers")

from tests.conformance.unseen2_data_checks import assert_cache_round_trip  # noqa: E402

VOCAB = 64
IMAGE_TOKEN = VOCAB - 1
QUERIES = 4
WIDTH = 32
IMAGE = 16
PATCHES = (IMAGE // 4) ** 2 + 1  # 16 patches and [CLS]


def _model(mode: str):
    config = transformers.Blip2Config(
        vision_config={
            "hidden_size": WIDTH,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": IMAGE,
            "patch_size": 4,
        },
        qformer_config={
            "hidden_size": WIDTH,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "encoder_hidden_size": WIDTH,
            "vocab_size": VOCAB,
        },
        text_config=transformers.OPTConfig(
            vocab_size=VOCAB,
            hidden_size=WIDTH,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=32,
            word_embed_proj_dim=WIDTH,
            pad_token_id=0,
        ).to_dict(),
        num_query_tokens=QUERIES,
        image_token_index=IMAGE_TOKEN,
    )
    torch.manual_seed(0)
    model = transformers.Blip2ForConditionalGeneration(config)
    model.train()
    model.vision_model.requires_grad_(False)
    model.language_model.requires_grad_(False)
    if mode == "lavis":
        model.vision_model.eval()
        model.language_model.eval()
    return model


def build(mode: str):
    model = _model(mode)

    def training_step(batch):
        outputs = model(
            pixel_values=batch["pixel_values"],
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            labels=batch["labels"],
        )
        loss = outputs.loss
        return loss

    params = [p for p in model.parameters() if p.requires_grad]
    return model, training_step, params


def _batch(size: int, tokens: int = 6, seed: int = 0) -> transformers.BatchEncoding:
    """``Blip2Processor``'s layout: the image tokens, then the caption (right-padded);
    the collator's ``labels``: -100 over the image tokens and the padding."""
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randn(size, 3, IMAGE, IMAGE, generator=generator)
    ids, mask = ids_and_mask(size, tokens=tokens, vocab=VOCAB - 1, seed=seed, pad=2)
    image = torch.full((size, QUERIES), IMAGE_TOKEN)
    input_ids = torch.cat([image, ids], dim=1)
    attention_mask = torch.cat([torch.ones(size, QUERIES, dtype=torch.long), mask], dim=1)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :QUERIES] = -100
    return transformers.BatchEncoding(
        {
            "pixel_values": pixels,
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "labels": labels,
        }
    )


_BUILT: dict[str, tuple] = {}


def _built(mode: str):
    if mode not in _BUILT:
        model, step, params = build(mode)
        split = graphsplit.split(step, (_batch(2),))
        _BUILT[mode] = (model, step, params, split)
    return _BUILT[mode]


@pytest.mark.parametrize("mode", ["trainer", "lavis"])
def test_blip2_step_verifies_on_the_example_and_another_size(mode):
    _, step, _params, split = _built(mode)
    assert_stage1_holds_no_trainable(split)
    for seed, batch in enumerate([_batch(2), _batch(3, seed=1)]):
        checks = graphsplit.verify(step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


@pytest.mark.parametrize("mode", ["trainer", "lavis"])
def test_blip2_caches_the_frozen_vision_tower(mode):
    model, _step, _params, split = _built(mode)
    held = {name for name, _ in split.stage2.named_parameters()}
    assert not any(".vision_model." in f".{name}" for name in held), sorted(held)[:5]
    trainable = {n for n, p in split.stage2.named_parameters() if p.requires_grad}
    expected = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {name.split(".", 1)[1] for name in trainable} == expected
    assert split.path == "trace"
    per_sample = {key: spec.shape[1:] for key, spec in split.boundary.items()}
    tokens = QUERIES + 6
    # The vision tower's patch states (the Q-Former cross-attends to them), the frozen LM's
    # embedding of the tokens (the projected queries are scattered into it in stage 2), the
    # image-token mask (``input_ids == image_token_index``, unsqueezed) and the mask and labels
    # the LM reads. Neither the pixels nor the ids are needed by stage 2.
    assert per_sample == {
        "model_vision_model_last_hidden_state": (PATCHES, WIDTH),
        "model_language_model_model_decoder_embed_tokens": (tokens, WIDTH),
        "to_1": (tokens, 1),
        "attention_mask": (tokens,),
        "labels": (tokens,),
    }
    # The frozen LM runs in stage 2 (it is fed the trained queries); in train mode (the
    # Trainer's) its dropout draws stay there, in eval mode (LAVIS') there are none.
    assert any(name.startswith("model.language_model.") for name in held)
    assert ("aten.bernoulli_" in split.report()) == (mode == "trainer")


@pytest.mark.parametrize("mode", ["trainer", "lavis"])
def test_blip2_cache_round_trip(mode, tmp_path):
    _, step, params, split = _built(mode)
    loader = [_batch(2, seed=2), _batch(2, seed=3), _batch(1, seed=4)]
    assert_cache_round_trip(split, step, loader, tmp_path / "cache", params)
