"""Conformance: ``examples/advanced_diffusion_training/train_dreambooth_lora_sdxl_advanced.py``
with pivotal tuning (``--train_text_encoder_ti``).

The script's ``TokenEmbeddingsHandler`` (verbatim, less ``save_embeddings``) adds the
``--token_abstraction`` ``TOK``'s two new tokens ``<s0><s1>`` to both tokenizers, resizes both
CLIP text encoders' token embeddings and draws the new rows; ``main()`` then freezes the VAE,
both text encoders and the UNet, adds a LoRA to the UNet (``to_k/to_q/to_v/to_out.0``) and
makes every ``token_embedding`` parameter of both text encoders trainable (the rest of each
text encoder stays frozen); the loop puts the UNet and both text encoders in train mode. The
loop body is the script's (``freeze_text_encoder`` is False): the captions tokenized in the
step with ``add_special_tokens=True`` (``--caption_column``) or the instance prompt's tokens
computed before the loop, the VAE's ``latent_dist.sample()`` times ``vae_scaling_factor``,
DDPM noise and timesteps, the per-sample ``compute_time_ids`` loop, ``encode_prompt`` over the
token ids (both encoders' penultimate hidden states and the second's pooled embedding) and the
MSE loss; after ``optimizer.step()`` the loop calls ``embedding_handler.retract_embeddings()``.

What must hold: the step splits exactly (the UNet's LoRA and both token embeddings' gradients
bit for bit, on the example and on a batch of another size); the VAE is cached (its encoder is
not held by stage 2), the text encoders are not (every call of them reads a trainable token
embedding) and stage 2 trains exactly what the script trains; a cache written through the disk
still trains stage 2 exactly after an optimizer step and the script's ``retract_embeddings``
(which rewrites the token embeddings in place).

Tiny configs: diffusers' SDXL pipeline-test components (``unseen9_a_checks``), 32 px.
"""

from __future__ import annotations

import types
from typing import List, Optional  # noqa: UP035 (the script's)

import pytest
import torch
import torch.nn.functional as F

import graphsplit
from tests.helpers import assert_stage1_holds_no_trainable, line_of

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from tests.conformance.unseen2_checks import cached_outputs, unstored_inputs  # noqa: E402
from tests.conformance.unseen9_a_checks import (  # noqa: E402
    RESOLUTION,
    image,
    named_trainable,
    sdxl_components,
    sdxl_tokenizer,
    stage2_holds,
    trainable_in_stage2,
)
from tests.conformance.unseen_checks import loss_and_grads, stage2_top_modules  # noqa: E402

WORDS = ["a", "photo", "of", "dog", "on", "the", "beach", "in", "snow", "red", "blue", "TOK"]
CAPTIONS = ["a photo of TOK dog on the beach", "a TOK dog in snow", "a red dog", "a blue TOK dog"]


class TokenEmbeddingsHandler:
    """The script's, verbatim (``save_embeddings`` left out: nothing is saved here)."""

    def __init__(self, text_encoders, tokenizers):
        self.text_encoders = text_encoders
        self.tokenizers = tokenizers

        self.train_ids: Optional[torch.Tensor] = None  # noqa: UP045
        self.inserting_toks: Optional[List[str]] = None  # noqa: UP006, UP045
        self.embeddings_settings = {}

    def initialize_new_tokens(self, inserting_toks: List[str]):  # noqa: UP006
        idx = 0
        for tokenizer, text_encoder in zip(self.tokenizers, self.text_encoders):
            assert isinstance(inserting_toks, list), "inserting_toks should be a list of strings."
            assert all(isinstance(tok, str) for tok in inserting_toks), (
                "All elements in inserting_toks should be strings."
            )

            self.inserting_toks = inserting_toks
            special_tokens_dict = {"additional_special_tokens": self.inserting_toks}
            tokenizer.add_special_tokens(special_tokens_dict)
            text_encoder.resize_token_embeddings(len(tokenizer))

            self.train_ids = tokenizer.convert_tokens_to_ids(self.inserting_toks)

            # random initialization of new tokens
            std_token_embedding = (
                text_encoder.text_model if hasattr(text_encoder, "text_model") else text_encoder
            ).embeddings.token_embedding.weight.data.std()

            print(f"{idx} text encoder's std_token_embedding: {std_token_embedding}")

            (
                text_encoder.text_model if hasattr(text_encoder, "text_model") else text_encoder
            ).embeddings.token_embedding.weight.data[self.train_ids] = (
                torch.randn(
                    len(self.train_ids),
                    (
                        text_encoder.text_model
                        if hasattr(text_encoder, "text_model")
                        else text_encoder
                    ).config.hidden_size,
                )
                .to(device=self.device)
                .to(dtype=self.dtype)
                * std_token_embedding
            )
            self.embeddings_settings[f"original_embeddings_{idx}"] = (
                text_encoder.text_model if hasattr(text_encoder, "text_model") else text_encoder
            ).embeddings.token_embedding.weight.data.clone()
            self.embeddings_settings[f"std_token_embedding_{idx}"] = std_token_embedding

            inu = torch.ones((len(tokenizer),), dtype=torch.bool)
            inu[self.train_ids] = False

            self.embeddings_settings[f"index_no_updates_{idx}"] = inu

            print(self.embeddings_settings[f"index_no_updates_{idx}"].shape)

            idx += 1  # noqa: SIM113

    @property
    def dtype(self):
        return self.text_encoders[0].dtype

    @property
    def device(self):
        return self.text_encoders[0].device

    @torch.no_grad()
    def retract_embeddings(self):
        for idx, text_encoder in enumerate(self.text_encoders):
            index_no_updates = self.embeddings_settings[f"index_no_updates_{idx}"]
            (
                text_encoder.text_model if hasattr(text_encoder, "text_model") else text_encoder
            ).embeddings.token_embedding.weight.data[index_no_updates] = (
                self.embeddings_settings[f"original_embeddings_{idx}"][index_no_updates]
                .to(device=text_encoder.device)
                .to(dtype=text_encoder.dtype)
            )

            # for the parts that were updated, we need to normalize them
            # to have the same std as before
            std_token_embedding = self.embeddings_settings[f"std_token_embedding_{idx}"]

            index_updates = ~index_no_updates
            new_embeddings = (
                text_encoder.text_model if hasattr(text_encoder, "text_model") else text_encoder
            ).embeddings.token_embedding.weight.data[index_updates]
            off_ratio = std_token_embedding / new_embeddings.std()

            new_embeddings = new_embeddings * (off_ratio**0.1)
            (
                text_encoder.text_model if hasattr(text_encoder, "text_model") else text_encoder
            ).embeddings.token_embedding.weight.data[index_updates] = new_embeddings


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
        original_sizes += [example["class_original_size"] for example in examples]
        crop_top_lefts += [example["class_crop_top_left"] for example in examples]

    pixel_values = torch.stack(pixel_values)
    pixel_values = pixel_values.to(memory_format=torch.contiguous_format).float()

    batch = {
        "pixel_values": pixel_values,
        "prompts": prompts,
        "original_sizes": original_sizes,
        "crop_top_lefts": crop_top_lefts,
    }
    return batch


def tokenize_prompt(tokenizer, prompt, add_special_tokens=False):
    """The script's, verbatim."""
    text_inputs = tokenizer(
        prompt,
        padding="max_length",
        max_length=tokenizer.model_max_length,
        truncation=True,
        add_special_tokens=add_special_tokens,
        return_tensors="pt",
    )
    text_input_ids = text_inputs.input_ids
    return text_input_ids


# Adapted from pipelines.StableDiffusionXLPipeline.encode_prompt
def encode_prompt(text_encoders, tokenizers, prompt, text_input_ids_list=None, clip_skip=None):
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
        if clip_skip is None:
            prompt_embeds = prompt_embeds[-1][-2]
        else:
            # "2" because SDXL always indexes from the penultimate layer.
            prompt_embeds = prompt_embeds[-1][-(clip_skip + 2)]
        bs_embed, seq_len, _ = prompt_embeds.shape
        prompt_embeds = prompt_embeds.view(bs_embed, seq_len, -1)
        prompt_embeds_list.append(prompt_embeds)

    prompt_embeds = torch.concat(prompt_embeds_list, dim=-1)
    pooled_prompt_embeds = pooled_prompt_embeds.view(bs_embed, -1)
    return prompt_embeds, pooled_prompt_embeds


def build(*, custom_instance_prompts: bool, rank: int = 4):
    """``main()`` with ``--train_text_encoder_ti --token_abstraction TOK
    --num_new_tokens_per_abstraction 2`` (one process, fp32, no prior preservation, no EDM, no
    SNR weighting, no ``--cache_latents``)."""
    parts = sdxl_components(vocab_size=len(WORDS) + 3)
    unet, vae = parts.unet, parts.vae
    text_encoder_one, text_encoder_two = parts.text_encoder_one, parts.text_encoder_two
    noise_scheduler = parts.noise_scheduler
    tokenizer_one, tokenizer_two = sdxl_tokenizer(WORDS), sdxl_tokenizer(WORDS)
    args = types.SimpleNamespace(
        instance_prompt="a photo of TOK dog",
        token_abstraction="TOK",
        num_new_tokens_per_abstraction=2,
        train_text_encoder=False,
        train_text_encoder_ti=True,
        with_prior_preservation=False,
        do_edm_style_training=False,
        pretrained_vae_model_name_or_path=None,
        noise_offset=0,
        snr_gamma=None,
        clip_skip=None,
        resolution=RESOLUTION,
        rank=rank,
        lora_dropout=0.0,
        use_dora=False,
        cache_latents=False,
    )
    accelerator = types.SimpleNamespace(device=torch.device("cpu"))
    latents_mean = latents_std = None
    if hasattr(vae.config, "latents_mean") and vae.config.latents_mean is not None:
        latents_mean = torch.tensor(vae.config.latents_mean).view(1, 4, 1, 1)
    if hasattr(vae.config, "latents_std") and vae.config.latents_std is not None:
        latents_std = torch.tensor(vae.config.latents_std).view(1, 4, 1, 1)

    if args.train_text_encoder_ti:
        # we parse the provided token identifier (or identifiers) into a list. s.t. - "TOK" ->
        # ["TOK"], "TOK, TOK2" -> ["TOK", "TOK2"] etc.
        token_abstraction_list = "".join(args.token_abstraction.split()).split(",")

        token_abstraction_dict = {}
        token_idx = 0
        for i, token in enumerate(token_abstraction_list):
            token_abstraction_dict[token] = [
                f"<s{token_idx + i + j}>" for j in range(args.num_new_tokens_per_abstraction)
            ]
            token_idx += args.num_new_tokens_per_abstraction - 1

        # replace instances of --token_abstraction in --instance_prompt with the new tokens:
        # "<si><si+1>" etc.
        for token_abs, token_replacement in token_abstraction_dict.items():
            args.instance_prompt = args.instance_prompt.replace(
                token_abs, "".join(token_replacement)
            )
        # initialize the new tokens for textual inversion
        torch.manual_seed(2)
        embedding_handler = TokenEmbeddingsHandler(
            [text_encoder_one, text_encoder_two], [tokenizer_one, tokenizer_two]
        )
        inserting_toks = []
        for new_tok in token_abstraction_dict.values():
            inserting_toks.extend(new_tok)
        embedding_handler.initialize_new_tokens(inserting_toks=inserting_toks)

    # We only train the additional adapter LoRA layers
    vae.requires_grad_(False)
    text_encoder_one.requires_grad_(False)
    text_encoder_two.requires_grad_(False)
    unet.requires_grad_(False)
    weight_dtype = torch.float32

    torch.manual_seed(1)
    target_modules = ["to_k", "to_q", "to_v", "to_out.0"]
    unet_lora_config = peft.LoraConfig(
        r=args.rank,
        use_dora=args.use_dora,
        lora_alpha=args.rank,
        lora_dropout=args.lora_dropout,
        init_lora_weights="gaussian",
        target_modules=target_modules,
    )
    unet.add_adapter(unet_lora_config)
    with torch.no_grad():  # as after some steps: lora_B starts at zero
        for name, param in unet.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.02)

    # if we use textual inversion, we freeze all parameters except for the token embeddings
    # in text encoder
    if args.train_text_encoder_ti:
        text_lora_parameters_one = []
        for name, param in text_encoder_one.named_parameters():
            if "token_embedding" in name:
                # ensure that dtype is float32, even if rest of the model that isn't trained is
                # loaded in fp16
                param.data = param.to(dtype=torch.float32)
                param.requires_grad = True
                text_lora_parameters_one.append(param)
            else:
                param.requires_grad = False
        text_lora_parameters_two = []
        for name, param in text_encoder_two.named_parameters():
            if "token_embedding" in name:
                # ensure that dtype is float32, even if rest of the model that isn't trained is
                # loaded in fp16
                param.data = param.to(dtype=torch.float32)
                param.requires_grad = True
                text_lora_parameters_two.append(param)
            else:
                param.requires_grad = False

    unet_lora_parameters = list(filter(lambda p: p.requires_grad, unet.parameters()))
    # If neither --train_text_encoder nor --train_text_encoder_ti, text_encoders remain frozen
    freeze_text_encoder = not (args.train_text_encoder or args.train_text_encoder_ti)
    train_dataset = types.SimpleNamespace(
        custom_instance_prompts=CAPTIONS if custom_instance_prompts else None,
        token_abstraction_dict=token_abstraction_dict,
    )

    def compute_time_ids(crops_coords_top_left, original_size=None):
        # Adapted from pipeline.StableDiffusionXLPipeline._get_add_time_ids
        target_size = (args.resolution, args.resolution)
        add_time_ids = list(original_size + crops_coords_top_left + target_size)
        add_time_ids = torch.tensor([add_time_ids])
        add_time_ids = add_time_ids.to(accelerator.device, dtype=weight_dtype)
        return add_time_ids

    # if --train_text_encoder_ti we need add_special_tokens to be True for textual inversion
    add_special_tokens = True if args.train_text_encoder_ti else False  # noqa: SIM210

    tokens_one = tokens_two = None
    if not train_dataset.custom_instance_prompts:
        assert not freeze_text_encoder
        tokens_one = tokenize_prompt(tokenizer_one, args.instance_prompt, add_special_tokens)
        tokens_two = tokenize_prompt(tokenizer_two, args.instance_prompt, add_special_tokens)
    vae_scaling_factor = vae.config.scaling_factor

    # the epoch's head, before the pivot
    unet.train()
    text_encoder_one.train()
    text_encoder_two.train()

    def training_step(batch):
        nonlocal tokens_one, tokens_two, latents_mean, latents_std
        prompts = batch["prompts"]
        # encode batch prompts when custom prompts are provided for each image -
        if train_dataset.custom_instance_prompts:
            tokens_one = tokenize_prompt(tokenizer_one, prompts, add_special_tokens)
            tokens_two = tokenize_prompt(tokenizer_two, prompts, add_special_tokens)

        pixel_values = batch["pixel_values"].to(dtype=vae.dtype)
        model_input = vae.encode(pixel_values).latent_dist.sample()

        if latents_mean is None and latents_std is None:
            model_input = model_input * vae_scaling_factor
            if args.pretrained_vae_model_name_or_path is None:
                model_input = model_input.to(weight_dtype)
        else:
            latents_mean = latents_mean.to(device=model_input.device, dtype=model_input.dtype)
            latents_std = latents_std.to(device=model_input.device, dtype=model_input.dtype)
            model_input = (model_input - latents_mean) * vae_scaling_factor / latents_std
            model_input = model_input.to(dtype=weight_dtype)

        # Sample noise that we'll add to the latents
        noise = torch.randn_like(model_input)
        if args.noise_offset:
            # https://www.crosslabs.org//blog/diffusion-with-offset-noise
            noise += args.noise_offset * torch.randn(
                (model_input.shape[0], model_input.shape[1], 1, 1), device=model_input.device
            )

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

        # Predict the noise residual (freeze_text_encoder is False)
        unet_added_conditions = {"time_ids": add_time_ids}
        prompt_embeds, pooled_prompt_embeds = encode_prompt(
            text_encoders=[text_encoder_one, text_encoder_two],
            tokenizers=None,
            prompt=None,
            text_input_ids_list=[tokens_one, tokens_two],
            clip_skip=args.clip_skip,
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

    params = unet_lora_parameters + text_lora_parameters_one + text_lora_parameters_two
    return types.SimpleNamespace(
        step=training_step,
        unet=unet,
        vae=vae,
        text_encoder_one=text_encoder_one,
        text_encoder_two=text_encoder_two,
        embedding_handler=embedding_handler,
        dataset=train_dataset,
        params=params,
    )


def _example(index: int, dataset) -> dict:
    """``DreamBoothDataset.__getitem__``: the image in [-1, 1], its original size and crop
    corner, and its caption with ``TOK`` replaced by ``<s0><s1>`` (or the instance prompt)."""
    example = {
        "instance_images": image(index),
        "original_size": (RESOLUTION + 8 * index, RESOLUTION + 4 * index),
        "crop_top_left": (index % 3, 2 * index % 5),
    }
    if dataset.custom_instance_prompts:
        caption = dataset.custom_instance_prompts[index % len(dataset.custom_instance_prompts)]
        for token_abs, token_replacement in dataset.token_abstraction_dict.items():
            caption = caption.replace(token_abs, "".join(token_replacement))
        example["instance_prompt"] = caption
    else:
        example["instance_prompt"] = "a photo of <s0><s1> dog"
    return example


def _batch(parts, indices) -> dict:
    return collate_fn([_example(i, parts.dataset) for i in indices])


_BUILT: dict[bool, tuple] = {}


def _built(custom_instance_prompts: bool):
    if custom_instance_prompts not in _BUILT:
        parts = build(custom_instance_prompts=custom_instance_prompts)
        split = graphsplit.split(parts.step, (_batch(parts, [0, 1]),))
        _BUILT[custom_instance_prompts] = (parts, split)
    return _BUILT[custom_instance_prompts]


CONFIGS = [True, False]


def test_the_new_tokens_are_real_tokens_of_both_tokenizers():
    parts, _split = _built(True)
    assert parts.embedding_handler.train_ids == [len(WORDS) + 3, len(WORDS) + 4]
    for encoder in (parts.text_encoder_one, parts.text_encoder_two):
        text_model = encoder.text_model if hasattr(encoder, "text_model") else encoder
        weight = text_model.embeddings.token_embedding.weight
        assert weight.shape[0] == len(WORDS) + 5 and weight.requires_grad


def test_the_trace_refuses_the_tokenizers_on_the_captions_naming_the_line():
    parts, _split = _built(True)
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(parts.step, (_batch(parts, [0, 1]),), path="trace")
    assert line_of(tokenize_prompt, "text_inputs = tokenizer(") in str(caught.value)


@pytest.mark.parametrize("custom_instance_prompts", CONFIGS)
def test_pivotal_tuning_verifies_on_the_example_and_another_size(custom_instance_prompts):
    parts, split = _built(custom_instance_prompts)
    assert split.path == "calls"
    assert_stage1_holds_no_trainable(split)
    for seed, indices in enumerate([[0, 1], [2, 3, 4]]):
        checks = graphsplit.verify(parts.step, split, (_batch(parts, indices),), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


@pytest.mark.parametrize("custom_instance_prompts", CONFIGS)
def test_pivotal_tuning_caches_the_vae_not_the_text_encoders(custom_instance_prompts):
    parts, split = _built(custom_instance_prompts)
    assert unstored_inputs(split) == {"pixel_values"}  # only the cached VAE reads them
    cached = cached_outputs(split)
    # The VAE's latent distribution per sample; of the text encoders, only their position
    # embeddings (frozen, of the position ids alone: no batch dimension, stored once).
    per_sample = {key for key in cached if split.boundary[key].batch_dim is not None}
    assert per_sample == {"vae_quant_conv__0__out"}
    assert cached - per_sample == {
        "text_encoder_one_embeddings_position_embedding__0__out",
        "text_encoder_two_text_model_embeddings_position_embedding__0__out",
    }
    assert not stage2_holds(split, "vae.encoder")
    assert not stage2_holds(split, "vae.quant_conv")
    assert {"text_encoder_one", "text_encoder_two", "unet"} <= stage2_top_modules(split)
    expected = (
        named_trainable("unet", parts.unet)
        | named_trainable("text_encoder_one", parts.text_encoder_one)
        | named_trainable("text_encoder_two", parts.text_encoder_two)
    )
    assert {n for n in expected if "token_embedding" in n} == {
        "text_encoder_one.embeddings.token_embedding.weight",
        "text_encoder_two.text_model.embeddings.token_embedding.weight",
    }
    assert trainable_in_stage2(split) == expected


@pytest.mark.parametrize("custom_instance_prompts", CONFIGS)
def test_pivotal_tuning_trains_from_its_cache_after_a_step_and_retract(
    custom_instance_prompts, tmp_path
):
    """Cache, then the script's ``optimizer.step()`` (here SGD) and ``retract_embeddings()``;
    stage 2 on the old cache must train as the step does with the new embeddings."""
    parts, split = _built(custom_instance_prompts)
    batches = [_batch(parts, [5, 6]), _batch(parts, [7, 8, 9]), _batch(parts, [10])]
    torch.manual_seed(1234)
    graphsplit.cache(split, batches, tmp_path / "cache", progress=False)
    dataset = graphsplit.CachedDataset(tmp_path / "cache", split)
    assert len(dataset) == 6
    before = [p.detach().clone() for p in parts.params]
    optimizer = torch.optim.SGD(parts.params, lr=0.5)
    _loss, grads = loss_and_grads(lambda: parts.step(batches[0]), parts.params, 0)
    for param, grad in zip(parts.params, grads, strict=True):
        param.grad = grad
    optimizer.step()
    optimizer.zero_grad()
    parts.embedding_handler.retract_embeddings()
    assert not all(torch.equal(a, b) for a, b in zip(before, parts.params, strict=True))
    row = 0
    for index, raw in enumerate(batches):
        size = raw["pixel_values"].shape[0]
        rows = graphsplit.collate([dataset[r] for r in range(row, row + size)])
        row += size
        want_loss, want = loss_and_grads(lambda raw=raw: parts.step(raw), parts.params, 7 + index)
        got_loss, got = loss_and_grads(lambda b=rows: split.stage2(**b), parts.params, 7 + index)
        assert torch.equal(want_loss, got_loss), (want_loss, got_loss)
        for a, b in zip(want, got, strict=True):
            assert (a is None) == (b is None)
            assert a is None or torch.equal(a, b)
    with torch.no_grad():
        for param, old in zip(parts.params, before, strict=True):
            param.copy_(old)
