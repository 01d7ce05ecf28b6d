"""Step specs that give the CLI their own data pipeline: a loader, a collate_fn, a storage
dtype; and specs whose data options contradict each other."""

import torch
from torch.utils.data import DataLoader, default_collate

from graphsplit import StepSpec
from tests.tools.specs.tiny_step import Pairs, TinyStep

COLLATED = []  # batch sizes the counting collate_fn saw (the loader runs in this process)


def counting_collate(items: list) -> dict:
    COLLATED.append(len(items))
    return default_collate(items)


def _example() -> tuple:
    torch.manual_seed(0)
    return TinyStep(), (torch.randn(3, 8), torch.randn(3, 1))


def with_loader() -> StepSpec:
    model, example = _example()
    return StepSpec(model, example, loader=DataLoader(Pairs(), batch_size=5))


def with_collate() -> StepSpec:
    model, example = _example()
    return StepSpec(model, example, dataset=Pairs(), collate_fn=counting_collate)


def with_bfloat16() -> StepSpec:
    model, example = _example()
    return StepSpec(model, example, dataset=Pairs(), storage_dtype=torch.bfloat16)


def other_weights() -> StepSpec:
    """The tiny step with other weights: its cache is stale for ``tiny_step:step``."""
    torch.manual_seed(1)
    return StepSpec(TinyStep(), (torch.randn(3, 8), torch.randn(3, 1)), dataset=Pairs())


def missing_input() -> StepSpec:
    """Items without ``y``: the step cannot run on the first batch."""
    model, example = _example()
    return StepSpec(model, example, dataset=[{"x": torch.randn(8)} for _ in range(4)])


def loader_and_dataset() -> StepSpec:
    model, example = _example()
    return StepSpec(model, example, dataset=Pairs(), loader=DataLoader(Pairs()), num_workers=2)


def bad_storage_dtype() -> StepSpec:
    model, example = _example()
    return StepSpec(model, example, dataset=Pairs(), storage_dtype=torch.int8)


def bad_num_workers() -> StepSpec:
    model, example = _example()
    return StepSpec(model, example, dataset=Pairs(), num_workers=-1)
