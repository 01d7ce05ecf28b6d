"""Conformance: peft adapters and TRL SFT steps the other conformance files do not cover.

- peft prompt tuning and prefix tuning (``get_peft_model`` with ``PromptTuningConfig`` /
  ``PrefixTuningConfig``): trainable virtual tokens enter a frozen GPT-2 / Llama, so nothing
  after the token embedding may be cached;
- LoRA on a seq2seq T5's decoder (``task_type="SEQ_2_SEQ_LM"``): the labels are shifted into
  decoder inputs inside the model, the frozen encoder is cached;
- a LoRA Llama as ``Trainer.compute_loss`` calls it (``model(**inputs).loss``, ``use_cache``
  left at its default, so every layer is handed a ``DynamicCache``);
- LoRA Llama with ``gradient_checkpointing_enable()`` (reentrant and not) and
  ``enable_input_require_grads()``, as peft's ``prepare_model_for_kbit_training`` sets it up;
- TRL SFT, padding-free (``DataCollatorForLanguageModeling(padding_free=True)``: the samples
  packed into one row, ``position_ids`` restarting per sample, no attention mask) with
  ``SFTTrainer.compute_loss``'s fused LM head (a custom ``autograd.Function``).

Each is verified bit for bit and trained from its cache after an optimizer step
(:func:`~tests.conformance.test_unseen_lm.assert_trains_from_its_cache`).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphsplit
from tests.conformance.matrix import ids_and_mask
from tests.conformance.test_unseen_lm import assert_trains_from_its_cache, stage2_paths
from tests.helpers import split_and_verify, tiny_llama_config

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
trl_utils = pytest.importorskip("trl.trainer.utils")
trl_sft = pytest.importorskip("trl.trainer.sft_trainer")

VOCAB = 64


def _causal_batch(size: int, tokens: int = 8, seed: int = 0) -> tuple[torch.Tensor, ...]:
    ids, mask = ids_and_mask(size, tokens=tokens, seed=seed)
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _random_lora_b(model: nn.Module) -> nn.Module:
    """``lora_B`` starts at zero; random values give ``lora_A`` a gradient to compare too."""
    generator = torch.Generator().manual_seed(5)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data = torch.randn(param.shape, generator=generator) * 0.02
    return model


def _lora(**overrides) -> peft.LoraConfig:
    settings = {
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["q_proj", "v_proj"],
        "init_lora_weights": "gaussian",
    }
    return peft.LoraConfig(**{**settings, **overrides})


class CausalLanguageModelling(nn.Module):
    """``Trainer.compute_loss``: ``model(**inputs).loss``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, labels):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss


# --- prompt learning ------------------------------------------------------------------------


def _prompt_tuned_gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=32
    )
    prompt = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    model = peft.get_peft_model(transformers.GPT2LMHeadModel(config), prompt)
    return model.train()  # GPT-2's dropout (p=0.1) is live, as under the Trainer


@pytest.mark.parametrize("size", [2, 3])
def test_prompt_tuning_caches_only_the_token_embedding(size, tmp_path):
    torch.manual_seed(0)
    step = CausalLanguageModelling(_prompt_tuned_gpt2())
    batch = _causal_batch(size)
    split = split_and_verify(step, batch)
    # The frozen lookup of the real tokens is cached; the virtual tokens, the concatenation,
    # the dropout behind it and every transformer block run in stage 2.
    floats = {key: spec for key, spec in split.boundary.items() if spec.dtype.is_floating_point}
    features = {key: spec.shape for key, spec in floats.items()}
    assert features.pop("model_base_model_transformer_wte") == (size, 8, 32)
    assert all(shape[1:] == (8 + 4,) for shape in features.values())  # the attention mask
    held = stage2_paths(split)
    assert {"model.prompt_encoder.default", "model.base_model.transformer.h.0"} <= held
    assert "aten.bernoulli_" in split.report()  # the dropout draws stay in stage 2
    assert_trains_from_its_cache(step, split, [batch, _causal_batch(size, seed=1)], tmp_path)


def test_prefix_tuning_caches_only_work_the_virtual_tokens_do_not_reach():
    """Prefix tuning hands each layer a ``DynamicCache`` already holding the trainable
    prefix's keys and values (``past_key_values``); the layers append the real tokens' keys.
    The first layer's frozen key/value projections of the real tokens are cached; attention,
    which reads the prefix, and everything after it run in stage 2."""
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(tiny_llama_config())
    prefix = peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    step = CausalLanguageModelling(peft.get_peft_model(base, prefix))
    batch = _causal_batch(2)
    split = split_and_verify(step, batch)
    assert "model_base_model_model_embed_tokens" in split.boundary
    assert not any("kept" in note for note in split.notes)
    held = stage2_paths(split)
    assert {"model.prompt_encoder.default", "model.base_model.model.layers.1"} <= held
    assert_trains_from_its_cache(step, split, [batch, _causal_batch(2, seed=1)])


# --- seq2seq LoRA ----------------------------------------------------------------------------


class Seq2SeqDecoderLoRA(nn.Module):
    """``Seq2SeqTrainer`` on a T5 whose decoder has LoRA: the model shifts ``labels`` into
    ``decoder_input_ids`` itself (``_shift_right``, ``masked_fill_`` of -100 with the pad)."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.T5Config(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=2,
            decoder_start_token_id=0,
            pad_token_id=0,
            dropout_rate=0.0,  # a live dropout in the encoder would keep it in stage 2
        )
        model = transformers.T5ForConditionalGeneration(config).train()
        lora = _lora(task_type="SEQ_2_SEQ_LM", target_modules=r".*decoder.*\.(q|v)")
        self.model = _random_lora_b(peft.get_peft_model(model, lora))

    def forward(self, input_ids, attention_mask, labels):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss


def _seq2seq_batch(size: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    ids, mask = ids_and_mask(size, seed=seed)
    targets, target_mask = ids_and_mask(size, tokens=5, seed=seed + 10, pad=2)
    return ids, mask, targets.masked_fill(target_mask == 0, -100)


@pytest.mark.parametrize("size", [2, 3])
def test_t5_decoder_lora_caches_the_encoder(size, tmp_path):
    torch.manual_seed(0)
    step = Seq2SeqDecoderLoRA()
    batch = _seq2seq_batch(size)
    split = split_and_verify(step, batch)
    held = stage2_paths(split)
    assert "model.base_model.model.decoder" in held
    assert not {path for path in held if ".encoder" in path}
    assert (size, 8, 32) in {spec.shape for spec in split.boundary.values()}  # encoder states
    # use_cache defaults to True in training: the decoder builds an EncoderDecoderCache and
    # hands it to every layer; those calls are traced through, so the decoder's frozen
    # embedding lookup is cached too.
    assert "model_base_model_model_decoder_embed_tokens" in split.boundary
    assert not any("kept" in note for note in split.notes)
    assert_trains_from_its_cache(step, split, [batch, _seq2seq_batch(size, seed=1)], tmp_path)


def test_lora_llama_with_the_default_use_cache_caches_the_frozen_work(tmp_path):
    """Before, the ``DynamicCache`` handed to each layer made fx refuse the layer calls, and
    the whole Llama stayed one stage-2 call: nothing but the token ids was cached."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config())
    lora = _random_lora_b(peft.get_peft_model(model, _lora(task_type="CAUSAL_LM")))
    step = CausalLanguageModelling(lora)
    batch = _causal_batch(2)
    split = split_and_verify(step, batch)
    assert "model_base_model_model_model_embed_tokens" in split.boundary
    assert "model.base_model.model.model.embed_tokens" not in stage2_paths(split)
    assert not any("kept" in note for note in split.notes)
    assert_trains_from_its_cache(step, split, [batch, _causal_batch(2, seed=1)], tmp_path)


# --- gradient checkpointing -----------------------------------------------------------------


@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_with_input_require_grads(reentrant):
    """peft's k-bit recipe: checkpointing on, ``enable_input_require_grads()`` (a forward hook
    that makes the frozen embedding's output require grad, which reentrant checkpointing needs
    to give the LoRA weights any gradient), then LoRA."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config())
    model.gradient_checkpointing_enable({"use_reentrant": reentrant})
    model.enable_input_require_grads()
    lora = _random_lora_b(peft.get_peft_model(model, _lora(task_type="CAUSAL_LM")))
    step = CausalLanguageModelling(lora)
    step.train()
    batch = _causal_batch(2)
    split = split_and_verify(step, batch)
    assert "model_base_model_model_model_embed_tokens" in split.boundary
    assert "checkpoint" in split.stage2.code
    step(*batch).backward()
    lora = [(n, p) for n, p in step.named_parameters() if p.requires_grad]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for _, p in lora)
    step.zero_grad()
    assert_trains_from_its_cache(step, split, [batch, _causal_batch(2, seed=1)])


# --- TRL SFT, padding-free, fused LM head ----------------------------------------------------


class PaddingFreeSFT(nn.Module):
    """``SFTTrainer.compute_loss`` (loss_type="nll"): ``use_cache=False``, the fused LM head
    that ``SFTTrainer`` patches onto the model before peft wraps it."""

    def __init__(self) -> None:
        super().__init__()
        model = transformers.LlamaForCausalLM(tiny_llama_config())
        trl_utils.add_fused_lm_head(model, outputs=("log_probs", "entropy"))
        self.model = _random_lora_b(peft.get_peft_model(model, _lora(task_type="CAUSAL_LM")))

    def forward(self, input_ids, position_ids, labels):
        inputs = {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}
        inputs["use_cache"] = False
        outputs = self.model(**inputs, fused_lm_head=True)
        per_token_loss = -outputs.log_probs  # zero on ignored positions
        num_tokens = outputs.label_mask.sum()
        return per_token_loss.sum() / torch.as_tensor(num_tokens).clamp(min=1)


def _padding_free(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    collator = trl_sft.DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    examples = [
        {"input_ids": torch.randint(1, VOCAB, (n,), generator=generator).tolist()} for n in lengths
    ]
    batch = collator(examples)
    return batch["input_ids"], batch["position_ids"], batch["labels"]


def test_padding_free_sft_with_the_fused_lm_head_caches_the_embedding(tmp_path):
    torch.manual_seed(0)
    step = PaddingFreeSFT()
    packed = _padding_free([5, 3, 4])
    assert packed[1].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]]
    split = split_and_verify(step, packed)
    # Traced into: the LoRA'd model is no longer one stage-2 call (the kernel's apply is a node).
    assert "model_base_model_model_model_embed_tokens" in split.boundary
    assert "ChunkedLogProbFunction_apply(" in split.stage2.code
    # One sample, no packing: transformers' eager run skips the packed-sequence mask then.
    single = _padding_free([9], seed=1)
    assert all(c.ok for c in graphsplit.verify(step, split, single))
    assert_trains_from_its_cache(step, split, [packed, single], tmp_path)


class PaddedSFT(nn.Module):
    """``SFTTrainer.compute_loss`` on padded batches (the collator's default): the same fused
    LM head, with an attention mask."""

    def __init__(self) -> None:
        super().__init__()
        model = transformers.LlamaForCausalLM(tiny_llama_config())
        trl_utils.add_fused_lm_head(model, outputs=("log_probs", "entropy"))
        self.model = _random_lora_b(peft.get_peft_model(model, _lora(task_type="CAUSAL_LM")))

    def forward(self, input_ids, attention_mask, labels):
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
        inputs["use_cache"] = False
        outputs = self.model(**inputs, fused_lm_head=True)
        per_token_loss = -outputs.log_probs
        num_tokens = outputs.label_mask.sum()
        return per_token_loss.sum() / torch.as_tensor(num_tokens).clamp(min=1)


def _padded(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    collator = trl_sft.DataCollatorForLanguageModeling(pad_token_id=0)
    examples = [
        {"input_ids": torch.randint(1, VOCAB, (n,), generator=generator).tolist()} for n in lengths
    ]
    batch = collator(examples)
    return batch["input_ids"], batch["attention_mask"], batch["labels"]


def test_padded_sft_batches_of_two_lengths_cache_under_one_plan(tmp_path):
    """Llama's ``position_ids``, rotary tables and mask indices are per-dataset constants made
    from the length; stage 2 builds them itself from the cached embeddings' length, so one plan
    serves both lengths (planning/cut/sized_constants.py)."""
    torch.manual_seed(0)
    step = PaddedSFT()
    short, long = _padded([6, 4]), _padded([9, 11], seed=1)
    split = split_and_verify(step, short)
    assert not any(spec.is_constant for spec in split.boundary.values())
    assert all(c.ok for c in graphsplit.verify(step, split, long))
    assert len(split.plans) == 1
    assert_trains_from_its_cache(step, split, [short, long], tmp_path / "cache")
