"""Catch random numbers drawn while tracing, and find the user's line that drew them.

Glossary:
    generator: one of the process-wide random number generators user code may draw from:
        torch's default CPU generator, Python's ``random`` and, when imported, ``numpy.random``.
    draw while tracing: a generator that moved during the trace. The draw happened once, at
        trace time, so the plan would replay one frozen sample forever: the tracer refuses it.

In: a callable that traces the step. Out: the names of the generators that moved
(:func:`changed_generators`) and the first user line after which one moved
(:func:`locate_random_draw`).
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from typing import Any

import torch

from graphsplit.planning.rules.user_lines import describe, frame_location, is_internal


def generator_states() -> dict[str, Any]:
    """A snapshot of every generator's state, to compare or restore later."""
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "random": random.getstate()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        states["numpy.random"] = numpy.random.get_state()
    return states


def set_generator_states(states: dict[str, Any]) -> None:
    """Put every generator back to a snapshot of :func:`generator_states`."""
    torch.set_rng_state(states["torch"])
    random.setstate(states["random"])
    numpy = sys.modules.get("numpy")
    if numpy is not None and "numpy.random" in states:
        numpy.random.set_state(states["numpy.random"])


def changed_generators(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The names of the generators whose state differs between two snapshots."""
    changed = []
    for name, state in before.items():
        other = after[name]
        if name == "torch":
            same = torch.equal(state, other)
        elif name == "random":
            same = state == other
        else:  # numpy: (name, keys array, position, has_gauss, cached_gaussian)
            same = bool((state[1] == other[1]).all()) and state[2:] == other[2:]
        if not same:
            changed.append(name)
    return changed


def locate_random_draw(run: Callable[[], Any]) -> str | None:
    """Rerun ``run`` line by line; return the first user line after which a generator moved.

    Only called once a draw is known to have happened, so its cost (a trace function on every
    user-code line) is paid on the error path alone.
    """
    found: list[str] = []
    state = [generator_states()]
    last_line: list[str] = []

    def local(frame, event, arg):
        if found:
            return None
        if event in ("line", "return"):
            current = generator_states()
            if last_line and changed_generators(state[0], current):
                found.append(last_line[0])
                return None
            state[0] = current
            last_line[:] = [describe(frame_location(frame))]
        return local

    def global_trace(frame, event, arg):
        if found or is_internal(frame.f_code.co_filename):
            return None
        return local

    previous = sys.gettrace()
    sys.settrace(global_trace)
    try:
        run()
    except Exception:  # the first trace succeeded; a failure here only loses the location
        pass
    finally:
        sys.settrace(previous)
    return found[0] if found else None
