"""Seeded runs and random-state snapshots over every generator a step may draw from.

A step draws from torch (CPU and CUDA), numpy's global generator and Python's ``random``;
the module-level path seeds all three to compare two runs (:mod:`.analysis`), snapshots them
around a call to see whether the call draws, and forks them around stage 1 so that caching
never moves the user's random streams.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class RandomState:
    """The state of every generator, comparable with ``==`` (see :func:`snapshot`)."""

    torch_cpu: bytes
    torch_cuda: tuple[bytes, ...]
    numpy: tuple[Any, ...]
    python: tuple[Any, ...]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RandomState):
            return NotImplemented
        return (
            self.torch_cpu == other.torch_cpu
            and self.torch_cuda == other.torch_cuda
            and _numpy_equal(self.numpy, other.numpy)
            and self.python == other.python
        )

    __hash__ = None  # type: ignore[assignment]


def _numpy_equal(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
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
    )


def seed_all(seed: int) -> None:
    """Seed torch (every device), numpy's global generator and Python's ``random``."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


@contextlib.contextmanager
def forked() -> Iterator[None]:
    """Run the block and give every generator back the state it had before it."""
    numpy_state = np.random.get_state()
    python_state = random.getstate()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            np.random.set_state(numpy_state)
            random.setstate(python_state)


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block from ``seed`` on every generator, then restore the states it found."""
    with forked():
        seed_all(seed)
        yield
