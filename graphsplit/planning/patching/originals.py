"""Python's own builtins, bound once, before any trace replaces them; and the plain types.

While a step is traced, ``builtins.isinstance``, ``len``, ``list``, ``callable`` and ``range``
answer traced values as eager tensors would (:mod:`graphsplit.planning.patching.traced_builtins`).
graphsplit's own code between traced nodes (the call memo's keys, the interpreters, the patches
themselves) must keep Python's answers: it imports them from here, the one place they are bound.

Glossary:
    plain value type: a type whose values never hold a traced value or a tensor (``int``,
        ``str``, ``torch.dtype``, ``torch.Size``, ...). A value of exactly such a type is its own
        description: it is copied, compared and hashed as it is, never searched for tensors.
"""

from __future__ import annotations

import builtins

import torch

__all__ = [
    "PLAIN_VALUE_TYPES",
    "python_callable",
    "python_isinstance",
    "python_len",
    "python_list",
    "python_range",
]

python_isinstance = builtins.isinstance
python_callable = builtins.callable
python_len = builtins.len
python_list = builtins.list
python_range = builtins.range

PLAIN_VALUE_TYPES = frozenset(
    {
        int,
        float,
        bool,
        str,
        bytes,
        type(None),
        torch.dtype,
        torch.device,
        torch.layout,
        torch.memory_format,
        torch.Size,
    }
)
