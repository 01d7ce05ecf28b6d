"""The picture's HTML page: self-contained (no scripts, no network), the same for the same split.

It opens on the overview drawing (groups collapsed) scaled to fit the window, with each group's
own drawing in a collapsible section below (``<details>``); without Graphviz it lists the nodes
by group instead, and the values nothing uses last. The drawings come from
:mod:`graphsplit.tools.picture`, the marks from :mod:`graphsplit.tools.picture_marks`.

In: a :class:`~graphsplit.api.Split`, the overview SVG and each group's. Out:

    to_html(split, *, svg=None, group_svgs=None) -> str
"""

from __future__ import annotations

import html
import re
from typing import TYPE_CHECKING

import torch.fx as fx

from graphsplit.signatures.listing import signatures_html
from graphsplit.tools import picture_marks
from graphsplit.tools.groups import Group, group_nodes, is_hidden

if TYPE_CHECKING:
    from graphsplit.api import Split

__all__ = ["to_html"]

_STYLE = """
body { font-family: sans-serif; margin: 1.5em; }
table { border-collapse: collapse; margin-bottom: 1.5em; }
th, td { border: 1px solid #999; padding: 2px 8px; font-size: 13px; text-align: left; }
.stage-1 { background: %(stage 1)s; } .stage-2 { background: %(stage 2)s; }
.both { background: %(both)s; } .unused { background: %(unused)s; }
.trainable { border: 3px solid %(trainable)s; font-weight: bold; }
.random { font-style: italic; }
.graph svg { width: 100%%; height: auto; max-height: 85vh; }
details { margin: 0.4em 0; } summary { cursor: pointer; }
"""


def _fit(svg: str) -> str:
    """The ``<svg>`` element alone, without its fixed size, so it scales to fit the page."""
    start = svg.find("<svg")
    svg = svg[start:] if start >= 0 else svg
    end = svg.find(">")
    if end < 0:
        return svg
    opening = re.sub(r'\s(width|height)="[^"]*"', "", svg[:end])
    return opening + svg[end:]


def to_html(
    split: Split,
    *,
    svg: str | None = None,
    group_svgs: dict[Group, str | None] | None = None,
) -> str:
    """A self-contained page: the overview ``svg`` scaled to fit, each group in a collapsible
    section (its drawing from ``group_svgs``, else its nodes); without ``svg``, the nodes
    listed by group. Hidden values are listed last."""
    style = _STYLE % {**picture_marks.STAGE_COLOURS, "trainable": picture_marks.TRAINABLE_BORDER}
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
    listed = signatures_html(split)
    if listed:
        parts.append(listed)
    groups = group_nodes(split)
    drawn = [node for node in split.graph.nodes if not is_hidden(split, node)]
    if svg is not None:
        parts += [
            "<h2>Graph</h2>",
            "<p>Each module or function call is one box; open its section below to see "
            "inside it.</p>",
            f'<div class="graph">{_fit(svg)}</div>',
        ]
        group_svgs = group_svgs or {}
        sections = picture_marks.visible_groups(split)
        if sections:
            parts.append("<h2>Groups</h2>")
        for group in sections:
            members = [node for node in drawn if groups[node] == group]
            inner = group_svgs.get(group)
            body = (
                f'<div class="graph">{_fit(inner)}</div>' if inner else _node_table(split, members)
            )
            parts.append(_details(f"{group.label}: {len(members)} nodes", body))
    else:
        parts += [
            "<h2>Nodes by group</h2>",
            "<p>Graphviz's <code>dot</code> was not found, so the graph is listed instead; "
            "<code>split.dot</code> beside this page holds its source.</p>",
        ]
        for group in [Group.STEP, *picture_marks.visible_groups(split)]:
            members = [node for node in drawn if groups[node] == group]
            if members:
                label = f"{group.label}: {len(members)} nodes"
                parts.append(_details(label, _node_table(split, members), opened=group.is_step))
    hidden = [node for node in split.graph.nodes if is_hidden(split, node)]
    if hidden:
        parts.append(
            _details(
                f"{len(hidden)} values nothing uses (shape queries Python read), hidden from "
                "the drawings",
                _node_table(split, hidden),
            )
        )
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _details(summary: str, body: str, *, opened: bool = False) -> str:
    state = " open" if opened else ""
    return f"<details{state}><summary>{html.escape(summary)}</summary>\n{body}\n</details>"


def _css_class(stage: str) -> str:
    return stage.replace(" ", "-")


def _legend_html() -> str:
    cells = "".join(
        f'<td class="{_css_class(stage)}">{stage}</td>' for stage in picture_marks.STAGE_COLOURS
    )
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


def _node_table(split: Split, members: list[fx.Node]) -> str:
    boundary = set(split.cut.boundary)
    rows = ["<table><tr><th>stage</th><th>node</th><th>op</th><th>shape</th><th>marks</th></tr>"]
    order = list(picture_marks.STAGE_COLOURS)
    nodes = sorted(
        enumerate(members),
        key=lambda item: (order.index(picture_marks.stage_of(split, item[1])), item[0]),
    )
    for _, node in nodes:
        stage = picture_marks.stage_of(split, node)
        marks = []
        classes = [_css_class(stage)]
        if node in boundary:
            marks.append("boundary: " + picture_marks.boundary_label(split, node))
        if picture_marks.is_random(node):
            marks.append("random: " + ", ".join(node.meta["facts"].random_ops))
            classes.append("random")
        if picture_marks.is_trainable(split, node):
            marks.append("trainable")
            classes.append("trainable")
        cells = [
            stage,
            node.name,
            picture_marks.target_text(node),
            picture_marks.shape_text(node),
            "; ".join(marks),
        ]
        rows.append(
            f'<tr class="{" ".join(classes)}">'
            + "".join(f"<td>{html.escape(c)}</td>" for c in cells)
            + "</tr>"
        )
    rows.append("</table>")
    return "\n".join(rows)
