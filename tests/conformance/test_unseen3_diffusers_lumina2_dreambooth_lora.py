"""Conformance: ``examples/dreambooth/train_dreambooth_lora_lumina2.py``'s training step.

A LoRA on the ``Lumina2Transformer2DModel`` (``to_k/to_q/to_v/to_out.0``), the frozen VAE (shift
and scaling factors, ``latent_dist.sample()``) and a frozen Gemma-2 text encoder cast to
bfloat16, reached through a ``Lumina2Pipeline`` built with ``vae=None, transformer=None``: the
script's ``compute_text_embeddings`` calls ``text_encoding_pipeline.to(device)`` and then the
pipeline's own ``encode_prompt`` (the system prompt prepended to every prompt, Gemma's
penultimate hidden states and the attention mask; classifier-free guidance left on, so it
also encodes a negative ``""`` per sample, which the script discards). The step also moves the
VAE every step (``vae = vae.to(accelerator.device)``); stage 2 runs both moves too, so it holds
Gemma and the VAE encoder though it never computes with them (``report()`` says so; moving them
before the loop is the fix). Flow matching in Lumina2's reversed
lerp, the default ``"none"`` weighting through ``compute_density_for_timestep_sampling``, the
script's ``get_sigmas``.

Two ways to condition, both tested:

- a ``--caption_column``: the step encodes the batch's captions; Gemma's calls and the VAE
  encoder's must be cached, stage 2 training bit for bit with their weights all NaN.
- ``--instance_prompt`` alone: encoded once before the loop, repeated per sample in the step
  (``prompt_embeds.repeat(len(prompts), 1, 1)``); the VAE encoder must be cached.

The tokenizer on the batch's strings (captions) and ``get_sigmas``' ``.nonzero().item()``
(instance prompt) make the whole-step trace refuse, naming the line; ``path="auto"`` takes the
module-level path.

Tiny configs: diffusers' ``tests/pipelines/lumina2/test_pipeline_lumina2.py`` components
(hidden 8, two layers, Gemma-2 8 wide with two layers), a word-level tokenizer that knows the
pipeline's system prompt, 16 px.
"""

from __future__ import annotations

import copy
import re
import types

import pytest
import torch

import graphsplit
from tests.helpers import line_of, split_and_verify

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
from diffusers import Lumina2Pipeline  # noqa: E402
from diffusers.training_utils import (  # noqa: E402
    compute_density_for_timestep_sampling,
    compute_loss_weighting_for_sd3,
)

from tests.conformance.unseen2_checks import (  # noqa: E402
    assert_trains_from_its_cache,
    cached_outputs,
    unstored_inputs,
)
from tests.conformance.unseen_checks import stage2_top_modules, word_tokenizer  # noqa: E402

SYSTEM_PROMPT = (
    "You are an assistant designed to generate superior images with the superior degree of "
    "image-text alignment based on textual prompts or user prompts. <Prompt Start>"
)
CAPTIONS = ["a photo of sks dog on the beach", "a sks dog in snow", "a red dog", "a blue sks dog"]
WORDS = re.findall(r"\w+|[^\w\s]", SYSTEM_PROMPT + " " + " ".join(CAPTIONS))
RESOLUTION = 16


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


def _models():
    """diffusers' Lumina2 pipeline test components."""
    torch.manual_seed(0)
    transformer = diffusers.Lumina2Transformer2DModel(
        sample_size=4,
        patch_size=2,
        in_channels=4,
        hidden_size=8,
        num_layers=2,
        num_attention_heads=1,
        num_kv_heads=1,
        multiple_of=16,
        ffn_dim_multiplier=None,
        norm_eps=1e-5,
        scaling_factor=1.0,
        axes_dim_rope=[4, 2, 2],
        cap_feat_dim=8,
    )
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(
        sample_size=32,
        in_channels=3,
        out_channels=3,
        block_out_channels=(4,),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=1,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
    )
    torch.manual_seed(0)
    config = transformers.Gemma2Config(
        head_dim=4,
        hidden_size=8,
        intermediate_size=8,
        num_attention_heads=2,
        num_hidden_layers=2,
        num_key_value_heads=2,
        sliding_window=2,
        vocab_size=len(set(WORDS)) + 3,
    )
    text_encoder = transformers.Gemma2Model(config)
    for model in (transformer, vae, text_encoder):
        model.eval()  # as from_pretrained returns them
    return transformer, vae, text_encoder


def build(*, custom_instance_prompts: bool, rank: int = 4):
    """``main()``'s models and the loop body as a closure (one process, fp32 transformer,
    no prior preservation, no latent caching, no offload: the script's defaults)."""
    transformer, vae, text_encoder = _models()
    tokenizer = word_tokenizer(WORDS, eos=None)
    noise_scheduler = diffusers.FlowMatchEulerDiscreteScheduler()
    noise_scheduler_copy = copy.deepcopy(noise_scheduler)
    args = types.SimpleNamespace(
        instance_prompt="a photo of sks dog",
        with_prior_preservation=False,
        max_sequence_length=48,
        system_prompt=None,
        weighting_scheme="none",
        logit_mean=0.0,
        logit_std=1.0,
        mode_scale=1.29,
        cache_latents=False,
        offload=False,
        rank=rank,
        lora_dropout=0.0,
    )
    train_dataset = types.SimpleNamespace(
        custom_instance_prompts=CAPTIONS if custom_instance_prompts else None
    )
    accelerator = types.SimpleNamespace(device=torch.device("cpu"))

    transformer.requires_grad_(False)
    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)
    weight_dtype = torch.float32
    vae.to(dtype=torch.float32)
    transformer.to(accelerator.device, dtype=weight_dtype)
    text_encoder.to(dtype=torch.bfloat16)

    # The script's ``Lumina2Pipeline.from_pretrained(path, vae=None, transformer=None,
    # text_encoder=text_encoder, tokenizer=tokenizer)``: its scheduler comes from the path.
    text_encoding_pipeline = Lumina2Pipeline(
        transformer=None,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
        vae=None,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
    )

    target_modules = ["to_k", "to_q", "to_v", "to_out.0"]
    torch.manual_seed(1)
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

    def compute_text_embeddings(prompt, text_encoding_pipeline):
        text_encoding_pipeline = text_encoding_pipeline.to(accelerator.device)
        with torch.no_grad():
            prompt_embeds, prompt_attention_mask, _, _ = text_encoding_pipeline.encode_prompt(
                prompt,
                max_sequence_length=args.max_sequence_length,
                system_prompt=args.system_prompt,
            )
        if args.offload:
            text_encoding_pipeline = text_encoding_pipeline.to("cpu")
        prompt_embeds = prompt_embeds.to(transformer.dtype)
        return prompt_embeds, prompt_attention_mask

    prompt_embeds = prompt_attention_mask = None
    if not train_dataset.custom_instance_prompts:
        instance_prompt_hidden_states, instance_prompt_attention_mask = compute_text_embeddings(
            args.instance_prompt, text_encoding_pipeline
        )
    # (the script deletes its own names for the encoder here; the pipeline keeps it)
    if not train_dataset.custom_instance_prompts:
        prompt_embeds = instance_prompt_hidden_states
        prompt_attention_mask = instance_prompt_attention_mask

    vae_config_scaling_factor = vae.config.scaling_factor
    vae_config_shift_factor = vae.config.shift_factor

    def get_sigmas(timesteps, n_dim=4, dtype=torch.float32):
        sigmas = noise_scheduler_copy.sigmas.to(device=accelerator.device, dtype=dtype)
        schedule_timesteps = noise_scheduler_copy.timesteps.to(accelerator.device)
        timesteps = timesteps.to(accelerator.device)
        step_indices = [(schedule_timesteps == t).nonzero().item() for t in timesteps]

        sigma = sigmas[step_indices].flatten()
        while len(sigma.shape) < n_dim:
            sigma = sigma.unsqueeze(-1)
        return sigma

    transformer.train()

    def training_step(batch):
        nonlocal vae, prompt_embeds, prompt_attention_mask
        prompts = batch["prompts"]

        # encode batch prompts when custom prompts are provided for each image -
        if train_dataset.custom_instance_prompts:
            prompt_embeds, prompt_attention_mask = compute_text_embeddings(
                prompts, text_encoding_pipeline
            )

        # Convert images to latent space
        if args.cache_latents:
            raise AssertionError("not this configuration")
        else:
            vae = vae.to(accelerator.device)
            pixel_values = batch["pixel_values"].to(dtype=vae.dtype)
            model_input = vae.encode(pixel_values).latent_dist.sample()
            if args.offload:
                vae = vae.to("cpu")
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
        # Lumina2 reverses the lerp i.e., sigma of 1.0 should mean `model_input`
        sigmas = get_sigmas(timesteps, n_dim=model_input.ndim, dtype=model_input.dtype)
        noisy_model_input = (1.0 - sigmas) * noise + sigmas * model_input

        # Predict the noise residual
        # scale the timesteps (reversal not needed as we used a reverse lerp above already)
        timesteps = timesteps / noise_scheduler.config.num_train_timesteps
        model_pred = transformer(
            hidden_states=noisy_model_input,
            encoder_hidden_states=prompt_embeds.repeat(len(prompts), 1, 1)
            if not train_dataset.custom_instance_prompts
            else prompt_embeds,
            encoder_attention_mask=prompt_attention_mask.repeat(len(prompts), 1)
            if not train_dataset.custom_instance_prompts
            else prompt_attention_mask,
            timestep=timesteps,
            return_dict=False,
        )[0]

        # these weighting schemes use a uniform timestep sampling
        # and instead post-weight the loss
        weighting = compute_loss_weighting_for_sd3(
            weighting_scheme=args.weighting_scheme, sigmas=sigmas
        )

        # flow matching loss (reversed)
        target = model_input - noise

        # Compute regular loss.
        loss = torch.mean(
            (weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(
                target.shape[0], -1
            ),
            1,
        )
        loss = loss.mean()
        return loss

    return types.SimpleNamespace(
        step=training_step,
        transformer=transformer,
        get_sigmas=get_sigmas,
        params=[p for p in transformer.parameters() if p.requires_grad],
    )


def _example(index: int, *, caption: bool) -> dict:
    """``DreamBoothDataset.__getitem__``: the image in [-1, 1] and its caption or the prompt."""
    generator = torch.Generator().manual_seed(1000 + index)
    return {
        "instance_images": torch.rand(3, RESOLUTION, RESOLUTION, generator=generator) * 2 - 1,
        "instance_prompt": CAPTIONS[index % len(CAPTIONS)] if caption else "a photo of sks dog",
    }


def _batch(indices, *, caption: bool = True) -> dict:
    return collate_fn([_example(i, caption=caption) for i in indices])


def _lora(parts) -> set[str]:
    return {f"transformer.{n}" for n, p in parts.transformer.named_parameters() if p.requires_grad}


def test_the_trace_refuses_the_pipelines_tokenizer_on_the_captions_naming_the_users_call():
    parts = build(custom_instance_prompts=True)
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(parts.step, (_batch([0, 1]),), path="trace")
    message = str(caught.value)
    # The user's line that calls into the pipeline, not diffusers' tokenizer call inside it.
    assert line_of(build, "= text_encoding_pipeline.encode_prompt(") in message
    assert "pass the token ids to the step" in message


def test_the_trace_refuses_get_sigmas_with_the_instance_prompt():
    parts = build(custom_instance_prompts=False)
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(parts.step, (_batch([0, 1], caption=False),), path="trace")
    assert line_of(parts.get_sigmas, "step_indices = [") in str(caught.value)


# The frozen work on the caption embeddings inside the transformer: the first context refiner
# block's norm and its LoRA'd q / k / v base layers (its output attention carries LoRA).
REFINER = {
    "transformer_context_refiner_0_norm1__0__out",
    "transformer_context_refiner_0_attn_to_q_base_layer__0__out",
    "transformer_context_refiner_0_attn_to_k_base_layer__0__out",
    "transformer_context_refiner_0_attn_to_v_base_layer__0__out",
}


def assert_the_moved_modules_are_not_held(split, batch, moved):
    """The step runs ``vae = vae.to(accelerator.device)`` (and ``text_encoding_pipeline.to``)
    every step, in stage 2 too. A move to where a module already is computes nothing, so stage
    2 holds none of those modules (it held them all before calls/usage.py's MOVES), and the
    report lists none as held though cached. Their weights are never computed with: with every
    one of them NaN, stage 2 still trains bit for bit. (Not on meta here: the step reads the
    text pipeline's ``.device`` to place the captions' ids.)"""
    assert split.to_json()["held_though_cached"] == []
    held = {name for name, _ in split.stage2.named_parameters()}
    assert not any(name.startswith(tuple(moved)) for name in held)
    boundary = split.stage1(**batch)
    torch.manual_seed(3)
    expected = split.stage2(**boundary)
    step = split.stage2._step
    with torch.no_grad():
        for path in moved:
            for param in step.get_submodule(path).parameters():
                param.fill_(float("nan"))
    torch.manual_seed(3)
    assert torch.equal(split.stage2(**boundary), expected)


@pytest.mark.parametrize("size", [1, 2])
def test_captions_cache_gemma_and_the_vae_encoder(size):
    parts = build(custom_instance_prompts=True)
    split = split_and_verify(parts.step, (_batch(range(size)),))
    assert split.path == "calls"
    assert unstored_inputs(split) == {"pixel_values"}  # only the cached VAE reads them
    assert cached_outputs(split) == {
        "vae_encoder__0__out",
        "text_encoding_pipeline_text_encoder__0__hidden_states__1",  # the captions' [-2]
        # encode_prompt's negative "" per sample (guidance on): computed on, then discarded
        "text_encoding_pipeline_text_encoder__1__hidden_states__1",
        *REFINER,
    }
    assert split.boundary["text_encoding_pipeline_text_encoder__0__hidden_states__1"].dtype == (
        torch.bfloat16  # as the script casts Gemma
    )
    stage1 = {".".join(n.split(".")[:2]) for n, _ in split.stage1.named_parameters()}
    assert stage1 == {
        "vae.encoder",
        "text_encoding_pipeline.text_encoder",
        "transformer.context_refiner",
    }
    assert {n for n, p in split.stage2.named_parameters() if p.requires_grad} == _lora(parts)
    other = _batch(range(size, 2 * size))
    assert all(c.ok for c in graphsplit.verify(parts.step, split, (other,), seed=1))
    assert_the_moved_modules_are_not_held(
        split, other, {"vae.encoder", "text_encoding_pipeline.text_encoder"}
    )
    # The step reads the pipeline's .device to place the captions' ids: the report says to
    # build it on the training device (not on meta), though stage 2 does not hold it.
    assert "build them on the training device, not on meta: text_encoding_pipeline" in (
        split.report()
    )


def test_the_instance_prompt_caches_the_vae_encoder():
    parts = build(custom_instance_prompts=False)
    split = split_and_verify(parts.step, (_batch([0, 1], caption=False),))
    assert split.path == "calls"
    assert line_of(parts.get_sigmas, "step_indices = [") in split.reason
    # The embeddings were computed before the loop: the refiner's frozen work on them is
    # stored with every row (a batch cannot tell a constant from a sample's own value).
    assert unstored_inputs(split) == {"pixel_values"}  # only the cached VAE reads them
    assert cached_outputs(split) == {"vae_encoder__0__out", *REFINER}
    assert {n for n, p in split.stage2.named_parameters() if p.requires_grad} == _lora(parts)
    assert "text_encoding_pipeline" not in stage2_top_modules(split)  # never called in the step
    assert_the_moved_modules_are_not_held(split, _batch([2, 3], caption=False), {"vae.encoder"})


@pytest.mark.parametrize("custom_instance_prompts", [True, False])
def test_cache_round_trip(tmp_path, custom_instance_prompts):
    parts = build(custom_instance_prompts=custom_instance_prompts)
    caption = custom_instance_prompts
    split = graphsplit.split(parts.step, (_batch([0, 1], caption=caption),))
    batches = [_batch([i, i + 1], caption=caption) for i in (2, 4, 6)]
    assert_trains_from_its_cache(split, parts.step, batches, tmp_path, parts.params)
