"""Rewrites of the traced graph, in place, so the cut and the stages see plain dataflow.

In-place writes are rewritten by :mod:`graphsplit.planning.tracing.inplace`.

In: a traced ``torch.fx.Graph`` (and the model, or the step's real device).
Out: the same graph, rewritten:

    restore_input_names(graph, model) -> None
    restore_devices(graph, device) -> None
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.fx as fx
from torch import nn


def restore_input_names(graph: fx.Graph, model: nn.Module) -> None:
    """fx renames parameters it received as concrete args (``weight`` -> ``weight_1``)."""
    names = list(inspect.signature(model.forward).parameters)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, name in zip(placeholders, names):
        if node.target != name:
            node.target = name


def restore_devices(graph: fx.Graph, device: torch.device) -> None:
    """Code that read a module's ``.device`` during tracing saw ``meta``: put the real one back."""

    def replace(value: Any) -> Any:
        return device if isinstance(value, torch.device) and value.type == "meta" else value

    for node in graph.nodes:
        node.args = fx.node.map_aggregate(node.args, replace)
        node.kwargs = fx.node.map_aggregate(node.kwargs, replace)
