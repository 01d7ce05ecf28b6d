"""Why each frozen module call is cached or not: a typed verdict per call."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from torch import nn
from torch.nn.modules import module as torch_module
from torch.nn.utils.prune import BasePruningMethod
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

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
    HOOKED = "hooked"

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
    Verdict.HOOKED: (
        "a module inside it has forward hooks of the user's: stage 2 answers the call whole, "
        "so they would not run there (a hook that keeps a feature for the loss would hand it "
        "a stale one)"
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


# Hooks libraries install that act only on the call they run in: transformers' output
# capturing (its hidden states are part of the call's cached output), and torch's weight
# reparametrisations, computed from the module's own frozen parameters.
_PURE_HOOK_MODULES = ("transformers.utils.output_capturing",)
_PURE_HOOK_TYPES = (WeightNorm, SpectralNorm, BasePruningMethod)


def unhooked(verdicts: list[CallVerdict], modules: Mapping[str, nn.Module]) -> list[CallVerdict]:
    """``verdicts`` with each cached call of a module that holds hooked submodules turned
    :attr:`Verdict.HOOKED`.

    Stage 2 answers a cached call by replacing its module's ``forward``: the module's own hooks
    still run around the answer (NEFTune's noise on a cached embedding), but nothing inside it
    runs, so neither do the hooks on its submodules. A FitNets-style hint loss keeps a frozen
    teacher layer's output through such a hook and reads it after the call: cached, it read
    whatever an earlier run left there. Such a call stays in stage 2 (calls inside it, the
    hooked layer's own included, may still be cached when the module is opened).
    """
    result = []
    hooked: dict[str, list[str]] = {}  # by path: a module called many times is walked once
    for verdict in verdicts:
        module = modules.get(verdict.path)
        if verdict.cached and module is not None and verdict.path not in hooked:
            hooked[verdict.path] = _hooked_inside(module)
        names = hooked.get(verdict.path, []) if verdict.cached else []
        if names:
            shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            verdict = dataclasses.replace(
                verdict, verdict=Verdict.HOOKED, detail=f"hooks on {shown}", copied=(), fold=None
            )
        result.append(verdict)
    return result


def _hooked_inside(module: nn.Module) -> list[str]:
    """The submodules of ``module`` (itself left out) that carry a forward or forward pre-hook
    other than a pure library one; ``"every module (a global hook)"`` for torch's global ones."""
    everywhere = [*torch_module._global_forward_hooks.values()]
    everywhere += torch_module._global_forward_pre_hooks.values()
    if any(not _pure(hook) for hook in everywhere) and next(module.children(), None) is not None:
        return ["every module (a global hook)"]
    return [
        name
        for name, inner in module.named_modules()
        if name
        and any(
            not _pure(hook)
            for hook in [*inner._forward_hooks.values(), *inner._forward_pre_hooks.values()]
        )
    ]


def _pure(hook: object) -> bool:
    return getattr(hook, "__module__", "") in _PURE_HOOK_MODULES or isinstance(
        hook, _PURE_HOOK_TYPES
    )
