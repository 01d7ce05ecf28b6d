"""A frozen module every call of which takes a trainable (or random) input, and inside which
other frozen modules are called, is opened: its own calls are no longer routed, so the frozen
modules it calls are judged on their own (DeiT's ``DistillationLoss`` holds the teacher it
calls on the images and is called on the student's outputs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphsplit
from tests.helpers import split_and_verify


class Criterion(nn.Module):
    """Holds a frozen teacher; called on the images, the student's output and the labels."""

    def __init__(self) -> None:
        super().__init__()
        self.teacher = nn.Linear(4, 3)

    def forward(self, images, student, labels):
        with torch.no_grad():
            teacher = self.teacher(images)
        return F.cross_entropy(student, labels) + F.mse_loss(student, teacher)


class Step(nn.Module):
    def __init__(self, shifted: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.student = nn.Linear(4, 3)
        self.shift = nn.Parameter(torch.zeros(4)) if shifted else None
        self.criterion = Criterion().requires_grad_(False)

    def forward(self, images, labels):
        student = self.student(images)
        if self.shift is not None:  # the teacher's images depend on a trainable parameter too
            images = images + self.shift
        return self.criterion(images, student, labels)


def _batch(size: int = 3):
    generator = torch.Generator().manual_seed(size)
    return torch.randn(size, 4, generator=generator), torch.randint(
        0, 3, (size,), generator=generator
    )


def test_the_teacher_inside_a_criterion_fed_the_student_is_cached():
    step = Step()
    split = split_and_verify(step, _batch(), path="calls")
    assert list(split.boundary) == ["images", "labels", "criterion_teacher__0__out"]
    assert not any(name.startswith("criterion") for name, _ in split.stage2.named_parameters())
    assert all(c.ok for c in graphsplit.verify(step, split, _batch(5)))
    assert "opened: criterion: every call takes an input that depends on a trainable" in (
        split.report()
    )


def test_with_nothing_cacheable_inside_the_refusal_names_the_module_as_before():
    """Opened, the criterion's teacher call takes a trainable input too: the split is not
    taken, and the refusal lists the calls as the probes counted them unopened."""
    with pytest.raises(graphsplit.SplitError) as caught:
        graphsplit.split(Step(shifted=True), _batch(), path="calls")
    message = str(caught.value)
    assert "criterion call 0: an input depends on a trainable parameter" in message
    assert "criterion.teacher call 0" not in message
