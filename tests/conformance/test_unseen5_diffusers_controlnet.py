"""Conformance: ``examples/controlnet/train_controlnet.py``'s loop body, as a closure.

The script's models (``main()``): a frozen VAE, CLIP text encoder and UNet (``requires_grad_
(False)``, left in eval mode as ``from_pretrained`` returns them) and a trainable
``ControlNetModel.from_unet(unet)`` in train mode. The loop body is copied from the script:
``latent_dist.sample()`` times the scaling factor, noise and timesteps, ``add_noise`` on
``.float()`` inputs cast back to ``weight_dtype``, the text embedding, the ControlNet on
``batch["conditioning_pixel_values"]`` (``return_dict=False``), the frozen UNet fed the
ControlNet's residuals (``down_block_additional_residuals=[...]``, ``mid_block_additional_
residual=...``), the prediction-type target and an MSE loss. The batch is the script's
``collate_fn`` output (a dict of three tensors).

What must hold: the step splits exactly (loss and every ControlNet gradient bit for bit, on
the example and on a batch of another size), the VAE and the text encoder are cached (their
weights are not held by stage 2), the frozen UNet runs in stage 2 (it consumes trainable
residuals), and a cache written through the disk trains stage 2 exactly.

Tiny configs: the zoo's ``tiny`` SD (VAE (32, 64), CLIP 32 wide, UNet (32, 64)), the
ControlNet's conditioning embedding (16, 32) channels, 32 px.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

import graphsplit
from tests.helpers import assert_stage1_holds_no_trainable

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

from tests.conformance.unseen2_data_checks import assert_cache_round_trip  # noqa: E402
from tests.conformance.unseen_checks import stage2_top_modules  # noqa: E402
from tests.zoo import build_frozen_sd  # noqa: E402
from tests.zoo.data import tokenize  # noqa: E402

RESOLUTION = 32


def collate_fn(examples):
    """The script's, verbatim."""
    pixel_values = torch.stack([example["pixel_values"] for example in examples])
    pixel_values = pixel_values.to(memory_format=torch.contiguous_format).float()

    conditioning_pixel_values = torch.stack(
        [example["conditioning_pixel_values"] for example in examples]
    )
    conditioning_pixel_values = conditioning_pixel_values.to(
        memory_format=torch.contiguous_format
    ).float()

    input_ids = torch.stack([example["input_ids"] for example in examples])

    return {
        "pixel_values": pixel_values,
        "conditioning_pixel_values": conditioning_pixel_values,
        "input_ids": input_ids,
    }


def build():
    """``main()``'s models (fp32, one process) and the loop body as a closure."""
    vae, text_encoder, unet, noise_scheduler = build_frozen_sd()
    torch.manual_seed(3)
    controlnet = diffusers.ControlNetModel.from_unet(
        unet, conditioning_embedding_out_channels=(16, 32)
    )
    # from_unet copies the UNet's weights; the zero-initialised output convolutions would
    # leave most of the ControlNet without a gradient, so they are drawn small (as after
    # some training steps).
    with torch.no_grad():
        for name, param in controlnet.named_parameters():
            if "zero_conv" in name or "controlnet_" in name or "conv_out" in name:
                param.normal_(std=0.02)

    vae.requires_grad_(False)
    unet.requires_grad_(False)
    text_encoder.requires_grad_(False)
    controlnet.train()
    weight_dtype = torch.float32

    def training_step(batch):
        # Convert images to latent space
        latents = vae.encode(batch["pixel_values"].to(dtype=weight_dtype)).latent_dist.sample()
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
        noisy_latents = noise_scheduler.add_noise(latents.float(), noise.float(), timesteps).to(
            dtype=weight_dtype
        )

        # Get the text embedding for conditioning
        encoder_hidden_states = text_encoder(batch["input_ids"], return_dict=False)[0]

        controlnet_image = batch["conditioning_pixel_values"].to(dtype=weight_dtype)

        down_block_res_samples, mid_block_res_sample = controlnet(
            noisy_latents,
            timesteps,
            encoder_hidden_states=encoder_hidden_states,
            controlnet_cond=controlnet_image,
            return_dict=False,
        )

        # Predict the noise residual
        model_pred = unet(
            noisy_latents,
            timesteps,
            encoder_hidden_states=encoder_hidden_states,
            down_block_additional_residuals=[
                sample.to(dtype=weight_dtype) for sample in down_block_res_samples
            ],
            mid_block_additional_residual=mid_block_res_sample.to(dtype=weight_dtype),
            return_dict=False,
        )[0]

        # Get the target for loss depending on the prediction type
        if noise_scheduler.config.prediction_type == "epsilon":
            target = noise
        elif noise_scheduler.config.prediction_type == "v_prediction":
            target = noise_scheduler.get_velocity(latents, noise, timesteps)
        else:
            raise ValueError(f"Unknown prediction type {noise_scheduler.config.prediction_type}")
        loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
        return loss

    params = [p for p in controlnet.parameters() if p.requires_grad]
    return types.SimpleNamespace(
        step=training_step,
        vae=vae,
        text_encoder=text_encoder,
        unet=unet,
        controlnet=controlnet,
        params=params,
    )


def _example(index: int) -> dict:
    """``preprocess_train``'s sample: the image in [-1, 1], the conditioning image in [0, 1]
    (the script does not normalise it) and the caption's ids."""
    generator = torch.Generator().manual_seed(700 + index)
    return {
        "pixel_values": torch.rand(3, RESOLUTION, RESOLUTION, generator=generator) * 2 - 1,
        "conditioning_pixel_values": torch.rand(3, RESOLUTION, RESOLUTION, generator=generator),
        "input_ids": tokenize(f"a red circle number {index}"),
    }


def _batch(indices) -> dict:
    return collate_fn([_example(i) for i in indices])


def _held_params(module) -> set[str]:
    return {name for name, _ in module.named_parameters()}


@pytest.fixture(scope="module")
def built():
    parts = build()
    split = graphsplit.split(parts.step, (_batch([0, 1]),))
    return parts, split


def test_controlnet_step_verifies_on_the_example_and_another_size(built):
    parts, split = built
    assert_stage1_holds_no_trainable(split)
    for seed, batch in enumerate([_batch([0, 1]), _batch([2, 3, 4])]):
        checks = graphsplit.verify(parts.step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


def test_controlnet_caches_the_vae_and_the_text_encoder_not_the_unet(built):
    parts, split = built
    held = stage2_top_modules(split)
    assert "text_encoder" not in held
    stage2 = _held_params(split.stage2)
    assert not any(name.startswith("vae.encoder") for name in stage2)
    # the frozen UNet consumes the ControlNet's residuals: stage 2 runs it
    assert {"controlnet", "unet"} <= held
    stage1 = {".".join(n.split(".")[:2]) for n, _ in split.stage1.named_parameters()}
    assert {"vae.encoder", "vae.quant_conv", "text_encoder.encoder"} <= stage1
    # The boundary: the VAE's latent distribution (mean and log-variance: sampled again in
    # stage 2), the CLIP hidden states, and the conditioning image (cast to weight_dtype) the
    # trainable ControlNet reads. The raw image is not needed by stage 2.
    shapes = {key: spec.shape[1:] for key, spec in split.boundary.items()}
    assert sorted(shapes.values()) == sorted([(8, 16, 16), (16, 32), (3, 32, 32)])
    assert shapes["vae_encode_latent_dist_parameters"] == (8, 16, 16)
    assert shapes["text_encoder_0"] == (16, 32)
    assert "pixel_values" not in split.boundary
    trainable = {n for n, p in split.stage2.named_parameters() if p.requires_grad}
    assert trainable == {
        f"controlnet.{n}" for n, p in parts.controlnet.named_parameters() if p.requires_grad
    }


def test_controlnet_cache_round_trip(built, tmp_path):
    parts, split = built
    loader = [_batch([4, 5]), _batch([6, 7]), _batch([8])]
    assert_cache_round_trip(split, parts.step, loader, tmp_path / "cache", parts.params)
