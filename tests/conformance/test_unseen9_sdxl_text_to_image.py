"""Conformance: ``examples/text_to_image/train_text_to_image_sdxl.py`` (a full UNet fine-tune).

``main()`` freezes the VAE and both CLIP text encoders (``requires_grad_(False)``) and trains
every UNet parameter (``unet.train()``). The script precomputes the frozen work itself: it
runs its ``encode_prompt`` and ``compute_vae_encodings`` (both verbatim here) over the dataset
with ``train_dataset.map(..., batched=True)`` and its ``collate_fn`` (verbatim) stacks the
stored ``model_input``, ``prompt_embeds`` and ``pooled_prompt_embeds``. Two forms of the step:

- ``"raw"``: what the loop computes when given the raw batch (the dataset before its
  ``.map``): the step calls the script's ``compute_embeddings_fn`` and
  ``compute_vae_encodings_fn`` (``functools.partial`` as in ``main()``) on the batch, as the
  ``.map`` calls them on a batch of rows (``compute_vae_encodings`` pops ``pixel_values`` from
  the dict it is given, so it gets its own), then runs the loop body. Here graphsplit must
  cache the text encoders' embeddings and the VAE's latents (the VAE is sampled once, as the
  script's ``.map`` samples it once: ``latent_dist.sample()`` in stage 1 under ``torch.no_grad``
  is the user's own choice, and what the cache must hold is exactly what the script stores).
- ``"upstream"``: the loop body as the script writes it, on the precomputed batch: nothing in
  the step is frozen, so there is nothing to cache; graphsplit refuses it, and the refusal must
  name the user's line, the fix and that no frozen module is called.

The loop body is the script's (default ``--timestep_bias_strategy none``, no noise offset, no
SNR weighting, no ``--prediction_type``, no EMA): noise and timesteps, ``add_noise``, the time
ids built per sample by ``compute_time_ids`` (defined inside the loop), the UNet with
``added_cond_kwargs`` and the MSE loss.

Tiny configs: diffusers' SDXL pipeline-test components (``unseen9_a_checks``), 32 px.
"""

from __future__ import annotations

import functools
import random
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import graphsplit
from graphsplit.calls.unfrozen import NOTHING_FROZEN_FIX
from tests.helpers import assert_stage1_holds_no_trainable, line_of

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

from tests.conformance.unseen2_data_checks import assert_cache_round_trip  # noqa: E402
from tests.conformance.unseen9_a_checks import (  # noqa: E402
    RESOLUTION,
    image,
    named_trainable,
    sdxl_components,
    sdxl_tokenizer,
    stage2_holds,
    trainable_in_stage2,
)
from tests.conformance.unseen_checks import stage2_top_modules  # noqa: E402

WORDS = ["a", "cartoon", "of", "pokemon", "blue", "green", "with", "wings", "small", "dragon"]
CAPTIONS = [
    "a cartoon of a blue dragon",
    "a green pokemon with wings",
    "a small blue pokemon",
    "a cartoon dragon with wings",
]


# Adapted from pipelines.StableDiffusionXLPipeline.encode_prompt
def encode_prompt(
    batch, text_encoders, tokenizers, proportion_empty_prompts, caption_column, is_train=True
):
    """The script's, verbatim."""
    prompt_embeds_list = []
    prompt_batch = batch[caption_column]

    captions = []
    for caption in prompt_batch:
        if random.random() < proportion_empty_prompts:
            captions.append("")
        elif isinstance(caption, str):
            captions.append(caption)
        elif isinstance(caption, (list, np.ndarray)):
            # take a random caption if there are multiple
            captions.append(random.choice(caption) if is_train else caption[0])

    with torch.no_grad():
        for tokenizer, text_encoder in zip(tokenizers, text_encoders):
            text_inputs = tokenizer(
                captions,
                padding="max_length",
                max_length=tokenizer.model_max_length,
                truncation=True,
                return_tensors="pt",
            )
            text_input_ids = text_inputs.input_ids
            prompt_embeds = text_encoder(
                text_input_ids.to(text_encoder.device),
                output_hidden_states=True,
                return_dict=False,
            )

            # We are only ALWAYS interested in the pooled output of the final text encoder
            pooled_prompt_embeds = prompt_embeds[0]
            prompt_embeds = prompt_embeds[-1][-2]
            bs_embed, seq_len, _ = prompt_embeds.shape
            prompt_embeds = prompt_embeds.view(bs_embed, seq_len, -1)
            prompt_embeds_list.append(prompt_embeds)

    prompt_embeds = torch.concat(prompt_embeds_list, dim=-1)
    pooled_prompt_embeds = pooled_prompt_embeds.view(bs_embed, -1)
    return {
        "prompt_embeds": prompt_embeds.cpu(),
        "pooled_prompt_embeds": pooled_prompt_embeds.cpu(),
    }


def compute_vae_encodings(batch, vae):
    """The script's, verbatim."""
    images = batch.pop("pixel_values")
    pixel_values = torch.stack(list(images))
    pixel_values = pixel_values.to(memory_format=torch.contiguous_format).float()
    pixel_values = pixel_values.to(vae.device, dtype=vae.dtype)

    with torch.no_grad():
        model_input = vae.encode(pixel_values).latent_dist.sample()
    model_input = model_input * vae.config.scaling_factor

    # There might have slightly performance improvement
    # by changing model_input.cpu() to accelerator.gather(model_input)
    return {"model_input": model_input.cpu()}


def collate_fn(examples):
    """The script's, verbatim (the precomputed dataset's)."""
    model_input = torch.stack([torch.tensor(example["model_input"]) for example in examples])
    original_sizes = [example["original_sizes"] for example in examples]
    crop_top_lefts = [example["crop_top_lefts"] for example in examples]
    prompt_embeds = torch.stack([torch.tensor(example["prompt_embeds"]) for example in examples])
    pooled_prompt_embeds = torch.stack(
        [torch.tensor(example["pooled_prompt_embeds"]) for example in examples]
    )

    return {
        "model_input": model_input,
        "prompt_embeds": prompt_embeds,
        "pooled_prompt_embeds": pooled_prompt_embeds,
        "original_sizes": original_sizes,
        "crop_top_lefts": crop_top_lefts,
    }


def raw_collate_fn(examples):
    """The raw dataset's batch (``preprocess_train``'s columns, the images stacked)."""
    return {
        "text": [example["text"] for example in examples],
        "pixel_values": torch.stack([example["pixel_values"] for example in examples]),
        "original_sizes": [example["original_sizes"] for example in examples],
        "crop_top_lefts": [example["crop_top_lefts"] for example in examples],
    }


def build(form: str):
    """``main()`` (one process, fp32, the script's defaults) and the step as a closure."""
    parts = sdxl_components(vocab_size=len(WORDS) + 3)
    unet, vae = parts.unet, parts.vae
    text_encoder_one, text_encoder_two = parts.text_encoder_one, parts.text_encoder_two
    noise_scheduler = parts.noise_scheduler
    tokenizer_one, tokenizer_two = sdxl_tokenizer(WORDS), sdxl_tokenizer(WORDS)
    args = types.SimpleNamespace(
        resolution=RESOLUTION,
        proportion_empty_prompts=0,
        caption_column="text",
        noise_offset=0,
        timestep_bias_strategy="none",
        prediction_type=None,
        snr_gamma=None,
    )
    accelerator = types.SimpleNamespace(device=torch.device("cpu"))

    # Freeze vae and text encoders.
    vae.requires_grad_(False)
    text_encoder_one.requires_grad_(False)
    text_encoder_two.requires_grad_(False)
    # Set unet as trainable.
    unet.train()
    weight_dtype = torch.float32

    text_encoders = [text_encoder_one, text_encoder_two]
    tokenizers = [tokenizer_one, tokenizer_two]
    compute_embeddings_fn = functools.partial(
        encode_prompt,
        text_encoders=text_encoders,
        tokenizers=tokenizers,
        proportion_empty_prompts=args.proportion_empty_prompts,
        caption_column=args.caption_column,
    )
    compute_vae_encodings_fn = functools.partial(compute_vae_encodings, vae=vae)

    def loop_body(batch):
        # Sample noise that we'll add to the latents
        model_input = batch["model_input"].to(accelerator.device)
        noise = torch.randn_like(model_input)
        if args.noise_offset:
            # https://www.crosslabs.org//blog/diffusion-with-offset-noise
            noise += args.noise_offset * torch.randn(
                (model_input.shape[0], model_input.shape[1], 1, 1), device=model_input.device
            )

        bsz = model_input.shape[0]
        if args.timestep_bias_strategy == "none":
            # Sample a random timestep for each image without bias.
            timesteps = torch.randint(
                0, noise_scheduler.config.num_train_timesteps, (bsz,), device=model_input.device
            )
        else:
            raise AssertionError("timestep bias: not a configuration tested here")

        # Add noise to the model input according to the noise magnitude at each timestep
        # (this is the forward diffusion process)
        noisy_model_input = noise_scheduler.add_noise(model_input, noise, timesteps).to(
            dtype=weight_dtype
        )

        # time ids
        def compute_time_ids(original_size, crops_coords_top_left):
            # Adapted from pipeline.StableDiffusionXLPipeline._get_add_time_ids
            target_size = (args.resolution, args.resolution)
            add_time_ids = list(original_size + crops_coords_top_left + target_size)
            add_time_ids = torch.tensor(
                [add_time_ids], device=accelerator.device, dtype=weight_dtype
            )
            return add_time_ids

        add_time_ids = torch.cat(
            [
                compute_time_ids(s, c)
                for s, c in zip(batch["original_sizes"], batch["crop_top_lefts"])
            ]
        )

        # Predict the noise residual
        unet_added_conditions = {"time_ids": add_time_ids}
        prompt_embeds = batch["prompt_embeds"].to(accelerator.device, dtype=weight_dtype)
        pooled_prompt_embeds = batch["pooled_prompt_embeds"].to(accelerator.device)
        unet_added_conditions.update({"text_embeds": pooled_prompt_embeds})
        model_pred = unet(
            noisy_model_input,
            timesteps,
            prompt_embeds,
            added_cond_kwargs=unet_added_conditions,
            return_dict=False,
        )[0]

        # Get the target for loss depending on the prediction type
        if args.prediction_type is not None:
            # set prediction_type of scheduler if defined
            noise_scheduler.register_to_config(prediction_type=args.prediction_type)

        if noise_scheduler.config.prediction_type == "epsilon":
            target = noise
        elif noise_scheduler.config.prediction_type == "v_prediction":
            target = noise_scheduler.get_velocity(model_input, noise, timesteps)
        elif noise_scheduler.config.prediction_type == "sample":
            # We set the target to latents here, but the model_pred will return the noise
            # sample prediction.
            target = model_input
            # We will have to subtract the noise residual from the prediction to get the
            # target sample.
            model_pred = model_pred - noise
        else:
            raise ValueError(f"Unknown prediction type {noise_scheduler.config.prediction_type}")

        if args.snr_gamma is None:
            loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
        else:
            raise AssertionError("SNR weighting: not a configuration tested here")
        return loss

    if form == "raw":

        def training_step(batch):
            # the script's two ``.map`` passes, on this batch of rows
            batch = {
                **batch,
                **compute_embeddings_fn(batch),
                **compute_vae_encodings_fn(dict(batch)),
            }
            return loop_body(batch)

    else:
        training_step = loop_body

    params = [p for p in unet.parameters() if p.requires_grad]
    return types.SimpleNamespace(
        step=training_step,
        unet=unet,
        vae=vae,
        compute_embeddings_fn=compute_embeddings_fn,
        compute_vae_encodings_fn=compute_vae_encodings_fn,
        params=params,
    )


def _row(index: int) -> dict:
    """``preprocess_train``'s row: the caption, the image in [-1, 1], its original size and
    crop corner."""
    return {
        "text": CAPTIONS[index % len(CAPTIONS)],
        "pixel_values": image(index),
        "original_sizes": (RESOLUTION + 8 * index, RESOLUTION + 4 * index),
        "crop_top_lefts": (index % 3, 2 * index % 5),
    }


def _raw_batch(indices) -> dict:
    return raw_collate_fn([_row(i) for i in indices])


def _precomputed_batch(parts, indices) -> dict:
    """The rows after the script's two ``.map`` passes (Arrow stores tensors as lists), through
    the script's ``collate_fn``."""
    rows = [_row(i) for i in indices]
    columns = {key: [row[key] for row in rows] for key in rows[0]}
    torch.manual_seed(50 + indices[0])
    computed = {**parts.compute_embeddings_fn(columns), **parts.compute_vae_encodings_fn(columns)}
    examples = [
        {**row, **{key: value[i].tolist() for key, value in computed.items()}}
        for i, row in enumerate(rows)
    ]
    return collate_fn(examples)


_BUILT: dict[str, tuple] = {}


def _built(form: str):
    if form not in _BUILT:
        parts = build(form)
        example = _raw_batch([0, 1]) if form == "raw" else _precomputed_batch(parts, [0, 1])
        _BUILT[form] = (parts, graphsplit.split(parts.step, (example,)))
    return _BUILT[form]


def _batch(form: str, parts, indices) -> dict:
    return _raw_batch(indices) if form == "raw" else _precomputed_batch(parts, indices)


FORMS = ["raw"]


@pytest.mark.parametrize("form", FORMS)
def test_sdxl_text_to_image_verifies_on_the_example_and_another_size(form):
    parts, split = _built(form)
    assert_stage1_holds_no_trainable(split)
    for seed, indices in enumerate([[0, 1], [2, 3, 4]]):
        batch = _batch(form, parts, indices)
        checks = graphsplit.verify(parts.step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


def test_raw_form_caches_the_vae_and_both_text_encoders():
    parts, split = _built("raw")
    held = stage2_top_modules(split)
    assert not {"text_encoders", "text_encoder_one", "text_encoder_two"} & held, held
    assert not stage2_holds(split, "vae")
    assert "pixel_values" not in split.boundary
    # both encoders' penultimate hidden states, the second's pooled embedding and the VAE's
    # latent distribution (``latent_dist.sample()`` is drawn again in stage 2)
    assert {key for key in split.boundary if key.startswith(("text_encoders", "vae"))} == {
        "text_encoders_0__0__2__1",
        "text_encoders_1__0__0",
        "text_encoders_1__0__2__1",
        "vae_quant_conv__0__out",
    }
    assert "unet" in held
    assert trainable_in_stage2(split) == named_trainable("unet", parts.unet)


def test_upstream_form_is_refused_naming_the_loop_and_that_nothing_is_frozen():
    """The loop body on the precomputed batch calls no frozen module: there is nothing to
    cache, and that leads the refusal; the trace's refusal of the per-sample
    ``compute_time_ids`` loop (naming the line and the fix) follows as a note."""
    parts = build("upstream")
    with pytest.raises(graphsplit.SplitError) as caught:
        graphsplit.split(parts.step, (_precomputed_batch(parts, [0, 1]),))
    headline = str(caught.value)
    assert headline.startswith("nothing of this step can be cached: it calls no frozen module")
    assert NOTHING_FROZEN_FIX.words in headline
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "depends on the batch size" in notes
    assert line_of(parts.step, "for s, c in zip(") in notes


@pytest.mark.parametrize("form", FORMS)
def test_sdxl_text_to_image_cache_round_trip(form, tmp_path):
    parts, split = _built(form)
    loader = [_batch(form, parts, [4, 5]), _batch(form, parts, [6, 7]), _batch(form, parts, [8])]
    assert_cache_round_trip(split, parts.step, loader, tmp_path / "cache", parts.params)
