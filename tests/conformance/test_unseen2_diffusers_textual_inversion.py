"""Conformance: ``examples/textual_inversion/textual_inversion.py``'s training step.

The script adds placeholder tokens to the tokenizer, resizes the CLIP text encoder's token
embedding and freezes everything but that embedding (``text_module.encoder``,
``final_layer_norm`` and ``position_embedding`` frozen; the VAE and UNet frozen whole). The
loop body encodes the pixels with the frozen VAE, then runs the *whole* text encoder on the
batch's ``input_ids``: its first op reads the trainable token embedding, so nothing of the text
encoder may be cached (a cached ``encoder_hidden_states`` would be stale after one optimizer
step), and the frozen UNet must stay in stage 2 too (the gradient flows through it). Only the
VAE's work can be cached. The trains-from-its-cache check moves the embedding between caching
and training, so a stale boundary fails it.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

import graphsplit
from tests.helpers import split_and_verify

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

from tests.conformance.unseen2_checks import assert_trains_from_its_cache  # noqa: E402
from tests.conformance.unseen_checks import (  # noqa: E402
    assert_cache_round_trip,
    stage2_top_modules,
    word_tokenizer,
)
from tests.zoo import SD_SIZES  # noqa: E402

TEMPLATES = ["a photo of a {}", "a rendering of a {}", "a cropped photo of the {}"]


def build(num_vectors: int = 2, prediction_type: str = "epsilon"):
    """``main()``'s setup up to the loop, as the script writes it, on tiny random models."""
    torch.manual_seed(0)
    spec = SD_SIZES["tiny"]
    words = [*" ".join(TEMPLATES).replace("{}", "").split(), "toy"]
    tokenizer = word_tokenizer(words)
    tokenizer.model_max_length = 16
    noise_scheduler = diffusers.DDPMScheduler(
        num_train_timesteps=1000, beta_schedule="scaled_linear", prediction_type=prediction_type
    )
    text_encoder = transformers.CLIPTextModel(
        transformers.CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=77,
            eos_token_id=2,
        )
    )
    vae = diffusers.AutoencoderKL(sample_size=spec.resolution, **spec.vae)
    unet = diffusers.UNet2DConditionModel(**spec.unet)
    args = types.SimpleNamespace(
        placeholder_token="<cat-toy>", initializer_token="toy", num_vectors=num_vectors
    )

    # Add the placeholder token in tokenizer
    placeholder_tokens = [args.placeholder_token]
    # add dummy tokens for multi-vector
    additional_tokens = []
    for i in range(1, args.num_vectors):
        additional_tokens.append(f"{args.placeholder_token}_{i}")
    placeholder_tokens += additional_tokens
    num_added_tokens = tokenizer.add_tokens(placeholder_tokens)
    assert num_added_tokens == args.num_vectors
    # Convert the initializer_token, placeholder_token to ids
    token_ids = tokenizer.encode(args.initializer_token, add_special_tokens=False)
    initializer_token_id = token_ids[0]
    placeholder_token_ids = tokenizer.convert_tokens_to_ids(placeholder_tokens)
    # Resize the token embeddings as we are adding new special tokens to the tokenizer
    text_encoder.resize_token_embeddings(len(tokenizer))
    # Initialise the newly added placeholder token with the embeddings of the initializer token
    token_embeds = text_encoder.get_input_embeddings().weight.data
    with torch.no_grad():
        for token_id in placeholder_token_ids:
            token_embeds[token_id] = token_embeds[initializer_token_id].clone()
    # Freeze vae and unet
    vae.requires_grad_(False)
    unet.requires_grad_(False)
    # Freeze all parameters except for the token embeddings in text encoder
    text_module = text_encoder.text_model if hasattr(text_encoder, "text_model") else text_encoder
    text_module.encoder.requires_grad_(False)
    text_module.final_layer_norm.requires_grad_(False)
    text_module.embeddings.position_embedding.requires_grad_(False)
    for model in (vae, unet):  # as from_pretrained returns them; the script trains neither
        model.eval()
    text_encoder.train()
    weight_dtype = torch.float32

    def training_step(batch):
        # Convert images to latent space
        latents = (
            vae.encode(batch["pixel_values"].to(dtype=weight_dtype)).latent_dist.sample().detach()
        )
        latents = latents * vae.config.scaling_factor

        # Sample noise that we'll add to the latents
        noise = torch.randn_like(latents)
        bsz = latents.shape[0]
        # Sample a random timestep for each image
        timesteps = torch.randint(
            0, noise_scheduler.config.num_train_timesteps, (bsz,), device=latents.device
        )
        timesteps = timesteps.long()

        # Add noise to the latents according to the noise magnitude at each timestep
        # (this is the forward diffusion process)
        noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)

        # Get the text embedding for conditioning
        encoder_hidden_states = text_encoder(batch["input_ids"])[0].to(dtype=weight_dtype)

        # Predict the noise residual
        model_pred = unet(noisy_latents, timesteps, encoder_hidden_states).sample

        # Get the target for loss depending on the prediction type
        if noise_scheduler.config.prediction_type == "epsilon":
            target = noise
        elif noise_scheduler.config.prediction_type == "v_prediction":
            target = noise_scheduler.get_velocity(latents, noise, timesteps)
        else:
            raise ValueError(f"Unknown prediction type {noise_scheduler.config.prediction_type}")

        loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
        return loss

    placeholder = " ".join(tokenizer.convert_ids_to_tokens(placeholder_token_ids))
    return types.SimpleNamespace(
        step=training_step,
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        placeholder=placeholder,
        placeholder_token_ids=placeholder_token_ids,
    )


def example(parts, index: int, resolution: int = 32) -> dict[str, torch.Tensor]:
    """``TextualInversionDataset.__getitem__``: a template's text tokenized, an image in [-1, 1]."""
    text = TEMPLATES[index % len(TEMPLATES)].format(parts.placeholder)
    tokenizer = parts.tokenizer
    generator = torch.Generator().manual_seed(300 + index)
    return {
        "input_ids": tokenizer(
            text,
            padding="max_length",
            truncation=True,
            max_length=tokenizer.model_max_length,
            return_tensors="pt",
        ).input_ids[0],
        "pixel_values": torch.rand(3, resolution, resolution, generator=generator) * 2 - 1,
    }


def loader(parts, batch_size: int, items: int) -> torch.utils.data.DataLoader:
    """The script's ``DataLoader`` (default collate, no shuffle so the rows have names)."""
    dataset = [example(parts, i) for i in range(items)]
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size)


def test_the_placeholder_tokens_reach_the_text_encoder():
    """The tokenizer gives the new ids; the embedding's rows for them start as the initializer's."""
    parts = build()
    ids = example(parts, 0)["input_ids"]
    assert set(parts.placeholder_token_ids) <= set(ids.tolist())
    weight = parts.text_encoder.get_input_embeddings().weight
    assert weight.requires_grad and weight.shape[0] == len(parts.tokenizer)


@pytest.mark.parametrize("size", [1, 2, 3])
@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_textual_inversion_caches_only_the_vae(size, prediction_type):
    parts = build(prediction_type=prediction_type)
    batch = next(iter(loader(parts, size, size)))
    split = split_and_verify(parts.step, (batch,))
    # The text encoder reads the trainable embedding first thing: all of it stays in stage 2,
    # with the frozen UNet the gradient flows through. Only the VAE's moments are cached.
    assert stage2_top_modules(split) == {"text_encoder", "unet"}
    # The VAE's moments per sample, the ids (as CLIP views them) and, once for the plan, the
    # frozen position table's rows: no text-encoder state that the embedding feeds.
    assert {key: spec.batch_dim for key, spec in split.boundary.items()} == {
        "vae_encode_latent_dist_parameters": 0,
        "view": 0,
        "position_embeddings": None,
    }
    assert split.boundary["view"].dtype == torch.int64


def test_textual_inversion_trains_from_its_cache_after_the_embedding_moves(tmp_path):
    parts = build(num_vectors=1)
    batches = list(loader(parts, 2, 5))  # sizes 2, 2, 1
    split = graphsplit.split(parts.step, (batches[0],))
    embedding = parts.text_encoder.get_input_embeddings().weight
    assert_trains_from_its_cache(split, parts.step, batches, tmp_path, [embedding])


def test_textual_inversion_cache_round_trip(tmp_path):
    parts = build()
    split = graphsplit.split(parts.step, (next(iter(loader(parts, 3, 3))),))
    assert_cache_round_trip(
        split, parts.step, loader(parts, 3, 6), tmp_path, parts.text_encoder, rows_per_batch=3
    )
