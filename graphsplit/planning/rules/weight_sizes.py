"""A size read off the step's own weights is the same for every batch: a check may write it.

CLIP's text embeddings refuse a prompt longer than the position table::

    max_position_embedding = self.position_embedding.weight.shape[0]
    if seq_length > max_position_embedding:

The comparison is a size guard (:mod:`graphsplit.planning.rules.size_guards`): a stage must
recompute ``seq_length > 77`` to check a batch of another length. When the whole text encoder
is frozen, stage 1 holds the position table and recomputes it. When its token embedding trains
(``examples/textual_inversion``), stage 2 runs the embedding from ``input_ids`` but the frozen
position embedding's output is cached, so neither stage holds the table and the split was
refused, though ``weight.shape[0]`` cannot change from batch to batch. Such a value is written
into the check as the number it is, where no stage holds the tensor it was read from.

Glossary:
    weight size: a plain int, or tuple of ints, computed by size inspections (``.shape``,
        ``[k]``, arithmetic) from ``get_attr`` tensors only (parameters, buffers, constants),
        never from the batch: its value is the traced one for every batch of a plan.

In: a node and the size-guard module's notion of a size inspection. Out:

    is_weight_size(node, is_inspection) -> bool
"""

from __future__ import annotations

from collections.abc import Callable

import torch.fx as fx

from graphsplit.planning.rules.node_inputs import reads_through

__all__ = ["is_weight_size"]


def is_weight_size(node: fx.Node, is_inspection: Callable[[fx.Node], bool]) -> bool:
    """Whether ``node`` is a weight size (see the glossary).

    >>> import torch
    >>> graph = fx.Graph()
    >>> weight = graph.get_attr("weight")
    >>> shape = graph.call_function(getattr, (weight, "shape"))
    >>> rows = graph.call_function(__import__("operator").getitem, (shape, 0))
    >>> rows.meta["val"] = 77
    >>> is_weight_size(rows, lambda n: n.op == "call_function")
    True
    """
    value = node.meta.get("val")
    plain = type(value) is int or (
        isinstance(value, tuple) and all(type(item) is int for item in value)
    )
    if not plain or not is_inspection(node):
        return False
    _, ends = reads_through(node, lambda n: n.op != "get_attr" and is_inspection(n))
    return bool(ends) and all(end.op == "get_attr" for end in ends)
