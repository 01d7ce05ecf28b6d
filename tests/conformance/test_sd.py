"""Conformance: UNet training steps as diffusers' example scripts write them (issue 10).

SD 1.5 LoRA (``train_text_to_image_lora.py``), SDXL LoRA (``train_text_to_image_lora_sdxl.py``:
two text encoders, pooled embeddings, time ids) and ControlNet (``train_controlnet.py``). Each
step body follows the script's training loop line for line (noise offset, SNR weighting,
``return_dict=False``), with tiny configs and random weights; each is split and verified bit
for bit at two batch sizes, and each asserts that the frozen VAE and text encoders are cached.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphsplit
from tests.conformance.matrix import stage2_modules
from tests.helpers import line_of, split_and_verify

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
from diffusers.training_utils import compute_snr  # noqa: E402

from tests.zoo import build_frozen_sd, build_sd_lora_step, tokenize  # noqa: E402


class TextToImageLoRAStep(nn.Module):
    """The loop body of ``train_text_to_image_lora.py`` with ``--noise_offset --snr_gamma``."""

    def __init__(self, noise_offset: float = 0.1, snr_gamma: float = 5.0) -> None:
        super().__init__()
        parts = build_sd_lora_step()
        self.vae, self.text_encoder, self.unet = parts.vae, parts.text_encoder, parts.unet
        self.noise_scheduler = parts.scheduler
        self.noise_offset = noise_offset
        self.snr_gamma = snr_gamma

    def forward(self, pixel_values, input_ids):
        weight_dtype = torch.float32
        latents = self.vae.encode(pixel_values.to(dtype=weight_dtype)).latent_dist.sample()
        latents = latents * self.vae.config.scaling_factor
        noise = torch.randn_like(latents)
        if self.noise_offset:
            noise += self.noise_offset * torch.randn(
                (latents.shape[0], latents.shape[1], 1, 1), device=latents.device
            )
        bsz = latents.shape[0]
        timesteps = torch.randint(
            0, self.noise_scheduler.config.num_train_timesteps, (bsz,), device=latents.device
        )
        timesteps = timesteps.long()
        noisy_latents = self.noise_scheduler.add_noise(latents, noise, timesteps)
        encoder_hidden_states = self.text_encoder(input_ids, return_dict=False)[0]
        if self.noise_scheduler.config.prediction_type == "epsilon":
            target = noise
        elif self.noise_scheduler.config.prediction_type == "v_prediction":
            target = self.noise_scheduler.get_velocity(latents, noise, timesteps)
        model_pred = self.unet(noisy_latents, timesteps, encoder_hidden_states, return_dict=False)[
            0
        ]
        snr = compute_snr(self.noise_scheduler, timesteps)
        mse_loss_weights = torch.stack(
            [snr, self.snr_gamma * torch.ones_like(timesteps)], dim=1
        ).min(dim=1)[0]
        if self.noise_scheduler.config.prediction_type == "epsilon":
            mse_loss_weights = mse_loss_weights / snr
        elif self.noise_scheduler.config.prediction_type == "v_prediction":
            mse_loss_weights = mse_loss_weights / (snr + 1)
        loss = F.mse_loss(model_pred.float(), target.float(), reduction="none")
        loss = loss.mean(dim=list(range(1, len(loss.shape)))) * mse_loss_weights
        return loss.mean()


def _captions(size: int) -> torch.Tensor:
    return torch.stack([tokenize(f"a red circle number {i}") for i in range(size)])


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 3])
def test_sd15_lora_caches_vae_and_text_encoder(size):
    torch.manual_seed(0)
    step = TextToImageLoRAStep()
    split = split_and_verify(step, (torch.randn(size, 3, 32, 32), _captions(size)))
    assert stage2_modules(split) == {"unet"}


def _clip_config(**extra) -> transformers.CLIPTextConfig:
    return transformers.CLIPTextConfig(
        vocab_size=1000,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
        bos_token_id=998,
        eos_token_id=999,
        pad_token_id=999,
        **extra,
    )


def _sdxl_unet() -> diffusers.UNet2DConditionModel:
    """diffusers' own tiny SDXL UNet test config: ``text_time`` added conditioning."""
    return diffusers.UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=1,
        sample_size=16,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        transformer_layers_per_block=(1, 1),
        projection_class_embeddings_input_dim=6 * 8 + 32,
        cross_attention_dim=64,
        norm_num_groups=1,
    )


def encode_prompt(text_encoders, tokenizers, prompt, text_input_ids_list=None):
    """``train_text_to_image_lora_sdxl.py``'s ``encode_prompt``, verbatim."""
    prompt_embeds_list = []
    for i, text_encoder in enumerate(text_encoders):
        if tokenizers is not None:
            raise NotImplementedError("the matrix passes token ids, as the script's loop does")
        else:
            assert text_input_ids_list is not None
            text_input_ids = text_input_ids_list[i]
        prompt_embeds = text_encoder(
            text_input_ids.to(text_encoder.device), output_hidden_states=True, return_dict=False
        )
        # We are only ALWAYS interested in the pooled output of the final text encoder
        pooled_prompt_embeds = prompt_embeds[0]
        prompt_embeds = prompt_embeds[-1][-2]
        bs_embed, seq_len, _ = prompt_embeds.shape
        prompt_embeds = prompt_embeds.view(bs_embed, seq_len, -1)
        prompt_embeds_list.append(prompt_embeds)
    prompt_embeds = torch.concat(prompt_embeds_list, dim=-1)
    pooled_prompt_embeds = pooled_prompt_embeds.view(bs_embed, -1)
    return prompt_embeds, pooled_prompt_embeds


class SDXLLoRAStep(nn.Module):
    """The loop body of ``train_text_to_image_lora_sdxl.py`` (LoRA on the UNet only).

    ``original_sizes`` / ``crop_top_lefts`` are what the script's ``collate_fn`` yields: lists
    of ``(h, w)`` tuples. With ``time_ids_in_collate`` the batch carries the finished
    ``add_time_ids`` tensor instead (``compute_time_ids`` moved into the data pipeline: the
    one change from the script, until list-of-tuples inputs trace).
    """

    def __init__(self, resolution: int = 32, time_ids_in_collate: bool = False) -> None:
        super().__init__()
        parts = build_sd_lora_step()
        self.vae, self.noise_scheduler = parts.vae, parts.scheduler
        self.text_encoder_one = transformers.CLIPTextModel(_clip_config()).requires_grad_(False)
        self.text_encoder_two = transformers.CLIPTextModelWithProjection(
            _clip_config(projection_dim=32)
        ).requires_grad_(False)
        unet = _sdxl_unet().requires_grad_(False)
        unet.add_adapter(
            peft.LoraConfig(
                r=4,
                lora_alpha=4,
                init_lora_weights="gaussian",
                target_modules=["to_k", "to_q", "to_v", "to_out.0"],
            )
        )
        for name, param in unet.named_parameters():
            if "lora_B" in name:
                param.data.normal_(0.0, 0.02)  # peft's zeros would make lora_A's grads zero
        self.unet = unet
        self.resolution = resolution
        self.time_ids_in_collate = time_ids_in_collate

    def compute_time_ids(self, original_size, crops_coords_top_left):
        # Adapted from pipeline.StableDiffusionXLPipeline._get_add_time_ids
        target_size = (self.resolution, self.resolution)
        add_time_ids = list(original_size + crops_coords_top_left + target_size)
        add_time_ids = torch.tensor([add_time_ids])
        add_time_ids = add_time_ids.to(self.unet.device, dtype=torch.float32)
        return add_time_ids

    def forward(
        self,
        pixel_values,
        input_ids_one,
        input_ids_two,
        original_sizes=None,
        crop_top_lefts=None,
        add_time_ids=None,
    ):
        model_input = self.vae.encode(pixel_values).latent_dist.sample()
        model_input = model_input * self.vae.config.scaling_factor
        noise = torch.randn_like(model_input)
        noise += 0.05 * torch.randn(
            (model_input.shape[0], model_input.shape[1], 1, 1), device=model_input.device
        )
        bsz = model_input.shape[0]
        timesteps = torch.randint(
            0, self.noise_scheduler.config.num_train_timesteps, (bsz,), device=model_input.device
        )
        timesteps = timesteps.long()
        noisy_model_input = self.noise_scheduler.add_noise(model_input, noise, timesteps)
        if not self.time_ids_in_collate:
            add_time_ids = torch.cat(
                [self.compute_time_ids(s, c) for s, c in zip(original_sizes, crop_top_lefts)]
            )
        unet_added_conditions = {"time_ids": add_time_ids}
        prompt_embeds, pooled_prompt_embeds = encode_prompt(
            text_encoders=[self.text_encoder_one, self.text_encoder_two],
            tokenizers=None,
            prompt=None,
            text_input_ids_list=[input_ids_one, input_ids_two],
        )
        unet_added_conditions.update({"text_embeds": pooled_prompt_embeds})
        model_pred = self.unet(
            noisy_model_input,
            timesteps,
            prompt_embeds,
            added_cond_kwargs=unet_added_conditions,
            return_dict=False,
        )[0]
        target = noise
        return F.mse_loss(model_pred.float(), target.float(), reduction="mean")


def _sdxl_batch(size: int) -> tuple:
    ids = _captions(size)
    original_sizes = [(40 + 8 * i, 48) for i in range(size)]
    crop_top_lefts = [(4 * i, 0) for i in range(size)]
    return torch.randn(size, 3, 32, 32), ids, ids.flip(1), original_sizes, crop_top_lefts


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 3])
def test_sdxl_lora_caches_both_text_encoders_and_the_vae(size):
    torch.manual_seed(0)
    step = SDXLLoRAStep(time_ids_in_collate=True)
    pixels, ids_one, ids_two, original_sizes, crops = _sdxl_batch(size)
    time_ids = torch.cat([step.compute_time_ids(s, c) for s, c in zip(original_sizes, crops)])
    split = split_and_verify(step, (pixels, ids_one, ids_two), {"add_time_ids": time_ids})
    assert stage2_modules(split) == {"unet"}


def test_sdxl_time_ids_built_by_a_python_loop_over_the_batch_are_refused_at_the_loop():
    # train_text_to_image_lora_sdxl.py builds the time ids with a Python loop over the batch's
    # list of sizes. The list grows with the batch, so the loop is batch-size control flow:
    # refused naming the line (before, the list kept its example length while the step was
    # analysed, and the time ids were silently stored once for the whole dataset).
    torch.manual_seed(0)
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(SDXLLoRAStep(), _sdxl_batch(2), path="trace")
    message = str(caught.value)
    assert "depends on the batch size" in message
    assert line_of(SDXLLoRAStep, "for s, c in zip(original_sizes, crop_top_lefts)") in message
    assert "fix:" in message


class ControlNetStep(nn.Module):
    """The loop body of ``train_controlnet.py``: only the ControlNet trains.

    The frozen UNet consumes the ControlNet's residuals, so it must run in stage 2; the VAE
    and text encoder see only the batch and are cached.
    """

    def __init__(self) -> None:
        super().__init__()
        self.vae, self.text_encoder, self.unet, self.noise_scheduler = build_frozen_sd()
        self.controlnet = diffusers.ControlNetModel.from_unet(
            self.unet, conditioning_embedding_out_channels=(16, 32)
        ).requires_grad_(True)
        self.controlnet.train()

    def forward(self, pixel_values, input_ids, conditioning_pixel_values):
        weight_dtype = torch.float32
        latents = self.vae.encode(pixel_values.to(dtype=weight_dtype)).latent_dist.sample()
        latents = latents * self.vae.config.scaling_factor
        noise = torch.randn_like(latents)
        bsz = latents.shape[0]
        timesteps = torch.randint(
            0, self.noise_scheduler.config.num_train_timesteps, (bsz,), device=latents.device
        )
        timesteps = timesteps.long()
        noisy_latents = self.noise_scheduler.add_noise(latents.float(), noise.float(), timesteps)
        noisy_latents = noisy_latents.to(dtype=weight_dtype)
        encoder_hidden_states = self.text_encoder(input_ids, return_dict=False)[0]
        controlnet_image = conditioning_pixel_values.to(dtype=weight_dtype)
        down_block_res_samples, mid_block_res_sample = self.controlnet(
            noisy_latents,
            timesteps,
            encoder_hidden_states=encoder_hidden_states,
            controlnet_cond=controlnet_image,
            return_dict=False,
        )
        model_pred = self.unet(
            noisy_latents,
            timesteps,
            encoder_hidden_states=encoder_hidden_states,
            down_block_additional_residuals=[
                sample.to(dtype=weight_dtype) for sample in down_block_res_samples
            ],
            mid_block_additional_residual=mid_block_res_sample.to(dtype=weight_dtype),
            return_dict=False,
        )[0]
        if self.noise_scheduler.config.prediction_type == "epsilon":
            target = noise
        elif self.noise_scheduler.config.prediction_type == "v_prediction":
            target = self.noise_scheduler.get_velocity(latents, noise, timesteps)
        return F.mse_loss(model_pred.float(), target.float(), reduction="mean")


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 3])
def test_controlnet_caches_vae_and_text_encoder_but_runs_the_frozen_unet(size):
    torch.manual_seed(0)
    batch = (torch.randn(size, 3, 32, 32), _captions(size), torch.rand(size, 3, 32, 32))
    split = split_and_verify(ControlNetStep(), batch)
    # The UNet is frozen but consumes the ControlNet's (trainable) residuals.
    assert stage2_modules(split) == {"controlnet", "unet"}
