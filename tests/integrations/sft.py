"""SFT with a frozen teacher: a ``trl.SFTTrainer`` subclass on tiny random Llamas, shared by tests.

TRL's SFT collator pads each batch to its longest; ``pad_to_multiple_of=LENGTH`` (every text is
at most ``LENGTH`` tokens) pads every sample to ``LENGTH`` instead, so a sample has one shape in
any batch, as the cache needs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from datasets import Dataset
from trl import SFTConfig, SFTTrainer

from tests.integrations.dpo import word_tokenizer
from tests.integrations.kd import LENGTH, VOCAB, tiny_llama


def texts(count: int, seed: int = 0) -> Dataset:
    """``count`` texts of 3 to 7 words (the collator adds nothing; the tokenizer adds EOS)."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for index in range(count):
        ids = torch.randint(2, VOCAB, (3 + index % 5,), generator=generator).tolist()
        rows.append({"text": " ".join(f"t{i}" for i in ids)})
    return Dataset.from_list(rows)


class TeacherSFTTrainer(SFTTrainer):
    """SFT's next-token loss plus a KL to a frozen teacher on the real (unpadded) positions."""

    def __init__(self, *args: Any, teacher: torch.nn.Module, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.teacher = teacher.eval().requires_grad_(False)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        with torch.no_grad():
            teacher_logits = self.teacher(
                input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]
            ).logits
        outputs = model(
            input_ids=inputs["input_ids"],
            attention_mask=inputs["attention_mask"],
            labels=inputs["labels"],
        )
        real = inputs["attention_mask"].unsqueeze(-1).to(teacher_logits.dtype)
        distill = (
            F.kl_div(
                F.log_softmax(outputs.logits, dim=-1),
                F.log_softmax(teacher_logits, dim=-1),
                log_target=True,
                reduction="none",
            )
            * real
        ).sum() / real.sum()
        loss = 0.5 * outputs.loss + 0.5 * distill
        return (loss, outputs) if return_outputs else loss


def make_sft_trainer(output_dir: str, data: Dataset, **arguments: Any) -> TeacherSFTTrainer:
    settings = {
        "per_device_train_batch_size": 4,
        "num_train_epochs": 2,
        "logging_steps": 1,
        "seed": 7,
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "disable_tqdm": True,
        "max_length": LENGTH,
        "pad_to_multiple_of": LENGTH,
        **arguments,
    }
    return TeacherSFTTrainer(
        model=tiny_llama(1, 16),
        args=SFTConfig(output_dir=output_dir, **settings),
        train_dataset=data,
        processing_class=word_tokenizer(),
        teacher=tiny_llama(2, 32),
    )
