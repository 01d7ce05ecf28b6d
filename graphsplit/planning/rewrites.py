"""Rewrites of the traced graph, in place, so the cut and the stages see plain dataflow.

Glossary:
    functional setitem: ``x[k] = v`` recorded in place, rewritten as
        ``x2 = functional_setitem(x, k, v)`` with later reads of ``x`` reading ``x2``.
    view: a tensor sharing storage with another (``reshape``, ``transpose``, ``x[...]``);
        assigning into one would also write its base, which dataflow cannot express.

In: a traced ``torch.fx.Graph`` (and the model, or the step's real device).
Out: the same graph, rewritten:

    functionalize_setitem(graph) -> None
    restore_input_names(graph, model) -> None
    restore_devices(graph, device) -> None
"""

from __future__ import annotations

import inspect
import operator
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from graphsplit.errors import TraceError, user_error
from graphsplit.runtime import functional_setitem

_VIEW_METHODS = frozenset(
    {
        "view",
        "reshape",
        "transpose",
        "permute",
        "expand",
        "squeeze",
        "unsqueeze",
        "flatten",
        "unflatten",
        "narrow",
        "select",
        "unbind",
        "split",
        "chunk",
        "t",
        "view_as",
        "as_strided",
        "diagonal",
        "movedim",
        "swapaxes",
        "unfold",
    }
)


def _is_view(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target is operator.getitem:
        return isinstance(node.meta.get("val"), torch.Tensor)
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return node.op in ("call_method", "call_function") and name in _VIEW_METHODS


def functionalize_setitem(graph: fx.Graph) -> None:
    """Rewrite ``x[k] = v`` as ``x2 = functional_setitem(x, k, v)``; later reads use ``x2``.

    The cut and the stages then see plain dataflow. Assignments into a view would also change
    its base tensor, which dataflow cannot express, so they are refused.
    """
    order = {node: index for index, node in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if not (node.op == "call_function" and node.target is operator.setitem):
            continue
        target = node.args[0]
        producers = ("call_function", "call_method", "call_module")
        if not isinstance(target, fx.Node) or _is_view(target) or target.op not in producers:
            raise user_error(
                TraceError,
                "The step assigns into a slice of a tensor view or input (x[...] = value); "
                "graphsplit traces dataflow and cannot follow the write into the tensor it "
                "views.",
                node=node,
                fix="build the tensor with torch.where / torch.cat / torch.stack, or assign "
                "into a fresh tensor created in the step (torch.zeros(...)) rather than a view",
            )
        with graph.inserting_before(node):
            updated = graph.call_function(functional_setitem, node.args)
        # Keep the user's line; drop the op record of the in-place op (the copy runs other ops).
        updated.meta = {
            key: node.meta[key] for key in ("source", "source_code") if key in node.meta
        }
        updated.meta["val"] = target.meta.get("val")
        later = [user for user in target.users if order.get(user, -1) > order[node]]
        for user in later:
            user.replace_input_with(target, updated)
        graph.erase_node(node)


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
