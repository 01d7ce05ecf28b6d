"""A dataset that draws random numbers (augmentation) is named by ``cache()``.

diffusers' scripts crop and flip in the dataset; the cache stores the draw stage 1 saw, and
every epoch trained from it sees that draw again. ``cache()`` warns once, naming the field;
a later call that finds the inputs changed names the cause and the fix, where it used to say
only that the data changed.
"""

from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

import graphsplit
from graphsplit.caching.loader.batches import source_for
from graphsplit.caching.loader.random_samples import random_fields
from graphsplit.errors import RandomDatasetWarning, StaleCacheError


class Encodes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(4, 4).requires_grad_(False)
        self.head = nn.Linear(4, 1)

    def forward(self, pixel_values):
        return self.head(self.encoder(pixel_values)).square().mean()


class Images(Dataset):
    """Fixed images; ``flip`` draws a horizontal flip per read with torch, numpy or random."""

    def __init__(self, flip: str | None = None, note: bool = False) -> None:
        self.flip, self.note, self.reads = flip, note, 0

    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int) -> dict:
        self.reads += 1
        image = torch.randn(4, generator=torch.Generator().manual_seed(index))
        draw = {
            None: lambda: 1.0,
            "torch": lambda: float(torch.rand(())),
            "numpy": lambda: float(np.random.rand()),
            "random": random.random,
        }[self.flip]()
        if draw < 0.5:  # RandomHorizontalFlip(p=0.5), on a row
            image = image.flip(0)
        row = {"pixel_values": image}
        if self.note:  # a field the step never reads may be random: no warning for it
            row["note"] = torch.rand(())
        return row


def _split():
    return graphsplit.split(Encodes(), (torch.randn(2, 4),))


def _no_random_dataset_warning(run):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = run()
    assert not [w for w in seen if issubclass(w.category, RandomDatasetWarning)]
    return result


@pytest.mark.parametrize("flip", ["torch", "numpy", "random"])
def test_a_dataset_that_draws_is_named_with_the_field_and_the_fix(flip, tmp_path):
    loader = DataLoader(Images(flip), batch_size=2)
    with pytest.warns(RandomDatasetWarning) as caught:
        graphsplit.cache(_split(), loader, tmp_path / "cache")
    (warning,) = [w for w in caught if issubclass(w.category, RandomDatasetWarning)]
    message = str(warning.message)
    assert message.startswith(
        "the dataset draws random numbers: two reads of sample 0 gave other 'pixel_values'"
    )
    assert "every epoch trained from it sees that same draw" in message
    assert "cache a deterministic dataset (CenterCrop, no random flip)" in message
    assert warning.filename == __file__  # the user's cache() line


def test_calling_cache_again_names_the_random_dataset_and_the_fix(tmp_path):
    split = _split()
    with pytest.warns(RandomDatasetWarning):
        graphsplit.cache(split, DataLoader(Images("torch"), batch_size=2), tmp_path / "cache")
    torch.manual_seed(1)  # other draws than the first call's
    with pytest.warns(RandomDatasetWarning), pytest.raises(StaleCacheError) as caught:
        graphsplit.cache(split, DataLoader(Images("torch"), batch_size=2), tmp_path / "cache")
    message = str(caught.value)
    assert "was made from other data than the loader yields now" in message
    assert "the dataset draws random numbers" in message
    assert "a finished cache cannot be checked against them" in message
    assert "fix:    train from the finished cache without calling cache() again" in message
    # the finished cache is whole and reads back
    assert len(graphsplit.CachedDataset(tmp_path / "cache", split)) == 6


def test_a_deterministic_dataset_is_read_once_more_and_not_named(tmp_path):
    dataset = Images(None)
    info = _no_random_dataset_warning(
        lambda: graphsplit.cache(_split(), DataLoader(dataset, batch_size=2), tmp_path / "c")
    )
    assert info.num_samples == 6
    assert dataset.reads == 6 + 1  # the check reads the first sample once more


def test_a_random_field_the_step_does_not_read_is_not_named(tmp_path):
    loader = DataLoader(Images(None, note=True), batch_size=2)
    _no_random_dataset_warning(lambda: graphsplit.cache(_split(), loader, tmp_path / "c"))


def test_the_check_gives_every_generator_back_its_state():
    source = source_for(DataLoader(Images("numpy"), batch_size=2), ["pixel_values"])
    states = torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()
    assert random_fields(source) == ("pixel_values",)
    assert torch.equal(torch.get_rng_state(), states[0])
    assert np.array_equal(np.random.get_state()[1], states[1])
    assert random.getstate() == states[2]


class Stream(IterableDataset):
    def __iter__(self):
        for index in range(4):
            yield {"pixel_values": torch.randn(4) if index % 2 else torch.ones(4)}


def test_an_iterable_dataset_cannot_be_read_twice_and_is_not_checked(tmp_path):
    loader = DataLoader(Stream(), batch_size=2)
    assert random_fields(source_for(loader, ["pixel_values"])) == ()
    _no_random_dataset_warning(lambda: graphsplit.cache(_split(), loader, tmp_path / "c"))


def test_a_collate_that_needs_a_whole_batch_is_not_checked_and_caches(tmp_path):
    def pairs_only(items):
        if len(items) != 2:
            raise ValueError("this collate takes pairs")
        return torch.utils.data.default_collate(items)

    loader = DataLoader(Images("torch"), batch_size=2, collate_fn=pairs_only)
    info = _no_random_dataset_warning(lambda: graphsplit.cache(_split(), loader, tmp_path / "c"))
    assert info.num_samples == 6
