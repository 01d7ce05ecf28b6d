"""Torch calls that hold no traced value but must still become nodes while a step is traced.

Glossary:
    traced torch call: a torch call with no traced argument that still becomes a node: every
        random draw (:data:`RANDOM_FUNCTIONS`, :data:`RANDOM_FILLS`), and a real tensor indexed
        by a traced value (:class:`TracedTorchCalls`).
    sized method: a method of a real tensor given traced sizes (``self.uncond_embeds.expand(
        bsz, -1, -1)``, ``table.view(bsz, -1)``); torch's argument parser refuses a traced
        size among ``*size`` before any ``__torch_function__`` handler sees the call
        (:data:`SIZED_METHODS`, :func:`record_sized_methods`).
    random draw: a call of a torch function that draws random numbers; run at trace time, it
        would be frozen into the plan and replayed forever.

In: the trace's patcher and the tracer. Out: a torch function mode entered for the trace, and
the tables of random functions the example run shares:

    record_torch_calls(patcher, tracer) -> None   # the mode and the sized methods below
    record_sized_methods(patcher, tracer) -> None
    TracedTorchCalls(tracer): TorchFunctionMode
    RANDOM_FUNCTIONS, RANDOM_FILLS: frozenset
    SIZED_METHODS: tuple[str, ...]
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch.overrides import TorchFunctionMode

from graphsplit.planning.patching.distribution_draws import (
    DISTRIBUTION_SAMPLERS,
    gamma_clamped_out_of_place,
)
from graphsplit.planning.patching.originals import python_isinstance
from graphsplit.planning.patching.patcher import Patcher
from graphsplit.planning.patching.traced_values import contains_proxy
from graphsplit.runtime import functional_inplace

__all__ = [
    "RANDOM_FILLS",
    "RANDOM_FUNCTIONS",
    "SIZED_METHODS",
    "TracedTorchCalls",
    "record_sized_methods",
    "record_torch_calls",
]

# Every torch function that draws random numbers. fx records them when an argument is traced;
# without one (torch.randint(0, 1000, (1,)), torch.normal(..., device="cpu")) they would run
# once, at trace time, and the plan would replay that one draw forever.
RANDOM_FUNCTIONS = frozenset(
    {
        torch.rand,
        torch.randn,
        torch.randint,
        torch.rand_like,
        torch.randn_like,
        torch.randint_like,
        torch.normal,
        torch.randperm,
        torch.bernoulli,
        torch.multinomial,
        torch.poisson,
        torch.nn.functional.dropout,
        torch.nn.functional.dropout1d,
        torch.nn.functional.dropout2d,
        torch.nn.functional.dropout3d,
        torch.nn.functional.alpha_dropout,
        torch.nn.functional.feature_alpha_dropout,
    }
    | DISTRIBUTION_SAMPLERS  # torch.distributions' draws (planning/patching/distribution_draws.py)
)
# In-place random fills on a tensor the tracer does not follow (torch.empty(3).normal_()).
RANDOM_FILLS = frozenset(
    {
        torch.Tensor.normal_,
        torch.Tensor.uniform_,
        torch.Tensor.bernoulli_,
        torch.Tensor.exponential_,
        torch.Tensor.geometric_,
        torch.Tensor.log_normal_,
        torch.Tensor.cauchy_,
        torch.Tensor.random_,
    }
)


# Tensor methods (torch's C ones) that take sizes, dims or counts as ints: torch's parser
# accepts ``t.expand(n, -1)`` only if ``n`` is an ``int``, so a traced ``n`` never reaches a
# ``__torch_function__`` handler ("expand() takes 1 positional argument but 3 were given").
# Methods written in Python (``Tensor.split``, ``unflatten``) already pass a traced value on.
SIZED_METHODS = (
    "expand",
    "view",
    "reshape",
    "repeat",
    "tile",
    "permute",
    "flip",
    "broadcast_to",
    "sum_to_size",
    "new_empty",
    "new_zeros",
    "new_ones",
    "new_full",
    "narrow",
    "chunk",
    "movedim",
    "roll",
)

_INDEXING = {torch.Tensor.__getitem__: operator.getitem, torch.Tensor.__setitem__: operator.setitem}


class TracedTorchCalls(TorchFunctionMode):
    """Records, as graph nodes, torch calls that hold no traced value but must not run now.

    - random draws (:data:`RANDOM_FUNCTIONS`, :data:`RANDOM_FILLS`): one node each, in order,
      whatever their arguments (an explicit ``device=``, a ``generator=``);
    - indexing a real tensor with a traced index (``sigmas[step_ids]``): torch would first
      probe the index as a Python sequence (``len``, ``int``), which a traced value cannot
      answer; recorded as one ``getitem`` (and ``setitem`` likewise).

    Calls made while the tracer computes a node's value (``tracer.computing_meta``) run as is.
    """

    def __init__(self, tracer: Any) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.tracer.computing_meta:
            return func(*args, **kwargs)
        traced = contains_proxy((args, kwargs))
        if traced:
            self.tracer.drop_pending_guards((args, kwargs))
        if func in RANDOM_FUNCTIONS and not traced:
            return self.tracer.record_call(func, args, kwargs)
        if func in RANDOM_FILLS and not traced:
            tensor, *rest = args
            return self.tracer.record_call(
                functional_inplace, (tensor, func.__name__, *rest), kwargs
            )
        if func in _INDEXING and not traced and _slice_holds_proxy(args[1]):
            traced = True  # real[:n] with a traced n: one getitem node, the bound stays traced
        if func in _INDEXING and traced and not python_isinstance(args[0], fx.Proxy):
            return self.tracer.record_call(_INDEXING[func], args, kwargs)
        if traced:
            # Straight to the proxies' handler: torch's argument parser would first turn a
            # traced size in an int list (torch.randint(0, 10, (x.shape[0],))) into a Python
            # int through __index__, baking the batch size into the plan.
            return fx.Proxy.__torch_function__(func, types, args, kwargs)
        return func(*args, **kwargs)


def _slice_holds_proxy(index: Any) -> bool:
    items = index if python_isinstance(index, tuple) else (index,)
    return any(
        python_isinstance(item, slice) and contains_proxy((item.start, item.stop, item.step))
        for item in items
    )


def _recording_traced_sizes(tracer: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    """A tensor method that records one ``call_method`` node when given a traced value.

    The tensor itself (``self.uncond_embeds``, neither parameter nor buffer) becomes a
    constant of the graph, as fx stores any real tensor a node reads; the traced sizes stay
    nodes, so a batch size read from ``x.shape[0]`` follows the batch in the stages.
    """

    @functools.wraps(original)
    def sized_method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not tracer.computing_meta and contains_proxy((self, args, kwargs)):
            return tracer.create_proxy("call_method", original.__name__, (self, *args), kwargs)
        return original(self, *args, **kwargs)

    return sized_method


def record_sized_methods(patcher: Patcher, tracer: Any) -> None:
    """:data:`SIZED_METHODS` of real tensors take traced sizes: one node each.

    A traced tensor's methods never reach these (its attributes are nodes already,
    planning/tracing/proxies.py); a real tensor's methods with real arguments run as torch's.
    torch's ``__torch_function__`` dispatch looks methods up on ``torch.Tensor``, and fx asks
    :func:`torch.overrides.is_tensor_method_or_property` whether a handler is a method: its
    cached table is filled with torch's own methods before they are replaced.
    """
    torch.overrides._get_tensor_methods()
    for name in SIZED_METHODS:
        original = getattr(torch.Tensor, name)
        patcher.patch_method(torch.Tensor, name, _recording_traced_sizes(tracer, original))


def record_torch_calls(patcher: Patcher, tracer: Any) -> None:
    """Record random draws (``torch.distributions``' included), real-tensor indexing with
    traced indices and real tensors' methods given traced sizes (see above).

    A torch function mode is the calling thread's own (torch keeps the mode stack per
    thread): it is entered for the trace and exits with the patcher.
    """
    gamma_clamped_out_of_place(patcher, tracer)
    record_sized_methods(patcher, tracer)
    patcher.enter_context(TracedTorchCalls(tracer))
