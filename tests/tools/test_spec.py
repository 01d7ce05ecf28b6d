"""Step specs: `file.py:function` and `module:function` load; every bad spec says the fix."""

import pytest

from graphsplit import StepSpec
from graphsplit.tools.spec import SpecError, load_spec
from tests.tools.specs import BAD_SPECS, TINY_STEP


def test_load_spec_returns_step_spec():
    spec = load_spec(f"{TINY_STEP}:step")
    assert isinstance(spec, StepSpec)
    assert spec.example_kwargs == {}
    assert len(spec.example_args) == 2


def test_load_spec_accepts_a_module_spec():
    assert isinstance(load_spec("tests.tools.specs.tiny_step:step"), StepSpec)


@pytest.mark.parametrize(("spec", "message"), BAD_SPECS)
def test_bad_specs_raise_spec_error_with_a_fix(spec, message):
    with pytest.raises(SpecError, match="fix") as raised:
        load_spec(spec)
    assert message in str(raised.value)


def test_example_args_that_are_not_a_tuple_become_one():
    import torch

    example = torch.randn(3, 2)
    spec = StepSpec(torch.nn.Linear(2, 1), example_args=example)
    assert len(spec.example_args) == 1 and spec.example_args[0] is example
