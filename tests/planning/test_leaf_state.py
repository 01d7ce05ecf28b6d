"""Leaf calls made while the step had changed a module under them (planning/leaf_choice.py).

Stage code calls a leaf under the state its modules hold when the stage runs; the step's Python
around the call (``unet.disable_adapters()``, ``teacher.eval()``) is not in the graph. The
tracer marks such calls, the rounds trace into them (the graph then holds what the step's state
computes), and a call no round can trace into is refused, never split as recorded.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphsplit
from graphsplit.planning.patching.module_writes import _same
from tests.helpers import batch, line_of, split_and_verify


class Scaled(nn.Module):
    """A frozen layer whose forward reads a Python flag (as peft's layers read theirs)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4).requires_grad_(False)
        self.doubled = False

    def forward(self, x):
        out = self.linear(x)
        return out * 2 if self.doubled else out


class TogglesBetweenCalls(nn.Module):
    """Two calls of one frozen leaf, the flag set for the second and set back after it."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = Scaled()
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        plain = self.encoder(x)
        self.encoder.doubled = True
        doubled = self.encoder(x)
        self.encoder.doubled = False
        return self.head(plain + doubled).pow(2).mean()


def test_a_leaf_called_under_a_changed_flag_is_traced_into_and_exact():
    model = TogglesBetweenCalls()
    split = split_and_verify(model, (batch(3, 4),), path="trace")
    assert any("encoder" in note and "changes their state" in note for note in split.notes)
    assert not any(name.startswith("encoder") for name, _ in split.stage2.named_parameters())
    # the two calls differ in the graph: the second one's doubling is an op of its own
    assert graphsplit.verify(model, split, (batch(5, 4),), seed=1)
    assert model.encoder.doubled is False  # the step's writes were undone after the trace


class Unscaled(Scaled):
    """As Scaled, but its forward keys a dict by a traced size, so no round can trace into it
    (run whole, as a leaf, it runs)."""

    def forward(self, x):
        out = self.linear(x)
        factors = {out.shape[0]: 2.0}
        return out * factors[out.shape[0]] if self.doubled else out


class TogglesAnUntraceableLeaf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = Unscaled()
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        plain = self.encoder(x)
        self.encoder.doubled = True
        doubled = self.encoder(x)
        self.encoder.doubled = False
        return self.head(plain + doubled).pow(2).mean()


def test_a_leaf_no_round_can_trace_into_is_refused_naming_the_call_and_the_write():
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(TogglesAnUntraceableLeaf(), (batch(3, 4),), path="trace")
    message = str(caught.value)
    assert "The step changes the state of encoder before this call" in message
    assert "encoder.doubled (set at" in message
    assert "self.encoder.doubled = True" in message  # the line that wrote it
    assert line_of(TogglesAnUntraceableLeaf.forward, "doubled = self.encoder(x)") in message
    assert 'path="calls"' in message


def test_the_default_path_splits_the_untraceable_case_exactly():
    model = TogglesAnUntraceableLeaf()
    split = split_and_verify(model, (batch(3, 4),))
    assert split.path == "calls"


class Teacher(nn.Module):
    """A frozen teacher whose own forward reads ``training`` (as a library's may)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4).requires_grad_(False)

    def forward(self, x):
        out = self.linear(x)
        return out * 0.5 if self.training else out


class EvalInTheStep(nn.Module):
    """``teacher.eval()`` at the top of the step: the teacher was built in train mode."""

    def __init__(self) -> None:
        super().__init__()
        self.teacher = Teacher()
        self.student = nn.Linear(4, 4)

    def forward(self, x):
        self.teacher.eval()
        target = self.teacher(x)
        return (self.student(x) - target).pow(2).mean()


def test_eval_in_the_step_is_what_the_teacher_call_computes():
    """Run as recorded, the teacher call would run in the mode the teacher has when stage 1
    runs: train mode (the trace's writes are undone), halving its output. Traced into, the
    graph holds the eval branch; the Linear under it is left a leaf (its forward reads no
    ``training``)."""
    model = EvalInTheStep()
    assert model.teacher.training
    split = graphsplit.split(model, (batch(3, 4),), path="trace")
    assert model.teacher.training  # the split leaves the user's modules as they were
    inputs = batch(3, 4)
    cached = list(split.stage1(inputs).values())
    with torch.no_grad():
        wanted = model.teacher.linear(inputs)  # the eval branch, whatever mode it is in now
    assert any(torch.equal(value, wanted) for value in cached)  # the eval branch, cached
    split_and_verify(model, (batch(3, 4),), path="trace")  # (the eager step evals the teacher)
    assert any("teacher" in note and "changes their state" in note for note in split.notes)
    assert "teacher.linear" in [n.target for n in split.graph.nodes if n.op == "call_module"]
    assert graphsplit.verify(model, split, (batch(5, 4),), seed=1)


class DropoutTeacher(Teacher):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.linear(x))


class EvalsADropoutTeacher(EvalInTheStep):
    def __init__(self) -> None:
        super().__init__()
        self.teacher = DropoutTeacher()


def test_eval_of_a_torch_dropout_no_trace_can_open_is_refused_and_auto_is_exact():
    """fx never traces into torch.nn's own modules: the Dropout's call would run in train mode
    in stage 1 (random), so the trace path refuses it; the default path runs the step's own
    ``eval()`` and caches the teacher's output exactly."""
    model = EvalsADropoutTeacher()
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(model, (batch(3, 4),), path="trace")
    message = str(caught.value)
    assert "The step changes the state of teacher.drop" in message
    assert "teacher.drop.training (set at" in message and "self.teacher.eval()" in message
    split = split_and_verify(model, (batch(3, 4),))
    assert split.path == "calls"
    assert not any(name.startswith("teacher") for name, _ in split.stage2.named_parameters())


class EvalAlreadyEval(EvalInTheStep):
    def __init__(self) -> None:
        super().__init__()
        self.teacher.eval()


def test_a_write_that_changes_nothing_leaves_the_call_a_leaf():
    model = EvalAlreadyEval()
    split = split_and_verify(model, (batch(3, 4),), path="trace")
    assert not any("changes their state" in note for note in split.notes)
    calls = [n.target for n in split.graph.nodes if n.op == "call_module"]
    assert "teacher" in calls


class CountsItsCalls(nn.Module):
    """A leaf that writes its own attribute in its forward: its business, not the step's."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4).requires_grad_(False)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.linear(x)


class CallsACounter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = CountsItsCalls()
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.encoder(x) + self.encoder(x * 2)).mean()


def test_a_leaf_writing_its_own_state_is_not_marked():
    split = split_and_verify(CallsACounter(), (batch(3, 4),), path="trace")
    assert not any("changes their state" in note for note in split.notes)
    assert [n.target for n in split.graph.nodes if n.op == "call_module"].count("encoder") == 2


@pytest.mark.parametrize(
    ("before", "after", "same"),
    [
        (True, True, True),
        (False, True, False),
        (1, 1.0, False),  # another type: another value to code that checks it
        ("default", "default", True),
        (["default"], ["default"], True),
        (["default"], ["ref"], False),
        ({"default": 2.0}, {"default": 2.0}, True),
        ({"default": 2.0}, {"default": 1.0}, False),
        (None, None, True),
        ([nn.Linear(1, 1)], [nn.Linear(1, 1)], False),  # not plain: only the same object is
    ],
)
def test_same_values(before, after, same):
    assert _same(before, after) is same
