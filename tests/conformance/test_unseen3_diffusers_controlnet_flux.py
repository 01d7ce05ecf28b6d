"""Conformance: ``examples/controlnet/train_controlnet_flux.py``'s training step.

A trainable ``FluxControlNetModel`` (made with ``from_transformer``, as the script does without
``--controlnet_model_name_or_path``) beside the frozen Flux transformer, which it feeds its
per-block residuals (``controlnet_block_samples`` / ``controlnet_single_block_samples``). The
text is encoded before training: the script maps its ``compute_embeddings`` over the dataset
(``FluxControlNetPipeline.encode_prompt``: CLIP pooled, T5 at the pipeline's 512 tokens) and the
``collate_fn`` stacks the stored lists into ``prompt_ids`` and ``unet_added_conditions``
(a dict of batched tensors). The step encodes the target image and the conditioning image with
the frozen VAE (``latent_dist.sample()`` for both), packs both, draws noise and logit-normal
timesteps (the default ``--weighting_scheme``), looks sigmas up with the script's
``get_sigmas`` and runs the controlnet, then the transformer, with guidance (FLUX.1-dev's).

``get_sigmas``' ``.nonzero().item()`` makes the whole-step trace refuse, naming that line;
``path="auto"`` takes the module-level path. What must hold: the VAE's encoder is cached for
both images (the moments; the samples are drawn in stage 2) and stage 2 holds no VAE encoder
weight, nor any VAE weight at all; the frozen transformer stays in stage 2 whole (its input
carries the controlnet's residuals; a wholly frozen module is one call to the module-level path,
so its context embedder's work on the batch's text embeddings is not looked into); every
controlnet gradient matches the unsplit step bit for bit, from a cache on disk too.

Tiny configs: diffusers' ``tests/pipelines/controlnet_flux/test_controlnet_flux.py`` components
(1 + 1 blocks, latent channels 4, VAE scale factor 1; ``guidance_embeds=True``), a 2-layer T5 as
the SD3 test uses, real word-level tokenizers, 16 px.
"""

from __future__ import annotations

import copy
import functools
import random
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import graphsplit
from tests.helpers import line_of, split_and_verify

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
from diffusers import FluxControlNetModel, FluxControlNetPipeline  # noqa: E402
from diffusers.training_utils import compute_density_for_timestep_sampling  # noqa: E402

from tests.conformance.unseen2_checks import assert_trains_from_its_cache  # noqa: E402
from tests.conformance.unseen_checks import stage2_top_modules, word_tokenizer  # noqa: E402

WORDS = ["a", "red", "blue", "circle", "square", "on", "white", "black", "canny", "edges", "of"]
CAPTIONS = ["a red circle", "a blue square on white", "canny edges of a circle", "black"]
RESOLUTION = 16

pytestmark = pytest.mark.filterwarnings("ignore:`FluxPosEmbed` is deprecated:FutureWarning")


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

    prompt_ids = torch.stack([torch.tensor(example["prompt_embeds"]) for example in examples])

    pooled_prompt_embeds = torch.stack(
        [torch.tensor(example["pooled_prompt_embeds"]) for example in examples]
    )
    text_ids = torch.stack([torch.tensor(example["text_ids"]) for example in examples])

    return {
        "pixel_values": pixel_values,
        "conditioning_pixel_values": conditioning_pixel_values,
        "prompt_ids": prompt_ids,
        "unet_added_conditions": {
            "pooled_prompt_embeds": pooled_prompt_embeds,
            "time_ids": text_ids,
        },
    }


def _models():
    """diffusers' Flux ControlNet pipeline test components (guidance embeds on, as FLUX.1-dev)."""
    torch.manual_seed(0)
    transformer = diffusers.FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8],
        guidance_embeds=True,
    )
    clip_text_encoder_config = transformers.CLIPTextConfig(
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
    torch.manual_seed(0)
    text_encoder_one = transformers.CLIPTextModel(clip_text_encoder_config)
    torch.manual_seed(0)
    text_encoder_two = transformers.T5EncoderModel(
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
        latent_channels=4,
        norm_num_groups=1,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
    )
    for model in (transformer, vae, text_encoder_one, text_encoder_two):
        model.eval()  # as from_pretrained returns them
    return transformer, vae, text_encoder_one, text_encoder_two


def build():
    """``main()``'s models, its dataset ``map`` of ``compute_embeddings`` and the loop body as a
    closure (one process, fp32, no accumulation)."""
    flux_transformer, vae, text_encoder_one, text_encoder_two = _models()
    tokenizer_one, tokenizer_two = word_tokenizer(WORDS), word_tokenizer(WORDS)
    tokenizer_one.model_max_length = 77  # CLIP's
    args = types.SimpleNamespace(
        caption_column="text",
        proportion_empty_prompts=0.0,
        num_double_layers=1,
        num_single_layers=1,
        weighting_scheme="logit_normal",
        logit_mean=0.0,
        logit_std=1.0,
        mode_scale=1.29,
        guidance_scale=3.5,
    )
    accelerator = types.SimpleNamespace(device=torch.device("cpu"))
    torch.manual_seed(1)
    flux_controlnet = FluxControlNetModel.from_transformer(
        flux_transformer,
        attention_head_dim=flux_transformer.config["attention_head_dim"],
        num_attention_heads=flux_transformer.config["num_attention_heads"],
        num_layers=args.num_double_layers,
        num_single_layers=args.num_single_layers,
    )
    with torch.no_grad():  # as after some steps: its zero-initialised input and output layers
        for param in flux_controlnet.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    noise_scheduler = diffusers.FlowMatchEulerDiscreteScheduler()
    noise_scheduler_copy = copy.deepcopy(noise_scheduler)
    vae.requires_grad_(False)
    flux_transformer.requires_grad_(False)
    text_encoder_one.requires_grad_(False)
    text_encoder_two.requires_grad_(False)
    flux_controlnet.train()

    flux_controlnet_pipeline = FluxControlNetPipeline(
        scheduler=noise_scheduler,
        vae=vae,
        text_encoder=text_encoder_one,
        tokenizer=tokenizer_one,
        text_encoder_2=text_encoder_two,
        tokenizer_2=tokenizer_two,
        transformer=flux_transformer,
        controlnet=flux_controlnet,
    )
    flux_controlnet_pipeline.to(accelerator.device)
    weight_dtype = torch.float32
    vae.to(accelerator.device, dtype=weight_dtype)
    flux_transformer.to(accelerator.device, dtype=weight_dtype)

    def compute_embeddings(
        batch, proportion_empty_prompts, flux_controlnet_pipeline, weight_dtype, is_train=True
    ):
        prompt_batch = batch[args.caption_column]
        captions = []
        for caption in prompt_batch:
            if random.random() < proportion_empty_prompts:
                captions.append("")
            elif isinstance(caption, str):
                captions.append(caption)
            elif isinstance(caption, (list, np.ndarray)):
                # take a random caption if there are multiple
                captions.append(random.choice(caption) if is_train else caption[0])
        prompt_batch = captions
        prompt_embeds, pooled_prompt_embeds, text_ids = flux_controlnet_pipeline.encode_prompt(
            prompt_batch, prompt_2=prompt_batch
        )
        prompt_embeds = prompt_embeds.to(dtype=weight_dtype)
        pooled_prompt_embeds = pooled_prompt_embeds.to(dtype=weight_dtype)
        text_ids = text_ids.to(dtype=weight_dtype)

        # text_ids [512,3] to [bs,512,3]
        text_ids = text_ids.unsqueeze(0).expand(prompt_embeds.shape[0], -1, -1)
        return {
            "prompt_embeds": prompt_embeds,
            "pooled_prompt_embeds": pooled_prompt_embeds,
            "text_ids": text_ids,
        }

    compute_embeddings_fn = functools.partial(
        compute_embeddings,
        flux_controlnet_pipeline=flux_controlnet_pipeline,
        proportion_empty_prompts=args.proportion_empty_prompts,
        weight_dtype=weight_dtype,
    )

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
        # vae encode
        pixel_values = batch["pixel_values"].to(dtype=weight_dtype)
        pixel_latents_tmp = vae.encode(pixel_values).latent_dist.sample()
        pixel_latents_tmp = (
            pixel_latents_tmp - vae.config.shift_factor
        ) * vae.config.scaling_factor
        pixel_latents = FluxControlNetPipeline._pack_latents(
            pixel_latents_tmp,
            pixel_values.shape[0],
            pixel_latents_tmp.shape[1],
            pixel_latents_tmp.shape[2],
            pixel_latents_tmp.shape[3],
        )

        control_values = batch["conditioning_pixel_values"].to(dtype=weight_dtype)
        control_latents = vae.encode(control_values).latent_dist.sample()
        control_latents = (control_latents - vae.config.shift_factor) * vae.config.scaling_factor
        control_image = FluxControlNetPipeline._pack_latents(
            control_latents,
            control_values.shape[0],
            control_latents.shape[1],
            control_latents.shape[2],
            control_latents.shape[3],
        )

        latent_image_ids = FluxControlNetPipeline._prepare_latent_image_ids(
            batch_size=pixel_latents_tmp.shape[0],
            height=pixel_latents_tmp.shape[2] // 2,
            width=pixel_latents_tmp.shape[3] // 2,
            device=pixel_values.device,
            dtype=pixel_values.dtype,
        )

        bsz = pixel_latents.shape[0]
        noise = torch.randn_like(pixel_latents).to(accelerator.device).to(dtype=weight_dtype)
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
        timesteps = noise_scheduler_copy.timesteps[indices].to(device=pixel_latents.device)

        # Add noise according to flow matching.
        sigmas = get_sigmas(timesteps, n_dim=pixel_latents.ndim, dtype=pixel_latents.dtype)
        noisy_model_input = (1.0 - sigmas) * pixel_latents + sigmas * noise

        # handle guidance
        if flux_transformer.config.guidance_embeds:
            guidance_vec = torch.full(
                (noisy_model_input.shape[0],),
                args.guidance_scale,
                device=noisy_model_input.device,
                dtype=weight_dtype,
            )
        else:
            guidance_vec = None

        controlnet_block_samples, controlnet_single_block_samples = flux_controlnet(
            hidden_states=noisy_model_input,
            controlnet_cond=control_image,
            timestep=timesteps / 1000,
            guidance=guidance_vec,
            pooled_projections=batch["unet_added_conditions"]["pooled_prompt_embeds"].to(
                dtype=weight_dtype
            ),
            encoder_hidden_states=batch["prompt_ids"].to(dtype=weight_dtype),
            txt_ids=batch["unet_added_conditions"]["time_ids"][0].to(dtype=weight_dtype),
            img_ids=latent_image_ids,
            return_dict=False,
        )

        noise_pred = flux_transformer(
            hidden_states=noisy_model_input,
            timestep=timesteps / 1000,
            guidance=guidance_vec,
            pooled_projections=batch["unet_added_conditions"]["pooled_prompt_embeds"].to(
                dtype=weight_dtype
            ),
            encoder_hidden_states=batch["prompt_ids"].to(dtype=weight_dtype),
            controlnet_block_samples=[
                sample.to(dtype=weight_dtype) for sample in controlnet_block_samples
            ]
            if controlnet_block_samples is not None
            else None,
            controlnet_single_block_samples=[
                sample.to(dtype=weight_dtype) for sample in controlnet_single_block_samples
            ]
            if controlnet_single_block_samples is not None
            else None,
            txt_ids=batch["unet_added_conditions"]["time_ids"][0].to(dtype=weight_dtype),
            img_ids=latent_image_ids,
            return_dict=False,
        )[0]

        loss = F.mse_loss(noise_pred.float(), (noise - pixel_latents).float(), reduction="mean")
        return loss

    return types.SimpleNamespace(
        step=training_step,
        controlnet=flux_controlnet,
        embed=compute_embeddings_fn,
        get_sigmas=get_sigmas,
    )


@functools.cache
def _rows(count: int) -> tuple[dict, ...]:
    """The dataset after ``train_dataset.map(compute_embeddings_fn, batched=True)`` and
    ``preprocess_train``: images in [-1, 1] and the stored embeddings as lists (as 🤗 datasets
    returns them; ``collate_fn`` turns them back into tensors)."""
    embedded = build().embed({"text": [CAPTIONS[i % len(CAPTIONS)] for i in range(count)]})
    rows = []
    for index in range(count):
        generator = torch.Generator().manual_seed(1100 + index)
        images = torch.rand(2, 3, RESOLUTION, RESOLUTION, generator=generator) * 2 - 1
        rows.append(
            {
                "pixel_values": images[0],
                "conditioning_pixel_values": images[1],
                **{key: value[index].tolist() for key, value in embedded.items()},
            }
        )
    return tuple(rows)


def _batch(indices) -> dict:
    rows = _rows(8)
    return collate_fn([rows[i] for i in indices])


def _cached(split) -> set[str]:
    return {key for key, spec in split.boundary.items() if spec.source != "input"}


def test_the_trace_refuses_get_sigmas_naming_its_line():
    parts = build()
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(parts.step, (_batch([0, 1]),), path="trace")
    assert line_of(parts.get_sigmas, "step_indices = [") in str(caught.value)


@pytest.mark.parametrize("size", [1, 2])
def test_the_vae_is_cached_for_both_images_and_the_controlnet_trains_exactly(size):
    parts = build()
    split = split_and_verify(parts.step, (_batch(range(size)),))
    assert split.path == "calls"
    assert line_of(parts.get_sigmas, "step_indices = [") in split.reason
    # The moments of both images; the samples are drawn in stage 2.
    assert _cached(split) == {"vae_encoder__0__out", "vae_encoder__1__out"}
    # The batch's dict of text conditions crosses key by key.
    assert {"unet_added_conditions__pooled_prompt_embeds", "unet_added_conditions__time_ids"} <= (
        set(split.boundary)
    )
    assert {
        n.split(".")[0] + "." + n.split(".")[1] for n, _ in split.stage1.named_parameters()
    } == {"vae.encoder"}
    # The frozen transformer takes the controlnet's residuals: it stays in stage 2, whole. The
    # VAE is not held at all (the step computes with none of its weights there).
    assert stage2_top_modules(split) == {"flux_controlnet", "flux_transformer"}
    assert "vae" in split.plan.not_held
    controlnet = {f"flux_controlnet.{n}" for n, _ in parts.controlnet.named_parameters()}
    assert {n for n, p in split.stage2.named_parameters() if p.requires_grad} == controlnet
    other = _batch(range(size, 2 * size))
    assert all(c.ok for c in graphsplit.verify(parts.step, split, (other,), seed=1))


def test_cache_round_trip(tmp_path):
    parts = build()
    split = graphsplit.split(parts.step, (_batch([0, 1]),))
    batches = [_batch([2, 3]), _batch([4, 5]), _batch([6, 7])]
    params = list(parts.controlnet.parameters())
    assert_trains_from_its_cache(split, parts.step, batches, tmp_path, params)
