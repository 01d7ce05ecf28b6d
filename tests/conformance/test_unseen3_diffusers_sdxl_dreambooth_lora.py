"""Conformance: ``examples/dreambooth/train_dreambooth_lora_sdxl.py``'s training step.

A LoRA on the SDXL UNet (``to_k/to_q/to_v/to_out.0``), the frozen VAE (``latent_dist.sample()``
times the scaling factor), two CLIP text encoders (``CLIPTextModel`` and
``CLIPTextModelWithProjection``) through the script's ``encode_prompt`` (the penultimate hidden
states of both, concatenated, and the second's pooled embedding), SDXL's micro-conditioning
(``compute_time_ids`` per sample from the batch's ``original_sizes`` / ``crop_top_lefts``, lists
of tuples), DDPM noise and timesteps (the default, non-EDM scheduler).

Three configurations, each a real one of the script:

- a ``--caption_column`` without ``--train_text_encoder``: the step encodes the batch's captions
  with ``compute_text_embeddings`` (both encoders under ``torch.no_grad()``): the VAE and *both*
  text encoders must be cached.
- ``--train_text_encoder`` with captions: LoRA on both text encoders' ``q/k/v/out_proj``, their
  embeddings made trainable by the loop (``embeddings.requires_grad_(True)``), the captions
  tokenized in the step: the VAE must be cached, the text encoders must *not* be.
- ``--train_text_encoder`` with the instance prompt: tokenized once before the loop, its
  embeddings repeated per sample (``.repeat(elems_to_repeat_text_embeds, 1, 1)``).

The tokenizers called on the batch's strings and the per-sample ``compute_time_ids`` loop make
the whole-step trace refuse (naming the line); ``path="auto"`` takes the module-level path. The
batch's ``original_sizes`` and ``crop_top_lefts`` (a tuple of ints a sample) cross as ``[B, 2]``
tensors: the batches here have other sizes than the example, as a real dataset's images do.

Tiny configs: diffusers' ``tests/pipelines/stable_diffusion_xl/test_stable_diffusion_xl.py``
components (UNet (2, 4) channels, ``text_time`` added conditions of 6 x 8 + 32, cross-attention
64 = 32 + 32; CLIP 32 wide), here with one layer where the test has two (five for CLIP), real
word-level tokenizers, 32 px.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

import graphsplit
from tests.helpers import line_of, split_and_verify

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from tests.conformance.unseen2_checks import (  # noqa: E402
    assert_trains_from_its_cache,
    cached_outputs,
    unstored_inputs,
)
from tests.conformance.unseen_checks import stage2_top_modules, word_tokenizer  # noqa: E402

WORDS = ["a", "photo", "of", "sks", "dog", "on", "the", "beach", "in", "snow", "red", "blue"]
CAPTIONS = ["a photo of sks dog on the beach", "a sks dog in snow", "a red dog", "a blue sks dog"]
RESOLUTION = 32


def collate_fn(examples, with_prior_preservation=False):
    """The script's, verbatim."""
    pixel_values = [example["instance_images"] for example in examples]
    prompts = [example["instance_prompt"] for example in examples]
    original_sizes = [example["original_size"] for example in examples]
    crop_top_lefts = [example["crop_top_left"] for example in examples]

    # Concat class and instance examples for prior preservation.
    # We do this to avoid doing two forward passes.
    if with_prior_preservation:
        pixel_values += [example["class_images"] for example in examples]
        prompts += [example["class_prompt"] for example in examples]
        original_sizes += [example["original_size"] for example in examples]
        crop_top_lefts += [example["crop_top_left"] for example in examples]

    pixel_values = torch.stack(pixel_values)
    pixel_values = pixel_values.to(memory_format=torch.contiguous_format).float()

    batch = {
        "pixel_values": pixel_values,
        "prompts": prompts,
        "original_sizes": original_sizes,
        "crop_top_lefts": crop_top_lefts,
    }
    return batch


def tokenize_prompt(tokenizer, prompt):
    """The script's, verbatim."""
    text_inputs = tokenizer(
        prompt,
        padding="max_length",
        max_length=tokenizer.model_max_length,
        truncation=True,
        return_tensors="pt",
    )
    text_input_ids = text_inputs.input_ids
    return text_input_ids


# Adapted from pipelines.StableDiffusionXLPipeline.encode_prompt
def encode_prompt(text_encoders, tokenizers, prompt, text_input_ids_list=None):
    """The script's, verbatim."""
    prompt_embeds_list = []

    for i, text_encoder in enumerate(text_encoders):
        if tokenizers is not None:
            tokenizer = tokenizers[i]
            text_input_ids = tokenize_prompt(tokenizer, prompt)
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


def _models():
    """diffusers' SDXL pipeline test components (one UNet layer a block and one transformer
    layer an attention instead of two, CLIP at 2 layers instead of 5)."""
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(
        block_out_channels=(2, 4),
        layers_per_block=1,  # 2 in diffusers' test: one layer keeps this file fast
        time_cond_proj_dim=None,
        sample_size=32,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        # SD2-specific config below
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        transformer_layers_per_block=(1, 1),  # (1, 2) in diffusers' test
        projection_class_embeddings_input_dim=80,  # 6 * 8 + 32
        cross_attention_dim=64,
        norm_num_groups=1,
    )
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(
        block_out_channels=[32, 64],
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"],
        up_block_types=["UpDecoderBlock2D", "UpDecoderBlock2D"],
        latent_channels=4,
        sample_size=128,
    )
    torch.manual_seed(0)
    text_encoder_config = transformers.CLIPTextConfig(
        bos_token_id=0,
        eos_token_id=2,
        hidden_size=32,
        intermediate_size=37,
        layer_norm_eps=1e-05,
        num_attention_heads=4,
        num_hidden_layers=2,
        pad_token_id=1,
        vocab_size=len(WORDS) + 3,
        # SD2-specific config below
        hidden_act="gelu",
        projection_dim=32,
    )
    text_encoder_one = transformers.CLIPTextModel(text_encoder_config)
    text_encoder_two = transformers.CLIPTextModelWithProjection(text_encoder_config)
    for model in (unet, vae, text_encoder_one, text_encoder_two):
        model.eval()  # as from_pretrained returns them
    return unet, vae, text_encoder_one, text_encoder_two


def _tokenizer():
    tokenizer = word_tokenizer(WORDS)
    tokenizer.model_max_length = 12  # CLIP's 77, shortened
    return tokenizer


def build(*, train_text_encoder: bool, custom_instance_prompts: bool, rank: int = 4):
    """``main()``'s models and the loop body as a closure (one process, fp32, no accumulation,
    no prior preservation, no EDM, no SNR weighting: the script's defaults)."""
    unet, vae, text_encoder_one, text_encoder_two = _models()
    tokenizer_one, tokenizer_two = _tokenizer(), _tokenizer()
    noise_scheduler = diffusers.DDPMScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear"
    )
    args = types.SimpleNamespace(
        instance_prompt="a photo of sks dog",
        train_text_encoder=train_text_encoder,
        with_prior_preservation=False,
        do_edm_style_training=False,
        pretrained_vae_model_name_or_path=None,
        snr_gamma=None,
        resolution=RESOLUTION,
        rank=rank,
        lora_dropout=0.0,
    )
    train_dataset = types.SimpleNamespace(
        custom_instance_prompts=CAPTIONS if custom_instance_prompts else None
    )
    accelerator = types.SimpleNamespace(device=torch.device("cpu"))
    weight_dtype = torch.float32
    latents_mean = latents_std = None
    if hasattr(vae.config, "latents_mean") and vae.config.latents_mean is not None:
        latents_mean = torch.tensor(vae.config.latents_mean).view(1, 4, 1, 1)
    if hasattr(vae.config, "latents_std") and vae.config.latents_std is not None:
        latents_std = torch.tensor(vae.config.latents_std).view(1, 4, 1, 1)

    # We only train the additional adapter LoRA layers
    vae.requires_grad_(False)
    text_encoder_one.requires_grad_(False)
    text_encoder_two.requires_grad_(False)
    unet.requires_grad_(False)  # the script's ``unet.requires_grad_(False)`` (before the VAE's)

    def get_lora_config(rank, dropout, use_dora, target_modules):
        base_config = {
            "r": rank,
            "lora_alpha": rank,
            "lora_dropout": dropout,
            "init_lora_weights": "gaussian",
            "target_modules": target_modules,
        }
        return peft.LoraConfig(**base_config)

    torch.manual_seed(1)
    # now we will add new LoRA weights to the attention layers
    unet_target_modules = ["to_k", "to_q", "to_v", "to_out.0"]
    unet_lora_config = get_lora_config(
        rank=args.rank,
        dropout=args.lora_dropout,
        use_dora=False,
        target_modules=unet_target_modules,
    )
    unet.add_adapter(unet_lora_config)

    # The text encoder comes from 🤗 transformers, so we cannot directly modify it.
    # So, instead, we monkey-patch the forward calls of its attention-blocks.
    if args.train_text_encoder:
        text_target_modules = ["q_proj", "k_proj", "v_proj", "out_proj"]
        text_lora_config = get_lora_config(
            rank=args.rank,
            dropout=args.lora_dropout,
            use_dora=False,
            target_modules=text_target_modules,
        )
        # The script's ``text_encoder_*.add_adapter(text_lora_config)``: transformers 5's
        # ``add_adapter`` refuses the installed peft; peft's injector adds the same layers.
        peft.inject_adapter_in_model(text_lora_config, text_encoder_one)
        peft.inject_adapter_in_model(text_lora_config, text_encoder_two)
    with torch.no_grad():  # as after some steps: lora_B starts at zero
        for model in (unet, text_encoder_one, text_encoder_two):
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.02)

    def compute_time_ids(original_size, crops_coords_top_left):
        # Adapted from pipeline.StableDiffusionXLPipeline._get_add_time_ids
        target_size = (args.resolution, args.resolution)
        add_time_ids = list(original_size + crops_coords_top_left + target_size)
        add_time_ids = torch.tensor([add_time_ids])
        add_time_ids = add_time_ids.to(accelerator.device, dtype=weight_dtype)
        return add_time_ids

    if not args.train_text_encoder:
        tokenizers = [tokenizer_one, tokenizer_two]
        text_encoders = [text_encoder_one, text_encoder_two]

        def compute_text_embeddings(prompt, text_encoders, tokenizers):
            with torch.no_grad():
                prompt_embeds, pooled_prompt_embeds = encode_prompt(
                    text_encoders, tokenizers, prompt
                )
                prompt_embeds = prompt_embeds.to(accelerator.device)
                pooled_prompt_embeds = pooled_prompt_embeds.to(accelerator.device)
            return prompt_embeds, pooled_prompt_embeds

    tokens_one = tokens_two = prompt_embeds = unet_add_text_embeds = None
    if not train_dataset.custom_instance_prompts:
        if not args.train_text_encoder:
            raise AssertionError("precomputed embeddings: not a configuration tested here")
        tokens_one = tokenize_prompt(tokenizer_one, args.instance_prompt)
        tokens_two = tokenize_prompt(tokenizer_two, args.instance_prompt)

    unet.train()
    if args.train_text_encoder:
        text_encoder_one.train()
        text_encoder_two.train()

        # set top parameter requires_grad = True for gradient checkpointing works
        _te_one = text_encoder_one
        (
            _te_one.text_model if hasattr(_te_one, "text_model") else _te_one
        ).embeddings.requires_grad_(True)
        _te_two = text_encoder_two
        (
            _te_two.text_model if hasattr(_te_two, "text_model") else _te_two
        ).embeddings.requires_grad_(True)

    def training_step(batch):
        nonlocal tokens_one, tokens_two, prompt_embeds, unet_add_text_embeds
        pixel_values = batch["pixel_values"].to(dtype=vae.dtype)
        prompts = batch["prompts"]

        # encode batch prompts when custom prompts are provided for each image -
        if train_dataset.custom_instance_prompts:
            if not args.train_text_encoder:
                prompt_embeds, unet_add_text_embeds = compute_text_embeddings(
                    prompts, text_encoders, tokenizers
                )
            else:
                tokens_one = tokenize_prompt(tokenizer_one, prompts)
                tokens_two = tokenize_prompt(tokenizer_two, prompts)

        # Convert images to latent space
        model_input = vae.encode(pixel_values).latent_dist.sample()

        if latents_mean is None and latents_std is None:
            model_input = model_input * vae.config.scaling_factor
            if args.pretrained_vae_model_name_or_path is None:
                model_input = model_input.to(weight_dtype)
        else:
            raise AssertionError("the tiny VAE has no latents_mean")

        # Sample noise that we'll add to the latents
        noise = torch.randn_like(model_input)
        bsz = model_input.shape[0]

        # Sample a random timestep for each image
        timesteps = torch.randint(
            0, noise_scheduler.config.num_train_timesteps, (bsz,), device=model_input.device
        )
        timesteps = timesteps.long()

        # Add noise to the model input according to the noise magnitude at each timestep
        # (this is the forward diffusion process)
        noisy_model_input = noise_scheduler.add_noise(model_input, noise, timesteps)

        # time ids
        add_time_ids = torch.cat(
            [
                compute_time_ids(original_size=s, crops_coords_top_left=c)
                for s, c in zip(batch["original_sizes"], batch["crop_top_lefts"])
            ]
        )

        # Calculate the elements to repeat depending on the use of prior-preservation and
        # custom captions.
        if not train_dataset.custom_instance_prompts:
            elems_to_repeat_text_embeds = bsz // 2 if args.with_prior_preservation else bsz
        else:
            elems_to_repeat_text_embeds = 1

        # Predict the noise residual
        if not args.train_text_encoder:
            unet_added_conditions = {
                "time_ids": add_time_ids,
                "text_embeds": unet_add_text_embeds.repeat(elems_to_repeat_text_embeds, 1),
            }
            prompt_embeds_input = prompt_embeds.repeat(elems_to_repeat_text_embeds, 1, 1)
            model_pred = unet(
                noisy_model_input,
                timesteps,
                prompt_embeds_input,
                added_cond_kwargs=unet_added_conditions,
                return_dict=False,
            )[0]
        else:
            unet_added_conditions = {"time_ids": add_time_ids}
            prompt_embeds, pooled_prompt_embeds = encode_prompt(
                text_encoders=[text_encoder_one, text_encoder_two],
                tokenizers=None,
                prompt=None,
                text_input_ids_list=[tokens_one, tokens_two],
            )
            unet_added_conditions.update(
                {"text_embeds": pooled_prompt_embeds.repeat(elems_to_repeat_text_embeds, 1)}
            )
            prompt_embeds_input = prompt_embeds.repeat(elems_to_repeat_text_embeds, 1, 1)
            model_pred = unet(
                noisy_model_input,
                timesteps,
                prompt_embeds_input,
                added_cond_kwargs=unet_added_conditions,
                return_dict=False,
            )[0]

        # Get the target for loss depending on the prediction type
        if noise_scheduler.config.prediction_type == "epsilon":
            target = noise
        elif noise_scheduler.config.prediction_type == "v_prediction":
            target = noise_scheduler.get_velocity(model_input, noise, timesteps)
        else:
            raise ValueError(f"Unknown prediction type {noise_scheduler.config.prediction_type}")

        loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
        return loss

    params = [p for p in unet.parameters() if p.requires_grad]
    if args.train_text_encoder:
        params += [p for p in text_encoder_one.parameters() if p.requires_grad]
        params += [p for p in text_encoder_two.parameters() if p.requires_grad]
    return types.SimpleNamespace(
        step=training_step,
        unet=unet,
        text_encoder_one=text_encoder_one,
        text_encoder_two=text_encoder_two,
        compute_time_ids=compute_time_ids,
        params=params,
    )


def _example(index: int, *, caption: bool) -> dict:
    """``DreamBoothDataset.__getitem__``: the image in [-1, 1], its original size and crop
    corner (ints, as PIL and the random crop give them) and its caption or the prompt."""
    generator = torch.Generator().manual_seed(900 + index)
    return {
        "instance_images": torch.rand(3, RESOLUTION, RESOLUTION, generator=generator) * 2 - 1,
        "original_size": (RESOLUTION + 8 * index, RESOLUTION + 4 * index),
        "crop_top_left": (index % 3, 2 * index % 5),
        "instance_prompt": CAPTIONS[index % len(CAPTIONS)] if caption else "a photo of sks dog",
    }


def _batch(indices, *, caption: bool = True) -> dict:
    return collate_fn([_example(i, caption=caption) for i in indices])


def _trainable_in_stage2(split) -> set[str]:
    return {n for n, p in split.stage2.named_parameters() if p.requires_grad}


def _named(prefix, module) -> set[str]:
    return {f"{prefix}.{n}" for n, p in module.named_parameters() if p.requires_grad}


def test_the_trace_refuses_the_tokenizers_on_the_captions_naming_the_line():
    parts = build(train_text_encoder=False, custom_instance_prompts=True)
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(parts.step, (_batch([0, 1]),), path="trace")
    assert line_of(tokenize_prompt, "text_inputs = tokenizer(") in str(caught.value)


def test_the_trace_refuses_the_per_sample_time_ids_loop_naming_the_line():
    """With the instance prompt tokenized before the loop, the first refusal is the loop over
    the batch's ``original_sizes`` (its count is the batch size)."""
    parts = build(train_text_encoder=True, custom_instance_prompts=False)
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(parts.step, (_batch([0, 1], caption=False),), path="trace")
    message = str(caught.value)
    assert "depends on the batch size" in message
    assert line_of(parts.step, "for s, c in zip(") in message


@pytest.mark.parametrize("size", [1, 2])
def test_without_train_text_encoder_the_vae_and_both_text_encoders_are_cached(size):
    parts = build(train_text_encoder=False, custom_instance_prompts=True)
    split = split_and_verify(parts.step, (_batch(range(size)),))
    assert split.path == "calls"
    assert unstored_inputs(split) == {"pixel_values"}  # only the cached VAE reads them
    cached = cached_outputs(split)
    assert {key for key in cached if not key.startswith("unet_")} == {
        "vae_quant_conv__0__out",
        "text_encoders_0__0__2__1",  # CLIP one's hidden states [-2] (return_dict=False)
        "text_encoders_1__0__0",  # CLIP two's pooled projection
        "text_encoders_1__0__2__1",  # and its hidden states [-2]
    }
    # Inside the UNet, the frozen calls fed by the text embeddings alone are cached too: the
    # cross-attention's LoRA-wrapped to_k / to_v base layers (4 transformer blocks: down, mid,
    # 2x up) and the added-conditions embedding of time ids and pooled text.
    unet = {key for key in cached if key.startswith("unet_")}
    assert len(unet) == 1 + 4 * 2 and "unet_add_embedding__0__out" in unet
    assert all(
        key.endswith(("to_k_base_layer__0__out", "to_v_base_layer__0__out"))
        for key in unet - {"unet_add_embedding__0__out"}
    )
    stage1 = {".".join(n.split(".")[:2]) for n, _ in split.stage1.named_parameters()}
    assert {"vae.encoder", "vae.quant_conv", "text_encoders.0", "text_encoders.1"} <= stage1
    assert all(
        "attn2.to_k.base_layer" in n or "attn2.to_v.base_layer" in n or ".add_embedding." in n
        for n, _ in split.stage1.named_parameters()
        if n.startswith("unet.")
    )
    held = stage2_top_modules(split)
    assert "text_encoders" not in held
    assert not any(n.startswith("vae.encoder") for n, _ in split.stage2.named_parameters())
    assert _trainable_in_stage2(split) == _named("unet", parts.unet)
    other = _batch(range(size, 2 * size))
    assert all(c.ok for c in graphsplit.verify(parts.step, split, (other,), seed=1))


@pytest.mark.parametrize("custom_instance_prompts", [True, False])
def test_train_text_encoder_caches_the_vae_and_neither_text_encoder(custom_instance_prompts):
    parts = build(train_text_encoder=True, custom_instance_prompts=custom_instance_prompts)
    example = _batch([0, 1], caption=custom_instance_prompts)
    split = split_and_verify(parts.step, (example,))
    assert split.path == "calls"
    assert unstored_inputs(split) == {"pixel_values"}  # only the cached VAE reads them
    assert cached_outputs(split) == {"vae_quant_conv__0__out"}
    stage1 = {".".join(n.split(".")[:2]) for n, _ in split.stage1.named_parameters()}
    assert stage1 == {"vae.encoder", "vae.quant_conv"}
    assert {"text_encoder_one", "text_encoder_two", "unet"} <= stage2_top_modules(split)
    expected = (
        _named("unet", parts.unet)
        | _named("text_encoder_one", parts.text_encoder_one)
        | _named("text_encoder_two", parts.text_encoder_two)
    )
    # LoRA on q/k/v/out of two layers (16) and the token + position embeddings (2), each
    text = _named("text_encoder_one", parts.text_encoder_one)
    assert len(text) == 16 + 2
    assert _trainable_in_stage2(split) == expected
    other = _batch([2, 3, 4], caption=custom_instance_prompts)
    assert all(c.ok for c in graphsplit.verify(parts.step, split, (other,), seed=1))


@pytest.mark.parametrize("train_text_encoder", [False, True])
def test_cache_round_trip(tmp_path, train_text_encoder):
    """The stale-cache check moves every trainable weight (text-encoder LoRA and embeddings
    included): a cached text encoder would fail it."""
    parts = build(train_text_encoder=train_text_encoder, custom_instance_prompts=True)
    split = graphsplit.split(parts.step, (_batch([0, 1]),))
    batches = [_batch([2, 3]), _batch([4, 5]), _batch([6, 7])]
    assert_trains_from_its_cache(split, parts.step, batches, tmp_path, parts.params)
