"""The module-level path on steps that call ``torch.compile``'d modules.

The stages run the step's own code, so a compiled module runs compiled in them; the router
replaces the ``forward`` of the object the step calls, the compiled wrapper at its own path
(``text_encoder``), its original (``text_encoder._orig_mod``) then being a call inside it.
The probe runs compiled modules eagerly (``torch.compiler.set_stance("force_eager")``): it is
analysis, and under dynamo it compiled its own bookkeeping and recompiled per call (the
split of a step with a compiled text encoder and LoRA UNet took 84 s before, 9 s after, one
run each on two shared CPU cores). A module compiled in place (``module.compile()``) is
routed as itself. The compiles use ``backend="eager"``: exactness is checked bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import graphsplit
from graphsplit.calls import Verdict
from tests.zoo import CaptionedImages, build_sd_lora_step


def _step(compile_text_encoder: bool, compile_unet: bool):
    parts = build_sd_lora_step(seed=0)
    vae, scheduler = parts.vae, parts.scheduler
    text_encoder, unet = parts.text_encoder, parts.unet
    if compile_text_encoder:
        text_encoder = torch.compile(text_encoder, backend="eager")
    if compile_unet:
        unet = torch.compile(unet, backend="eager")

    def training_step(batch):  # diffusers' train_text_to_image_lora.py loop body, shortened
        latents = vae.encode(batch["pixel_values"]).latent_dist.sample()
        latents = latents * vae.config.scaling_factor
        noise = torch.randn_like(latents)
        timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (latents.shape[0],))
        noisy_latents = scheduler.add_noise(latents, noise, timesteps)
        encoder_hidden_states = text_encoder(batch["input_ids"], return_dict=False)[0]
        model_pred = unet(noisy_latents, timesteps, encoder_hidden_states, return_dict=False)[0]
        return F.mse_loss(model_pred.float(), noise.float(), reduction="mean")

    return training_step, text_encoder, unet


def _verdicts(split) -> dict:
    return {(verdict.path, verdict.index): verdict.verdict for verdict in split.plan.verdicts}


def _batch() -> dict:
    return next(iter(DataLoader(CaptionedImages(length=2), batch_size=2)))


def _same_loss(step, split, batch) -> None:
    torch.manual_seed(4)
    expected = step(batch)
    torch.manual_seed(4)
    assert torch.equal(split.stage2(**split.stage1(**batch)), expected)


def test_a_compiled_frozen_encoder_is_routed_and_cached_as_the_uncompiled_one():
    batch = _batch()
    step, text_encoder, _ = _step(compile_text_encoder=True, compile_unet=False)
    split = graphsplit.split(step, (batch,), path="calls")
    assert all(c.ok for c in graphsplit.verify(step, split, (batch,)))

    # The wrapper's call is the one routed and cached, under the name the code calls it by
    # (the uncompiled encoder's keys); the original's call runs inside it, uncounted.
    assert _verdicts(split)[("text_encoder", 0)] is Verdict.CACHED
    assert ("text_encoder._orig_mod", 0) not in _verdicts(split)
    # (of its (last_hidden_state, pooler_output) tuple only the field the step reads is stored)
    assert [key for key in split.boundary if key.startswith("text_encoder")] == [
        "text_encoder__0__0",
    ]
    assert not hasattr(split.stage2, "text_encoder")
    calls = []
    original = text_encoder._orig_mod
    original.register_forward_pre_hook(lambda module, args: calls.append(module))
    boundary = split.stage1(**batch)
    assert calls == [original]  # stage 1 ran the encoder (through the compiled wrapper)
    split.stage2(**boundary)
    assert calls == [original]  # stage 2 answered the wrapper's call from the cache
    _same_loss(step, split, batch)


@pytest.mark.slow  # dynamo captures the routed UNet: about 45 s on two cores
def test_a_compiled_lora_unet_runs_compiled_in_stage2_with_its_frozen_parts_cached():
    batch = _batch()
    step, _, unet = _step(compile_text_encoder=False, compile_unet=True)
    split = graphsplit.split(step, (batch,), path="calls")
    assert all(c.ok for c in graphsplit.verify(step, split, (batch,)))

    # The frozen projections of the text states inside the compiled UNet are cached.
    inner = [call for call, verdict in _verdicts(split).items() if verdict is Verdict.CACHED]
    assert any(path.startswith("unet._orig_mod.") and "attn2.to_k" in path for path, _ in inner)
    assert set(split.stage2.state_dict()) <= {f"unet.{key}" for key in unet.state_dict()}
    calls = []
    unet.register_forward_pre_hook(lambda module, args: calls.append(module))
    boundary = split.stage1(**batch)  # runs the UNet up to its cached inner calls
    calls.clear()
    split.stage2(**boundary)
    assert calls == [unet]  # stage 2 runs the step's code: the compiled wrapper
    _same_loss(step, split, batch)


def test_a_frozen_encoder_compiled_in_place_is_routed_and_cached():
    batch = _batch()
    step, text_encoder, _ = _step(compile_text_encoder=False, compile_unet=False)
    text_encoder.compile(backend="eager")  # module.compile(): the module itself, its call compiled
    split = graphsplit.split(step, (batch,), path="calls")
    assert all(c.ok for c in graphsplit.verify(step, split, (batch,)))
    assert _verdicts(split)[("text_encoder", 0)] is Verdict.CACHED
    assert not hasattr(split.stage2, "text_encoder")
    assert text_encoder._compiled_call_impl is not None
    _same_loss(step, split, batch)
