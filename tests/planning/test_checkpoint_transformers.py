"""The library's own gradient checkpointing, traced into, stays in effect (issue 11, item 5).

transformers 5.x checkpoints each decoder layer inside the layer's own ``forward``
(``GradientCheckpointingLayer``: ``self._gradient_checkpointing_func(partial(forward, self,
**kwargs), *args)``, a ``functools.partial(checkpoint, ...)`` made by
``gradient_checkpointing_enable()``). A LoRA'd layer fed cacheable values is traced into, so its
checkpoint region is the whole layer body: many modules and ops, part of them cached by stage 1.
diffusers checkpoints one block call per region (``tests/planning/test_checkpoint.py``), so it
has no such case.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import tiny_llama_config
from tests.planning.test_checkpoint_regions import assert_checkpointed_as_eager

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def _lora_llama(*, use_reentrant: bool, checkpointing: bool = True) -> nn.Module:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config()).requires_grad_(False)
    peft.inject_adapter_in_model(peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]), model)
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(parameter, std=0.02)
    if checkpointing:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": use_reentrant}
        )
    return model.train()


class CausalLMStep(nn.Module):
    """The loss a causal-LM fine-tuning script computes (``labels=input_ids``)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, attention_mask):
        return self.lm(
            input_ids=input_ids, attention_mask=attention_mask, labels=input_ids, use_cache=False
        ).loss


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated")
@pytest.mark.parametrize("use_reentrant", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_lora_llama_layer_traced_into_keeps_its_gradient_checkpointing(use_reentrant):
    """Layer 0 reads cacheable embeddings, so it is traced into (its layer norm and frozen
    projections go to stage 1): its checkpoint region is many modules and ops, checkpointed
    as one region module. Layer 1 stays a module that checkpoints itself, as in eager."""
    model = CausalLMStep(_lora_llama(use_reentrant=use_reentrant))
    plain = CausalLMStep(_lora_llama(use_reentrant=use_reentrant, checkpointing=False))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    args = (ids, torch.ones(2, 8, dtype=torch.long))
    split = assert_checkpointed_as_eager(model, plain, args, regions=2, exact_saved=False)
    assert "lm_model_layers_0_input_layernorm" in split.boundary
    region = split.stage2.checkpointed_0.code
    assert "self_attn.q_proj.lora_A.default(" in region and ".mlp(" in region
    assert "scaled_dot_product_attention(" in region
