"""Conformance: TRL's ``SFTTrainer``, a LoRA ``peft_config``, ``SFTConfig`` defaults, split_trainer.

Upstream: TRL 1.16's ``SFTTrainer`` (trl/trainer/sft_trainer.py), unchanged, as its PEFT docs
build it: ``SFTTrainer(model=model, args=SFTConfig(...), train_dataset=dataset,
processing_class=tokenizer, peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj",
"v_proj"], task_type="CAUSAL_LM"))`` on a text-only prompt-completion dataset, so
``completion_only_loss`` (the default) masks the prompt. ``SFTConfig``'s own defaults are kept:
``bf16=True`` (``train()`` has accelerate wrap the PEFT model's forward in a bfloat16
autocast) and ``gradient_checkpointing=True``. ``compute_loss`` is TRL's
(``fused_lm_head=True``, entropy / token accuracy / ``num_tokens`` metrics).

What must hold: after ``split_trainer(trainer, folder)``, ``trainer.train()`` logs the plain
trainer's losses and grad norms (the plain run on the same batches,
``batch_by_padded_length``) and ends with its weights, bit for bit; the frozen token
embedding is cached and stage 2 holds no ``embed_tokens`` weight; the cache holds one row per
sample.

Tiny config: Qwen2 16 wide, 1 layer, a word-level tokenizer of 64 ids
(tests/integrations/dpo.py's), 12 prompt-completion pairs.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("peft")

from accelerate.state import AcceleratorState
from datasets import Dataset
from peft import LoraConfig
from trl import SFTConfig, SFTTrainer

from graphsplit.integrations.transformers import (
    batch_by_padded_length,
    split_trainer,
)
from tests.integrations.dpo import VOCAB, tiny_qwen2, word_tokenizer


@pytest.fixture(autouse=True)
def _one_thread_and_fresh_accelerate_state():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    torch.set_num_threads(threads)


def _dataset() -> Dataset:
    generator = torch.Generator().manual_seed(0)

    def words(n: int) -> str:
        ids = torch.randint(2, VOCAB, (n,), generator=generator).tolist()
        return " ".join(f"t{i}" for i in ids)

    return Dataset.from_list(
        [{"prompt": words(3 + i % 2), "completion": " " + words(2 + i % 2)} for i in range(12)]
    )


def _trainer(output_dir: str) -> SFTTrainer:
    args = SFTConfig(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        num_train_epochs=1,
        learning_rate=1e-2,
        seed=42,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    peft_config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
    )
    return SFTTrainer(
        model=tiny_qwen2(1),
        args=args,
        train_dataset=_dataset(),
        processing_class=word_tokenizer(),
        peft_config=peft_config,
    )


def _logged(trainer, *keys):
    return [tuple(e[k] for k in keys) for e in trainer.state.log_history if "loss" in e]


def test_split_trainer_trains_as_the_plain_sft_trainer_with_lora(tmp_path):
    plain = _trainer(str(tmp_path / "plain"))
    assert plain.args.bf16 and plain.args.gradient_checkpointing  # SFTConfig's defaults
    assert plain.accelerator.native_amp
    batch_by_padded_length(plain)  # the split run's batches
    plain.train()
    trainer = _trainer(str(tmp_path / "split"))
    parts = split_trainer(trainer, str(tmp_path / "cache"))
    trainer.train()
    boundary = parts.split.boundary
    assert [key for key in boundary if "embed_tokens" in key], list(boundary)
    assert not [k for k, _ in parts.split.stage2.named_parameters() if "embed_tokens" in k]
    assert len(_logged(trainer, "loss")) == len(_logged(plain, "loss")) >= 4
    assert _logged(trainer, "loss", "grad_norm") == _logged(plain, "loss", "grad_norm")
    one, other = plain.model.state_dict(), trainer.model.state_dict()
    assert one.keys() == other.keys() and all(torch.equal(one[k], other[k]) for k in one)
    assert parts.cached is not None and len(parts.cached) >= len(trainer.train_dataset)
