"""Conformance: PEFT LoRA on rotary causal LMs other than Llama, dynamic padding, many lengths.

The sized-constant change (graphsplit/planning/cut/sized_constants.py) lets stage 2 recompute
the constants a whole-step trace makes from the padded length (rotary ``cos`` / ``sin``,
position ids, causal and sliding-window mask pieces): one plan serves every length. It was
tested on Llama. Here:

- Mistral with ``sliding_window`` set (every layer a sliding-window layer);
- Gemma (embeddings scaled by ``sqrt(hidden_size)``, a ``normalizer`` made in the forward);
- Gemma2 (that scaling, sliding and full layers alternating, attention and final logit
  soft-capping);
- Phi3 (fused ``qkv_proj``, ``partial_rotary_factor=0.5``);
- GPT-NeoX (fused ``query_key_value``, ``rotary_pct=0.5``).

Step: the Trainer's ``compute_loss`` body ``model(**inputs).loss``. Batches: six padded lengths,
``DataCollatorForLanguageModeling(tokenizer, mlm=False)`` padding each to its longest row
(labels ``-100`` on padding). For each: the default path is the trace, one plan after stage 1
saw all six lengths, ``verify`` exact at each length, a cache of all six read back and stage 2
on ``cached.loader(batch_size=2, seed=0)`` batches exact against the eager step on the same
samples. Tiny configs: 32 wide, 2 layers, 2 heads, window 4.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

import transformers
from transformers import DataCollatorForLanguageModeling

from tests.conformance.unseen14_d_checks import lora, run_causal_lm, signatures
from tests.conformance.unseen_checks import word_tokenizer

WORDS = [f"w{i}" for i in range(40)]
VOCAB = len(WORDS) + 3
LENGTHS = (9, 6, 11, 7, 13, 5)
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
}


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _mistral():
    config = transformers.MistralConfig(**COMMON, num_key_value_heads=1, sliding_window=4)
    return transformers.MistralForCausalLM(config), ["q_proj", "v_proj"]


def _gemma():
    config = transformers.GemmaConfig(**COMMON, num_key_value_heads=1, head_dim=16)
    return transformers.GemmaForCausalLM(config), ["q_proj", "v_proj"]


def _gemma2():
    config = transformers.Gemma2Config(
        **COMMON,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=4,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    )
    assert "sliding_attention" in config.layer_types
    return transformers.Gemma2ForCausalLM(config), ["q_proj", "v_proj"]


def _phi3():
    config = transformers.Phi3Config(**COMMON, num_key_value_heads=1, partial_rotary_factor=0.5)
    return transformers.Phi3ForCausalLM(config), ["qkv_proj", "o_proj"]


def _neox():
    config = transformers.GPTNeoXConfig(**COMMON, rotary_pct=0.5)
    return transformers.GPTNeoXForCausalLM(config), ["query_key_value"]


@pytest.mark.parametrize(
    "build",
    [_mistral, _gemma, _gemma2, _phi3, _neox],
    ids=["mistral-sliding", "gemma", "gemma2-softcap", "phi3-partial-rotary", "gpt-neox"],
)
def test_lora_rotary_lm_one_plan_for_every_padded_length(tmp_path, build):
    torch.manual_seed(0)
    model, targets = build()
    model = lora(model, targets)
    collator = DataCollatorForLanguageModeling(word_tokenizer(WORDS), mlm=False)
    split = run_causal_lm(model, collator, LENGTHS, tmp_path / "cache", vocab=VOCAB)
    assert split.path == "trace"
    assert len(split.plans) == 1, signatures(split)
