"""Custom autograd functions on traced values, recorded as one node each while a step is traced.

Glossary:
    custom function: a subclass of ``torch.autograd.Function`` with its own ``backward``
        (TRL's fused LM head calls ``ChunkedLogProbFunction.apply(hidden, weight, ...)``).
    applier: the node's target, a function named ``<Class>_apply`` that calls
        ``Class.apply`` (:func:`applier`); one per class.

Traced tensors answer ``isinstance(x, torch.Tensor)`` as eager tensors do (traced_builtins), so
torch's ``Function.apply`` handed them to a C++ function that takes only real tensors
(``unwrap_if_dead``) and the trace failed with a ``TypeError``. Running ``forward`` op by op
instead would lose the class's ``backward``: stage 2 would differentiate ``forward``'s ops, a
different gradient (and ``forward`` often runs its own loops under ``no_grad``). So
``Class.apply(*args)`` with a traced argument is one ``call_function`` node: its meta value is
``forward`` run on meta tensors, and the stage that holds it calls ``Class.apply`` as the step
did, its ``backward`` included. ``torch.utils.checkpoint``'s ``CheckpointFunction`` never gets
here: :mod:`~graphsplit.planning.patching.checkpoint_regions` replaces it for the trace.

In: the trace's patcher and the tracer. Out: nothing; the replacement of ``Function.apply`` is
registered with the patcher:

    record_autograd_functions(patcher, tracer) -> None
    applier(function_class) -> Callable   # the node target for one class
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from graphsplit.planning.patching.patcher import Patcher
from graphsplit.planning.patching.traced_values import contains_proxy

__all__ = ["applier", "record_autograd_functions"]

_APPLIERS: dict[type, Callable[..., Any]] = {}


def applier(function_class: type) -> Callable[..., Any]:
    """The node target for ``function_class.apply``: a plain function (fx's code generator
    would name a bound classmethod by its defining class, ``torch.autograd.function.Function
    .apply``, and call the wrong ``apply``)."""
    found = _APPLIERS.get(function_class)
    if found is None:

        def apply(*args: Any, **kwargs: Any) -> Any:
            return function_class.apply(*args, **kwargs)

        apply.__name__ = apply.__qualname__ = f"{function_class.__name__}_apply"
        found = _APPLIERS[function_class] = apply
    return found


def _unpacked(output: Any) -> Any:
    """A tuple output as a tuple of its items: a traced item for each tensor, the value itself
    for the rest. ``forward`` returns ``None`` for an output it was not asked for (TRL's
    ``(log_probs, entropy, None, ...)``), and the step tests ``x is None`` on each item."""
    value = output.node.meta.get("val")
    if not isinstance(value, tuple):
        return output
    return tuple(
        output[index] if isinstance(item, torch.Tensor) else item
        for index, item in enumerate(value)
    )


def record_autograd_functions(patcher: Patcher, tracer: Any) -> None:
    """``Class.apply(...)`` with a traced argument: one node calling :func:`applier`'s target."""
    original = vars(torch.autograd.Function)["apply"].__func__

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        if tracer.computing_meta or not contains_proxy((args, kwargs)):
            return original(cls, *args, **kwargs)
        output = tracer.create_proxy("call_function", applier(cls), args, kwargs)
        return _unpacked(output)

    patcher.patch(torch.autograd.Function, "apply", classmethod(apply))
