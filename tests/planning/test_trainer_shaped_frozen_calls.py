"""Frozen calls as trainers make them: a teacher that also returns a batch loss, library code
that asks autocast about its tensors' device (planning/leaf_rounds.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import graphsplit


class TeacherWithLoss(nn.Module):
    """Like a ``*ForCausalLM`` called with ``labels``: per-sample logits and a batch-mean loss."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 5)

    def forward(self, x, labels):
        logits = self.head(torch.tanh(self.body(x)))
        return F.cross_entropy(logits, labels), logits


class AsksAutocast(nn.Module):
    """Like TRL's chunked log-prob kernel: reads autocast's state for its input's device."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 5)

    def forward(self, x):
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        return self.linear(x.to(dtype))


def _student_step(frozen: nn.Module, student: nn.Module, call):
    def step(x, labels):
        with torch.no_grad():
            target = call(frozen, x, labels)
        return F.kl_div(
            F.log_softmax(student(x), -1), F.log_softmax(target, -1), log_target=True,
            reduction="batchmean",
        )  # fmt: skip

    return step


def test_a_teacher_returning_an_unused_batch_loss_still_has_its_logits_cached():
    torch.manual_seed(0)
    teacher, student = TeacherWithLoss().requires_grad_(False), nn.Linear(8, 5)
    step = _student_step(teacher, student, lambda t, x, labels: t(x, labels)[1])
    x, labels = torch.randn(4, 8), torch.randint(0, 5, (4,))
    split = graphsplit.split(step, (x, labels))
    assert "frozen" not in dict(split.stage2.named_children())  # the teacher, by its name here
    assert any(note.startswith("traced into frozen") for note in split.notes)
    assert all(spec.batch_dim == 0 for spec in split.boundary.values())
    graphsplit.verify(step, split, (x, labels))  # bit for bit
    assert torch.equal(split.stage2(**split.stage1(x, labels)), step(x, labels))


def test_frozen_code_asking_autocast_about_its_device_is_planned_and_exact():
    torch.manual_seed(0)
    frozen, student = AsksAutocast().requires_grad_(False), nn.Linear(8, 5)
    step = _student_step(frozen, student, lambda f, x, labels: f(x))
    x, labels = torch.randn(4, 8), torch.randint(0, 5, (4,))
    split = graphsplit.split(step, (x, labels))
    assert "frozen" not in dict(split.stage2.named_children())
    graphsplit.verify(step, split, (x, labels))
    assert torch.is_autocast_enabled("cpu") is False  # the planning's answer is undone
