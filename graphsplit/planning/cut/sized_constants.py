"""A per-dataset constant made from the batch's length is recomputed in stage 2, not stored.

The min-cut puts a per-dataset constant on the boundary: it reads no value of the batch, so the
cache stores it once per plan and it costs nothing per sample. Some of them still read a *size*
of the batch. A PEFT LoRA Llama traced whole builds ``position_ids = torch.arange(seq_len)``,
the rotary ``cos`` / ``sin`` (from the buffer ``inv_freq``) and the causal mask from
``inputs_embeds.shape[1]``, the padded length. Stored, such a constant fixes that length for its
plan (:mod:`graphsplit.planning.rules.constant_sizes` guards it): with dynamic padding every new
length was a new plan, and a dataset with more lengths than ``max_plans`` was refused.

Stage 2 can often compute the constant itself: its inputs are tensors stage 2 has anyway (the
cached embeddings whose ``.shape[1]`` and ``.device`` it reads), buffers, and cheap torch ops
on them. Then the constant leaves the boundary and stage 2 runs the step's own code on the
batch's own sizes, as the eager step does: one plan serves every length, exactly.

Glossary:
    sized constant: a boundary constant whose ancestors hold a size value of the batch
        (:func:`~graphsplit.planning.rules.constant_sizes.size_values_read`).
    recomputable: every ancestor of the constant, walking back until a node stage 2 already
        has (the boundary, a baked number, ``cut.stage2``), is a ``call_function`` /
        ``call_method`` that is not frozen work (:func:`~graphsplit.planning.rules.taint.
        is_banned`: no FLOPs, no frozen module), not an opaque call, draws nothing, and yields
        a per-dataset constant tensor or a non-tensor (a size, a device, a dtype); or a
        ``get_attr`` of a tensor that is no parameter and is computed from none (a buffer,
        a tensor the trace holds). A placeholder, a module call or a parameter on the way keeps
        the constant stored (and its sizes guarded), as before.

In: the traced graph and the min-cut's cut. Out: the boundary constants stage 2 should
recompute, in boundary order (:func:`~graphsplit.planning.cut.boundary.choose_boundary` takes
them off the boundary):

    recomputable_constants(graph, cut) -> tuple[fx.Node, ...]
"""

from __future__ import annotations

import torch
import torch.fx as fx

from graphsplit.artifacts import Cut
from graphsplit.planning.cut.twin_reads import twins_for
from graphsplit.planning.rules.constant_sizes import computed_from_inputs, size_values_read
from graphsplit.planning.rules.node_inputs import reads_through
from graphsplit.planning.rules.opaque_call import is_opaque
from graphsplit.planning.rules.taint import facts, is_banned

__all__ = ["numbers_read_off_twins", "recomputable_constants"]


def recomputable_constants(
    graph: fx.Graph, cut: Cut
) -> tuple[tuple[fx.Node, ...], dict[fx.Node, fx.Node]]:
    """The boundary constants made from a size of the batch that stage 2 can compute cheaply,
    and the reads stage 2 makes on a twin for them (``{read: twin}``, see
    :mod:`~graphsplit.planning.cut.twin_reads`)."""
    data, opaque = computed_from_inputs(graph)
    available = set(cut.boundary) | set(cut.baked) | set(cut.stage2)
    constants: list[fx.Node] = []
    twin_reads: dict[fx.Node, fx.Node] = {}
    for node in cut.boundary:
        if not facts(node).is_constant or not size_values_read(node, data, opaque):
            continue
        twins = _recomputable(node, available, cut)
        if twins is not None:
            constants.append(node)
            twin_reads.update(twins)
    return tuple(constants), twin_reads


def numbers_read_off_twins(cut: Cut) -> tuple[tuple[fx.Node, ...], dict[fx.Node, fx.Node]]:
    """The numbers the cut baked that stage 2 can compute from reads of boundary tensors (OPT's
    ``q_length = inputs_embeds.shape[1]``), and those reads (``{read: twin}``).

    A baked number is a literal in stage 2, checked in stage 1: a plan per value. Read off a
    twin, it is whatever the batch has, and one plan serves every length."""
    available = set(cut.boundary) | set(cut.stage2)
    numbers: list[fx.Node] = []
    twin_reads: dict[fx.Node, fx.Node] = {}
    for number in cut.baked:
        twins = _recomputable(number, available, cut, twins_only=True)
        if twins:
            numbers.append(number)
            twin_reads.update(twins)
    return tuple(numbers), twin_reads


def _recomputable(
    constant: fx.Node, available: set[fx.Node], cut: Cut, *, twins_only: bool = False
) -> dict[fx.Node, fx.Node] | None:
    """None when stage 2 cannot compute ``constant``; else the twin reads it needs.
    ``twins_only``: every tensor the walk ends at must be read off a twin (a baked number
    read off a tensor stage 2 has would have been left computed by the cut)."""
    if not _cheap_to_redo(constant, cut):  # a frozen module's output (CLIP's positions) stays
        return None
    passed, ends = reads_through(
        constant, lambda node: node not in available and _cheap_to_redo(node, cut)
    )
    if twins_only and ends & available:
        return None
    twin_reads: dict[fx.Node, fx.Node] = {}
    for end in ends - available:  # a tensor stage 2 lacks: its reads may be made on a twin
        twins = twins_for(end, passed | {constant}, cut.boundary)
        if twins is None:
            return None
        twin_reads.update(twins)
    return twin_reads


def _cheap_to_redo(node: fx.Node, cut: Cut) -> bool:
    """Whether stage 2 may run ``node`` to rebuild a constant: it reads nothing stage 1 alone
    has (an input, a module, a parameter) and costs next to nothing."""
    if "facts" not in node.meta or node in cut.taint:
        return False
    node_facts = facts(node)
    if node_facts.random_ops or node_facts.params:
        return False
    if node.op == "get_attr":
        return isinstance(node.meta.get("val"), torch.Tensor)
    if node.op not in ("call_function", "call_method"):
        return False  # a placeholder not on the boundary, a module call
    if is_opaque(node) or is_banned(node, cut.taint):
        return False
    return node_facts.is_constant or not node_facts.is_tensor
