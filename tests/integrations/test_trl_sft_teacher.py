"""SFT with a frozen teacher (a ``trl.SFTTrainer`` subclass) trained from a graphsplit cache.

Exactness: the split run logs the unsplit run's losses (Python floats, ``==``) and ends with
bit-identical student weights (``torch.equal``), in full batches of one size.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from graphsplit.integrations.transformers import batch_by_padded_length, split_trainer
from tests.integrations.kd import logged_losses
from tests.integrations.sft import make_sft_trainer, texts


def _same_weights(one, other):
    one, other = one.model.state_dict(), other.model.state_dict()
    return one.keys() == other.keys() and all(torch.equal(one[k], other[k]) for k in one)


@pytest.mark.parametrize("live", [False, True], ids=["cache-first", "cache-while-training"])
def test_sft_with_a_frozen_teacher_trains_from_the_cache_as_unsplit(tmp_path, live):
    data = texts(16)
    unsplit = make_sft_trainer(str(tmp_path / "unsplit"), data)
    unsplit.train()
    trainer = make_sft_trainer(str(tmp_path / "split"), data)
    parts = split_trainer(trainer, str(tmp_path / "cache"), cache_while_training=live)
    trainer.train()
    assert logged_losses(trainer) == logged_losses(unsplit)
    assert len(logged_losses(trainer)) == 8
    assert _same_weights(trainer, unsplit)
    assert "teacher" not in dict(parts.split.stage2.named_children())


def test_sfts_default_padding_to_the_longest_trains_in_batches_of_one_length(tmp_path):
    """TRL's collator pads each batch to its longest: split_trainer groups the texts by
    length (16 texts, 5 lengths); batches of 1, so every batch is full."""
    data = texts(16)
    unpadded = {"pad_to_multiple_of": None, "per_device_train_batch_size": 1}
    unsplit = make_sft_trainer(str(tmp_path / "unsplit"), data, **unpadded)
    assert batch_by_padded_length(unsplit) is not None
    unsplit.train()
    trainer = make_sft_trainer(str(tmp_path / "split"), data, **unpadded)
    parts = split_trainer(trainer, str(tmp_path / "cache"))
    trainer.train()
    assert logged_losses(trainer) == logged_losses(unsplit)
    assert len(logged_losses(trainer)) == 32
    assert _same_weights(trainer, unsplit)
    assert len(parts.groups.groups) == 5
