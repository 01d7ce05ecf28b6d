"""Whether a value holds a traced value: the test every recording patch asks first.

Glossary:
    traced value: a proxy of the step's tracer (an ``fx.Proxy``); only the tracing thread
        holds one, so a patch that answers as the original for everything else answers every
        other thread as the original does.

In: any value (a call's ``(args, kwargs)``). Out: a bool:

    contains_proxy(tree) -> bool
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree

from graphsplit.planning.patching.originals import (
    PLAIN_VALUE_TYPES,
    python_isinstance,
    python_list,
)

__all__ = ["contains_proxy"]

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
