"""Whether a map-style dataset draws random numbers: data augmentation, frozen by a cache.

diffusers' scripts crop and flip in the dataset (``transforms.RandomCrop``,
``RandomHorizontalFlip`` behind ``--random_flip``), so every read of a sample is another draw.
A cache stores the draw stage 1 saw, and every epoch trained from it sees that draw again,
where the unsplit run draws anew each epoch: per batch the split is exact, over epochs it is
not the same training. ``cache()`` says so (:class:`~graphsplit.errors.RandomDatasetWarning`),
and a later call that finds the dataset's inputs changed names the cause.

The first sample the loader would read is read again, from a seed of the global generators
(torch, numpy, Python's ``random``; a generator the dataset seeds itself is left to it; every
state is given back) and collated alone by the loader's own ``collate_fn``. A read that draws
nothing from those generators ends the check; one that draws is read again under other seeds
(up to :data:`MAX_READS`), and a batch input that comes out otherwise is a random field.
Iterable datasets cannot read a sample twice and are not checked.

    random_fields(source) -> ("pixel_values",)     # () when the reads agree or cannot be made
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from graphsplit.calls.generators import RandomState, seeded, snapshot
from graphsplit.calls.provenance import same_value


def random_fields(source: Any) -> tuple[str, ...]:
    """The batch inputs of ``source``'s first sample that differ between reads."""
    loader = getattr(source, "loader", None)
    index_lists = getattr(source, "index_lists", None)
    if loader is None or not index_lists or not index_lists[0]:
        return ()
    first = index_lists[0][0]
    reads: list[Any] = []
    for seed in range(1, MAX_READS + 1):
        with seeded(seed, own_generators=False):
            before = snapshot()
            try:
                reads.append(loader.collate_fn([loader.dataset[first]]))
            except Exception:  # a collate that needs a whole batch: caching itself will say
                return ()
            drew = _global_draws(before, snapshot())
        if seed == 1 and not drew:
            return ()  # one read that draws nothing from the global generators: deterministic
        fields = _differing(reads[0], reads[-1], source.input_names)
        if fields:
            return fields
    return ()  # it draws, but no batch input came out otherwise in MAX_READS reads


MAX_READS = 8
"""Reads of the first sample at most, once it draws: a flip with p=0.5 agrees between two
reads half the time, between the first and each of seven others once in 128."""


def _global_draws(before: RandomState, after: RandomState) -> bool:
    """Whether torch's, numpy's or Python's global generator moved (not a generator of the
    dataset's own, which ``own_draws`` counts)."""
    return dataclasses.replace(after, own_draws=before.own_draws) != before


def _differing(one: Any, other: Any, names: Sequence[str]) -> tuple[str, ...]:
    if not isinstance(one, Mapping) or not isinstance(other, Mapping):
        return ()
    return tuple(
        name
        for name in names
        if name in one and name in other and not same_value(one[name], other[name])
    )


def frozen_augmentation_text(source: Any) -> str:
    """What the warning and a later refusal say about ``source``'s random fields."""
    names = ", ".join(repr(name) for name in source.random_fields)
    first = source.index_lists[0][0]
    return (
        f"the dataset draws random numbers: two reads of sample {first!r} gave other {names} "
        "(random crops or flips in the dataset?). The cache holds one draw per sample, and "
        "every epoch trained from it sees that same draw, where an unsplit run draws anew "
        "each epoch"
    )
