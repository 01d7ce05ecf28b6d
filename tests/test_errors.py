"""Every way a split can fail raises a graphsplit exception that says where, why and what to do.

Errors about the step's code name the graph node, the user's source line (this file's path and
line) and a fix; errors about the arguments name the offending argument and a fix.
"""

from __future__ import annotations

import inspect
import math
import random
import re

import numpy
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphsplit
import graphsplit.planning.analyse.boundary_codecs
from graphsplit import MetaParameterError, SplitError, TraceError, VerifyError
from graphsplit.errors import TensorValueError
from tests.helpers import batch, split_and_verify


def line_of(owner: object, text: str) -> str:
    """``test_errors.py:N`` for the line of ``owner``'s source that contains ``text``."""
    lines, start = inspect.getsourcelines(owner)
    matches = [start + offset for offset, line in enumerate(lines) if text in line]
    assert len(matches) == 1, f"{text!r} found {len(matches)} times"
    return f"test_errors.py:{matches[0]}"


def message_lines(error: BaseException) -> dict[str, str]:
    """The ``node:``, ``source:`` and ``fix:`` lines of a user error, by label."""
    labelled = {}
    for line in str(error).splitlines()[1:]:
        label, _, rest = line.strip().partition(":")
        if label in ("node", "source", "fix"):
            labelled[label] = rest.strip()
    return labelled


def assert_names_node_source_and_fix(
    error: BaseException, node: str, owner: object, text: str
) -> None:
    parts = message_lines(error)
    assert parts.get("node", "").startswith(node), str(error)
    assert line_of(owner, text) in parts.get("source", ""), str(error)
    assert parts.get("fix"), str(error)


class Step(nn.Module):
    """A frozen encoder and a trainable head; subclasses change ``forward`` only."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 4).requires_grad_(False)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.encoder(x)).mean()


# -- values steering Python control flow --------------------------------------------------------
class BranchOnTensorValue(Step):
    def forward(self, x):
        latents = self.encoder(x)
        if latents.sum() > 0:
            latents = latents * 2
        return self.head(latents).mean()


def test_control_flow_on_a_tensor_value():
    with pytest.raises(TraceError) as caught:
        graphsplit.split(BranchOnTensorValue(), (batch(3, 4),), path="trace")
    assert "control flow depends on the value of a tensor" in str(caught.value)
    assert_names_node_source_and_fix(
        caught.value, "gt", BranchOnTensorValue.forward, "if latents.sum() > 0"
    )
    assert "torch.where" in message_lines(caught.value)["fix"]


class ReadsItem(Step):
    def forward(self, x):
        latents = self.encoder(x)
        scale = latents.abs().max().item()
        return self.head(latents / scale).mean()


def test_item_reads_a_tensor_value():
    with pytest.raises(TraceError) as caught:
        graphsplit.split(ReadsItem(), (batch(3, 4),), path="trace")
    assert "reads the value of a tensor" in str(caught.value)
    assert_names_node_source_and_fix(caught.value, "item", ReadsItem.forward, ".item()")
    assert ".item()" in message_lines(caught.value)["fix"]


class BuildsFromTensorItems(Step):
    def forward(self, x):
        latents = self.encoder(x)
        stats = torch.Tensor([latents.mean(), latents.std()])
        return self.head(latents - stats[0]).mean() * stats[1]


def test_a_tensor_built_from_tensor_items_reads_their_values():
    """torch.Tensor([0-dim tensors]) reads each item in C++; it is told as a value read, with
    torch.stack as the fix (it used to be a meta failure whose fix spoke of devices)."""
    with pytest.raises(TensorValueError) as caught:
        graphsplit.split(BuildsFromTensorItems(), (batch(3, 4),), path="trace")
    assert "torch.Tensor(...) from a list holding tensors" in str(caught.value)
    assert_names_node_source_and_fix(
        caught.value, "tensor", BuildsFromTensorItems.forward, "torch.Tensor([latents.mean()"
    )
    assert "torch.stack" in message_lines(caught.value)["fix"]
    assert "device" not in message_lines(caught.value)["fix"]


def _frozen_stats(latents):
    return torch.tensor([latents.mean(), latents.std()])


class FrozenHelperBuildsFromTensorItems(Step):
    def forward(self, x):
        latents = self.encoder(x)
        stats = _frozen_stats(latents)
        return self.head(latents - stats[0]).mean() * stats[1]


def test_a_frozen_helper_building_from_tensor_items_runs_as_one_opaque_step():
    """Told as a value read, a frozen function doing it still splits as before: the encoder's
    output is cached, and the stats, which mix the batch's samples, are computed in stage 2
    from it, exactly."""
    model = FrozenHelperBuildsFromTensorItems()
    split = split_and_verify(model, (batch(3, 4),), path="trace")
    assert list(split.boundary) == ["encoder"]
    assert not any(name.startswith("encoder") for name, _ in split.stage2.named_parameters())
    assert graphsplit.verify(model, split, (batch(5, 4),), seed=1)


# -- randomness drawn while tracing -------------------------------------------------------------
class PythonRandom(Step):
    def forward(self, x):
        scale = random.random()
        return self.head(self.encoder(x) * scale).mean()


class NumpyRandom(Step):
    def forward(self, x):
        scale = float(numpy.random.rand())
        return self.head(self.encoder(x) * scale).mean()


@pytest.mark.parametrize(
    ("step", "generator", "text"),
    [
        (PythonRandom, "random", "random.random()"),
        (NumpyRandom, "numpy.random", "numpy.random.rand()"),
    ],
)
def test_randomness_drawn_while_tracing(step, generator, text):
    with pytest.raises(TraceError) as caught:
        graphsplit.split(step(), (batch(3, 4),), path="trace")
    message = str(caught.value)
    assert "Random numbers were drawn while tracing" in message
    assert "replays torch's random functions in stage 2" in message
    assert f"({generator} generator)" in message
    assert "torch.randn_like" in message_lines(caught.value).get("fix", "")
    assert line_of(step.forward, text) in message_lines(caught.value).get("source", ""), message


class NumpyDrawThenNumpyOnATracedSize(Step):
    """transformers' ``_compute_mask_indices`` (SpecAugment): a NumPy draw, then NumPy handed
    a size computed from the traced batch, which NumPy cannot take (its own ValueError)."""

    def forward(self, x):
        count = int(numpy.random.rand() * 2) + 1
        spans = numpy.arange(x.shape[0] - count)  # NumPy's ValueError on the traced size
        return self.head(self.encoder(x)).mean() * float(len(spans) + 1)


def test_a_trace_that_fails_after_a_draw_names_the_draw():
    step = NumpyDrawThenNumpyOnATracedSize()
    state = numpy.random.get_state()
    with pytest.raises(TraceError) as caught:
        graphsplit.split(step, (batch(3, 4),), path="trace")
    assert "(numpy.random generator)" in str(caught.value)
    assert line_of(step.forward, "numpy.random.rand()") in message_lines(caught.value)["source"]
    assert isinstance(caught.value.__cause__, ValueError)  # NumPy's own, kept as the cause
    assert (numpy.random.get_state()[1] == state[1]).all()  # the draw was given back
    split = graphsplit.split(step, (batch(3, 4),))  # path="auto": the module-level path
    assert "(numpy.random generator)" in split.reason


# -- Python control flow on the batch size ------------------------------------------------------
class LoopOverBatchByShape(Step):
    def forward(self, x):
        latents = self.encoder(x)
        total = 0
        for index in range(x.shape[0]):
            total = total + self.head(latents[index]).sum()
        return total


class LoopOverBatchByLen(Step):
    def forward(self, x):
        latents = self.encoder(x)
        total = 0
        for index in range(len(x)):
            total = total + self.head(latents[index]).sum()
        return total


class BatchSizeAsPythonSize(Step):
    def forward(self, x):
        latents = self.encoder(x)
        bias = torch.zeros(int(x.shape[0]), 4)
        return self.head(latents + bias).mean()


class BatchSizeAsPythonNumber(Step):
    def forward(self, x):
        latents = self.encoder(x)
        return self.head(latents).sum() / int(x.shape[0])


class LoopOverBatchByInt(Step):
    def forward(self, x):
        latents = self.encoder(x)
        total = 0
        for index in range(int(x.shape[0])):
            total = total + self.head(latents[index]).sum()
        return total


@pytest.mark.parametrize(
    ("step", "text"),
    [
        (LoopOverBatchByShape, "range(x.shape[0])"),
        (LoopOverBatchByLen, "range(len(x))"),
        (LoopOverBatchByInt, "range(int(x.shape[0]))"),
    ],
)
def test_python_control_flow_on_the_batch_size(step, text):
    with pytest.raises(TraceError) as caught:
        graphsplit.split(step(), (batch(3, 4),), path="trace")
    message = str(caught.value)
    assert "batch size" in message.splitlines()[0]
    parts = message_lines(caught.value)
    assert parts.get("node") and line_of(step.forward, text) in parts.get("source", ""), message
    assert parts.get("fix"), message


@pytest.mark.parametrize("step", [BatchSizeAsPythonSize, BatchSizeAsPythonNumber])
def test_int_of_the_batch_size_that_python_never_reads_follows_the_batch(step):
    """``int(x.shape[0])`` given to torch, or dividing a loss, is the batch size itself, traced
    (planning/tracing/int_calls.py): no longer refused, and exact at another batch size."""
    model = step()
    split = split_and_verify(model, (batch(3, 4),), path="trace")
    other = batch(5, 4, seed=1)
    assert torch.equal(split.stage2(**split.stage1(other)), model(other))


# -- values that cannot cross the boundary ------------------------------------------------------
class Latents:
    """A frozen module's custom output type (like a library's distribution object)."""

    def __init__(self, values: torch.Tensor) -> None:
        self.values = values


class LatentsEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return Latents(self.linear(x))


class LatentsHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, latents):
        return self.linear(latents.values)


class CustomObjectAcrossTheBoundary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = LatentsEncoder().requires_grad_(False)
        self.head = LatentsHead()

    def forward(self, x):
        latents = self.encoder(x)
        return self.head(latents).mean()


def encode_latents(latents: Latents) -> torch.Tensor:
    return latents.values


def decode_latents(values: torch.Tensor) -> Latents:
    return Latents(values)


@pytest.fixture
def codec_registry():
    """Codecs registered by a test are forgotten after it."""
    with graphsplit.planning.analyse.boundary_codecs.scoped_registry():
        yield


def test_non_tensor_value_without_codec(codec_registry):
    with pytest.raises(SplitError) as caught:
        graphsplit.split(CustomObjectAcrossTheBoundary(), (batch(3, 4),))
    message = str(caught.value)
    assert "Latents" in message.splitlines()[0] and "not a tensor" in message
    assert_names_node_source_and_fix(
        caught.value, "encoder", CustomObjectAcrossTheBoundary.forward, "self.encoder(x)"
    )
    assert "graphsplit.register_codec" in message_lines(caught.value)["fix"]


def test_register_codec_makes_the_value_cacheable(codec_registry):
    graphsplit.register_codec(Latents, encode_latents, decode_latents, suffix="values")
    model = CustomObjectAcrossTheBoundary()
    split = split_and_verify(model, (batch(3, 4),))
    assert list(split.boundary) == ["encoder_values"]
    spec = split.boundary["encoder_values"]
    assert (spec.shape, spec.batch_dim, spec.bytes_per_sample) == ((3, 4), 0, 16)
    assert split.stage1.encoder is model.encoder
    assert not hasattr(split.stage2, "encoder")


# -- bad arguments ------------------------------------------------------------------------------
def test_frozen_prefix_that_matches_nothing():
    with pytest.raises(SplitError, match="'encodr' matches no parameter") as caught:
        graphsplit.split(Step(), (batch(3, 4),), frozen=["encodr"])
    assert "fix:" in str(caught.value)


def test_frozen_module_that_is_not_in_the_model():
    with pytest.raises(SplitError, match="Linear that is not a submodule") as caught:
        graphsplit.split(Step(), (batch(3, 4),), frozen=[nn.Linear(4, 4)])
    assert "fix:" in str(caught.value)


def test_frozen_mixing_modules_and_prefixes():
    model = Step()
    with pytest.raises(SplitError, match=r"mixes or uses unsupported types \(Linear, str\)"):
        graphsplit.split(model, (batch(3, 4),), frozen=[model.encoder, "head"])
    with pytest.raises(SplitError, match=r"unsupported types \(int\)"):
        graphsplit.split(model, (batch(3, 4),), frozen=[3])


class TwoInputs(Step):
    def forward(self, x, y):
        return F.mse_loss(self.head(self.encoder(x)), y)


class StarArgs(Step):
    def forward(self, *inputs):
        return self.head(self.encoder(inputs[0])).mean()


class NoBatchedTensor(Step):
    def forward(self, scale):
        return self.head(self.encoder(torch.ones(2, 4))).mean() * scale


def test_example_batch_that_does_not_match_forward():
    with pytest.raises(SplitError, match=r"does not match TwoInputs\.forward") as caught:
        graphsplit.split(TwoInputs(), (batch(3, 4),))
    assert "'y'" in str(caught.value) and "fix:" in str(caught.value)
    with pytest.raises(SplitError, match=r"does not match TwoInputs\.forward"):
        graphsplit.split(TwoInputs(), (batch(3, 4), batch(3, 1)), {"z": batch(3, 1)})


def test_forward_with_star_args():
    with pytest.raises(SplitError, match=r"StarArgs.forward takes \*inputs") as caught:
        graphsplit.split(StarArgs(), (batch(3, 4),), path="trace")
    assert "fix:" in str(caught.value)


def test_example_batch_without_a_batched_tensor():
    with pytest.raises(SplitError, match="no tensor with a batch dimension") as caught:
        graphsplit.split(NoBatchedTensor(), (2.0,), path="trace")
    assert "fix:" in str(caught.value)


# -- verify and meta parameters -----------------------------------------------------------------
def test_verify_mismatch_shows_a_table_per_tensor(monkeypatch):
    model = Step()
    x = batch(3, 4)
    split = graphsplit.split(model, (x,))
    exact_stage2 = split.stage2
    monkeypatch.setattr(split, "stage2", lambda **boundary: exact_stage2(**boundary) + 1e-3)
    with pytest.raises(VerifyError) as caught:
        graphsplit.verify(model, split, (x,))
    assert isinstance(caught.value, AssertionError)
    lines = str(caught.value).splitlines()
    assert "do not reproduce Step" in lines[0] and "rtol=0.0, atol=0.0" in lines[0]
    assert "max |diff|" in lines[1]
    rows = {line[:62].strip(): line for line in lines[2:]}  # the name column is 60 wide
    assert rows["output[0]"].rstrip().endswith("MISMATCH")
    assert rows["grad head.weight"].rstrip().endswith("ok")
    assert rows["grad head.bias"].rstrip().endswith("ok")
    # A tolerance that covers the difference passes, and gradients were left as they were.
    assert all(c.ok for c in graphsplit.verify(model, split, (x,), atol=1e-2))
    assert model.head.weight.grad is None


def test_stage_holding_a_meta_parameter_refuses_to_run():
    model = Step()
    x = batch(3, 4)
    split = graphsplit.split(model, (x,))
    boundary = split.stage1(x)
    expected = model(x)
    model.encoder.to("meta")  # e.g. a training process that never loads the frozen weights
    with pytest.raises(MetaParameterError) as caught:
        split.stage1(x)
    assert "'encoder.weight'" in str(caught.value) and "fix:" in str(caught.value)
    # Stage 2 does not hold the frozen encoder, so it still trains.
    assert torch.equal(split.stage2(**boundary), expected)
    model.head.to("meta")
    with pytest.raises(MetaParameterError, match=r"'head\.weight'"):
        split.stage2(**boundary)


def test_a_weight_loaded_onto_meta_after_several_steps_is_refused():
    """The check gathers the stage's parameter dicts once and looks at their current values
    every call: a weight loaded later with ``assign=True`` (a new object in the same dict) is
    seen as it was before the check was made cheap."""
    model = Step()
    x = batch(3, 4)
    split = graphsplit.split(model, (x,))
    boundary = split.stage1(x)
    expected = model(x)
    for _ in range(3):
        assert torch.equal(split.stage2(**boundary), expected)
    on_meta = {
        name: torch.empty_like(value, device="meta")
        for name, value in model.head.state_dict().items()
    }
    model.head.load_state_dict(on_meta, assign=True)
    with pytest.raises(MetaParameterError, match=r"'head\.weight'"):
        split.stage2(**boundary)


class _TupleBatchStep(nn.Module):
    """A webdataset-style step: the batch is one ``(image, label)`` tuple parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 4).requires_grad_(False)
        self.head = nn.Linear(4, 1)

    def forward(self, batch):
        image, target = batch
        return F.mse_loss(self.head(self.encoder(image)), target)


def test_a_tuple_batch_is_refused_naming_the_field_and_the_unpacking_fix():
    step = _TupleBatchStep()
    with pytest.raises(SplitError) as caught:
        graphsplit.split(step, args=((torch.randn(2, 4), torch.randn(2, 1)),), path="trace")
    message = str(caught.value)
    assert "inside a list or tuple (batch)" in message
    assert "unpack the tuple into the step's parameters" in message_lines(caught.value)["fix"]
    # The default path goes on to the module-level path, which takes the tuple as it is.
    batch_args = ((torch.randn(3, 4), torch.randn(3, 1)),)
    split = graphsplit.split(step, args=batch_args)
    assert "module-level path" in split.report().splitlines()[0]
    graphsplit.verify(step, split, batch_args)


def test_a_batch_without_any_batched_tensor_is_refused_with_the_fix():
    class Step(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(()))

        def forward(self, scale):
            return self.weight * scale

    with pytest.raises(SplitError) as caught:
        graphsplit.split(Step(), args=(torch.tensor(2.0),), path="trace")
    assert "holds no tensor with a batch dimension" in str(caught.value)
    assert "pass at least one batched tensor" in message_lines(caught.value)["fix"]


def _clean_caption(caption: str) -> str:
    """Caption cleaning as DeepFloyd's and PixArt's scripts do it: a regex needs real text."""
    return re.sub(r"\s+", " ", caption).strip()


class _CaptionStep(nn.Module):
    """A step that cleans its batch's captions (or only counts them) before encoding."""

    def __init__(self, scale: object = 2.0, *, clean: bool = True) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 4).requires_grad_(False)
        self.head = nn.Linear(4, 1)
        self.scale, self.clean = scale, clean

    def forward(self, batch):
        captions = batch["caption"]
        if self.clean:
            captions = [_clean_caption(text) for text in captions]
        features = _scaled(self.encoder(batch["x"]), self.scale)
        return self.head(features).mean() + 0 * len(captions)


def _scaled(features: torch.Tensor, scale: object) -> torch.Tensor:
    return features * math.sqrt(scale)


def _caption_batch() -> dict:
    return {"x": torch.randn(2, 4), "caption": ["a  cat", "a dog "]}


def test_batch_strings_reaching_code_that_needs_real_text_are_refused_at_the_users_line():
    with pytest.raises(TraceError) as caught:
        graphsplit.split(_CaptionStep(), args=(_caption_batch(),), path="trace")
    message = str(caught.value)
    assert message.startswith(
        "the step passed a batch field of strings to code that needs the real text "
    )
    assert line_of(_clean_caption, 're.sub(r"\\s+"') in message
    assert "tokenize in the data pipeline" in message_lines(caught.value)["fix"]
    assert type(caught.value.__cause__) is TypeError  # the library's own error, kept


def test_another_type_error_in_a_step_whose_batch_holds_strings_keeps_its_own_message():
    """The user's own bug (``math.sqrt`` of a string scale) is not a text-tracing refusal
    because the batch happens to hold captions: it is the error eager gives."""
    step = _CaptionStep(scale="2", clean=False)
    with pytest.raises(TypeError) as eager:
        step(_caption_batch())
    with pytest.raises(TypeError) as caught:
        graphsplit.split(step, args=(_caption_batch(),), path="trace")
    assert type(caught.value) is TypeError
    assert str(caught.value) == str(eager.value)
