"""Conformance: peft adapters other than plain LoRA on a tiny Llama, as ``get_peft_model`` builds.

DoRA (``LoraConfig(use_dora=True)``), IA3, LoHa, LoKr, VeRA, OFT, BOFT and AdaLoRA, each
trained as ``Trainer.compute_loss`` calls the model (``model(**inputs).loss``). peft 0.21.

The frozen work before the first adapted layer (the token embedding, layer 0's input norm, the
frozen projections and base layers of layer 0) may be cached, nothing after it: each test
checks where the cut falls, exactness (loss and every trainable gradient bit for bit, on the
example and on other data) and training from the cache after an optimizer step
(:func:`~tests.conformance.test_unseen_lm.assert_trains_from_its_cache`: a cache that held
anything depending on a trainable parameter fails it).

What graphsplit does with each:

- DoRA, IA3, OFT, BOFT: the whole-step trace; layer 0's frozen base projections are cached
  (DoRA: ``base_layer(x)``, which ``lora_magnitude_vector`` rescales in stage 2; IA3: the
  ``k``/``v`` base outputs that ``ia3_l`` scales). OFT and BOFT rotate the *input* of the
  base layer, so the base projection runs in stage 2; BOFT's ``torch.eye`` / ``torch.ones``
  start values are per-dataset constants.
- VeRA: the trace, but tracing into the adapted projections fails on peft's shared
  ``BufferDict`` (a note says so) and they are kept whole in stage 2: the cut is layer 0's
  input norm, exact.
- LoHa, LoKr: their layers draw ``torch.rand(1) > module_dropout`` (module dropout) and branch
  on it in Python; the trace refuses that value read, naming peft's line, and the
  module-level path caches the frozen calls' outputs and runs the step's own Python in
  stage 2 (the draw live).
- AdaLoRA: ``AdaLoraModel.forward`` adds its orthogonal regulariser from a loop over
  ``named_parameters()``; the trace refuses the value it would have frozen (before, stage 2
  held a ``meta`` constant and failed when run), the module-level path computes it live.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import graphsplit
from tests.conformance.matrix import ids_and_mask
from tests.conformance.test_unseen_lm import assert_trains_from_its_cache, stage2_paths
from tests.helpers import split_and_verify, tiny_llama_config

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ATTENTION = ["q_proj", "v_proj"]
LAYER0 = "model.base_model.model.model.layers.0"
# The modules stage 1 may hold: the work before layer 0's attention, and its frozen parts.
BEFORE_ADAPTERS = {
    "model",
    "model.base_model",
    "model.base_model.model",
    "model.base_model.model.model",
    "model.base_model.model.model.embed_tokens",
    "model.base_model.model.model.rotary_emb",
    "model.base_model.model.model.layers",
    LAYER0,
    f"{LAYER0}.input_layernorm",
    f"{LAYER0}.self_attn",
    *(f"{LAYER0}.self_attn.{p}_proj" for p in "qkv"),
    *(f"{LAYER0}.self_attn.{p}_proj.base_layer" for p in "qkv"),
}


class CausalLanguageModelling(nn.Module):
    """``Trainer.compute_loss``: ``model(**inputs).loss``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, labels):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss


def _adapted(config) -> CausalLanguageModelling:
    """``get_peft_model`` on a tiny random Llama; every trainable tensor then moved off its
    identity start (LoRA's zero ``B``, IA3's ones, OFT's zero skew matrix) so each adapter
    changes the output and every gradient is worth comparing."""
    torch.manual_seed(0)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(tiny_llama_config()), config)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return CausalLanguageModelling(model.train())


def _batch(size: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    ids, mask = ids_and_mask(size, tokens=8, seed=seed)
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _check(step: nn.Module, split, tmp_path) -> None:
    """Exact on other data (three rows, another seed), nothing past the first adapted layer
    in stage 1, and trained from its cache after an optimizer step."""
    other = _batch(3, seed=1)
    assert all(c.ok for c in graphsplit.verify(step, split, other, seed=3))
    held_by_stage1 = {name for name, _ in split.stage1.named_modules() if name}
    assert held_by_stage1 <= BEFORE_ADAPTERS, held_by_stage1 - BEFORE_ADAPTERS
    assert "model.base_model.model.model.embed_tokens" in held_by_stage1
    assert f"{LAYER0}.input_layernorm" in held_by_stage1
    assert not any(p.requires_grad for p in split.stage1.parameters())
    assert_trains_from_its_cache(step, split, [_batch(2), other], tmp_path / "cache")


# --- the whole-step trace --------------------------------------------------------------------

TRACED = {
    "dora": (
        lambda: peft.LoraConfig(
            task_type="CAUSAL_LM",
            r=4,
            lora_alpha=8,
            target_modules=ATTENTION,
            use_dora=True,
            init_lora_weights="gaussian",
        ),
        {"q_proj.base_layer", "v_proj.base_layer"},
    ),
    "ia3": (
        lambda: peft.IA3Config(
            task_type="CAUSAL_LM",
            target_modules=["k_proj", "v_proj", "down_proj"],
            feedforward_modules=["down_proj"],
        ),
        {"k_proj.base_layer", "v_proj.base_layer"},
    ),
    "oft": (
        lambda: peft.OFTConfig(
            task_type="CAUSAL_LM", r=0, oft_block_size=4, target_modules=ATTENTION
        ),
        set(),
    ),
    "boft": (
        lambda: peft.BOFTConfig(task_type="CAUSAL_LM", boft_block_size=4, target_modules=ATTENTION),
        set(),
    ),
}


@pytest.mark.parametrize("adapter", sorted(TRACED))
def test_adapter_caches_the_frozen_work_before_the_first_adapted_layer(adapter, tmp_path):
    config, cached_base = TRACED[adapter]
    step = _adapted(config())
    split = split_and_verify(step, _batch(2))
    assert split.path == "trace"
    keys = set(split.boundary)
    assert "model_base_model_model_model_embed_tokens" in keys
    # The output of layer 0's input norm is the adapted projections' input. IA3 adapts only
    # ``k``/``v`` by scaling their outputs: the frozen ``q`` (rotated) and their base outputs
    # are all stage 2 needs of it.
    norm = "model_base_model_model_model_layers_0_input_layernorm"
    assert (norm in keys) == (adapter != "ia3")
    prefix = "model_base_model_model_model_layers_0_self_attn_"
    base_outputs = {
        key.removeprefix(prefix).replace("_base_layer", ".base_layer")
        for key in keys
        if key.startswith(prefix) and key.endswith("_base_layer")
    }
    assert base_outputs == cached_base
    held = stage2_paths(split)
    adapted = "k_proj" if adapter == "ia3" else "q_proj"
    assert f"{LAYER0}.self_attn.{adapted}" in held
    assert "model.base_model.model.model.layers.1" in held
    _check(step, split, tmp_path)


def test_boft_caches_its_identity_start_as_a_per_dataset_constant():
    """BOFT's ``forward`` starts from ``torch.eye(in_features)`` and ``torch.ones``, which
    depend on nothing: per-dataset constants on the boundary, not per-sample tensors."""
    step = _adapted(TRACED["boft"][0]())
    split = split_and_verify(step, _batch(2))
    rotation = split.boundary["boft_rotation"]
    assert rotation.shape == (32, 32) and rotation.is_constant and rotation.batch_dim is None


def test_vera_keeps_its_adapted_projections_whole_and_is_exact(tmp_path):
    """VeRA's layers read the shared frozen ``vera_A`` / ``vera_B`` from peft's ``BufferDict``;
    tracing into the layer fails on the meta run and the layer is kept whole in stage 2 (its
    frozen base projection not cached), which the report says."""
    step = _adapted(peft.VeraConfig(task_type="CAUSAL_LM", r=4, target_modules=ATTENTION))
    split = split_and_verify(step, _batch(2))
    assert split.path == "trace"
    kept = [note for note in split.notes if note.startswith("kept")]
    assert len(kept) == 1 and f"{LAYER0}.self_attn.q_proj" in kept[0]
    assert "model_base_model_model_model_layers_0_input_layernorm" in split.boundary
    assert f"{LAYER0}.self_attn.q_proj.base_layer" in stage2_paths(split)
    _check(step, split, tmp_path)


# --- the module-level path -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("adapter", "layer"),
    [
        (
            lambda: peft.LoHaConfig(task_type="CAUSAL_LM", r=4, alpha=8, target_modules=ATTENTION),
            "loha",
        ),
        (
            lambda: peft.LoKrConfig(task_type="CAUSAL_LM", r=4, alpha=8, target_modules=ATTENTION),
            "lokr",
        ),
    ],
    ids=["loha", "lokr"],
)
def test_lycoris_module_dropout_takes_the_module_level_path(adapter, layer, tmp_path):
    step = _adapted(adapter())
    split = split_and_verify(step, _batch(2))
    assert split.path == "calls"
    # The refusal names peft's own line, where the drawn value steers Python.
    forward = getattr(peft.tuners, layer).layer
    source, start = inspect.getsourcelines(
        forward.LoHaLayer if layer == "loha" else forward.LoKrLayer
    )
    number = next(
        start + i for i, text in enumerate(source) if "torch.rand(1) > module_dropout" in text
    )
    assert f"peft/tuners/{layer}/layer.py:{number}" in split.reason
    assert "reads tensor values" in split.reason
    assert "never allowed on the trainable side" in split.reason
    keys = set(split.boundary)
    assert {
        "model_base_model_model_model_embed_tokens__0__out",
        "model_base_model_model_model_layers_0_input_layernorm__0__out",
        "model_base_model_model_model_layers_0_self_attn_q_proj_base_layer__0__out",
        "model_base_model_model_model_layers_0_self_attn_k_proj__0__out",
    } <= keys
    _check(step, split, tmp_path)


def test_adalora_regulariser_takes_the_module_level_path(tmp_path):
    config = peft.AdaLoraConfig(
        task_type="CAUSAL_LM", init_r=6, target_r=4, target_modules=ATTENTION, total_step=10
    )
    step = _adapted(config)
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(step, _batch(2), path="trace")
    regulariser = inspect.getsourcelines(peft.tuners.adalora.model.AdaLoraModel.forward)
    number = next(
        regulariser[1] + i
        for i, text in enumerate(regulariser[0])
        if "outputs.loss += orth_reg_weight * regu_loss" in text
    )
    message = str(caught.value)
    assert f"peft/tuners/adalora/model.py:{number}" in message
    assert "named_parameters() or parameters()" in message
    assert "depends on trainable parameters" in message
    assert 'path="calls"' in caught.value.fix.words
    split = split_and_verify(step, _batch(2))
    assert split.path == "calls"
    assert "named_parameters() or parameters()" in split.reason
    assert "model_base_model_model_model_layers_0_self_attn_q_proj_base_layer__0__out" in set(
        split.boundary
    )
    _check(step, split, tmp_path)
