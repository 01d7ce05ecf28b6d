"""A step spec the whole-step trace refuses (a per-sample loop): the CLI's module-level split."""

import torch

from graphsplit import StepSpec
from tests.calls.test_fallback import PerSampleLoop


def step() -> StepSpec:
    torch.manual_seed(0)
    return StepSpec(PerSampleLoop(), example_args=(torch.randn(3, 4), [True, False, True]))
