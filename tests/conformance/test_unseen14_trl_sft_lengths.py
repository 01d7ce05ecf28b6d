"""Conformance: TRL's ``SFTTrainer`` with a LoRA, fp32, dynamic padding at many lengths.

``SFTConfig(bf16=False, gradient_checkpointing=False)`` (no autocast). The default path
is still the calls path here (not the whole-step trace), so no plan count is pinned. Plain-text
rows of six token counts: the collator pads each batch to its longest, so the padded length
varies batch to batch. After ``split_trainer(trainer, folder)``, ``trainer.train()`` logs the
plain trainer's losses and grad norms bit for bit and ends with its weights, the plain trainer
given the same batches of one padded length by ``batch_by_padded_length`` (split_trainer batches
samples of one padded length, so a cached row keeps the padding it was computed with).
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

from graphsplit.integrations.transformers import batch_by_padded_length, split_trainer
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

    return Dataset.from_list([{"text": words(3 + (5 * i) % 7)} for i in range(12)])


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
        bf16=False,
        gradient_checkpointing=False,
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


def test_split_sft_trainer_trains_as_the_plain_one_at_many_lengths(tmp_path):
    """split_trainer batches samples of one padded length (the collator pads each batch to its
    longest, so a cached row keeps its padding only among rows of its length): the plain
    trainer gets the same batches from batch_by_padded_length, as docs/howto.md says."""
    plain = _trainer(str(tmp_path / "plain"))
    batch_by_padded_length(plain)
    plain.train()
    trainer = _trainer(str(tmp_path / "split"))
    parts = split_trainer(trainer, str(tmp_path / "cache"))
    trainer.train()
    assert parts.split.path == "calls"  # SFTTrainer.compute_loss is not traced whole
    assert len(_logged(trainer, "loss")) == len(_logged(plain, "loss")) == 7  # 7 groups of a length
    assert _logged(trainer, "loss", "grad_norm") == _logged(plain, "loss", "grad_norm")
    one, other = plain.model.state_dict(), trainer.model.state_dict()
    assert all(torch.equal(one[k], other[k]) for k in one)
