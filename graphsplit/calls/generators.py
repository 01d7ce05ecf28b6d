"""Seeded runs and random-state snapshots over every generator a step may draw from.

A step draws from torch (CPU and CUDA), numpy's global generator and Python's ``random``, and
from ``torch.Generator`` objects of its own (InstructPix2Pix's conditioning dropout draws
``torch.rand(bsz, generator=generator)`` from one made in ``main()``). The module-level path
seeds all of them to compare two runs (:mod:`.analysis`), snapshots them around a call to see
whether the call draws, and forks them around stage 1 so that caching never moves the user's
random streams; :func:`~graphsplit.verify` runs the step and the split from the same states.

A step's own generators are found as torch calls are handed them (:class:`OwnGenerators`, a
``TorchFunctionMode``), before the call draws: no walk over the step's objects can miss one.
Inside :func:`seeded` each is seeded on first sight from the block's seed and its position, so
two runs under different seeds draw differently from it (a call fed by such a draw is random,
never cached), and two runs under one seed draw alike.
"""

from __future__ import annotations

import contextlib
import random
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from graphsplit.planning.rules.random_draws import (
    own_generator_state,
    restore_own_generator,
    seed_own_generator,
)


@dataclass(frozen=True)
class RandomState:
    """The state of every generator, comparable with ``==`` (see :func:`snapshot`)."""

    torch_cpu: bytes
    torch_cuda: tuple[bytes, ...]
    numpy: tuple[Any, ...]
    python: tuple[Any, ...]
    own_draws: int = 0  # torch calls handed one of the step's own generators so far

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RandomState):
            return NotImplemented
        return (
            self.torch_cpu == other.torch_cpu
            and self.torch_cuda == other.torch_cuda
            and numpy_equal(self.numpy, other.numpy)
            and self.python == other.python
            and self.own_draws == other.own_draws
        )

    __hash__ = None  # type: ignore[assignment]


def numpy_equal(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return len(a) == len(b) and all(
        np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y for x, y in zip(a, b)
    )


def snapshot() -> RandomState:
    """The current state of torch's, numpy's and Python's generators."""
    cuda = (
        tuple(bytes(state.numpy()) for state in torch.cuda.get_rng_state_all())
        if torch.cuda.is_available() and torch.cuda.is_initialized()
        else ()
    )
    return RandomState(
        torch_cpu=bytes(torch.get_rng_state().numpy()),
        torch_cuda=cuda,
        numpy=tuple(np.random.get_state()),
        python=random.getstate(),
        own_draws=_WATCHING[-1].draws if _WATCHING else 0,
    )


def seed_all(seed: int) -> None:
    """Seed torch (every device), numpy's global generator and Python's ``random``."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


class OwnGenerators(TorchFunctionMode):
    """Finds the ``torch.Generator`` objects torch calls are handed, keeping each one's state
    from before its first draw (:meth:`restore` puts them back); with ``seed``, seeds each on
    first sight from ``seed`` and its position."""

    def __init__(self, seed: int | None = None) -> None:
        super().__init__()
        self.seed = seed
        self.first: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
        self.draws = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Generator):
                self.draws += 1
                if id(value) not in self.first:
                    # The innermost block sees a call first: the outer ones (a seeded verify
                    # around a forked stage 1) must keep and seed the state before it does.
                    for watch in _WATCHING:  # this one included: forked() pushed it
                        watch.see(value)
        return func(*args, **kwargs)

    def see(self, generator: torch.Generator) -> None:
        if id(generator) not in self.first:
            KNOWN.add(generator)
            self.first[id(generator)] = (generator, generator.get_state())
            if self.seed is not None:
                generator.manual_seed(_derived_seed(self.seed, len(self.first)))
                # A fork opened before this first sight (stage 1 inside a seeded verify) gives
                # the generator back as seeded here, as if seeded before the fork: stage 2 then
                # draws from where the eager run started.
                for snapshot in _FORK_SNAPSHOTS:
                    if id(generator) in snapshot:
                        snapshot[id(generator)] = (generator, generator.get_state())

    def restore(self) -> None:
        for generator, state in self.first.values():
            generator.set_state(state)


_WATCHING: list[OwnGenerators] = []
_FORK_SNAPSHOTS: list[dict[int, tuple[torch.Generator, torch.Tensor]]] = []
"""The states unwatched forks (stage 1) give their known generators back, innermost last."""

PYTHON_KNOWN: dict[int, Any] = {}
"""The step's own ``random.Random`` / NumPy generators the probes found (by id, kept alive as
the step that holds them usually is): forked and seeded like the rest. The trace refuses a
draw from one; the module-level path runs it in stage 2, every step."""


def remember(found: Iterable[Any]) -> None:
    """Add the step's own Python-level generators to :data:`PYTHON_KNOWN`."""
    for generator in found:
        PYTHON_KNOWN[id(generator)] = generator


KNOWN: weakref.WeakSet[torch.Generator] = weakref.WeakSet()
"""Every step's own generator a watch has seen (the probes of each split see the step's):
what :func:`forked` without a watch gives back. A generator made inside the step dies with
its run and leaves the set."""


@contextlib.contextmanager
def forked(seed: int | None = None, *, watch: bool = True) -> Iterator[None]:
    """Run the block and give every generator back the state it had before it (the step's own
    generators too: see :class:`OwnGenerators`, which ``seed`` is handed to).

    ``watch=False`` (stage 1 of the module-level path, once per batch) gives back the step's
    own generators the probes saw (:data:`KNOWN`) by their states alone: no mode sees every
    torch call, which cost stage 1 a fifth of its time on the tiny SD step."""
    with _python_generators_forked(seed), _forked(seed, watch):
        yield


@contextlib.contextmanager
def _python_generators_forked(seed: int | None) -> Iterator[None]:
    """Give :data:`PYTHON_KNOWN` back their states; with ``seed``, seed them from it first."""
    saved = [(generator, own_generator_state(generator)) for generator in PYTHON_KNOWN.values()]
    if seed is not None:
        for index, (generator, _) in enumerate(saved, start=500_000):
            seed_own_generator(generator, _derived_seed(seed, index))
    try:
        yield
    finally:
        for generator, state in saved:
            restore_own_generator(generator, state)


@contextlib.contextmanager
def _forked(seed: int | None, watch: bool) -> Iterator[None]:
    numpy_state = np.random.get_state()
    python_state = random.getstate()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    own = OwnGenerators(seed) if watch else None
    if own is None:
        # Given back by their states. An outer watch (a seeded verify) seeds a generator on
        # its first use, and updates this snapshot then (OwnGenerators.see): seeing every known
        # generator here instead numbered this step's by the order of a set that also holds
        # other splits' generators, so stage 2 could start from another seed than the eager
        # run (a verify that failed depending on what else the process held).
        known = {id(generator): (generator, generator.get_state()) for generator in list(KNOWN)}
        _FORK_SNAPSHOTS.append(known)
    else:
        _WATCHING.append(own)
    with torch.random.fork_rng(devices=devices), own or contextlib.nullcontext():
        try:
            yield
        finally:
            if own is None:
                _FORK_SNAPSHOTS[:] = [other for other in _FORK_SNAPSHOTS if other is not known]
                for generator, state in known.values():
                    generator.set_state(state)
            else:
                _WATCHING.pop()
                own.restore()
            np.random.set_state(numpy_state)
            random.setstate(python_state)


def _derived_seed(seed: int, index: int) -> int:
    """The seed of the ``index``-th of the step's own generators in a block seeded ``seed``."""
    return seed * 1_000_003 + index


@contextlib.contextmanager
def seeded(seed: int, *, own_generators: bool = True) -> Iterator[None]:
    """Run the block from ``seed`` on every generator, then restore the states it found.

    ``own_generators=False`` seeds only torch's, numpy's and Python's global generators and
    leaves the step's own ones as they are (still given back): a dataset that seeds one per
    sample (``torch.Generator().manual_seed(index)``) then reads alike under any seed. (With
    ``True``, a generator the step makes and seeds itself is seeded anew too: two probes see
    its draws as random, which keeps a call they feed uncached, never wrong.)"""
    with forked(seed if own_generators else None):
        seed_all(seed)
        yield
