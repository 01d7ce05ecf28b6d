"""Whether a value holds a traced value: the test every recording patch asks first.

Glossary:
    traced value: a proxy of the step's tracer (an ``fx.Proxy``); only the tracing thread
        holds one, so a patch that answers as the original for everything else answers every
        other thread as the original does.

    object fx cannot hold: an argument ``fx.Tracer.create_arg`` refuses ("argument of type"):
        not a proxy, tensor, module, plain value, enum, slice or container of those
        (transformers' ``DynamicCache``, which a decoder layer is handed in training).

In: any value (a call's ``(args, kwargs)``). Out: a bool:

    contains_proxy(tree) -> bool
    holds_an_object_fx_cannot_hold(tree) -> bool
"""

from __future__ import annotations

import enum
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree
from torch import nn

from graphsplit.planning.patching.originals import (
    PLAIN_VALUE_TYPES,
    python_isinstance,
    python_list,
)

__all__ = ["contains_proxy", "holds_an_object_fx_cannot_hold"]

# Leaves that hold no traced value (a tensor here is a real or meta one: a traced tensor is a
# proxy).
_NO_PROXY_INSIDE = PLAIN_VALUE_TYPES | {torch.Tensor}


def contains_proxy(tree: Any) -> bool:
    """Whether a traced value is anywhere in ``tree`` (its pytree leaves).

    Asked for every leaf-module call and every torch call the tracer sees, so plain tuples,
    lists and dicts are walked directly and Python's own ``isinstance`` is used (the trace's
    stand-in answers for proxies, which this test is about); other containers go through
    pytree.
    """
    kind = type(tree)
    if kind is tuple or kind is python_list:  # ``list`` itself is the trace's stand-in
        return any(map(contains_proxy, tree))
    if kind is dict:
        return any(map(contains_proxy, tree.values()))
    if kind in _NO_PROXY_INSIDE:
        return False
    if python_isinstance(tree, fx.Proxy):
        return True
    return any(python_isinstance(leaf, fx.Proxy) for leaf in torch.utils._pytree.tree_leaves(tree))


# What fx.Tracer.create_arg records as a node argument, beside containers and proxies.
_FX_ARGUMENT_TYPES = (*fx.node.base_types, slice, range, enum.Enum, nn.Module, type(None))


def holds_an_object_fx_cannot_hold(tree: Any) -> bool:
    """Whether a call's arguments hold an object fx cannot record as a node argument.

    A leaf-module call handed one (each Llama or T5 decoder layer gets the ``DynamicCache`` the
    model makes when ``use_cache`` is on, the default in training) cannot be one node; the
    tracer traces through the module instead, where the object's methods run on the traced
    values (:meth:`~graphsplit.planning.tracing.tracer.StepTracer.call_module`).
    """
    kind = type(tree)
    if kind is tuple or kind is python_list:
        return any(map(holds_an_object_fx_cannot_hold, tree))
    if kind is dict:
        return any(map(holds_an_object_fx_cannot_hold, tree.values()))
    if tree is Ellipsis or python_isinstance(tree, (fx.Proxy, *_FX_ARGUMENT_TYPES)):
        return False
    if python_isinstance(tree, (tuple, list, dict)):  # a namedtuple, a ModelOutput
        return any(map(holds_an_object_fx_cannot_hold, torch.utils._pytree.tree_leaves(tree)))
    return not (hasattr(tree, "__fx_create_arg__") or callable(tree))
