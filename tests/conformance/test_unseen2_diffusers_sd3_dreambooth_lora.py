"""Conformance: ``examples/dreambooth/train_dreambooth_lora_sd3.py``'s training step.

A LoRA on the SD3 ``SD3Transformer2DModel`` (the script's eight attention targets), the frozen
VAE with shift and scaling factors, three frozen text encoders (two CLIP with projection, one
T5) through the script's ``encode_prompt``, logit-normal timestep sampling
(``compute_density_for_timestep_sampling``), the script's ``get_sigmas`` and
``compute_loss_weighting_for_sd3``, EDM preconditioning (``--precondition_outputs=1``, the
default). The script has two ways to condition, both tested:

- ``--instance_prompt`` alone: the prompts are encoded once before the loop and the encoders
  deleted; the step reads ``prompt_embeds`` from ``main()``'s locals. With prior preservation
  the instance and class embeddings are concatenated, so one batch is one instance and one
  class image (``--train_batch_size=1``, as the concatenated embeddings fix).
- a ``--caption_column``: the step encodes the batch's own caption strings with
  ``compute_text_embeddings`` (tokenizers and encoders under ``torch.no_grad()``).

``get_sigmas`` finds each drawn timestep with ``(schedule_timesteps == t).nonzero().item()``:
no traced plan can hold a value read of a random draw, so ``path="auto"`` takes the
module-level path. Stage 1 must hold the VAE's encoder and, with captions, the three text
encoders; stage 2 the LoRA transformer alone.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch

import graphsplit
from tests.helpers import line_of, split_and_verify

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
from diffusers.training_utils import (  # noqa: E402
    compute_density_for_timestep_sampling,
    compute_loss_weighting_for_sd3,
)

from tests.conformance.unseen_checks import (  # noqa: E402
    assert_cache_round_trip,
    word_tokenizer,
)

WORDS = ["a", "photo", "of", "sks", "dog", "cat", "on", "the", "beach", "in", "snow", "red", "blue"]
CAPTIONS = [
    "a photo of sks dog on the beach",
    "a photo of sks dog in snow",
    "a red sks dog",
    "a blue sks dog on the beach",
]


def _encode_prompt_with_t5(
    text_encoder,
    tokenizer,
    max_sequence_length,
    prompt=None,
    num_images_per_prompt=1,
    device=None,
    text_input_ids=None,
):
    """The script's, verbatim."""
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
            raise ValueError("text_input_ids must be provided when the tokenizer is not specified")

    prompt_embeds = text_encoder(text_input_ids.to(device))[0]

    dtype = text_encoder.dtype
    prompt_embeds = prompt_embeds.to(dtype=dtype, device=device)

    _, seq_len, _ = prompt_embeds.shape

    # duplicate text embeddings and attention mask for each generation per prompt, using mps
    # friendly method
    prompt_embeds = prompt_embeds.repeat(1, num_images_per_prompt, 1)
    prompt_embeds = prompt_embeds.view(batch_size * num_images_per_prompt, seq_len, -1)

    return prompt_embeds


def _encode_prompt_with_clip(
    text_encoder,
    tokenizer,
    prompt: str,
    device=None,
    text_input_ids=None,
    num_images_per_prompt: int = 1,
):
    """The script's, verbatim (``max_length=77`` as the script writes it)."""
    prompt = [prompt] if isinstance(prompt, str) else prompt
    batch_size = len(prompt)

    if tokenizer is not None:
        text_inputs = tokenizer(
            prompt,
            padding="max_length",
            max_length=77,
            truncation=True,
            return_tensors="pt",
        )

        text_input_ids = text_inputs.input_ids
    else:
        if text_input_ids is None:
            raise ValueError("text_input_ids must be provided when the tokenizer is not specified")

    prompt_embeds = text_encoder(text_input_ids.to(device), output_hidden_states=True)

    pooled_prompt_embeds = prompt_embeds[0]
    prompt_embeds = prompt_embeds.hidden_states[-2]
    prompt_embeds = prompt_embeds.to(dtype=text_encoder.dtype, device=device)

    _, seq_len, _ = prompt_embeds.shape
    # duplicate text embeddings for each generation per prompt, using mps friendly method
    prompt_embeds = prompt_embeds.repeat(1, num_images_per_prompt, 1)
    prompt_embeds = prompt_embeds.view(batch_size * num_images_per_prompt, seq_len, -1)

    return prompt_embeds, pooled_prompt_embeds


def encode_prompt(
    text_encoders,
    tokenizers,
    prompt: str,
    max_sequence_length,
    device=None,
    num_images_per_prompt: int = 1,
    text_input_ids_list=None,
):
    """The script's, verbatim."""
    prompt = [prompt] if isinstance(prompt, str) else prompt

    clip_tokenizers = tokenizers[:2]
    clip_text_encoders = text_encoders[:2]

    clip_prompt_embeds_list = []
    clip_pooled_prompt_embeds_list = []
    for i, (tokenizer, text_encoder) in enumerate(zip(clip_tokenizers, clip_text_encoders)):
        prompt_embeds, pooled_prompt_embeds = _encode_prompt_with_clip(
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            prompt=prompt,
            device=device if device is not None else text_encoder.device,
            num_images_per_prompt=num_images_per_prompt,
            text_input_ids=text_input_ids_list[i] if text_input_ids_list else None,
        )
        clip_prompt_embeds_list.append(prompt_embeds)
        clip_pooled_prompt_embeds_list.append(pooled_prompt_embeds)

    clip_prompt_embeds = torch.cat(clip_prompt_embeds_list, dim=-1)
    pooled_prompt_embeds = torch.cat(clip_pooled_prompt_embeds_list, dim=-1)

    t5_prompt_embed = _encode_prompt_with_t5(
        text_encoders[-1],
        tokenizers[-1],
        max_sequence_length,
        prompt=prompt,
        num_images_per_prompt=num_images_per_prompt,
        text_input_ids=text_input_ids_list[-1] if text_input_ids_list else None,
        device=device if device is not None else text_encoders[-1].device,
    )

    clip_prompt_embeds = torch.nn.functional.pad(
        clip_prompt_embeds, (0, t5_prompt_embed.shape[-1] - clip_prompt_embeds.shape[-1])
    )
    prompt_embeds = torch.cat([clip_prompt_embeds, t5_prompt_embed], dim=-2)

    return prompt_embeds, pooled_prompt_embeds


def collate_fn(examples, with_prior_preservation=False):
    """The script's, verbatim."""
    pixel_values = [example["instance_images"] for example in examples]
    prompts = [example["instance_prompt"] for example in examples]

    # Concat class and instance examples for prior preservation.
    # We do this to avoid doing two forward passes.
    if with_prior_preservation:
        pixel_values += [example["class_images"] for example in examples]
        prompts += [example["class_prompt"] for example in examples]

    pixel_values = torch.stack(pixel_values)
    pixel_values = pixel_values.to(memory_format=torch.contiguous_format).float()

    batch = {"pixel_values": pixel_values, "prompts": prompts}
    return batch


def _clip(seed: int):
    torch.manual_seed(seed)
    return transformers.CLIPTextModelWithProjection(
        transformers.CLIPTextConfig(
            vocab_size=len(WORDS) + 3,
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=4,
            projection_dim=32,
            max_position_embeddings=77,
            eos_token_id=2,
        )
    )


def build(*, custom_instance_prompts: bool, with_prior_preservation: bool = False, rank: int = 4):
    """``main()``'s models (diffusers' tiny SD3 test configs) and the loop body as a closure."""
    tokenizer_one, tokenizer_two, tokenizer_three = (word_tokenizer(WORDS) for _ in range(3))
    text_encoder_one, text_encoder_two = _clip(1), _clip(2)
    torch.manual_seed(3)
    text_encoder_three = transformers.T5EncoderModel(
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
    torch.manual_seed(4)
    vae = diffusers.AutoencoderKL(
        block_out_channels=(32, 64),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
        norm_num_groups=32,
        sample_size=16,
        shift_factor=0.0609,
        scaling_factor=1.5035,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    torch.manual_seed(5)
    transformer = diffusers.SD3Transformer2DModel(
        sample_size=8,
        patch_size=1,
        in_channels=4,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_projection_dim=32,
        joint_attention_dim=32,
        pooled_projection_dim=64,
        out_channels=4,
    )
    noise_scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    noise_scheduler_copy = copy.deepcopy(noise_scheduler)
    args = types.SimpleNamespace(
        instance_prompt="a photo of sks dog",
        class_prompt="a photo of dog",
        with_prior_preservation=with_prior_preservation,
        prior_loss_weight=1.0,
        max_sequence_length=12,
        weighting_scheme="logit_normal",
        logit_mean=0.0,
        logit_std=1.0,
        mode_scale=1.29,
        precondition_outputs=1,
        rank=rank,
        lora_dropout=0.0,
    )
    for model in (transformer, vae, text_encoder_one, text_encoder_two, text_encoder_three):
        model.requires_grad_(False)
        model.eval()  # as from_pretrained returns them
    weight_dtype = torch.float32
    accelerator = types.SimpleNamespace(device=torch.device("cpu"))
    target_modules = [
        "attn.add_k_proj",
        "attn.add_q_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "attn.to_k",
        "attn.to_out.0",
        "attn.to_q",
        "attn.to_v",
    ]
    # now we will add new LoRA weights to the attention layers
    transformer_lora_config = peft.LoraConfig(
        r=args.rank,
        lora_alpha=args.rank,
        lora_dropout=args.lora_dropout,
        init_lora_weights="gaussian",
        target_modules=target_modules,
    )
    transformer.add_adapter(transformer_lora_config)
    with torch.no_grad():  # as after some steps: lora_B starts at zero
        for name, param in transformer.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.02)

    tokenizers = [tokenizer_one, tokenizer_two, tokenizer_three]
    text_encoders = [text_encoder_one, text_encoder_two, text_encoder_three]

    def compute_text_embeddings(prompt, text_encoders, tokenizers):
        with torch.no_grad():
            prompt_embeds, pooled_prompt_embeds = encode_prompt(
                text_encoders, tokenizers, prompt, args.max_sequence_length
            )
        return prompt_embeds, pooled_prompt_embeds

    prompt_embeds = pooled_prompt_embeds = None
    if not custom_instance_prompts:
        instance_prompt_hidden_states, instance_pooled_prompt_embeds = compute_text_embeddings(
            args.instance_prompt, text_encoders, tokenizers
        )
        prompt_embeds = instance_prompt_hidden_states
        pooled_prompt_embeds = instance_pooled_prompt_embeds
        if args.with_prior_preservation:
            class_prompt_hidden_states, class_pooled_prompt_embeds = compute_text_embeddings(
                args.class_prompt, text_encoders, tokenizers
            )
            prompt_embeds = torch.cat([prompt_embeds, class_prompt_hidden_states], dim=0)
            pooled_prompt_embeds = torch.cat(
                [pooled_prompt_embeds, class_pooled_prompt_embeds], dim=0
            )
        # Explicitly delete the objects as well, otherwise only the lists are deleted and the
        # original references remain, preventing garbage collection
        del tokenizers, text_encoders
        del text_encoder_one, text_encoder_two, text_encoder_three
    vae_config_shift_factor = vae.config.shift_factor
    vae_config_scaling_factor = vae.config.scaling_factor
    transformer.train()

    def get_sigmas(timesteps, n_dim=4, dtype=torch.float32):
        sigmas = noise_scheduler_copy.sigmas.to(device=accelerator.device, dtype=dtype)
        schedule_timesteps = noise_scheduler_copy.timesteps.to(accelerator.device)
        timesteps = timesteps.to(accelerator.device)
        step_indices = [(schedule_timesteps == t).nonzero().item() for t in timesteps]

        sigma = sigmas[step_indices].flatten()
        while len(sigma.shape) < n_dim:
            sigma = sigma.unsqueeze(-1)
        return sigma

    def training_step(batch):
        nonlocal prompt_embeds, pooled_prompt_embeds
        prompts = batch["prompts"]

        # encode batch prompts when custom prompts are provided for each image -
        if custom_instance_prompts:
            prompt_embeds, pooled_prompt_embeds = compute_text_embeddings(
                prompts, text_encoders, tokenizers
            )

        # Convert images to latent space
        pixel_values = batch["pixel_values"].to(dtype=vae.dtype)
        model_input = vae.encode(pixel_values).latent_dist.sample()

        model_input = (model_input - vae_config_shift_factor) * vae_config_scaling_factor
        model_input = model_input.to(dtype=weight_dtype)

        # Sample noise that we'll add to the latents
        noise = torch.randn_like(model_input)
        bsz = model_input.shape[0]

        # Sample a random timestep for each image
        # for weighting schemes where we sample timesteps non-uniformly
        u = compute_density_for_timestep_sampling(
            weighting_scheme=args.weighting_scheme,
            batch_size=bsz,
            logit_mean=args.logit_mean,
            logit_std=args.logit_std,
            mode_scale=args.mode_scale,
        )
        indices = (u * noise_scheduler_copy.config.num_train_timesteps).long()
        timesteps = noise_scheduler_copy.timesteps[indices].to(device=model_input.device)

        # Add noise according to flow matching.
        # zt = (1 - texp) * x + texp * z1
        sigmas = get_sigmas(timesteps, n_dim=model_input.ndim, dtype=model_input.dtype)
        noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise

        # Predict the noise residual
        model_pred = transformer(
            hidden_states=noisy_model_input,
            timestep=timesteps,
            encoder_hidden_states=prompt_embeds,
            pooled_projections=pooled_prompt_embeds,
            return_dict=False,
        )[0]

        # Follow: Section 5 of https://huggingface.co/papers/2206.00364.
        # Preconditioning of the model outputs.
        if args.precondition_outputs:
            model_pred = model_pred * (-sigmas) + noisy_model_input

        # these weighting schemes use a uniform timestep sampling
        # and instead post-weight the loss
        weighting = compute_loss_weighting_for_sd3(
            weighting_scheme=args.weighting_scheme, sigmas=sigmas
        )

        # flow matching loss
        if args.precondition_outputs:  # noqa: SIM108 (the script's)
            target = model_input
        else:
            target = noise - model_input

        if args.with_prior_preservation:
            # Chunk the noise and model_pred into two parts and compute the loss on each part
            # separately.
            model_pred, model_pred_prior = torch.chunk(model_pred, 2, dim=0)
            target, target_prior = torch.chunk(target, 2, dim=0)
            weighting, weighting_prior = torch.chunk(weighting, 2, dim=0)

            # Compute prior loss
            prior_loss = torch.mean(
                (
                    weighting_prior.float() * (model_pred_prior.float() - target_prior.float()) ** 2
                ).reshape(target_prior.shape[0], -1),
                1,
            )
            prior_loss = prior_loss.mean()

        # Compute regular loss.
        loss = torch.mean(
            (weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(
                target.shape[0], -1
            ),
            1,
        )
        loss = loss.mean()

        if args.with_prior_preservation:
            # Add the prior loss to the instance loss.
            loss = loss + args.prior_loss_weight * prior_loss
        return loss

    return types.SimpleNamespace(
        step=training_step, transformer=transformer, get_sigmas=get_sigmas, args=args
    )


def assert_stage2_trains_the_transformer_alone(split, transformer) -> None:
    """No text encoder and no VAE encoder weight in stage 2 (the module-level path keeps the
    VAE object, whose decoder the step never calls); every LoRA weight there."""
    held = {name for name, _ in split.stage2.named_parameters()}
    assert not any(name.startswith(("text_encoders", "vae.encoder")) for name in held)
    assert {name.split(".")[0] for name in held} <= {"transformer", "vae"}
    lora = {f"transformer.{name}" for name, p in transformer.named_parameters() if p.requires_grad}
    assert len(lora) == 14 and lora <= held  # seven targets (the last block has no to_add_out)


def _example(index: int, *, caption: bool, resolution: int = 16) -> dict:
    """``DreamBoothDataset.__getitem__``: an image in [-1, 1], its caption or the instance
    prompt, and the class image and prompt."""
    generator = torch.Generator().manual_seed(500 + index)
    return {
        "instance_images": torch.rand(3, resolution, resolution, generator=generator) * 2 - 1,
        "instance_prompt": CAPTIONS[index % len(CAPTIONS)] if caption else "a photo of sks dog",
        "class_images": torch.rand(3, resolution, resolution, generator=generator) * 2 - 1,
        "class_prompt": "a photo of dog",
    }


def _batch(indices, *, caption: bool, prior: bool = False) -> dict:
    return collate_fn([_example(i, caption=caption) for i in indices], prior)


def test_the_trace_refuses_get_sigmas_value_read_of_a_drawn_timestep():
    parts = build(custom_instance_prompts=False)
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(parts.step, (_batch([0], caption=False),), path="trace")
    assert line_of(parts.get_sigmas, "step_indices = [") in str(caught.value)


def test_instance_prompt_caches_the_vae():
    """Embeddings precomputed before the loop for the one instance prompt: their batch of one
    fixes ``--train_batch_size=1`` (the joint attention concatenates them with the latents)."""
    parts = build(custom_instance_prompts=False)
    split = split_and_verify(parts.step, (_batch([0], caption=False),))
    assert split.path == "calls"
    assert_stage2_trains_the_transformer_alone(split, parts.transformer)
    cached = {key for key in split.boundary if key not in split.input_names}
    # The VAE's encoder and the frozen context embedder over the closure's constant prompts.
    # Only the cached VAE encoder computes with the pixels: their shape is stored, not they.
    assert cached == {
        "vae_encoder__0__out",
        "transformer_context_embedder__0__out",
        "pixel_values__shape",
    }
    # At one row a batch, the constant prompt's projection is stored with every row (exact;
    # a batch of one cannot tell a constant from a sample's own value).
    assert split.boundary["transformer_context_embedder__0__out"].shape == (1, 89, 32)


def test_instance_prompt_with_prior_preservation_caches_the_vae():
    """One instance and one class image per batch, their embeddings concatenated up front."""
    parts = build(custom_instance_prompts=False, with_prior_preservation=True)
    split = split_and_verify(parts.step, (_batch([0], caption=False, prior=True),))
    assert split.path == "calls"
    assert_stage2_trains_the_transformer_alone(split, parts.transformer)
    # The batch's last row run alone fails in the transformer (the closure's instance + class
    # embeddings have two rows); the per-sample proof then runs the batch reordered at its own
    # size, and the VAE's encoder, called on both rows, is cached per row.
    cached = {key: spec for key, spec in split.boundary.items() if key not in split.input_names}
    assert list(cached) == ["pixel_values__shape", "vae_encoder__0__out"]
    assert (
        cached["vae_encoder__0__out"].shape[0] == 2 and cached["vae_encoder__0__out"].batch_dim == 0
    )
    other = _batch([1], caption=False, prior=True)
    assert all(c.ok for c in graphsplit.verify(parts.step, split, (other,), seed=0))


@pytest.mark.parametrize("size", [1, 2, 3])
def test_captions_encoded_in_the_step_cache_the_three_text_encoders(size):
    parts = build(custom_instance_prompts=True)
    split = split_and_verify(parts.step, (_batch(range(size), caption=True),))
    assert split.path == "calls"
    # The first refusal: the tokenizers need the real captions (the Rust core takes str).
    assert line_of(_encode_prompt_with_clip, "text_inputs = tokenizer(") in split.reason
    assert_stage2_trains_the_transformer_alone(split, parts.transformer)
    cached = {key.split("__")[0] for key in split.boundary if key not in split.input_names}
    assert cached == {
        "pixel_values",  # pixel_values__shape: only the cached VAE encoder reads the pixels
        "vae_encoder",
        "transformer_context_embedder",
        "text_encoders_0",  # CLIP one
        "text_encoders_1",  # CLIP two
        "text_encoders_2",  # T5
    }
    # _encode_prompt_with_clip reads `[0]` (text_embeds) and `.hidden_states[-2]` of each CLIP
    # encoder's output; their last_hidden_state and other hidden states are not stored: stage 2
    # never computes with them (calls/usage.py). The T5 call returns last_hidden_state alone.
    text = {key for key in split.boundary if key.startswith("text_encoders")}
    assert text == {
        "text_encoders_0__0__text_embeds",
        "text_encoders_0__0__hidden_states__1",
        "text_encoders_1__0__text_embeds",
        "text_encoders_1__0__hidden_states__1",
        "text_encoders_2__0__last_hidden_state",
    }
    assert set(split.plan.not_stored) == {
        f"text_encoders_{clip}__0__{field}"
        for clip in (0, 1)
        for field in ("last_hidden_state", "hidden_states__0", "hidden_states__2")
    }
    assert all(split.boundary[key].batch_dim == 0 for key in split.boundary)


def test_instance_prompt_cache_round_trip(tmp_path):
    parts = build(custom_instance_prompts=False)
    split = graphsplit.split(parts.step, (_batch([0], caption=False),))
    batches = [_batch([i], caption=False) for i in (1, 2, 3)]
    assert_cache_round_trip(
        split, parts.step, batches, tmp_path, parts.transformer, rows_per_batch=1
    )


def test_captions_the_plan_was_not_made_with_are_encoded_in_stage1_and_train_exactly():
    """The captions cross the module-level boundary (as code points): another batch's captions
    are encoded by the three text encoders in stage 1 and train bit for bit."""
    parts = build(custom_instance_prompts=True)
    split = graphsplit.split(parts.step, (_batch([0, 1], caption=True),))
    other = _batch([2, 3], caption=True)
    comparisons = graphsplit.verify(parts.step, split, (other,), seed=0)
    assert len(comparisons) > 14 and all(c.ok for c in comparisons)
    example = split.stage1(**_batch([0, 1], caption=True))
    encoded = split.stage1(**other)
    text = [key for key in encoded if key.startswith("text_encoders_2")]  # T5
    assert text and not any(torch.equal(example[key], encoded[key]) for key in text)
