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

In: a :class:`~graphsplit.api.Split`. Out: ``split.dot`` always, ``split.svg`` when Graphviz's
``dot`` is on ``PATH``, and a self-contained ``split.html`` (no scripts, no network). The output
depends only on the split, so the same split always gives the same files.
"""

from __future__ import annotations

import html
import os
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import torch.fx as fx

from graphsplit.artifacts import TaintKind
from graphsplit.units import human_bytes

if TYPE_CHECKING:
    from graphsplit.api import Split

__all__ = ["STAGE_COLOURS", "render_split", "to_dot", "to_html"]

STAGE_COLOURS = {
    "stage 1": "#cfe2ff",
    "stage 2": "#ffd8a8",
    "both": "#c8f0c8",
    "unused": "#eeeeee",
}
_TRAINABLE_BORDER = "#c0392b"
_BOUNDARY_EDGE = "#1f4e9c"
_MAX_LABEL = 60


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
    if svg is not None:
        (folder / "split.svg").write_text(svg)
    page = folder / "split.html"
    page.write_text(to_html(split, svg=svg))
    return page


def stage_of(split: Split, node: fx.Node) -> str:
    """``'stage 1'``, ``'stage 2'``, ``'both'`` or ``'unused'`` for one node of ``split.graph``."""
    if node.op == "output":
        return "stage 2"
    first, second = node in split.cut.stage1, node in split.cut.stage2
    if first and second:
        return "both"
    if first:
        return "stage 1"
    if second:
        return "stage 2"
    return "unused"


def _is_random(node: fx.Node) -> bool:
    facts = node.meta.get("facts")
    return bool(facts is not None and facts.random_ops)


def _is_trainable(split: Split, node: fx.Node) -> bool:
    taint = split.cut.taint.get(node)
    return taint is not None and taint.kind is TaintKind.TRAINABLE and taint.origin is node


def _target_text(node: fx.Node) -> str:
    if node.op in ("placeholder", "output"):
        return node.op
    target = node.target
    name = getattr(target, "__name__", None) or str(target)
    text = f"{node.op}: {name}"
    return text if len(text) <= _MAX_LABEL else text[: _MAX_LABEL - 3] + "..."


def _shape_text(node: fx.Node) -> str:
    facts = node.meta.get("facts")
    if facts is None or not facts.is_tensor or facts.shape is None:
        return ""
    return "x".join(str(size) for size in facts.shape) or "scalar"


def boundary_label(split: Split, node: fx.Node) -> str:
    """``'shape 2x4, 16 B/sample'`` for a boundary node (``const`` for a per-dataset one)."""
    spec = split.boundary.get(node.name)
    if spec is None:
        return ""
    shape = "x".join(str(size) for size in spec.shape) or "scalar"
    size = f"{human_bytes(spec.bytes_per_sample)}/sample" if spec.batch_dim is not None else "const"
    return f"{shape} {str(spec.dtype).removeprefix('torch.')}, {size}"


def _dot_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _node_attributes(split: Split, node: fx.Node) -> str:
    lines = [node.name, _target_text(node)]
    shape = _shape_text(node)
    if shape:
        lines.append(shape)
    if _is_random(node):
        lines.append("random: " + ", ".join(node.meta["facts"].random_ops))
    attributes = {
        "label": "\\n".join(line.replace("\\", "\\\\").replace('"', '\\"') for line in lines),
        "fillcolor": STAGE_COLOURS[stage_of(split, node)],
        "style": "filled",
        "shape": "doubleoctagon" if _is_random(node) else "box",
    }
    if _is_trainable(split, node):
        attributes.update(color=_TRAINABLE_BORDER, penwidth="3", style="filled,bold")
    if node in split.cut.boundary:
        attributes["peripheries"] = "2"
    return ", ".join(f'{key}="{value}"' for key, value in attributes.items())


def to_dot(split: Split) -> str:
    """The Graphviz source of the picture: nodes in graph order, so the text is deterministic."""
    boundary = set(split.cut.boundary)
    lines = [
        "digraph split {",
        "  rankdir=TB;",
        '  node [fontname="Helvetica", fontsize=10];',
        '  edge [fontname="Helvetica", fontsize=9];',
        *_legend_dot(),
    ]
    for node in split.graph.nodes:
        lines.append(f"  {_dot_string(node.name)} [{_node_attributes(split, node)}];")
    for node in split.graph.nodes:
        for user in node.users:
            edge = f"  {_dot_string(node.name)} -> {_dot_string(user.name)}"
            crosses = node in boundary and stage_of(split, user) in ("stage 2", "both")
            if crosses:
                label = _dot_string("boundary: " + boundary_label(split, node))
                edge += f' [label={label}, color="{_BOUNDARY_EDGE}", penwidth=3, style=bold]'
            lines.append(edge + ";")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _legend_dot() -> list[str]:
    lines = ["  subgraph cluster_legend {", '    label="legend"; fontsize=10;']
    for index, (stage, colour) in enumerate(STAGE_COLOURS.items()):
        lines.append(
            f'    legend_{index} [label="{stage}", style=filled, fillcolor="{colour}", shape=box];'
        )
    lines.append('    legend_random [label="random", shape=doubleoctagon];')
    lines.append(
        f'    legend_trainable [label="trainable", shape=box, color="{_TRAINABLE_BORDER}", '
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


_STYLE = """
body { font-family: sans-serif; margin: 1.5em; }
table { border-collapse: collapse; margin-bottom: 1.5em; }
th, td { border: 1px solid #999; padding: 2px 8px; font-size: 13px; text-align: left; }
.stage-1 { background: %(stage 1)s; } .stage-2 { background: %(stage 2)s; }
.both { background: %(both)s; } .unused { background: %(unused)s; }
.trainable { border: 3px solid %(trainable)s; font-weight: bold; }
.random { font-style: italic; }
"""


def to_html(split: Split, *, svg: str | None = None) -> str:
    """A self-contained page: the SVG inline when given, else the nodes listed by stage."""
    style = _STYLE % {**STAGE_COLOURS, "trainable": _TRAINABLE_BORDER}
    title = html.escape(f"graphsplit: {split.model_name}")
    parts = [
        "<!DOCTYPE html>",
        '<html><head><meta charset="utf-8">',
        f"<title>{title}</title><style>{style}</style></head><body>",
        f"<h1>{title}</h1>",
        _legend_html(),
        "<h2>Boundary</h2>",
        _boundary_table(split),
    ]
    if svg is not None:
        start = svg.find("<svg")
        parts += ["<h2>Graph</h2>", svg[start:] if start >= 0 else svg]
    else:
        parts += [
            "<h2>Nodes by stage</h2>",
            "<p>Graphviz's <code>dot</code> was not found, so the graph is listed instead; "
            "<code>split.dot</code> beside this page holds its source.</p>",
            _node_table(split),
        ]
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _css_class(stage: str) -> str:
    return stage.replace(" ", "-")


def _legend_html() -> str:
    cells = "".join(f'<td class="{_css_class(stage)}">{stage}</td>' for stage in STAGE_COLOURS)
    cells += '<td class="random">random</td><td class="trainable">trainable</td>'
    return f"<table><tr><th>legend</th>{cells}</tr></table>"


def _boundary_table(split: Split) -> str:
    rows = [
        "<table><tr><th>name</th><th>shape</th><th>dtype</th><th>batch dim</th>"
        "<th>bytes/sample</th><th>source</th></tr>"
    ]
    for spec in split.boundary.values():
        shape = "x".join(str(size) for size in spec.shape) or "scalar"
        batch = "const" if spec.batch_dim is None else str(spec.batch_dim)
        cells = [
            spec.name,
            shape,
            str(spec.dtype).removeprefix("torch."),
            batch,
            str(spec.bytes_per_sample),
            spec.source,
        ]
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    rows.append("</table>")
    return "\n".join(rows)


def _node_table(split: Split) -> str:
    boundary = set(split.cut.boundary)
    rows = ["<table><tr><th>stage</th><th>node</th><th>op</th><th>shape</th><th>marks</th></tr>"]
    order = list(STAGE_COLOURS)
    nodes = sorted(
        enumerate(split.graph.nodes),
        key=lambda item: (order.index(stage_of(split, item[1])), item[0]),
    )
    for _, node in nodes:
        stage = stage_of(split, node)
        marks = []
        classes = [_css_class(stage)]
        if node in boundary:
            marks.append("boundary: " + boundary_label(split, node))
        if _is_random(node):
            marks.append("random: " + ", ".join(node.meta["facts"].random_ops))
            classes.append("random")
        if _is_trainable(split, node):
            marks.append("trainable")
            classes.append("trainable")
        cells = [stage, node.name, _target_text(node), _shape_text(node), "; ".join(marks)]
        rows.append(
            f'<tr class="{" ".join(classes)}">'
            + "".join(f"<td>{html.escape(c)}</td>" for c in cells)
            + "</tr>"
        )
    rows.append("</table>")
    return "\n".join(rows)
