"""Conformance: Flux Control LoRA, diffusers' ``examples/flux-control/train_control_lora_flux.py``
loop body, as a closure.

The script's models (``main()``): a frozen VAE and ``FluxTransformer2DModel`` whose
``x_embedder`` is replaced by a Linear of twice the input features (the new half zero, the old
half copied; ``register_to_config(in_channels=initial_input_channels * 2, ...)``), then a LoRA
adapter on the script's default ``target_modules`` (``x_embedder`` and the attention and
feed-forward projections) with ``init_lora_weights=True``; the text encoders sit in a
``FluxControlPipeline`` built with ``transformer=None, vae=None`` (the script's
``text_encoding_pipeline``), called on the batch's caption strings. The batch is the script's
``collate_fn`` output: ``pixel_values``, ``conditioning_pixel_values`` and ``captions``.

The loop body is copied from the script: both images encoded by the script's
``encode_images`` (``latent_dist.sample()``, shift and scaling factor), the flow-matching noise
and ``compute_density_for_timestep_sampling`` timesteps, ``get_sigmas`` (``.nonzero().item()``
per timestep), the control latents concatenated to the noisy latents *on the channels*
(``torch.cat([noisy_model_input, control_latents], dim=1)``), ``_pack_latents``,
``_prepare_latent_image_ids``, the guidance vector, ``text_encoding_pipeline.encode_prompt``
under ``torch.no_grad()``, the prediction unpacked and the weighted flow-matching loss.
Changes: ``accelerator`` is a stand-in (one process, the CPU), ``--offload`` is off, and the
backward, clipping, optimizer and logging lines that follow the loss are the caller's.

What must hold: the step splits exactly (loss and every LoRA gradient bit for bit, on the
example and on a batch of another size), the VAE's latent distribution of both images and
the two text encoders' outputs are cached (their weights are not held by stage 2), and a cache
written through the disk trains stage 2 exactly.

Tiny configs: diffusers' ``tests/pipelines/flux/test_pipeline_flux_control.py`` components
(1 + 1 blocks, latent channels 1, VAE scale factor 1, so 4 packed channels, 8 with the
control), ``guidance_embeds=True`` (as FLUX.1-dev's), a 2-layer T5, real word-level
tokenizers, 16 px.
"""

from __future__ import annotations

import copy
import random
import types

import pytest
import torch

import graphsplit
from tests.helpers import assert_stage1_holds_no_trainable

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
from diffusers import FluxControlPipeline  # noqa: E402
from diffusers.training_utils import (  # noqa: E402
    compute_density_for_timestep_sampling,
    compute_loss_weighting_for_sd3,
)

from tests.conformance.unseen2_data_checks import assert_cache_round_trip  # noqa: E402
from tests.conformance.unseen_checks import stage2_top_modules, word_tokenizer  # noqa: E402

WORDS = ["a", "photo", "of", "red", "blue", "dog", "cat", "in", "the", "snow", "canny"]
RESOLUTION = 16
MAX_SEQUENCE_LENGTH = 512  # encode_prompt's default, as the script calls it


def encode_images(pixels: torch.Tensor, vae: torch.nn.Module, weight_dtype):
    """The script's, verbatim."""
    pixel_latents = vae.encode(pixels.to(vae.dtype)).latent_dist.sample()
    pixel_latents = (pixel_latents - vae.config.shift_factor) * vae.config.scaling_factor
    return pixel_latents.to(weight_dtype)


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
    captions = [example["captions"] for example in examples]
    return {
        "pixel_values": pixel_values,
        "conditioning_pixel_values": conditioning_pixel_values,
        "captions": captions,
    }


def _models():
    """diffusers' Flux pipeline test components (``guidance_embeds`` on)."""
    torch.manual_seed(0)
    transformer = diffusers.FluxTransformer2DModel(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8],
        guidance_embeds=True,
    )
    torch.manual_seed(0)
    text_encoder = transformers.CLIPTextModel(
        transformers.CLIPTextConfig(
            bos_token_id=0,
            eos_token_id=2,
            hidden_size=32,
            intermediate_size=37,
            layer_norm_eps=1e-05,
            num_attention_heads=4,
            num_hidden_layers=2,
            pad_token_id=1,
            vocab_size=len(WORDS) + 3,
            hidden_act="gelu",
            projection_dim=32,
        )
    )
    torch.manual_seed(0)
    text_encoder_2 = transformers.T5EncoderModel(
        transformers.T5Config(
            vocab_size=len(WORDS) + 3,
            d_model=32,
            d_kv=8,
            d_ff=37,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
        )
    )
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(
        sample_size=32,
        in_channels=3,
        out_channels=3,
        block_out_channels=(4,),
        layers_per_block=1,
        latent_channels=1,
        norm_num_groups=1,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
    )
    for model in (transformer, vae, text_encoder, text_encoder_2):
        model.eval()  # as from_pretrained returns them
    tokenizer = word_tokenizer(WORDS)
    tokenizer.model_max_length = 77  # CLIP's
    tokenizer_2 = word_tokenizer(WORDS)
    text_encoding_pipeline = FluxControlPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
        vae=None,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=None,
    )
    return transformer, vae, text_encoding_pipeline


def build():
    """``main()``'s models (fp32, one process) and the loop body as a closure."""
    flux_transformer, vae, text_encoding_pipeline = _models()
    args = types.SimpleNamespace(
        rank=4,
        use_lora_bias=False,
        lora_layers=None,
        gaussian_init_lora=False,
        train_norm_layers=False,
        offload=False,
        weighting_scheme="none",
        logit_mean=0.0,
        logit_std=1.0,
        mode_scale=1.29,
        guidance_scale=3.5,
        proportion_empty_prompts=0,
    )
    accelerator = types.SimpleNamespace(device=torch.device("cpu"), unwrap_model=lambda m: m)
    vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)
    noise_scheduler = diffusers.FlowMatchEulerDiscreteScheduler()
    noise_scheduler_copy = copy.deepcopy(noise_scheduler)
    vae.requires_grad_(False)
    flux_transformer.requires_grad_(False)
    text_encoding_pipeline.text_encoder.requires_grad_(False)
    text_encoding_pipeline.text_encoder_2.requires_grad_(False)
    weight_dtype = torch.float32

    # enable image inputs
    with torch.no_grad():
        initial_input_channels = flux_transformer.config.in_channels
        new_linear = torch.nn.Linear(
            flux_transformer.x_embedder.in_features * 2,
            flux_transformer.x_embedder.out_features,
            bias=flux_transformer.x_embedder.bias is not None,
            dtype=flux_transformer.dtype,
            device=flux_transformer.device,
        )
        new_linear.weight.zero_()
        new_linear.weight[:, :initial_input_channels].copy_(flux_transformer.x_embedder.weight)
        if flux_transformer.x_embedder.bias is not None:
            new_linear.bias.copy_(flux_transformer.x_embedder.bias)
        flux_transformer.x_embedder = new_linear

    assert torch.all(flux_transformer.x_embedder.weight[:, initial_input_channels:].data == 0)
    flux_transformer.register_to_config(
        in_channels=initial_input_channels * 2, out_channels=initial_input_channels
    )

    target_modules = [
        "x_embedder",
        "attn.to_k",
        "attn.to_q",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_k_proj",
        "attn.add_q_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
    ]
    transformer_lora_config = peft.LoraConfig(
        r=args.rank,
        lora_alpha=args.rank,
        init_lora_weights="gaussian" if args.gaussian_init_lora else True,
        target_modules=target_modules,
        lora_bias=args.use_lora_bias,
    )
    torch.manual_seed(1)
    flux_transformer.add_adapter(transformer_lora_config)
    with torch.no_grad():  # as after some steps: lora_B starts at zero
        for name, param in flux_transformer.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.02)

    def unwrap_model(model):
        model = accelerator.unwrap_model(model)
        return model

    def get_sigmas(timesteps, n_dim=4, dtype=torch.float32):
        sigmas = noise_scheduler_copy.sigmas.to(device=accelerator.device, dtype=dtype)
        schedule_timesteps = noise_scheduler_copy.timesteps.to(accelerator.device)
        timesteps = timesteps.to(accelerator.device)
        step_indices = [(schedule_timesteps == t).nonzero().item() for t in timesteps]

        sigma = sigmas[step_indices].flatten()
        while len(sigma.shape) < n_dim:
            sigma = sigma.unsqueeze(-1)
        return sigma

    flux_transformer.train()

    def training_step(batch):
        nonlocal text_encoding_pipeline
        # Convert images to latent space
        # vae encode
        pixel_latents = encode_images(
            batch["pixel_values"], vae.to(accelerator.device), weight_dtype
        )
        control_latents = encode_images(
            batch["conditioning_pixel_values"], vae.to(accelerator.device), weight_dtype
        )

        if args.offload:
            # offload vae to CPU.
            vae.cpu()

        # Sample a random timestep for each image
        # for weighting schemes where we sample timesteps non-uniformly
        bsz = pixel_latents.shape[0]
        noise = torch.randn_like(pixel_latents, device=accelerator.device, dtype=weight_dtype)
        u = compute_density_for_timestep_sampling(
            weighting_scheme=args.weighting_scheme,
            batch_size=bsz,
            logit_mean=args.logit_mean,
            logit_std=args.logit_std,
            mode_scale=args.mode_scale,
        )
        indices = (u * noise_scheduler_copy.config.num_train_timesteps).long()
        timesteps = noise_scheduler_copy.timesteps[indices].to(device=pixel_latents.device)

        # Add noise according to flow matching.
        sigmas = get_sigmas(timesteps, n_dim=pixel_latents.ndim, dtype=pixel_latents.dtype)
        noisy_model_input = (1.0 - sigmas) * pixel_latents + sigmas * noise
        # Concatenate across channels.
        # Question: Should we concatenate before adding noise?
        concatenated_noisy_model_input = torch.cat([noisy_model_input, control_latents], dim=1)

        # pack the latents.
        packed_noisy_model_input = FluxControlPipeline._pack_latents(
            concatenated_noisy_model_input,
            batch_size=bsz,
            num_channels_latents=concatenated_noisy_model_input.shape[1],
            height=concatenated_noisy_model_input.shape[2],
            width=concatenated_noisy_model_input.shape[3],
        )

        # latent image ids for RoPE.
        latent_image_ids = FluxControlPipeline._prepare_latent_image_ids(
            bsz,
            concatenated_noisy_model_input.shape[2] // 2,
            concatenated_noisy_model_input.shape[3] // 2,
            accelerator.device,
            weight_dtype,
        )

        # handle guidance
        if unwrap_model(flux_transformer).config.guidance_embeds:
            guidance_vec = torch.full(
                (bsz,),
                args.guidance_scale,
                device=noisy_model_input.device,
                dtype=weight_dtype,
            )
        else:
            guidance_vec = None

        # text encoding.
        captions = batch["captions"]
        text_encoding_pipeline = text_encoding_pipeline.to(accelerator.device)
        with torch.no_grad():
            prompt_embeds, pooled_prompt_embeds, text_ids = text_encoding_pipeline.encode_prompt(
                captions, prompt_2=None
            )
        # this could be optimized by not having to do any text encoding and just
        # doing zeros on specified shapes for `prompt_embeds` and `pooled_prompt_embeds`
        if args.proportion_empty_prompts and random.random() < args.proportion_empty_prompts:
            prompt_embeds.zero_()
            pooled_prompt_embeds.zero_()
        if args.offload:
            text_encoding_pipeline = text_encoding_pipeline.to("cpu")

        # Predict.
        model_pred = flux_transformer(
            hidden_states=packed_noisy_model_input,
            timestep=timesteps / 1000,
            guidance=guidance_vec,
            pooled_projections=pooled_prompt_embeds,
            encoder_hidden_states=prompt_embeds,
            txt_ids=text_ids,
            img_ids=latent_image_ids,
            return_dict=False,
        )[0]
        model_pred = FluxControlPipeline._unpack_latents(
            model_pred,
            height=noisy_model_input.shape[2] * vae_scale_factor,
            width=noisy_model_input.shape[3] * vae_scale_factor,
            vae_scale_factor=vae_scale_factor,
        )
        # these weighting schemes use a uniform timestep sampling
        # and instead post-weight the loss
        weighting = compute_loss_weighting_for_sd3(
            weighting_scheme=args.weighting_scheme, sigmas=sigmas
        )

        # flow-matching loss
        target = noise - pixel_latents
        loss = torch.mean(
            (weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(
                target.shape[0], -1
            ),
            1,
        )
        loss = loss.mean()
        return loss

    params = [p for p in flux_transformer.parameters() if p.requires_grad]
    return types.SimpleNamespace(
        step=training_step,
        transformer=flux_transformer,
        vae=vae,
        text_encoding_pipeline=text_encoding_pipeline,
        params=params,
    )


def _example(index: int) -> dict:
    """``preprocess_train``'s sample: both images in [-1, 1] (the script normalises the
    conditioning image too) and the caption string."""
    generator = torch.Generator().manual_seed(300 + index)
    colour = ["red", "blue"][index % 2]
    animal = ["dog", "cat", "dog in the snow"][index % 3]
    return {
        "pixel_values": torch.rand(3, RESOLUTION, RESOLUTION, generator=generator) * 2 - 1,
        "conditioning_pixel_values": torch.rand(3, RESOLUTION, RESOLUTION, generator=generator) * 2
        - 1,
        "captions": f"a photo of a {colour} {animal}",
    }


def _batch(indices) -> dict:
    return collate_fn([_example(i) for i in indices])


_BUILT: list = []


def _built():
    if not _BUILT:
        parts = build()
        _BUILT.append((parts, graphsplit.split(parts.step, (_batch([0, 1]),))))
    return _BUILT[0]


def test_flux_control_step_verifies_on_the_example_and_another_size():
    parts, split = _built()
    assert parts.transformer.x_embedder.base_layer.in_features == 8
    assert_stage1_holds_no_trainable(split)
    for seed, batch in enumerate([_batch([0, 1]), _batch([2, 3, 4])]):
        checks = graphsplit.verify(parts.step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


def test_flux_control_caches_the_vae_and_the_text_encoders():
    parts, split = _built()
    # ``get_sigmas``'s ``.nonzero().item()``: the module-level path takes the step
    assert split.path == "calls"
    per_sample = {key: spec.shape[1:] for key, spec in split.boundary.items()}
    # both images' latent distributions (mean and log-variance of 1 channel, 16 x 16)
    assert per_sample["vae_encoder__0__out"] == (2, 16, 16)
    assert per_sample["vae_encoder__1__out"] == (2, 16, 16)
    assert per_sample["text_encoding_pipeline_text_encoder__0__pooler_output"] == (32,)
    assert per_sample["text_encoding_pipeline_text_encoder_2__0__last_hidden_state"] == (
        MAX_SEQUENCE_LENGTH,
        32,
    )
    assert "pixel_values" not in split.boundary
    assert "conditioning_pixel_values" not in split.boundary
    assert "flux_transformer" in stage2_top_modules(split)
    trainable = {n for n, p in split.stage2.named_parameters() if p.requires_grad}
    assert trainable == {
        f"flux_transformer.{n}" for n, p in parts.transformer.named_parameters() if p.requires_grad
    }


def test_flux_control_stage2_holds_no_frozen_encoder_weights():
    """Every call of ``vae.encoder`` and of both text encoders is answered from the cache. The
    step's ``vae.to(accelerator.device)`` and ``text_encoding_pipeline.to(accelerator.device)``
    (moves to where the modules already are) used to count as computing with every weight, so
    stage 2 held them; a move that returns the very tensor computes nothing."""
    _parts, split = _built()
    stage2 = {name for name, _ in split.stage2.named_parameters()}
    held = sorted(n for n in stage2 if n.startswith(("text_encoding_pipeline", "vae.encoder")))
    assert not held, held[:3]


def test_flux_control_cache_round_trip(tmp_path):
    parts, split = _built()
    loader = [_batch([4, 5]), _batch([6, 7, 8]), _batch([9])]
    assert_cache_round_trip(split, parts.step, loader, tmp_path / "cache", parts.params)
