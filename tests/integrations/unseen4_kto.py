"""A TRL ``KTOTrainer`` on the tiny random Qwen2 and word-level tokenizer of :mod:`.dpo`."""

from __future__ import annotations

from typing import Any

import torch
from datasets import Dataset
from trl import KTOConfig, KTOTrainer

from tests.integrations.dpo import VOCAB, tiny_qwen2, word_tokenizer


def unpaired_preferences(count: int, seed: int = 0) -> Dataset:
    """KTO's unpaired layout: a prompt, one completion and whether it is desirable."""
    generator = torch.Generator().manual_seed(seed)

    def words(n: int) -> str:
        return " ".join(
            f"t{i}" for i in torch.randint(2, VOCAB, (n,), generator=generator).tolist()
        )

    rows = [
        {"prompt": words(3 + i % 3), "completion": " " + words(2 + i % 4), "label": i % 2 == 0}
        for i in range(count)
    ]
    return Dataset.from_list(rows)


def make_kto_trainer(output_dir: str, examples: Dataset, **arguments: Any) -> KTOTrainer:
    settings = {
        "per_device_train_batch_size": 4,
        "max_steps": 2,
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "disable_tqdm": True,
        **arguments,
    }
    return KTOTrainer(
        model=tiny_qwen2(1),
        ref_model=tiny_qwen2(2),
        args=KTOConfig(output_dir=output_dir, **settings),
        train_dataset=examples,
        processing_class=word_tokenizer(),
    )
