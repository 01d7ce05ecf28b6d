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

A ``.device`` read of a derived tensor (DETR's ``device = pixel_values.device``) is allowed
where the device it carries (:func:`~.ops.result_device`, from the input's own) is the real
one: stage 2 answers it with the device of its batch's other tensors, so an input whose batch
may hold no other tensor (:func:`lone_inputs`) and whose device is read is stored.

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
from graphsplit.calls.field_reads import VALUE
from graphsplit.calls.module_calls import CallId
from graphsplit.calls.unstored_inputs.ops import (
    on_meta,
    python_valued,
    reads_device,
    refusal,
    result_device,
)
from graphsplit.calls.usage import Usage
from graphsplit.planning.rules.user_lines import frame_location, user_frame


class Derivation(Usage):
    """A probe's usage record that also follows the tensors derived from ``roots`` (input name
    -> the example batch's tensor)."""

    def __init__(self, roots: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self._derived: dict[int, tuple[frozenset[str], torch.device | None]] = {}
        self._refs: list[weakref.ref[torch.Tensor]] = []
        self.roots = frozenset(roots)
        self.refused: dict[str, str] = {}
        """Input name -> why stage 2 cannot run the step on its stand-in (the first reason)."""
        self.entered: list[tuple[CallId, frozenset[str]]] = []
        """``(call, names)``: a frozen call's code took tensors derived from these inputs."""
        self.device_read: set[str] = set()
        """The inputs the step's own code read the ``.device`` of (or of a value derived)."""
        for name, tensor in roots.items():
            self._derive(tensor, self.names_of(tensor) | {name}, tensor.device)

    def names_of(self, value: Any) -> frozenset[str]:
        """The inputs ``value`` is derived from (empty: none, or not a tensor)."""
        if not isinstance(value, torch.Tensor):
            return frozenset()
        return self._derived.get(id(value), (frozenset(), None))[0]

    def device_of(self, tensor: torch.Tensor) -> torch.device | None:
        """The device stage 2 would carry for ``tensor`` (None: unknown): a derived tensor's
        own record, any other tensor's real device."""
        known = self._derived.get(id(tensor))
        if known is not None:
            return known[1]
        with torch._C.DisableTorchFunctionSubclass():
            return tensor.device

    def _derive(
        self, tensor: torch.Tensor, names: frozenset[str], device: torch.device | None
    ) -> None:
        # The device as the call gave it, even for a tensor it gave back (x.type(its dtype)):
        # stage 2's stand-in, on meta, cannot tell a tensor given back from a move.
        key = id(tensor)
        entry = (names, device)
        self._derived[key] = entry

        def forget(_: Any, key: int = key, entry: tuple[Any, ...] = entry) -> None:
            if self._derived.get(key) is entry:
                del self._derived[key]

        self._refs.append(weakref.ref(tensor, forget))

    def _refuse(self, names: frozenset[str], why: str) -> None:
        where, code = frame_location(user_frame())
        for name in names:
            self.refused.setdefault(name, f"{why} ({where}  {code})" if code else why)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        names: frozenset[str] = frozenset()
        if self._derived:
            for leaf in _tensors((args, kwargs)):
                names |= self.names_of(leaf)
        context = self.context
        if names and context is not None:  # a frozen call computes with it (unstored_inputs)
            self.entered.append((context, names))
            return super().__torch_function__(func, types, args, kwargs)
        if not names:
            return super().__torch_function__(func, types, args, kwargs)
        if all(name in self.refused for name in names):  # stored: followed for the report only
            result = super().__torch_function__(func, types, args, kwargs)
            for leaf in _tensors(result):
                self._derive(leaf, names | self.names_of(leaf), None)
            return result
        if reads_device(func):  # stage 2 answers with the device it carries: is it this one?
            result = super().__torch_function__(func, types, args, kwargs)
            if self.device_of(args[0]) == result:
                self.device_read |= names
            else:
                self._refuse(
                    names,
                    "reads its .device, which stage 2 cannot answer for certain (a move to a "
                    "device not named exactly, or tensors on several devices)",
                )
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
            self._refuse(names, why)
        device = result_device(func, args, kwargs, self.device_of)
        for leaf in _tensors(result):
            self._derive(leaf, names | self.names_of(leaf), device)
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


def lone_inputs(
    inputs: Iterable[Any], uses: dict[CallId, dict[str, str]], inner: Iterable[CallId]
) -> frozenset[str]:
    """The inputs (specs with ``name`` and ``kind``) beside which stage 2's batch may hold no
    other tensor to answer their ``.device`` with: the one input that crosses (a constant
    does not), where no stored call's field is stored for its values. Shape rows are not
    counted: a step reading only shapes of the cached outputs keeps such an input stored."""
    inner = set(inner)
    stored = [fields for call, fields in uses.items() if call not in inner]
    if any(use == VALUE for fields in stored for use in fields.values()):
        return frozenset()
    crossing = [spec.name for spec in inputs if spec.kind != "constant"]
    return frozenset(crossing) if len(crossing) == 1 else frozenset()


def unstored_inputs(
    derivations: Iterable[Derivation],
    results: Iterable[Any],
    cached: set[CallId],
    lone: frozenset[str] = frozenset(),
) -> tuple[set[str], dict[str, str]]:
    """``(unstored, kept)``: the inputs only cached calls compute with in every probe (and,
    of the ``lone`` ones, :func:`lone_inputs`, that the step reads no ``.device`` of), and,
    for each other input some cached call took, why it is stored (for the report)."""
    kept: dict[str, str] = {}
    taken: set[str] = set()
    roots: set[str] = set()
    for derivation, result in zip(derivations, results):
        roots |= derivation.roots
        for name, why in derivation.refused.items():
            kept.setdefault(name, f"a value computed from it reaches a call that {why}")
        for name in derivation.device_read & lone:
            kept.setdefault(
                name,
                "the step reads its .device, and stage 2's batch holds no other tensor to "
                "answer that with",
            )
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
