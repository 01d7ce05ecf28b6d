"""Method calls on leaf modules, recorded as one node each while a step is traced.

Glossary:
    leaf method call: ``vae.encode(x)`` on a leaf module, recorded as one ``call_method`` node
        on a ``get_attr(vae)`` handle, just like ``forward`` (:func:`record_leaf_methods`).
    recording wrapper: the function bound, for the trace, as each public method of a leaf
        (:func:`is_recording_wrapper` recognises one); it calls the method it wraps when no
        traced value is passed or a node's meta value is computed.

In: the trace's patcher, the tracer, the model and its leaves' names. Out: the wrappers,
registered with the patcher; and the two helpers the call memo and tests share:

    record_leaf_methods(patcher, tracer, model, leaf_names) -> None
    wrapped_like(wrapper, original) -> wrapper
    is_recording_wrapper(function) -> bool
"""

from __future__ import annotations

import functools
from types import FunctionType, MethodType
from typing import Any

from torch import nn

from graphsplit.planning.patching.patcher import Patcher
from graphsplit.planning.patching.traced_values import (
    contains_proxy,
    holds_an_object_fx_cannot_hold,
)

__all__ = ["is_recording_wrapper", "record_leaf_methods", "wrapped_like"]


def _public_methods(cls: type) -> tuple[str, ...]:
    """Methods defined by ``cls`` and its bases up to ``nn.Module``."""
    names: list[str] = []
    for klass in cls.__mro__:
        if klass in (nn.Module, object):
            break
        for name, attr in vars(klass).items():
            if isinstance(attr, FunctionType) and not name.startswith("_") and name not in names:
                names.append(name)
    return tuple(names)


def record_leaf_methods(
    patcher: Patcher, tracer: Any, model: nn.Module, leaf_names: frozenset[str]
) -> None:
    """Record method calls on leaf modules (``vae.encode(x)``) as single nodes.

    ``tracer`` is the step's tracer: ``tracer.computing_meta`` is true while it runs an op for
    its meta value (the real method must run then), ``tracer.module_proxy(name)`` gives the
    module's ``get_attr`` handle. Each method is an instance attribute for the trace.
    """
    methods_of: dict[type, tuple[str, ...]] = {}  # a big model has thousands of leaves, few types
    flags_of: dict[int, frozenset[bool]] = {}  # one walk of the tree for every leaf's flags
    submodules: dict[str, nn.Module] = {"": model}
    for qualified_name in sorted(leaf_names):
        module = _submodule(submodules, qualified_name)
        if type(module) not in methods_of:
            methods_of[type(module)] = _public_methods(type(module))
        inline = _requires_grad_flags(module, flags_of) == {True, False}
        for method_name in methods_of[type(module)]:
            original = getattr(module, method_name)
            recorded = _recording(tracer, qualified_name, method_name, original, inline=inline)
            patcher.patch(module, method_name, recorded)


def _submodule(known: dict[str, nn.Module], qualified_name: str) -> nn.Module:
    """``model.get_submodule(qualified_name)``, one step from its memoised parent.

    ``known`` maps dotted names already resolved to their modules (``""`` is the model), so
    thousands of leaves sharing their parents cost one attribute step each instead of a walk
    from the root each.
    """
    module = known.get(qualified_name)
    if module is None:
        parent, _, last = qualified_name.rpartition(".")
        module = known[qualified_name] = _submodule(known, parent).get_submodule(last)
    return module


def _requires_grad_flags(
    module: nn.Module, flags_of: dict[int, frozenset[bool]]
) -> frozenset[bool]:
    """The ``requires_grad`` values of ``module``'s parameters: ``{True, False}`` when it mixes
    frozen and trainable ones (a LoRA'd DiT).

    ``flags_of`` memoises them per module (by id), so nested leaves share one walk instead of
    each walking its whole subtree (``module.parameters()`` per leaf was quadratic in depth).
    """
    known = flags_of.get(id(module))
    if known is None:
        flags = {param.requires_grad for param in module._parameters.values() if param is not None}
        for child in module._modules.values():
            if child is not None:
                flags |= _requires_grad_flags(child, flags_of)
        known = flags_of[id(module)] = frozenset(flags)
    return known


def _recording(
    tracer: Any, qualified_name: str, method_name: str, original: Any, *, inline: bool
) -> Any:
    """``original`` (a bound method), recorded as one node when called on traced values.

    ``functools.wraps`` keeps its signature: library code inspects it (transformers'
    ``apply_chunking_to_forward`` counts the parameters of the forward it is given).

    ``inline``: the module mixes frozen and trainable parameters. A method other than
    ``forward`` (``dit.patchify(x)``, ``dit.unpatchify(x, grid)``) is then traced into, its
    submodules staying leaves, so stage 2 holds only the submodules and parameters the method
    uses instead of the whole module with every frozen weight in it. If tracing into it
    fails, the call is recorded as one node, as for other modules.
    """

    def recorded(*args: Any, **kwargs: Any) -> Any:
        if tracer.computing_meta or not contains_proxy((args, kwargs)):
            return original(*args, **kwargs)
        if holds_an_object_fx_cannot_hold((args, kwargs)):  # no node could hold it: trace
            return original(*args, **kwargs)
        if inline:
            with tracer.rolled_back_on_error():
                return original(*args, **kwargs)
            # It failed, and what it traced was undone: record the call whole.
        handle = tracer.module_proxy(qualified_name)
        return tracer.create_proxy("call_method", method_name, (handle, *args), kwargs)

    return wrapped_like(recorded, original)


def wrapped_like(wrapper: FunctionType, original: Any) -> FunctionType:
    """``functools.wraps(original)(wrapper)``, quickly for the usual bound method.

    A big model's leaves get one wrapper per public method (SDXL: 20,513); ``update_wrapper``
    costs about 4 µs each through its generic attribute loop, assigning the same attributes
    from the method's function directly a fraction of that. Anything else (a ``partial`` an
    accelerate hook installed as ``forward``) goes through ``update_wrapper``.
    """
    if type(original) is not MethodType:
        return functools.update_wrapper(wrapper, original)
    function = original.__func__
    if type(function) is not FunctionType:
        return functools.update_wrapper(wrapper, original)
    for name in _WRAPPER_ASSIGNMENTS:  # __module__, __name__, __qualname__, __doc__, ...
        setattr(wrapper, name, getattr(function, name))
    if function.__dict__:
        wrapper.__dict__.update(function.__dict__)
    wrapper.__wrapped__ = original
    return wrapper


# What update_wrapper assigns in this Python version (3.12 adds __type_params__); a plain
# function has every one of them.
_WRAPPER_ASSIGNMENTS = functools.WRAPPER_ASSIGNMENTS


def is_recording_wrapper(function: FunctionType) -> bool:
    """Whether ``function`` is the tracer's wrapper of a leaf's method (:func:`_recording`):
    while a node's meta value is computed it only calls the method it wraps."""
    return function.__code__ is _RECORDING_CODE


def _any_method() -> None:
    pass


_RECORDING_CODE = _recording(None, "", "", _any_method, inline=False).__code__
