"""A frozen teacher called as trainers call it: ``teacher(**inputs)`` with the labels (a scalar
``.loss``) and ``use_cache`` on (a ``DynamicCache``). The step reads ``.logits`` alone: the
module-level path caches the logits, leaves the rest out, and stays bit-equal to the unsplit
step; a step that reads a field the cache cannot hold is refused, naming it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

import graphsplit
from graphsplit import SplitError
from graphsplit.calls import Verdict
from tests.integrations.kd import VOCAB, padded_samples, tiny_llama


def tiny_gpt2(seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    return GPT2LMHeadModel(config)


TEACHERS = {"llama": lambda: tiny_llama(1, 16), "gpt2": lambda: tiny_gpt2(1)}


class Distill(nn.Module):
    """The trainer example's step: the teacher gets every input, labels included."""

    def __init__(self, teacher: nn.Module, read: str = "logits") -> None:
        super().__init__()
        self.student = tiny_llama(0, 16).train()
        self.teacher = teacher.eval().requires_grad_(False)
        self.read = read

    def forward(self, input_ids, attention_mask, labels):
        with torch.no_grad():
            teacher = self.teacher(
                input_ids=input_ids, attention_mask=attention_mask, labels=labels, use_cache=True
            )
            if self.read == "logits":
                teacher_logits = teacher.logits
            elif self.read == "key":
                teacher_logits = teacher["logits"]
            elif self.read == "loss":
                teacher_logits = teacher.logits * teacher.loss
            else:  # "index": [1] is the logits while a loss is there
                teacher_logits = teacher[1]
        student = self.student(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        distill = F.kl_div(
            F.log_softmax(student.logits, dim=-1),
            F.log_softmax(teacher_logits, dim=-1),
            log_target=True,
            reduction="batchmean",
        )
        return 0.5 * student.loss + 0.5 * distill


def _batch(size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    samples = padded_samples(size, seed)
    return {name: torch.stack([s[name] for s in samples]) for name in samples[0]}


def _run(step: nn.Module, run) -> tuple[torch.Tensor, list[torch.Tensor]]:
    for param in step.parameters():
        param.grad = None
    loss = run()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in step.parameters() if p.requires_grad]


@pytest.mark.parametrize("read", ["logits", "key"])
@pytest.mark.parametrize("teacher", sorted(TEACHERS))
@pytest.mark.parametrize("size", [1, 2, 3])
def test_the_teachers_logits_are_cached_and_the_rest_left_out_bit_equal(teacher, size, read):
    step = Distill(TEACHERS[teacher](), read)
    batch = _batch(size)
    split = graphsplit.split(step, kwargs=batch, path="calls")
    planned = split.plan.cached[("teacher", 0)]
    assert list(planned.keys) == ["logits"]
    assert "loss" in planned.structure.left_out
    assert "teacher__0__logits" in split.boundary
    for seed in (0, 1):  # the example batch and another one
        other = _batch(size, seed)
        torch.manual_seed(seed)
        want = _run(step, lambda other=other: step(**other))
        boundary = split.stage1(**other)
        torch.manual_seed(seed)
        got = _run(step, lambda boundary=boundary: split.stage2(**boundary))
        assert torch.equal(want[0], got[0])
        assert all(torch.equal(a, b) for a, b in zip(want[1], got[1]))


@pytest.mark.parametrize(
    "read, verdict, words",
    [
        ("loss", Verdict.NOT_PER_SAMPLE, "(loss)"),
        ("index", Verdict.NON_TENSOR, "the step reads the output as a whole ([1])"),
    ],
)
def test_a_step_reading_a_field_the_cache_cannot_hold_is_refused(read, verdict, words):
    step = Distill(tiny_llama(1, 16), read)
    with pytest.raises(SplitError) as caught:
        graphsplit.split(step, kwargs=_batch(2), path="calls")
    message = str(caught.value)
    assert "teacher call 0" in message and words in message
    assert verdict.why in message
    assert "fix:" in message


def test_stage2s_answer_refuses_a_field_the_plan_left_out():
    step = Distill(tiny_llama(1, 16))
    batch = _batch(2)
    split = graphsplit.split(step, kwargs=batch, path="calls")
    boundary = split.stage1(**batch)
    step.read = "loss"  # the step now reads a field the example batch's step did not
    with pytest.raises(SplitError) as caught:
        split.stage2(**boundary)
    message = str(caught.value)
    assert "reads .loss of teacher call 0's output" in message
    assert "left out" in message and "fix:" in message


class Plain(nn.Module):
    """The teacher called without labels or a cache: its output is cacheable whole."""

    def __init__(self) -> None:
        super().__init__()
        self.teacher = tiny_llama(1, 16).eval().requires_grad_(False)
        self.head = nn.Linear(VOCAB, 1)
        self.seen: list[type] = []

    def forward(self, input_ids):
        out = self.teacher(input_ids=input_ids, use_cache=False)
        self.seen.append(type(out))
        return self.head(out[0]).sum()


def test_an_output_cacheable_whole_keeps_its_class_and_is_cached_whole():
    step = Plain()
    input_ids = _batch(2)["input_ids"]
    split = graphsplit.split(step, (input_ids,), path="calls")
    assert split.plan.cached[("teacher", 0)].structure.left_out == ()
    assert {t.__name__ for t in step.seen} == {"CausalLMOutputWithPast"}
    assert all(t is type(step.teacher(input_ids=input_ids[:1], use_cache=False)) for t in step.seen)
    want = step(input_ids)
    assert torch.equal(split.stage2(**split.stage1(input_ids)), want)
