"""A failing meta run is a value read by its type, never by its message's words."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import pytest
import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    unset_fake_temporarily,
)

from graphsplit.errors import TensorValueError, TraceError
from graphsplit.planning.meta.analysis_view import analysis_view
from graphsplit.planning.meta.meta_failures import (
    TensorMethodValueRead,
    meta_failure,
    reads_values,
)
from graphsplit.planning.meta.tracing_interpreter import TracingInterpreter


def _meta_run(function: Callable[..., object], *inputs: torch.Tensor) -> object:
    """Run ``function(*inputs)`` as one traced node, the way the tracer runs each new node."""
    graph = fx.Graph()
    placeholders = []
    for index, value in enumerate(inputs):
        placeholder = graph.placeholder(f"x{index}")
        placeholder.meta["val"] = value
        placeholders.append(placeholder)
    node = graph.call_function(function, tuple(placeholders))
    with analysis_view(nn.Module()):
        return TracingInterpreter(nn.Module(), graph, {}).value_of(node)


def says_item_and_tolist(x: torch.Tensor) -> torch.Tensor:
    """No value read: an error whose words are those of one (the meta kernel's own)."""
    raise RuntimeError("Tensor.item() cannot be called on meta tensors; nor tolist()")


def test_an_error_that_mentions_item_and_tolist_is_no_value_read():
    with pytest.raises(TraceError) as caught:
        _meta_run(says_item_and_tolist, torch.empty(3, device="meta"))
    assert type(caught.value) is TraceError
    assert "Running this operation on meta tensors failed: RuntimeError" in str(caught.value)


def _masked(x: torch.Tensor) -> torch.Tensor:
    return x[x > 0]  # the read


def _equal(x: torch.Tensor) -> bool:
    return torch.equal(x, x)


@pytest.mark.parametrize(
    ("function", "op"),
    [
        (torch.nonzero, "aten.nonzero.default"),  # an output shape that depends on values
        (_masked, "aten.nonzero.default"),  # boolean-mask indexing runs nonzero inside
        (torch.unique, "aten._unique2.default"),
        (_equal, "aten.equal.default"),  # a result that is a value
    ],
)
def test_a_value_read_is_one_by_its_type_though_its_message_names_only_the_op(function, op):
    with pytest.raises(TensorValueError) as caught:
        _meta_run(function, torch.empty(3, device="meta"))
    assert caught.value.reason.startswith(f"The step reads the value of a tensor ({op}")
    for words in ("item()", "tolist", "meta tensor", "data-dependent"):
        assert words not in str(caught.value.__cause__)


def test_a_value_read_by_an_op_names_the_line_of_the_code_that_ran_it():
    """An ATen op names no line, and the node's line is the step's call of the module whose
    code read the value (a library model's ``pixel_values[real_images_inds]``): the innermost
    frame of user or library code under the op is named; an op the node calls itself, none."""
    with pytest.raises(TensorValueError) as caught:
        _meta_run(_masked, torch.empty(3, device="meta"))
    line = f"{_line_of(_masked, '# the read')}  return x[x > 0]  # the read"
    assert caught.value.reason.startswith(
        f"The step reads the value of a tensor (aten.nonzero.default) at {line}; "
    )
    with pytest.raises(TensorValueError) as caught:
        _meta_run(torch.nonzero, torch.empty(3, device="meta"))
    assert caught.value.reason.startswith(
        "The step reads the value of a tensor (aten.nonzero.default); "
    )


def repeats_by_a_plain_meta_tensor(x: torch.Tensor) -> torch.Tensor:
    """A value read with the fake mode set aside: the meta kernel refuses, untyped."""
    with unset_fake_temporarily():
        meta = torch.empty(3, device="meta")
        return torch.repeat_interleave(meta, torch.ones(3, dtype=torch.long, device="meta"))


def test_a_meta_kernels_untyped_refusal_of_a_value_read_is_typed_at_the_op():
    with pytest.raises(TensorValueError) as caught:
        _meta_run(repeats_by_a_plain_meta_tensor, torch.empty(3, device="meta"))
    typed = caught.value.__cause__
    assert type(typed) is DynamicOutputShapeException
    assert typed.func is torch.ops.aten.repeat_interleave.Tensor
    assert type(typed.__cause__) is RuntimeError  # the meta kernel's own words, kept


def test_value_reading_ops_are_told_by_their_tags():
    assert reads_values(torch.ops.aten._local_scalar_dense.default)
    assert reads_values(torch.ops.aten.nonzero.default)
    assert not reads_values(torch.ops.aten.add.Tensor)


def test_meta_failure_decides_by_type():
    graph = fx.Graph()
    node = graph.call_function(torch.tanh, (graph.placeholder("x"),))
    op = torch.ops.aten._local_scalar_dense.default
    assert type(meta_failure(node, DataDependentOutputException(op))) is TensorValueError
    assert type(meta_failure(node, RuntimeError("a.item() and b.tolist()"))) is TraceError


def lists_a_plain_meta_tensor(x: torch.Tensor) -> list:
    """``tolist()`` in a library's Python on a plain meta tensor (the fake mode set aside, as
    for a module called whole): the method itself refuses with a ``RuntimeError`` about
    storage, past the ATen ops a value read is typed at."""
    with unset_fake_temporarily():
        sizes = torch.ones(2, 3, dtype=torch.long, device="meta")
        return sizes.tolist()  # the read


def arrays_a_plain_meta_tensor(x: torch.Tensor) -> object:
    with unset_fake_temporarily():
        sizes = torch.ones(2, 3, dtype=torch.long, device="meta")
        return sizes.numpy()  # the read


@pytest.mark.parametrize(
    ("function", "method"),
    [(lists_a_plain_meta_tensor, "tolist"), (arrays_a_plain_meta_tensor, "numpy")],
)
def test_a_value_method_on_a_plain_meta_tensor_is_a_value_read_naming_its_line(function, method):
    with pytest.raises(TensorValueError) as caught:
        _meta_run(function, torch.empty(3, device="meta"))
    typed = caught.value.__cause__
    assert type(typed) is TensorMethodValueRead
    assert isinstance(typed, DataDependentOutputException)  # a value read by its type
    assert typed.method == method
    line = f"{_line_of(function, '# the read')}  return sizes.{method}()  # the read"
    assert caught.value.reason.startswith(
        f"The step reads the value of a tensor (Tensor.{method}() reads the tensor's values, "
        f"at {line})"
    )
    assert "storage" not in str(caught.value)  # the method's own untyped words are not shown


def _line_of(function: Callable[..., object], marker: str) -> str:
    """``tests/planning/test_meta_failures.py:N``: the line of ``function`` holding ``marker``."""
    lines, first = inspect.getsourcelines(function)
    offset = next(index for index, text in enumerate(lines) if marker in text)
    return f"tests/planning/test_meta_failures.py:{first + offset}"


def test_a_value_method_on_a_real_tensor_is_left_alone():
    """Only a meta tensor's read is refused: ``tolist()`` of a real tensor the code holds
    (a table made before the analysis) still answers."""
    table = torch.arange(3)

    def lists_a_real_tensor(x: torch.Tensor) -> torch.Tensor:
        assert table.tolist() == [0, 1, 2]
        return x

    assert _meta_run(lists_a_real_tensor, torch.empty(3, device="meta")).shape == (3,)
