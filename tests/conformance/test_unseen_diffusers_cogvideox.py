"""Conformance: ``examples/cogvideo/train_cogvideox_lora.py``'s training step.

The script encodes every video with the CogVideoX VAE before training and its ``collate_fn``
samples the latent distributions; the loop body then tokenizes the batch's *strings* and runs
the frozen T5 encoder under ``torch.no_grad()`` (``compute_prompt_embeddings``), computes the
3-D rotary embeddings from the sizes (``prepare_rotary_positional_embeddings``, the number of
frames read off the batch's shape), and trains a LoRA CogVideoX transformer on the
v-prediction loss weighted by ``1 / (1 - alphas_cumprod)``. The models are ``main()``'s locals.
Stage 1 must hold the tokenizer and T5; stage 2 the transformer alone.
"""

from __future__ import annotations

import types
from typing import Optional, Tuple, Union  # noqa: UP035 (the script's annotations)

import pytest
import torch

import graphsplit
from tests.helpers import line_of, split_and_verify

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
from diffusers.models.embeddings import get_3d_rotary_pos_embed  # noqa: E402
from diffusers.pipelines.cogvideo.pipeline_cogvideox import (  # noqa: E402
    get_resize_crop_region_for_grid,
)
from transformers import T5EncoderModel, T5Tokenizer  # noqa: E402

from tests.conformance.unseen_checks import (  # noqa: E402
    stage2_top_modules,
    word_tokenizer,
)

WORDS = [
    "a",
    "dog",
    "runs",
    "on",
    "the",
    "beach",
    "cat",
    "jumps",
    "over",
    "red",
    "car",
    "in",
    "snow",
]


def _get_t5_prompt_embeds(
    tokenizer: T5Tokenizer,
    text_encoder: T5EncoderModel,
    prompt: Union[str, list[str]],  # noqa: UP007
    num_videos_per_prompt: int = 1,
    max_sequence_length: int = 226,
    device: Optional[torch.device] = None,  # noqa: UP045
    dtype: Optional[torch.dtype] = None,  # noqa: UP045
    text_input_ids=None,
):
    """The script's ``_get_t5_prompt_embeds``, verbatim."""
    prompt = [prompt] if isinstance(prompt, str) else prompt
    batch_size = len(prompt)

    if tokenizer is not None:
        text_inputs = tokenizer(
            prompt,
            padding="max_length",
            max_length=max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_tensors="pt",
        )
        text_input_ids = text_inputs.input_ids
    else:
        if text_input_ids is None:
            raise ValueError(
                "`text_input_ids` must be provided when the tokenizer is not specified."
            )

    prompt_embeds = text_encoder(text_input_ids.to(device))[0]
    prompt_embeds = prompt_embeds.to(dtype=dtype, device=device)

    # duplicate text embeddings for each generation per prompt, using mps friendly method
    _, seq_len, _ = prompt_embeds.shape
    prompt_embeds = prompt_embeds.repeat(1, num_videos_per_prompt, 1)
    prompt_embeds = prompt_embeds.view(batch_size * num_videos_per_prompt, seq_len, -1)

    return prompt_embeds


def encode_prompt(
    tokenizer: T5Tokenizer,
    text_encoder: T5EncoderModel,
    prompt: Union[str, list[str]],  # noqa: UP007
    num_videos_per_prompt: int = 1,
    max_sequence_length: int = 226,
    device: Optional[torch.device] = None,  # noqa: UP045
    dtype: Optional[torch.dtype] = None,  # noqa: UP045
    text_input_ids=None,
):
    """The script's ``encode_prompt``, verbatim."""
    prompt = [prompt] if isinstance(prompt, str) else prompt
    prompt_embeds = _get_t5_prompt_embeds(
        tokenizer,
        text_encoder,
        prompt=prompt,
        num_videos_per_prompt=num_videos_per_prompt,
        max_sequence_length=max_sequence_length,
        device=device,
        dtype=dtype,
        text_input_ids=text_input_ids,
    )
    return prompt_embeds


def compute_prompt_embeddings(
    tokenizer, text_encoder, prompt, max_sequence_length, device, dtype, requires_grad: bool = False
):
    """The script's ``compute_prompt_embeddings``, verbatim."""
    if requires_grad:
        prompt_embeds = encode_prompt(
            tokenizer,
            text_encoder,
            prompt,
            num_videos_per_prompt=1,
            max_sequence_length=max_sequence_length,
            device=device,
            dtype=dtype,
        )
    else:
        with torch.no_grad():
            prompt_embeds = encode_prompt(
                tokenizer,
                text_encoder,
                prompt,
                num_videos_per_prompt=1,
                max_sequence_length=max_sequence_length,
                device=device,
                dtype=dtype,
            )
    return prompt_embeds


def prepare_rotary_positional_embeddings(
    height: int,
    width: int,
    num_frames: int,
    vae_scale_factor_spatial: int = 8,
    patch_size: int = 2,
    attention_head_dim: int = 64,
    device: Optional[torch.device] = None,  # noqa: UP045
    base_height: int = 480,
    base_width: int = 720,
) -> Tuple[torch.Tensor, torch.Tensor]:  # noqa: UP006
    """The script's ``prepare_rotary_positional_embeddings``, verbatim."""
    grid_height = height // (vae_scale_factor_spatial * patch_size)
    grid_width = width // (vae_scale_factor_spatial * patch_size)
    base_size_width = base_width // (vae_scale_factor_spatial * patch_size)
    base_size_height = base_height // (vae_scale_factor_spatial * patch_size)

    grid_crops_coords = get_resize_crop_region_for_grid(
        (grid_height, grid_width), base_size_width, base_size_height
    )
    freqs_cos, freqs_sin = get_3d_rotary_pos_embed(
        embed_dim=attention_head_dim,
        crops_coords=grid_crops_coords,
        grid_size=(grid_height, grid_width),
        temporal_size=num_frames,
        device=device,
    )

    return freqs_cos, freqs_sin


def _models(seed: int = 0):
    torch.manual_seed(seed)
    vae = diffusers.AutoencoderKLCogVideoX(
        in_channels=3,
        out_channels=3,
        down_block_types=("CogVideoXDownBlock3D",) * 4,
        up_block_types=("CogVideoXUpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=2,
        temporal_compression_ratio=4,
    )
    text_encoder = T5EncoderModel(
        transformers.T5Config(vocab_size=32, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4)
    )
    transformer = diffusers.CogVideoXTransformer3DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        time_embed_dim=2,
        text_embed_dim=32,
        num_layers=1,
        sample_width=4,
        sample_height=4,
        sample_frames=9,
        patch_size=2,
        temporal_compression_ratio=4,
        max_text_seq_length=16,
        use_rotary_positional_embeddings=True,
    )
    # The CogVideoX-2b scheduler config.
    scheduler = diffusers.CogVideoXDPMScheduler(
        beta_schedule="scaled_linear",
        prediction_type="v_prediction",
        rescale_betas_zero_snr=True,
        snr_shift_scale=3.0,
        timestep_spacing="trailing",
        clip_sample=False,
        set_alpha_to_one=True,
    )
    for model in (vae, text_encoder, transformer):
        model.eval()  # as from_pretrained returns them (T5's dropout is off)
    text_encoder.requires_grad_(False)
    transformer.requires_grad_(False)
    vae.requires_grad_(False)
    transformer_lora_config = peft.LoraConfig(
        r=4,
        lora_alpha=4,
        init_lora_weights=True,
        target_modules=["to_k", "to_q", "to_v", "to_out.0"],
    )
    transformer.add_adapter(transformer_lora_config)
    with torch.no_grad():  # peft's zero lora_B would make every lora_A gradient zero
        for name, param in transformer.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.02)
    return vae, text_encoder, transformer, scheduler


def build(seed: int = 0):
    """``main()``: models, the videos encoded up front, ``collate_fn``, the loop body."""
    vae, text_encoder, transformer, scheduler = _models(seed)
    tokenizer = word_tokenizer(WORDS)
    args = types.SimpleNamespace(height=32, width=32)
    weight_dtype = torch.float32
    device = torch.device("cpu")

    def encode_video(video):
        video = video.to(device, dtype=vae.dtype).unsqueeze(0)
        video = video.permute(0, 2, 1, 3, 4)  # [B, C, F, H, W]
        latent_dist = vae.encode(video).latent_dist
        return latent_dist

    generator = torch.Generator().manual_seed(seed)
    prompts = [" ".join(WORDS[i : i + 4]) for i in range(4)]
    instance_videos = [torch.rand(9, 3, 32, 32, generator=generator) * 2 - 1 for _ in prompts]
    with torch.no_grad():
        encoded_videos = [encode_video(video) for video in instance_videos]
    dataset = [
        {"instance_video": video, "instance_prompt": prompt}
        for video, prompt in zip(encoded_videos, prompts, strict=True)
    ]

    def collate_fn(examples):
        videos = [
            example["instance_video"].sample() * vae.config.scaling_factor for example in examples
        ]
        prompts = [example["instance_prompt"] for example in examples]

        videos = torch.cat(videos)
        videos = videos.permute(0, 2, 1, 3, 4)
        videos = videos.to(memory_format=torch.contiguous_format).float()

        return {
            "videos": videos,
            "prompts": prompts,
        }

    vae_scale_factor_spatial = 2 ** (len(vae.config.block_out_channels) - 1)
    model_config = (
        transformer.module.config if hasattr(transformer, "module") else transformer.config
    )

    def training_step(batch):
        model_input = batch["videos"].to(dtype=weight_dtype)  # [B, F, C, H, W]
        prompts = batch["prompts"]

        # encode prompts
        prompt_embeds = compute_prompt_embeddings(
            tokenizer,
            text_encoder,
            prompts,
            model_config.max_text_seq_length,
            device,
            weight_dtype,
            requires_grad=False,
        )

        # Sample noise that will be added to the latents
        noise = torch.randn_like(model_input)
        batch_size, num_frames, num_channels, height, width = model_input.shape  # noqa: RUF059

        # Sample a random timestep for each image
        timesteps = torch.randint(
            0, scheduler.config.num_train_timesteps, (batch_size,), device=model_input.device
        )
        timesteps = timesteps.long()

        # Prepare rotary embeds
        image_rotary_emb = (
            prepare_rotary_positional_embeddings(
                height=args.height,
                width=args.width,
                num_frames=num_frames,
                vae_scale_factor_spatial=vae_scale_factor_spatial,
                patch_size=model_config.patch_size,
                attention_head_dim=model_config.attention_head_dim,
                device=device,
            )
            if model_config.use_rotary_positional_embeddings
            else None
        )

        # Add noise to the model input according to the noise magnitude at each timestep
        # (this is the forward diffusion process)
        noisy_model_input = scheduler.add_noise(model_input, noise, timesteps)

        # Predict the noise residual
        model_output = transformer(
            hidden_states=noisy_model_input,
            encoder_hidden_states=prompt_embeds,
            timestep=timesteps,
            image_rotary_emb=image_rotary_emb,
            return_dict=False,
        )[0]
        model_pred = scheduler.get_velocity(model_output, noisy_model_input, timesteps)

        alphas_cumprod = scheduler.alphas_cumprod[timesteps]
        weights = 1 / (1 - alphas_cumprod)
        while len(weights.shape) < len(model_pred.shape):
            weights = weights.unsqueeze(-1)

        target = model_input

        loss = torch.mean((weights * (model_pred - target) ** 2).reshape(batch_size, -1), dim=1)
        loss = loss.mean()
        return loss

    return types.SimpleNamespace(
        step=training_step, transformer=transformer, dataset=dataset, collate_fn=collate_fn
    )


def _first_batch(parts):
    torch.manual_seed(0)
    return parts.collate_fn(parts.dataset[:2])


def test_the_trace_refuses_the_tokenizer_on_traced_strings_naming_the_line():
    """The tokenizer's Rust core needs real text: a typed TraceError at the script's line."""
    parts = build()
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(parts.step, (_first_batch(parts),), path="trace")
    message = str(caught.value)
    assert line_of(_get_t5_prompt_embeds, "text_inputs = tokenizer(") in message
    assert "the step passed a batch field of strings to code that needs the real text" in message
    assert "tokenize in the data pipeline (the collate function)" in message


def test_auto_takes_the_module_level_path_caches_t5_and_verifies_exactly():
    parts = build()
    batch = _first_batch(parts)
    split = split_and_verify(parts.step, (batch,))
    assert split.path == "calls"
    assert line_of(_get_t5_prompt_embeds, "text_inputs = tokenizer(") in split.reason
    assert stage2_top_modules(split) == {"transformer"}
    assert any(key.startswith("text_encoder") for key in split.boundary)


def test_the_module_level_plan_carries_each_batchs_own_prompts_exactly():
    """The prompts cross the boundary (as code points) and stage 2 gets the very strings back:
    a batch with other captions trains as the step does on it, loss and gradients bit for bit
    (they were a constant of the plan before, refused on any other batch)."""
    parts = build()
    split = graphsplit.split(parts.step, (_first_batch(parts),))
    assert split.boundary["prompts"].dtype == torch.int32
    torch.manual_seed(1)
    other = parts.collate_fn(parts.dataset[2:4])
    assert other["prompts"] != _first_batch(parts)["prompts"]
    comparisons = graphsplit.verify(parts.step, split, (other,), seed=3)
    assert comparisons and all(c.ok for c in comparisons)
