"""Frozen code that reads tensor values runs as one opaque stage-1 step (issue 11 item 2).

Each model is a tiny inline step: a frozen embedding whose states are trimmed to each prompt's
length by Python code that reads the mask (``.tolist()``, a tensor slice bound, a boolean-mask
gather), then a trainable head. The trimming function is recorded as one node that stage 1 runs
eagerly on the real batch; stage 2 never contains it; split + verify is bit-exact. Every
refusal (value-dependent code on the trainable side, random draws inside it, frozen weights on
meta, samples mixed at batch > 1) checks its message: the function, the user's line, the fix.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphsplit
from graphsplit.caching.format.fingerprint import differences, fingerprint
from graphsplit.errors import TensorValueError
from graphsplit.planning.rules.opaque_call import OPAQUE, is_opaque
from tests.helpers import frozen, line_of, split_and_verify
from tests.planning import opaque_functions
from tests.planning.opaque_functions import trim_to_lengths

VOCAB, TOKENS, WIDTH = 16, 6, 4


def prompts(size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, a padding mask of a different length per sample, a regression target."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (size, TOKENS), generator=generator)
    mask = torch.ones(size, TOKENS, dtype=torch.long)
    for row in range(size):
        mask[row, 2 + (row + seed) % (TOKENS - 2) :] = 0
    return ids, mask, torch.randn(size, TOKENS, generator=generator)


def opaque_nodes(split: graphsplit.Split) -> list[torch.fx.Node]:
    return [node for node in split.graph.nodes if is_opaque(node)]


class TrimsWithToList(nn.Module):
    """``for i, length in enumerate(mask.sum(1).tolist()): states[i, length:] = 0``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = frozen(nn.Embedding(VOCAB, WIDTH))
        self.head = nn.Linear(WIDTH, 1)

    def encode(self, ids, mask):
        states = self.embed(ids)
        for i, length in enumerate(mask.sum(dim=1).tolist()):
            states[i, length:] = 0
        return states

    def forward(self, ids, mask, target):
        states = self.encode(ids, mask)
        return F.mse_loss(self.head(states).squeeze(-1), target)


def test_a_tolist_loop_in_frozen_code_runs_in_stage_1_and_splits_exactly():
    torch.manual_seed(0)
    step = TrimsWithToList()
    split = split_and_verify(step, prompts(3))
    (node,) = opaque_nodes(split)
    assert node in split.cut.stage1 and node not in split.cut.stage2
    assert node.meta[OPAQUE].label == "TrimsWithToList.encode"
    assert line_of(TrimsWithToList.encode, ".tolist()") in node.meta[OPAQUE].read_at
    assert node.meta[OPAQUE].batch_dims == (0,)
    # One readable line in stage 1; stage 2 starts from its cached output.
    calls = [line for line in split.stage1.code.splitlines() if "encode(ids, mask)" in line]
    assert len(calls) == 1 and calls[0].strip().startswith("encode = ")
    assert "encode" in split.boundary and "encode(" not in split.stage2.code
    assert any("TrimsWithToList.encode runs eagerly in stage 1" in note for note in split.notes)
    # Another batch, of another size, through the same plan: the same loss and gradients.
    other = prompts(2, seed=5)
    expected = step(*other)
    assert torch.equal(split.stage2(**split.stage1(*other)), expected)


def test_stage_1_holds_the_frozen_weights_an_opaque_call_reads():
    torch.manual_seed(0)
    step = TrimsWithToList()
    split = graphsplit.split(step, prompts(3))
    assert split.stage1.get_parameter("embed.weight") is step.embed.weight
    assert [name for name, _ in split.stage2.named_parameters()] == ["head.weight", "head.bias"]
    before = fingerprint(split)
    with torch.no_grad():
        step.embed.weight.add_(1.0)  # another text encoder: the cache is stale
    assert differences(before, fingerprint(split)) == ("weights",)


def test_saved_stage_1_code_binds_the_opaque_call_from_the_live_stage(tmp_path):
    torch.manual_seed(0)
    split = graphsplit.split(TrimsWithToList(), prompts(3))
    folder = split.save_code(tmp_path / "code")
    namespace: dict = {}
    exec(compile((folder / "stage1.py").read_text(), "stage1.py", "exec"), namespace)
    assert namespace["Stage1"].OPAQUE_CALLS == ("tests_planning_test_opaque_encode",)
    saved = namespace["Stage1"](split.stage1)
    batch = prompts(2, seed=7)
    expected, got = split.stage1(*batch), saved(*batch)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[key], got[key]) for key in expected)


def _frozen_trim(states, mask):
    """A module-level function (looked up as a global) with a tensor value as a slice bound."""
    states = states.clone()
    for row, length in zip(states, mask.sum(dim=1)):
        row[length:] = 0
    return states


class TrimsInAGlobalFunction(TrimsWithToList):
    def forward(self, ids, mask, target):
        states = _frozen_trim(self.embed(ids), mask)
        return F.mse_loss(self.head(states).squeeze(-1), target)


class GathersInAStaticMethod(TrimsWithToList):
    """``states[mask.bool()]``, a boolean-mask gather, in a static method, restacked per row."""

    @staticmethod
    def masked_mean(states, mask):
        rows = [row[keep.bool()].mean(dim=0) for row, keep in zip(states, mask)]
        return torch.stack(rows)

    def forward(self, ids, mask, target):
        pooled = self.masked_mean(self.embed(ids), mask)
        return F.mse_loss(self.head(pooled).squeeze(-1), target[:, 0])


class CallsAStoredFunction(TrimsWithToList):
    """DiffSynth's ``pipe.model_fn = model_fn_wan_video``: the function is an instance attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.trim = _frozen_trim

    def forward(self, ids, mask, target):
        states = self.trim(self.embed(ids), mask)
        return F.mse_loss(self.head(states).squeeze(-1), target)


class CallsAnImportedFunction(TrimsWithToList):
    """``from module import function``: the call looks the name up in this module."""

    def forward(self, ids, mask, target):
        states = trim_to_lengths(self.embed(ids), mask)
        return F.mse_loss(self.head(states).squeeze(-1), target)


@pytest.mark.parametrize("step_type", [CallsAStoredFunction, CallsAnImportedFunction])
def test_a_function_held_by_an_instance_or_imported_by_name_is_patched_there(step_type):
    torch.manual_seed(0)
    step = step_type()
    split = split_and_verify(step, prompts(3))
    (node,) = opaque_nodes(split)
    assert node in split.cut.stage1 and node not in split.cut.stage2
    # Patched for the trace only: the step holds its own objects again.
    assert getattr(step, "trim", _frozen_trim) is _frozen_trim
    assert trim_to_lengths is opaque_functions.trim_to_lengths
    batch = prompts(3, seed=5)
    assert torch.equal(split.stage2(**split.stage1(*batch)), step(*batch))


@pytest.mark.parametrize("step_type", [TrimsInAGlobalFunction, GathersInAStaticMethod])
def test_module_functions_and_static_methods_are_patched_where_they_are_looked_up(step_type):
    torch.manual_seed(0)
    split = split_and_verify(step_type(), prompts(3))
    (node,) = opaque_nodes(split)
    assert node in split.cut.stage1 and node not in split.cut.stage2


class ReturnsLengths(TrimsWithToList):
    """The innermost function returns Python ints: its caller becomes the opaque step."""

    def lengths(self, mask):
        return mask.sum(dim=1).tolist()

    def encode(self, ids, mask):
        states = self.embed(ids)
        for i, length in enumerate(self.lengths(mask)):
            states[i, length:] = 0
        return states


def test_a_function_returning_values_read_from_tensors_makes_its_caller_opaque():
    torch.manual_seed(0)
    split = split_and_verify(ReturnsLengths(), prompts(3))
    (node,) = opaque_nodes(split)
    assert node.meta[OPAQUE].label == "ReturnsLengths.encode"


def test_at_batch_one_the_opaque_output_is_the_one_samples():
    torch.manual_seed(0)
    step = TrimsWithToList()
    ids, mask, target = prompts(1)
    split = split_and_verify(step, (ids, mask, target))
    assert split.batch_sizes == (1, 1)
    assert any(note.startswith("one sample per batch") for note in split.notes)
    (node,) = opaque_nodes(split)
    assert node in split.cut.stage1
    other = prompts(1, seed=3)
    assert torch.equal(split.stage2(**split.stage1(*other)), step(*other))


# -- refusals -------------------------------------------------------------------------------------
class TrimsTrainableStates(TrimsWithToList):
    """The same loop, on the trainable head's output: value-dependent code, trainable side."""

    def trim(self, scores, mask):
        for i, length in enumerate(mask.sum(dim=1).tolist()):
            scores[i, length:] = 0
        return scores

    def forward(self, ids, mask, target):
        scores = self.head(self.embed(ids)).squeeze(-1)
        return F.mse_loss(self.trim(scores, mask), target)


def test_value_dependent_code_on_a_trainable_value_is_refused_naming_the_line_and_fix():
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(TrimsTrainableStates(), prompts(3), path="trace")
    message = str(caught.value)
    assert "TrimsTrainableStates.trim reads tensor values" in message
    assert "depend on a trainable parameter" in message
    assert "never allowed on the trainable side" in message
    assert "node:   trim" in message
    assert line_of(TrimsTrainableStates.trim, ".tolist()") in message
    assert "fix:    replace .item()/.tolist()" in message


class ReadsTheHeadInside(TrimsWithToList):
    """Frozen inputs, but the function itself calls the trainable head."""

    def encode(self, ids, mask):
        states = self.head(self.embed(ids))
        for i, length in enumerate(mask.sum(dim=1).tolist()):
            states[i, length:] = 0
        return states

    def forward(self, ids, mask, target):
        return F.mse_loss(self.encode(ids, mask).squeeze(-1), target)


def test_an_opaque_function_reading_a_trainable_parameter_is_refused():
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(ReadsTheHeadInside(), prompts(3), path="trace")
    message = str(caught.value)
    assert "reads the trainable parameter head.weight" in message
    assert line_of(ReadsTheHeadInside.encode, ".tolist()") in message
    assert "fix:" in message


class DrawsInside(TrimsWithToList):
    def encode(self, ids, mask):
        states = self.embed(ids) + 0.1 * torch.randn(ids.shape[0], TOKENS, WIDTH)
        for i, length in enumerate(mask.sum(dim=1).tolist()):
            states[i, length:] = 0
        return states


def test_an_opaque_function_drawing_random_numbers_is_refused_and_the_rng_does_not_move():
    torch.manual_seed(0)
    step, batch = DrawsInside(), prompts(3)
    before = torch.get_rng_state()
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(step, batch, path="trace")
    assert torch.equal(torch.get_rng_state(), before)
    message = str(caught.value)
    assert "DrawsInside.encode reads tensor values" in message
    assert "draws random numbers (torch generator)" in message
    assert line_of(DrawsInside.encode, ".tolist()") in message
    assert "fix:    draw the random numbers outside this function" in message


def test_an_opaque_function_whose_frozen_weights_are_on_meta_is_refused_with_what_to_do():
    step = TrimsWithToList()
    with torch.device("meta"):
        step.embed = frozen(nn.Embedding(VOCAB, WIDTH))
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(step, prompts(3), path="trace")
    message = str(caught.value)
    assert "the frozen tensor embed.weight is on the meta device" in message
    assert "runs it once on the example batch" in message
    assert line_of(TrimsWithToList.encode, ".tolist()") in message
    assert "fix:    load the frozen weights this function uses" in message


class PadsToTheLongest(TrimsWithToList):
    """The pipelines' trim-and-pad: each prompt cut to its length, padded to the batch's longest."""

    def encode(self, ids, mask):
        states = self.embed(ids)
        trimmed = [row[:length] for row, length in zip(states, mask.sum(dim=1).tolist())]
        longest = max(row.shape[0] for row in trimmed)
        return torch.stack([F.pad(row, (0, 0, 0, longest - row.shape[0])) for row in trimmed])

    def forward(self, ids, mask, target):
        states = self.encode(ids, mask)
        return F.mse_loss(self.head(states).squeeze(-1).sum(1), target[:, 0])


def test_batch_mixing_opaque_code_is_refused_at_batch_two_and_splits_at_batch_one():
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(PadsToTheLongest(), prompts(3), path="trace")
    message = str(caught.value)
    assert "PadsToTheLongest.encode reads tensor values and mixes the samples" in message
    assert line_of(PadsToTheLongest.encode, ".tolist()") in message
    assert "fix:    plan at batch 1: pass an example batch of one sample" in message
    torch.manual_seed(0)
    split = split_and_verify(PadsToTheLongest(), prompts(1))
    assert split.batch_sizes == (1, 1)


class LoopsOverTrimmedTokens(TrimsWithToList):
    """Stage-1 code after the opaque call reads its output's length as a Python number."""

    def __init__(self) -> None:
        super().__init__()
        self.project = frozen(nn.Linear(WIDTH, WIDTH))  # frozen work: the loop is in stage 1

    def encode(self, ids, mask):
        return self.embed(ids)[:, : int(mask.sum())]

    def forward(self, ids, mask, target):
        states = self.encode(ids, mask)
        total = sum(states[:, position] for position in range(states.shape[1]))
        return F.mse_loss(self.head(self.project(total)).squeeze(-1), target[:, 0])


def test_an_opaque_output_size_read_as_a_number_is_rechecked_when_stage_1_runs():
    torch.manual_seed(0)
    step = LoopsOverTrimmedTokens()
    split = split_and_verify(step, prompts(1))  # a prompt of 2 tokens: a loop of 2
    (node,) = opaque_nodes(split)
    assert node.target.shapes == ((1, 2, WIDTH),)
    same_length = prompts(1, seed=4)  # 2 tokens again
    assert torch.equal(split.stage2(**split.stage1(*same_length)), step(*same_length))
    with pytest.raises(graphsplit.SplitError) as caught:
        split.stage1(*prompts(1, seed=1))  # 3 tokens
    message = str(caught.value)
    assert "returned a tensor of shape (1, 3, 4)" in message
    assert "this plan was made for (1, 2, 4)" in message
    assert "fix:    keep the output's size fixed" in message


class ReturnsOneTensorPerToken(TrimsWithToList):
    """An opaque output whose structure follows the data: one tensor per kept token."""

    def encode(self, ids, mask):
        return list(self.embed(ids)[:, : int(mask.sum())].unbind(1))

    def forward(self, ids, mask, target):
        tokens = torch.stack(self.encode(ids, mask), dim=1)
        return F.mse_loss(self.head(tokens).squeeze(-1).sum(1), target[:, 0])


def test_an_opaque_output_of_another_structure_is_refused_when_stage_1_runs():
    torch.manual_seed(0)
    split = split_and_verify(ReturnsOneTensorPerToken(), prompts(1))  # 2 tokens: 2 tensors
    with pytest.raises(graphsplit.SplitError) as caught:
        split.stage1(*prompts(1, seed=1))  # 3 tokens
    message = str(caught.value)
    assert "but this plan was made for its output structure" in message
    assert "fix:    make the function return the same structure" in message


class NormalisesInTrainMode(TrimsWithToList):
    """A frozen BatchNorm left in train mode inside the opaque function."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = frozen(nn.BatchNorm1d(WIDTH)).train()

    def encode(self, ids, mask):
        states = self.norm(self.embed(ids).transpose(1, 2)).transpose(1, 2)
        for i, length in enumerate(mask.sum(dim=1).tolist()):
            states[i, length:] = 0
        return states


def test_an_opaque_function_writing_the_models_buffers_is_refused_and_the_write_undone():
    torch.manual_seed(0)
    step = NormalisesInTrainMode()
    before = {name: buffer.clone() for name, buffer in step.norm.named_buffers()}
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(step, prompts(1), path="trace")
    message = str(caught.value)
    assert "writes into the model's norm.num_batches_tracked, norm.running_mean" in message
    assert line_of(NormalisesInTrainMode.encode, ".tolist()") in message
    assert "fix:    put the frozen module in eval mode" in message
    assert all(torch.equal(buffer, before[name]) for name, buffer in step.norm.named_buffers())


class MixesBeforeTheCall(TrimsWithToList):
    """Frozen work that reads across the batch (numerically a no-op) feeds the opaque call."""

    def forward(self, ids, mask, target):
        states = self.embed(ids)
        states = states + 0.0 * states.sum(dim=0, keepdim=True)  # mixes samples, by its ops
        trimmed = self.trim(states, mask)
        return F.mse_loss(self.head(trimmed).squeeze(-1), target)

    def trim(self, states, mask):
        states = states.clone()
        for i, length in enumerate(mask.sum(dim=1).tolist()):
            states[i, length:] = 0
        return states


def test_an_opaque_call_the_analysis_finds_tainted_is_refused():
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(MixesBeforeTheCall(), prompts(3), path="trace")
    message = str(caught.value)
    assert "MixesBeforeTheCall.trim reads tensor values, so it can only run eagerly" in message
    assert "its value must be computed every step (mixing: mixes samples" in message
    assert line_of(MixesBeforeTheCall.trim, ".tolist()") in message
    assert "fix:    replace .item()/.tolist()" in message


class ScalesEachRow(nn.Module):
    """A frozen module whose own forward reads values, row by row (so, per sample)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Linear(4, 4)

    def forward(self, x):
        return torch.cat([self.scale(row[None]) * (2 if row.sum() > 0 else 1) for row in x])


class ScalesTheBatch(ScalesEachRow):
    """The same, deciding on the whole batch's sum: it mixes samples."""

    def forward(self, x):
        return self.scale(x) * (2 if x.sum() > 0 else 1)


class CallsAModuleThatReads(nn.Module):
    def __init__(self, encoder: nn.Module, *, frozen_encoder: bool = True) -> None:
        super().__init__()
        self.encoder = frozen(encoder) if frozen_encoder else encoder
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.encoder(x)).mean()


def test_a_frozen_leaf_module_whose_forward_reads_values_runs_as_one_opaque_call():
    torch.manual_seed(0)
    step = CallsAModuleThatReads(ScalesEachRow())
    split = split_and_verify(step, (torch.randn(3, 4),))
    (node,) = opaque_nodes(split)
    assert node.name == "encoder" and node.meta[OPAQUE].label == "ScalesEachRow.forward"
    assert line_of(ScalesEachRow.forward, "row.sum() > 0") in node.meta[OPAQUE].read_at
    assert {name for name, _ in split.stage1.named_parameters()} == {
        "encoder.scale.weight",
        "encoder.scale.bias",
    }
    other = torch.randn(2, 4)
    assert torch.equal(split.stage2(**split.stage1(other)), step(other))


def test_a_frozen_leaf_module_that_mixes_samples_is_refused_at_batch_three():
    # The batch's sum is positive, the last sample's negative: alone, it is scaled by 1, in
    # the batch by 2 (a difference at the values' scale, not in the last bits).
    x = torch.tensor([[2.0, 1.0, 1.0, 1.0], [1.0, 0.5, 0.5, 0.0], [-1.0, -0.5, 0.0, 0.0]])
    with pytest.raises(TensorValueError) as caught:
        graphsplit.split(CallsAModuleThatReads(ScalesTheBatch()), (x,), path="trace")
    message = str(caught.value)
    assert "ScalesTheBatch.forward reads tensor values and mixes the samples" in message
    assert line_of(ScalesTheBatch.forward, "x.sum() > 0") in message
    assert "fix:    plan at batch 1" in message


def test_a_trainable_leaf_module_reading_values_stays_an_error_at_its_call():
    step = CallsAModuleThatReads(ScalesTheBatch(), frozen_encoder=False)
    with pytest.raises(TensorValueError) as caught:
        graphsplit.split(step, (torch.randn(3, 4),), path="trace")
    message = str(caught.value)
    assert "reads the value of a tensor" in message
    assert "node:   encoder" in message
    assert line_of(CallsAModuleThatReads.forward, "self.encoder(x)") in message


class TrimsItsArgumentInPlace(TrimsWithToList):
    def forward(self, ids, mask, target):
        states = self.embed(ids)
        trimmed = self.trim(states, mask)
        return F.mse_loss(self.head(trimmed + states).squeeze(-1), target)

    def trim(self, states, mask):
        for i, length in enumerate(mask.sum(dim=1).tolist()):
            states[i, length:] = 0
        return states


def test_an_opaque_function_writing_into_its_input_is_refused():
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(TrimsItsArgumentInPlace(), prompts(3), path="trace")
    message = str(caught.value)
    assert "TrimsItsArgumentInPlace.trim reads tensor values and writes into its own" in message
    assert line_of(TrimsItsArgumentInPlace.trim, ".tolist()") in message
    assert "fix:    write into a copy (x = x.clone()) inside the function" in message


def test_the_default_path_caches_the_embedding_the_opaque_function_writes_into_exactly():
    """The module-level path caches ``embed(ids)``; the step's own ``trim`` writes into a copy."""
    step = TrimsItsArgumentInPlace()
    split = graphsplit.split(step, prompts(3))
    assert isinstance(split, graphsplit.CallSplit)
    assert split.plan.verdicts[0].copied == ("out",)
    boundary = split.stage1(*prompts(3))
    assert torch.equal(split.stage2(**boundary), step(*prompts(3)))
    assert torch.equal(split.stage2(**boundary), step(*prompts(3)))  # the cache was not trimmed
    assert all(c.ok for c in graphsplit.verify(step, split, prompts(3, seed=1)))
