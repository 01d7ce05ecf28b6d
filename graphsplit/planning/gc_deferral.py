"""Fewer garbage collections while a plan is made: planning's speed, not its result.

Planning allocates hundreds of thousands of container objects (fx nodes and their argument
tuples, fake tensors, op records), each counted towards the collector's next pass; at the
default thresholds (700 allocations a young-generation pass) the passes, and the older
generations' passes they trigger over the whole heap, took 10-15% of a 10,000-node chain's
``split()`` (2.35 -> 2.1 s CPU; docs/benchmarks.md, "Module-level path and planning, perf").
Most of what planning allocates lives until the plan is returned, so the early passes free
little. :func:`deferred_collections` raises the young generation's threshold for the block
and puts the previous thresholds back after it (an error included); nothing is disabled, and
the collector still runs, less often.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

PLANNING_THRESHOLDS = (100_000, 50, 100)
"""Allocations between young passes, young passes between middle ones, middle between old."""


@contextlib.contextmanager
def deferred_collections() -> Iterator[None]:
    """Run the block with :data:`PLANNING_THRESHOLDS`, then the thresholds it found."""
    previous = gc.get_threshold()
    if previous[0] == 0:  # the collector's automatic passes are off: leave them off
        yield
        return
    gc.set_threshold(*PLANNING_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*previous)
