"""Conformance: a PEFT LoRA Qwen2 (sliding window off and on), dynamic padding, many lengths.

The sized-constant change (graphsplit/planning/cut/sized_constants.py) lets stage 2 recompute
the rotary ``cos`` / ``sin``, the position ids and the mask pieces made from the padded length,
so one plan serves every length. Tested on Llama; here on Qwen2, whose mask builder also makes
a sliding-window mask when ``use_sliding_window=True`` (``layer_types`` then hold
``"sliding_attention"`` layers). Also under a bfloat16 autocast (``--bf16``).

Step: the Trainer's ``compute_loss`` body ``model(**inputs).loss``. Batches:
``DataCollatorForLanguageModeling(tokenizer, mlm=False)`` padding each to its longest row.
Tiny config: 32 wide, 2 layers, 2 heads (1 KV head), window 4.
"""

from __future__ import annotations

import pytest
import torch

import graphsplit

pytest.importorskip("transformers")
pytest.importorskip("peft")

from peft import LoraConfig, get_peft_model
from transformers import DataCollatorForLanguageModeling, Qwen2Config, Qwen2ForCausalLM

from tests.conformance.unseen14_d_checks import (
    check_cache_and_loader,
    check_lengths,
    lm_batch,
    run_causal_lm,
    signatures,
)
from tests.conformance.unseen_checks import word_tokenizer
from tests.helpers import assert_stage1_holds_no_trainable

WORDS = [f"w{i}" for i in range(40)]
VOCAB = len(WORDS) + 3
LENGTHS = (9, 6, 11, 7, 13, 5)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(sliding: bool):
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        use_sliding_window=sliding,
        sliding_window=4 if sliding else None,
        max_window_layers=1 if sliding else 2,
        pad_token_id=0,
    )
    model = Qwen2ForCausalLM(config)
    if sliding:
        assert "sliding_attention" in model.config.layer_types
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=["q_proj", "v_proj"],
        task_type="CAUSAL_LM",
        init_lora_weights="gaussian",
    )
    model = get_peft_model(model, lora)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    model.train()
    return model


@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding-window"])
def test_lora_qwen2_one_plan_for_every_padded_length(tmp_path, sliding):
    model = _model(sliding)
    collator = DataCollatorForLanguageModeling(word_tokenizer(WORDS), mlm=False)

    def compute_loss(inputs):
        return model(**inputs).loss

    batches = [lm_batch(collator, length, vocab=VOCAB) for length in LENGTHS]
    split = graphsplit.split(compute_loss, (batches[0],))
    assert split.path == "trace"
    assert_stage1_holds_no_trainable(split)
    plans = check_lengths(split, compute_loss, batches)
    assert plans == 1, signatures(split)
    params = [p for p in model.parameters() if p.requires_grad]
    check_cache_and_loader(split, compute_loss, batches, tmp_path / "cache", params)
    assert len(split.plans) == 1, signatures(split)


def test_lora_qwen2_under_an_outer_bf16_autocast_verifies_at_every_length(tmp_path):
    """``--bf16`` by hand: the split, the stages and the eager step all run inside one
    ``torch.autocast("cpu", dtype=torch.bfloat16)``, exact at every length.

    It used to take the trace path and verify with LoRA gradients ~1e-6 off: peft's LoRA
    layer reads ``torch_result_dtype = result.dtype`` of its base layer's output, and the
    trace held the analysis's float32 (the analysis cannot apply an autocast) where the run
    has bfloat16, so stage 2 summed two gradients in float32 where eager rounds each to
    bfloat16. The trace is now refused where a dtype it read differs in the real run
    (planning/cut/ambient_dtypes.refuse_read_dtypes), and the module-level path is exact."""
    model = _model(sliding=True)
    collator = DataCollatorForLanguageModeling(word_tokenizer(WORDS), mlm=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        split = run_causal_lm(model, collator, LENGTHS, tmp_path / "cache", vocab=VOCAB)
    assert split.path == "calls"
    assert "The step reads the dtype of a tensor the autocast around" in split.reason
    assert "q_proj_base_layer" in split.reason


def test_lora_qwen2_with_the_autocast_inside_the_step_verifies_at_every_length():
    """accelerate's way: the autocast inside the forward. The default path is then the calls
    path (no plans); exact at every length."""
    model = _model(sliding=True)
    collator = DataCollatorForLanguageModeling(word_tokenizer(WORDS), mlm=False)

    def compute_loss(inputs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(**inputs).loss

    batches = [lm_batch(collator, length, vocab=VOCAB) for length in LENGTHS]
    split = graphsplit.split(compute_loss, (batches[0],))
    assert split.path == "calls"
    check_lengths(split, compute_loss, batches)
