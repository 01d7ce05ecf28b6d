"""Conformance: LoRA on a mixture-of-experts LM (top-k routing: data-dependent indexing).

``MixtralForCausalLM`` and ``Qwen2MoeForCausalLM`` (transformers ``models/mixtral``,
``models/qwen2_moe``) with peft LoRA on the attention projections, as ``Trainer.compute_loss``
calls them (``model(**inputs).loss``), with and without ``output_router_logits=True`` (the
load-balancing auxiliary loss TRL's trainers request for MoE models). The router picks each
token's experts with ``torch.topk`` and the experts gather their tokens with data-dependent
indexing; all of that sits after the first LoRA layer, so only the frozen work before it (the
token embedding, the first layer's norm and frozen projections) may be cached. Tiny configs,
random weights.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphsplit
from tests.conformance.matrix import ids_and_mask
from tests.conformance.test_unseen_lm import assert_trains_from_its_cache, stage2_paths
from tests.helpers import split_and_verify

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB = 64
SIZES = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 32,
}


def _mixtral() -> nn.Module:
    config = transformers.MixtralConfig(**SIZES, num_local_experts=4, num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(config)


def _qwen2_moe() -> nn.Module:
    config = transformers.Qwen2MoeConfig(
        **SIZES,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
    )
    return transformers.Qwen2MoeForCausalLM(config)


def _with_lora(model: nn.Module) -> nn.Module:
    config = peft.LoraConfig(
        task_type="CAUSAL_LM",
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        init_lora_weights="gaussian",
    )
    model = peft.get_peft_model(model, config)
    generator = torch.Generator().manual_seed(5)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data = torch.randn(param.shape, generator=generator) * 0.02
    return model


class CausalLanguageModelling(nn.Module):
    """``Trainer.compute_loss``: ``model(**inputs).loss``; with ``router_aux``, the MoE
    load-balancing loss is added inside the model (``router_aux_loss_coef``)."""

    def __init__(self, model: nn.Module, router_aux: bool) -> None:
        super().__init__()
        self.model, self.router_aux = model, router_aux

    def forward(self, input_ids, attention_mask, labels):
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
        if self.router_aux:
            inputs["output_router_logits"] = True
        return self.model(**inputs).loss


def _batch(size: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    ids, mask = ids_and_mask(size, seed=seed)
    return ids, mask, ids.masked_fill(mask == 0, -100)


@pytest.mark.parametrize("router_aux", [False, True], ids=["plain", "router_aux"])
@pytest.mark.parametrize("build", [_mixtral, _qwen2_moe], ids=["mixtral", "qwen2_moe"])
@pytest.mark.parametrize("size", [1, 2, 3])
def test_moe_lora_caches_the_frozen_embedding_only(size, build, router_aux):
    torch.manual_seed(0)
    step = CausalLanguageModelling(_with_lora(build()), router_aux)
    batch = _batch(size)
    split = split_and_verify(step, batch)
    # The experts run ``torch._grouped_mm``, whose CPU kernel takes float32 and whose meta
    # kernel (torch 2.13) wants bfloat16: the whole-step trace fails on meta tensors, and the
    # module-level path takes the step, caching the frozen calls made before the first LoRA.
    assert isinstance(split, graphsplit.CallSplit)
    assert "BF16" in split.report()
    cached = {key for key in split.boundary if key not in split.input_names}
    layer = "model_base_model_model_model_layers_0"
    assert cached == {
        "input_ids__shape",  # only the cached embedding reads the ids: their shape is stored
        "model_base_model_model_model_embed_tokens__0__out",
        f"{layer}_input_layernorm__0__out",
        f"{layer}_self_attn_q_proj_base_layer__0__out",
        f"{layer}_self_attn_k_proj__0__out",
        f"{layer}_self_attn_v_proj_base_layer__0__out",
    }
    assert {"model.base_model.model.model.layers.1.mlp"} <= stage2_paths(split)
    assert_trains_from_its_cache(step, split, [batch, _batch(size, seed=1)])
