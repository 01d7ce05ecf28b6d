"""How ``cache()`` reads a loader's batch as stage 1's inputs (caching/loader/batches.py)."""

from __future__ import annotations

import pytest
import torch

from graphsplit.caching.loader.batches import _batch_length, as_mapping
from graphsplit.errors import CacheError


def test_a_dict_batch_gives_its_fields_by_name():
    batch = {"x": torch.zeros(2, 3), "key": ["a", "b"], "unused": 1}
    assert as_mapping(batch, ["x"]) == {"x": batch["x"]}


def test_a_tuple_batch_gives_the_step_its_positional_inputs():
    x, y = torch.zeros(2, 3), torch.ones(2)
    assert as_mapping((x, y), ["x", "y"]) == {"x": x, "y": y}


def test_a_step_of_one_parameter_takes_the_loaders_list_whole():
    """A webdataset's ``image, text = batch`` step: the list is the step's one input."""
    images, texts = torch.zeros(3, 3, 4, 4), ["a", "b", "c"]
    mapped = as_mapping([images, texts], ["batch"])
    assert mapped == {"batch": [images, texts]}
    assert _batch_length([images, texts], ["batch"]) == 3  # rows counted from its items


def test_a_list_batch_of_another_length_is_refused_naming_the_inputs():
    with pytest.raises(CacheError) as info:
        as_mapping([torch.zeros(2), torch.zeros(2), torch.zeros(2)], ["x", "y"])
    message = str(info.value)
    assert "a batch is a list; graphsplit.cache needs a dict holding ['x', 'y']" in message
    assert "make the dataset return dicts" in message


def test_a_dict_batch_missing_an_input_is_refused_naming_it():
    with pytest.raises(CacheError) as info:
        as_mapping({"x": torch.zeros(2)}, ["x", "y"])
    assert "the loader's batches lack ['y']" in str(info.value)
