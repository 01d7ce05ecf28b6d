"""The picture of a split: stage colours, boundary edge labels, random and trainable marks."""

import shutil

import torch
from torch import nn

import graphsplit
from graphsplit.tools.picture import STAGE_COLOURS, render_split, stage_of, to_dot, to_html


class FrozenEncoderNoisyHead(nn.Module):
    """Frozen encoder, a cheap reshape stage 2 may recompute, random noise, trainable head."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(8, 6).requires_grad_(False)
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        features = self.encoder(x).view(-1, 2, 3).flatten(1)
        noisy = features + torch.randn_like(features)
        return nn.functional.mse_loss(self.head(noisy), y)


def _split():
    torch.manual_seed(0)
    return graphsplit.split(FrozenEncoderNoisyHead(), (torch.randn(3, 8), torch.randn(3, 1)))


def test_dot_marks_stages_boundary_random_and_trainable():
    parts = _split()
    dot = to_dot(parts)
    assert dot.startswith("digraph split {")
    stages = {stage_of(parts, node) for node in parts.graph.nodes}
    assert {"stage 1", "stage 2"} <= stages
    for stage in stages:
        assert STAGE_COLOURS[stage] in dot
    for spec in parts.boundary.values():
        shape = "x".join(map(str, spec.shape))
        assert f"boundary: {shape} float32, {spec.bytes_per_sample} B/sample" in dot
    random_line = next(line for line in dot.splitlines() if line.startswith('  "randn_like"'))
    assert "doubleoctagon" in random_line and "random: randn_like" in random_line
    head_line = next(line for line in dot.splitlines() if line.startswith('  "head"'))
    assert "penwidth" in head_line and STAGE_COLOURS["stage 2"] in head_line
    encoder_line = next(line for line in dot.splitlines() if line.startswith('  "x"'))
    assert STAGE_COLOURS["stage 1"] in encoder_line


def test_dot_is_deterministic():
    assert to_dot(_split()) == to_dot(_split())


def test_html_without_svg_lists_nodes_by_stage():
    parts = _split()
    page = to_html(parts, svg=None)
    assert page.startswith("<!DOCTYPE html>")
    assert "<script" not in page and "http" not in page
    assert "Nodes by stage" in page
    assert 'class="stage-2 random"' in page
    assert "trainable" in page
    for name in parts.boundary:
        assert f"<td>{name}</td>" in page


def test_html_inlines_svg():
    page = to_html(_split(), svg='<?xml version="1.0"?><svg><g id="graph0"></g></svg>')
    assert '<svg><g id="graph0"></g></svg>' in page
    assert "<?xml" not in page


def test_render_split_writes_files(tmp_path):
    page = render_split(_split(), tmp_path)
    assert page == tmp_path / "split.html"
    assert (tmp_path / "split.dot").read_text().startswith("digraph")
    has_dot = shutil.which("dot") is not None
    assert (tmp_path / "split.svg").exists() == has_dot
    if has_dot:
        assert "<svg" in page.read_text()
    else:
        assert "Nodes by stage" in page.read_text()
