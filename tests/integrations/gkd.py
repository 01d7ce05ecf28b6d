"""TRL's ``GKDTrainer`` with ``lmbda=0`` (no on-policy generation) on tiny random Llamas.

The dataset is pre-tokenized and pre-padded (``tests.integrations.kd.padded_samples``, labels
``-100`` on padding) and collated by ``default_data_collator``: GKD's own ChatML collator needs a
chat template, which the tests' word-level tokenizer does not have.
"""

from __future__ import annotations

from typing import Any

from transformers import default_data_collator
from trl.experimental.gkd import GKDConfig, GKDTrainer

from tests.integrations.dpo import word_tokenizer
from tests.integrations.kd import LENGTH, padded_samples, tiny_llama


def make_gkd_trainer(output_dir: str, count: int = 16, **arguments: Any) -> GKDTrainer:
    settings = {
        "per_device_train_batch_size": 4,
        "num_train_epochs": 2,
        "logging_steps": 1,
        "seed": 7,
        "report_to": [],
        "use_cpu": True,
        "bf16": False,
        "save_strategy": "no",
        "disable_tqdm": True,
        "max_length": LENGTH,
        "lmbda": 0.0,
        **arguments,
    }
    rows = [{k: v.tolist() for k, v in row.items()} for row in padded_samples(count)]
    from datasets import Dataset

    return GKDTrainer(
        model=tiny_llama(1, 16),
        teacher_model=tiny_llama(2, 32),
        args=GKDConfig(output_dir=output_dir, **settings),
        data_collator=default_data_collator,
        train_dataset=Dataset.from_list(rows),
        processing_class=word_tokenizer(),
    )
