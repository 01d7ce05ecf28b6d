"""Method calls that only reshape do not pull a module's frozen weights into stage 2 (item 6).

DiffSynth's ``model_fn_wan_video`` calls ``dit.patchify(x)`` and ``dit.unpatchify(x, grid)``
on a LoRA'd DiT (frozen base weights, trainable adapters), outside the DiT's ``forward``. Recorded
as one call each, they made stage 2 hold the whole DiT, including the frozen text embedding
whose work stage 1 caches. A mixed module's methods are traced into instead.
"""

from __future__ import annotations

import torch
from torch import nn

from tests.helpers import batch, frozen, param_names, split_and_verify


class LoraLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base_layer = frozen(nn.Linear(8, 8))
        self.lora_A = nn.Linear(8, 2, bias=False)
        self.lora_B = nn.Linear(2, 8, bias=False)

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


class Dit(nn.Module):
    """Wan 2.1's DiT layout: patch embedding, text embedding, blocks, head; LoRA on blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.patch_size = (1, 2, 2)
        self.patch_embedding = frozen(nn.Conv3d(4, 8, self.patch_size, stride=self.patch_size))
        self.text_embedding = frozen(nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 8)))
        self.blocks = nn.ModuleList([LoraLinear() for _ in range(2)])
        self.head = frozen(nn.Linear(8, 16))

    def patchify(self, x):
        x = self.patch_embedding(x)
        grid_size = x.shape[2:]
        x = x.flatten(2).transpose(1, 2).contiguous()
        return x, grid_size

    def unpatchify(self, x, grid_size):
        f, h, w = grid_size
        c = x.shape[-1] // (self.patch_size[0] * self.patch_size[1] * self.patch_size[2])
        x = x.view(x.shape[0], f, h, w, *self.patch_size, c)
        x = torch.einsum("bfhwpqrc->bcfphqwr", x)
        return x.reshape(x.shape[0], c, f * self.patch_size[0], h * 2, w * 2)


def model_fn(dit, latents, context):
    context = dit.text_embedding(context)
    x, (f, h, w) = dit.patchify(latents)
    for block in dit.blocks:
        x = block(x + context.mean(1, keepdim=True))
    x = dit.head(x)
    return dit.unpatchify(x, (f, h, w))


class WanLikeStep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dit = Dit()

    def forward(self, latents, prompt_emb):
        noise = torch.randn_like(latents)
        pred = model_fn(self.dit, latents + noise, prompt_emb)
        return nn.functional.mse_loss(pred, noise)


ARGS = (batch(2, 4, 2, 4, 4), batch(2, 3, 6, seed=1))


def test_patchify_and_unpatchify_do_not_pull_the_dit_into_stage_2():
    model = WanLikeStep()
    split = split_and_verify(model, ARGS)
    held = param_names(split.stage2, model)
    assert not any(name.startswith("dit.text_embedding") for name in held)
    assert any(name.startswith("dit.patch_embedding") for name in held)  # runs on noisy input
    assert ".patchify(" not in split.stage2.code and ".unpatchify(" not in split.stage2.code


class EagerOnly(Dit):
    """A method library code wrote for eager tensors only: it cannot be traced into."""

    def patchify(self, x):
        if {4: "image", 5: "video"}[x.dim()] != "video":  # a traced int is no dict key: KeyError
            raise ValueError("expected a video")
        return super().patchify(x)


def test_a_method_that_cannot_be_traced_into_is_recorded_whole():
    model = WanLikeStep()
    model.dit = EagerOnly()
    split = split_and_verify(model, ARGS)
    assert "dit.patchify(" in split.stage2.code
    assert any(name.startswith("dit.text_embedding") for name in param_names(split.stage2, model))
