"""Conformance: PEFT DoRA (``LoraConfig(use_dora=True)``) on a causal LM, Trainer and by hand.

Upstream: huggingface/peft ``src/peft/tuners/lora/dora.py`` (``DoraLinearLayer.forward``) and
``src/peft/tuners/lora/layer.py`` (``Linear.forward``'s DoRA branch), trained with
huggingface/transformers ``src/transformers/trainer.py``'s stock ``Trainer.compute_loss``
(``outputs = model(**inputs)``; ``loss = outputs["loss"] if isinstance(outputs, dict) else
outputs[0]``, copied below as the step). PEFT's DoRA docs (``docs/source/developer_guides/
lora.md``, "Weight-Decomposed Low-Rank Adaptation") enable it with ``LoraConfig(use_dora=True)``.

Every forward of a DoRA layer recomputes, from the frozen base weight and the trainable LoRA
matrices, ``weight_norm = ||W + scaling * B @ A||`` (per output row, ``.detach()``-ed as the
paper's section 4.3 asks) and scales the frozen base output ``base_layer(x)`` by the trainable
``magnitude / weight_norm``. So:

- the norm depends on trainable parameters (``lora_B(lora_A(eye))``) even though it is
  detached: it must never be cached (a stale norm trains differently, silently);
- ``base_layer(x)`` of the first layer's projections depends only on the input ids and frozen
  weights (embedding, RMSNorm, base ``q/k/v_proj``): cacheable;
- ``DoraLinearLayer`` keeps a Python-side ``_dora_cache`` that it fills only in eval mode with
  ``ENABLE_DORA_CACHING``; in training it clears it every call.

The magnitude vectors start as the norm itself (so ``magnitude / weight_norm == 1``); LoRA B
starts at zero. Both are moved off their initial values so every gradient flows and the norm
is not the trivial one. Batches: ``run_clm.py``'s fixed blocks (``labels`` a copy of
``input_ids``) through ``default_data_collator``.

Tiny config: Llama 32 wide, 2 layers, 2 heads (1 KV head), 64 tokens, blocks of 8.
"""

from __future__ import annotations

import pytest
import torch

import graphsplit

pytest.importorskip("transformers")
pytest.importorskip("peft")

from accelerate.state import AcceleratorState
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import (
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
    default_data_collator,
)

from graphsplit.integrations.transformers import split_trainer
from tests.conformance.unseen2_data_checks import assert_cache_round_trip
from tests.helpers import assert_stage1_holds_no_trainable, tiny_llama_config

VOCAB = 64
block_size = 8


@pytest.fixture(autouse=True)
def _one_thread_and_fresh_accelerate_state():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    torch.set_num_threads(threads)


def _dora_model():
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(vocab_size=VOCAB))
    peft_config = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        use_dora=True,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, peft_config)
    with torch.no_grad():  # B starts at zero, magnitude at the norm: move both
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
            if "lora_magnitude_vector" in name:
                param.mul_(1.0 + 0.1 * torch.randn_like(param))
    return model


def _train_dataset(size: int = 16, seed: int = 0) -> Dataset:
    """``run_clm.py``'s ``group_texts`` output: blocks of ``block_size`` tokens, labels a copy."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (size, block_size), generator=generator).tolist()
    return Dataset.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": [[1] * block_size] * size,
            "labels": [list(row) for row in input_ids],
        }
    )


def _batch(size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    rows = _train_dataset(size, seed)
    return default_data_collator([rows[i] for i in range(size)])


_BUILT: dict[str, tuple] = {}


def _by_hand():
    if "hand" not in _BUILT:
        model = _dora_model()
        model.train()  # Trainer.train() -> model.train() before the loop

        def compute_loss(inputs):  # Trainer.compute_loss, its plain branch
            outputs = model(**inputs)
            # We don't use .loss here since the model may return tuples instead of ModelOutput.
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
            return loss

        split = graphsplit.split(compute_loss, (_batch(4),))
        params = [p for p in model.parameters() if p.requires_grad]
        _BUILT["hand"] = (model, compute_loss, split, params)
    return _BUILT["hand"]


def test_dora_by_hand_verifies_on_the_example_and_another_size():
    _model, step, split, _params = _by_hand()
    assert any("lora_magnitude_vector" in n for n in split.trainable)
    assert_stage1_holds_no_trainable(split)
    for seed, batch in enumerate([_batch(4), _batch(3, seed=1)]):
        checks = graphsplit.verify(step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


def test_dora_caches_frozen_work_and_never_the_norm():
    """Stage 1 caches frozen work only (no value that reads a LoRA or magnitude weight); stage 2
    still reads every base weight the norm needs, and holds no embedding table (its lookup is
    frozen work before any adapter)."""
    model, step, split, params = _by_hand()
    boundary = split.stage1(**_batch(4))
    assert boundary, "nothing cached"
    # the first layer's frozen base projections are cached; nothing of the second layer is
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert any(k.endswith(f"layers_0_self_attn_{proj}_base_layer") for k in boundary), list(
            boundary
        )
    assert not [k for k in boundary if "layers_1" in k or "lora" in k], list(boundary)
    held = {name for name, _ in split.stage2.named_parameters()}
    assert not [n for n in held if "embed_tokens" in n], sorted(held)
    # the norm ||W + s B A|| needs W of every DoRA layer every step: stage 2 must hold them
    for name, module in model.named_modules():
        if hasattr(module, "lora_magnitude_vector") and module.lora_magnitude_vector:
            base = f"{name}.base_layer.weight"
            assert any(h.endswith(base.split("model.", 1)[-1]) for h in held), (base, held)
    # a stale norm must not survive a weight update: train one step on stage 2, then compare
    # stage 2 on the cached boundary against the unsplit step with the new weights
    optimizer = torch.optim.SGD(params, lr=0.5)
    cached = split.stage1(**_batch(4, seed=5))
    torch.manual_seed(0)
    split.stage2(**cached).backward()
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        assert torch.equal(split.stage2(**cached), step(_batch(4, seed=5)))


def test_dora_by_hand_cache_round_trip(tmp_path):
    _model, step, split, params = _by_hand()
    loader = [_batch(4, seed=2), _batch(4, seed=3), _batch(2, seed=4)]
    assert_cache_round_trip(split, step, loader, tmp_path / "cache", params)


def _trainer(output_dir: str) -> Trainer:
    training_args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        num_train_epochs=2,
        learning_rate=1e-2,
        logging_steps=1,
        seed=3,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )
    return Trainer(
        model=_dora_model(),
        args=training_args,
        train_dataset=_train_dataset(),
        data_collator=default_data_collator,
    )


def _logged(trainer, *keys):
    return [tuple(e[k] for k in keys) for e in trainer.state.log_history if "loss" in e]


@pytest.mark.parametrize("live", [False, True], ids=["cached-first", "cache-while-training"])
def test_split_trainer_with_dora_trains_as_the_plain_trainer(tmp_path, live):
    plain = _trainer(str(tmp_path / "plain"))
    plain.train()
    trainer = _trainer(str(tmp_path / "split"))
    parts = split_trainer(trainer, str(tmp_path / "cache"), cache_while_training=live)
    held = {name for name, _ in parts.split.stage2.named_parameters()}
    assert not [n for n in held if "embed_tokens" in n], sorted(held)
    trainer.train()
    assert len(_logged(trainer, "loss")) == len(_logged(plain, "loss")) == 8
    assert _logged(trainer, "loss", "grad_norm") == _logged(plain, "loss", "grad_norm")
    one, other = plain.model.state_dict(), trainer.model.state_dict()
    assert all(torch.equal(one[k], other[k]) for k in one)
    if not live:
        assert parts.cached is not None and len(parts.cached) == len(trainer.train_dataset)
