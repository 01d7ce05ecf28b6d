"""Conformance: ``examples/controlnet/train_controlnet_sd3.py``'s loop body, as a closure.

The script's models (``main()``): a frozen VAE, three frozen text encoders (two CLIP with
projection, one T5) and a frozen ``SD3Transformer2DModel`` (``requires_grad_(False)``, in eval
mode as ``from_pretrained`` returns them), and a trainable ``SD3ControlNetModel.from_transformer
(transformer, num_extra_conditioning_channels=0)`` in train mode. Before the loop the script
maps ``compute_text_embeddings`` (its ``encode_prompt``, copied verbatim) over the dataset, so
the batch its ``collate_fn`` (verbatim) makes carries ``prompt_embeds`` and
``pooled_prompt_embeds`` beside both images. The loop body is copied from the script: the VAE's
``latent_dist.sample()`` shifted and scaled, ``randn_like`` noise, logit-normal timestep
sampling (``compute_density_for_timestep_sampling``), ``get_sigmas`` (which reads each drawn
timestep with ``.nonzero().item()``), flow-matching noisy input, the *conditioning image also
VAE-encoded and sampled* (``vae.encode(controlnet_image).latent_dist.sample()``), the
ControlNet's block residuals fed to the frozen transformer (``block_controlnet_hidden_states``),
EDM preconditioning (``--precondition_outputs=1``, the default), ``compute_loss_weighting_for_
sd3`` and the weighted MSE.

What must hold: the step splits exactly (the loss and every ControlNet gradient bit for bit,
on the example and on a batch of another size); both VAE encodings are cached (stage 2 holds no
VAE encoder weight) while their samples are drawn again in stage 2; the frozen transformer runs
in stage 2 (it consumes the trainable residuals); a cache written through the disk trains
stage 2 exactly.

Tiny configs: diffusers' SD3 test components (``unseen11_b_checks.sd3_components``), 16 px.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch

import graphsplit
from tests.helpers import assert_stage1_holds_no_trainable, line_of

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
from diffusers.training_utils import (  # noqa: E402
    compute_density_for_timestep_sampling,
    compute_loss_weighting_for_sd3,
)

from tests.conformance.unseen2_data_checks import assert_cache_round_trip  # noqa: E402
from tests.conformance.unseen11_b_checks import (  # noqa: E402
    one_thread,
    sd3_components,
    stage2_param_names,
    trainable_names,
)
from tests.conformance.unseen_checks import stage2_top_modules, word_tokenizer  # noqa: E402

_one_thread = pytest.fixture(autouse=True)(one_thread)

WORDS = ["a", "red", "blue", "circle", "square", "on", "white", "black", "canny", "edges"]
CAPTIONS = ["a red circle", "a blue square on white", "canny edges on black", "a white circle"]
RESOLUTION = 16


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

    prompt_embeds = torch.stack([torch.tensor(example["prompt_embeds"]) for example in examples])
    pooled_prompt_embeds = torch.stack(
        [torch.tensor(example["pooled_prompt_embeds"]) for example in examples]
    )

    return {
        "pixel_values": pixel_values,
        "conditioning_pixel_values": conditioning_pixel_values,
        "prompt_embeds": prompt_embeds,
        "pooled_prompt_embeds": pooled_prompt_embeds,
    }


# Copied from dreambooth sd3 example
def _encode_prompt_with_t5(
    text_encoder,
    tokenizer,
    max_sequence_length,
    prompt=None,
    num_images_per_prompt=1,
    device=None,
):
    """The script's, verbatim."""
    prompt = [prompt] if isinstance(prompt, str) else prompt
    batch_size = len(prompt)

    text_inputs = tokenizer(
        prompt,
        padding="max_length",
        max_length=max_sequence_length,
        truncation=True,
        add_special_tokens=True,
        return_tensors="pt",
    )
    text_input_ids = text_inputs.input_ids
    prompt_embeds = text_encoder(text_input_ids.to(device))[0]

    dtype = text_encoder.dtype
    prompt_embeds = prompt_embeds.to(dtype=dtype, device=device)

    _, seq_len, _ = prompt_embeds.shape

    # duplicate text embeddings and attention mask for each generation per prompt, using mps
    # friendly method
    prompt_embeds = prompt_embeds.repeat(1, num_images_per_prompt, 1)
    prompt_embeds = prompt_embeds.view(batch_size * num_images_per_prompt, seq_len, -1)

    return prompt_embeds


# Copied from dreambooth sd3 example
def _encode_prompt_with_clip(
    text_encoder,
    tokenizer,
    prompt: str,
    device=None,
    num_images_per_prompt: int = 1,
):
    """The script's, verbatim."""
    prompt = [prompt] if isinstance(prompt, str) else prompt
    batch_size = len(prompt)

    text_inputs = tokenizer(
        prompt,
        padding="max_length",
        max_length=77,
        truncation=True,
        return_tensors="pt",
    )

    text_input_ids = text_inputs.input_ids
    prompt_embeds = text_encoder(text_input_ids.to(device), output_hidden_states=True)

    pooled_prompt_embeds = prompt_embeds[0]
    prompt_embeds = prompt_embeds.hidden_states[-2]
    prompt_embeds = prompt_embeds.to(dtype=text_encoder.dtype, device=device)

    _, seq_len, _ = prompt_embeds.shape
    # duplicate text embeddings for each generation per prompt, using mps friendly method
    prompt_embeds = prompt_embeds.repeat(1, num_images_per_prompt, 1)
    prompt_embeds = prompt_embeds.view(batch_size * num_images_per_prompt, seq_len, -1)

    return prompt_embeds, pooled_prompt_embeds


# Copied from dreambooth sd3 example
def encode_prompt(
    text_encoders,
    tokenizers,
    prompt: str,
    max_sequence_length,
    device=None,
    num_images_per_prompt: int = 1,
):
    """The script's, verbatim."""
    prompt = [prompt] if isinstance(prompt, str) else prompt

    clip_tokenizers = tokenizers[:2]
    clip_text_encoders = text_encoders[:2]

    clip_prompt_embeds_list = []
    clip_pooled_prompt_embeds_list = []
    for tokenizer, text_encoder in zip(clip_tokenizers, clip_text_encoders):
        prompt_embeds, pooled_prompt_embeds = _encode_prompt_with_clip(
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            prompt=prompt,
            device=device if device is not None else text_encoder.device,
            num_images_per_prompt=num_images_per_prompt,
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
        device=device if device is not None else text_encoders[-1].device,
    )

    clip_prompt_embeds = torch.nn.functional.pad(
        clip_prompt_embeds, (0, t5_prompt_embed.shape[-1] - clip_prompt_embeds.shape[-1])
    )
    prompt_embeds = torch.cat([clip_prompt_embeds, t5_prompt_embed], dim=-2)

    return prompt_embeds, pooled_prompt_embeds


def build():
    """``main()``'s models (fp32, one process), its dataset ``map`` and the loop body."""
    # 13 layers: the script's from_transformer copies 12 blocks (its default num_layers), and
    # SD3's last block (context_pre_only) has another shape, as in the real 24-layer model.
    parts = sd3_components(len(WORDS) + 3, num_layers=13)
    tokenizer_one, tokenizer_two, tokenizer_three = (word_tokenizer(WORDS) for _ in range(3))
    text_encoder_one, text_encoder_two = parts.text_encoder_one, parts.text_encoder_two
    text_encoder_three = parts.text_encoder_three
    vae, transformer = parts.vae, parts.transformer
    noise_scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    noise_scheduler_copy = copy.deepcopy(noise_scheduler)
    args = types.SimpleNamespace(
        num_extra_conditioning_channels=0,
        max_sequence_length=12,
        weighting_scheme="logit_normal",
        logit_mean=0.0,
        logit_std=1.0,
        mode_scale=1.29,
        precondition_outputs=1,
    )
    accelerator = types.SimpleNamespace(device=torch.device("cpu"))

    torch.manual_seed(6)
    controlnet = diffusers.SD3ControlNetModel.from_transformer(
        transformer, num_extra_conditioning_channels=args.num_extra_conditioning_channels
    )
    # from_transformer zero-initialises pos_embed_input and the controlnet_blocks: drawn
    # small, as after some training steps, so every ControlNet weight gets a gradient.
    with torch.no_grad():
        for name, param in controlnet.named_parameters():
            if name.startswith(("pos_embed_input", "controlnet_blocks")):
                param.normal_(std=0.02)

    transformer.requires_grad_(False)
    vae.requires_grad_(False)
    text_encoder_one.requires_grad_(False)
    text_encoder_two.requires_grad_(False)
    text_encoder_three.requires_grad_(False)
    controlnet.train()
    weight_dtype = torch.float32

    tokenizers = [tokenizer_one, tokenizer_two, tokenizer_three]
    text_encoders = [text_encoder_one, text_encoder_two, text_encoder_three]

    def compute_text_embeddings(batch, text_encoders, tokenizers):
        with torch.no_grad():
            prompt = batch["prompts"]
            prompt_embeds, pooled_prompt_embeds = encode_prompt(
                text_encoders, tokenizers, prompt, args.max_sequence_length
            )
            prompt_embeds = prompt_embeds.to(accelerator.device)
            pooled_prompt_embeds = pooled_prompt_embeds.to(accelerator.device)
        return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled_prompt_embeds}

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
        # Convert images to latent space
        pixel_values = batch["pixel_values"].to(dtype=vae.dtype)
        model_input = vae.encode(pixel_values).latent_dist.sample()
        model_input = (model_input - vae.config.shift_factor) * vae.config.scaling_factor
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

        # Get the text embedding for conditioning
        prompt_embeds = batch["prompt_embeds"].to(dtype=weight_dtype)
        pooled_prompt_embeds = batch["pooled_prompt_embeds"].to(dtype=weight_dtype)

        # controlnet(s) inference
        controlnet_image = batch["conditioning_pixel_values"].to(dtype=weight_dtype)
        controlnet_image = vae.encode(controlnet_image).latent_dist.sample()
        controlnet_image = (controlnet_image - vae.config.shift_factor) * vae.config.scaling_factor

        control_block_res_samples = controlnet(
            hidden_states=noisy_model_input,
            timestep=timesteps,
            encoder_hidden_states=prompt_embeds,
            pooled_projections=pooled_prompt_embeds,
            controlnet_cond=controlnet_image,
            return_dict=False,
        )[0]
        control_block_res_samples = [
            sample.to(dtype=weight_dtype) for sample in control_block_res_samples
        ]

        # Predict the noise residual
        model_pred = transformer(
            hidden_states=noisy_model_input,
            timestep=timesteps,
            encoder_hidden_states=prompt_embeds,
            pooled_projections=pooled_prompt_embeds,
            block_controlnet_hidden_states=control_block_res_samples,
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

        # Compute regular loss.
        loss = torch.mean(
            (weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(
                target.shape[0], -1
            ),
            1,
        )
        loss = loss.mean()
        return loss

    # The dataset's ``map(compute_embeddings_fn, batched=True)``: Arrow stores the embeddings
    # as nested lists, which ``collate_fn`` turns back into tensors.
    embedded = compute_text_embeddings({"prompts": CAPTIONS}, text_encoders, tokenizers)
    rows = [
        {key: value[index].tolist() for key, value in embedded.items()}
        for index in range(len(CAPTIONS))
    ]
    return types.SimpleNamespace(
        step=training_step,
        get_sigmas=get_sigmas,
        controlnet=controlnet,
        transformer=transformer,
        vae=vae,
        rows=rows,
        params=[p for p in controlnet.parameters() if p.requires_grad],
    )


def _example(parts, index: int) -> dict:
    """``preprocess_train`` + the ``map``: the image in [-1, 1], the conditioning image in
    [0, 1] (``ToTensor`` without ``Normalize``) and the caption's precomputed embeddings."""
    generator = torch.Generator().manual_seed(900 + index)
    return {
        "pixel_values": torch.rand(3, RESOLUTION, RESOLUTION, generator=generator) * 2 - 1,
        "conditioning_pixel_values": torch.rand(3, RESOLUTION, RESOLUTION, generator=generator),
        **parts.rows[index % len(parts.rows)],
    }


def _batch(parts, indices) -> dict:
    return collate_fn([_example(parts, i) for i in indices])


@pytest.fixture(scope="module")
def built():
    torch.set_num_threads(1)
    parts = build()
    split = graphsplit.split(parts.step, (_batch(parts, [0, 1]),))
    return parts, split


def test_the_trace_refuses_get_sigmas_value_read_naming_the_line():
    parts = build()
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(parts.step, (_batch(parts, [0]),), path="trace")
    assert line_of(parts.get_sigmas, "step_indices = [") in str(caught.value)


def test_controlnet_sd3_verifies_on_the_example_and_another_size(built):
    parts, split = built
    assert split.path == "calls"
    assert_stage1_holds_no_trainable(split)
    for seed, batch in enumerate([_batch(parts, [0, 1]), _batch(parts, [2, 3, 4])]):
        checks = graphsplit.verify(parts.step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


def test_controlnet_sd3_caches_both_vae_encodings_not_the_transformer(built):
    parts, split = built
    held = stage2_param_names(split)
    assert not any(name.startswith("vae.encoder") for name in held)
    # the frozen transformer consumes the ControlNet's residuals: stage 2 runs it
    assert stage2_top_modules(split) == {"controlnet", "transformer"}
    trainable = {n for n, p in split.stage2.named_parameters() if p.requires_grad}
    assert trainable == trainable_names("controlnet", parts.controlnet)
    cached = {key for key in split.boundary if key not in split.input_names}
    # the VAE encoder's output for each image (the image and the conditioning image), so both
    # latent_dist.sample() draws happen in stage 2
    assert {key for key in cached if key.startswith("vae_encoder")} == {
        "vae_encoder__0__out",
        "vae_encoder__1__out",
    }
    # only the cached VAE calls read the raw images: their shapes are stored, not they
    assert cached == {
        "vae_encoder__0__out",
        "vae_encoder__1__out",
        "pixel_values__shape",
        "conditioning_pixel_values__shape",
    }


def test_controlnet_sd3_cache_round_trip(built, tmp_path):
    parts, split = built
    loader = [_batch(parts, [4, 5]), _batch(parts, [6, 7]), _batch(parts, [8])]
    # The ControlNet's last block (and the second-to-last's context branch) feeds nothing the
    # 13-layer transformer reads, so those get no gradient in the unsplit step either: the
    # round trip compares the parameters that do.
    torch.manual_seed(0)
    parts.step(loader[0]).backward()
    params = [p for p in parts.params if p.grad is not None]
    for param in parts.params:
        param.grad = None
    assert len(params) < len(parts.params)
    assert_cache_round_trip(split, parts.step, loader, tmp_path / "cache", params)
