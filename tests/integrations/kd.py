"""A knowledge-distillation ``Trainer`` subclass on tiny random Llamas, shared by the tests.

The student and teacher are ``LlamaForCausalLM`` from tiny configs (random weights, no hub);
the dataset is pre-padded to one length (variable real lengths, right padding, ``-100`` labels
on padding), so every sample has one shape in any batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

VOCAB = 64
LENGTH = 10


def tiny_llama(seed: int, hidden: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(config)


def padded_samples(count: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``count`` samples of 4 to 8 real tokens, right-padded to ``LENGTH``."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for index in range(count):
        real = 4 + index % 5
        input_ids = torch.randint(1, VOCAB, (LENGTH,), generator=generator)
        attention_mask = torch.ones(LENGTH, dtype=torch.long)
        attention_mask[real:] = 0
        labels = input_ids.clone()
        labels[real:] = -100
        samples.append({"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels})
    return samples


class DistillationTrainer(Trainer):
    """The user's trainer: a frozen teacher, called with the labels too, inside compute_loss."""

    def __init__(self, *args: Any, teacher: torch.nn.Module, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.teacher = teacher.eval().requires_grad_(False)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        with torch.no_grad():
            teacher_logits = self.teacher(**inputs).logits  # its .loss is computed and unused
        outputs = model(**inputs)
        distill = F.kl_div(
            F.log_softmax(outputs.logits, dim=-1),
            F.log_softmax(teacher_logits, dim=-1),
            log_target=True,
            reduction="batchmean",
        )
        loss = 0.5 * outputs.loss + 0.5 * distill
        return (loss, outputs) if return_outputs else loss


def make_trainer(output_dir: str, samples: list[dict], **arguments: Any) -> DistillationTrainer:
    settings = {
        "per_device_train_batch_size": 4,
        "num_train_epochs": 2,
        "logging_steps": 1,
        "seed": 7,
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "disable_tqdm": True,
        **arguments,
    }
    return DistillationTrainer(
        model=tiny_llama(1, 16),
        args=TrainingArguments(output_dir=output_dir, **settings),
        train_dataset=samples,
        teacher=tiny_llama(2, 32),
    )


def logged_losses(trainer: Trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def unpadded_samples(lengths: list[int], seed: int = 0) -> list[dict[str, list[int]]]:
    """One unpadded sample per length (token ids 2..63); a collator pads them."""
    generator = torch.Generator().manual_seed(seed)
    return [
        {
            "input_ids": torch.randint(2, VOCAB, (length,), generator=generator).tolist(),
            "attention_mask": [1] * length,
        }
        for length in lengths
    ]


class PaddedDistillationTrainer(DistillationTrainer):
    """The KD loss on batches a collator padded: the labels are the real tokens (-100 on pads)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
        return super().compute_loss(
            model, {**inputs, "labels": labels}, return_outputs, num_items_in_batch
        )


def make_padding_trainer(
    output_dir: str, samples: list[dict], collator: Any, **arguments: Any
) -> PaddedDistillationTrainer:
    """The KD trainer with ``collator`` (one that pads each batch) on unpadded samples."""
    trainer = make_trainer(output_dir, samples, **arguments)
    trainer.__class__ = PaddedDistillationTrainer
    trainer.data_collator = collator
    return trainer
