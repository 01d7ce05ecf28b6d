"""A real KD ``Trainer`` (tiny Llama student and teacher, CPU) trained from a graphsplit cache.

Exactness: the split run logs the same losses as the unsplit run, compared as Python floats
(``==``), and ends with bit-identical student weights (``torch.equal``): the trainer's sampler
picks the same samples in the same order, and stage 2 computes what ``compute_loss`` computes.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from graphsplit.errors import CacheError
from graphsplit.integrations.transformers import TrainerLoss, split_trainer
from tests.caching.fixtures import worker_environment
from tests.helpers import two_process_launch
from tests.integrations.kd import LENGTH, VOCAB, logged_losses, make_trainer, padded_samples


def _train(tmp_path, name, samples, *, split, **arguments):
    trainer = make_trainer(str(tmp_path / name), samples, **arguments)
    parts = split_trainer(trainer, str(tmp_path / name / "cache")) if split else None
    trainer.train()
    return trainer, parts


def _same_weights(one, other):
    one, other = one.model.state_dict(), other.model.state_dict()
    return one.keys() == other.keys() and all(torch.equal(one[k], other[k]) for k in one)


@pytest.mark.parametrize(
    "arguments",
    [
        {},
        {"gradient_accumulation_steps": 2, "bf16": True},
        {"train_sampling_strategy": "group_by_length", "per_device_train_batch_size": 2},
    ],
    ids=["plain", "accumulation-bf16", "group-by-length"],
)
def test_the_split_trainer_logs_the_unsplit_losses(tmp_path, arguments):
    samples = padded_samples(16)
    unsplit, _ = _train(tmp_path, "unsplit", samples, split=False, **arguments)
    split, parts = _train(tmp_path, "split", samples, split=True, **arguments)
    assert logged_losses(split) == logged_losses(unsplit)
    assert len(logged_losses(split)) >= 4
    assert _same_weights(split, unsplit)
    # the teacher ran in stage 1 only: its log-probabilities are cached, stage 2 holds the
    # student and never computes the teacher's unread loss
    assert "teacher" not in dict(parts.split.stage2.named_children())
    cached = {n: s.shape[1:] for n, s in parts.split.boundary.items() if n not in samples[0]}
    assert list(cached.values()) == [(LENGTH, VOCAB)], cached
    assert "Not cached" not in parts.split.report()
    assert len(parts.cached) == 16


def test_a_partial_last_batch_agrees_within_rounding(tmp_path):
    """16 samples in batches of 3: the last batch holds one sample.

    Tolerance 1e-6 (relative): a sample cached in the caching loader's 1-sample tail batch
    is trained in a 3-sample batch (and the reverse); CPU matmul kernels round rows computed
    at another batch size differently in the last bits (6.7e-8 seen on the teacher's
    logits). Full batches of one size are bit for bit (above).
    """
    samples = padded_samples(16)
    arguments = {"train_sampling_strategy": "group_by_length", "per_device_train_batch_size": 3}
    unsplit, _ = _train(tmp_path, "unsplit", samples, split=False, **arguments)
    split, _ = _train(tmp_path, "split", samples, split=True, **arguments)
    assert logged_losses(split) == pytest.approx(logged_losses(unsplit), rel=1e-6)
    assert len(logged_losses(split)) == 12


def test_a_datasets_dataset_goes_through_the_trainers_column_removal(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = padded_samples(8)
    table = datasets.Dataset.from_list(
        [{**{k: v.tolist() for k, v in row.items()}, "note": "unused"} for row in rows]
    )
    unsplit, _ = _train(tmp_path, "unsplit", table, split=False, num_train_epochs=1)
    split, parts = _train(tmp_path, "split", table, split=True, num_train_epochs=1)
    assert logged_losses(split) == logged_losses(unsplit)
    assert "note" not in parts.split.input_names


def test_evaluation_runs_the_unsplit_loss_on_raw_batches(tmp_path):
    samples = padded_samples(8)
    plain = make_trainer(str(tmp_path / "plain"), samples, eval_strategy="no")
    split = make_trainer(str(tmp_path / "split"), samples, eval_strategy="no")
    split_trainer(split, str(tmp_path / "cache"))
    calls = []
    split.teacher.register_forward_hook(lambda *_: calls.append(1))
    assert split.evaluate(samples)["eval_loss"] == plain.evaluate(samples)["eval_loss"]
    assert calls, "evaluation must call the teacher (the unsplit compute_loss)"


def test_the_student_is_named_model_and_the_trainers_other_modules_by_attribute(tmp_path):
    trainer = make_trainer(str(tmp_path), padded_samples(4))
    loss = TrainerLoss(trainer)
    assert dict(loss.named_children()) == {"model": trainer.model, "teacher": trainer.teacher}
    # the callback handler's reference to the student does not name it
    assert trainer.callback_handler.model is trainer.model


def test_a_checkpoint_taken_mid_epoch_resumes_to_the_uninterrupted_losses(tmp_path):
    samples = padded_samples(16)
    steps = {"save_strategy": "steps", "save_steps": 3}
    whole, _ = _train(tmp_path, "whole", samples, split=True, **steps)  # 8 steps, 4 an epoch
    losses = logged_losses(whole)
    assert (tmp_path / "whole" / "checkpoint-3" / "graphsplit.json").exists()
    resumed = make_trainer(str(tmp_path / "whole"), samples, **steps)
    split_trainer(resumed, str(tmp_path / "whole" / "cache"))  # the same cache, reused
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-3"))
    after = [e["loss"] for e in resumed.state.log_history if "loss" in e and e["step"] > 3]
    assert after == losses[3:] and len(after) == 5
    assert _same_weights(resumed, whole)


def test_resuming_from_a_checkpoint_of_another_cache_is_refused(tmp_path):
    samples = padded_samples(8)
    steps = {"save_strategy": "steps", "save_steps": 2, "num_train_epochs": 1}
    _train(tmp_path, "run", samples, split=True, **steps)
    other = make_trainer(str(tmp_path / "run"), samples, **steps)
    split_trainer(other, str(tmp_path / "elsewhere"))
    with pytest.raises(CacheError, match=r"was trained from the cache .*run/cache") as error:
        other.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert "resume with the cache and models the checkpoint was trained with" in str(error.value)


@pytest.mark.parametrize("live", [False, True], ids=["cache-first", "cache-while-training"])
def test_two_accelerate_processes_cache_their_shares_and_train_as_unsplit(tmp_path, live):
    """Under ``accelerate launch`` (2 CPU processes, gloo DDP) each process caches its share
    (first, or while training epoch 1) and trains stage 2 through the DDP wrapper: the same
    losses and weights as unsplit."""
    pytest.importorskip("accelerate")
    worker = Path(__file__).with_name("trainer_worker.py")
    command = two_process_launch(str(worker), str(tmp_path), *(["live"] if live else []))
    finished = subprocess.run(command, env=worker_environment(), capture_output=True, timeout=300)
    assert finished.returncode == 0, finished.stderr.decode()[-4000:]
    reports = [json.loads((tmp_path / f"report.{rank}.json").read_text()) for rank in (0, 1)]
    for report in reports:
        assert report["world"] == 2 and report["wrapped"] == "DistributedDataParallel"
        assert report["split"] == report["unsplit"]
        assert len(report["split"]) == (6 if live else 4)
        assert report["same_weights"] and report["cached"] == 16


def test_splitting_a_trainer_again_wraps_its_own_methods_once(tmp_path):
    samples = padded_samples(8)
    unsplit, _ = _train(tmp_path, "unsplit", samples, split=False, num_train_epochs=1)
    trainer = make_trainer(str(tmp_path / "twice"), samples, num_train_epochs=1)
    split_trainer(trainer, str(tmp_path / "first"))
    split_trainer(trainer, str(tmp_path / "second"))  # e.g. after changing the teacher
    trainer.train()
    assert logged_losses(trainer) == logged_losses(unsplit)
    assert TrainerLoss(trainer)._compute_loss == trainer._graphsplit_originals["compute_loss"]


def test_a_wrapped_student_that_stage2_does_not_call_whole_is_refused(tmp_path):
    from graphsplit.errors import SplitError
    from graphsplit.integrations.transformers import _student_called_as

    trainer = make_trainer(str(tmp_path), padded_samples(4))
    wrapper = torch.nn.Sequential(trainer.model)  # stands in for DDP
    stage2 = torch.nn.Module()  # holds no "model" child, as when traced into the student
    refused = pytest.raises(SplitError, match="does not call the student as one module")
    with refused as error, _student_called_as(stage2, wrapper, trainer.model):
        pass
    assert "train this split in one process" in str(error.value)


def test_a_trainer_that_builds_its_own_batches_is_refused_naming_the_methods(tmp_path):
    from graphsplit.errors import SplitError
    from graphsplit.integrations.trainer_checks import batch_building_methods
    from tests.integrations.kd import DistillationTrainer

    class Generating(DistillationTrainer):
        def _prepare_inputs(self, inputs):  # e.g. generates completions with the student
            return super()._prepare_inputs(inputs)

    trainer = make_trainer(str(tmp_path), padded_samples(4))
    trainer.__class__ = Generating
    with pytest.raises(SplitError, match=r"builds its training batches itself \(_prepare_inputs"):
        split_trainer(trainer, str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists()
    assert batch_building_methods(DistillationTrainer) == []


def test_trls_on_policy_distillation_trainer_is_recognised_as_building_its_batches():
    from graphsplit.integrations.trainer_checks import batch_building_methods

    trl = pytest.importorskip("trl")
    from trl.trainer.distillation_trainer import DistillationTrainer as TrlDistillation

    assert batch_building_methods(TrlDistillation) == [
        "_prepare_inputs",
        "get_train_dataloader",
        "_get_train_sampler",
    ]
    assert batch_building_methods(trl.SFTTrainer) == []  # SFT with a frozen teacher fits


@pytest.mark.parametrize(
    ("policy", "shown"), [({"lmbda": 0.5}, "lmbda=0.5"), ({"seq_kd": True}, "seq_kd=True")]
)
def test_an_on_policy_gkd_style_trainer_is_refused(tmp_path, policy, shown):
    """GKDTrainer's training_step swaps the batch for generations with probability lmbda
    (or the teacher's, under seq_kd); its compute_loss is not overridden in a checkable way."""
    from graphsplit.errors import SplitError

    trainer = make_trainer(str(tmp_path), padded_samples(4))
    for name, value in policy.items():
        setattr(trainer, name, value)
    with pytest.raises(SplitError, match="trains on-policy") as error:
        split_trainer(trainer, str(tmp_path / "cache"))
    assert shown in str(error.value) and "trl.SFTTrainer subclass" in str(error.value)


def test_a_trainer_that_compiles_its_model_logs_the_unsplit_losses(tmp_path):
    """``TrainingArguments(torch_compile=True)`` wraps the student in ``torch.compile``
    (``backend="eager"`` here: inductor's rounding is not what this test is about)."""
    samples = padded_samples(8)
    arguments = {"torch_compile": True, "torch_compile_backend": "eager", "num_train_epochs": 1}
    unsplit, _ = _train(tmp_path, "unsplit", samples, split=False, **arguments)
    split, parts = _train(tmp_path, "split", samples, split=True, **arguments)
    assert logged_losses(split) == logged_losses(unsplit) and len(logged_losses(split)) == 2
    assert _same_weights(split, unsplit)
    assert "teacher" not in dict(parts.split.stage2.named_children())
