"""Pause Python's cyclic garbage collector while a split runs.

Glossary:
    cyclic collector: CPython's ``gc`` module, which walks container objects to find
        reference cycles. Reference counting frees everything else without it.

Planning allocates hundreds of thousands of short-lived objects (fake tensors, pytree specs,
op records, the networkx flow network's edge dicts) next to long-lived ones (a model of
thousands of modules, a traced graph of thousands of nodes). Every allocation burst triggers
collections, and each older-generation one walks all of the long-lived objects: on a
10k-node chain the min-cut alone took twice as long with the collector on. Cycles made
meanwhile are collected by the first collection after the split.

In: nothing. Out: a context manager (nests; restores the state it found):

    cyclic_gc_paused() -> ContextManager
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Disable the cyclic collector for the block; re-enable it on exit if it was enabled."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
