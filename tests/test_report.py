"""``Split.report()`` (``graphsplit.report``): boundary, parameters per stage, moved work."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import sdpa_flop_count

from graphsplit.planning.rules.opaque_call import OPAQUE, is_opaque
from graphsplit.report import moved_work, plan_json
from tests.helpers import (
    batch,
    frozen,
    line_of,
    split_and_verify,
)
from tests.planning.test_cut import FrozenChain
from tests.planning.test_opaque import (
    TOKENS,
    VOCAB,
    WIDTH,
    CallsAModuleThatReads,
    ScalesEachRow,
    TrimsWithToList,
    prompts,
)


# -- the report --------------------------------------------------------------------------------
def test_report_lists_boundary_parameters_and_moved_work():
    model = FrozenChain()
    split = split_and_verify(model, (batch(3, 8), batch(3, 1, seed=1)))
    report = split.report()
    assert report.startswith("graphsplit plan for FrozenChain")
    assert "Boundary: 2 tensors, 28 B per sample" in report
    row = next(line for line in report.splitlines() if line.strip().startswith("second "))
    assert "(3, 6)" in row and "float32" in row and "24 B" in row
    assert row.rstrip().endswith(line_of(FrozenChain.forward, "self.second("))
    assert "stage 1: 4 tensors" in report and "(0 trainable, 4 frozen)" in report
    assert "stage 2: 2 tensors" in report and "(2 trainable, 0 frozen)" in report
    assert "frozen parameters stage 2 does not need: 4 tensors" in report
    # first: 2*8*16 FLOPs per sample, second: 2*16*6
    assert "448 FLOP per sample" in report


# -- the work of opaque calls (frozen code that reads tensor values, run eagerly by stage 1) ---
def _moved_line(report: str) -> list[str]:
    lines = report.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Work moved out"))
    return lines[start:]


def test_an_opaque_call_no_counter_sees_is_reported_as_not_counted_never_as_zero():
    # An embedding trimmed by a .tolist() loop: no op with a FLOP formula runs in the call.
    torch.manual_seed(0)
    split = split_and_verify(TrimsWithToList(), prompts(3))
    report = split.report()
    moved = _moved_line(report)
    assert moved[0].startswith("Work moved out of the training step: unknown: the work of 1 ")
    assert moved[1].split()[:2] == ["encode", "TrimsWithToList.encode"]
    assert moved[1].rstrip().endswith(line_of(TrimsWithToList.forward, "self.encode("))
    assert "0 FLOP" not in report
    plan = plan_json(split)
    assert plan["moved_flops_per_sample"] is None
    assert [entry["runs"] for entry in plan["moved_work_not_counted"]] == ["TrimsWithToList.encode"]


def test_the_flops_an_opaque_call_runs_are_counted_from_its_example_run():
    torch.manual_seed(0)
    split = split_and_verify(CallsAModuleThatReads(ScalesEachRow()), (torch.randn(3, 4),))
    assert [node.name for node in split.graph.nodes if is_opaque(node)] == ["encoder"]
    work = moved_work(split)
    assert work.flops_per_sample == 2 * 4 * 4 and work.not_counted == ()  # Linear(4, 4)
    assert _moved_line(split.report())[0].endswith(
        ": 32 FLOP per sample (matmul/conv/attention FLOPs)"
    )
    assert plan_json(split)["moved_flops_per_sample"] == 32


class AttendsThenTrims(nn.Module):
    """A frozen self-attention over the prompt, then a trim by the mask's lengths (opaque)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = frozen(nn.Embedding(VOCAB, 8))
        self.project = frozen(nn.Linear(8, 8))
        self.head = nn.Linear(8, 1)

    def encode(self, ids, mask):
        lengths = mask.sum(dim=1).tolist()  # reads values: this method runs as one call
        states = self.embed(ids)[:, None]  # one head
        states = F.scaled_dot_product_attention(states, states, states)[:, 0]
        for row, length in enumerate(lengths):
            states[row, length:] = 0
        return states

    def forward(self, ids, mask, target):
        states = self.project(self.encode(ids, mask))  # traced: counted by the meta analysis
        return F.mse_loss(self.head(states).squeeze(-1), target)


def test_attention_inside_an_opaque_call_counts_as_the_traced_step_counts_it():
    # On the CPU, scaled_dot_product_attention runs a kernel FlopCounterMode has no formula for.
    torch.manual_seed(0)
    ids, mask, target = prompts(3)
    split = split_and_verify(AttendsThenTrims(), (ids, mask, target))
    (node,) = [node for node in split.graph.nodes if is_opaque(node)]
    shape = (3, 1, TOKENS, 8)
    attention = sdpa_flop_count(shape, shape, shape) // 3
    projection = 2 * TOKENS * 8 * 8
    assert node.meta[OPAQUE].flops // 3 == attention
    assert moved_work(split).flops_per_sample == attention + projection


def test_counted_work_and_an_uncounted_opaque_call_are_reported_side_by_side():
    torch.manual_seed(0)

    class ProjectsThenTrims(TrimsWithToList):
        def __init__(self) -> None:
            super().__init__()
            self.project = frozen(nn.Linear(WIDTH, WIDTH))

        def forward(self, ids, mask, target):
            states = self.project(self.encode(ids, mask))
            return F.mse_loss(self.head(states).squeeze(-1), target)

    split = split_and_verify(ProjectsThenTrims(), prompts(3))
    moved = _moved_line(split.report())
    assert moved[0].startswith(
        "Work moved out of the training step: 192 FLOP per sample (matmul/conv/attention "
        "FLOPs), plus the work of 1 opaque call not counted"
    )  # 2 * TOKENS * WIDTH * WIDTH
    assert plan_json(split)["moved_flops_per_sample"] == 2 * TOKENS * WIDTH * WIDTH


class MaskedLossOfATrainableHead(nn.Module):
    """A frozen encoder, a trainable head, SimMIM's masked loss: ``(loss * mask).sum() /
    (mask.sum() + 1e-5) / num_channels``."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = frozen(nn.Linear(4, 4))
        self.head = nn.Linear(4, 4)

    def forward(self, x, mask):
        loss = self.head(self.encoder(x)).pow(2)
        return (loss * mask).sum() / (mask.sum() + 1e-5) / 4


def test_not_cached_lists_a_mixing_root_once_not_what_it_feeds():
    """``mask.sum()`` mixes the batch's samples (its own taint); ``mask.sum() + 1e-5`` has no
    batch dim either, so it carries its own mixing taint too, but it is fed by a value stage 2
    computes anyway: only the root is listed (SAM's and SimMIM's loss tails listed every
    batch-less step after the reduction as frozen work)."""
    mask = (batch(3, 4, seed=1) > 0).float()
    split = split_and_verify(MaskedLossOfATrainableHead(), (batch(3, 4), mask))
    report = split.report()
    listed = report.split("Not cached (frozen work that stays in stage 2):")[-1].splitlines()
    names = [line.split()[0] for line in listed if line.startswith("  ") and line.split()]
    assert names == ["sum_2"], report
