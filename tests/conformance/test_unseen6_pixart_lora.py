"""Conformance: PixArt's LoRA fine-tuning loop body (``train_scripts/train_pixart_lora_hf.py``).

The PixArt-sigma repository's script (adapted from PixArt-alpha's): a frozen T5 encoder
(``T5EncoderModel``, called with the caption's attention mask), a frozen ``AutoencoderKL``, and
the transformer (``Transformer2DModel.from_pretrained``, a ``PixArtTransformer2DModel``) frozen
(``requires_grad_(False)``) then wrapped by ``peft.get_peft_model`` with the script's
``LoraConfig`` (``init_lora_weights="gaussian"``, its twelve ``target_modules``), in train mode.
The batch is the script's ``collate_fn`` output (``pixel_values``, ``input_ids``,
``prompt_attention_mask``: ids padded to ``max_length``). The loop body is copied from the
script: ``latent_dist.sample()`` times the scaling factor, noise, timesteps, ``add_noise``, the
T5 embedding with the mask, the prediction-type target, the micro-conditions
(``added_cond_kwargs = {"resolution": None, "aspect_ratio": None}``: the tiny transformer's
``sample_size`` is not 128), the transformer's learned-sigma output split as the script does it
(``.sample.chunk(2, 1)[0]``) and the MSE loss, plain or with ``--snr_gamma 5.0``
(``compute_snr``).

What must hold: the step splits exactly (loss and every LoRA gradient bit for bit, on the
example and on a batch of another size), the VAE's latent distribution and the T5 hidden states
are cached (their weights are not held by stage 2), the mask the transformer reads crosses,
and a cache written through the disk trains stage 2 exactly.

Tiny configs: VAE (8, 16) channels (16 px images, 8 x 8 latents of 4 channels); T5 16 wide, 2
layers, 64 tokens, captions padded to 8; PixArt 2 layers, 2 heads of 8, patch 2, 8 output
channels (learned sigma), LoRA rank 4 with ``lora_B`` drawn small.
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
peft = pytest.importorskip("peft")

from diffusers.training_utils import compute_snr  # noqa: E402

from tests.conformance.unseen2_data_checks import assert_cache_round_trip  # noqa: E402

RESOLUTION = 16
MAX_LENGTH = 8
VOCAB = 64


def _models():
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=RESOLUTION,
    )
    text_encoder = transformers.T5EncoderModel(
        transformers.T5Config(
            vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2
        )
    )
    text_encoder.eval()  # as from_pretrained returns it
    transformer = diffusers.PixArtTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=8,
        num_layers=2,
        norm_num_groups=8,
        cross_attention_dim=16,
        sample_size=RESOLUTION // 2,
        patch_size=2,
        caption_channels=16,
    )
    return vae, text_encoder, transformer


def build(snr_gamma: float | None):
    vae, text_encoder, transformer = _models()
    args = types.SimpleNamespace(
        noise_offset=0,
        prediction_type=None,
        micro_conditions=False,
        resolution=RESOLUTION,
        snr_gamma=snr_gamma,
    )
    weight_dtype = torch.float32
    noise_scheduler = diffusers.DDPMScheduler()
    text_encoder.requires_grad_(False)
    vae.requires_grad_(False)
    transformer.requires_grad_(False)
    for param in transformer.parameters():
        param.requires_grad_(False)
    lora_config = peft.LoraConfig(
        r=4,
        init_lora_weights="gaussian",
        target_modules=[
            "to_k",
            "to_q",
            "to_v",
            "to_out.0",
            "proj_in",
            "proj_out",
            "ff.net.0.proj",
            "ff.net.2",
            "proj",
            "linear",
            "linear_1",
            "linear_2",
        ],
    )
    transformer = peft.get_peft_model(transformer, lora_config)
    # peft's lora_B starts at zero, which would leave every lora_A without a gradient.
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in transformer.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    transformer.train()

    def training_step(batch):
        # Convert images to latent space
        latents = vae.encode(batch["pixel_values"].to(dtype=weight_dtype)).latent_dist.sample()
        latents = latents * vae.config.scaling_factor

        # Sample noise that we'll add to the latents
        noise = torch.randn_like(latents)
        if args.noise_offset:
            # https://www.crosslabs.org//blog/diffusion-with-offset-noise
            noise += args.noise_offset * torch.randn(
                (latents.shape[0], latents.shape[1], 1, 1), device=latents.device
            )

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
        prompt_embeds = text_encoder(
            batch["input_ids"], attention_mask=batch["prompt_attention_mask"]
        )[0]
        prompt_attention_mask = batch["prompt_attention_mask"]
        # Get the target for loss depending on the prediction type
        if args.prediction_type is not None:
            # set prediction_type of scheduler if defined
            noise_scheduler.register_to_config(prediction_type=args.prediction_type)

        if noise_scheduler.config.prediction_type == "epsilon":
            target = noise
        elif noise_scheduler.config.prediction_type == "v_prediction":
            target = noise_scheduler.get_velocity(latents, noise, timesteps)
        else:
            raise ValueError(f"Unknown prediction type {noise_scheduler.config.prediction_type}")

        # Prepare micro-conditions.
        added_cond_kwargs = {"resolution": None, "aspect_ratio": None}
        if (
            getattr(transformer, "module", transformer).config.sample_size == 128
            and args.micro_conditions
        ):
            resolution = torch.tensor([args.resolution, args.resolution]).repeat(bsz, 1)
            aspect_ratio = torch.tensor([float(args.resolution / args.resolution)]).repeat(bsz, 1)
            resolution = resolution.to(dtype=weight_dtype, device=latents.device)
            aspect_ratio = aspect_ratio.to(dtype=weight_dtype, device=latents.device)
            added_cond_kwargs = {"resolution": resolution, "aspect_ratio": aspect_ratio}

        # Predict the noise residual and compute loss
        model_pred = transformer(
            noisy_latents,
            encoder_hidden_states=prompt_embeds,
            encoder_attention_mask=prompt_attention_mask,
            timestep=timesteps,
            added_cond_kwargs=added_cond_kwargs,
        ).sample.chunk(2, 1)[0]

        if args.snr_gamma is None:
            loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
        else:
            # Compute loss-weights as per Section 3.4 of https://arxiv.org/abs/2303.09556.
            snr = compute_snr(noise_scheduler, timesteps)
            if noise_scheduler.config.prediction_type == "v_prediction":
                # Velocity objective requires that we add one to SNR values before we divide.
                snr = snr + 1
            mse_loss_weights = (
                torch.stack([snr, args.snr_gamma * torch.ones_like(timesteps)], dim=1).min(dim=1)[0]
                / snr
            )

            loss = F.mse_loss(model_pred.float(), target.float(), reduction="none")
            loss = loss.mean(dim=list(range(1, len(loss.shape)))) * mse_loss_weights
            loss = loss.mean()
        return loss

    params = list(filter(lambda p: p.requires_grad, transformer.parameters()))
    return types.SimpleNamespace(
        step=training_step,
        vae=vae,
        text_encoder=text_encoder,
        transformer=transformer,
        params=params,
    )


def collate_fn(examples):
    """The script's, verbatim."""
    pixel_values = torch.stack([example["pixel_values"] for example in examples])
    pixel_values = pixel_values.to(memory_format=torch.contiguous_format).float()
    input_ids = torch.stack([example["input_ids"] for example in examples])
    prompt_attention_mask = torch.stack([example["prompt_attention_mask"] for example in examples])
    return {
        "pixel_values": pixel_values,
        "input_ids": input_ids,
        "prompt_attention_mask": prompt_attention_mask,
    }


def _example(index: int) -> dict:
    """``preprocess_train``'s sample: the image in [-1, 1], the caption's ids padded to
    ``max_length`` (T5's pad id 0, then its ``</s>`` id 1) and the mask."""
    generator = torch.Generator().manual_seed(300 + index)
    length = 3 + index % (MAX_LENGTH - 3)
    ids = torch.zeros(MAX_LENGTH, dtype=torch.long)
    ids[: length - 1] = torch.randint(2, VOCAB, (length - 1,), generator=generator)
    ids[length - 1] = 1
    mask = torch.zeros(MAX_LENGTH, dtype=torch.long)
    mask[:length] = 1
    return {
        "pixel_values": torch.rand(3, RESOLUTION, RESOLUTION, generator=generator) * 2 - 1,
        "input_ids": ids,
        "prompt_attention_mask": mask,
    }


def _batch(indices) -> dict:
    return collate_fn([_example(i) for i in indices])


_BUILT: dict[float | None, tuple] = {}


def _built(snr_gamma):
    if snr_gamma not in _BUILT:
        parts = build(snr_gamma)
        _BUILT[snr_gamma] = (parts, graphsplit.split(parts.step, (_batch([0, 1]),)))
    return _BUILT[snr_gamma]


GAMMAS = [None, 5.0]


@pytest.mark.parametrize("snr_gamma", GAMMAS)
def test_pixart_lora_step_verifies_on_the_example_and_another_size(snr_gamma):
    parts, split = _built(snr_gamma)
    assert_stage1_holds_no_trainable(split)
    for seed, batch in enumerate([_batch([0, 1]), _batch([2, 3, 4])]):
        checks = graphsplit.verify(parts.step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


@pytest.mark.parametrize("snr_gamma", GAMMAS)
def test_pixart_lora_caches_the_vae_and_t5(snr_gamma):
    parts, split = _built(snr_gamma)
    assert split.path == "trace"
    held = {name for name, _ in split.stage2.named_parameters()}
    assert held and all(name.startswith("transformer.") for name in held), sorted(held)[:5]
    trainable = {n for n, p in split.stage2.named_parameters() if p.requires_grad}
    assert trainable == {
        f"transformer.{n}" for n, p in parts.transformer.named_parameters() if p.requires_grad
    }
    stage1 = {name.split(".")[0] for name, _ in split.stage1.named_parameters()}
    assert stage1 == {"vae", "text_encoder"}
    # The VAE's latent distribution (mean and log-variance, sampled again in stage 2), T5's
    # last hidden state, and the mask the transformer's cross-attention reads. Neither the
    # pixels nor the ids cross.
    per_sample = {key: spec.shape[1:] for key, spec in split.boundary.items()}
    assert per_sample == {
        "vae_encode_latent_dist_parameters": (8, RESOLUTION // 2, RESOLUTION // 2),
        "text_encoder_0": (MAX_LENGTH, 16),
        "prompt_attention_mask": (MAX_LENGTH,),
    }


@pytest.mark.parametrize("snr_gamma", GAMMAS)
def test_pixart_lora_cache_round_trip(snr_gamma, tmp_path):
    parts, split = _built(snr_gamma)
    loader = [_batch([5, 6]), _batch([7, 8, 9]), _batch([10])]
    assert_cache_round_trip(split, parts.step, loader, tmp_path / "cache", parts.params)
