"""The model's tensors as the module-level path's planning runs found them: put back after.

:func:`~graphsplit.calls.call_split.split_calls` runs the user's step for real on the example
batch (under two seeds, again with the trainable weights moved, on the last sample alone, with
the step's Python draws forced), and whatever the step writes into the model's tensors then, it
has written. MoCo's step enqueues its keys into a buffer and moves its key encoder by momentum
(``param_k.data = param_k.data * m + param_q.data * (1 - m)``); a BatchNorm in training mode
updates its running statistics. After a split, made or refused, the model was then not the one
the user handed over, and training it went elsewhere than the unsplit run would have.

So before the runs every buffer is copied
(:func:`~graphsplit.planning.patching.module_state.buffers_put_back`, as the ambient-autocast
run of stage 1 does) and every frozen parameter's tensor is noted: the tensor itself (a
reference, not a copy), its version counter and a few of its values. After them every buffer
gets its values back, and a parameter whose tensor the step replaced (``.data = ...``) gets its
own tensor back. A parameter written in place (``p.data.mul_(m)``, which bypasses the version
counter, is seen by its sampled values) cannot be put back without a copy of every weight,
which planning must not make: the error says so.

A frozen parameter the step writes is no frozen weight: a module whose outputs are cached holds
its values at caching time, and the step moves them every step. A split that caches a call of
a module holding one is refused, naming the parameter; one that leaves such a module in stage 2
(MoCo's key encoder runs on a shuffled batch: not cached) stays exact, the update included.

    @tensors_put_back                # on split_calls: the outermost call notes and puts back
    def split_calls(model, args, kwargs, **options) -> CallSplit: ...
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from graphsplit.errors import Fix, GraphsplitError, SplitError, user_error
from graphsplit.planning.patching.module_state import buffers_put_back
from graphsplit.planning.step.callables import as_step_module

__all__ = ["FROZEN_WRITE_FIX", "FrozenParameters", "tensors_put_back"]

FROZEN_WRITE_FIX = Fix(
    "update such weights outside the step (after optimizer.step(), as EMA teachers usually "
    "are) and cache only what a fixed module computes, rebuilding the cache when they move; "
    "or leave the module's work uncached (graphsplit.split(..., frozen=[...]) without it)"
)
_SAMPLES = 8
_OUTERMOST = threading.local()


@dataclass
class _Parameter:
    name: str
    param: nn.Parameter
    tensor: torch.Tensor  # the parameter's tensor itself, to give back if .data is replaced
    version: int
    samples: torch.Tensor


class FrozenParameters:
    """Notes of a module's frozen parameters (their tensors, versions and a few values), to
    give back a replaced tensor and to name a write after runs.

    Trainable parameters are left out: the runs that move them (:func:`~graphsplit.calls.
    provenance.moved`) put them back themselves.
    """

    def __init__(self, module: nn.Module) -> None:
        with torch.no_grad():
            self.parameters = [
                _Parameter(name, param, param.data, param._version, _sampled(param))
                for name, param in module.named_parameters()
                if param.device.type != "meta" and not param.requires_grad
            ]

    def put_back(self) -> tuple[list[str], list[str]]:
        """Every replaced tensor back; returns the names of the frozen parameters the runs
        wrote (``replaced``, now put back, and ``in_place``, not). A parameter only moved to
        another device or dtype (its values the same) is no write, and is left where the step
        moved it."""
        replaced, in_place = [], []
        with torch.no_grad():
            for noted in self.parameters:
                param, samples = noted.param, noted.samples
                now = _sampled(param).to(samples.device, samples.dtype)
                if param.data.data_ptr() != noted.tensor.data_ptr():
                    if not torch.equal(now, samples):
                        param.data = noted.tensor
                        replaced.append(noted.name)
                elif param._version != noted.version or not torch.equal(now, samples):
                    in_place.append(noted.name)
        return replaced, in_place


def _sampled(param: torch.Tensor) -> torch.Tensor:
    """A few of the tensor's values at fixed, evenly spaced places (the last one included)."""
    flat = param.detach().reshape(-1)
    if flat.numel() == 0:
        return flat.clone()
    count = min(_SAMPLES, flat.numel())
    # Integer steps: a float linspace rounds past the last index of a tensor over 2**24 long.
    places = torch.arange(count) * (flat.numel() - 1) // max(count - 1, 1)
    return flat[places].clone()


def tensors_put_back(split_calls: Callable[..., Any]) -> Callable[..., Any]:
    """``split_calls`` with the model's tensors put back after its runs, and refused when a
    call it caches belongs to a module whose frozen parameters the step writes."""

    @functools.wraps(split_calls)
    def wrapper(
        model: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None, **options: Any
    ) -> Any:
        if getattr(_OUTERMOST, "active", False):  # an opened module's split, inside the first
            return split_calls(model, args, kwargs, **options)
        module = as_step_module(model, args, dict(kwargs or {})).module
        noted = FrozenParameters(module)
        _OUTERMOST.active = True
        try:
            with buffers_put_back(module):
                split = split_calls(model, args, kwargs, **options)
        except GraphsplitError as refusal:
            _, in_place = noted.put_back()
            if in_place:
                refusal.add_note(_not_put_back(in_place))
            raise
        finally:
            _OUTERMOST.active = False
        replaced, in_place = noted.put_back()
        cached = {call[0] for call in split.plan.cached}
        written = [
            name
            for name in [*replaced, *in_place]
            if any(name.startswith(path + ".") for path in cached)
        ]
        if written:
            owner = next(path for path in cached if written[0].startswith(path + "."))
            message = (
                f"the step writes into the frozen parameter {written[0]!r} (a momentum or EMA "
                f"update inside the step?): {owner!r} holds it, and the module-level plan would "
                "cache that module's outputs once, while the step moves its weights every step."
            )
            if in_place:
                message += " " + _not_put_back(in_place)
            raise user_error(SplitError, message, fix=FROZEN_WRITE_FIX)
        if in_place:
            split.notes.append(_not_put_back(in_place))
        return split

    return wrapper


def _not_put_back(names: list[str]) -> str:
    shown = ", ".join(repr(name) for name in names[:3]) + (", ..." if len(names) > 3 else "")
    return (
        f"graphsplit ran the step to plan it, and the step wrote {shown} in place; those "
        "values are not put back (that would need a copy of every weight): reload them"
    )
