"""SFT with a frozen teacher (a ``trl.SFTTrainer`` subclass) trained from a graphsplit cache.

Exactness: the split run logs the unsplit run's losses (Python floats, ``==``) and ends with
bit-identical student weights (``torch.equal``), in full batches of one size.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from graphsplit.errors import CacheError
from graphsplit.integrations.transformers import split_trainer
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


def test_sfts_default_padding_to_the_longest_is_refused(tmp_path):
    trainer = make_sft_trainer(str(tmp_path), texts(16), pad_to_multiple_of=None)
    with pytest.raises(CacheError, match="different shapes in different batches"):
        split_trainer(trainer, str(tmp_path / "cache"))
