"""torch functions whose C++ cannot read a traced argument, replaced to take one for a trace.

Glossary:
    size-vararg factory: ``torch.zeros(h, w, 3)`` with traced ``h``/``w``; torch's argument
        parser only takes them as one tuple (:func:`accept_traced_sizes`).
    legacy constructor: ``torch.Tensor(data)`` / ``torch.Tensor(*sizes)``, which torch runs
        without consulting ``__torch_function__``; with a traced argument it is one node
        (:func:`record_legacy_constructor`).
    assumed check: ``torch._check(cond)`` / ``torch._check_tensor_all_with(error, cond,
        message)`` on a traced condition, taken to hold (:func:`assume_tensor_checks`).

Every replacement calls torch's own function for arguments that hold no traced value, which
is every call another thread makes while a step is traced.

In: the trace's patcher (and the tracer, for the legacy constructor). Out: nothing; the
replacements are registered with the patcher:

    accept_traced_sizes(patcher) -> None
    record_legacy_constructor(patcher, tracer) -> None
    assume_tensor_checks(patcher) -> None
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.utils._device

from graphsplit.planning.patching.originals import python_isinstance, python_list
from graphsplit.planning.patching.patcher import Patcher
from graphsplit.planning.patching.traced_values import contains_proxy

__all__ = ["accept_traced_sizes", "assume_tensor_checks", "record_legacy_constructor"]

# -- factories with traced sizes ------------------------------------------------------------------
SIZE_VARARG_FACTORIES = ("zeros", "ones", "empty", "rand", "randn")


def _is_traced_int(arg: Any) -> bool:
    """A traced value standing for one size; a traced ``torch.Size`` (``torch.randn(h.shape)``)
    is already the whole size and is passed on as it is."""
    return python_isinstance(arg, fx.Proxy) and not python_isinstance(
        arg.node.meta.get("val"), (tuple, python_list, torch.Size)
    )


def _packing_sizes(factory: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.zeros(h, w, 3)`` with traced ``h``/``w``: torch's parser takes them as a tuple."""

    def factory_with_traced_sizes(*args: Any, **kwargs: Any) -> Any:
        if any(_is_traced_int(arg) for arg in args) and all(
            python_isinstance(arg, int) or _is_traced_int(arg) for arg in args
        ):
            return factory(tuple(args), **kwargs)
        return factory(*args, **kwargs)

    return factory_with_traced_sizes


def accept_traced_sizes(patcher: Patcher) -> None:
    """``torch.zeros`` / ``ones`` / ``empty`` / ``rand`` / ``randn`` accept traced sizes."""
    # torch.device(...) as a context manager caches the set of factory functions it redirects
    # on first use; fill that cache with the real functions before they are wrapped.
    device_constructors = getattr(torch.utils._device, "_device_constructors", None)
    if device_constructors is not None:
        device_constructors()
    for name in SIZE_VARARG_FACTORIES:
        patcher.patch(torch, name, _packing_sizes(getattr(torch, name)))


# -- torch.Tensor(...) ----------------------------------------------------------------------------
def record_legacy_constructor(patcher: Patcher, tracer: Any) -> None:
    """``torch.Tensor([guidance] * latents.shape[0])`` with a traced argument: one node.

    The legacy constructor is ``Tensor.__new__``, which torch's C++ runs without asking any
    ``__torch_function__`` handler, so a traced list (or size) reached it as an object it
    cannot read ("not a storage"). Replaced for the trace, it records the call as
    ``torch.Tensor(...)`` (stage code runs it as written, eager's dtype and device rules
    included); without traced arguments, and for subclasses, it is torch's own. torch.Tensor
    inherits ``__new__`` from ``torch._C.TensorBase``: the patcher deletes it again on exit.
    """
    original = torch.Tensor.__new__

    def legacy_constructor(cls: type, *args: Any, **kwargs: Any) -> Any:
        if cls is torch.Tensor and not tracer.computing_meta and contains_proxy((args, kwargs)):
            return tracer.create_proxy("call_function", torch.Tensor, args, kwargs)
        return original(cls, *args, **kwargs)

    patcher.patch_method(torch.Tensor, "__new__", staticmethod(legacy_constructor))


# -- torch._check(...) ----------------------------------------------------------------------------
def assume_tensor_checks(patcher: Patcher) -> None:
    """torch's run-time checks on traced conditions are assumed to hold, as torch.export does.

    transformers' ``torch_compilable_check`` (LLaVA's "image features and image tokens do not
    match") ends in ``torch._check_tensor_all_with(error, cond, message)``, which reads
    ``cond._is_all_true().item()``, or in ``torch._check_with``, which insists on a real
    ``bool``: a traced condition has no value yet. A check states what must hold for the step
    to run at all; it changes no value, so the plan is the same whether it holds or not, and
    leaf modules still run their own checks on real data in the stages. Checks on real values
    run as usual.
    """

    def assumed(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def check(error_type: Any, cond: Any, message: Any = None) -> None:
            if python_isinstance(cond, fx.Proxy):
                return None
            return original(error_type, cond, message)

        return check

    for name in ("_check_with", "_check_tensor_all_with"):
        patcher.patch(torch, name, assumed(getattr(torch, name)))
