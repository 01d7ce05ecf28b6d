"""``split(path=...)``: the fallback from the trace to the module-level path, and its refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphsplit
import graphsplit.api
from graphsplit.errors import Fix, user_error
from tests.helpers import line_of


class PerSampleLoop(nn.Module):
    """A Python loop over the batch (the trace refuses it); a frozen encoder of the batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(4, 4).requires_grad_(False)
        self.head = nn.Linear(4, 1)

    def forward(self, x, keep):
        h = self.encoder(x)
        rows = [row if k else torch.zeros_like(row) for row, k in zip(h, keep)]
        return self.head(torch.stack(rows)).square().mean()


class LoopAndNoisyEncoder(PerSampleLoop):
    """As above, but the only frozen call is fed a random draw: both paths refuse."""

    def forward(self, x, keep):
        h = self.encoder(x + torch.randn_like(x))
        rows = [row if k else torch.zeros_like(row) for row, k in zip(h, keep)]
        return self.head(torch.stack(rows)).square().mean()


def example(size: int = 3):
    return torch.randn(size, 4), [i % 2 == 0 for i in range(size)]


@pytest.mark.parametrize("size", [2, 3])
def test_auto_falls_back_and_the_report_says_why(size):
    step = PerSampleLoop()
    split = graphsplit.split(step, example(size))
    assert isinstance(split, graphsplit.CallSplit) and split.path == "calls"
    report = split.report()
    assert report.startswith("graphsplit plan for PerSampleLoop (module-level path)")
    assert "path: calls, because the whole-step trace refused the step:" in report
    assert "Python control flow depends on the batch size" in split.reason
    assert "encoder call 0: cached" in report
    assert "answered from the cache in stage 2 (weights not held, may stay on meta): encoder" in (
        report
    )
    assert split.to_json()["path"] == "calls"
    assert split.to_json()["calls"][0]["verdict"] == "cached"
    assert all(c.ok for c in graphsplit.verify(step, split, example(size)))


def test_a_step_the_trace_splits_takes_the_trace():
    step = nn.Sequential(nn.Linear(4, 4).requires_grad_(False), nn.Linear(4, 1))
    split = graphsplit.split(step, (torch.randn(3, 4),))
    assert isinstance(split, graphsplit.Split) and split.path == "trace"


def test_path_trace_keeps_the_refusal():
    with pytest.raises(graphsplit.TraceError, match="Python control flow depends on the batch"):
        graphsplit.split(PerSampleLoop(), example(), path="trace")


def test_when_both_paths_refuse_the_trace_error_is_raised_with_the_calls_refusal_as_cause():
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(LoopAndNoisyEncoder(), example())
    error = caught.value
    assert "Python control flow depends on the batch size" in str(error)
    assert isinstance(error.__cause__, graphsplit.SplitError)
    assert "encoder call 0: an input differs between two runs" in str(error.__cause__)
    notes = "\n".join(getattr(error, "__notes__", []))
    assert 'also tried the module-level path (path="calls"), which refused too' in notes
    # The calls path's whole reason, its verdict list included (not its first line alone).
    assert "no frozen module call whose inputs are a function of the sample alone:\n" in notes
    assert "encoder call 0: an input differs between two runs under different seeds" in notes


def test_the_report_quotes_the_traces_whole_refusal_its_notes_included(monkeypatch):
    """A trace refusal may carry notes (a value not every sample shares adds the bucketing
    fix as one): the fallback's reason is the refusal as a traceback shows it."""
    refusal = user_error(
        graphsplit.TraceError,
        "the step reads a tensor's value",
        fix=Fix("read it after the frozen calls"),
        source="step.py:12  if x.sum() > 0:",
    )
    refusal.add_note("the value differs between samples: batch by it")

    def refuse(*args, **kwargs):
        raise refusal

    monkeypatch.setattr(graphsplit.api, "_split_traced", refuse)
    split = graphsplit.split(PerSampleLoop(), example())
    assert split.reason == str(refusal) + "\nthe value differs between samples: batch by it"
    lines = split.report().splitlines()
    start = lines.index("path: calls, because the whole-step trace refused the step:")
    assert lines[start + 1 : start + 5] == [
        "    the step reads a tensor's value",
        "      source: step.py:12  if x.sum() > 0:",
        "      fix:    read it after the frozen calls",
        "    the value differs between samples: batch by it",
    ]


def test_an_unknown_path_is_refused_with_the_paths_there_are():
    with pytest.raises(graphsplit.SplitError) as caught:
        graphsplit.split(PerSampleLoop(), example(), path="module")
    assert "path='module' is not a path graphsplit.split knows" in str(caught.value)
    assert 'pass path="auto" (default), "trace" or "calls"' in str(caught.value)


class UnfrozenTeacher(nn.Module):
    """A teacher put in ``eval()`` and called under ``no_grad`` but never frozen (TRL's KTO
    reference as the trainer leaves it), beside a Python loop over the batch."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.teacher = nn.Sequential(nn.Linear(4, 4), nn.Tanh()).eval()
        self.student = nn.Linear(4, 4)

    def forward(self, x, keep):
        with torch.no_grad():
            target = self.teacher(x)
        rows = [row if k else torch.zeros_like(row) for row, k in zip(self.student(x), keep)]
        return (torch.stack(rows) - target).square().mean()


def test_a_module_run_only_under_no_grad_but_not_frozen_is_named_with_the_fix():
    step = UnfrozenTeacher()
    with pytest.raises(graphsplit.SplitError) as caught:
        graphsplit.split(step, example(), path="calls")
    message = str(caught.value)
    assert "(the step calls no frozen module)" in message
    (line,) = [line for line in message.splitlines() if "teacher: every call" in line]
    assert "teacher: every call ran under no_grad (first at " in line
    assert line_of(UnfrozenTeacher.forward, "target = self.teacher(x)") in line
    assert "target = self.teacher(x)" in line
    assert "fix:    if teacher is not trained, freeze it before splitting" in message
    assert "(teacher.requires_grad_(False))" in message
    assert "student" not in message  # run with gradients: it may be trained

    with pytest.raises(graphsplit.TraceError) as caught:  # path="auto": the note carries it
        graphsplit.split(step, example())
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "it suggests: if teacher is not trained, freeze it before splitting" in notes

    step.teacher.requires_grad_(False)  # the fix: the teacher's call is cached
    split = graphsplit.split(step, example())
    assert split.path == "calls" and "teacher call 0: cached" in split.report()
    assert all(c.ok for c in graphsplit.verify(step, split, example()))
