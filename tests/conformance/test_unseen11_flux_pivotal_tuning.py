"""Conformance: ``examples/advanced_diffusion_training/train_dreambooth_lora_flux_advanced.py``
with pivotal tuning (``--train_text_encoder_ti``, CLIP only: ``--enable_t5_ti`` unset).

``main()`` as the script writes it: ``--token_abstraction=TOK`` becomes the two new tokens
``<s0><s1>`` in the instance prompt (and, through ``DreamBoothDataset``, in the captions); the
script's ``TokenEmbeddingsHandler`` (verbatim, less ``save_embeddings``) adds them to the CLIP
tokenizer, resizes CLIP's token embedding and draws the new rows; the transformer, VAE and both
text encoders are frozen, the transformer gets the script's twelve-target LoRA and every
``token_embedding`` parameter of CLIP is made trainable (the rest of CLIP and the whole T5 stay
frozen). The loop puts the transformer and CLIP in train mode. The loop body is the script's
with ``freeze_text_encoder`` False: the instance prompt's ``tokens_one`` / ``tokens_two``
computed before the loop (``elems_to_repeat = len(prompts)``) or, with a ``--caption_column``,
the batch's captions tokenized in the step; ``encode_prompt`` over those ids (CLIP's pooled
output, T5's hidden states, ``text_ids``); the VAE's ``latent_dist.sample()`` shifted and
scaled; ``_prepare_latent_image_ids``; ``randn_like`` noise; ``compute_density_for_timestep_
sampling`` (``--weighting_scheme=none``, the default); ``get_sigmas`` (``.nonzero().item()``
of each drawn timestep); ``_pack_latents``; guidance; the transformer; ``_unpack_latents`` and
the weighted flow-matching loss. After ``optimizer.step()`` the script calls
``embedding_handler.retract_embeddings()``.

What must hold: the step splits exactly (the LoRA and the token embedding's gradients bit for
bit, on the example and on a batch of another size); the VAE encoder and the frozen T5 are
cached (stage 2 holds neither's weights), CLIP is not (it reads the trainable token embedding);
a cache written through the disk trains stage 2 exactly, also after an optimizer step and the
script's ``retract_embeddings``.

Tiny configs: diffusers' FLUX pipeline-test components (as the unseen-3 Kontext test), 16 px.
"""

from __future__ import annotations

import copy
import types
from typing import List, Optional  # noqa: UP035 (the script's)

import pytest
import torch

import graphsplit
from tests.helpers import assert_stage1_holds_no_trainable, line_of

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
from diffusers import FluxPipeline  # noqa: E402
from diffusers.training_utils import (  # noqa: E402
    compute_density_for_timestep_sampling,
    compute_loss_weighting_for_sd3,
)

from tests.conformance.unseen11_b_checks import (  # noqa: E402
    one_thread,
    stage2_param_names,
    trainable_names,
)
from tests.conformance.unseen_checks import (  # noqa: E402
    loss_and_grads,
    stage2_top_modules,
    word_tokenizer,
)

_one_thread = pytest.fixture(autouse=True)(one_thread)

WORDS = ["a", "photo", "of", "TOK", "dog", "on", "the", "beach", "in", "snow", "red", "blue"]
CAPTIONS = ["a photo of TOK dog on the beach", "a TOK dog in snow", "a red dog", "a blue TOK dog"]
RESOLUTION = 16

# The script's module-level ``args`` (``TokenEmbeddingsHandler`` reads it as a global).
args = types.SimpleNamespace(initializer_concept=None)


class TokenEmbeddingsHandler:
    """The script's, verbatim (``save_embeddings`` left out: nothing is saved here)."""

    def __init__(self, text_encoders, tokenizers):
        self.text_encoders = text_encoders
        self.tokenizers = tokenizers

        self.train_ids: Optional[torch.Tensor] = None  # noqa: UP045
        self.train_ids_t5: Optional[torch.Tensor] = None  # noqa: UP045
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
            # Resize the token embeddings as we are adding new special tokens to the tokenizer
            text_encoder.resize_token_embeddings(len(tokenizer))

            # Convert the token abstractions to ids
            if idx == 0:
                self.train_ids = tokenizer.convert_tokens_to_ids(self.inserting_toks)
            else:
                self.train_ids_t5 = tokenizer.convert_tokens_to_ids(self.inserting_toks)

            # random initialization of new tokens
            text_module = (
                text_encoder.text_model if hasattr(text_encoder, "text_model") else text_encoder
            )
            embeds = (
                text_module.embeddings.token_embedding
                if idx == 0
                else text_encoder.encoder.embed_tokens
            )
            std_token_embedding = embeds.weight.data.std()

            print(f"{idx} text encoder's std_token_embedding: {std_token_embedding}")

            train_ids = self.train_ids if idx == 0 else self.train_ids_t5
            # if initializer_concept are not provided, token embeddings are initialized randomly
            if args.initializer_concept is None:
                hidden_size = (
                    text_module.config.hidden_size
                    if idx == 0
                    else text_encoder.encoder.config.hidden_size
                )
                embeds.weight.data[train_ids] = (
                    torch.randn(len(train_ids), hidden_size)
                    .to(device=self.device)
                    .to(dtype=self.dtype)
                    * std_token_embedding
                )
            else:
                # Convert the initializer_token, placeholder_token to ids
                initializer_token_ids = tokenizer.encode(
                    args.initializer_concept, add_special_tokens=False
                )
                for token_idx, token_id in enumerate(train_ids):
                    embeds.weight.data[token_id] = (embeds.weight.data)[
                        initializer_token_ids[token_idx % len(initializer_token_ids)]
                    ].clone()

            self.embeddings_settings[f"original_embeddings_{idx}"] = embeds.weight.data.clone()
            self.embeddings_settings[f"std_token_embedding_{idx}"] = std_token_embedding

            # makes sure we don't update any embedding weights besides the newly added token
            index_no_updates = torch.ones((len(tokenizer),), dtype=torch.bool)
            index_no_updates[train_ids] = False

            self.embeddings_settings[f"index_no_updates_{idx}"] = index_no_updates

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
            text_module = (
                text_encoder.text_model if hasattr(text_encoder, "text_model") else text_encoder
            )
            embeds = text_module.embeddings.token_embedding if idx == 0 else text_encoder.shared
            index_no_updates = self.embeddings_settings[f"index_no_updates_{idx}"]
            embeds.weight.data[index_no_updates] = (
                self.embeddings_settings[f"original_embeddings_{idx}"][index_no_updates]
                .to(device=text_encoder.device)
                .to(dtype=text_encoder.dtype)
            )

            # for the parts that were updated, we need to normalize them
            # to have the same std as before
            std_token_embedding = self.embeddings_settings[f"std_token_embedding_{idx}"]

            index_updates = ~index_no_updates
            new_embeddings = embeds.weight.data[index_updates]
            off_ratio = std_token_embedding / new_embeddings.std()

            new_embeddings = new_embeddings * (off_ratio**0.1)
            embeds.weight.data[index_updates] = new_embeddings


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


def tokenize_prompt(tokenizer, prompt, max_sequence_length, add_special_tokens=False):
    """The script's, verbatim."""
    text_inputs = tokenizer(
        prompt,
        padding="max_length",
        max_length=max_sequence_length,
        truncation=True,
        return_length=False,
        return_overflowing_tokens=False,
        add_special_tokens=add_special_tokens,
        return_tensors="pt",
    )
    text_input_ids = text_inputs.input_ids
    return text_input_ids


def _encode_prompt_with_t5(
    text_encoder,
    tokenizer,
    max_sequence_length=512,
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
            return_length=False,
            return_overflowing_tokens=False,
            return_tensors="pt",
        )
        text_input_ids = text_inputs.input_ids
    else:
        if text_input_ids is None:
            raise ValueError("text_input_ids must be provided when the tokenizer is not specified")

    prompt_embeds = text_encoder(text_input_ids.to(device))[0]

    if hasattr(text_encoder, "module"):  # noqa: SIM108 (the script's)
        dtype = text_encoder.module.dtype
    else:
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
    """The script's, verbatim."""
    prompt = [prompt] if isinstance(prompt, str) else prompt
    batch_size = len(prompt)

    if tokenizer is not None:
        text_inputs = tokenizer(
            prompt,
            padding="max_length",
            max_length=77,
            truncation=True,
            return_overflowing_tokens=False,
            return_length=False,
            return_tensors="pt",
        )

        text_input_ids = text_inputs.input_ids
    else:
        if text_input_ids is None:
            raise ValueError("text_input_ids must be provided when the tokenizer is not specified")

    prompt_embeds = text_encoder(text_input_ids.to(device), output_hidden_states=False)

    if hasattr(text_encoder, "module"):  # noqa: SIM108 (the script's)
        dtype = text_encoder.module.dtype
    else:
        dtype = text_encoder.dtype
    # Use pooled output of CLIPTextModel
    prompt_embeds = prompt_embeds.pooler_output
    prompt_embeds = prompt_embeds.to(dtype=dtype, device=device)

    # duplicate text embeddings for each generation per prompt, using mps friendly method
    prompt_embeds = prompt_embeds.repeat(1, num_images_per_prompt, 1)
    prompt_embeds = prompt_embeds.view(batch_size * num_images_per_prompt, -1)

    return prompt_embeds


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
    if hasattr(text_encoders[0], "module"):
        dtype = text_encoders[0].module.dtype
    else:
        dtype = text_encoders[0].dtype

    pooled_prompt_embeds = _encode_prompt_with_clip(
        text_encoder=text_encoders[0],
        tokenizer=tokenizers[0],
        prompt=prompt,
        device=device if device is not None else text_encoders[0].device,
        num_images_per_prompt=num_images_per_prompt,
        text_input_ids=text_input_ids_list[0] if text_input_ids_list else None,
    )

    prompt_embeds = _encode_prompt_with_t5(
        text_encoder=text_encoders[1],
        tokenizer=tokenizers[1],
        max_sequence_length=max_sequence_length,
        prompt=prompt,
        num_images_per_prompt=num_images_per_prompt,
        device=device if device is not None else text_encoders[1].device,
        text_input_ids=text_input_ids_list[1] if text_input_ids_list else None,
    )

    text_ids = torch.zeros(prompt_embeds.shape[1], 3).to(device=device, dtype=dtype)

    return prompt_embeds, pooled_prompt_embeds, text_ids


def _models():
    """diffusers' FLUX pipeline-test components (``guidance_embeds`` on, as FLUX.1-dev's)."""
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
    text_encoder_one = transformers.CLIPTextModel(
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
        latent_channels=1,
        norm_num_groups=1,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
    )
    for model in (transformer, vae, text_encoder_one, text_encoder_two):
        model.eval()  # as from_pretrained returns them
    return transformer, text_encoder_one, text_encoder_two, vae


def build(*, custom_instance_prompts: bool, rank: int = 4):
    """``main()``'s models and the loop body as a closure (one process, fp32)."""
    transformer, text_encoder_one, text_encoder_two, vae = _models()
    tokenizer_one, tokenizer_two = word_tokenizer(WORDS), word_tokenizer(WORDS)
    tokenizer_one.model_max_length = 77
    noise_scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    noise_scheduler_copy = copy.deepcopy(noise_scheduler)
    opts = types.SimpleNamespace(
        instance_prompt="a photo of TOK dog",
        token_abstraction="TOK",
        max_sequence_length=12,
        weighting_scheme="none",
        logit_mean=0.0,
        logit_std=1.0,
        mode_scale=1.29,
        guidance_scale=3.5,
        rank=rank,
        lora_alpha=rank,
        lora_dropout=0.0,
        train_text_encoder=False,
        train_text_encoder_ti=True,
        enable_t5_ti=False,
        cache_latents=False,
    )
    accelerator = types.SimpleNamespace(device=torch.device("cpu"))

    # --train_text_encoder_ti: TOK -> <s0><s1> (two new tokens, no --initializer_concept)
    token_abstraction_dict = {opts.token_abstraction: ["<s0>", "<s1>"]}
    for token_abs, token_replacement in token_abstraction_dict.items():
        opts.instance_prompt = opts.instance_prompt.replace(token_abs, "".join(token_replacement))
    text_encoders = [text_encoder_one]
    tokenizers = [tokenizer_one]
    embedding_handler = TokenEmbeddingsHandler(text_encoders, tokenizers)
    inserting_toks = []
    for new_tok in token_abstraction_dict.values():
        inserting_toks.extend(new_tok)
    torch.manual_seed(1)
    embedding_handler.initialize_new_tokens(inserting_toks=inserting_toks)

    # We only train the additional adapter LoRA layers
    transformer.requires_grad_(False)
    vae.requires_grad_(False)
    text_encoder_one.requires_grad_(False)
    text_encoder_two.requires_grad_(False)
    weight_dtype = torch.float32

    target_modules = [
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
    # now we will add new LoRA weights to the attention layers
    transformer_lora_config = peft.LoraConfig(
        r=opts.rank,
        lora_alpha=opts.lora_alpha,
        lora_dropout=opts.lora_dropout,
        init_lora_weights="gaussian",
        target_modules=target_modules,
    )
    transformer.add_adapter(transformer_lora_config)
    with torch.no_grad():  # as after some steps: lora_B starts at zero
        for name, param in transformer.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.02)

    # if we use textual inversion, we freeze all parameters except for the token embeddings
    # in text encoder
    text_lora_parameters_one = []  # CLIP
    for name, param in text_encoder_one.named_parameters():
        if "token_embedding" in name:
            param.requires_grad = True
            text_lora_parameters_one.append(param)
        else:
            param.requires_grad = False

    freeze_text_encoder = not (opts.train_text_encoder or opts.train_text_encoder_ti)
    assert not freeze_text_encoder

    # if --train_text_encoder_ti we need add_special_tokens to be True for textual inversion
    add_special_tokens_clip = True if opts.train_text_encoder_ti else False  # noqa: SIM210
    add_special_tokens_t5 = True if (opts.train_text_encoder_ti and opts.enable_t5_ti) else False  # noqa: SIM210

    tokens_one = tokens_two = None
    if not custom_instance_prompts:
        tokens_one = tokenize_prompt(
            tokenizer_one,
            opts.instance_prompt,
            max_sequence_length=77,
            add_special_tokens=add_special_tokens_clip,
        )
        tokens_two = tokenize_prompt(
            tokenizer_two,
            opts.instance_prompt,
            max_sequence_length=opts.max_sequence_length,
            add_special_tokens=add_special_tokens_t5,
        )

    vae_config_shift_factor = vae.config.shift_factor
    vae_config_scaling_factor = vae.config.scaling_factor
    vae_config_block_out_channels = vae.config.block_out_channels

    def unwrap_model(model):
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

    # the epoch's start: transformer.train(); --train_text_encoder_ti: text_encoder_one.train()
    transformer.train()
    text_encoder_one.train()

    def training_step(batch):
        nonlocal tokens_one, tokens_two
        prompts = batch["prompts"]

        # encode batch prompts when custom prompts are provided for each image -
        if custom_instance_prompts:
            elems_to_repeat = 1
            tokens_one = tokenize_prompt(
                tokenizer_one,
                prompts,
                max_sequence_length=77,
                add_special_tokens=add_special_tokens_clip,
            )
            tokens_two = tokenize_prompt(
                tokenizer_two,
                prompts,
                max_sequence_length=opts.max_sequence_length,
                add_special_tokens=add_special_tokens_t5,
            )
        else:
            elems_to_repeat = len(prompts)

        if not freeze_text_encoder:
            prompt_embeds, pooled_prompt_embeds, text_ids = encode_prompt(
                text_encoders=[text_encoder_one, text_encoder_two],
                tokenizers=[None, None],
                text_input_ids_list=[
                    tokens_one.repeat(elems_to_repeat, 1),
                    tokens_two.repeat(elems_to_repeat, 1),
                ],
                max_sequence_length=opts.max_sequence_length,
                device=accelerator.device,
                prompt=prompts,
            )
        # Convert images to latent space
        pixel_values = batch["pixel_values"].to(dtype=vae.dtype)
        model_input = vae.encode(pixel_values).latent_dist.sample()
        model_input = (model_input - vae_config_shift_factor) * vae_config_scaling_factor
        model_input = model_input.to(dtype=weight_dtype)

        vae_scale_factor = 2 ** (len(vae_config_block_out_channels) - 1)

        latent_image_ids = FluxPipeline._prepare_latent_image_ids(
            model_input.shape[0],
            model_input.shape[2] // 2,
            model_input.shape[3] // 2,
            accelerator.device,
            weight_dtype,
        )
        # Sample noise that we'll add to the latents
        noise = torch.randn_like(model_input)
        bsz = model_input.shape[0]

        # Sample a random timestep for each image
        # for weighting schemes where we sample timesteps non-uniformly
        u = compute_density_for_timestep_sampling(
            weighting_scheme=opts.weighting_scheme,
            batch_size=bsz,
            logit_mean=opts.logit_mean,
            logit_std=opts.logit_std,
            mode_scale=opts.mode_scale,
        )
        indices = (u * noise_scheduler_copy.config.num_train_timesteps).long()
        timesteps = noise_scheduler_copy.timesteps[indices].to(device=model_input.device)

        # Add noise according to flow matching.
        # zt = (1 - texp) * x + texp * z1
        sigmas = get_sigmas(timesteps, n_dim=model_input.ndim, dtype=model_input.dtype)
        noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise

        packed_noisy_model_input = FluxPipeline._pack_latents(
            noisy_model_input,
            batch_size=model_input.shape[0],
            num_channels_latents=model_input.shape[1],
            height=model_input.shape[2],
            width=model_input.shape[3],
        )

        # handle guidance
        if unwrap_model(transformer).config.guidance_embeds:
            guidance = torch.tensor([opts.guidance_scale], device=accelerator.device)
            guidance = guidance.expand(model_input.shape[0])
        else:
            guidance = None

        # Predict the noise residual
        model_pred = transformer(
            hidden_states=packed_noisy_model_input,
            # YiYi notes: divide it by 1000 for now because we scale it by 1000 in the
            # transformer model (we should not keep it but I want to keep the inputs same for
            # the model for testing)
            timestep=timesteps / 1000,
            guidance=guidance,
            pooled_projections=pooled_prompt_embeds,
            encoder_hidden_states=prompt_embeds,
            txt_ids=text_ids,
            img_ids=latent_image_ids,
            return_dict=False,
        )[0]
        model_pred = FluxPipeline._unpack_latents(
            model_pred,
            height=model_input.shape[2] * vae_scale_factor,
            width=model_input.shape[3] * vae_scale_factor,
            vae_scale_factor=vae_scale_factor,
        )

        # these weighting schemes use a uniform timestep sampling
        # and instead post-weight the loss
        weighting = compute_loss_weighting_for_sd3(
            weighting_scheme=opts.weighting_scheme, sigmas=sigmas
        )

        # flow matching loss
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

    params = [p for p in transformer.parameters() if p.requires_grad] + text_lora_parameters_one
    return types.SimpleNamespace(
        step=training_step,
        get_sigmas=get_sigmas,
        transformer=transformer,
        text_encoder_one=text_encoder_one,
        embedding_handler=embedding_handler,
        token_abstraction_dict=token_abstraction_dict,
        tokenizer_one=tokenizer_one,
        params=params,
    )


def _example(parts, index: int, *, caption: bool) -> dict:
    """``DreamBoothDataset.__getitem__``: an image in [-1, 1] and its caption with
    ``--token_abstraction`` replaced by the new tokens, or the instance prompt."""
    generator = torch.Generator().manual_seed(600 + index)
    prompt = CAPTIONS[index % len(CAPTIONS)] if caption else "a photo of TOK dog"
    # replace instances of --token_abstraction in caption with the new tokens: "<si><si+1>" etc.
    for token_abs, token_replacement in parts.token_abstraction_dict.items():
        prompt = prompt.replace(token_abs, "".join(token_replacement))
    return {
        "instance_images": torch.rand(3, RESOLUTION, RESOLUTION, generator=generator) * 2 - 1,
        "instance_prompt": prompt,
    }


def _batch(parts, indices, *, caption: bool) -> dict:
    return collate_fn([_example(parts, i, caption=caption) for i in indices])


_BUILT: dict = {}


def _built(caption: bool):
    if caption not in _BUILT:
        torch.set_num_threads(1)
        parts = build(custom_instance_prompts=caption)
        split = graphsplit.split(parts.step, (_batch(parts, [0, 1], caption=caption),))
        _BUILT[caption] = parts, split
    return _BUILT[caption]


def test_the_new_tokens_are_real_clip_tokens():
    parts, _ = _built(True)
    ids = parts.tokenizer_one("a <s0><s1> dog", add_special_tokens=True).input_ids
    assert parts.embedding_handler.train_ids == ids[1:3]


def test_the_trace_refuses_get_sigmas_value_read_naming_the_line():
    parts = build(custom_instance_prompts=False)
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(parts.step, (_batch(parts, [0], caption=False),), path="trace")
    assert line_of(parts.get_sigmas, "step_indices = [") in str(caught.value)


@pytest.mark.parametrize("caption", [False, True], ids=["instance_prompt", "captions"])
def test_pivotal_tuning_verifies_on_the_example_and_another_size(caption):
    parts, split = _built(caption)
    assert split.path == "calls"
    assert_stage1_holds_no_trainable(split)
    for seed, indices in enumerate([[0, 1], [2, 3, 4]]):
        batch = _batch(parts, indices, caption=caption)
        checks = graphsplit.verify(parts.step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


@pytest.mark.parametrize("caption", [False, True], ids=["instance_prompt", "captions"])
def test_pivotal_tuning_caches_the_vae_and_t5_not_clip(caption):
    parts, split = _built(caption)
    held = stage2_param_names(split)
    assert not any(name.startswith("vae.encoder") for name in held)
    # T5 is frozen and reads token ids only: its output is cached, its weights not held
    assert not any("text_encoder_two" in name for name in held), sorted(held)[:5]
    # CLIP reads the trainable token embedding: stage 2 runs it
    assert "text_encoder_one" in stage2_top_modules(split)
    trainable = {n for n, p in split.stage2.named_parameters() if p.requires_grad}
    assert trainable == trainable_names("transformer", parts.transformer) | trainable_names(
        "text_encoder_one", parts.text_encoder_one
    )
    cached = {key for key in split.boundary if key not in split.input_names}
    assert any(key.startswith("text_encoder_two") for key in cached), cached
    assert any(key.startswith("vae_encoder") for key in cached), cached


@pytest.mark.parametrize("caption", [False, True], ids=["instance_prompt", "captions"])
def test_pivotal_tuning_trains_from_its_cache_after_a_step_and_retract(caption, tmp_path):
    parts, split = _built(caption)
    batches = [_batch(parts, [i, i + 1], caption=caption) for i in (4, 6)]
    graphsplit.cache(split, batches, tmp_path / "cache")
    cached = graphsplit.CachedDataset(tmp_path / "cache", split)
    assert len(cached) == 4
    optimizer = torch.optim.AdamW(parts.params, lr=1e-2)
    for seed, raw in enumerate(batches):
        rows = graphsplit.collate([cached[2 * seed], cached[2 * seed + 1]])
        expected = loss_and_grads(lambda raw=raw: parts.step(raw), parts.params, seed)
        got = loss_and_grads(lambda rows=rows: split.stage2(**rows), parts.params, seed)
        assert torch.equal(got[0], expected[0]), (got[0], expected[0])
        assert all(torch.equal(a, b) for a, b in zip(got[1], expected[1], strict=True))
        # the script's optimizer step, then retract_embeddings (in place on the embedding)
        for param, grad in zip(parts.params, expected[1], strict=True):
            param.grad = grad
        optimizer.step()
        optimizer.zero_grad()
        parts.embedding_handler.retract_embeddings()
