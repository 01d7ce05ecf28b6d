"""Draws from ``torch.distributions`` recorded as the torch draws they are.

A distribution's ``sample`` / ``rsample`` ends in one of torch's random functions
(``torch._sample_dirichlet`` for Beta and Dirichlet, ``torch._standard_gamma`` for Gamma,
``torch.binomial``, ``torch.poisson``, ``torch.normal``, ``Tensor.exponential_`` ...). With
constant parameters (torchvision-v2-style MixUp's ``Beta(α, α).sample(())``) that function's
argument is a real tensor, so the tracer's torch function mode records it as one node
(planning/patching/torch_calls.py, ``RANDOM_FUNCTIONS``): stage 2 draws every step, in the
step's order, and the ops after the draw are traced as any others.

Glossary:
    sampler: a torch random function a distribution draws with.
    meta sampler: a shape-only ``Meta`` kernel for a sampler torch ships without one; the
        analysis computes every node's value on meta tensors (:func:`meta_samplers_registered`).
    in-place clamp: ``Gamma.rsample`` clamps its sample through ``value.detach().clamp_(...)``
        (a write through a view, which the trace cannot follow); for the trace it is written
        out of place with the same values and gradients (:func:`gamma_clamped_out_of_place`).

In: the trace's patcher and tracer. Out: the samplers recorded, the meta samplers registered
for the analysis, Gamma's ``rsample`` replaced for the trace:

    DISTRIBUTION_SAMPLERS: frozenset
    with meta_samplers_registered(): ...
    gamma_clamped_out_of_place(patcher, tracer) -> None
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributions import Gamma

from graphsplit.planning.patching.patcher import Patcher

__all__ = ["DISTRIBUTION_SAMPLERS", "gamma_clamped_out_of_place", "meta_samplers_registered"]

# The samplers torch.distributions calls that torch_calls.RANDOM_FUNCTIONS does not already
# name for other reasons: Gamma, Chi2, StudentT, FisherSnedecor (``_standard_gamma``), Beta,
# Dirichlet, LKJCholesky (``_sample_dirichlet``), Binomial (``binomial``).
DISTRIBUTION_SAMPLERS = frozenset({torch._standard_gamma, torch._sample_dirichlet, torch.binomial})

# Samplers torch (2.13) ships without a Meta kernel; each sample has its first argument's shape.
_WITHOUT_META = ("_sample_dirichlet", "binomial")
_NO_SAMPLE_SHAPE = torch.Size()  # one draw of the distribution's own shape, torch's default


@contextlib.contextmanager
def meta_samplers_registered() -> Iterator[None]:
    """Shape-only Meta kernels for the samplers torch ships without one, for the block.

    Entered for the whole analysis (``planning.leaf_rounds``), not only the trace: the
    analysis after the trace runs the plan's nodes on meta tensors too. A kernel changes
    nothing but a meta run that would otherwise raise ``NotImplementedError``; an op that has
    one already keeps torch's. The registrations are removed on exit, so torch's dispatcher
    is as it was after every split.
    """
    missing = [
        name
        for name in _WITHOUT_META
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "Meta")
    ]
    if not missing:
        yield
        return
    library = torch.library.Library("aten", "IMPL")
    try:
        for name in missing:
            library.impl(name, _sample_of_the_same_shape, "Meta")
        yield
    finally:
        library._destroy()


def _sample_of_the_same_shape(first: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.empty_like(first)


def gamma_clamped_out_of_place(patcher: Patcher, tracer: Any) -> None:
    """``Gamma.rsample`` (and Chi2's, StudentT's, FisherSnedecor's through it) for the trace.

    torch writes ``value.detach().clamp_(min=tiny)`` so that autograd does not see the clamp.
    The trace writes ``value + (value.clamp(min=tiny) - value).detach()`` instead: the same
    bits (a sample at or above ``tiny`` gets ``+ 0``; one below it, a multiple of the
    smallest subnormal as ``tiny`` is, gets the exact difference), and autograd sees the
    same thing, the sample itself. Calls while a node's value is computed run torch's own.
    """
    original = Gamma.rsample

    def rsample(self: Gamma, sample_shape: Any = _NO_SAMPLE_SHAPE) -> torch.Tensor:
        if tracer.computing_meta:
            return original(self, sample_shape)
        shape = self._extended_shape(sample_shape)
        value = torch._standard_gamma(self.concentration.expand(shape)) / self.rate.expand(shape)
        tiny = torch.finfo(value.dtype).tiny
        return value + (value.clamp(min=tiny) - value).detach()

    patcher.patch_method(Gamma, "rsample", rsample)
