"""Everything generated stage code calls, under names that never move.

torch.fx writes a call to a Python function as ``<module path>_<name>(...)`` (a call to
:func:`functional_setitem` reads ``graphsplit_runtime_functional_setitem(...)``), and the cache
fingerprint hashes stage 1's code. So where these helpers live is part of every cache's identity:
moving one would make every user's cache look stale. They live here, their names are pinned by
``tests/test_runtime.py``, and a change of behaviour gets a new name (``..._v2``) rather than a
new body, so an old cache is never silently read by code that means something else.

:data:`LEGACY_NAMES` maps each name to what graphsplit 0.1 (whose helpers lived in
``graphsplit.trace`` and ``graphsplit.codecs``) wrote for the same helper: the fingerprint
accepts a cache whose code digest matches under either spelling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from graphsplit.errors import Fix, SplitError, user_error

# The helpers stage code calls; Difference and PlanMismatch, the signal the checks raise, are
# imported by name and are no part of generated code.
__all__ = [
    "LEGACY_NAMES",
    "check_same_read",
    "check_size",
    "check_size_read",
    "check_value",
    "decode_diagonal_gaussian",
    "decode_diagonal_gaussian_deterministic",
    "encode_diagonal_gaussian",
    "functional_inplace",
    "functional_setitem",
]


def functional_setitem(tensor: torch.Tensor, key: Any, value: Any) -> torch.Tensor:
    """``tensor[key] = value`` without mutating ``tensor``: what ``x[k] = v`` becomes."""
    result = tensor.clone()
    result[key] = value
    return result


def functional_inplace(
    tensor: torch.Tensor, method: str, *args: Any, **kwargs: Any
) -> torch.Tensor:
    """``tensor.<method>(*args, **kwargs)`` (an in-place method) applied to a copy of ``tensor``.

    What ``h.masked_fill_(m, 0)`` becomes: the same kernel on the same values, so the result
    is bit for bit what the in-place op gave (its dtype stays ``tensor``'s, random in-place
    fills such as ``normal_`` draw the same numbers), while ``tensor`` itself is left alone.
    """
    result = tensor.clone()
    getattr(result, method)(*args, **kwargs)
    return result


@dataclass(frozen=True)
class Difference:
    """What a batch read differently from the plan: ``what`` (the expression as the user wrote
    it, or the value read), the plan's ``expected`` value, the batch's ``actual`` one, and
    ``where`` (the user's line)."""

    what: str
    expected: Any
    actual: Any
    where: str


class PlanMismatch(SplitError):
    """A batch whose signature (a checked size or read value) is not the plan's: the typed
    signal :mod:`graphsplit.signatures.dispatch` answers by choosing or making another plan.

    Raised by stage code run on its own (``save_code``'s files, a plan without dispatch) it is
    the user's error; ``difference`` carries what differed, for code to decide by.
    """

    difference: Difference | None = None


def _mismatch(reason: str, difference: Difference, *, of_a_value: bool = False) -> PlanMismatch:
    error = user_error(
        PlanMismatch, reason, fix=VALUE_FIX if of_a_value else SIZE_FIX, source=difference.where
    )
    assert isinstance(error, PlanMismatch)
    error.difference = difference
    return error


SIZE_FIX = Fix(
    "call graphsplit.split with an example batch of this size (one plan per "
    "resolution or frame count: bucket the data by size)"
)


def check_size(value: Any, expected: int | tuple[int, ...], what: str, where: str) -> Any:
    """Stop stage code run at a size its plan was not made for; else return ``value``.

    ``value`` is an int the traced step turned into a Python number (a resolution, a frame
    count), a tensor whose ``len`` it read, or a tuple of ints (a ``torch.Size``) the plan
    holds as a literal; ``what`` names it, ``where`` is the user's line.
    """
    if isinstance(value, torch.Tensor):
        actual: Any = len(value)
    elif isinstance(value, tuple):
        actual = tuple(int(size) for size in value)
    else:
        actual = int(value)
    if actual != expected:
        raise _mismatch(
            f"this plan was made for {what} = {expected}, got {actual}; split again for this size.",
            Difference(what, expected, actual, str(where)),
        )
    return value


def check_size_read(value: Any, read: str, expected: Any, what: str, where: str) -> Any:
    """Stop stage code whose step read a size-derived Python value the plan was not made for.

    The traced step turned a value computed from sizes into a Python ``bool`` (``if
    h.shape[-1] % 16 != 0``), ``float``, ``int`` of a float, ``str`` or formatted string
    (``f"block_{w}"``); the plan holds what it read at the example batch. ``read`` names the
    reading (``"bool"``, ``"float"``, ``"int"``, ``"str"``, or ``"format:<spec>"``), ``what``
    the value as the user wrote it, ``where`` the user's line. Returns ``value``.
    """
    actual = _size_reading(value, read)
    if actual != expected or type(actual) is not type(expected):
        raise _mismatch(
            f"this plan was made for {what} = {expected!r}, got {actual!r}; split again for "
            "this size.",
            Difference(what, expected, actual, str(where)),
        )
    return value


def check_same_read(on_twin: Any, on_tensor: Any, what: str, twin: str, where: str) -> None:
    """Stop stage 1 at a batch where stage 2's read of a boundary tensor (``twin``) would give
    another value than the step's read of the tensor it stands for (``what``: ``x.shape``).

    Stage 2 reads a size or device off a cached tensor instead of a frozen call's output it
    does not have (:mod:`graphsplit.planning.cut.twin_reads`); the two agreed at the example
    batch, and must agree at every batch cached under the plan.
    """
    if type(on_twin) is not type(on_tensor) or on_twin != on_tensor:
        raise _mismatch(
            f"this plan reads {what} off {twin} in stage 2, and for this batch they differ "
            f"({on_tensor} against {on_twin}); split again for this size.",
            Difference(what, on_twin, on_tensor, str(where)),
        )


def _size_reading(value: Any, read: str) -> Any:
    if read.startswith("format:"):
        return format(value, read.removeprefix("format:"))
    return {"bool": bool, "float": float, "int": int, "str": str}[read](value)


_VALUE_READS = {
    "tolist": lambda tensor: tensor.tolist(),
    "item": lambda tensor: tensor.item(),
    "bool": bool,
    "int": int,
    "float": float,
    "index": lambda tensor: tensor.__index__(),
}
"""How the step read each value, by the name the check is written with."""


def check_value(tensor: Any, read: str, expected: Any, where: str) -> None:
    """Stop stage 1 at a batch whose frozen data reads another value than the plan holds.

    The step read a Python value off a tensor computed from data and frozen weights only
    (``mask.sum(dim=1).tolist()``); the plan holds the example batch's value as a literal
    (:mod:`graphsplit.planning.opaque.value_reads`). On meta and fake tensors (the planning's own
    runs) there is nothing to read and nothing is checked.
    """
    if not isinstance(tensor, torch.Tensor) or tensor.is_meta or _is_fake(tensor):
        return
    actual = _VALUE_READS[read](tensor)
    if actual != expected and not _both_nan(actual, expected):
        raise _mismatch(
            f"this plan was made for the value {expected!r} read from frozen data here "
            f"({_read_text(read)}), got {actual!r}; the plan holds the example batch's value, "
            "and the trainable part's code depends on it.",
            Difference(f"the value read ({_read_text(read)})", expected, actual, str(where)),
            of_a_value=True,
        )


VALUE_FIX = Fix(
    "call graphsplit.split with an example batch that reads this value (one "
    "plan per value: bucket the data by it, e.g. by prompt length), or compute it "
    "with tensor ops so that it stays a tensor"
)


def _read_text(read: str) -> str:
    return f".{read}()" if read in ("tolist", "item") else f"{read}() of a tensor"


def _both_nan(actual: Any, expected: Any) -> bool:
    both_floats = isinstance(actual, float) and isinstance(expected, float)
    return both_floats and actual != actual and expected != expected


def _is_fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(tensor)


def encode_diagonal_gaussian(distribution: Any) -> torch.Tensor:
    """A diffusers ``DiagonalGaussianDistribution``'s ``parameters``: mean and log-variance."""
    return distribution.parameters


def decode_diagonal_gaussian(parameters: torch.Tensor) -> Any:
    """Rebuild diffusers' ``DiagonalGaussianDistribution`` (sampling stays in stage 2)."""
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    return DiagonalGaussianDistribution(parameters)


def decode_diagonal_gaussian_deterministic(parameters: torch.Tensor) -> Any:
    """As :func:`decode_diagonal_gaussian`, for distributions built with ``deterministic=True``."""
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    return DiagonalGaussianDistribution(parameters, deterministic=True)


# How each helper's call read in stage code generated by graphsplit 0.1.
LEGACY_NAMES: dict[str, str] = {
    "graphsplit_runtime_functional_setitem": "graphsplit_trace_functional_setitem",
    "graphsplit_runtime_encode_diagonal_gaussian": "graphsplit_codecs_encode_diagonal_gaussian",
    "graphsplit_runtime_decode_diagonal_gaussian": "graphsplit_codecs_decode_diagonal_gaussian",
    "graphsplit_runtime_decode_diagonal_gaussian_deterministic": (
        "graphsplit_codecs_decode_diagonal_gaussian_deterministic"
    ),
}
