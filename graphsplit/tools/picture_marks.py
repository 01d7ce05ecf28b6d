"""What the picture of a split marks on each node, for its Graphviz drawing and its HTML page.

Glossary (the colours and marks :mod:`graphsplit.tools.picture` draws):
    stage: ``'stage 1'`` (frozen, cached: blue), ``'stage 2'`` (tainted work and what depends
        on it: orange), ``'both'`` (a cheap frozen node stage 2 recomputes: green) or
        ``'unused'`` (a node neither stage runs: grey), with its colour in
        :data:`STAGE_COLOURS`.
    boundary label: the shape, dtype and bytes per sample of a boundary value (``const`` for
        a per-dataset constant).
    random node: draws random numbers; trainable node: reads a trainable parameter itself.
    visible group: a module or function call, other than the step's own code, holding a node
        the picture draws.

In: a :class:`~graphsplit.api.Split` and its nodes. Out:

    stage_of(split, node) -> str        boundary_label(split, node) -> str
    is_random(node), is_trainable(split, node) -> bool
    target_text(node), shape_text(node) -> str      visible_groups(split) -> list[Group]
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.fx as fx

from graphsplit.artifacts import TaintKind
from graphsplit.tools.groups import Group, group_nodes, is_hidden
from graphsplit.units import human_bytes

if TYPE_CHECKING:
    from graphsplit.api import Split

__all__ = [
    "STAGE_COLOURS",
    "TRAINABLE_BORDER",
    "boundary_label",
    "is_random",
    "is_trainable",
    "shape_text",
    "stage_of",
    "target_text",
    "visible_groups",
]

STAGE_COLOURS = {
    "stage 1": "#cfe2ff",
    "stage 2": "#ffd8a8",
    "both": "#c8f0c8",
    "unused": "#eeeeee",
}
TRAINABLE_BORDER = "#c0392b"
_MAX_LABEL = 60


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


def is_random(node: fx.Node) -> bool:
    facts = node.meta.get("facts")
    return bool(facts is not None and facts.random_ops)


def is_trainable(split: Split, node: fx.Node) -> bool:
    taint = split.cut.taint.get(node)
    return taint is not None and taint.kind is TaintKind.TRAINABLE and taint.origin is node


def target_text(node: fx.Node) -> str:
    if node.op in ("placeholder", "output"):
        return node.op
    target = node.target
    name = getattr(target, "__name__", None) or str(target)
    text = f"{node.op}: {name}"
    return text if len(text) <= _MAX_LABEL else text[: _MAX_LABEL - 3] + "..."


def shape_text(node: fx.Node) -> str:
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


def visible_groups(split: Split) -> list[Group]:
    """The groups other than the step's own code that hold a drawn node, in graph order."""
    groups = group_nodes(split)
    seen: dict[Group, None] = {}
    for node in split.graph.nodes:
        if not groups[node].is_step and not is_hidden(split, node):
            seen.setdefault(groups[node])
    return list(seen)
