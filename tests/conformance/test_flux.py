"""Conformance: a Flux full fine-tune as ``train_dreambooth_flux.py`` writes its step (issue 10).

CLIP (pooled) and T5 text encoders, a VAE with shift and scaling factors, packed latents,
latent image ids, logit-normal timestep density sampling, guidance embeds, and the script's
own ``get_sigmas``. The transformer trains fully; VAE and both text encoders are frozen.

The script's ``get_sigmas`` looks each timestep up with a per-sample Python loop,
``(schedule_timesteps == t).nonzero().item() for t in timesteps``, on timesteps drawn inside
the step: stage 2 would have to read tensor values every step, which no traced plan can do.
The first test checks the error names that line and the fix; the others apply the fix
(index ``sigmas`` with the drawn ``indices``, the same numbers).

The script passes the batch's list of prompt strings to ``encode_prompt``, whose helpers take
the batch size from ``len(prompt)``: a traced length, which follows the batch like
``x.shape[0]`` (the probe batches grow the list with the tensors). The full fine-tune tests
also run without ``prompts`` (left at ``None``), where the helpers take the batch size from
the token ids instead.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.conformance.matrix import ids_and_mask, stage2_modules
from tests.helpers import line_of, split_and_verify

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
from diffusers import FluxPipeline  # noqa: E402
from diffusers.training_utils import (  # noqa: E402
    compute_density_for_timestep_sampling,
    compute_loss_weighting_for_sd3,
)

import graphsplit  # noqa: E402

VOCAB = 64


def _encode_prompt_with_t5(
    text_encoder,
    tokenizer,
    max_sequence_length=512,
    prompt=None,
    num_images_per_prompt=1,
    device=None,
    text_input_ids=None,
):
    prompt = [prompt] if isinstance(prompt, str) else prompt
    batch_size = len(prompt) if prompt is not None else text_input_ids.shape[0]  # see module doc
    prompt_embeds = text_encoder(text_input_ids.to(device))[0]
    dtype = text_encoder.dtype
    prompt_embeds = prompt_embeds.to(dtype=dtype, device=device)
    _, seq_len, _ = prompt_embeds.shape
    # duplicate text embeddings and attention mask for each generation per prompt
    prompt_embeds = prompt_embeds.repeat(1, num_images_per_prompt, 1)
    prompt_embeds = prompt_embeds.view(batch_size * num_images_per_prompt, seq_len, -1)
    return prompt_embeds


def _encode_prompt_with_clip(
    text_encoder, tokenizer, prompt, device=None, text_input_ids=None, num_images_per_prompt=1
):
    prompt = [prompt] if isinstance(prompt, str) else prompt
    batch_size = len(prompt) if prompt is not None else text_input_ids.shape[0]  # see module doc
    prompt_embeds = text_encoder(text_input_ids.to(device), output_hidden_states=False)
    # Use pooled output of CLIPTextModel
    prompt_embeds = prompt_embeds.pooler_output
    prompt_embeds = prompt_embeds.to(dtype=text_encoder.dtype, device=device)
    # duplicate text embeddings for each generation per prompt, using mps friendly method
    prompt_embeds = prompt_embeds.repeat(1, num_images_per_prompt, 1)
    prompt_embeds = prompt_embeds.view(batch_size * num_images_per_prompt, -1)
    return prompt_embeds


def encode_prompt(
    text_encoders,
    tokenizers,
    prompt,
    max_sequence_length,
    device=None,
    num_images_per_prompt=1,
    text_input_ids_list=None,
):
    """The script's ``encode_prompt`` (tokenizer branches dropped: the batch holds token ids)."""
    prompt = [prompt] if isinstance(prompt, str) else prompt
    dtype = text_encoders[0].dtype
    pooled_prompt_embeds = _encode_prompt_with_clip(
        text_encoder=text_encoders[0],
        tokenizer=tokenizers[0],
        prompt=prompt,
        device=device if device is not None else text_encoders[0].device,
        num_images_per_prompt=num_images_per_prompt,
        text_input_ids=text_input_ids_list[0] if text_input_ids_list else None,
    )
    prompt_embeds = _encode_prompt_with_t5(
        text_encoder=text_encoders[1],
        tokenizer=tokenizers[1],
        max_sequence_length=max_sequence_length,
        prompt=prompt,
        num_images_per_prompt=num_images_per_prompt,
        device=device if device is not None else text_encoders[1].device,
        text_input_ids=text_input_ids_list[1] if text_input_ids_list else None,
    )
    text_ids = torch.zeros(prompt_embeds.shape[1], 3).to(device=device, dtype=dtype)
    return prompt_embeds, pooled_prompt_embeds, text_ids


class FluxFineTuneStep(nn.Module):
    """The loop body of ``train_dreambooth_flux.py`` (no prior preservation)."""

    def __init__(self, *, sigmas_by_index: bool = False) -> None:
        super().__init__()
        self.vae = (
            diffusers.AutoencoderKL(
                block_out_channels=(8, 16),
                norm_num_groups=4,
                latent_channels=4,
                down_block_types=("DownEncoderBlock2D",) * 2,
                up_block_types=("UpDecoderBlock2D",) * 2,
                shift_factor=0.1159,
                scaling_factor=0.3611,
            )
            .requires_grad_(False)
            .eval()
        )  # as from_pretrained returns it
        self.text_encoder_one = (
            transformers.CLIPTextModel(
                transformers.CLIPTextConfig(
                    vocab_size=VOCAB,
                    hidden_size=32,
                    intermediate_size=64,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    max_position_embeddings=32,
                    eos_token_id=2,
                )
            )
            .requires_grad_(False)
            .eval()
        )  # as from_pretrained returns it
        self.text_encoder_two = (
            transformers.T5EncoderModel(
                transformers.T5Config(
                    vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=2
                )
            )
            .requires_grad_(False)
            .eval()
        )  # as from_pretrained returns it
        self.transformer = diffusers.FluxTransformer2DModel(
            patch_size=1,
            in_channels=16,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            guidance_embeds=True,
            axes_dims_rope=(4, 4, 8),
        )
        self.noise_scheduler_copy = diffusers.FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000, shift=3.0
        )
        self.device = torch.device("cpu")  # accelerator.device
        self.guidance_scale = 3.5
        self.sigmas_by_index = sigmas_by_index

    def get_sigmas(self, timesteps, n_dim=4, dtype=torch.float32):
        sigmas = self.noise_scheduler_copy.sigmas.to(device=self.device, dtype=dtype)
        schedule_timesteps = self.noise_scheduler_copy.timesteps.to(self.device)
        timesteps = timesteps.to(self.device)
        step_indices = [(schedule_timesteps == t).nonzero().item() for t in timesteps]
        sigma = sigmas[step_indices].flatten()
        while len(sigma.shape) < n_dim:
            sigma = sigma.unsqueeze(-1)
        return sigma

    def sigmas_at(self, indices, n_dim=4, dtype=torch.float32):
        """The fix: the timesteps were drawn as ``timesteps[indices]``, so ``sigmas[indices]``."""
        sigma = self.noise_scheduler_copy.sigmas.to(device=self.device, dtype=dtype)[indices]
        return sigma.flatten().reshape(-1, *([1] * (n_dim - 1)))

    def forward(self, pixel_values, tokens_one, tokens_two, prompts=None):
        weight_dtype = torch.float32
        prompt_embeds, pooled_prompt_embeds, text_ids = encode_prompt(
            text_encoders=[self.text_encoder_one, self.text_encoder_two],
            tokenizers=[None, None],
            text_input_ids_list=[tokens_one, tokens_two],
            max_sequence_length=tokens_two.shape[1],
            device=self.device,
            prompt=prompts,
        )
        pixel_values = pixel_values.to(dtype=self.vae.dtype)
        model_input = self.vae.encode(pixel_values).latent_dist.sample()
        model_input = (model_input - self.vae.config.shift_factor) * self.vae.config.scaling_factor
        model_input = model_input.to(dtype=weight_dtype)
        vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        latent_image_ids = FluxPipeline._prepare_latent_image_ids(
            model_input.shape[0],
            model_input.shape[2] // 2,
            model_input.shape[3] // 2,
            self.device,
            weight_dtype,
        )
        noise = torch.randn_like(model_input)
        bsz = model_input.shape[0]
        u = compute_density_for_timestep_sampling(
            weighting_scheme="logit_normal",
            batch_size=bsz,
            logit_mean=0.0,
            logit_std=1.0,
            mode_scale=1.29,
        )
        indices = (u * self.noise_scheduler_copy.config.num_train_timesteps).long()
        timesteps = self.noise_scheduler_copy.timesteps[indices].to(device=model_input.device)
        if self.sigmas_by_index:
            sigmas = self.sigmas_at(indices, n_dim=model_input.ndim, dtype=model_input.dtype)
        else:
            sigmas = self.get_sigmas(timesteps, n_dim=model_input.ndim, dtype=model_input.dtype)
        noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
        packed_noisy_model_input = FluxPipeline._pack_latents(
            noisy_model_input,
            batch_size=model_input.shape[0],
            num_channels_latents=model_input.shape[1],
            height=model_input.shape[2],
            width=model_input.shape[3],
        )
        if self.transformer.config.guidance_embeds:
            guidance = torch.tensor([self.guidance_scale], device=self.device)
            guidance = guidance.expand(model_input.shape[0])
        else:
            guidance = None
        model_pred = self.transformer(
            hidden_states=packed_noisy_model_input,
            timestep=timesteps / 1000,
            guidance=guidance,
            pooled_projections=pooled_prompt_embeds,
            encoder_hidden_states=prompt_embeds,
            txt_ids=text_ids,
            img_ids=latent_image_ids,
            return_dict=False,
        )[0]
        model_pred = FluxPipeline._unpack_latents(
            model_pred,
            height=model_input.shape[2] * vae_scale_factor,
            width=model_input.shape[3] * vae_scale_factor,
            vae_scale_factor=vae_scale_factor,
        )
        weighting = compute_loss_weighting_for_sd3(weighting_scheme="logit_normal", sigmas=sigmas)
        target = noise - model_input
        loss = torch.mean(
            (weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(
                target.shape[0], -1
            ),
            1,
        )
        return loss.mean()


def _batch(size: int, *, with_prompts: bool = True) -> tuple:
    tokens_one, _ = ids_and_mask(size, vocab=VOCAB, seed=1)
    tokens_two, _ = ids_and_mask(size, vocab=VOCAB, seed=2)
    batch = (torch.randn(size, 3, 16, 16), tokens_one, tokens_two)
    if not with_prompts:
        return batch
    return (*batch, [f"a photo of sks dog number {i}" for i in range(size)])


def test_flux_get_sigmas_loop_over_timesteps_is_refused_at_its_line():
    torch.manual_seed(0)
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(FluxFineTuneStep(), _batch(2), path="trace")
    message = str(caught.value)
    assert line_of(FluxFineTuneStep.get_sigmas, "nonzero().item()") in message
    assert "fix:" in message and "replace .item()/.tolist()" in message


@pytest.mark.parametrize("size", [2, 3])
def test_flux_with_the_batch_prompt_list(size):
    torch.manual_seed(0)
    split = split_and_verify(FluxFineTuneStep(sigmas_by_index=True), _batch(size))
    assert stage2_modules(split) == {"transformer"}
    # batch_size = len(prompt) is read off the batch's prompt list by stage 1, not fixed at
    # the probe size; the strings themselves are not cached.
    assert "len(prompts)" in split.stage1.code
    assert "prompts" not in split.boundary


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 3])
def test_flux_full_fine_tune_caches_vae_and_both_text_encoders(size):
    torch.manual_seed(0)
    batch = _batch(size, with_prompts=False)
    split = split_and_verify(FluxFineTuneStep(sigmas_by_index=True), batch)
    assert stage2_modules(split) == {"transformer"}
