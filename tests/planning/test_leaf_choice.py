"""Which leaves a round traces into (planning/leaf_choice.py): one number for the batch; and
a frozen leaf entering torch.inference_mode() in its own forward (planning/meta/eager_protocols.py).

transformers' Trainer passes ``num_items_in_batch`` (``labels.ne(-100).sum()``, a 0-dim tensor
that mixes the batch) into ``model(**inputs)`` whenever the model's forward takes ``**kwargs``,
and the model hands its kwargs on to its backbone. Called whole, the frozen backbone was tainted
by the count and nothing was cached; traced into, only what computes with the count is.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import batch, split_and_verify


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x, **kwargs):  # swallows the count, as transformers' layers do
        return torch.tanh(self.linear(x))


class Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(3))

    def forward(self, x, **kwargs):
        for layer in self.layers:
            x = layer(x, **kwargs)
        return x


class Classifier(nn.Module):
    """A frozen backbone and a trainable head, the count handed down as transformers does."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = Backbone().requires_grad_(False)
        self.head = nn.Linear(4, 3)

    def forward(self, x, labels, **kwargs):
        logits = self.head(self.backbone(x, **kwargs))
        loss = nn.functional.cross_entropy(logits, labels, reduction="sum")
        count = kwargs.get("num_items_in_batch")
        return loss / count if count is not None else loss / labels.shape[0]


class TrainerStep(nn.Module):
    """The Trainer's ``compute_loss`` with ``num_items_in_batch``."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Classifier()

    def forward(self, x, labels):
        num_items_in_batch = labels.ne(-100).sum()
        return self.model(x, labels, num_items_in_batch=num_items_in_batch)


def _labels(n: int) -> torch.Tensor:
    return torch.arange(n) % 3


def test_the_count_does_not_keep_the_frozen_backbone_whole():
    step = TrainerStep()
    split = split_and_verify(step, (batch(3, 4), _labels(3)), path="trace")
    held = {name for name, _ in split.stage2.named_parameters()}
    assert not any(".backbone." in name for name in held), sorted(held)
    assert "x" not in split.boundary  # the backbone's output crosses, not the input
    assert any("num_items_in_batch" in note for note in split.notes)
    split_and_verify(step, (batch(5, 4), _labels(5)), path="trace")


class NoisedBackbone(TrainerStep):
    """Control: a per-sample random tensor beside the data keeps the backbone's call tainted
    (nothing frozen can be cached behind it), as before."""

    def forward(self, x, labels):
        noisy = x + torch.randn_like(x)
        return self.model(noisy, labels)


def test_a_per_sample_draw_into_the_backbone_still_keeps_it_in_stage_2():
    split = split_and_verify(NoisedBackbone(), (batch(3, 4), _labels(3)), path="trace")
    held = {name for name, _ in split.stage2.named_parameters()}
    assert any(".backbone." in name for name in held)
    assert not any("num_items_in_batch" in note for note in split.notes)


# -- a frozen leaf that enters torch.inference_mode() in its own forward -----------------------
class InferenceEncoder(nn.Module):
    """DINOv2's linear evaluation runs its backbone so; the step builds normal tensors from the
    inference tensors (``torch.cat``) before anything trains on them."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.token = nn.Parameter(torch.zeros(1, 4))

    def forward(self, x):
        with torch.inference_mode():
            return self.linear(x) + self.token.expand(x.shape[0], -1)  # a view of a weight


class ProbesInferenceFeatures(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = InferenceEncoder().requires_grad_(False)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        features = torch.cat([self.encoder(x)])
        return self.head(features).pow(2).mean()


@pytest.mark.parametrize("path", ["trace", "calls"])
def test_inference_mode_inside_a_frozen_leaf_splits_exactly(path):
    """It used to fail on both paths: on fake tensors the weight's view raised "Cannot set
    version_counter for inference tensor" (a TraceError whose fix spoke of devices), and the
    module-level probe read the ``_version`` of the call's inference-tensor output."""
    model = ProbesInferenceFeatures()
    split = split_and_verify(model, (batch(3, 4),), path=path)
    assert not any(name.startswith("encoder") for name, _ in split.stage2.named_parameters())
    split_and_verify(model, (batch(5, 4),), path=path)
    with torch.inference_mode():  # the step's own inference mode still works after a split
        assert model.encoder(batch(2, 4)).is_inference()


# -- the step's own module holding a frozen one, fed trainable and cacheable values ----------
class TeacherLoss(nn.Module):
    """DeiT's ``DistillationLoss`` in small: the frozen teacher runs on the raw ``inputs``,
    the student's ``outputs`` meet its answer in the loss."""

    def __init__(self, teacher: nn.Module) -> None:
        super().__init__()
        self.teacher = teacher

    def forward(self, inputs, outputs, labels):
        with torch.no_grad():
            hard = self.teacher(inputs).argmax(dim=1)
        return nn.functional.cross_entropy(outputs, hard) + nn.functional.cross_entropy(
            outputs, labels
        )


class StudentWithTeacherLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.student = nn.Linear(8, 5)
        self.criterion = TeacherLoss(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 5)))
        self.criterion.requires_grad_(False)

    def forward(self, samples, labels):
        return self.criterion(samples, self.student(samples), labels)


class FrozenAttentionOverCacheable(nn.Module):
    """torch's own frozen ``MultiheadAttention`` fed a trainable query beside cacheable keys:
    a library's module, kept one call."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.query = nn.Linear(8, 8)
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True).requires_grad_(False)

    def forward(self, x):
        return self.attention(self.query(x), x, x)[0].pow(2).mean()


def test_the_steps_own_module_holding_a_frozen_one_is_traced_into():
    step = StudentWithTeacherLoss()
    labels = torch.tensor([0, 3, 1, 4])
    split = split_and_verify(step, (batch(4, 8), labels))
    assert "traced into criterion" in " ".join(split.notes)
    assert not [name for name, _ in split.stage2.named_parameters() if "teacher" in name]
    assert [spec.dtype for name, spec in split.boundary.items() if name.startswith("argmax")] == [
        torch.int64
    ]


def test_a_library_module_fed_trainable_and_cacheable_values_stays_one_call():
    split = split_and_verify(FrozenAttentionOverCacheable(), (batch(3, 4, 8),))
    assert not any("traced into attention" in note for note in split.notes)
    assert [name for name, _ in split.stage2.named_parameters() if name.startswith("attention")]
