"""Undo what the step's code wrote into its modules while it was traced.

Tracing runs the user's ``forward`` with fx proxies, and code that caches on ``self`` stores
them: Qwen-Image's RoPE does ``self.pos_freqs = self.pos_freqs.to(device)`` and fills
``self.rope_cache[key]``. Left there, the analysis that follows (and the user's own eager
calls after ``split``) would read proxies of a finished graph. So the state of every module,
and of every plain helper object a module holds (a scheduler), is put back as soon as the
trace is done.

Glossary:
    state: an object's ``__dict__`` (attributes added, rebound or deleted are undone) and the
        contents of the plain ``dict`` / ``OrderedDict`` / ``list`` values in it
        (``self.cache[key] = ...``, ``self._buffers``, the hook tables ``self._forward_hooks``),
        one level deep. Hook tables matter: transformers installs output-capturing hooks on
        first call and marks the module with a flag; undoing the flag but not the hooks would
        install them a second time on the next call, and LLaVA's selected vision layer
        (``output_hidden_states=-2``) would come back as ``None``.

A module's *tensors* are another matter: code that runs for real (stage 1 once under an
ambient autocast, the module-level path's planning runs) writes into buffers as the step does
(a BatchNorm's running statistics, a queue), and :func:`buffers_put_back` puts their values
back.

In: the model. Out: context managers, and the two pieces the analysis view
(``planning/meta/analysis_view.py``) shares with them:

    module_state_restored(model) -> ContextManager
    buffers_put_back(model) -> ContextManager   # every real buffer's values as they were
    is_helper_object(value) -> bool
    restore_attributes(obj, saved_attributes) -> None
"""

from __future__ import annotations

import contextlib
import operator
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

_Saved = tuple[Any, dict[str, Any], dict[str, Any]]


@contextlib.contextmanager
def module_state_restored(model: nn.Module) -> Iterator[None]:
    """Snapshot the state of ``model``'s modules and helper objects; restore it on exit."""
    saved = [_snapshot(obj) for obj in _stateful_objects(model)]
    try:
        yield
    finally:
        for obj, attributes, contents in saved:
            _restore(obj, attributes, contents)


@contextlib.contextmanager
def buffers_put_back(model: nn.Module) -> Iterator[None]:
    """Copy every real buffer of ``model`` (running statistics, queues, tables: small beside
    the weights); on exit, each one whose values changed gets them back (one left as it was
    keeps its version counter)."""
    with torch.no_grad():
        saved = [
            (buffer, buffer.detach().clone()) for buffer in model.buffers() if not buffer.is_meta
        ]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, values in saved:
                if buffer.shape == values.shape and not torch.equal(buffer, values):
                    buffer.copy_(values)


def _stateful_objects(model: nn.Module) -> list[Any]:
    found: dict[int, Any] = {}
    for module in model.modules():
        found.setdefault(id(module), module)
        for value in vars(module).values():
            if is_helper_object(value):
                found.setdefault(id(value), value)
    return list(found.values())


def is_helper_object(value: Any) -> bool:
    """A plain Python object with attributes (a scheduler, a config), not a module or tensor.

    Most attributes of a module are numbers, strings, ``None`` and its own tables (dicts):
    their exact type answers at once, the full test runs for the rest (it is called for every
    attribute of every module, several times per split).
    """
    if type(value) in _NEVER_HELPERS:
        return False
    if isinstance(value, (nn.Module, torch.Tensor, type)) or callable(value):
        return False
    return hasattr(value, "__dict__") and not isinstance(value, (dict, list, tuple))


# Exact types that the full test above rejects (no __dict__, or a container).
_NEVER_HELPERS = frozenset(
    {int, float, bool, str, bytes, type(None), dict, OrderedDict, list, tuple, set, frozenset}
)


def _snapshot(obj: Any) -> _Saved:
    attributes = dict(vars(obj))
    contents = {
        name: (dict(value) if isinstance(value, dict) else list(value))
        for name, value in attributes.items()
        if type(value) in _CONTAINERS
    }
    return obj, attributes, contents


def _restore(obj: Any, attributes: dict[str, Any], contents: dict[str, Any]) -> None:
    restore_attributes(obj, attributes)
    for name, content in contents.items():
        container = attributes[name]
        if not content and not container:
            continue  # empty then and now (most hook tables): nothing to put back
        if isinstance(container, dict):
            container.clear()
            container.update(content)
        else:
            container[:] = content


def restore_attributes(obj: Any, attributes: dict[str, Any]) -> None:
    """Make ``vars(obj)`` hold exactly the objects of ``attributes`` again.

    Added attributes are deleted and rebound ones set back. The common case, nothing changed
    (same names in the same order, each bound to the same object), is recognised by two
    comparisons that run in C, before any per-name work.
    """
    current = vars(obj)
    if list(current) == list(attributes) and not any(
        map(operator.is_not, current.values(), attributes.values())
    ):
        return
    for name in [name for name in current if name not in attributes]:
        del current[name]
    for name, value in attributes.items():
        if current.get(name, _MISSING) is not value:
            current[name] = value


_MISSING = object()
_CONTAINERS = (dict, OrderedDict, list)
