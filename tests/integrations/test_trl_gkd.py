"""TRL's ``GKDTrainer`` with ``lmbda=0`` (off-policy: the teacher sees the dataset's sequences)
trained from a graphsplit cache of the teacher's logits.

GKD's loss indexes by a mask (``jsd[mask]``, a value-dependent shape on the trainable side), so
the whole-step trace refuses it and ``split`` takes the module-level path: the frozen
``teacher_model``'s call is cached. Exactness: the split run logs the unsplit run's losses
(Python floats, ``==``) and ends with bit-identical student weights (``torch.equal``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from graphsplit.errors import SplitError
from graphsplit.integrations.transformers import split_trainer
from tests.integrations.gkd import make_gkd_trainer
from tests.integrations.kd import logged_losses


def _same_weights(one, other):
    one, other = one.model.state_dict(), other.model.state_dict()
    return one.keys() == other.keys() and all(torch.equal(one[k], other[k]) for k in one)


def _frozen(trainer):
    trainer.teacher_model.requires_grad_(False)
    trainer.teacher_model.config.use_cache = False
    return trainer


@pytest.mark.parametrize("live", [False, True], ids=["cache-first", "cache-while-training"])
def test_off_policy_gkd_trains_from_the_cached_teacher_as_unsplit(tmp_path, live):
    unsplit = make_gkd_trainer(str(tmp_path / "unsplit"))
    unsplit.train()
    trainer = _frozen(make_gkd_trainer(str(tmp_path / "split")))
    split_trainer(trainer, str(tmp_path / "cache"), cache_while_training=live)
    calls = []
    trainer.teacher_model.lm_head.register_forward_hook(lambda *_: calls.append(1))
    trainer.train()
    assert logged_losses(trainer) == logged_losses(unsplit)
    assert len(logged_losses(trainer)) == 8
    assert _same_weights(trainer, unsplit)
    # the teacher computes in epoch 1 only, or never (cached first)
    assert len(calls) == (4 if live else 0)


@pytest.mark.parametrize(
    ("change", "shown"),
    [
        (lambda t: t.teacher_model.config.__setattr__("use_cache", False), "trainable parameters"),
        (lambda t: t.teacher_model.requires_grad_(False), "returns a KV cache"),
    ],
    ids=["trainable-teacher", "kv-cache"],
)
def test_a_gkd_teacher_left_trainable_or_returning_a_kv_cache_is_refused(tmp_path, change, shown):
    trainer = make_gkd_trainer(str(tmp_path))
    change(trainer)
    with pytest.raises(SplitError, match="GKDTrainer's teacher_model") as error:
        split_trainer(trainer, str(tmp_path / "cache"))
    assert shown in str(error.value)
    assert "trainer.teacher_model.requires_grad_(False)" in str(error.value)
    assert not (tmp_path / "cache").exists()


def test_on_policy_gkd_is_refused(tmp_path):
    trainer = _frozen(make_gkd_trainer(str(tmp_path), lmbda=0.5))
    with pytest.raises(SplitError, match=r"trains on-policy \(lmbda=0.5"):
        split_trainer(trainer, str(tmp_path / "cache"))
