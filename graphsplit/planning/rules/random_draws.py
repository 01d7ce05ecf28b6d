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

import contextlib
import copy
import functools
import random
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from graphsplit.errors import Fix, GraphsplitError, TraceError, user_error
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


def locate_random_draw(
    run: Callable[[], Any],
    *,
    snapshot: Callable[[], dict[str, Any]] = generator_states,
    changed: Callable[[dict[str, Any], dict[str, Any]], list[str]] = changed_generators,
) -> str | None:
    """Rerun ``run`` line by line; return the first user line after which a generator moved
    (the process-wide ones; others with ``snapshot`` and ``changed``).

    Only called once a draw is known to have happened, so its cost (a trace function on every
    user-code line) is paid on the error path alone.
    """
    found: list[str] = []
    state = [snapshot()]
    last_line: list[str] = []

    def local(frame, event, arg):
        if found:
            return None
        if event in ("line", "return"):
            current = snapshot()
            if last_line and changed(state[0], current):
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


# -- the step's own Python-level generators -------------------------------------------------
# ``self.rng = np.random.default_rng(seed)`` or ``random.Random(seed)``, drawn from in the step:
# the tracer runs that draw once, in Python, and its number becomes a constant of the plan
# (``scale = rng.uniform(0.5, 1.5)``). The process-wide snapshot above cannot see such an object,
# so the objects the step holds are found (module attributes, a helper object's attributes,
# the step function's closure cells, defaults and globals) and checked around the planning.


_CONTAINER_ITEMS = 64  # a dict or list of the step's is looked into this far (a dict of rngs)


def own_generators(model: Any) -> dict[str, Any]:
    """The ``random.Random`` and NumPy ``Generator`` / ``RandomState`` objects ``model`` holds,
    by a name the user knows them by (the process-wide ones are :func:`generator_states`')."""
    kinds = _generator_kinds()
    plain = (type, types.ModuleType, types.FunctionType, types.MethodType)  # not looked into
    found: dict[str, Any] = {}
    seen: set[int] = set()

    def add(name: str, value: Any, depth: int = 0) -> None:
        if id(value) in seen or value is random._inst:  # type: ignore[attr-defined]
            return
        seen.add(id(value))
        if isinstance(value, kinds):
            found[name] = value
        elif depth >= 1:
            return
        elif isinstance(value, dict):  # self.rngs = {"noise": np.random.default_rng(0)}
            for key, item in list(value.items())[:_CONTAINER_ITEMS]:
                add(f"{name}[{key!r}]", item, depth + 1)
        elif isinstance(value, list | tuple):
            for index, item in enumerate(value[:_CONTAINER_ITEMS]):
                add(f"{name}[{index}]", item, depth + 1)
        elif hasattr(value, "__dict__") and not isinstance(value, plain):
            for key, item in list(vars(value).items()):
                if not key.startswith("__") and not isinstance(item, torch.nn.Module):
                    add(f"{name}.{key}", item, depth + 1)

    for path, module in model.named_modules():
        for key, value in vars(module).items():
            if not key.startswith("_") and not isinstance(value, torch.nn.Module):
                add(f"{path}.{key}" if path else key, value)
    function = getattr(model, "step_callable", None)
    while isinstance(function, functools.partial):
        for index, value in enumerate(function.args):
            add(f"argument {index}", value)
        function = function.func
    owner = getattr(function, "__self__", None)
    if owner is not None:
        add("self", owner)
    function = getattr(function, "__func__", function)
    code = getattr(function, "__code__", None)
    if code is not None:
        for name, cell in zip(code.co_freevars, function.__closure__ or ()):
            with contextlib.suppress(ValueError):  # an empty cell
                add(name, cell.cell_contents)
        for name in code.co_names:
            if name in function.__globals__:
                add(name, function.__globals__[name])
    return found


def _generator_kinds() -> tuple[type, ...]:
    numpy = sys.modules.get("numpy")
    extra = (numpy.random.Generator, numpy.random.RandomState) if numpy is not None else ()
    return (random.Random, *extra)


def own_generator_state(generator: Any) -> Any:
    """The state of one of :func:`own_generators`' objects."""
    if isinstance(generator, random.Random):
        return generator.getstate()
    if hasattr(generator, "bit_generator"):
        return copy.deepcopy(generator.bit_generator.state)
    return generator.get_state()


def restore_own_generator(generator: Any, state: Any) -> None:
    """Give one of :func:`own_generators`' objects back a state of :func:`own_generator_state`."""
    if isinstance(generator, random.Random):
        generator.setstate(state)
    elif hasattr(generator, "bit_generator"):
        generator.bit_generator.state = state
    else:
        generator.set_state(state)


def seed_own_generator(generator: Any, seed: int) -> None:
    """Seed one of :func:`own_generators`' objects."""
    if hasattr(generator, "bit_generator"):
        generator.bit_generator.state = type(generator.bit_generator)(seed).state
    else:
        generator.seed(seed)


def _same(one: Any, other: Any) -> bool:
    if isinstance(one, dict) and isinstance(other, dict):
        return one.keys() == other.keys() and all(_same(one[k], other[k]) for k in one)
    if isinstance(one, tuple | list) and isinstance(other, tuple | list):
        return len(one) == len(other) and all(_same(a, b) for a, b in zip(one, other))
    if hasattr(one, "shape") and hasattr(other, "shape"):  # a NumPy array of the key
        return bool((one == other).all()) if one.shape == other.shape else False
    return bool(one == other)


def refuse_own_draws(model: Any, run: Callable[[], Any]) -> Any:
    """``run()`` (the planning), refused when it drew from one of ``model``'s own Python-level
    generators; every such generator is given back its state either way."""
    own = own_generators(model)
    if not own:
        return run()

    def states() -> dict[str, Any]:
        return {name: own_generator_state(generator) for name, generator in own.items()}

    def restore(saved: dict[str, Any]) -> None:
        for name, state in saved.items():
            restore_own_generator(own[name], state)

    before = states()
    try:
        result = run()
    finally:
        after = states()
        restore(before)
    moved = _moved_names(before, after)
    if not moved:
        return result
    location = locate_random_draw(run, snapshot=states, changed=_moved_names)
    restore(before)
    kinds = ", ".join(f"{name} ({_kind(own[name])})" for name in moved)
    raise user_error(
        TraceError,
        f"Random numbers were drawn while tracing from the step's own generator {kinds}; the "
        "draw would be frozen into the plan instead of happening every step. graphsplit "
        "replays torch's random functions in stage 2, not Python's or NumPy's.",
        source=location,
        fix=Fix(
            "draw with torch (torch.rand, torch.randint, torch.randn_like, ..., with a "
            "torch.Generator if the step keeps its own), or move the draw into the data "
            "pipeline and pass the result as an input"
        ),
    )


def _kind(generator: Any) -> str:
    module = "random" if isinstance(generator, random.Random) else "numpy.random"
    return f"{module}.{type(generator).__name__}"


def _moved_names(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    return [name for name in before if not _same(before[name], after[name])]


def random_draw_refusal(states: dict[str, Any], rerun: Callable[[], Any]) -> GraphsplitError:
    """The refusal of a trace that moved a process-wide generator (from ``states``), naming
    the user's line that drew: ``rerun`` traces again, line by line (the error path alone pays
    for it). The generators are put back to ``states`` before and after."""
    changed = changed_generators(states, generator_states())
    set_generator_states(states)  # the user's generators must not move because we traced
    location = locate_random_draw(rerun)
    set_generator_states(states)
    return user_error(
        TraceError,
        f"Random numbers were drawn while tracing ({', '.join(changed)} generator); the "
        "draw would be frozen into the plan instead of happening every step. graphsplit "
        "replays torch's random functions in stage 2, not Python's or NumPy's.",
        source=location,
        fix=Fix(
            "draw with torch (torch.rand, torch.randint, torch.randn_like, ...), or move "
            "the Python/NumPy draw into the data pipeline and pass the result as an input"
        ),
    )
