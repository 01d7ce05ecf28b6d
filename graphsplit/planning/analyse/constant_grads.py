"""Tensors the trace holds as constants that still carry a gradient to a parameter.

A step may read a tensor made outside it from a trainable parameter: diffusers' Kandinsky 2.2
prior script takes ``clip_mean = prior.clip_mean.clone()`` before its loop and normalises
``(image_embeds - clip_mean) / clip_std`` in the step. The clone is no parameter, so the trace
holds it as a constant (``_tensor_constant0``), and a constant was taken for data: work on it
looked frozen. But it still requires grad, its ``grad_fn`` leading back to the parameter:
cached, the gradient eager sends through it was lost; under the step's own ``no_grad``,
dropped as exact, stage 2 sent gradients to the parameter that eager never sends. Here such a
constant reads the parameters its ``grad_fn`` graph ends at, so taint follows them as it
follows a parameter read.

In and out::

    params_behind(node, constant, name_of) -> frozenset[str]   # node_facts.resolve_params
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from graphsplit.errors import Fix, TraceError, user_error

__all__ = ["params_behind"]

HELD_GRAD_FIX = Fix(
    "make it a parameter of a module the step calls (nn.Parameter), or .detach() it where its "
    "gradient is not wanted (the unsplit step then computes the same)"
)


def params_behind(node: fx.Node, constant: Any, name_of: dict[int, str]) -> frozenset[str]:
    """The names of the model's parameters that ``constant`` (the tensor ``node`` reads, held
    by the trace) carries a gradient to; empty for one that requires none. One whose gradient
    ends at a tensor the model does not hold (a leaf the user optimises apart) is refused:
    graphsplit cannot tell whether it trains."""
    if not isinstance(constant, torch.Tensor) or not constant.requires_grad:
        return frozenset()
    if constant.device.type == "meta":  # computed from the analysis's meta weights: refused
        return frozenset()  # by planning/rules/weight_constants.py, naming the loop's line
    leaves = _grad_leaves(constant)
    outside = [leaf for leaf in leaves if id(leaf) not in name_of]
    if outside:
        raise user_error(
            TraceError,
            f"The step reads a tensor made outside it that requires grad (shape "
            f"{tuple(constant.shape)}), whose gradient goes to a tensor that is no parameter "
            "of the model: graphsplit cannot tell whether it trains, so it cannot tell what "
            "is cacheable.",
            node=node,
            source=_first_use(node),
            fix=HELD_GRAD_FIX,
        )
    return frozenset(name_of[id(leaf)] for leaf in leaves)


def _first_use(node: fx.Node) -> str | None:
    """The user's line of the first op that reads the constant (its own node has none)."""
    return next((user.meta["source"] for user in node.users if user.meta.get("source")), None)


def _grad_leaves(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors the autograd graph of ``tensor`` accumulates gradients into."""
    if tensor.grad_fn is None:
        return [tensor]
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    stack = [tensor.grad_fn]
    while stack:
        function = stack.pop()
        if function is None or id(function) in seen:
            continue
        seen.add(id(function))
        variable = getattr(function, "variable", None)  # AccumulateGrad
        if isinstance(variable, torch.Tensor):
            found.append(variable)
            continue
        stack.extend(following for following, _ in function.next_functions)
    return found
