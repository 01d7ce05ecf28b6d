"""Conformance: tencent-ailab/IP-Adapter's ``tutorial_train.py`` training step.

The script trains an image prompt adapter for Stable Diffusion: ``ImageProjModel`` (a linear
projection of the frozen ``CLIPVisionModelWithProjection``'s ``image_embeds`` into four extra
context tokens) and, inside the frozen UNet, every cross-attention layer's ``to_k_ip`` /
``to_v_ip`` (the script's ``IPAttnProcessor2_0``, an ``nn.Module`` processor installed with
``unet.set_attn_processor``). VAE, text encoder and image encoder are frozen and run under
``torch.no_grad()``. ``MyDataset.__getitem__`` decides per sample whether to drop the image
embedding (``drop_image_embed``, a Python int the ``collate_fn`` gathers into a list); the step
replaces each dropped sample's embedding with ``torch.zeros_like`` in a Python loop over the
batch's rows. The processor also stores ``self.attn_map`` under ``torch.no_grad()`` (for
visualisation) on every call.

The script's processor classes, ``ImageProjModel``, ``IPAdapter`` and ``collate_fn`` are copied
verbatim below but for line wrapping (the repository is not a package); the loop body is a
closure over ``main()``'s locals, ``noise_scheduler.num_train_timesteps`` (a deprecated direct
config read) included. Tiny configs: the zoo's SD UNet / VAE / CLIP (diffusers' test configs)
and a CLIP vision tower as diffusers' ChronoEdit pipeline test builds it, 32 wide.

The whole-step trace refuses the loop over the batch's rows (its count is the batch size) naming
its line; ``path="auto"`` takes the module-level path. What must hold there: VAE, text encoder
and image encoder are cached (stage 1 holds them, stage 2 none of them), stage 2 trains the
projection and the IP weights of the four cross-attention layers exactly, and a plan made for
one pattern of drops trains exactly on batches that drop other samples, and from its cache.
"""

from __future__ import annotations

import itertools
import random
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphsplit
from tests.helpers import line_of, split_and_verify

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

from tests.conformance.unseen2_checks import assert_trains_from_its_cache  # noqa: E402
from tests.conformance.unseen_checks import stage2_top_modules, word_tokenizer  # noqa: E402
from tests.zoo import build_frozen_sd  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Accessing config attribute:FutureWarning")

RESOLUTION = 32
CLIP_SIZE = 32
TOKENS = 16


# --- ip_adapter/attention_processor.py, verbatim (the torch-2 classes the script imports) ---
class AttnProcessor2_0(torch.nn.Module):
    r"""
    Processor for implementing scaled dot-product attention (enabled by default if you're using
    PyTorch 2.0).
    """

    def __init__(
        self,
        hidden_size=None,
        cross_attention_dim=None,
    ):
        super().__init__()
        if not hasattr(F, "scaled_dot_product_attention"):
            raise ImportError(
                "AttnProcessor2_0 requires PyTorch 2.0, to use it, please upgrade PyTorch to 2.0."
            )

    def __call__(
        self,
        attn,
        hidden_states,
        encoder_hidden_states=None,
        attention_mask=None,
        temb=None,
        *args,
        **kwargs,
    ):
        residual = hidden_states

        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)

        input_ndim = hidden_states.ndim

        if input_ndim == 4:
            batch_size, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch_size, channel, height * width).transpose(1, 2)

        batch_size, sequence_length, _ = (
            hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
        )

        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(
                attention_mask, sequence_length, batch_size
            )
            # scaled_dot_product_attention expects attention_mask shape to be
            # (batch, heads, source_length, target_length)
            attention_mask = attention_mask.view(
                batch_size, attn.heads, -1, attention_mask.shape[-1]
            )

        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)

        query = attn.to_q(hidden_states)

        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        elif attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)

        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)

        inner_dim = key.shape[-1]
        head_dim = inner_dim // attn.heads

        query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)

        key = key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        value = value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)

        # the output of sdp = (batch, num_heads, seq_len, head_dim)
        # TODO: add support for attn.scale when we move to Torch 2.1
        hidden_states = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False
        )

        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)
        hidden_states = hidden_states.to(query.dtype)

        # linear proj
        hidden_states = attn.to_out[0](hidden_states)
        # dropout
        hidden_states = attn.to_out[1](hidden_states)

        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(
                batch_size, channel, height, width
            )

        if attn.residual_connection:
            hidden_states = hidden_states + residual

        hidden_states = hidden_states / attn.rescale_output_factor

        return hidden_states


class IPAttnProcessor2_0(torch.nn.Module):
    r"""
    Attention processor for IP-Adapater for PyTorch 2.0.
    Args:
        hidden_size (`int`):
            The hidden size of the attention layer.
        cross_attention_dim (`int`):
            The number of channels in the `encoder_hidden_states`.
        scale (`float`, defaults to 1.0):
            the weight scale of image prompt.
        num_tokens (`int`, defaults to 4 when do ip_adapter_plus it should be 16):
            The context length of the image features.
    """

    def __init__(self, hidden_size, cross_attention_dim=None, scale=1.0, num_tokens=4):
        super().__init__()

        if not hasattr(F, "scaled_dot_product_attention"):
            raise ImportError(
                "AttnProcessor2_0 requires PyTorch 2.0, to use it, please upgrade PyTorch to 2.0."
            )

        self.hidden_size = hidden_size
        self.cross_attention_dim = cross_attention_dim
        self.scale = scale
        self.num_tokens = num_tokens

        self.to_k_ip = nn.Linear(cross_attention_dim or hidden_size, hidden_size, bias=False)
        self.to_v_ip = nn.Linear(cross_attention_dim or hidden_size, hidden_size, bias=False)

    def __call__(
        self,
        attn,
        hidden_states,
        encoder_hidden_states=None,
        attention_mask=None,
        temb=None,
        *args,
        **kwargs,
    ):
        residual = hidden_states

        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)

        input_ndim = hidden_states.ndim

        if input_ndim == 4:
            batch_size, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch_size, channel, height * width).transpose(1, 2)

        batch_size, sequence_length, _ = (
            hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
        )

        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(
                attention_mask, sequence_length, batch_size
            )
            # scaled_dot_product_attention expects attention_mask shape to be
            # (batch, heads, source_length, target_length)
            attention_mask = attention_mask.view(
                batch_size, attn.heads, -1, attention_mask.shape[-1]
            )

        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)

        query = attn.to_q(hidden_states)

        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        else:
            # get encoder_hidden_states, ip_hidden_states
            end_pos = encoder_hidden_states.shape[1] - self.num_tokens
            encoder_hidden_states, ip_hidden_states = (
                encoder_hidden_states[:, :end_pos, :],
                encoder_hidden_states[:, end_pos:, :],
            )
            if attn.norm_cross:
                encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)

        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)

        inner_dim = key.shape[-1]
        head_dim = inner_dim // attn.heads

        query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)

        key = key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        value = value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)

        # the output of sdp = (batch, num_heads, seq_len, head_dim)
        # TODO: add support for attn.scale when we move to Torch 2.1
        hidden_states = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False
        )

        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)
        hidden_states = hidden_states.to(query.dtype)

        # for ip-adapter
        ip_key = self.to_k_ip(ip_hidden_states)
        ip_value = self.to_v_ip(ip_hidden_states)

        ip_key = ip_key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        ip_value = ip_value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)

        # the output of sdp = (batch, num_heads, seq_len, head_dim)
        # TODO: add support for attn.scale when we move to Torch 2.1
        ip_hidden_states = F.scaled_dot_product_attention(
            query, ip_key, ip_value, attn_mask=None, dropout_p=0.0, is_causal=False
        )
        with torch.no_grad():
            self.attn_map = query @ ip_key.transpose(-2, -1).softmax(dim=-1)
            # print(self.attn_map.shape)

        ip_hidden_states = ip_hidden_states.transpose(1, 2).reshape(
            batch_size, -1, attn.heads * head_dim
        )
        ip_hidden_states = ip_hidden_states.to(query.dtype)

        hidden_states = hidden_states + self.scale * ip_hidden_states

        # linear proj
        hidden_states = attn.to_out[0](hidden_states)
        # dropout
        hidden_states = attn.to_out[1](hidden_states)

        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(
                batch_size, channel, height, width
            )

        if attn.residual_connection:
            hidden_states = hidden_states + residual

        hidden_states = hidden_states / attn.rescale_output_factor

        return hidden_states


# tutorial_train.py's imports under torch 2
IPAttnProcessor, AttnProcessor = IPAttnProcessor2_0, AttnProcessor2_0


# --- ip_adapter/ip_adapter.py, verbatim ---
class ImageProjModel(torch.nn.Module):
    """Projection Model"""

    def __init__(
        self, cross_attention_dim=1024, clip_embeddings_dim=1024, clip_extra_context_tokens=4
    ):
        super().__init__()

        self.generator = None
        self.cross_attention_dim = cross_attention_dim
        self.clip_extra_context_tokens = clip_extra_context_tokens
        self.proj = torch.nn.Linear(
            clip_embeddings_dim, self.clip_extra_context_tokens * cross_attention_dim
        )
        self.norm = torch.nn.LayerNorm(cross_attention_dim)

    def forward(self, image_embeds):
        embeds = image_embeds
        clip_extra_context_tokens = self.proj(embeds).reshape(
            -1, self.clip_extra_context_tokens, self.cross_attention_dim
        )
        clip_extra_context_tokens = self.norm(clip_extra_context_tokens)
        return clip_extra_context_tokens


# --- tutorial_train.py, verbatim ---
def collate_fn(data):
    images = torch.stack([example["image"] for example in data])
    text_input_ids = torch.cat([example["text_input_ids"] for example in data], dim=0)
    clip_images = torch.cat([example["clip_image"] for example in data], dim=0)
    drop_image_embeds = [example["drop_image_embed"] for example in data]

    return {
        "images": images,
        "text_input_ids": text_input_ids,
        "clip_images": clip_images,
        "drop_image_embeds": drop_image_embeds,
    }


class IPAdapter(torch.nn.Module):
    """IP-Adapter"""

    def __init__(self, unet, image_proj_model, adapter_modules, ckpt_path=None):
        super().__init__()
        self.unet = unet
        self.image_proj_model = image_proj_model
        self.adapter_modules = adapter_modules

        if ckpt_path is not None:
            self.load_from_checkpoint(ckpt_path)

    def forward(self, noisy_latents, timesteps, encoder_hidden_states, image_embeds):
        ip_tokens = self.image_proj_model(image_embeds)
        encoder_hidden_states = torch.cat([encoder_hidden_states, ip_tokens], dim=1)
        # Predict the noise residual
        noise_pred = self.unet(noisy_latents, timesteps, encoder_hidden_states).sample
        return noise_pred


def install_ip_attn_processors(unet, **num_tokens):
    """The scripts' ``# init adapter modules`` block, verbatim (``tutorial_train_plus.py`` adds
    ``num_tokens=args.num_tokens`` to the ``IPAttnProcessor`` call)."""
    # init adapter modules
    attn_procs = {}
    unet_sd = unet.state_dict()
    for name in unet.attn_processors.keys():  # noqa: SIM118 (the script's)
        cross_attention_dim = (
            None if name.endswith("attn1.processor") else unet.config.cross_attention_dim
        )
        if name.startswith("mid_block"):
            hidden_size = unet.config.block_out_channels[-1]
        elif name.startswith("up_blocks"):
            block_id = int(name[len("up_blocks.")])
            hidden_size = list(reversed(unet.config.block_out_channels))[block_id]
        elif name.startswith("down_blocks"):
            block_id = int(name[len("down_blocks.")])
            hidden_size = unet.config.block_out_channels[block_id]
        if cross_attention_dim is None:
            attn_procs[name] = AttnProcessor()
        else:
            layer_name = name.split(".processor")[0]
            weights = {
                "to_k_ip.weight": unet_sd[layer_name + ".to_k.weight"],
                "to_v_ip.weight": unet_sd[layer_name + ".to_v.weight"],
            }
            attn_procs[name] = IPAttnProcessor(
                hidden_size=hidden_size, cross_attention_dim=cross_attention_dim, **num_tokens
            )
            attn_procs[name].load_state_dict(weights)
    unet.set_attn_processor(attn_procs)


def _image_encoder():
    """diffusers' ChronoEdit test config for its CLIP image encoder, 32 wide, 32 px."""
    torch.manual_seed(0)
    config = transformers.CLIPVisionConfig(
        hidden_size=32,
        projection_dim=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=CLIP_SIZE,
        intermediate_size=37,
        patch_size=8,
    )
    return transformers.CLIPVisionModelWithProjection(config)


def build():
    """``main()``'s models and its loop body as a closure over them (``accelerator`` reduced to
    its device: one process, no accumulation, fp32)."""
    vae, text_encoder, unet, _ = build_frozen_sd()
    noise_scheduler = diffusers.DDPMScheduler(num_train_timesteps=1000)
    image_encoder = _image_encoder()
    # freeze parameters of models to save more memory
    unet.requires_grad_(False)
    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)
    image_encoder.requires_grad_(False)

    torch.manual_seed(1)
    # ip-adapter
    image_proj_model = ImageProjModel(
        cross_attention_dim=unet.config.cross_attention_dim,
        clip_embeddings_dim=image_encoder.config.projection_dim,
        clip_extra_context_tokens=4,
    )
    install_ip_attn_processors(unet)
    adapter_modules = torch.nn.ModuleList(unet.attn_processors.values())

    ip_adapter = IPAdapter(unet, image_proj_model, adapter_modules, None)
    with torch.no_grad():  # as after some steps (to_k_ip / to_v_ip start as copies of to_k / to_v)
        for param in adapter_modules.parameters():
            param.add_(torch.randn_like(param) * 0.02)

    weight_dtype = torch.float32
    accelerator = types.SimpleNamespace(device=torch.device("cpu"))
    # optimizer
    params_to_opt = list(
        itertools.chain(
            ip_adapter.image_proj_model.parameters(), ip_adapter.adapter_modules.parameters()
        )
    )

    def training_step(batch):
        # Convert images to latent space
        with torch.no_grad():
            latents = vae.encode(
                batch["images"].to(accelerator.device, dtype=weight_dtype)
            ).latent_dist.sample()
            latents = latents * vae.config.scaling_factor

        # Sample noise that we'll add to the latents
        noise = torch.randn_like(latents)
        bsz = latents.shape[0]
        # Sample a random timestep for each image
        timesteps = torch.randint(
            0, noise_scheduler.num_train_timesteps, (bsz,), device=latents.device
        )
        timesteps = timesteps.long()

        # Add noise to the latents according to the noise magnitude at each timestep
        # (this is the forward diffusion process)
        noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)

        with torch.no_grad():
            image_embeds = image_encoder(
                batch["clip_images"].to(accelerator.device, dtype=weight_dtype)
            ).image_embeds
        image_embeds_ = []
        for image_embed, drop_image_embed in zip(image_embeds, batch["drop_image_embeds"]):
            if drop_image_embed == 1:
                image_embeds_.append(torch.zeros_like(image_embed))
            else:
                image_embeds_.append(image_embed)
        image_embeds = torch.stack(image_embeds_)

        with torch.no_grad():
            encoder_hidden_states = text_encoder(batch["text_input_ids"].to(accelerator.device))[0]

        noise_pred = ip_adapter(noisy_latents, timesteps, encoder_hidden_states, image_embeds)

        loss = F.mse_loss(noise_pred.float(), noise.float(), reduction="mean")
        return loss

    return types.SimpleNamespace(
        step=training_step,
        ip_adapter=ip_adapter,
        params=params_to_opt,
        adapter_modules=adapter_modules,
    )


def _example(index: int, drop: int) -> dict:
    """``MyDataset.__getitem__``'s row: the image in [-1, 1], its caption's ids as the CLIP
    tokenizer returns them (``(1, model_max_length)``), the CLIP image processor's
    ``pixel_values`` (``(1, 3, S, S)``, normalised) and the sample's drop decision."""
    generator = torch.Generator().manual_seed(300 + index)
    ids = torch.randint(0, 997, (1, TOKENS), generator=generator)
    ids[0, 0], ids[0, 5:] = 998, 999  # BOS, then EOS padding (the zoo's CLIP special ids)
    return {
        "image": torch.rand(3, RESOLUTION, RESOLUTION, generator=generator) * 2 - 1,
        "text_input_ids": ids,
        "clip_image": torch.randn(1, 3, CLIP_SIZE, CLIP_SIZE, generator=generator),
        "drop_image_embed": drop,
    }


def _batch(indices, drops) -> dict:
    return collate_fn([_example(i, d) for i, d in zip(indices, drops, strict=True)])


def test_the_encoders_are_cached_and_stage2_trains_the_projection_and_ip_weights():
    """At two samples (the drop-pattern test below splits at three)."""
    size = 2
    parts = build()
    split = split_and_verify(parts.step, (_batch(range(size), [0, 1, 0][:size]),))
    # The whole-step trace refuses the per-sample loop over the batch's rows (its count is the
    # batch size), naming the loop's line; "auto" falls back to the module-level path.
    assert split.path == "calls"
    assert "depends on the batch size" in split.reason
    assert line_of(parts.step, "for image_embed, drop_image_embed in zip(") in split.reason
    cached = {key for key in split.boundary if key not in split.input_names}
    assert cached == {
        # Only cached calls compute with the pixels, the CLIP images and the token ids: stage 2
        # holds stand-ins, the cache their shapes (calls/unstored_inputs).
        "images__shape",
        "clip_images__shape",
        "text_input_ids__shape",
        "vae_quant_conv__0__out",  # the latent distribution's moments, resampled in stage 2
        "image_encoder__0__image_embeds",
        "text_encoder__0__last_hidden_state",
    }
    # The list of ints crosses as a tensor and comes back as the same list.
    assert split.boundary["drop_image_embeds"].shape == (size,)
    stage1 = {name.split(".")[0] for name, _ in split.stage1.named_parameters()}
    assert stage1 == {"vae", "text_encoder", "image_encoder"}
    held = stage2_top_modules(split)
    assert held == {"ip_adapter"}
    assert not held & {"vae", "text_encoder", "image_encoder"}
    trainable = {n for n, p in split.stage2.named_parameters() if p.requires_grad}
    names = {id(p): n for n, p in parts.ip_adapter.named_parameters()}
    assert trainable == {f"ip_adapter.{names[id(p)]}" for p in parts.params}
    # proj + norm, to_k_ip / to_v_ip in the four cross-attention layers (down, mid, 2x up)
    assert len(parts.params) == 4 + 4 * 2
    # The processors' visualisation side effect still happens in stage 2 (it runs the step).
    for module in parts.adapter_modules:
        if isinstance(module, IPAttnProcessor):
            del module.attn_map
    split.stage2(**split.stage1(**_batch(range(size), [1] * size))).backward()
    assert all(
        module.attn_map.shape[0] == size
        for module in parts.adapter_modules
        if isinstance(module, IPAttnProcessor)
    )


def test_path_trace_refuses_the_per_sample_loop_naming_its_line():
    parts = build()
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(parts.step, (_batch([0, 1], [0, 1]),), path="trace")
    assert line_of(parts.step, "for image_embed, drop_image_embed in zip(") in str(caught.value)


def test_a_plan_made_for_one_drop_pattern_trains_other_patterns_exactly():
    """The drops are the batch's data: stage 2 runs the script's loop on each batch's list."""
    parts = build()
    split = graphsplit.split(parts.step, (_batch([0, 1, 2], [0, 1, 0]),))
    for index, drops in enumerate([[0, 0, 0], [1, 0, 1], [1, 1, 1], [0, 1]]):
        other = _batch(range(3 + 3 * index, 3 + 3 * index + len(drops)), drops)
        assert all(c.ok for c in graphsplit.verify(parts.step, split, (other,), seed=index))


def test_cache_round_trip(tmp_path):
    parts = build()
    split = graphsplit.split(parts.step, (_batch([0, 1], [0, 1]),))
    batches = [_batch([2, 3], [1, 0]), _batch([4, 5], [0, 0]), _batch([6, 7], [1, 1])]
    assert_trains_from_its_cache(split, parts.step, batches, tmp_path, parts.params)


class MyDataset(torch.utils.data.Dataset):
    """``tutorial_train.py``'s dataset: its ``__getitem__`` verbatim from the drop on (``random``
    decides per read whether to drop the image embedding, the text or both); the image and the
    CLIP image are made from the index instead of read from disk and transformed."""

    def __init__(self, data, tokenizer, t_drop_rate=0.05, i_drop_rate=0.05, ti_drop_rate=0.05):
        super().__init__()

        self.tokenizer = tokenizer
        self.i_drop_rate = i_drop_rate
        self.t_drop_rate = t_drop_rate
        self.ti_drop_rate = ti_drop_rate
        self.data = data  # list of dict: [{"image_file": "1.png", "text": "A dog"}]

    def __getitem__(self, idx):
        item = self.data[idx]
        text = item["text"]
        row = _example(idx, 0)
        image, clip_image = row["image"], row["clip_image"]

        # drop
        drop_image_embed = 0
        rand_num = random.random()
        if rand_num < self.i_drop_rate:
            drop_image_embed = 1
        elif rand_num < (self.i_drop_rate + self.t_drop_rate):
            text = ""
        elif rand_num < (self.i_drop_rate + self.t_drop_rate + self.ti_drop_rate):
            text = ""
            drop_image_embed = 1
        # get text and tokenize
        text_input_ids = self.tokenizer(
            text,
            max_length=self.tokenizer.model_max_length,
            padding="max_length",
            truncation=True,
            return_tensors="pt",
        ).input_ids

        return {
            "image": image,
            "text_input_ids": text_input_ids,
            "clip_image": clip_image,
            "drop_image_embed": drop_image_embed,
        }

    def __len__(self):
        return len(self.data)


def _loader(**drop_rates) -> torch.utils.data.DataLoader:
    tokenizer = word_tokenizer(["a", "dog", "cat", "on", "the", "beach"])
    tokenizer.model_max_length = TOKENS
    texts = ["a dog", "a cat on the beach", "the dog", "a cat"]
    data = [{"image_file": f"{i}.png", "text": texts[i]} for i in range(4)]
    dataset = MyDataset(data, tokenizer=tokenizer, **drop_rates)
    return torch.utils.data.DataLoader(dataset, collate_fn=collate_fn, batch_size=2)


def test_cache_names_the_datasets_per_read_drops(tmp_path):
    """The drops are drawn per read in ``__getitem__``: a cache stores one draw per sample,
    where the unsplit run draws anew every epoch. ``cache()`` re-reads the first sample under
    other seeds and, at the script's own rates, sees a text-and-image drop: it names both
    fields (the warning, not an error: one draw per sample may be what the user wants)."""
    parts = build()
    split = graphsplit.split(parts.step, (_batch([0, 1], [0, 1]),))
    with pytest.warns(graphsplit.errors.RandomDatasetWarning) as caught:
        graphsplit.cache(split, _loader(), tmp_path / "cache", progress=False)
    message = str(caught[0].message)
    assert "two reads of sample 0 gave other 'text_input_ids', 'drop_image_embeds'" in message
    assert "every epoch trained from it sees that same draw" in message
