"""split_trainer puts back the trainer's own counts and metrics after planning and caching
(graphsplit/integrations/trainer_bookkeeping.py): TRL's SFTTrainer counts tokens and appends
metrics inside compute_loss, which the probes and stage 1 run many times."""

from __future__ import annotations

from collections import defaultdict

import pytest
from torch import nn

from graphsplit.integrations.trainer_bookkeeping import bookkeeping_kept


class Trainer:
    def __init__(self) -> None:
        self._total_train_tokens = 0
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        self.model = nn.Linear(2, 2)
        self.name = "sft"


def test_counts_and_metrics_come_back_and_the_rest_is_left_alone():
    trainer = Trainer()
    trainer._metrics["train"]["entropy"].append(1.0)
    metrics, model = trainer._metrics, trainer.model
    with bookkeeping_kept(trainer):
        trainer._total_train_tokens += 90
        trainer._metrics["train"]["entropy"].append(2.0)
        trainer._metrics["train"]["num_tokens"].append(90)
        trainer._signature_columns = ["input_ids"]  # a plain attribute set meanwhile
        trainer.model = nn.Linear(3, 3)  # not plain data: left as it is now
    assert trainer._total_train_tokens == 0
    assert trainer._metrics is metrics  # refilled in place: a callback may hold it
    assert dict(trainer._metrics["train"]) == {"entropy": [1.0]}
    assert isinstance(trainer._metrics["train"], defaultdict)
    assert not hasattr(trainer, "_signature_columns")
    assert trainer.model is not model and trainer.name == "sft"


def test_split_trainer_leaves_the_generators_as_it_found_them_even_through_its_checks(
    monkeypatch,
):
    """Its checks' first import of TRL imports rich, which draws from Python's generator: the
    states are taken before the checks and put back after them."""
    import random

    from graphsplit.integrations import transformers as integration

    def drawing_check(trainer):
        random.random()
        raise RuntimeError("stop here")

    monkeypatch.setattr(integration, "check_trainer", drawing_check)
    before = random.getstate()
    with pytest.raises(RuntimeError, match="stop here"):
        integration.split_trainer(object(), "unused")
    assert random.getstate() == before
