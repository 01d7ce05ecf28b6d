"""Conformance: ``examples/dreambooth/train_dreambooth_lora.py`` with ``--with_prior_preservation``.

The script's ``collate_fn`` concatenates instance and class examples into one batch (token ids
``torch.cat`` of ``(1, L)`` rows, attention masks left as a *list* of tensors), the loop body
encodes the prompts with the script's ``encode_prompt`` and chunks prediction and target in two
halves along the batch: instance loss plus ``prior_loss_weight`` times the class loss. The
models are locals of ``main()``, read by the step as closure variables, as the howto's port
writes it. The frozen VAE and CLIP text encoder must be cached; the chunking stays in stage 2.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

import graphsplit
from graphsplit.errors import CacheError
from tests.helpers import split_and_verify

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from tests.conformance.unseen_checks import (  # noqa: E402
    assert_cache_round_trip,
    stage2_top_modules,
)
from tests.zoo import build_sd_lora_step, tokenize  # noqa: E402


def encode_prompt(text_encoder, input_ids, attention_mask, text_encoder_use_attention_mask=None):
    """``train_dreambooth_lora.py``'s ``encode_prompt``, verbatim."""
    text_input_ids = input_ids.to(text_encoder.device)

    if text_encoder_use_attention_mask:
        attention_mask = attention_mask.to(text_encoder.device)
    else:
        attention_mask = None

    prompt_embeds = text_encoder(
        text_input_ids,
        attention_mask=attention_mask,
        return_dict=False,
    )
    prompt_embeds = prompt_embeds[0]

    return prompt_embeds


def collate_fn(examples, with_prior_preservation=False):
    """The script's ``collate_fn``, verbatim."""
    has_attention_mask = "instance_attention_mask" in examples[0]

    input_ids = [example["instance_prompt_ids"] for example in examples]
    pixel_values = [example["instance_images"] for example in examples]

    if has_attention_mask:
        attention_mask = [example["instance_attention_mask"] for example in examples]

    # Concat class and instance examples for prior preservation.
    # We do this to avoid doing two forward passes.
    if with_prior_preservation:
        input_ids += [example["class_prompt_ids"] for example in examples]
        pixel_values += [example["class_images"] for example in examples]
        if has_attention_mask:
            attention_mask += [example["class_attention_mask"] for example in examples]

    pixel_values = torch.stack(pixel_values)
    pixel_values = pixel_values.to(memory_format=torch.contiguous_format).float()

    input_ids = torch.cat(input_ids, dim=0)

    batch = {
        "input_ids": input_ids,
        "pixel_values": pixel_values,
    }

    if has_attention_mask:
        batch["attention_mask"] = attention_mask

    return batch


def _example(index: int, resolution: int = 32) -> dict[str, torch.Tensor]:
    """One ``DreamBoothDataset`` item: instance and class image, ``(1, L)`` ids and masks."""
    generator = torch.Generator().manual_seed(100 + index)
    instance_ids = tokenize("a photo of sks dog")[None]
    class_ids = tokenize("a photo of dog")[None]
    return {
        "instance_images": torch.rand(3, resolution, resolution, generator=generator) * 2 - 1,
        "instance_prompt_ids": instance_ids,
        "instance_attention_mask": (instance_ids != 999).long(),
        "class_images": torch.rand(3, resolution, resolution, generator=generator) * 2 - 1,
        "class_prompt_ids": class_ids,
        "class_attention_mask": (class_ids != 999).long(),
    }


def build_training_step(prediction_type: str = "epsilon"):
    """``main()``'s models as locals and the loop body as a closure over them."""
    parts = build_sd_lora_step()
    vae, text_encoder, unet = parts.vae, parts.text_encoder, parts.unet
    noise_scheduler = diffusers.DDPMScheduler(
        num_train_timesteps=1000, beta_schedule="scaled_linear", prediction_type=prediction_type
    )
    weight_dtype = torch.float32
    args = types.SimpleNamespace(
        pre_compute_text_embeddings=False,
        text_encoder_use_attention_mask=False,
        class_labels_conditioning=None,
        with_prior_preservation=True,
        prior_loss_weight=1.0,
    )

    def unwrap_model(model):
        return model

    def training_step(batch):
        pixel_values = batch["pixel_values"].to(dtype=weight_dtype)

        if vae is not None:
            # Convert images to latent space
            model_input = vae.encode(pixel_values).latent_dist.sample()
            model_input = model_input * vae.config.scaling_factor
        else:
            model_input = pixel_values

        # Sample noise that we'll add to the latents
        noise = torch.randn_like(model_input)
        bsz, channels, height, width = model_input.shape  # noqa: RUF059 (the script's)
        # Sample a random timestep for each image
        timesteps = torch.randint(
            0, noise_scheduler.config.num_train_timesteps, (bsz,), device=model_input.device
        )
        timesteps = timesteps.long()

        # Add noise to the model input according to the noise magnitude at each timestep
        # (this is the forward diffusion process)
        noisy_model_input = noise_scheduler.add_noise(model_input, noise, timesteps)

        # Get the text embedding for conditioning
        if args.pre_compute_text_embeddings:
            encoder_hidden_states = batch["input_ids"]
        else:
            encoder_hidden_states = encode_prompt(
                text_encoder,
                batch["input_ids"],
                batch["attention_mask"],
                text_encoder_use_attention_mask=args.text_encoder_use_attention_mask,
            )

        if unwrap_model(unet).config.in_channels == channels * 2:
            noisy_model_input = torch.cat([noisy_model_input, noisy_model_input], dim=1)

        if args.class_labels_conditioning == "timesteps":  # noqa: SIM108 (the script's)
            class_labels = timesteps
        else:
            class_labels = None

        # Predict the noise residual
        model_pred = unet(
            noisy_model_input,
            timesteps,
            encoder_hidden_states,
            class_labels=class_labels,
            return_dict=False,
        )[0]

        # if model predicts variance, throw away the prediction.
        if model_pred.shape[1] == 6:
            model_pred, _ = torch.chunk(model_pred, 2, dim=1)

        # Get the target for loss depending on the prediction type
        if noise_scheduler.config.prediction_type == "epsilon":
            target = noise
        elif noise_scheduler.config.prediction_type == "v_prediction":
            target = noise_scheduler.get_velocity(model_input, noise, timesteps)
        else:
            raise ValueError(f"Unknown prediction type {noise_scheduler.config.prediction_type}")

        if args.with_prior_preservation:
            # Chunk the noise and model_pred into two parts and compute the loss on each part
            # separately.
            model_pred, model_pred_prior = torch.chunk(model_pred, 2, dim=0)
            target, target_prior = torch.chunk(target, 2, dim=0)

            # Compute instance loss
            loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")

            # Compute prior loss
            prior_loss = F.mse_loss(
                model_pred_prior.float(), target_prior.float(), reduction="mean"
            )

            # Add the prior loss to the instance loss.
            loss = loss + args.prior_loss_weight * prior_loss
        else:
            loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
        return loss

    return training_step, unet


def _batch(indices, resolution: int = 32):
    return collate_fn([_example(i, resolution) for i in indices], with_prior_preservation=True)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_prior_preservation_caches_vae_and_text_encoder(prediction_type):
    torch.manual_seed(0)
    training_step, _ = build_training_step(prediction_type)
    batch = _batch([0, 1])
    split = split_and_verify(training_step, (batch,))
    assert stage2_top_modules(split) == {"unet"}
    # The list of masks is unused (no --text_encoder_use_attention_mask): no stage-1 output.
    assert not any("attention_mask" in key for key in split.boundary)


def _prior_preservation_loader() -> torch.utils.data.DataLoader:
    examples = [_example(i) for i in range(4)]
    return torch.utils.data.DataLoader(
        examples, batch_size=2, collate_fn=lambda items: collate_fn(items, True)
    )


def test_prior_preservation_cache_round_trip(tmp_path):
    """Two dataset items make four rows; the batches, passed as an iterable, are numbered."""
    torch.manual_seed(0)
    training_step, unet = build_training_step()
    split = graphsplit.split(training_step, (_batch([0, 1]),))
    loader = _prior_preservation_loader()
    assert_cache_round_trip(
        split, training_step, loader, tmp_path, unet, rows_per_batch=4, as_iterable=True
    )


def test_prior_preservation_dataloader_is_refused_naming_the_fix(tmp_path):
    """A DataLoader names cached rows by dataset index: four rows of two items have no names."""
    torch.manual_seed(0)
    training_step, _ = build_training_step()
    split = graphsplit.split(training_step, (_batch([0, 1]),))
    with pytest.raises(CacheError) as caught:
        graphsplit.cache(split, _prior_preservation_loader(), tmp_path / "cache")
    message = str(caught.value)
    assert "a batch holds 4 rows but its sampler gave 2 dataset indices ([0, 1])" in message
    assert "graphsplit.cache(split, (batch for batch in loader), path)" in message
