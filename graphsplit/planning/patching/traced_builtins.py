"""Python's ``isinstance``, ``callable``, ``len`` and ``list``, for traced values as in eager.

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

Why builtins and not the proxy's ``__class__``: torch's C++ argument parser asks the C API,
not ``builtins.isinstance``, so it keeps seeing a proxy (a faked ``__class__`` made it unpack
a proxy as a tensor and crash).

Meta execution (:func:`graphsplit.planning.meta.analysis_view.meta_execution`, where the tracer runs
an op for its meta value) gets Python's own builtins back: the code it runs (torch's fake mode,
pytree, the op memo) holds meta values, never traced ones, so the replacements could only
cost time there (a million ``isinstance`` calls on a 10k-node chain).

In: the tracer's proxy types. Out: a context manager active for the trace, and one that
undoes it for a block inside it:

    python_builtins_as_eager(traced_types) -> ContextManager
    python_builtins_restored() -> ContextManager
"""

from __future__ import annotations

import builtins
import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch

_isinstance = builtins.isinstance
_callable = builtins.callable
_len = builtins.len
_list = builtins.list

_GRAPHSPLIT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_TRACER_FILES = (
    _GRAPHSPLIT_DIR,
    os.path.join(_TORCH_DIR, "fx") + os.sep,
    os.path.join(_TORCH_DIR, "utils", "_pytree.py"),
)


_NOT_THE_TRACER = os.path.join(_TORCH_DIR, "fx", "experimental") + os.sep  # shape helpers


def _called_by_the_tracer(depth: int = 2) -> bool:
    """True when the caller of the patched builtin is torch.fx, torch's pytree or graphsplit."""
    filename = sys._getframe(depth).f_code.co_filename
    return filename.startswith(_TRACER_FILES) and not filename.startswith(_NOT_THE_TRACER)


@contextlib.contextmanager
def python_builtins_as_eager(traced_types: tuple[type, ...]) -> Iterator[None]:
    """Replace ``isinstance``, ``callable`` and ``len`` for the trace (restored on exit).

    ``traced_types`` are the tracer's proxy classes: objects of exactly these types have an
    ``eager_value()`` and a ``tracer``.
    """
    traced = frozenset(traced_types)

    def eager_isinstance(obj: Any, classinfo: Any) -> bool:
        if type(obj) not in traced or _isinstance(obj, classinfo):
            return _isinstance(obj, classinfo)
        value = obj.eager_value()
        if _isinstance(value, torch.Tensor):
            return issubclass(torch.Tensor, classinfo)
        if value is None or _called_by_the_tracer():
            return False
        return _isinstance(value, classinfo)

    def eager_callable(obj: Any) -> bool:
        if type(obj) not in traced or _called_by_the_tracer():
            return _callable(obj)
        return _callable(obj.eager_value())

    def eager_len(obj: Any) -> Any:
        if type(obj) not in traced or _called_by_the_tracer():
            return _len(obj)
        if _length_can_follow_the_batch(obj.eager_value()):
            return obj.tracer.create_proxy("call_function", _len, (obj,), {})
        return _len(obj)  # the proxy's __len__: a guarded int

    replaced = {
        "isinstance": eager_isinstance,
        "callable": eager_callable,
        "len": eager_len,
        "list": _list_type(traced),
    }
    previous = {name: getattr(builtins, name) for name in replaced}
    for name, function in replaced.items():
        setattr(builtins, name, function)
    _REPLACED.append((replaced, previous))
    try:
        yield
    finally:
        _REPLACED.pop()
        for name, function in previous.items():
            setattr(builtins, name, function)


# The replacements of the traces in progress (innermost last), with what each replaced.
_REPLACED: list[tuple[dict[str, Any], dict[str, Any]]] = []


class python_builtins_restored:  # lower case: used like the function-style managers here
    """Put back the builtins the innermost trace replaced, for the block; no-op outside one.

    A class rather than a generator: it is entered for every op the tracer runs on meta.
    """

    __slots__ = ("_entry",)

    def __enter__(self) -> None:
        self._entry = _REPLACED[-1] if _REPLACED else None
        if self._entry is not None:
            for name, function in self._entry[1].items():
                setattr(builtins, name, function)

    def __exit__(self, *exc_info: object) -> None:
        if self._entry is not None:
            for name, function in self._entry[0].items():
                setattr(builtins, name, function)


class _ListType(type):
    """The metaclass of the stand-in ``list``: every real list is an instance of it.

    A class that subclasses ``list`` while the stand-in is in place (a module imported lazily
    during the trace) gets this metaclass too: it answers for itself as any class does.
    """

    def __instancecheck__(cls, instance: Any) -> bool:
        if cls.__dict__.get("_stands_in_for_list", False):
            return _isinstance(instance, _list)
        return type.__instancecheck__(cls, instance)

    def __subclasscheck__(cls, subclass: type) -> bool:
        if cls.__dict__.get("_stands_in_for_list", False):
            return issubclass(subclass, _list)
        return type.__subclasscheck__(cls, subclass)


def _list_type(traced: frozenset[type]) -> type:
    """``list``, except that ``list(x)`` of a traced tensor with a dim is one graph node."""

    class list(_list, metaclass=_ListType):  # the name error messages and reprs show
        _stands_in_for_list = True

        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            if cls.__dict__.get("_stands_in_for_list", False) is not True:
                return _list.__new__(cls, *args, **kwargs)  # a subclass made meanwhile
            if (
                _len(args) == 1
                and type(args[0]) in traced
                and _isinstance(args[0].eager_value(), torch.Tensor)
                and args[0].eager_value().dim() > 0
                and not _called_by_the_tracer()
            ):
                return args[0].tracer.create_proxy("call_function", _list, args, {})
            return _list(*args, **kwargs)

    return list


def _length_can_follow_the_batch(value: Any) -> bool:
    """A tensor with a dim, or a list or tuple that is not a shape."""
    if _isinstance(value, torch.Tensor):
        return value.dim() > 0
    return _isinstance(value, (list, tuple)) and not _isinstance(value, torch.Size)
