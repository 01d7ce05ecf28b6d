"""wrapped_like gives the wrapper what functools.wraps would, for methods and other callables."""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

from graphsplit.planning.patching.leaf_methods import wrapped_like


class Annotated(nn.Module):
    def encode(self, pixels: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        """Scale the pixels."""
        return pixels * scale


Annotated.encode.custom_marker = "kept"  # a function attribute update_wrapper copies


def _attributes(function):
    names = (*functools.WRAPPER_ASSIGNMENTS, "__wrapped__")
    return {name: getattr(function, name) for name in names} | {"dict": dict(vars(function))}


def _wrapper(*args, **kwargs):
    return None


def _copy_of(function):
    return type(function)(function.__code__, function.__globals__)


def test_bound_method_gets_what_functools_wraps_gives():
    module = Annotated()
    quick = wrapped_like(_copy_of(_wrapper), module.encode)
    reference = functools.wraps(module.encode)(_copy_of(_wrapper))
    assert _attributes(quick) == _attributes(reference)
    assert quick.__name__ == "encode" and quick.__doc__ == "Scale the pixels."
    assert quick.custom_marker == "kept"
    assert str(inspect.signature(quick)) == str(inspect.signature(module.encode))


def test_other_callables_go_through_update_wrapper():
    module = Annotated()
    hooked = functools.partial(Annotated.encode, module)  # as an accelerate hook installs it
    quick = wrapped_like(_copy_of(_wrapper), hooked)
    assert quick.__wrapped__ is hooked
    assert str(inspect.signature(quick)) == str(inspect.signature(hooked))
