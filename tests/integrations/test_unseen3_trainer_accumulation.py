"""``split_trainer`` on the Trainer's own ``compute_loss`` (no subclass): gradient accumulation,
the ``LabelSmoother`` and ``average_tokens_across_devices``, against the plain Trainer.

A LoRA'd tiny Llama (peft ``get_peft_model``, as Trainer users wrap it) trains a few optimizer
steps; the trainable parameters are compared bit for bit after every optimizer step
(``on_step_end``), and the logged losses with ``==``.

Found: with ``gradient_accumulation_steps=2`` the Trainer counts the label tokens of the whole
accumulated batch (``num_items_in_batch``), passes the count to the model and skips its division
by the accumulation steps. The split trainer dropped the count and its cached batches hold no
``labels`` to count, so it trained to other weights, silently (the losses differed in the 4th
digit). ``split_trainer`` now refuses that (:mod:`graphsplit.integrations.trainer_accumulation`)
with the two ways to make the runs agree; the second (``model_accepts_loss_kwargs = False``) is
shown exact here, label smoothing included.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from graphsplit.errors import SplitError  # noqa: E402
from graphsplit.integrations.transformers import split_trainer  # noqa: E402
from tests.integrations.kd import (  # noqa: E402
    DistillationTrainer,
    logged_losses,
    padded_samples,
    tiny_llama,
)


class _Weights(transformers.TrainerCallback):
    """The trainable parameters after every optimizer step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        self.steps.append(trained)


def _lora_llama() -> Any:
    model = peft.get_peft_model(
        tiny_llama(1, 16),
        peft.LoraConfig(
            task_type="CAUSAL_LM",
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj"],
            init_lora_weights="gaussian",
        ),
    )
    generator = torch.Generator().manual_seed(5)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data = torch.randn(param.shape, generator=generator) * 0.02
    return model


def _trainer(output_dir: str, **arguments: Any) -> Any:
    settings = {
        "per_device_train_batch_size": 2,
        "num_train_epochs": 1,
        "logging_steps": 1,
        "seed": 7,
        "learning_rate": 1e-2,
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "disable_tqdm": True,
        **arguments,
    }
    # Samples of 4 to 8 real tokens: the micro-batches of a step hold unequal token counts.
    return transformers.Trainer(
        model=_lora_llama(),
        args=transformers.TrainingArguments(output_dir=output_dir, **settings),
        train_dataset=padded_samples(12),
    )


def _run(tmp_path, name: str, *, split: bool, per_micro_batch: bool = False, **arguments):
    trainer = _trainer(str(tmp_path / name), **arguments)
    if per_micro_batch:
        trainer.model_accepts_loss_kwargs = False
    weights = _Weights()
    trainer.add_callback(weights)
    if split:
        split_trainer(trainer, str(tmp_path / name / "cache"))
    trainer.train()
    return trainer, weights.steps


def _same_steps(one: list[dict], other: list[dict]) -> bool:
    return len(one) == len(other) and all(
        a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        for a, b in zip(one, other, strict=True)
    )


@pytest.mark.parametrize(
    "arguments",
    [
        {"label_smoothing_factor": 0.1, "average_tokens_across_devices": True},
        {"label_smoothing_factor": 0.0, "average_tokens_across_devices": False},
    ],
    ids=["label-smoothing", "plain"],
)
def test_the_trainers_own_loss_without_accumulation_is_exact_step_by_step(tmp_path, arguments):
    """``label_smoothing_factor > 0``: ``compute_loss`` pops the labels, the model returns
    logits, the Trainer's ``LabelSmoother`` computes the loss outside the model (traced in
    stage 2). ``average_tokens_across_devices``: one process, the loss scaled by 1."""
    unsplit, expected = _run(tmp_path, "unsplit", split=False, **arguments)
    split, got = _run(tmp_path, "split", split=True, **arguments)
    assert (unsplit.label_smoother is not None) == (arguments["label_smoothing_factor"] > 0)
    assert logged_losses(split) == logged_losses(unsplit) and len(expected) == 6
    assert _same_steps(got, expected)


@pytest.mark.parametrize("smoothing", [0.0, 0.1], ids=["model-loss", "label-smoother"])
def test_accumulation_normalised_by_the_steps_token_count_is_refused(tmp_path, smoothing):
    trainer = _trainer(
        str(tmp_path), gradient_accumulation_steps=2, label_smoothing_factor=smoothing
    )
    with pytest.raises(SplitError) as caught:
        split_trainer(trainer, str(tmp_path / "cache"))
    message = str(caught.value)
    assert message.startswith("gradient_accumulation_steps=2: the Trainer counts the label tokens")
    assert "num_items_in_batch" in message
    assert "the cached batches hold no labels" in message
    words = caught.value.fix.words
    assert "gradient_accumulation_steps=1" in words
    assert "trainer.model_accepts_loss_kwargs = False" in words
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


@pytest.mark.parametrize("smoothing", [0.0, 0.1], ids=["model-loss", "label-smoother"])
def test_accumulation_of_per_micro_batch_means_is_exact_step_by_step(tmp_path, smoothing):
    """The refusal's second fix: ``model_accepts_loss_kwargs = False`` on both trainers; each
    micro-batch's mean is divided by the accumulation steps in both runs."""
    arguments = {"gradient_accumulation_steps": 2, "label_smoothing_factor": smoothing}
    unsplit, expected = _run(tmp_path, "unsplit", split=False, per_micro_batch=True, **arguments)
    split, got = _run(tmp_path, "split", split=True, per_micro_batch=True, **arguments)
    assert logged_losses(split) == logged_losses(unsplit) and len(expected) == 3
    assert _same_steps(got, expected)


class CountingDistillationTrainer(DistillationTrainer):
    """A KD loss whose student call takes the Trainer's token count, as the Trainer's own
    ``compute_loss`` passes it (``model(**inputs, num_items_in_batch=...)``)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        with torch.no_grad():
            teacher_logits = self.teacher(**inputs).logits
        outputs = model(**inputs, num_items_in_batch=num_items_in_batch)
        distill = torch.nn.functional.kl_div(
            torch.nn.functional.log_softmax(outputs.logits, dim=-1),
            torch.nn.functional.log_softmax(teacher_logits, dim=-1),
            log_target=True,
            reduction="batchmean",
        )
        return 0.5 * outputs.loss + 0.5 * distill


def _kd(output_dir: str, trainer_class: type) -> Any:
    arguments = {
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "disable_tqdm": True,
    }
    return trainer_class(
        model=tiny_llama(1, 16),
        args=transformers.TrainingArguments(output_dir=output_dir, **arguments),
        train_dataset=padded_samples(8),
        teacher=tiny_llama(2, 32),
    )


def test_a_compute_loss_that_reads_the_count_is_refused_though_the_labels_are_cached(tmp_path):
    """The KD student is all trainable: the labels cross the boundary, so the Trainer counts the
    cached batches' tokens too; but this ``compute_loss`` reads the count, which stage 2 drops.
    Found by running ``compute_loss`` on the example batch with and without a count."""
    with pytest.raises(SplitError) as caught:
        split_trainer(_kd(str(tmp_path), CountingDistillationTrainer), str(tmp_path / "cache"))
    assert "compute_loss reads num_items_in_batch" in str(caught.value)


def test_a_compute_loss_that_ignores_the_count_is_not_refused(tmp_path):
    """The KD trainer of tests/integrations/kd.py ignores the count: accumulation is exact there
    (tests/integrations/test_transformers_trainer.py trains it); it is not refused."""
    parts = split_trainer(_kd(str(tmp_path), DistillationTrainer), str(tmp_path / "cache"))
    assert "labels" in parts.split.boundary
