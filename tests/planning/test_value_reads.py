"""Frozen value reads: planned one sample per batch, a value read off frozen data is answered.

The steps are tiny inline versions of DiffSynth's ``model_fn_qwen_image``: a function that
reads prompt lengths off a frozen mask (``mask.sum(dim=1).tolist()``) and then runs the
trainable head, so it cannot be one opaque stage-1 step. Planned at batch 1, the plan holds the
example's value, stage 2 uses it as a literal, and stage 1 checks it on every batch: the same
value splits bit for bit, another value stops in stage 1 naming the user's line. Reads that
depend on a trainable parameter or a random draw, reads at batch > 1 and reads needing frozen
weights that are on ``meta`` stay errors, each message checked.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import graphsplit
from graphsplit.errors import TensorValueError
from graphsplit.planning.opaque.value_reads import answered_reads, value_checks
from tests.helpers import frozen, line_of, split_and_verify

VOCAB, TOKENS, WIDTH = 16, 6, 4


def prompt(length: int, *, seed: int = 0, size: int = 1) -> dict[str, torch.Tensor]:
    """Token ids padded to ``TOKENS``, a mask of ``length`` ones, a regression target."""
    generator = torch.Generator().manual_seed(seed)
    mask = torch.zeros(size, TOKENS, dtype=torch.long)
    mask[:, :length] = 1
    return {
        "ids": torch.randint(0, VOCAB, (size, TOKENS), generator=generator),
        "mask": mask,
        "target": torch.randn(size, length, generator=generator),
    }


def model_fn(head: nn.Module, table: torch.Tensor, states, mask, target):
    """DiffSynth's pattern: lengths read as Python ints, then the trainable model runs."""
    lengths = mask.sum(dim=1).tolist()
    longest = max(lengths)
    scores = head(states).squeeze(-1)[:, :longest]  # a slice bound, on the trainable side
    return F.mse_loss(scores + table[:longest].sum(-1), target)


class ReadsPromptLengths(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = frozen(nn.Embedding(VOCAB, WIDTH))
        self.head = nn.Linear(WIDTH, 1)
        self.register_buffer("table", torch.randn(TOKENS, WIDTH))

    def forward(self, ids, mask, target):
        return model_fn(self.head, self.table, self.embed(ids), mask, target)


def test_a_frozen_value_read_beside_trainable_code_splits_exactly_at_batch_one():
    step = ReadsPromptLengths()
    split = split_and_verify(step, (), prompt(4))
    (read,) = answered_reads(split.graph)
    assert read.value == [4]
    assert read.read_at.endswith("lengths = mask.sum(dim=1).tolist()")
    assert line_of(model_fn, ".tolist()") in read.read_at
    notes = [note for note in split.notes if note.startswith("the value read at")]
    assert len(notes) == 1 and "[4]" in notes[0] and "stage 1 checks it" in notes[0]
    # Stage 1 checks the value; stage 2 slices with the literal and never reads the mask.
    assert "graphsplit_runtime_check_value(" in split.stage1.code
    assert "check_value" not in split.stage2.code
    assert "mask" not in split.stage2.code
    assert "slice(None, 4, None)" in split.stage2.code


def test_another_sample_with_the_same_value_runs_through_the_plan_bit_for_bit():
    step = ReadsPromptLengths()
    split = graphsplit.split(step, kwargs=prompt(4))
    other = prompt(4, seed=7)
    expected = step(**other)
    assert torch.equal(split.stage2(**split.stage1(**other)), expected)


def test_a_sample_reading_another_value_stops_in_stage_1_naming_the_line():
    split = graphsplit.split(ReadsPromptLengths(), kwargs=prompt(4), max_plans=1)
    with pytest.raises(graphsplit.SplitError) as caught:
        split.stage1(**prompt(3))
    message = str(caught.value)
    assert "this plan was made for the value [4] read from frozen data here (.tolist())" in message
    assert "got [3]" in message
    assert line_of(model_fn, ".tolist()") in message
    assert "lengths = mask.sum(dim=1).tolist()" in message
    assert "fix:    pass a larger max_plans to graphsplit.split" in message


def test_the_checks_line_is_held_beside_stage_1s_code_not_in_it():
    """Stage 1's code is fingerprinted: a moved line must not make a cache stale."""
    split = graphsplit.split(ReadsPromptLengths(), kwargs=prompt(4))
    assert "test_value_reads.py" not in split.stage1.code
    (check,) = value_checks(split.graph)
    assert any("tolist()" in line for line in split.stage1.graphsplit_check_sources)
    assert check in split.cut.stage1 and check not in split.cut.stage2


def test_a_bool_and_an_int_read_of_frozen_data_are_answered_and_checked():
    def gate(head, states, mask, target):
        if mask[:, -1].any():  # bool() of a frozen tensor
            states = states * 2
        count = int(mask.sum())  # int() of one
        return F.mse_loss(head(states[:, :count]).squeeze(-1), target)

    class Gates(ReadsPromptLengths):
        def forward(self, ids, mask, target):
            return gate(self.head, self.embed(ids), mask, target)

    split = split_and_verify(Gates(), (), prompt(5))

    split.plan_set.max_plans = 1  # refuse another size, make no plan for it
    reads = answered_reads(split.graph)
    assert [(read.read.value, read.value) for read in reads] == [("bool", False), ("int", 5)]
    with pytest.raises(graphsplit.SplitError, match=r"the value False .*got True"):
        split.stage1(**prompt(TOKENS))


class ReadsTheHeadsOutput(ReadsPromptLengths):
    """The value read depends on the trainable head: no plan can hold it."""

    def forward(self, ids, mask, target):
        scores = self.head(self.embed(ids)).squeeze(-1)
        return reads_scores(scores, target)


def reads_scores(scores, target):
    if scores.sum().item() > 0:
        scores = scores * 2
    return F.mse_loss(scores[:, : target.shape[1]], target)


def test_a_value_read_of_trainable_data_stays_an_error_naming_the_line():
    with pytest.raises(TensorValueError) as caught:
        graphsplit.split(ReadsTheHeadsOutput(), kwargs=prompt(4), path="trace")
    message = str(caught.value)
    assert line_of(reads_scores, ".item()") in message
    assert "fix:    replace .item()/.tolist()/nonzero-style code with tensor ops" in message


class ReadsARandomDraw(ReadsPromptLengths):
    def forward(self, ids, mask, target):
        return reads_a_draw(self.head, self.embed(ids), mask, target)


def reads_a_draw(head, states, mask, target):
    keep = int(torch.randint(1, 5, (1,)).item())
    return F.mse_loss(head(states[:, :keep]).squeeze(-1).sum(1), target.sum(1))


def test_a_value_read_of_a_random_draw_is_refused_and_the_rng_does_not_move():
    step, batch = ReadsARandomDraw(), prompt(4)
    torch.manual_seed(3)
    before = torch.get_rng_state()
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(step, kwargs=batch, path="trace")
    assert torch.equal(torch.get_rng_state(), before)
    message = str(caught.value)
    assert line_of(reads_a_draw, ".item()") in message
    assert "fix:" in message


def test_at_batch_two_a_value_samples_do_not_share_is_not_answered_and_names_the_line():
    """With several samples per batch only a value every sample shares is answered
    (tests/signatures/test_batched_value_reads.py); lengths 4 and 3 are refused."""
    example = prompt(4, size=2)
    example["mask"][1, 3:] = 0
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(ReadsPromptLengths(), kwargs=example, path="trace")
    message = str(caught.value)
    assert line_of(model_fn, ".tolist()") in message or "model_fn" in message
    assert "fix:" in message


class ReadsEncoded(ReadsPromptLengths):
    """The mask the lengths are read from now comes out of the frozen embedding."""

    def forward(self, ids, mask, target):
        states = self.embed(ids)
        mask = mask * (states.sum(-1) != 0)
        return model_fn(self.head, self.table, states, mask, target)


def test_a_value_read_needing_frozen_weights_on_meta_is_refused_with_what_to_do():
    step = ReadsEncoded()
    step.embed.to("meta")
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(step, kwargs=prompt(4), path="trace")
    message = str(caught.value)
    assert "is on the meta device" in message
    assert line_of(model_fn, ".tolist()") in message
    assert "fix:    load the frozen weights" in message


def test_a_value_read_of_frozen_work_splits_with_the_work_in_stage_1():
    split = split_and_verify(ReadsEncoded(), (), prompt(4))
    assert [read.value for read in answered_reads(split.graph)] == [[4]]
    assert not any(name.startswith("embed") for name, _ in split.stage2.named_parameters())


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(planned=st.integers(1, TOKENS), lengths=st.lists(st.integers(1, TOKENS), max_size=4))
def test_a_plan_runs_every_sample_of_its_value_exactly_and_refuses_every_other(planned, lengths):
    """Whatever length the plan was made at, each later sample either runs bit for bit as the
    unsplit step does (same length) or stops in stage 1 before anything runs in stage 2."""
    step = ReadsPromptLengths()
    split = graphsplit.split(step, kwargs=prompt(planned), max_plans=1)
    for seed, length in enumerate(lengths, start=1):
        sample = prompt(length, seed=seed)
        if length == planned:
            assert torch.equal(split.stage2(**split.stage1(**sample)), step(**sample))
        else:
            with pytest.raises(
                graphsplit.SplitError, match=rf"value \[{planned}\].*got \[{length}\]"
            ):
                split.stage1(**sample)
