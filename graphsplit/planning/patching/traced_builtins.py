"""Python's ``isinstance``, ``callable``, ``len``, ``list`` and ``range``, for traced values.

Library code inspects the values it is given: DiffSynth casts only what
``isinstance(x, torch.Tensor)`` accepts, transformers' ``torch_compilable_check`` calls its
condition when ``callable(cond)``, CLIP's loss builds ``torch.arange(len(logits))``, diffusers'
``encode_prompt`` takes ``len(prompt)`` of the batch's list of prompts. An fx proxy answers all
of these as a proxy would (not a tensor, callable, an ``int`` that must be fixed now), so the
traced program would not be the program eager runs. While a step is traced, these three
builtins are replaced by functions that answer for traced values the way their meta value
would, and fall through to the builtins for everything else. ``list(x)`` of a traced tensor
(LLaVA's ``image_features = list(image_features)``, one row per image) becomes one ``list``
node instead of a Python loop over the batch, which would fix the batch size.

Glossary:
    traced value: a proxy of the step's tracer (:mod:`graphsplit.planning.tracing.tracer`); its
        ``eager_value()`` is the meta value eager would hold in its place (a tensor, an
        ``int`` size, a list, a ``ModelOutput``).
    step code: the user's code and the libraries it calls. The tracer's own code (torch.fx,
        torch's pytree, graphsplit) must keep seeing proxies as proxies, so only step code
        gets the eager answer for non-tensor values (a traced tensor passes
        ``isinstance(x, torch.Tensor)`` everywhere, as it always has: the tracer's
        ``create_arg`` looks for proxies first).
    traced length: ``len(x)`` of a traced tensor with a dim, or of a traced list or tuple:
        a ``len`` node whose value is an ``int`` proxy, so a length that follows the batch
        size is re-anchored in stage 2 like ``x.shape[0]`` instead of being fixed at the
        probe size. Python control flow on it (``range(len(x))``, ``if len(x) > 1``) reads
        it as a guarded int, as before. The length of a ``torch.Size`` or a dict is an int.
    traced list: ``list(x)`` of a traced tensor with a dim: a ``list`` node whose value is
        the list of rows, passed on whole (``torch.cat(rows)``); iterating it in Python still
        unrolls it. ``builtins.list`` is replaced by a subclass of ``list`` whose metaclass
        answers ``isinstance(obj, list)`` for every real list, so ``list[int]``,
        ``list.append`` and ``isinstance`` keep working.
    traced range: ``range(x.shape[1])`` with a traced size; the size becomes a guarded Python
        int read from the meta value.
    chunk loop: ``range(0, x.shape[0], chunk)`` with a plain step other than 1 or -1
        (diffusers' LCM scripts encode ``pixel_values[i : i + chunk]`` chunk by chunk): the
        guarded int is the iteration count ``len(range(0, x.shape[0], chunk))``, the same at
        every batch size up to ``chunk``, not the size itself, which follows the batch.

Why builtins and not the proxy's ``__class__``: torch's C++ argument parser asks the C API,
not ``builtins.isinstance``, so it keeps seeing a proxy (a faked ``__class__`` made it unpack
a proxy as a tensor and crash).

Meta execution (:func:`graphsplit.planning.meta.analysis_view.meta_execution`, where the tracer runs
an op for its meta value) gets Python's own builtins back (they are registered as meta-reverted
patches, see :mod:`graphsplit.planning.patching.patcher`): the code it runs (torch's fake mode,
pytree, the op memo) holds meta values, never traced ones, so the replacements could only
cost time there (a million ``isinstance`` calls on a 10k-node chain).

Other threads: every replacement answers as Python's builtin for every value but a traced
value of the tracing thread, and checks that it is called in that thread before answering for
one (:meth:`~graphsplit.planning.patching.patcher.Patcher.traces_here`). A class made with the
stand-in ``list`` as its base (a module imported lazily meanwhile) gets Python's ``list`` as
its base instead, so nothing made during a trace keeps the stand-in once it ends.

In: the patcher of the trace, the tracer's proxy types, and for ``range`` a function turning a
traced size into a Python int. Out: nothing; the replacements are registered with the patcher:

    replace_python_builtins(patcher, traced_types) -> None
    replace_range(patcher, to_int) -> None
    called_by_the_tracer(depth=2) -> bool   # also asked by patching/module_writes.py
"""

from __future__ import annotations

import builtins
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from graphsplit.planning.patching.originals import (
    python_callable,
    python_isinstance,
    python_len,
    python_list,
    python_range,
)
from graphsplit.planning.patching.patcher import Patcher

__all__ = ["called_by_the_tracer", "replace_python_builtins", "replace_range"]

_GRAPHSPLIT_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_TRACER_FILES = (
    _GRAPHSPLIT_DIR + os.sep,
    os.path.join(_TORCH_DIR, "fx") + os.sep,
    os.path.join(_TORCH_DIR, "utils", "_pytree.py"),
)


_NOT_THE_TRACER = os.path.join(_TORCH_DIR, "fx", "experimental") + os.sep  # shape helpers


def called_by_the_tracer(depth: int = 2) -> bool:
    """True when the caller of the patched builtin is torch.fx, torch's pytree or graphsplit."""
    filename = sys._getframe(depth).f_code.co_filename
    return filename.startswith(_TRACER_FILES) and not filename.startswith(_NOT_THE_TRACER)


def replace_python_builtins(patcher: Patcher, traced_types: tuple[type, ...]) -> None:
    """Replace ``isinstance``, ``callable``, ``len`` and ``list`` while ``patcher`` is active.

    ``traced_types`` are the tracer's proxy classes: objects of exactly these types have an
    ``eager_value()`` and a ``tracer``.
    """
    traced = frozenset(traced_types)

    def eager_isinstance(obj: Any, classinfo: Any) -> bool:
        if (
            type(obj) not in traced
            or python_isinstance(obj, classinfo)
            or not patcher.traces_here()
        ):
            return python_isinstance(obj, classinfo)
        value = obj.eager_value()
        if python_isinstance(value, torch.Tensor):
            return issubclass(torch.Tensor, classinfo)
        if value is None or called_by_the_tracer():
            return False
        return python_isinstance(value, classinfo)

    def eager_callable(obj: Any) -> bool:
        if type(obj) not in traced or not patcher.traces_here() or called_by_the_tracer():
            return python_callable(obj)
        return python_callable(obj.eager_value())

    def eager_len(obj: Any) -> Any:
        if type(obj) not in traced or not patcher.traces_here() or called_by_the_tracer():
            return python_len(obj)
        if _length_can_follow_the_batch(obj.eager_value()):
            return obj.tracer.create_proxy("call_function", python_len, (obj,), {})
        return python_len(obj)  # the proxy's __len__: a guarded int

    replacements = {
        "isinstance": eager_isinstance,
        "callable": eager_callable,
        "len": eager_len,
        "list": _list_type(traced, patcher),
    }
    for name, replacement in replacements.items():
        patcher.patch(builtins, name, replacement, reverted_for_meta=True)


def replace_range(patcher: Patcher, to_int: Callable[[fx.Proxy], int]) -> None:
    """``range(x.shape[1])`` works while tracing: ``to_int`` turns traced sizes into ints."""

    class TracedRange(metaclass=_RangeType):
        def __new__(cls, *args: Any) -> range:
            if patcher.traces_here():
                if _is_chunk_loop(args):
                    return _chunk_range(args, to_int)
                args = tuple(
                    to_int(arg) if python_isinstance(arg, fx.Proxy) else arg for arg in args
                )
            return python_range(*args)

    patcher.patch(builtins, "range", TracedRange, reverted_for_meta=True)


def _is_chunk_loop(args: tuple[Any, ...]) -> bool:
    """``range(start, n, step)`` with only ``n`` traced and ``|step| > 1`` (see the glossary).

    With a step of 1 the count follows ``n`` one to one, so guarding ``n`` itself (what the
    plan held before chunk loops) is the same guard, and the stage code stays as it was.
    """
    if python_len(args) != 3 or not python_isinstance(args[1], fx.Proxy):
        return False
    start, step = args[0], args[2]
    plain = (int,)
    return (
        python_isinstance(start, plain)
        and python_isinstance(step, plain)
        and not python_isinstance(step, bool)
        and abs(step) > 1
    )


def _chunk_range(args: tuple[Any, ...], to_int: Callable[[fx.Proxy], int]) -> range:
    """The range of a chunk loop, its iteration count the guarded int.

    The count is a ``len(range(start, n, step))`` node: the analysis compares it (not ``n``)
    at both probe sizes, and the stages recheck it at run time like any size guard, so a batch
    that needs another number of chunks stops with "split again for this size". The loop's
    values ``start, start + step, ...`` follow from the count alone.
    """
    start, stop, step = args
    chunks = stop.tracer.create_proxy("call_function", python_range, args, {})
    count = to_int(stop.tracer.create_proxy("call_function", python_len, (chunks,), {}))
    return python_range(start, start + count * step, step)


class _RangeType(type):
    """The metaclass of the stand-in ``range``: every real range is an instance of it."""

    def __instancecheck__(cls, instance: Any) -> bool:
        return python_isinstance(instance, python_range)


class _ListType(type):
    """The metaclass of the stand-in ``list``: every real list is an instance of it.

    A class made with the stand-in as a base while it is in place (a module imported lazily
    during the trace) is made with Python's ``list`` in its place: it must stay a plain list
    subclass after the trace.
    """

    def __new__(
        mcls, name: str, bases: tuple[type, ...], namespace: dict[str, Any], **kwargs: Any
    ) -> type:
        if namespace.get("_stands_in_for_list") is True:
            return super().__new__(mcls, name, bases, namespace, **kwargs)
        real_bases = tuple(python_list if type(base) is _ListType else base for base in bases)
        metaclass = type
        for base in real_bases:  # the most derived metaclass, as the class statement picks it
            if issubclass(type(base), metaclass):
                metaclass = type(base)
        return metaclass(name, real_bases, namespace, **kwargs)

    def __instancecheck__(cls, instance: Any) -> bool:
        return python_isinstance(instance, python_list)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, python_list)


def _list_type(traced: frozenset[type], patcher: Patcher) -> type:
    """``list``, except that ``list(x)`` of a traced tensor with a dim is one graph node."""

    class list(python_list, metaclass=_ListType):  # the name error messages and reprs show
        _stands_in_for_list = True

        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            if (
                python_len(args) == 1
                and type(args[0]) in traced
                and patcher.traces_here()
                and python_isinstance(args[0].eager_value(), torch.Tensor)
                and args[0].eager_value().dim() > 0
                and not called_by_the_tracer()
            ):
                return args[0].tracer.create_proxy("call_function", python_list, args, {})
            return python_list(*args, **kwargs)

    return list


def _length_can_follow_the_batch(value: Any) -> bool:
    """A tensor with a dim, or a list or tuple that is not a shape."""
    if python_isinstance(value, torch.Tensor):
        return value.dim() > 0
    return python_isinstance(value, (python_list, tuple)) and not python_isinstance(
        value, torch.Size
    )
