"""Python idioms of real training code that the tracer supports (Flux-style position ids)."""

from __future__ import annotations

import torch
from torch import nn

from tests.helpers import split_and_verify


class PositionIds(nn.Module):
    """Position ids built as diffusers' Flux pipeline does: zeros(h, w, 3), then item writes."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(8, 8).requires_grad_(False)
        self.head = nn.Linear(11, 1)

    def forward(self, x):
        hidden = self.encoder(x)
        batch, tokens, _ = hidden.shape
        ids = torch.zeros(tokens, 3)
        ids[..., 1] = ids[..., 1] + torch.arange(tokens)
        ids[..., 2] = ids[..., 2] + 2.0
        features = torch.cat([hidden, ids.unsqueeze(0).expand(batch, -1, -1)], dim=-1)
        return self.head(features).mean()


def test_factories_with_traced_sizes_and_item_assignment_trace_exactly():
    model = PositionIds()
    split = split_and_verify(model, (torch.randn(3, 4, 8),))
    # The ids read the token count and nothing stage 2 lacks: stage 2 builds them itself
    # (planning/cut/sized_constants.py), so no length is a guard.
    assert "graphsplit_runtime_functional_setitem" in split.stage2.code
    assert list(split.boundary) == ["encoder"] and split.boundary["encoder"].batch_dim == 0
    other = torch.randn(5, 4, 8)  # the ids follow the traced token count, not a baked one
    assert torch.equal(split.stage2(**split.stage1(other)), model(other))


class AssignIntoView(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        buffer = torch.zeros(x.shape[0], 8)
        window = buffer[:, :4]
        window[...] = x  # writes through the view into `buffer`
        return self.head(buffer[:, :4]).mean()


def test_item_assignment_into_an_indexing_view_writes_through_to_its_base():
    model = AssignIntoView()
    split = split_and_verify(model, (torch.randn(3, 4),))
    other = torch.randn(5, 4)
    assert torch.equal(split.stage2(**split.stage1(other)), model(other))


class NoiseShapedLikeFeatures(nn.Module):
    """``torch.randn(h.shape)``: the traced size is a whole ``torch.Size``, passed as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(8, 8).requires_grad_(False)
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        hidden = self.encoder(x)
        noise = torch.randn(hidden.shape)
        return ((self.head(hidden) - noise) ** 2).mean()


def test_a_factory_given_a_traced_shape_draws_that_shape_in_stage_2():
    model = NoiseShapedLikeFeatures()
    split = split_and_verify(model, (torch.randn(3, 8),))
    assert list(split.boundary) == ["encoder"]
    assert "torch.randn" in split.stage2.code and "randn" not in split.stage1.code
    other = torch.randn(5, 8)
    torch.manual_seed(1)
    expected = model(other)
    torch.manual_seed(1)
    assert torch.equal(split.stage2(**split.stage1(other)), expected)


class SlicesItsBuffer(nn.Module):
    """Python-level work on a registered buffer: ``self.table[:4]``, ``self.alphas[0] ** 0.5``
    (a scheduler table kept as a buffer). fx hands code a buffer itself by default, so that
    work ran at trace time on the analysis view's meta twin, and its result, a meta constant,
    left both stages unable to run."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(8, 6).requires_grad_(False)
        self.head = nn.Linear(6, 1)
        self.register_buffer("table", torch.randn(6, 6))
        self.register_buffer("alphas", torch.linspace(0.9, 0.1, 4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        features = self.encoder(x)[:, :4] + self.table[:4, :4].sum(0)
        scale = self.alphas[0] ** 0.5
        return nn.functional.mse_loss(self.head(torch.relu(features @ self.table[:4]) * scale), y)


def test_work_on_a_buffer_in_traced_code_is_traced_and_both_stages_run():
    torch.manual_seed(0)
    model = SlicesItsBuffer()
    x, y = torch.randn(3, 8), torch.randn(3, 1)
    split = split_and_verify(model, (x, y))
    reads = {node.target for node in split.graph.nodes if node.op == "get_attr"}
    assert {"table", "alphas"} <= reads
    held = {name for name, _ in split.stage2.named_buffers()} | set(split.boundary)
    assert not any(name.startswith(("constant", "_tensor_constant")) for name in held)
    other_x, other_y = torch.randn(5, 8), torch.randn(5, 1)
    assert torch.equal(split.stage2(**split.stage1(other_x, other_y)), model(other_x, other_y))
