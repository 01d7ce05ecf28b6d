"""Why each frozen module call is cached or not: a typed verdict per call."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from graphsplit.calls.row_folds import RowFold


class Verdict(enum.Enum):
    """What the analysis found about one call (:mod:`graphsplit.calls.analysis`)."""

    CACHED = "cached"
    TRAINABLE_INPUT = "trainable-input"
    TRAINABLE_VALUE = "trainable-value"
    RANDOM_INPUT = "random-input"
    RARE_BRANCH = "rare-branch"
    DRAWS_ITSELF = "draws-itself"
    MUTATED = "mutated"
    NON_TENSOR = "non-tensor"
    NOT_PER_SAMPLE = "not-per-sample"
    MIXES_SAMPLES = "mixes-samples"
    RECOMPUTED = "recomputed"

    @property
    def why(self) -> str:
        """The reason, in words, a call with this verdict stays in stage 2."""
        return _WHY[self]


_WHY = {
    Verdict.CACHED: "cached: its inputs are a function of the sample alone",
    Verdict.TRAINABLE_INPUT: (
        "an input depends on a trainable parameter (it carries autograd history)"
    ),
    Verdict.TRAINABLE_VALUE: (
        "an input depends on a trainable parameter without autograd's record (computed under "
        "no_grad or detached): it changed when the trainable parameters were moved, so a "
        "cached value would go stale once training moves them"
    ),
    Verdict.RANDOM_INPUT: (
        "an input differs between two runs under different seeds (it depends on a random "
        "draw, or on state that changes from step to step)"
    ),
    Verdict.RARE_BRANCH: (
        "a rare random branch changes its inputs: with the step's Python / NumPy draws forced "
        "to an end of their range, its inputs differ or the call is not made (a caption "
        "dropout drawn with random.random())"
    ),
    Verdict.DRAWS_ITSELF: "the call draws random numbers itself (dropout in training mode?)",
    Verdict.MUTATED: "the step mutates the call's output in place, or the call mutates its inputs",
    Verdict.NON_TENSOR: "its output holds a value that is not a tensor",
    Verdict.NOT_PER_SAMPLE: (
        "its inputs depend on the batch but an output has no batch dimension first "
        "(it would not cache per sample)"
    ),
    Verdict.MIXES_SAMPLES: (
        "a sample's output differs when the sample runs alone (the call mixes the samples "
        "of a batch, as batch statistics do), so a cached row would depend on its batch"
    ),
    Verdict.RECOMPUTED: (
        "redone in stage 2 (recompute='auto'): one frozen layer computing from what stage 2 "
        "reads from the cache anyway, cheaper to run than to store its output"
    ),
}


@dataclass(frozen=True)
class CallVerdict:
    """One call of a frozen module: ``path``, ``index``, the verdict and a detail."""

    path: str
    index: int
    verdict: Verdict
    detail: str = ""
    copied: tuple[str, ...] = ()
    """Cached output fields the step writes in place: stage 1 keeps them as the call returned
    them, stage 2 hands the step a copy (so the cache it reads from stays as written)."""
    fold: RowFold | None = None
    """A call taking ``k`` rows a sample (:mod:`.row_folds`): its outputs are stored a
    sample's ``k`` rows an entry."""

    @property
    def cached(self) -> bool:
        return self.verdict is Verdict.CACHED

    def line(self) -> str:
        reason = self.verdict.why + (f" ({self.detail})" if self.detail else "")
        return f"  {self.path} call {self.index}: {reason}"


def every_call_cached(verdicts: Iterable[CallVerdict]) -> frozenset[str]:
    """Modules all of whose calls are cached, unless a module inside one runs in stage 2."""
    by_module: dict[str, bool] = {}
    for verdict in verdicts:
        by_module[verdict.path] = by_module.get(verdict.path, True) and verdict.cached
    running = [path for path, cached in by_module.items() if not cached]
    return frozenset(
        path
        for path, cached in by_module.items()
        if cached and not any(other.startswith(path + ".") for other in running)
    )
