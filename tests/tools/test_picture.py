"""The picture of a split: stage colours, boundary edge labels, random and trainable marks;
nodes grouped by the module or function call they belong to (collapsible in the page), values
nothing uses hidden, the page opening on the whole graph."""

import re
import shutil

import pytest
import torch
from torch import nn

import graphsplit
from graphsplit.tools.groups import Group, group_nodes, is_hidden
from graphsplit.tools.picture import STAGE_COLOURS, render_split, stage_of, to_dot, to_html
from tests.tools.specs.noise import add_noise


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


def test_html_without_svg_lists_nodes_by_group():
    parts = _split()
    page = to_html(parts, svg=None)
    assert page.startswith("<!DOCTYPE html>")
    assert "<script" not in page and "http" not in page
    assert "<details open><summary>the step: " in page
    assert 'class="stage-2 random"' in page
    assert "trainable" in page
    for name in parts.boundary:
        assert f"<td>{name}</td>" in page


def test_html_inlines_svg_scaled_to_fit():
    svg = '<?xml version="1.0"?><svg width="800pt" height="2000pt" viewBox="0 0 800 2000">'
    page = to_html(_split(), svg=svg + '<g id="graph0"></g></svg>')
    assert '<div class="graph"><svg viewBox="0 0 800 2000"><g id="graph0"></g></svg>' in page
    assert "<?xml" not in page and 'width="800pt"' not in page
    assert ".graph svg { width: 100%; height: auto; max-height: 85vh; }" in page


def test_render_split_writes_files(tmp_path):
    page = render_split(_split(), tmp_path)
    assert page == tmp_path / "split.html"
    assert (tmp_path / "split.dot").read_text().startswith("digraph")
    has_dot = shutil.which("dot") is not None
    assert (tmp_path / "split.svg").exists() == has_dot
    if has_dot:
        assert "<svg" in page.read_text()
    else:
        assert "Nodes by group" in page.read_text()


# -- groups and hidden values, on a step shaped like a diffusion loop body ---------------------


class Block(nn.Module):
    """Part frozen, part trainable, fed cacheable values: graphsplit traces into it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6).requires_grad_(False)
        self.gate = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(torch.relu(self.proj(x)))


class NoisyStep(nn.Module):
    """Frozen encoder, a mixed block, a scheduler-like ``add_noise`` from another file."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(8, 6).requires_grad_(False)
        self.block = Block()
        self.head = nn.Linear(6, 1)
        self.register_buffer("alphas", torch.linspace(0.9, 0.1, 4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        features = self.block(self.encoder(x))
        noisy = add_noise(features, torch.randn_like(features), self.alphas)
        return nn.functional.mse_loss(self.head(noisy), y)


@pytest.fixture(scope="module")
def noisy():
    torch.manual_seed(0)
    return graphsplit.split(NoisyStep(), (torch.randn(3, 8), torch.randn(3, 1)))


def _names(parts, label):
    return [node.name for node, group in group_nodes(parts).items() if group.label == label]


def test_nodes_are_grouped_by_the_call_they_belong_to(noisy):
    groups = group_nodes(noisy)
    labels = {group.label for group in groups.values()}
    assert labels == {"the step", "block (Block)", "add_noise()  noise.py"}
    assert _names(noisy, "block (Block)") == ["block_proj", "relu", "block_gate"]
    assert {stage_of(noisy, node) for node in groups if groups[node].label == "block (Block)"} == {
        "stage 1",
        "stage 2",
    }
    inside = _names(noisy, "add_noise()  noise.py")
    assert "add" in inside and all(name in inside for name in ("mul", "mul_1"))
    for name in ("x", "y", "encoder", "randn_like", "head", "mse_loss", "output"):
        assert name in _names(noisy, "the step")


def test_values_nothing_uses_are_hidden_and_counted(noisy):
    hidden = [node.name for node in noisy.graph.nodes if is_hidden(noisy, node)]
    assert len(hidden) == 8 and all("_shape" in name for name in hidden)  # add_noise's loops
    for dot in (to_dot(noisy), to_dot(noisy, collapsed=True)):
        assert "(8 values nothing uses are hidden)" in dot
        for name in hidden:
            assert f'"{name}"' not in dot
        assert STAGE_COLOURS["unused"] not in dot
    page = to_html(noisy)
    assert "8 values nothing uses (shape queries Python read), hidden from the drawings" in page
    for name in hidden:
        assert f"<td>{name}</td>" in page


def test_the_full_dot_draws_each_group_as_a_cluster(noisy):
    dot = to_dot(noisy)
    clusters = re.findall(r"subgraph (cluster_group_\d+) \{\n    label=\"([^\"]+)\"", dot)
    assert [label for _, label in clusters] == ["block (Block)", "add_noise()  noise.py"]
    block = dot.split("subgraph cluster_group_0 {")[1].split("  }")[0]
    assert '"block_proj"' in block and '"block_gate"' in block and '"head"' not in block


def test_the_overview_collapses_each_group_into_one_node(noisy):
    dot = to_dot(noisy, collapsed=True)
    assert '"block_proj"' not in dot and '"add" [' not in dot
    block = next(line for line in dot.splitlines() if line.startswith("  group_0 ["))
    assert "block (Block)\\n3 nodes: stage 1, stage 2" in block
    assert 'style="striped"' in block and STAGE_COLOURS["stage 1"] in block
    assert 'peripheries="2"' in block  # it holds the boundary value, named inside
    assert "\\nboundary relu: 3x6 float32, 24 B/sample" in block
    assert f'color="{"#c0392b"}"' in block  # and a trainable module
    noise = next(line for line in dot.splitlines() if line.startswith("  group_1 ["))
    # The alphas buffer's scalars are frozen constants, cached once; the mixing runs in stage 2.
    assert "add_noise()  noise.py\\n13 nodes: stage 1, stage 2" in noise
    assert 'style="striped"' in noise
    edges = [line for line in dot.splitlines() if "->" in line]
    assert len(edges) == len(set(edges))
    assert any(e.startswith('  "encoder" -> "group_0"') for e in edges)
    assert any(e.startswith('  "group_0" -> "group_1";') for e in edges)
    assert any(e.startswith('  "y" -> "mse_loss" [label="boundary: 3x1') for e in edges)
    assert any(e.startswith('  "randn_like" -> "group_1"') for e in edges)


def test_one_group_drawn_with_its_neighbours(noisy):
    block = next(g for g in set(group_nodes(noisy).values()) if g.label == "block (Block)")
    dot = to_dot(noisy, only=block)
    assert '"block_gate" [label="block_gate' in dot
    assert '"encoder" [label="encoder", shape=ellipse' in dot  # a neighbour, drawn plain
    assert '"randn_like"' in dot  # block_gate feeds it (randn_like reads its shape)
    assert '"mse_loss"' not in dot and "legend" not in dot
    assert '"block_proj" -> "relu"' in dot


def test_the_page_makes_each_group_collapsible(noisy):
    svgs = {
        group: f"<svg width='1pt'><text>{group.label}</text></svg>"
        for group in set(group_nodes(noisy).values())
        if not group.is_step
    }
    page = to_html(noisy, svg="<svg><text>overview</text></svg>", group_svgs=svgs)
    assert "<details><summary>block (Block): 3 nodes</summary>" in page
    assert "<details><summary>add_noise()  noise.py: 13 nodes</summary>" in page
    assert page.index("overview") < page.index("<details>")  # opens on the whole graph
    assert "<script" not in page


def test_graphviz_draws_the_overview_and_every_group(noisy, tmp_path):
    if shutil.which("dot") is None:
        reason = "Graphviz's dot is not installed (apt-get install graphviz): SVG path not run"
        print(reason)
        pytest.skip(reason)
    page = render_split(noisy, tmp_path).read_text()
    full = (tmp_path / "split.svg").read_text()
    assert full.count('class="cluster"') == 3  # the legend and the two groups
    graphs = re.findall(r'<div class="graph">(<svg[^>]*>)', page)
    assert len(graphs) == 3  # the overview, then each group
    assert all(" width=" not in svg and "viewBox=" in svg for svg in graphs)
    overview = page.split('<div class="graph">')[1]
    assert "3 nodes: stage 1, stage 2" in overview and "block_proj" not in overview
    block = page.split("<summary>block (Block): 3 nodes</summary>")[1].split("</details>")[0]
    assert "block_proj" in block and "block_gate" in block
    assert isinstance(next(iter(group_nodes(noisy).values())), Group)
