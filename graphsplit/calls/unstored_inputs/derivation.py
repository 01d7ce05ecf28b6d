"""Which batched tensor inputs only cached calls compute with, from the probes (see the
package's docstring).

:class:`Derivation` is the probe's :class:`~graphsplit.calls.usage.Usage` that also follows
the inputs: every tensor a torch call of the step's own code (outside any frozen call) makes
from an input, or from a tensor made so, is *derived* from that input. Such a call is what
stage 2 would run on the input's stand-in, so the probe checks it as stage 2 would run it
(:mod:`.ops`): the call must be one a stand-in allows, draw nothing, hand Python nothing of
the values, and give on ``meta`` tensors of the shapes and dtypes it gave here; else the input
is stored, for good (its first reason kept for the report; it is still followed, unchecked, so
that the report can say which cached call it reached). A frozen
call whose code takes a derived tensor is recorded, not followed inside: which calls are
cached is known only after the verdicts, and :func:`unstored_inputs` reads the record then
(cached, stage 2 answers the call without its arguments; kept, it would compute with the
stand-in, so the input is stored). A cached call's outputs are not derived: stage 2 is
answered with the real ones.

Ids of tensors are reused once a tensor is freed: a derived tensor's id is forgotten when the
tensor dies (a weak reference), so a later tensor with that id is never taken for a derived one.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.utils._pytree as pytree

from graphsplit.calls import generators
from graphsplit.calls.module_calls import CallId
from graphsplit.calls.unstored_inputs.ops import on_meta, python_valued, refusal
from graphsplit.calls.usage import Usage
from graphsplit.planning.rules.user_lines import frame_location, user_frame


class Derivation(Usage):
    """A probe's usage record that also follows the tensors derived from ``roots`` (input name
    -> the example batch's tensor)."""

    def __init__(self, roots: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self._names_of: dict[int, frozenset[str]] = {}
        self._refs: list[weakref.ref[torch.Tensor]] = []
        self.roots = frozenset(roots)
        self.refused: dict[str, str] = {}
        """Input name -> why stage 2 cannot run the step on its stand-in (the first reason)."""
        self.entered: list[tuple[CallId, frozenset[str]]] = []
        """``(call, names)``: a frozen call's code took tensors derived from these inputs."""
        for name, tensor in roots.items():
            self._derive(tensor, self.names_of(tensor) | {name})

    def names_of(self, value: Any) -> frozenset[str]:
        """The inputs ``value`` is derived from (empty: none, or not a tensor)."""
        if not isinstance(value, torch.Tensor):
            return frozenset()
        return self._names_of.get(id(value), frozenset())

    def _derive(self, tensor: torch.Tensor, names: frozenset[str]) -> None:
        key = id(tensor)
        self._names_of[key] = names

        def forget(_: Any, key: int = key, names: frozenset[str] = names) -> None:
            if self._names_of.get(key) is names:
                del self._names_of[key]

        self._refs.append(weakref.ref(tensor, forget))

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        names: frozenset[str] = frozenset()
        if self._names_of:
            for leaf in _tensors((args, kwargs)):
                names |= self._names_of.get(id(leaf), frozenset())
        context = self.context
        if names and context is not None:  # a frozen call computes with it (unstored_inputs)
            self.entered.append((context, names))
            return super().__torch_function__(func, types, args, kwargs)
        if not names:
            return super().__torch_function__(func, types, args, kwargs)
        if all(name in self.refused for name in names):  # stored: followed for the report only
            result = super().__torch_function__(func, types, args, kwargs)
            for leaf in _tensors(result):
                self._derive(leaf, names | self.names_of(leaf))
            return result
        why = refusal(func, kwargs)
        state = generators.snapshot() if why is None else None
        result = super().__torch_function__(func, types, args, kwargs)
        if why is None and generators.snapshot() != state:
            why = f"draws random numbers ({getattr(func, '__name__', func)})"
        if why is None and python_valued(func, result):
            why = f"hands its values to Python ({getattr(func, '__name__', func)})"
        if why is None:
            why = _differs_on_meta(func, args, kwargs, result)
        if why is not None:
            where, code = frame_location(user_frame())
            for name in names:
                self.refused.setdefault(name, f"{why} ({where}  {code})" if code else why)
        for leaf in _tensors(result):
            self._derive(leaf, names | self.names_of(leaf))
        return result


def _tensors(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def _differs_on_meta(func: Any, args: Any, kwargs: dict[str, Any], result: Any) -> str | None:
    """Why stage 2's run of this call on ``meta`` would not give what it gave (None: it does)."""
    name = getattr(func, "__name__", repr(func))
    try:
        simulated = on_meta(func, args, kwargs)
    except Exception as error:  # data-dependent shapes (nonzero, a boolean mask) and the like
        return f"runs {name}, which cannot run without the values ({type(error).__name__})"
    real, fake = _tensors(result), _tensors(simulated)
    if len(real) != len(fake) or any(
        a.shape != b.shape or a.dtype != b.dtype for a, b in zip(real, fake)
    ):
        return f"runs {name}, whose result on meta differs from the real one"
    return None


def unstored_inputs(
    derivations: Iterable[Derivation], results: Iterable[Any], cached: set[CallId]
) -> tuple[set[str], dict[str, str]]:
    """``(unstored, kept)``: the inputs only cached calls compute with in every probe, and,
    for each other input some cached call took, why it is stored (for the report)."""
    kept: dict[str, str] = {}
    taken: set[str] = set()
    roots: set[str] = set()
    for derivation, result in zip(derivations, results):
        roots |= derivation.roots
        for name, why in derivation.refused.items():
            kept.setdefault(name, f"a value computed from it reaches a call that {why}")
        for call, names in derivation.entered:
            if call in cached:
                taken |= names
                continue
            for name in names:
                kept.setdefault(name, f"{call[0]} call {call[1]}, which stage 2 runs, takes it")
        for leaf in _tensors(result):
            for name in derivation.names_of(leaf):
                kept.setdefault(name, "the step returns a value computed from it")
    return roots - set(kept), {name: why for name, why in kept.items() if name in taken}
