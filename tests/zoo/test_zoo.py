"""The zoo's real-model steps: they run, train only what they claim, and are reproducible.

Other tests trust these builders as ground truth, so a builder that silently trained a frozen
weight, or whose weights changed with ``frozen_on_meta``, would make those tests meaningless.
"""

from __future__ import annotations

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("peft")

import torch
from torch import nn
from torch.utils.data import default_collate

from tests.zoo import (
    SD_SIZES,
    CaptionedImages,
    build_frozen_sd,
    build_partial_encoder_lora_step,
    build_sd_lora_step,
    build_textual_inversion_step,
    special_token_ids,
)


def _batch(dataset: CaptionedImages, n: int = 2) -> dict[str, torch.Tensor]:
    batch = default_collate([dataset[i] for i in range(n)])
    batch.pop("key")
    return batch


@pytest.fixture(scope="module")
def batch() -> dict[str, torch.Tensor]:
    return _batch(CaptionedImages(length=4, resolution=32))


def _trainable(module: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in module.named_parameters() if p.requires_grad}


def _assert_grads_only_on_trainable(module: nn.Module) -> None:
    """Every trainable parameter got a non-zero gradient and no frozen one got any."""
    for name, param in module.named_parameters():
        if param.requires_grad:
            assert param.grad is not None, name
            assert param.grad.abs().sum() > 0, name
        else:
            assert param.grad is None, name


def _devices(module: nn.Module) -> set[str]:
    tensors = [*module.parameters(), *module.buffers()]
    return {t.device.type for t in tensors}


def _same_weights(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ---- dataset -----------------------------------------------------------------------------


def test_dataset_items_are_deterministic_and_well_formed() -> None:
    a, b = CaptionedImages(length=5, seed=3), CaptionedImages(length=5, seed=3)
    for i in reversed(range(5)):  # order must not matter
        x, y = a[i], b[i]
        assert x["key"] == y["key"] == f"sample-{i:06d}"
        assert torch.equal(x["pixel_values"], y["pixel_values"])
        assert torch.equal(x["input_ids"], y["input_ids"])
        assert x["pixel_values"].shape == (3, 32, 32)
        assert x["pixel_values"].dtype == torch.float32
        assert x["pixel_values"].min() >= -1 and x["pixel_values"].max() <= 1
        assert x["input_ids"].shape == (16,) and x["input_ids"].dtype == torch.int64
    other = CaptionedImages(length=5, seed=4)[0]
    assert not torch.equal(other["pixel_values"], a[0]["pixel_values"])
    with pytest.raises(IndexError):
        a[5]


def test_dataset_tokens_follow_clip_conventions() -> None:
    bos, eos, _ = special_token_ids(1000)
    ids = CaptionedImages(max_tokens=12, placeholder_ids=[1000, 1001])[0]["input_ids"]
    assert ids[0] == bos and ids[1:3].tolist() == [1000, 1001]
    assert (ids == eos).any()
    words = ids[3:][ids[3:] != eos]
    assert ((words > 0) & (words < bos)).all()


def test_dataset_resolutions_cycle() -> None:
    data = CaptionedImages(length=4, resolutions=[32, 48])
    sides = [data[i]["pixel_values"].shape[-1] for i in range(4)]
    assert sides == [32, 48, 32, 48] == [data.resolution_of(i) for i in range(4)]


# ---- SD LoRA -------------------------------------------------------------------------------


def test_sd_lora_step_trains_only_lora(batch: dict[str, torch.Tensor]) -> None:
    step = build_sd_lora_step()
    trainable = _trainable(step)
    assert trainable and all("lora_" in n and n.startswith("unet.") for n in trainable)
    targets = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable}
    assert targets == {"to_q", "to_k", "to_v", "0"}  # "0" is to_out.0
    assert not step.vae.training and not step.text_encoder.training
    torch.manual_seed(0)
    loss = step(**batch)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    _assert_grads_only_on_trainable(step)


def test_builders_are_deterministic_and_keep_caller_rng() -> None:
    state = torch.random.get_rng_state()
    a, b = build_sd_lora_step(seed=1), build_sd_lora_step(seed=1)
    assert torch.equal(state, torch.random.get_rng_state())
    assert _same_weights(a, b)
    assert not _same_weights(a.unet, build_sd_lora_step(seed=2).unet)


def test_frozen_sd_is_frozen_in_eval_with_the_lora_steps_weights() -> None:
    vae, text_encoder, unet, scheduler = build_frozen_sd(seed=1)
    for module in (vae, text_encoder, unet):
        assert not module.training
        assert not any(p.requires_grad for p in module.parameters())
    assert not any("lora_" in name for name, _ in unet.named_parameters())
    step = build_sd_lora_step(seed=1)
    assert _same_weights(vae, step.vae) and _same_weights(text_encoder, step.text_encoder)
    assert scheduler.config.num_train_timesteps == 1000


def test_frozen_on_meta_keeps_unet_weights() -> None:
    ref = build_sd_lora_step()
    lean = build_sd_lora_step(frozen_on_meta=True)
    assert _devices(lean.vae) == _devices(lean.text_encoder) == {"meta"}
    assert _devices(lean.unet) == {"cpu"}
    assert _same_weights(ref.unet, lean.unet)

    stage1_only = build_sd_lora_step(trainable_on_meta=True)
    assert _devices(stage1_only.unet) == {"meta"}
    assert _devices(stage1_only.vae) == _devices(stage1_only.text_encoder) == {"cpu"}
    assert _same_weights(ref.vae, stage1_only.vae)
    assert _same_weights(ref.text_encoder, stage1_only.text_encoder)


def test_gradient_checkpointing_is_enabled_and_exact(batch: dict[str, torch.Tensor]) -> None:
    plain, ckpt = build_sd_lora_step(), build_sd_lora_step(gradient_checkpointing=True)
    assert not plain.unet.is_gradient_checkpointing
    assert ckpt.unet.is_gradient_checkpointing and ckpt.unet.training
    losses = []
    for step in (plain, ckpt):
        torch.manual_seed(0)
        loss = step(**batch)
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[0], losses[1])
    grads = [{n: p.grad for n, p in _trainable(s).items()} for s in (plain, ckpt)]
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name])


def test_sizes_build_and_heavy_frozen_is_frozen_heavy() -> None:
    """Benchmark sizes construct; ``heavy_frozen`` is dominated by its frozen modules."""
    for size in SD_SIZES:
        step = build_sd_lora_step(size=size, frozen_on_meta=True, trainable_on_meta=True)
        assert _devices(step) == {"meta"}
    heavy = build_sd_lora_step(size="heavy_frozen", frozen_on_meta=True, trainable_on_meta=True)
    frozen = sum(p.numel() for m in (heavy.vae, heavy.text_encoder) for p in m.parameters())
    assert frozen > 10 * sum(p.numel() for p in heavy.unet.parameters())
    with pytest.raises(ValueError, match="unknown size"):
        build_sd_lora_step(size="huge")


# ---- partial encoder LoRA -------------------------------------------------------------------


def test_partial_encoder_lora_only_on_last_layers() -> None:
    step = build_partial_encoder_lora_step()
    trainable = _trainable(step)
    lora = [n for n in trainable if "lora_" in n]
    assert set(trainable) - set(lora) == {"head.weight", "head.bias"}
    assert {n.split(".")[3] for n in lora} == {"2", "3"}  # text_encoder.encoder.layers.N
    assert {n.split(".")[5] for n in lora} == {"q_proj", "v_proj"}
    assert not any("lora_" in n for n, _ in step.text_encoder.encoder.layers[:2].named_parameters())
    ids = _batch(CaptionedImages(length=2))["input_ids"]
    loss = step(ids, torch.randn(2, step.head.out_features))
    loss.backward()
    _assert_grads_only_on_trainable(step)


# ---- textual inversion ----------------------------------------------------------------------


def test_textual_inversion_trains_only_new_embeddings() -> None:
    step = build_textual_inversion_step(n_new_tokens=2)
    assert list(_trainable(step)) == ["new_embeddings"]
    data = CaptionedImages(length=2, placeholder_ids=[step.vocab_size, step.vocab_size + 1])
    torch.manual_seed(0)
    loss = step(**_batch(data))
    loss.backward()
    _assert_grads_only_on_trainable(step)


def test_textual_inversion_embeds_placeholders() -> None:
    step = build_textual_inversion_step(n_new_tokens=2)
    with torch.no_grad():
        step.new_embeddings.normal_()
    v = step.vocab_size
    ids = torch.tensor([[v - 2, v + 1, 5, v, v - 1]])
    emb = step.embed_tokens(ids)[0]
    table = step.text_encoder.embeddings.token_embedding.weight
    assert torch.equal(emb[1], step.new_embeddings[1])
    assert torch.equal(emb[3], step.new_embeddings[0])
    assert torch.equal(emb[2], table[5]) and torch.equal(emb[4], table[v - 1])


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_textual_inversion_text_path_matches_clip_forward(attn: str) -> None:
    """Without placeholders the hand-built text path equals ``CLIPTextModel(input_ids)``.

    This pins the causal mask: the encoder called without one attends bidirectionally.
    """
    step = build_textual_inversion_step()
    step.text_encoder.set_attn_implementation(attn)
    ids = _batch(CaptionedImages(length=2))["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(step.encode_text(ids), step.text_encoder(ids)[0])
