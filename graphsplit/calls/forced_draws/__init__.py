"""Rare random branches the seeded probes miss: the step's Python and NumPy draws forced.

The module-level path runs the step under two seeds and caches a frozen call only where its
inputs agree. A branch the step takes rarely, drawn with Python's or NumPy's generator
(AnimateDiff's ``cfg_random_null_text``: ``"" if random.random() <= 0.1 else text``;
finetrainers' caption dropout at p = 0.05), is taken by neither seed, so the text encoder's call
looked like a function of the sample alone, and stage 2 trained on the cached embedding of a
caption the step would have dropped: another loss, no error, and ``verify()`` (stage 1 and
stage 2 under one seed) cannot see it.

So while the first probe runs, the draw functions of :data:`WATCHED` are counted; where the
step called one, the step runs twice more under the first probe's seed with every such draw
forced to the bottom and to the top of its range (:func:`forced`): a ``random.random() < p``
branch is taken one way in one run and the other way in the other. A cached call whose inputs
differ from the first probe's in either run, or that is not made there, depends on a draw
(:func:`steered_calls`). A forced run that fails (a draw at the end of its range may be one
the step cannot take) checks nothing, and the split's notes say so.

Torch's own draws are not forced: a branch on ``torch.rand(()) < p`` read in Python is still
seen only if a seed takes it (the split's notes say that rare branches may be missed).

Glossary:
    watched draw: ``random.random``, ``random.uniform``, ``numpy.random.rand`` / ``random`` /
        ``random_sample`` / ``uniform``, looked up on their module at call time (code that
        imported the function itself, ``from random import random``, is not watched).

In: the probes' runs. Out:

    watched() -> ContextManager[list[int]]        # [number of watched draws made]
    forced(fraction) -> ContextManager             # every watched draw gives that fraction
    steered_calls(first, forced_runs) -> {call: detail}
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

WATCHED: tuple[tuple[Any, str], ...] = (
    (random, "random"),
    (random, "uniform"),
    (np.random, "rand"),
    (np.random, "random"),
    (np.random, "random_sample"),
    (np.random, "uniform"),
)

ENDS = (0.0, 1.0 - 2.0**-24)  # the bottom and the top of [0, 1)


@contextlib.contextmanager
def _replaced(make: Any) -> Iterator[None]:
    """Each watched function replaced by ``make(name, original)`` in this thread; others
    keep the original."""
    thread = threading.get_ident()
    originals = [(owner, name, getattr(owner, name)) for owner, name in WATCHED]

    def routed(name: str, original: Any) -> Any:
        replacement = make(name, original)

        def draw(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != thread:
                return original(*args, **kwargs)
            return replacement(*args, **kwargs)

        return draw

    for owner, name, original in originals:
        setattr(owner, name, routed(name, original))
    try:
        yield
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)


@contextlib.contextmanager
def watched() -> Iterator[list[int]]:
    """Count the watched draws the block makes: ``[count]``."""
    count = [0]

    def counting(name: str, original: Any) -> Any:
        def draw(*args: Any, **kwargs: Any) -> Any:
            count[0] += 1
            return original(*args, **kwargs)

        return draw

    with _replaced(counting):
        yield count


def _forced_draw(name: str, fraction: float) -> Any:
    """The watched function ``name`` giving ``fraction`` of its range, in its own shapes."""
    if name in ("random", "random_sample"):  # random.random(), numpy's (size=None)

        def draw(size: Any = None) -> Any:
            return fraction if size is None else np.full(size, fraction)

    elif name == "rand":

        def draw(*shape: int) -> Any:
            return np.full(shape, fraction) if shape else fraction

    else:  # uniform(low, high[, size])

        def draw(low: float = 0.0, high: float = 1.0, size: Any = None) -> Any:
            value = low + (high - low) * fraction
            return value if size is None else np.full(size, value)

    return draw


@contextlib.contextmanager
def forced(fraction: float) -> Iterator[None]:
    """Every watched draw in the block gives ``fraction`` of its range."""
    with _replaced(lambda name, original: _forced_draw(name, fraction)):
        yield


def steered_calls(first: Any, forced_runs: list[Any]) -> dict[Any, str]:
    """The calls of ``first`` (a probe) whose inputs a forced run changed, or that it did not
    make, with why; runs that failed (None) are skipped."""
    steered: dict[Any, str] = {}
    calls: Mapping[Any, Any] = first.calls
    for run, where in zip(forced_runs, ("bottom", "top")):
        if run is None:
            continue
        for call, seen in calls.items():
            if call in steered:
                continue
            other = run.calls.get(call)
            if other is None:
                steered[call] = f"forced to the {where} of their range, the step does not make it"
            elif seen.inputs.difference(other.inputs) is not None:
                steered[call] = f"forced to the {where} of their range, its inputs differ"
    return steered
