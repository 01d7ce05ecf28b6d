"""Python-level patches active only while a step is traced, each undone on exit.

Glossary:
    leaf method call: ``vae.encode(x)`` on a leaf module, recorded as one ``call_method`` node
        on a ``get_attr(vae)`` handle, just like ``forward`` (:func:`leaf_methods_recorded`).
    traced range: ``range(x.shape[1])`` with a traced size; the size becomes a guarded Python
        int read from the meta value (:func:`traced_range`).
    size-vararg factory: ``torch.zeros(h, w, 3)`` with traced ``h``/``w``; torch's argument
        parser only takes them as one tuple (:func:`traced_factories`).

In: the tracer (for :func:`leaf_methods_recorded`), or a function turning a traced size into a
Python int (for :func:`traced_range`). Out: context managers.
"""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import Callable, Iterator
from types import FunctionType
from typing import Any

import torch
import torch.fx as fx
import torch.utils._device
from torch import nn


# -- leaf method calls ------------------------------------------------------------------------
def _public_methods(module: nn.Module) -> list[str]:
    names: list[str] = []
    for klass in type(module).__mro__:
        if klass in (nn.Module, object):
            break
        for name, attr in vars(klass).items():
            if isinstance(attr, FunctionType) and not name.startswith("_") and name not in names:
                names.append(name)
    return names


def _contains_proxy(tree: Any) -> bool:
    return any(isinstance(leaf, fx.Proxy) for leaf in torch.utils._pytree.tree_leaves(tree))


@contextlib.contextmanager
def leaf_methods_recorded(
    tracer: Any, model: nn.Module, leaf_names: frozenset[str]
) -> Iterator[None]:
    """Record method calls on leaf modules (``vae.encode(x)``) as single nodes.

    ``tracer`` is the step's tracer: ``tracer.computing_meta`` is true while it runs an op for
    its meta value (the real method must run then), ``tracer.module_proxy(name)`` gives the
    module's ``get_attr`` handle.
    """
    patched = []
    for qualified_name in sorted(leaf_names):
        module = model.get_submodule(qualified_name)
        for method_name in _public_methods(module):
            original = getattr(module, method_name)

            def recorded(
                *args, __name=qualified_name, __method=method_name, __orig=original, **kwargs
            ):
                if tracer.computing_meta or not _contains_proxy((args, kwargs)):
                    return __orig(*args, **kwargs)
                handle = tracer.module_proxy(__name)
                return tracer.create_proxy("call_method", __method, (handle, *args), kwargs)

            had = method_name in vars(module)
            previous = vars(module).get(method_name)
            object.__setattr__(module, method_name, recorded)
            patched.append((module, method_name, had, previous))
    try:
        yield
    finally:
        for module, method_name, had, previous in reversed(patched):
            if had:
                object.__setattr__(module, method_name, previous)
            else:
                vars(module).pop(method_name, None)


# -- range() over traced sizes ------------------------------------------------------------------
class _RangeType(type):
    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, _BUILTIN_RANGE)


_BUILTIN_RANGE = range


@contextlib.contextmanager
def traced_range(to_int: Callable[[fx.Proxy], int]) -> Iterator[None]:
    """``range(x.shape[1])`` works while tracing: ``to_int`` turns traced sizes into ints."""

    class TracedRange(metaclass=_RangeType):
        def __new__(cls, *args: Any) -> range:
            args = tuple(to_int(arg) if isinstance(arg, fx.Proxy) else arg for arg in args)
            return _BUILTIN_RANGE(*args)

    builtins.range = TracedRange
    try:
        yield
    finally:
        builtins.range = _BUILTIN_RANGE


# -- factories with traced sizes ------------------------------------------------------------------
_SIZE_VARARG_FACTORIES = ("zeros", "ones", "empty", "rand", "randn")


def _packing_sizes(factory: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.zeros(h, w, 3)`` with traced ``h``/``w``: torch's parser takes them as a tuple."""

    def factory_with_traced_sizes(*args: Any, **kwargs: Any) -> Any:
        if any(isinstance(arg, fx.Proxy) for arg in args) and all(
            isinstance(arg, (int, fx.Proxy)) for arg in args
        ):
            return factory(tuple(args), **kwargs)
        return factory(*args, **kwargs)

    return factory_with_traced_sizes


@contextlib.contextmanager
def traced_factories() -> Iterator[None]:
    """``torch.zeros`` / ``ones`` / ``empty`` / ``rand`` / ``randn`` accept traced sizes."""
    # torch.device(...) as a context manager caches the set of factory functions it redirects
    # on first use; fill that cache with the real functions before they are wrapped.
    device_constructors = getattr(torch.utils._device, "_device_constructors", None)
    if device_constructors is not None:
        device_constructors()
    originals = {name: getattr(torch, name) for name in _SIZE_VARARG_FACTORIES}
    for name, factory in originals.items():
        setattr(torch, name, _packing_sizes(factory))
    try:
        yield
    finally:
        for name, factory in originals.items():
            setattr(torch, name, factory)
