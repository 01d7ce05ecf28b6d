"""``split_trainer(..., cache_while_training=True)``: the first epoch builds the cache.

Exactness: the split run logs the unsplit run's losses (Python floats, ``==``) and ends with
bit-identical student weights (``torch.equal``): epoch 1 trains on the trainer's own raw
batches through stage 1 + stage 2, later epochs on the cached rows in full batches of one size.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers import TrainerCallback

import graphsplit
from graphsplit.errors import SplitError
from graphsplit.integrations.transformers import split_trainer
from tests.integrations.kd import logged_losses, make_trainer, padded_samples


def _same_weights(one, other):
    one, other = one.model.state_dict(), other.model.state_dict()
    return one.keys() == other.keys() and all(torch.equal(one[k], other[k]) for k in one)


def _count_stage1_calls(parts):
    """Stage 1 (the teacher) runs on the first epoch's raw batches only."""
    calls = []
    parts.split.stage1.get_submodule("teacher.lm_head").register_forward_hook(
        lambda *_: calls.append(1)
    )
    return calls


class _Interrupted(Exception):
    pass


class _StopAfterSaving(TrainerCallback):
    """The process dies right after the checkpoint at ``step`` is saved."""

    def __init__(self, step):
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise _Interrupted


@pytest.mark.parametrize(
    "arguments",
    [
        {},
        {"train_sampling_strategy": "group_by_length", "gradient_accumulation_steps": 2},
        {"dataloader_num_workers": 2},
        {"gradient_accumulation_steps": 3},  # 4 batches an epoch: a short last update
    ],
    ids=["plain", "group-by-length-accumulation", "two-workers", "accumulation-remainder"],
)
def test_the_first_epoch_builds_the_cache_and_all_epochs_log_the_unsplit_losses(
    tmp_path, arguments
):
    samples = padded_samples(16)
    unsplit = make_trainer(str(tmp_path / "unsplit"), samples, num_train_epochs=3, **arguments)
    unsplit.train()
    trainer = make_trainer(str(tmp_path / "split"), samples, num_train_epochs=3, **arguments)
    parts = split_trainer(trainer, str(tmp_path / "cache"), cache_while_training=True)
    calls = _count_stage1_calls(parts)
    trainer.train()
    assert logged_losses(trainer) == logged_losses(unsplit)
    assert len(logged_losses(trainer)) >= 3
    assert _same_weights(trainer, unsplit)
    # stage 1 (the teacher) ran in epoch 1 only (4 batches), then the cache served epochs 2 and 3
    assert len(calls) == 4
    assert parts.live.complete and graphsplit.check_cache(str(tmp_path / "cache")).ok
    assert sorted(parts.live.dataset().keys, key=int) == [str(i) for i in range(16)]


def test_a_complete_cache_is_read_from_the_first_epoch(tmp_path):
    samples = padded_samples(8)
    first = make_trainer(str(tmp_path / "first"), samples, num_train_epochs=1)
    split_trainer(first, str(tmp_path / "cache"), cache_while_training=True)
    first.train()
    again = make_trainer(str(tmp_path / "again"), samples, num_train_epochs=1)
    calls = _count_stage1_calls(
        split_trainer(again, str(tmp_path / "cache"), cache_while_training=True)
    )
    again.train()
    assert calls == [] and logged_losses(again) == logged_losses(first)


def test_a_checkpoint_mid_first_epoch_resumes_the_cache_and_the_losses(tmp_path):
    """Interrupted after the checkpoint at step 3 of 4 in epoch 1 (it committed the rows of
    steps 1-3); the resumed run caches the rest of the epoch and matches an uninterrupted run."""
    samples = padded_samples(16)
    steps = {"save_strategy": "steps", "save_steps": 3, "num_train_epochs": 2}
    whole = make_trainer(str(tmp_path / "whole"), samples, **steps)
    whole.train()
    stopped = make_trainer(str(tmp_path / "run"), samples, **steps)
    first = split_trainer(stopped, str(tmp_path / "cache"), cache_while_training=True)
    stopped.add_callback(_StopAfterSaving(3))
    with pytest.raises(_Interrupted):
        stopped.train()
    first.live.close()  # what the process's end does (it releases the folder)
    assert not graphsplit.check_cache(str(tmp_path / "cache")).ok  # unfinished: no manifest
    resumed = make_trainer(str(tmp_path / "run"), samples, **steps)
    parts = split_trainer(resumed, str(tmp_path / "cache"), cache_while_training=True)
    calls = _count_stage1_calls(parts)
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3"))
    after = [e["loss"] for e in resumed.state.log_history if "loss" in e and e["step"] > 3]
    assert after == logged_losses(whole)[3:] and len(after) == 5
    assert _same_weights(resumed, whole)
    assert len(calls) == 1  # only epoch 1's last batch ran stage 1
    assert parts.live.complete and len(parts.live.dataset()) == 16


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        ({"dataloader_drop_last": True}, "dataloader_drop_last=False"),
        (
            {"dataloader_num_workers": 1, "dataloader_persistent_workers": True},
            "dataloader_persistent_workers=False",
        ),
    ],
    ids=["drop-last", "persistent-workers"],
)
def test_what_cache_while_training_cannot_do_is_refused_with_the_fix(tmp_path, arguments, said):
    trainer = make_trainer(str(tmp_path), padded_samples(8), **arguments)
    with pytest.raises(SplitError, match="cache_while_training") as error:
        split_trainer(trainer, str(tmp_path / "cache"), cache_while_training=True)
    assert said in str(error.value)
    assert not (tmp_path / "cache").exists()


def test_an_epoch_cut_short_by_max_steps_leaves_the_cache_open(tmp_path):
    trainer = make_trainer(str(tmp_path), padded_samples(16), max_steps=2)
    parts = split_trainer(trainer, str(tmp_path / "cache"), cache_while_training=True)
    trainer.train()
    assert not parts.live.complete
    assert not graphsplit.check_cache(str(tmp_path / "cache")).ok


def test_a_first_epoch_that_lacks_samples_is_refused_at_its_end(tmp_path, monkeypatch):
    """Rows of the batches before the checkpoint lost (here: never committed) -> refused
    before a later epoch would look them up."""
    from graphsplit.caching.live import LiveCache
    from graphsplit.errors import CacheError

    samples = padded_samples(16)
    steps = {"save_strategy": "steps", "save_steps": 3, "num_train_epochs": 2}
    monkeypatch.setattr(LiveCache, "commit", lambda self: None)
    stopped = make_trainer(str(tmp_path / "run"), samples, **steps)
    first = split_trainer(stopped, str(tmp_path / "cache"), cache_while_training=True)
    stopped.add_callback(_StopAfterSaving(3))
    with pytest.raises(_Interrupted):
        stopped.train()
    first.live.close()
    resumed = make_trainer(str(tmp_path / "run"), samples, **steps)
    split_trainer(resumed, str(tmp_path / "cache"), cache_while_training=True)
    with pytest.raises(CacheError, match="lacks 12 of the 16 samples") as error:
        resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3"))
    assert "resume with the cache folder the checkpoint was trained with" in str(error.value)


def test_caching_while_training_into_a_bucket_is_refused_naming_the_fix(tmp_path):
    """A live cache is written to a local or shared folder (cache first to write a bucket)."""
    from graphsplit.errors import CacheError

    trainer = make_trainer(str(tmp_path), padded_samples(8))
    with pytest.raises(CacheError, match="local or shared folder, not to s3://bucket/cache") as e:
        split_trainer(trainer, "s3://bucket/cache", cache_while_training=True)
    assert "write a bucket with graphsplit.cache" in str(e.value)
