"""Conformance: tencent-ailab/IP-Adapter's ``tutorial_train_plus.py`` training step (IP-Adapter
Plus).

Where ``tutorial_train.py`` (``test_unseen3_diffusers_ip_adapter.py``) zeroes a dropped sample's
*embedding* after the frozen image encoder, the Plus script zeroes the dropped sample's *CLIP
image* before it, in a Python loop over ``zip(batch["clip_images"], batch["drop_image_embeds"])``,
then encodes the stacked images with ``output_hidden_states=True`` and keeps
``hidden_states[-2]`` (the penultimate layer's patch tokens). The trainable projection is the
script's ``Resampler`` (a Perceiver over those tokens, einops inside), with 16 IP tokens given to
every ``IPAttnProcessor2_0`` (``num_tokens=args.num_tokens``).

The image encoder's input now depends on the drop flags: it is still a function of the sample
alone (its image and its flag), so it must be cached, per sample, with only the one hidden
state stage 2 reads stored. VAE and text encoder as before; stage 2 trains the Resampler and the
IP weights bit for bit, on other drop patterns and from a cache on disk.
"""

from __future__ import annotations

import itertools
import math
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange
from einops.layers.torch import Rearrange

import graphsplit
from tests.helpers import line_of, split_and_verify

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

from tests.conformance.test_unseen3_diffusers_ip_adapter import (  # noqa: E402
    IPAdapter,
    _batch,
    _image_encoder,
    install_ip_attn_processors,
)
from tests.conformance.unseen2_checks import assert_trains_from_its_cache  # noqa: E402
from tests.conformance.unseen_checks import stage2_top_modules  # noqa: E402
from tests.zoo import build_frozen_sd  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Accessing config attribute:FutureWarning")


# --- ip_adapter/resampler.py, verbatim but for line wrapping ---
# FFN
def FeedForward(dim, mult=4):
    inner_dim = int(dim * mult)
    return nn.Sequential(
        nn.LayerNorm(dim),
        nn.Linear(dim, inner_dim, bias=False),
        nn.GELU(),
        nn.Linear(inner_dim, dim, bias=False),
    )


def reshape_tensor(x, heads):
    bs, length, width = x.shape  # noqa: RUF059 (the script's)
    # (bs, length, width) --> (bs, length, n_heads, dim_per_head)
    x = x.view(bs, length, heads, -1)
    # (bs, length, n_heads, dim_per_head) --> (bs, n_heads, length, dim_per_head)
    x = x.transpose(1, 2)
    # (bs, n_heads, length, dim_per_head) --> (bs*n_heads, length, dim_per_head)
    x = x.reshape(bs, heads, length, -1)
    return x


class PerceiverAttention(nn.Module):
    def __init__(self, *, dim, dim_head=64, heads=8):
        super().__init__()
        self.scale = dim_head**-0.5
        self.dim_head = dim_head
        self.heads = heads
        inner_dim = dim_head * heads

        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)

        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim, inner_dim * 2, bias=False)
        self.to_out = nn.Linear(inner_dim, dim, bias=False)

    def forward(self, x, latents):
        """
        Args:
            x (torch.Tensor): image features
                shape (b, n1, D)
            latent (torch.Tensor): latent features
                shape (b, n2, D)
        """
        x = self.norm1(x)
        latents = self.norm2(latents)

        b, l, _ = latents.shape  # noqa: E741 (the script's)

        q = self.to_q(latents)
        kv_input = torch.cat((x, latents), dim=-2)
        k, v = self.to_kv(kv_input).chunk(2, dim=-1)

        q = reshape_tensor(q, self.heads)
        k = reshape_tensor(k, self.heads)
        v = reshape_tensor(v, self.heads)

        # attention
        scale = 1 / math.sqrt(math.sqrt(self.dim_head))
        weight = (q * scale) @ (k * scale).transpose(
            -2, -1
        )  # More stable with f16 than dividing afterwards
        weight = torch.softmax(weight.float(), dim=-1).type(weight.dtype)
        out = weight @ v

        out = out.permute(0, 2, 1, 3).reshape(b, l, -1)

        return self.to_out(out)


class Resampler(nn.Module):
    def __init__(
        self,
        dim=1024,
        depth=8,
        dim_head=64,
        heads=16,
        num_queries=8,
        embedding_dim=768,
        output_dim=1024,
        ff_mult=4,
        max_seq_len: int = 257,  # CLIP tokens + CLS token
        apply_pos_emb: bool = False,
        num_latents_mean_pooled: int = 0,  # number of latents derived from mean pooled
        # representation of the sequence
    ):
        super().__init__()
        self.pos_emb = nn.Embedding(max_seq_len, embedding_dim) if apply_pos_emb else None

        self.latents = nn.Parameter(torch.randn(1, num_queries, dim) / dim**0.5)

        self.proj_in = nn.Linear(embedding_dim, dim)

        self.proj_out = nn.Linear(dim, output_dim)
        self.norm_out = nn.LayerNorm(output_dim)

        self.to_latents_from_mean_pooled_seq = (
            nn.Sequential(
                nn.LayerNorm(dim),
                nn.Linear(dim, dim * num_latents_mean_pooled),
                Rearrange("b (n d) -> b n d", n=num_latents_mean_pooled),
            )
            if num_latents_mean_pooled > 0
            else None
        )

        self.layers = nn.ModuleList([])
        for _ in range(depth):
            self.layers.append(
                nn.ModuleList(
                    [
                        PerceiverAttention(dim=dim, dim_head=dim_head, heads=heads),
                        FeedForward(dim=dim, mult=ff_mult),
                    ]
                )
            )

    def forward(self, x):
        if self.pos_emb is not None:
            n, device = x.shape[1], x.device
            pos_emb = self.pos_emb(torch.arange(n, device=device))
            x = x + pos_emb

        latents = self.latents.repeat(x.size(0), 1, 1)

        x = self.proj_in(x)

        if self.to_latents_from_mean_pooled_seq:
            meanpooled_seq = masked_mean(
                x, dim=1, mask=torch.ones(x.shape[:2], device=x.device, dtype=torch.bool)
            )
            meanpooled_latents = self.to_latents_from_mean_pooled_seq(meanpooled_seq)
            latents = torch.cat((meanpooled_latents, latents), dim=-2)

        for attn, ff in self.layers:
            latents = attn(x, latents) + latents
            latents = ff(latents) + latents

        latents = self.proj_out(latents)
        return self.norm_out(latents)


def masked_mean(t, *, dim, mask=None):
    if mask is None:
        return t.mean(dim=dim)

    denom = mask.sum(dim=dim, keepdim=True)
    mask = rearrange(mask, "b n -> b n 1")
    masked_t = t.masked_fill(~mask, 0.0)

    return masked_t.sum(dim=dim) / denom.clamp(min=1e-5)


def build():
    """``main()``'s models and its loop body as a closure (one process, fp32). The Resampler at
    depth 1 with 4 heads of 8 (the script: depth 4, 12 heads of 64), 16 queries (its default
    ``--num_tokens``)."""
    vae, text_encoder, unet, _ = build_frozen_sd()
    noise_scheduler = diffusers.DDPMScheduler(num_train_timesteps=1000)
    image_encoder = _image_encoder()
    args = types.SimpleNamespace(num_tokens=16)
    # freeze parameters of models to save more memory
    unet.requires_grad_(False)
    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)
    image_encoder.requires_grad_(False)

    torch.manual_seed(1)
    # ip-adapter-plus
    image_proj_model = Resampler(
        dim=unet.config.cross_attention_dim,
        depth=1,
        dim_head=8,
        heads=4,
        num_queries=args.num_tokens,
        embedding_dim=image_encoder.config.hidden_size,
        output_dim=unet.config.cross_attention_dim,
        ff_mult=4,
    )
    install_ip_attn_processors(unet, num_tokens=args.num_tokens)
    adapter_modules = torch.nn.ModuleList(unet.attn_processors.values())
    ip_adapter = IPAdapter(unet, image_proj_model, adapter_modules, None)
    with torch.no_grad():  # as after some steps (to_k_ip / to_v_ip start as copies of to_k / to_v)
        for param in adapter_modules.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    weight_dtype = torch.float32
    accelerator = types.SimpleNamespace(device=torch.device("cpu"))
    params_to_opt = list(
        itertools.chain(
            ip_adapter.image_proj_model.parameters(), ip_adapter.adapter_modules.parameters()
        )
    )

    def training_step(batch):
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

        clip_images = []
        for clip_image, drop_image_embed in zip(batch["clip_images"], batch["drop_image_embeds"]):
            if drop_image_embed == 1:
                clip_images.append(torch.zeros_like(clip_image))
            else:
                clip_images.append(clip_image)
        clip_images = torch.stack(clip_images, dim=0)
        with torch.no_grad():
            image_embeds = image_encoder(
                clip_images.to(accelerator.device, dtype=weight_dtype), output_hidden_states=True
            ).hidden_states[-2]

        with torch.no_grad():
            encoder_hidden_states = text_encoder(batch["text_input_ids"].to(accelerator.device))[0]

        noise_pred = ip_adapter(noisy_latents, timesteps, encoder_hidden_states, image_embeds)

        loss = F.mse_loss(noise_pred.float(), noise.float(), reduction="mean")
        return loss

    return types.SimpleNamespace(step=training_step, ip_adapter=ip_adapter, params=params_to_opt)


def test_the_image_encoder_on_the_dropped_images_is_cached_one_hidden_state_stored():
    drops = [0, 1, 0]
    parts = build()
    split = split_and_verify(parts.step, (_batch(range(len(drops)), drops),))
    assert split.path == "calls"
    assert line_of(parts.step, "for clip_image, drop_image_embed in zip(") in split.reason
    cached = {key for key, spec in split.boundary.items() if spec.source != "input"}
    # The penultimate of the vision tower's three hidden states (embeddings + two layers).
    assert cached == {
        "vae_quant_conv__0__out",
        "image_encoder__0__hidden_states__1",
        "text_encoder__0__last_hidden_state",
    }
    assert split.boundary["image_encoder__0__hidden_states__1"].batch_dim == 0
    stage1 = {name.split(".")[0] for name, _ in split.stage1.named_parameters()}
    assert stage1 == {"vae", "text_encoder", "image_encoder"}
    assert stage2_top_modules(split) == {"ip_adapter"}
    trainable = {n for n, p in split.stage2.named_parameters() if p.requires_grad}
    names = {id(p): n for n, p in parts.ip_adapter.named_parameters()}
    assert trainable == {f"ip_adapter.{names[id(p)]}" for p in parts.params}
    for index, other_drops in enumerate([[1, 0, 1], [1]]):
        start = 3 + 3 * index
        other = _batch(range(start, start + len(other_drops)), other_drops)
        assert all(c.ok for c in graphsplit.verify(parts.step, split, (other,), seed=index))


def test_a_dropped_image_is_encoded_as_zeros_in_stage1():
    """The cache holds the encoder's output on the *zeroed* image for a dropped sample: the
    same sample cached with and without its drop differs, and the dropped row equals the
    encoder's output on a zero image in the same row of a batch of the same size (CPU kernels
    may round a row otherwise at another position in the batch, so rows are compared in place)."""
    parts = build()
    split = graphsplit.split(parts.step, (_batch([0, 1], [0, 1]),))
    key = "image_encoder__0__hidden_states__1"
    kept = split.stage1(**_batch([2, 3], [0, 0]))[key]
    dropped = split.stage1(**_batch([2, 3], [1, 0]))[key]
    assert not torch.equal(kept[0], dropped[0]) and torch.equal(kept[1], dropped[1])
    zeros = split.stage1(**_batch([4, 5], [1, 1]))[key]
    assert torch.equal(dropped[0], zeros[0])
    assert torch.equal(split.stage1(**_batch([6, 7], [0, 1]))[key][1], zeros[1])


def test_cache_round_trip(tmp_path):
    parts = build()
    split = graphsplit.split(parts.step, (_batch([0, 1], [0, 1]),))
    batches = [_batch([2, 3], [1, 0]), _batch([6, 7], [1, 1])]
    assert_trains_from_its_cache(split, parts.step, batches, tmp_path, parts.params)
