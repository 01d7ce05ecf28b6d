"""Conformance: Wan 2.1 text-to-video LoRA on a short clip (issue 10).

The step is written as diffusers writes Wan: ``WanPipeline._get_t5_prompt_embeds`` for the
UMT5 prompt states (ids and mask from the batch, per-sample trim to the mask then zero padding),
``AutoencoderKLWan`` on the clip normalised by the config's ``latents_mean`` / ``latents_std``,
and the flow-matching loop body of diffusers' SD3 / Flux training scripts (logit-normal density
sampling, ``sigmas`` indexed by the drawn indices). LoRA on the transformer's attention; UMT5
and the VAE are frozen, as ``from_pretrained`` returns them (eval mode).

The pipeline's trim-and-pad loop, ``[u[:v] for u, v in zip(prompt_embeds, seq_lens)]``, is a
Python loop over the samples with a tensor value as a slice bound: frozen, value-dependent code.
``_get_t5_prompt_embeds`` runs as one opaque stage-1 step (issue 11 item 2); it pads to the
fixed ``max_sequence_length``, so each sample's output is its own and the plan holds for every
batch size. The other tests use its tensor form, ``torch.where(mask, prompt_embeds, 0)`` (the
same numbers: the tokenizer already pads to ``max_sequence_length``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.conformance.matrix import ids_and_mask, stage2_modules
from tests.helpers import split_and_verify

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from diffusers.training_utils import compute_density_for_timestep_sampling  # noqa: E402

from graphsplit.planning.rules.opaque_call import OPAQUE, is_opaque  # noqa: E402

VOCAB = 64
MAX_SEQUENCE_LENGTH = 8


class WanTextToVideoLoRAStep(nn.Module):
    """Wan 2.1 T2V LoRA: UMT5 with mask, AutoencoderKLWan, WanTransformer3DModel."""

    def __init__(self, *, pipeline_trim_loop: bool = True) -> None:
        super().__init__()
        self.text_encoder = transformers.UMT5EncoderModel(
            transformers.UMT5Config(
                vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=2
            )
        )
        self.vae = diffusers.AutoencoderKLWan(
            base_dim=3,
            z_dim=16,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
        )
        for frozen in (self.text_encoder, self.vae):
            frozen.requires_grad_(False).eval()  # as from_pretrained returns them
        transformer = diffusers.WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=12,
            in_channels=16,
            out_channels=16,
            text_dim=32,
            freq_dim=256,
            ffn_dim=32,
            num_layers=2,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
        ).requires_grad_(False)
        transformer.add_adapter(
            peft.LoraConfig(
                r=4,
                lora_alpha=4,
                init_lora_weights="gaussian",
                target_modules=["to_q", "to_k", "to_v", "to_out.0"],
            )
        )
        for name, param in transformer.named_parameters():
            if "lora_B" in name:
                param.data.normal_(0.0, 0.02)  # peft's zeros would make lora_A's grads zero
        self.transformer = transformer
        self.noise_scheduler_copy = diffusers.FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000, shift=3.0
        )
        self.pipeline_trim_loop = pipeline_trim_loop

    def _get_t5_prompt_embeds(self, text_input_ids, mask, max_sequence_length):
        """``WanPipeline._get_t5_prompt_embeds`` after its tokenizer call."""
        seq_lens = mask.gt(0).sum(dim=1).long()
        prompt_embeds = self.text_encoder(text_input_ids, mask).last_hidden_state
        prompt_embeds = prompt_embeds.to(dtype=torch.float32)
        if not self.pipeline_trim_loop:
            return torch.where(mask.gt(0)[..., None], prompt_embeds, 0.0)
        prompt_embeds = [u[:v] for u, v in zip(prompt_embeds, seq_lens)]
        prompt_embeds = torch.stack(
            [
                torch.cat([u, u.new_zeros(max_sequence_length - u.size(0), u.size(1))])
                for u in prompt_embeds
            ],
            dim=0,
        )
        return prompt_embeds

    def forward(self, video, input_ids, attention_mask):
        prompt_embeds = self._get_t5_prompt_embeds(input_ids, attention_mask, MAX_SEQUENCE_LENGTH)
        latents = self.vae.encode(video).latent_dist.sample()
        latents_mean = (
            torch.tensor(self.vae.config.latents_mean)
            .view(1, self.vae.config.z_dim, 1, 1, 1)
            .to(latents.device, latents.dtype)
        )
        latents_std = 1.0 / torch.tensor(self.vae.config.latents_std).view(
            1, self.vae.config.z_dim, 1, 1, 1
        ).to(latents.device, latents.dtype)
        latents = (latents - latents_mean) * latents_std
        noise = torch.randn_like(latents)
        bsz = latents.shape[0]
        u = compute_density_for_timestep_sampling(
            weighting_scheme="logit_normal",
            batch_size=bsz,
            logit_mean=0.0,
            logit_std=1.0,
            mode_scale=1.29,
        )
        indices = (u * self.noise_scheduler_copy.config.num_train_timesteps).long()
        timesteps = self.noise_scheduler_copy.timesteps[indices].to(device=latents.device)
        sigmas = self.noise_scheduler_copy.sigmas.to(dtype=latents.dtype)[indices].flatten()
        while len(sigmas.shape) < latents.ndim:
            sigmas = sigmas.unsqueeze(-1)
        noisy_model_input = (1.0 - sigmas) * latents + sigmas * noise
        model_pred = self.transformer(
            hidden_states=noisy_model_input,
            timestep=timesteps,
            encoder_hidden_states=prompt_embeds,
            return_dict=False,
        )[0]
        target = noise - latents
        return F.mse_loss(model_pred.float(), target.float())


def _batch(size: int) -> tuple[torch.Tensor, ...]:
    ids, mask = ids_and_mask(size, tokens=MAX_SEQUENCE_LENGTH, vocab=VOCAB)
    video = torch.rand(size, 3, 5, 16, 16) * 2 - 1  # 5 frames -> 2 latent frames
    return video, ids, mask


def test_wan_with_the_pipeline_trim_loop():
    torch.manual_seed(0)
    split = split_and_verify(WanTextToVideoLoRAStep(), _batch(2))
    assert stage2_modules(split) == {"transformer"}
    (node,) = [node for node in split.graph.nodes if is_opaque(node)]
    assert node.meta[OPAQUE].label == "WanTextToVideoLoRAStep._get_t5_prompt_embeds"
    assert node.meta[OPAQUE].batch_dims == (0,)  # padded to a fixed length: one row per sample
    assert node in split.cut.stage1 and node not in split.cut.stage2


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 3])
def test_wan_t2v_lora_caches_umt5_and_the_video_vae(size):
    torch.manual_seed(0)
    split = split_and_verify(WanTextToVideoLoRAStep(pipeline_trim_loop=False), _batch(size))
    assert stage2_modules(split) == {"transformer"}
