"""What one split's analyses share: the op memo's and the call memo's entries, across plans.

Glossary:
    shared memos: the tables an :class:`~graphsplit.planning.meta.op_memo.OpMemo` and its
        :class:`~graphsplit.planning.meta.call_memo.CallMemo` fill (op signature -> output
        layouts; call or node signature -> result template and op records; the signatures met
        once), held by one ``split()``'s planner for every analysis it runs: the rounds of one
        plan and the plans a new shape signature makes later (``PlanSet`` calls the planner
        again). Every key is structural (classes, functions, metadata, values), never an
        object's identity that could be recycled, and every entry is metadata (shapes,
        strides, dtypes, op records), never a tensor: an entry made under one analysis's fake
        mode is remade as new fake tensors of the analysis that reads it.

Why: a new shape signature's plan traces and analyses the step again from its batch; whatever
it meets with the same metadata as the first plan (the text encoder's whole call at the same
token count, the timestep embedding, a block's weight views) is answered instead of run.

What no key sees (Python globals a library reads, class attributes) is taken to be fixed for
the life of one split, as it already was for one analysis: a step that changes such a global
between two batches of different shapes has a plan made under the old value either way.

In: a planner's :class:`SharedMemos`. Out: the analysis in progress reads it.

    with sharing(memos): ...        # analyses started inside use (and fill) ``memos``
    current() -> SharedMemos | None
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class SharedMemos:
    """The op memo's and call memo's tables for every analysis of one split (see glossary)."""

    op_results: dict[Any, Any] = field(default_factory=dict)
    seen: set[Any] = field(default_factory=set)
    call_entries: dict[Any, Any] = field(default_factory=dict)
    node_entries: dict[Any, Any] = field(default_factory=dict)


_ACTIVE: list[SharedMemos] = []


@contextlib.contextmanager
def sharing(memos: SharedMemos) -> Iterator[None]:
    """Analyses started inside fill and read ``memos`` instead of tables of their own."""
    _ACTIVE.append(memos)
    try:
        yield
    finally:
        _ACTIVE.pop()


def current() -> SharedMemos | None:
    """The memos of the planning in progress, or None (an analysis then has its own)."""
    return _ACTIVE[-1] if _ACTIVE else None
