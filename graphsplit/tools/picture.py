"""A picture of a split: the traced graph, coloured by stage, with the boundary marked.

Glossary:
    stage 1 only: frozen, data-dependent work that runs once and is cached (blue).
    stage 2 only: tainted work (trainable, random, mixing) and what depends on it (orange).
    both: a cheap frozen node (a reshape, a broadcast) that stage 2 recomputes instead of
        storing (green).
    unused: a node neither stage runs (a shape query only Python control flow read) (grey).
    boundary edge: an edge from a boundary value to a stage-2 node, drawn bold and labelled
        with the value's shape and bytes per sample (``const`` for a per-dataset constant).
    random node: draws random numbers (double octagon); trainable node: reads a trainable
        parameter (red bold border).
    group: the module or function call a node belongs to (:mod:`graphsplit.tools.groups`):
        a box (Graphviz cluster) around its nodes in ``split.dot``; one node of its own in the
        overview, striped with the colours of the stages inside it.
    hidden value: a node neither stage runs (a shape query only Python control flow read);
        left out of every drawing, counted in the graph's title and listed in the page.

In: a :class:`~graphsplit.api.Split`. Out: ``split.dot`` (every node, grouped) always,
``split.svg`` (its drawing) when Graphviz's ``dot`` is on ``PATH``, and a self-contained
``split.html`` (no scripts, no network): it opens on the overview (groups collapsed) scaled to
fit the window, with each group's own drawing in a collapsible section below (``<details>``);
without Graphviz it lists the nodes by group instead. The output depends only on the split, so
the same split always gives the same files. This module draws (Graphviz); the marks of each
node are :mod:`graphsplit.tools.picture_marks`', the page :mod:`graphsplit.tools.picture_page`'s.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch.fx as fx

from graphsplit.tools.groups import Group, group_nodes, is_hidden
from graphsplit.tools.picture_marks import (
    STAGE_COLOURS,
    TRAINABLE_BORDER,
    boundary_label,
    is_random,
    is_trainable,
    shape_text,
    stage_of,
    target_text,
    visible_groups,
)
from graphsplit.tools.picture_page import to_html

if TYPE_CHECKING:
    from graphsplit.api import Split

__all__ = ["STAGE_COLOURS", "render_split", "stage_of", "to_dot", "to_html"]

_BOUNDARY_EDGE = "#1f4e9c"


def render_split(split: Split, path: str | os.PathLike[str]) -> Path:
    """Draw ``split`` into the folder ``path``; returns the path of the HTML page.

    Writes ``split.dot``, ``split.svg`` (only when Graphviz's ``dot`` is installed) and
    ``split.html``, which inlines the SVG or, without Graphviz, lists the nodes by stage.

    Example:
        >>> import tempfile, torch, graphsplit
        >>> from graphsplit.tools.picture import render_split
        >>> step = torch.nn.Sequential(torch.nn.Linear(4, 4).requires_grad_(False),
        ...                            torch.nn.Linear(4, 1))
        >>> page = render_split(graphsplit.split(step, (torch.randn(2, 4),)), tempfile.mkdtemp())
        >>> page.name
        'split.html'
    """
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    dot_text = to_dot(split)
    (folder / "split.dot").write_text(dot_text)
    svg = _run_graphviz(dot_text)
    page = folder / "split.html"
    if svg is None:
        page.write_text(to_html(split))
        return page
    (folder / "split.svg").write_text(svg)
    overview = _run_graphviz(to_dot(split, collapsed=True))
    groups = {group: _run_graphviz(to_dot(split, only=group)) for group in visible_groups(split)}
    page.write_text(to_html(split, svg=overview or svg, group_svgs=groups))
    return page


def _dot_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _node_attributes(split: Split, node: fx.Node) -> str:
    lines = [node.name, target_text(node)]
    shape = shape_text(node)
    if shape:
        lines.append(shape)
    if is_random(node):
        lines.append("random: " + ", ".join(node.meta["facts"].random_ops))
    attributes = {
        "label": "\\n".join(line.replace("\\", "\\\\").replace('"', '\\"') for line in lines),
        "fillcolor": STAGE_COLOURS[stage_of(split, node)],
        "style": "filled",
        "shape": "doubleoctagon" if is_random(node) else "box",
    }
    if is_trainable(split, node):
        attributes.update(color=TRAINABLE_BORDER, penwidth="3", style="filled,bold")
    if node in split.cut.boundary:
        attributes["peripheries"] = "2"
    return ", ".join(f'{key}="{value}"' for key, value in attributes.items())


def _group_id(index: int) -> str:
    return f"group_{index}"


def to_dot(split: Split, *, collapsed: bool = False, only: Group | None = None) -> str:
    """The Graphviz source of the picture, deterministic (nodes in graph order).

    Default: every drawn node, each group's in a cluster. ``collapsed``: each group is one
    node (the overview). ``only``: one group's nodes, with their outside neighbours as plain
    ellipses. Hidden values are left out of all three, and counted in the title.
    """
    groups = group_nodes(split)
    drawn = [node for node in split.graph.nodes if not is_hidden(split, node)]
    hidden = sum(1 for node in split.graph.nodes if is_hidden(split, node))
    order = visible_groups(split)
    ids = {group: _group_id(index) for index, group in enumerate(order)}
    title = f"{split.model_name or 'step'}"
    if hidden:
        title += f"  ({hidden} values nothing uses are hidden)"
    if only is not None:
        title = f"{only.label} in {split.model_name or 'the step'}"
    lines = [
        "digraph split {",
        "  rankdir=TB;",
        f'  label={_dot_string(title)}; labelloc=t; fontname="Helvetica";',
        '  node [fontname="Helvetica", fontsize=10];',
        '  edge [fontname="Helvetica", fontsize=9];',
        *([] if only is not None else _legend_dot()),
    ]
    if only is not None:
        members = [node for node in drawn if groups[node] == only]
        inside = set(members)
        around = {
            other
            for node in members
            for other in (*node.all_input_nodes, *node.users)
            if other not in inside and not is_hidden(split, other)
        }
        for node in drawn:
            if node in inside:
                lines.append(f"  {_dot_string(node.name)} [{_node_attributes(split, node)}];")
            elif node in around:
                lines.append(
                    f"  {_dot_string(node.name)} [label={_dot_string(node.name)}, "
                    'shape=ellipse, color="#999999", fontcolor="#666666"];'
                )
        lines += _edges(split, drawn, lambda node: node.name, keep=inside | around, only=inside)
    elif collapsed:
        emitted: set[Group] = set()
        for node in drawn:
            group = groups[node]
            if group.is_step:
                lines.append(f"  {_dot_string(node.name)} [{_node_attributes(split, node)}];")
            elif group not in emitted:
                emitted.add(group)
                members = [other for other in drawn if groups[other] == group]
                lines.append(f"  {ids[group]} [{_group_attributes(split, group, members)}];")
        lines += _edges(
            split,
            drawn,
            lambda node: node.name if groups[node].is_step else ids[groups[node]],
        )
    else:
        for node in drawn:
            if groups[node].is_step:
                lines.append(f"  {_dot_string(node.name)} [{_node_attributes(split, node)}];")
        for group in order:
            lines.append(f"  subgraph cluster_{ids[group]} {{")
            lines.append(f'    label={_dot_string(group.label)}; style="rounded,dashed";')
            for node in drawn:
                if groups[node] == group:
                    lines.append(f"    {_dot_string(node.name)} [{_node_attributes(split, node)}];")
            lines.append("  }")
        lines += _edges(split, drawn, lambda node: node.name)
    lines.append("}")
    return "\n".join(lines) + "\n"


def _edges(
    split: Split,
    drawn: Iterable[fx.Node],
    name: Callable[[fx.Node], str],
    *,
    keep: set[fx.Node] | None = None,
    only: set[fx.Node] | None = None,
) -> list[str]:
    """Edges between drawn nodes, each once, named by ``name`` (a group stands for its nodes);
    boundary edges bold and labelled. With ``only``, edges touching those nodes."""
    boundary = set(split.cut.boundary)
    visible = set(drawn)
    lines: list[str] = []
    seen: set[tuple[str, str, str]] = set()
    for node in drawn:
        for user in node.users:
            if user not in visible or (keep is not None and (node not in keep or user not in keep)):
                continue
            if only is not None and node not in only and user not in only:
                continue
            source, target = name(node), name(user)
            if source == target:
                continue
            label = ""
            if node in boundary and stage_of(split, user) in ("stage 2", "both"):
                label = "boundary: " + boundary_label(split, node)
            if (source, target, label) in seen:
                continue
            seen.add((source, target, label))
            edge = f"  {_dot_string(source)} -> {_dot_string(target)}"
            if label:
                edge += (
                    f' [label={_dot_string(label)}, color="{_BOUNDARY_EDGE}", penwidth=3, '
                    "style=bold]"
                )
            lines.append(edge + ";")
    return lines


def _group_attributes(split: Split, group: Group, members: list[fx.Node]) -> str:
    """One node standing for a collapsed group: its name, size, stages (stripes), marks."""
    stages = [stage for stage in STAGE_COLOURS if any(stage_of(split, n) == stage for n in members)]
    lines = [group.label, f"{len(members)} nodes: {', '.join(stages)}"]
    random_ops = sorted({op for n in members if is_random(n) for op in n.meta["facts"].random_ops})
    if random_ops:
        lines.append("random: " + ", ".join(random_ops))
    for node in members:  # an edge inside the box is not drawn: say what crosses there
        if node in split.cut.boundary:
            lines.append(f"boundary {node.name}: {boundary_label(split, node)}")
    colours = ":".join(STAGE_COLOURS[stage] for stage in stages)
    attributes = {
        "label": "\\n".join(line.replace("\\", "\\\\").replace('"', '\\"') for line in lines),
        "fillcolor": colours,
        "style": "filled" if len(stages) == 1 else "striped",
        "shape": "box3d" if len(stages) == 1 else "box",
    }
    if any(is_trainable(split, n) for n in members):
        attributes.update(color=TRAINABLE_BORDER, penwidth="3")
    if any(n in split.cut.boundary for n in members):
        attributes["peripheries"] = "2"
    return ", ".join(f'{key}="{value}"' for key, value in attributes.items())


def _legend_dot() -> list[str]:
    lines = ["  subgraph cluster_legend {", '    label="legend"; fontsize=10;']
    for index, (stage, colour) in enumerate(STAGE_COLOURS.items()):
        if stage == "unused":  # hidden from the drawings; listed in the page
            continue
        lines.append(
            f'    legend_{index} [label="{stage}", style=filled, fillcolor="{colour}", shape=box];'
        )
    lines.append('    legend_random [label="random", shape=doubleoctagon];')
    lines.append(
        f'    legend_trainable [label="trainable", shape=box, color="{TRAINABLE_BORDER}", '
        "penwidth=3];"
    )
    lines.append("  }")
    return lines


def _run_graphviz(dot_text: str) -> str | None:
    executable = shutil.which("dot")
    if executable is None:
        return None
    try:
        result = subprocess.run(
            [executable, "-Tsvg"],
            input=dot_text,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout
