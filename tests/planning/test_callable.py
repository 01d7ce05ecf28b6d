"""Splitting what users write: plain functions, closures, bound methods, callable objects.

Each step reaches its modules another way; the split must find them, name them as the code does,
call the same objects in stage 2 and reproduce the function bit for bit.
"""

from __future__ import annotations

import collections
import copy
import functools
import re
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphsplit
from graphsplit.planning.step.callables import as_step_module
from tests.helpers import batch, frozen, split_and_verify

X, Y = batch(3, 8), batch(3, 1, seed=1)


def _models(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    return frozen(nn.Linear(8, 4)), nn.Linear(4, 1)


def _held(split: graphsplit.Split) -> dict[str, int]:
    return {name: id(param) for name, param in split.stage2.named_parameters()}


# -- where the modules come from ------------------------------------------------------------------
def test_closure_cells_are_found_and_stage2_calls_the_same_objects():
    encoder, head = _models()

    def training_step(x, y):
        return F.mse_loss(head(encoder(x)), y)

    split = split_and_verify(training_step, (X, Y))
    assert list(split.boundary) == ["y", "encoder"]
    assert split.stage2.head is head and split.stage1.encoder is encoder
    assert _held(split) == {"head.weight": id(head.weight), "head.bias": id(head.bias)}
    assert split.model_name == "training_step"


def test_modules_a_local_helper_or_partial_in_a_closure_reaches_are_found():
    """diffusers' LCM script: ``compute_embeddings_fn = functools.partial(compute_embeddings,
    text_encoder=text_encoder, ...)`` made in ``main()``; the step calls it, and the partial's
    keywords (and a local helper's own closure) hold the frozen modules."""
    encoder, head = _models(3)
    scale = frozen(nn.Linear(4, 4))

    def compute_embeddings(x, weight, text_encoder):
        return scale(text_encoder(x)) * weight

    embed = functools.partial(compute_embeddings, weight=2.0, text_encoder=encoder)

    def training_step(x, y):
        return F.mse_loss(head(embed(x)), y)

    module = as_step_module(training_step, (X, Y), {}).module
    assert dict(module.named_children()) == {"head": head, "text_encoder": encoder, "scale": scale}
    split = split_and_verify(training_step, (X, Y))
    assert set(_held(split)) == {"head.weight", "head.bias"}


ENCODER, HEAD = _models(1)


def _encode(x):  # a helper function beside the step: its globals are reached too
    return ENCODER(x)


def global_step(x, y):
    return F.mse_loss(HEAD(_encode(x)), y)


def test_globals_and_helper_functions_are_found():
    split = split_and_verify(global_step, (X, Y))
    assert split.stage2.HEAD is HEAD and split.stage1.ENCODER is ENCODER
    assert split.trainable == {"HEAD.weight", "HEAD.bias"}


models = types.ModuleType("models")  # ``import models``: another file of the script
models.encoder, models.head = _models(3)
models.loss = F.mse_loss


def python_module_step(x, y):
    return models.loss(models.head(models.encoder(x)), y)


@pytest.mark.parametrize("path", ["trace", "calls"])
def test_models_held_by_an_imported_python_module_are_found(path):
    split = split_and_verify(python_module_step, (X, Y), path=path)
    assert split.trainable == {"models_head.weight", "models_head.bias"}
    held = {name for name, _ in split.stage2.named_parameters()}
    assert held == {"models_head.weight", "models_head.bias"}  # the encoder's work is cached


class Trainer:
    """A trainer object (not a module) holding its models, as kohya / TRL trainers do."""

    def __init__(self) -> None:
        self.encoder, self.head = _models(2)
        self.scale = 0.5

    def training_step(self, x, y):
        return F.mse_loss(self.head(self.encoder(x)) * self.scale, y)


def test_bound_method_of_a_trainer_names_modules_by_attribute():
    trainer = Trainer()
    split = split_and_verify(trainer.training_step, (X, Y))
    assert split.stage2.head is trainer.head
    assert set(split.stage2.state_dict()) == {"head.weight", "head.bias"}


class LightningLike(nn.Module):
    """A module whose training step is a method other than ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.head = _models(3)
        self.bias = nn.Parameter(torch.zeros(1))
        self.register_buffer("target_scale", torch.tensor(2.0))

    def training_step(self, x, y):
        return F.mse_loss(self.head(self.encoder(x)) + self.bias, y * self.target_scale)


def test_method_of_a_module_keeps_the_modules_own_state_dict_keys():
    model = LightningLike()
    split = split_and_verify(model.training_step, (X, Y))
    keys = list(split.stage2.state_dict())
    assert keys == [key for key in model.state_dict() if key in keys]
    assert {"bias", "head.weight", "head.bias"} <= set(keys)
    assert split.stage2.bias is model.bias


def test_module_arguments_are_bound_once_and_leave_the_batch():
    encoder, head = _models(4)

    def training_step(model, x, y, *, frozen_part):
        return F.mse_loss(model(frozen_part(x)), y)

    split = split_and_verify(training_step, (head, X, Y), {"frozen_part": encoder})
    assert split.input_names == ("x", "y")
    assert split.stage2.model is head
    loss = split.stage2(**split.stage1(X, Y))
    assert torch.equal(loss, training_step(head, X, Y, frozen_part=encoder))


def test_callable_object_and_containers_of_modules():
    encoder, head = _models(5)

    class Step:
        def __init__(self) -> None:
            self.models = {"encoder": encoder, "head": head}

        def __call__(self, x, y):
            return F.mse_loss(self.models["head"](self.models["encoder"](x)), y)

    split = split_and_verify(Step(), (X, Y))
    assert set(split.stage2.state_dict()) == {"models.head.weight", "models.head.bias"}


def test_a_pipeline_object_holding_modules_and_a_scheduler():
    encoder, head = _models(12)

    class Pipeline:  # callable, like a diffusers pipeline
        def __init__(self) -> None:
            self.encoder, self.head = encoder, head
            self.schedule = types.SimpleNamespace(table=torch.linspace(0.5, 1.5, 10))

        def __call__(self, x):
            return self.head(self.encoder(x))

    pipe = Pipeline()

    def training_step(x, y):
        index = torch.randint(0, 10, (x.shape[0],))
        return F.mse_loss(pipe.head(pipe.encoder(x)) * pipe.schedule.table[index, None], y)

    split = split_and_verify(training_step, (X, Y))
    assert list(split.stage2.state_dict()) == ["pipe.head.weight", "pipe.head.bias"]
    assert "self.pipe_schedule_table" in split.stage2.code


def test_a_module_reached_twice_keeps_one_name():
    encoder, head = _models(6)
    stack = nn.Sequential(encoder, head)

    def training_step(x, y):
        return F.mse_loss(stack(x) + head(encoder(x)), y)

    module = as_step_module(training_step, (X, Y), {}).module
    assert list(dict(module.named_children())) == ["stack"]
    assert list(module.state_dict()) == list(stack.state_dict(prefix="stack."))
    split_and_verify(training_step, (X, Y))


def test_a_dict_batch_is_spread_into_stage1_inputs():
    encoder, head = _models(10)

    def training_step(batch, weight=1.0):
        return F.mse_loss(head(encoder(batch["x"])), batch["y"]) * weight

    split = split_and_verify(training_step, ({"x": X, "y": Y},))
    assert split.input_names == ("x", "y")  # an argument left out keeps its default
    assert split.boundary["encoder"].batch_dim == 0  # the field's batch dim is seen
    loss = split.stage2(**split.stage1(x=X, y=Y))
    assert torch.equal(loss, training_step({"x": X, "y": Y}))


def test_a_module_taking_a_dict_batch_gets_its_fields_batched():
    # Before: a dict's tensors were frozen into the plan as per-dataset constants (one y for
    # every batch), silently; the fields are now inputs of their own, batched along dim 0.
    encoder, head = _models(12)

    class Step(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder, self.head = encoder, head

        def forward(self, batch, scale: torch.Tensor):
            return F.mse_loss(self.head(self.encoder(batch["x"])), batch["y"]) * scale

    step, scale = Step(), torch.tensor(2.0)
    split = split_and_verify(step, ({"x": X, "y": Y}, scale))
    assert split.input_names == ("x", "y", "scale")
    assert split.boundary["y"].batch_dim == 0 and split.boundary["encoder"].batch_dim == 0
    assert set(split.stage2.state_dict()) == {"head.weight", "head.bias"}
    other_x, other_y = batch(5, *X.shape[1:], seed=3), batch(5, *Y.shape[1:], seed=4)
    loss = split.stage2(**split.stage1(x=other_x, y=other_y, scale=scale))
    assert torch.equal(loss, step({"x": other_x, "y": other_y}, scale))


@pytest.mark.parametrize("keys", [("x", "weight"), ("x", "not a name")])
def test_a_dict_batch_whose_keys_cannot_be_parameters_is_refused(keys):
    encoder, head = _models(11)

    def training_step(batch, weight=1.0):
        return head(encoder(batch["x"])).sum() * weight

    with pytest.raises(graphsplit.SplitError) as caught:
        graphsplit.split(training_step, (dict(zip(keys, (X, Y))),))
    message = str(caught.value)
    assert "takes the dict 'batch'" in message and repr([keys[1]]) in message
    assert "fix:    rename those fields" in message


def test_placeholders_point_at_the_users_def_line():
    encoder, head = _models(7)

    def training_step(x, y):
        return F.mse_loss(head(encoder(x)), y)

    split = graphsplit.split(training_step, (X, Y))
    line = training_step.__code__.co_firstlineno
    assert split.boundary["y"].source.endswith(f"test_callable.py:{line}")


# -- what cannot be split, and the message that says so ------------------------------------------
def _generator_step(x):
    yield HEAD(x)


async def _async_step(x):
    return HEAD(x)


def _star_step(*tensors):
    return HEAD(tensors[0])


@pytest.mark.parametrize(
    ("step", "names", "fix"),
    [
        (len, "builtin builtin_function_or_method len", "pass the function that runs one"),
        (
            lambda x: x.sum(),
            re.compile(r"<lambda> \(\S*test_callable\.py:\d+\) reaches no torch\.nn\.Module"),
            "use the models in the step's own",
        ),
        (
            _generator_step,
            re.compile(r"_generator_step \(\S*test_callable\.py:\d+\) is a generator"),
            "make it a plain function",
        ),
        (_async_step, "is an async function", "make it a plain function"),
        (Trainer, "the class Trainer", "pass an instance (graphsplit.split(Trainer(...)"),
        (
            functools.partial(global_step, z=Y),
            "functools.partial(global_step",
            "bind only the function's own parameters",
        ),
        (_star_step, "takes *tensors", "explicit parameters, one per batch field"),
    ],
    ids=["builtin", "lambda", "generator", "async", "class", "partial", "varargs"],
)
def test_unsupported_callables_are_named_with_the_fix(step, names, fix):
    with pytest.raises(graphsplit.SplitError) as caught:
        graphsplit.split(step, (X,))
    message = str(caught.value)
    assert names.search(message) if isinstance(names, re.Pattern) else names in message, message
    assert "fix:" in message and fix in message


def test_a_batch_that_does_not_fit_the_function_names_it():
    with pytest.raises(
        graphsplit.SplitError,
        match=r"global_step \(\S*test_callable\.py:\d+\): too many positional",
    ):
        graphsplit.split(global_step, (X, Y, X))


# -- state dicts and optimizers ------------------------------------------------------------------
class OutOfOrder(nn.Module):
    """Registers ``head`` before ``body`` but calls ``body`` first; holds a scheduler-like table."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(8)
        self.head = nn.Linear(4, 1)
        self.body = nn.Linear(4, 4)
        self.encoder = frozen(nn.Linear(8, 4))
        self.schedule = type("Schedule", (), {})()
        self.schedule.table = torch.linspace(0.5, 1.5, 10)
        self.plain = [torch.full((1,), 3.0)]

    def forward(self, x, y):
        index = torch.randint(0, 10, (x.shape[0],))  # drawn every step: stage 2
        scale = self.schedule.table[index].unsqueeze(-1) * self.plain[0]
        return F.mse_loss(self.head(self.body(self.encoder(x))) * scale, y)


def _trainables(model: nn.Module) -> list[nn.Parameter]:
    return [param for param in model.parameters() if param.requires_grad]


def test_constants_are_named_after_their_origin_and_kept_out_of_state_dicts():
    model = OutOfOrder()
    split = split_and_verify(model, (X, Y))
    code = split.stage2.code
    assert "self.schedule_table" in code and "self.constant" in code
    assert "_tensor_constant" not in code + split.stage1.code
    assert list(split.stage2.state_dict()) == [
        "head.weight",
        "head.bias",
        "body.weight",
        "body.bias",
    ]
    assert dict(split.stage2.named_buffers())["schedule_table"] is model.schedule.table


def test_checkpoints_and_optimizers_cross_between_full_and_split_runs_strictly():
    full, resumed = OutOfOrder(), OutOfOrder()
    split = graphsplit.split(resumed, (X, Y))

    # A full run trains a step and checkpoints its trainable modules and optimizer.
    optimizer = torch.optim.Adam(_trainables(full), lr=0.1)
    torch.manual_seed(1)
    F.mse_loss(full(X, Y), torch.zeros(())).backward()
    optimizer.step()
    trainable = nn.ModuleDict({"head": full.head, "body": full.body})
    saved = {"model": trainable.state_dict(), "optimizer": optimizer.state_dict()}
    checkpoint = copy.deepcopy(saved)  # as torch.save / torch.load would give it back

    # The split run loads both strictly and continues exactly as the full run does.
    split.stage2.load_state_dict(checkpoint["model"], strict=True)
    split_optimizer = torch.optim.Adam(_trainables(split.stage2), lr=0.1)
    split_optimizer.load_state_dict(checkpoint["optimizer"])
    for opt, run in (
        (optimizer, lambda: full(X, Y)),
        (split_optimizer, lambda: split.stage2(**split.stage1(X, Y))),
    ):
        opt.zero_grad()
        torch.manual_seed(0)
        run().backward()
        opt.step()
    for (name, a), b in zip(full.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name

    # And back: the split run's checkpoint loads strictly into the full run's modules.
    trainable.load_state_dict(split.stage2.state_dict(), strict=True)
    optimizer.load_state_dict(split_optimizer.state_dict())
    assert torch.equal(full.body.weight, resumed.body.weight)


def test_an_optimizer_on_the_users_modules_trains_stage2():
    encoder, head = _models(9)
    reference = nn.Linear(4, 1)
    reference.load_state_dict(head.state_dict())

    def training_step(x, y):
        return F.mse_loss(head(encoder(x)), y)

    split = graphsplit.split(training_step, (X, Y))
    optimizer = torch.optim.SGD(head.parameters(), lr=0.5)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    boundary = split.stage1(X, Y)
    for _ in range(2):
        optimizer.zero_grad()
        split.stage2(**boundary).backward()
        optimizer.step()
        reference_optimizer.zero_grad()
        F.mse_loss(reference(encoder(X)), Y).backward()
        reference_optimizer.step()
    assert torch.equal(head.weight, reference.weight) and torch.equal(head.bias, reference.bias)


def test_saved_code_of_a_function_split_runs_with_the_same_objects(tmp_path):
    split = graphsplit.split(global_step, (X, Y))
    split.save_code(tmp_path)
    source = (tmp_path / "stage2.py").read_text()
    assert "TARGETS = ('HEAD',)" in source and "of global_step" in source
    namespace: dict = {}
    exec(compile(source, str(tmp_path / "stage2.py"), "exec"), namespace)
    saved = namespace["Stage2"](split.stage2)
    assert saved.HEAD is HEAD
    boundary = split.stage1(X, Y)
    assert torch.equal(saved(**boundary), split.stage2(**boundary))


class _Fields(collections.UserDict):
    """A collator's mapping that is not a dict (transformers' ``BatchEncoding`` is one)."""

    def scaled(self) -> torch.Tensor:
        return self["x"] * 2


@pytest.mark.parametrize("kind", [_Fields, collections.OrderedDict])
@pytest.mark.parametrize("path", ["trace", "calls"])
def test_a_mapping_batch_spreads_into_fields_and_the_step_gets_its_own_type_back(kind, path):
    encoder, head = _models()
    seen: list[type] = []

    def step(batch):
        seen.append(type(batch))
        x = batch.scaled() if isinstance(batch, _Fields) else batch["x"] * 2
        return F.mse_loss(head(encoder(x)), batch["y"])

    example = kind(x=X, y=Y)
    split = split_and_verify(step, (example,), path=path)
    assert split.input_names == ("x", "y")
    assert seen and set(seen) == {kind}
    seen.clear()
    boundary = split.stage1(x=X, y=Y)
    assert torch.equal(split.stage2(**boundary), step(kind(x=X, y=Y)))
    assert set(seen) == {kind}


def test_a_defaultdict_batch_is_not_spread():
    encoder, head = _models()

    def step(batch):
        return F.mse_loss(head(encoder(batch["x"])), batch["y"])

    fields = collections.defaultdict(lambda: None, x=X, y=Y)
    module = as_step_module(step, (fields,), {})
    assert list(module.kwargs) == ["batch"] and module.kwargs["batch"] is fields
