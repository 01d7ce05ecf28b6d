"""Conformance: ``examples/amused/train_amused.py``'s training step (masked token modelling).

aMUSEd trains a ``UVit2DModel`` to predict masked VQ tokens: under ``torch.no_grad()`` the
loop body encodes the pixels with the frozen VQ-GAN and takes the code indices
(``vq_model.quantize(...)[2][2]``, an ``argmin``: integers), splits the encode into chunks
(``math.ceil(batch_size / split_batch_size)`` Python iterations: one at the default
``--split_vae_encode``; with a smaller value the script's own ``reshape(bs, -1)`` of each chunk
by the whole batch size fails eagerly, so only the default is tested), draws a masking rate per
image (``cos`` schedule) and a random permutation per row (``rand(...).argsort``), replaces
the masked tokens with ``mask_id`` and labels the rest ``-100``; the frozen CLIP text encoder
(with projection) gives the penultimate hidden states and the pooled embedding; the loss is
the cross entropy over the codebook. The configs are diffusers' own tiny aMUSEd test configs.

Stage 1 must hold the VQ-GAN (its integer codes are cached) and the text encoder; the
masking draws stay in stage 2 every step. ``--cond_dropout_prob`` is left at its default 0:
above it the script reads the *previous* step's ``encoder_hidden_states`` (asserting it is
not None on the first), which no single step can reproduce.
"""

from __future__ import annotations

import math
import types
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import default_collate

import graphsplit
from tests.helpers import split_and_verify

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

from tests.conformance.unseen2_checks import assert_trains_from_its_cache  # noqa: E402
from tests.conformance.unseen_checks import (  # noqa: E402
    assert_cache_round_trip,
    stage2_top_modules,
)


def encode_prompt(text_encoder, input_ids):
    """The script's, verbatim."""
    outputs = text_encoder(input_ids, return_dict=True, output_hidden_states=True)
    encoder_hidden_states = outputs.hidden_states[-2]
    cond_embeds = outputs[0]
    return encoder_hidden_states, cond_embeds


def build(*, split_vae_encode=None, train_text_encoder: bool = False):
    """``main()``'s models (diffusers' tiny aMUSEd test configs) and the loop body."""
    torch.manual_seed(0)
    model = diffusers.UVit2DModel(
        hidden_size=8,
        use_bias=False,
        hidden_dropout=0.0,
        cond_embed_dim=8,
        micro_cond_encode_dim=2,
        micro_cond_embed_dim=10,
        encoder_hidden_size=8,
        vocab_size=33,  # the codebook and the mask token
        codebook_size=32,
        in_channels=8,
        block_out_channels=8,
        num_res_blocks=1,
        downsample=True,
        upsample=True,
        block_num_heads=1,
        num_hidden_layers=1,
        num_attention_heads=1,
        attention_dropout=0.0,
        intermediate_size=8,
        layer_norm_eps=1e-06,
        ln_elementwise_affine=True,
    )
    vq_model = diffusers.VQModel(
        act_fn="silu",
        block_out_channels=[8],
        down_block_types=["DownEncoderBlock2D"],
        in_channels=3,
        latent_channels=8,
        layers_per_block=1,
        norm_num_groups=8,
        num_vq_embeddings=32,
        out_channels=3,
        sample_size=8,
        up_block_types=["UpDecoderBlock2D"],
        mid_block_add_attention=False,
        lookup_from_codebook=True,
    )
    text_encoder = transformers.CLIPTextModelWithProjection(
        transformers.CLIPTextConfig(
            bos_token_id=0,
            eos_token_id=2,
            hidden_size=8,
            intermediate_size=8,
            layer_norm_eps=1e-05,
            num_attention_heads=1,
            num_hidden_layers=2,
            pad_token_id=1,
            vocab_size=40,
            projection_dim=8,
        )
    )
    args = types.SimpleNamespace(
        split_vae_encode=split_vae_encode,
        min_masking_rate=0.0,
        cond_dropout_prob=0.0,
        resolution=8,
        train_text_encoder=train_text_encoder,
    )
    if args.train_text_encoder:
        text_encoder.train()
        text_encoder.requires_grad_(True)
    else:
        text_encoder.eval()
        text_encoder.requires_grad_(False)
    vq_model.requires_grad_(False)
    vq_model.eval()  # as from_pretrained returns it
    model.train()
    accelerator = types.SimpleNamespace(device=torch.device("cpu"), unwrap_model=lambda m: m)
    encoder_hidden_states = cond_embeds = empty_embeds = empty_clip_embeds = None

    def training_step(batch):
        nonlocal encoder_hidden_states, cond_embeds
        with torch.no_grad():
            micro_conds = batch["micro_conds"].to(accelerator.device, non_blocking=True)
            pixel_values = batch["image"].to(accelerator.device, non_blocking=True)

            batch_size = pixel_values.shape[0]

            split_batch_size = (
                args.split_vae_encode if args.split_vae_encode is not None else batch_size
            )
            num_splits = math.ceil(batch_size / split_batch_size)
            image_tokens = []
            for i in range(num_splits):
                start_idx = i * split_batch_size
                end_idx = min((i + 1) * split_batch_size, batch_size)
                bs = pixel_values.shape[0]
                image_tokens.append(
                    vq_model.quantize(vq_model.encode(pixel_values[start_idx:end_idx]).latents)[2][
                        2
                    ].reshape(bs, -1)
                )
            image_tokens = torch.cat(image_tokens, dim=0)

            batch_size, seq_len = image_tokens.shape

            timesteps = torch.rand(batch_size, device=image_tokens.device)
            mask_prob = torch.cos(timesteps * math.pi * 0.5)
            mask_prob = mask_prob.clip(args.min_masking_rate)

            num_token_masked = (seq_len * mask_prob).round().clamp(min=1)
            batch_randperm = torch.rand(batch_size, seq_len, device=image_tokens.device).argsort(
                dim=-1
            )
            mask = batch_randperm < num_token_masked.unsqueeze(-1)

            mask_id = accelerator.unwrap_model(model).config.vocab_size - 1
            input_ids = torch.where(mask, mask_id, image_tokens)
            labels = torch.where(mask, image_tokens, -100)

            if args.cond_dropout_prob > 0.0:
                assert encoder_hidden_states is not None

                batch_size = encoder_hidden_states.shape[0]

                mask = (
                    torch.zeros((batch_size, 1, 1), device=encoder_hidden_states.device)
                    .float()
                    .uniform_(0, 1)
                    < args.cond_dropout_prob
                )

                empty_embeds_ = empty_embeds.expand(batch_size, -1, -1)
                encoder_hidden_states = torch.where(
                    (encoder_hidden_states * mask).bool(), encoder_hidden_states, empty_embeds_
                )

                empty_clip_embeds_ = empty_clip_embeds.expand(batch_size, -1)
                cond_embeds = torch.where(
                    (cond_embeds * mask.squeeze(-1)).bool(), cond_embeds, empty_clip_embeds_
                )

            bs = input_ids.shape[0]
            vae_scale_factor = 2 ** (len(vq_model.config.block_out_channels) - 1)
            resolution = args.resolution // vae_scale_factor
            input_ids = input_ids.reshape(bs, resolution, resolution)

        if "prompt_input_ids" in batch:
            with nullcontext() if args.train_text_encoder else torch.no_grad():
                encoder_hidden_states, cond_embeds = encode_prompt(
                    text_encoder,
                    batch["prompt_input_ids"].to(accelerator.device, non_blocking=True),
                )

        # Train Step
        codebook_size = accelerator.unwrap_model(model).config.codebook_size

        logits = (
            model(
                input_ids=input_ids,
                encoder_hidden_states=encoder_hidden_states,
                micro_conds=micro_conds,
                pooled_text_emb=cond_embeds,
            )
            .reshape(bs, codebook_size, -1)
            .permute(0, 2, 1)
            .reshape(-1, codebook_size)
        )

        loss = F.cross_entropy(
            logits,
            labels.view(-1),
            ignore_index=-100,
            reduction="mean",
        )
        return loss

    return types.SimpleNamespace(step=training_step, model=model, text_encoder=text_encoder)


def _example(index: int) -> dict:
    """``process_image`` and ``tokenize_prompt``: the image in [0, 1], the micro-conditions
    (original size, crop corner, aesthetic score 6), 77 prompt ids."""
    generator = torch.Generator().manual_seed(900 + index)
    ids = torch.ones(77, dtype=torch.long)  # pad_token_id
    words = torch.randint(3, 40, (4 + index % 3,), generator=generator)
    ids[0], ids[1 : 1 + len(words)], ids[1 + len(words)] = 0, words, 2
    return {
        "image": torch.rand(3, 8, 8, generator=generator),
        "micro_conds": torch.tensor([12.0 + index, 10.0, index % 3, 1.0, 6.0]),
        "prompt_input_ids": ids,
    }


def _batch(indices) -> dict:
    return default_collate([_example(i) for i in indices])


@pytest.mark.parametrize("size", [1, 2, 3])
def test_amused_caches_the_vq_codes_and_the_text_encoder(size):
    parts = build()
    split = split_and_verify(parts.step, (_batch(range(size)),))
    assert stage2_top_modules(split) == {"model"}  # no VQ-GAN, no codebook, no text encoder
    # The VQ-GAN's integer codes (not its latents: the quantizer's batch-mean loss, which the
    # step never reads, must not pull them onto the boundary), CLIP's penultimate states and
    # pooled embedding, and the micro-conditions.
    assert {(spec.dtype, spec.shape[1:]) for spec in split.boundary.values()} == {
        (torch.int64, (64,)),
        (torch.float32, (77, 8)),
        (torch.float32, (8,)),
        (torch.float32, (5,)),
    }
    assert len(split.boundary) == 4


def test_amused_trains_from_its_cache(tmp_path):
    parts = build()
    split = graphsplit.split(parts.step, (_batch([0, 1]),))
    params = [p for p in parts.model.parameters() if p.requires_grad]
    batches = [_batch([2, 3]), _batch([4, 5, 6])]
    assert_trains_from_its_cache(split, parts.step, batches, tmp_path, params)


def test_amused_cache_round_trip(tmp_path):
    parts = build()
    split = graphsplit.split(parts.step, (_batch([0, 1]),))
    batches = [_batch([2 * k, 2 * k + 1]) for k in range(3)]
    assert_cache_round_trip(split, parts.step, batches, tmp_path, parts.model, rows_per_batch=2)


def test_amused_with_the_text_encoder_trained_keeps_it_in_stage2():
    parts = build(train_text_encoder=True)
    split = split_and_verify(parts.step, (_batch([0, 1]),))
    assert stage2_top_modules(split) == {"model", "text_encoder"}
