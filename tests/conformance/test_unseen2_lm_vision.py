"""Conformance: BLIP-2 stage-1 style training with the vision tower and the LM frozen.

``Blip2ForConditionalGeneration`` (transformers ``models/blip_2/modeling_blip_2.py``) as the
Trainer calls it (``model(**batch).loss``), with ``model.vision_model`` and
``model.language_model`` frozen and the Q-Former, its query tokens and the language projection
trained (BLIP-2's recipe). The processor puts ``num_query_tokens`` image tokens at the front of
``input_ids``; the model ``masked_scatter``s the projected queries into the frozen LM's
embeddings. The frozen vision tower's output is what is cached; the Q-Former, which
cross-attends to it, and the whole frozen LM behind it (fed trained queries) run in stage 2.
Tiny configs, random weights.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.conformance.matrix import ids_and_mask
from tests.conformance.test_unseen_lm import assert_trains_from_its_cache, stage2_paths
from tests.helpers import split_and_verify

transformers = pytest.importorskip("transformers")

VOCAB = 64
IMAGE_TOKEN = VOCAB - 1
QUERIES = 4
WIDTH = 32


def _blip2() -> nn.Module:
    config = transformers.Blip2Config(
        vision_config={
            "hidden_size": WIDTH,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 16,
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
    model = transformers.Blip2ForConditionalGeneration(config).train()
    model.vision_model.requires_grad_(False)
    model.language_model.requires_grad_(False)
    return model


class Blip2QFormerTraining(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = _blip2()

    def forward(self, pixel_values, input_ids, attention_mask, labels):
        return self.model(
            pixel_values=pixel_values,
            input_ids=input_ids,
            attention_mask=attention_mask,
            labels=labels,
        ).loss


def _batch(size: int, tokens: int = 6, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """``Blip2Processor``'s layout: the image tokens, then the caption (right-padded);
    ``labels`` -100 over the image tokens and the padding."""
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randn(size, 3, 16, 16, generator=generator)
    ids, mask = ids_and_mask(size, tokens=tokens, vocab=VOCAB - 1, seed=seed, pad=2)
    image = torch.full((size, QUERIES), IMAGE_TOKEN)
    input_ids = torch.cat([image, ids], dim=1)
    attention_mask = torch.cat([torch.ones(size, QUERIES, dtype=torch.long), mask], dim=1)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :QUERIES] = -100
    return pixels, input_ids, attention_mask, labels


@pytest.mark.parametrize("size", [1, 2, 3])
def test_blip2_caches_the_frozen_vision_tower_under_a_trained_qformer(size, tmp_path):
    torch.manual_seed(0)
    step = Blip2QFormerTraining()
    batch = _batch(size)
    split = split_and_verify(step, batch)
    held = stage2_paths(split)
    assert {"model.qformer", "model.language_projection", "model.language_model"} <= held
    assert not {path for path in held if path.startswith("model.vision_model")}
    cached = {key: spec.shape[1:] for key, spec in split.boundary.items()}  # per sample
    # The vision tower's patch states (16 patches and [CLS]) the Q-Former cross-attends to,
    # the LM's frozen embedding of the tokens (the queries are scattered into it in stage 2)
    # and the image-token mask; the raw pixels are not needed any more.
    assert cached.pop("model_vision_model_last_hidden_state") == (17, WIDTH)
    assert cached.pop("model_language_model_model_decoder_embed_tokens") == (10, WIDTH)
    assert "pixel_values" not in cached and "input_ids" not in cached
    # OPT's dropout is live (the frozen LM is left in train mode, as the Trainer leaves it):
    # its draws stay in stage 2, so the LM cannot be cached past its embedding.
    assert "aten.bernoulli_" in split.report()
    assert_trains_from_its_cache(step, split, [batch, _batch(size, seed=1)], tmp_path / "c")
