"""A collator that pads each batch to its longest (``DataCollatorWithPadding``'s default, or
rounded up by ``pad_to_multiple_of``): ``split_trainer`` trains batches of samples the collator
pads to one length, cached in such batches.

Exactness: against an unsplit trainer given the same batches (``batch_by_padded_length``), the
split run logs the same losses (Python floats, ``==``) and ends with bit-identical student
weights (``torch.equal``). Every length group here holds a multiple of the batch size, so
every batch is full (a group's shorter last batch is within rounding, docs/howto.md).
"""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from transformers import DataCollatorWithPadding, TrainerCallback

import graphsplit
from graphsplit.errors import CacheError
from graphsplit.integrations.transformers import batch_by_padded_length, split_trainer
from tests.caching.fixtures import worker_environment
from tests.helpers import two_process_launch
from tests.integrations.dpo import word_tokenizer
from tests.integrations.kd import logged_losses, make_padding_trainer, unpadded_samples

# 32 samples of 8 lengths: 4 per length (pad to longest), 16 per multiple of 8.
LENGTHS = [[4, 5, 6, 7, 9, 10, 11, 12][i % 8] for i in range(32)]


def _same_weights(one, other):
    one, other = one.model.state_dict(), other.model.state_dict()
    return one.keys() == other.keys() and all(torch.equal(one[k], other[k]) for k in one)


def _collator(multiple=None):
    return DataCollatorWithPadding(word_tokenizer(), pad_to_multiple_of=multiple)


def _unsplit(folder, samples, collator, **arguments):
    trainer = make_padding_trainer(folder, samples, collator, **arguments)
    assert batch_by_padded_length(trainer) is not None
    trainer.train()
    return trainer


@pytest.mark.parametrize("live", [False, True], ids=["cache-first", "cache-while-training"])
@pytest.mark.parametrize(
    ("multiple", "groups"), [(None, 8), (8, 2)], ids=["longest", "multiple-of-8"]
)
def test_batches_of_one_padded_length_train_as_the_unsplit_trainer(
    tmp_path, live, multiple, groups
):
    samples = unpadded_samples(LENGTHS)
    unsplit = _unsplit(str(tmp_path / "unsplit"), samples, _collator(multiple))
    trainer = make_padding_trainer(str(tmp_path / "split"), samples, _collator(multiple))
    parts = split_trainer(trainer, str(tmp_path / "cache"), cache_while_training=live)
    trainer.train()
    assert logged_losses(trainer) == logged_losses(unsplit)
    assert len(logged_losses(trainer)) == 16
    assert _same_weights(trainer, unsplit)
    assert len(parts.groups.groups) == groups
    cached = parts.live.dataset() if live else parts.cached
    assert len(cached.buckets()) == groups  # one cache, a shape per padded length
    lengths = {shape[0][1][0] for shape in parts.groups.groups}
    assert lengths == ({4, 5, 6, 7, 9, 10, 11, 12} if multiple is None else {8, 16})


def test_every_batch_holds_one_padded_length_and_every_sample_once_an_epoch(tmp_path):
    samples = unpadded_samples(LENGTHS)
    trainer = make_padding_trainer(str(tmp_path), samples, _collator())
    split_trainer(trainer, str(tmp_path / "cache"))
    epochs = []
    for epoch in range(2):
        loader = trainer.get_train_dataloader()
        loader.set_epoch(epoch)
        batches = [batch["input_ids"].shape for batch in loader]
        assert all(shape[0] == 4 for shape in batches) and len(batches) == 8
        epochs.append([shape[1] for shape in batches])
    assert sorted(epochs[0]) == sorted(epochs[1]) == [4, 5, 6, 7, 9, 10, 11, 12]
    assert epochs[0] != epochs[1]  # shuffled per epoch, with the trainer's seed


def test_a_groups_shorter_caching_batch_is_filled_to_the_batch_size(tmp_path):
    """5 samples of one length, 3 of another, batches of 4: the caching pass fills each
    group's last batch with the group's first samples, so every row is computed at batch 4;
    with dataloader_drop_last=True training sees full batches only, exactly as unsplit."""
    samples = unpadded_samples([5, 5, 5, 5, 5, 9, 9, 9] * 2)  # 10 of length 5, 6 of 9
    arguments = {"dataloader_drop_last": True, "num_train_epochs": 3}
    unsplit = _unsplit(str(tmp_path / "unsplit"), samples, _collator(), **arguments)
    trainer = make_padding_trainer(str(tmp_path / "split"), samples, _collator(), **arguments)
    parts = split_trainer(trainer, str(tmp_path / "cache"))
    trainer.train()
    assert logged_losses(trainer) == logged_losses(unsplit)
    assert len(logged_losses(trainer)) == 9  # 2 + 1 full batches an epoch
    assert _same_weights(trainer, unsplit)
    keys = parts.cached.keys
    assert sorted(k for k in keys if "~" not in k) == sorted(str(i) for i in range(16))
    assert len(keys) == 20  # 10 -> 3 batches (2 fillers), 6 -> 2 batches (2 fillers)
    assert graphsplit.check_cache(str(tmp_path / "cache")).ok
    assert len(trainer.get_train_dataloader().dataset) == 16  # the samples, not the fillers


class _Interrupted(Exception):
    pass


class _StopAfterSaving(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise _Interrupted


@pytest.mark.parametrize("live", [False, True], ids=["cache-first", "cache-while-training"])
def test_a_checkpoint_taken_mid_epoch_resumes_to_the_uninterrupted_losses(tmp_path, live):
    samples = unpadded_samples(LENGTHS)
    steps = {"save_strategy": "steps", "save_steps": 3}
    whole = make_padding_trainer(str(tmp_path / "whole"), samples, _collator(), **steps)
    split_trainer(whole, str(tmp_path / "whole-cache"), cache_while_training=live)
    whole.train()  # 8 steps an epoch, 16 in all
    cut = make_padding_trainer(str(tmp_path / "cut"), samples, _collator(), **steps)
    split_trainer(cut, str(tmp_path / "cut-cache"), cache_while_training=live)
    cut.add_callback(_StopAfterSaving(9))  # in the second epoch
    with pytest.raises(_Interrupted):
        cut.train()
    resumed = make_padding_trainer(str(tmp_path / "cut"), samples, _collator(), **steps)
    split_trainer(resumed, str(tmp_path / "cut-cache"), cache_while_training=live)
    resumed.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-9"))
    after = [e["loss"] for e in resumed.state.log_history if "loss" in e and e["step"] > 9]
    assert after == logged_losses(whole)[9:] and len(after) == 7
    assert _same_weights(resumed, whole)


class _RandomLength:
    """Pads every batch to a random length: no grouping can give a sample its cached length."""

    def __init__(self):
        self.random = random.Random(0)

    def __call__(self, features):
        length = max(len(f["input_ids"]) for f in features) + self.random.randint(0, 3)
        pad = lambda values: values + [0] * (length - len(values))  # noqa: E731
        return {
            name: torch.tensor([pad(f[name]) for f in features])
            for name in ("input_ids", "attention_mask")
        }


@pytest.mark.parametrize("live", [False, True], ids=["cache-first", "cache-while-training"])
def test_a_collator_whose_padding_cannot_be_grouped_is_refused_before_any_model_runs(
    tmp_path, live
):
    trainer = make_padding_trainer(str(tmp_path), unpadded_samples(LENGTHS), _RandomLength())
    calls = []
    trainer.teacher.register_forward_hook(lambda *_: calls.append(1))
    with pytest.raises(CacheError, match="its padding depends on more than the samples") as error:
        split_trainer(trainer, str(tmp_path / "cache"), cache_while_training=live)
    assert "pad_to_multiple_of" in str(error.value) and "padding='max_length'" in str(error.value)
    assert calls == [] and not (tmp_path / "cache").exists()


def test_one_length_for_all_keeps_the_trainers_own_sampler(tmp_path):
    samples = unpadded_samples(LENGTHS)
    collator = DataCollatorWithPadding(word_tokenizer(), padding="max_length", max_length=12)
    trainer = make_padding_trainer(str(tmp_path), samples, collator)
    assert batch_by_padded_length(trainer) is None
    parts = split_trainer(trainer, str(tmp_path / "cache"))
    assert parts.groups is None and len(parts.cached.buckets()) == 1


def test_two_accelerate_processes_train_padding_groups_as_unsplit(tmp_path):
    """Under ``accelerate launch`` (2 CPU processes, gloo DDP) each process caches its share of
    the groups' batches and trains its share of every epoch's batches (accelerate shards the
    group sampler as it shards the trainer's own): the unsplit run's losses and weights."""
    pytest.importorskip("accelerate")
    worker = Path(__file__).with_name("trainer_worker.py")
    command = two_process_launch(str(worker), str(tmp_path), "groups")
    finished = subprocess.run(command, env=worker_environment(), capture_output=True, timeout=300)
    assert finished.returncode == 0, finished.stderr.decode()[-4000:]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"report.{rank}.json").read_text())
        assert report["world"] == 2 and report["wrapped"] == "DistributedDataParallel"
        assert report["split"] == report["unsplit"] and len(report["split"]) == 8
        assert report["same_weights"] and report["cached"] == 32
