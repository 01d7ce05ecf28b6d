"""``isinstance``, ``callable``, ``len`` and ``list`` of traced values answer as eager does.

Each tiny step writes the construct the way a library writes it: transformers'
``torch_compilable_check`` (``callable(cond)``, then ``torch._check_tensor_all_with``), CLIP's
``contrastive_loss`` (``torch.arange(len(logits))``), diffusers' ``encode_prompt``
(``len(prompt)`` of the batch's list of strings), LLaVA's ``list(image_features)``,
DiffSynth's ``torch.Tensor([guidance] * latents.shape[0])``, a loss module created inside
``forward``, and transformers' output capturing (hooks installed on first call). Each is
split and verified bit for bit, at two batch sizes where the batch size is what is at stake.
"""

from __future__ import annotations

import builtins
import contextvars

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphsplit
from graphsplit.errors import TraceError
from tests.helpers import batch, frozen, line_of, param_names, split_and_verify


def compilable_check(cond, msg):
    """transformers' ``torch_compilable_check`` outside dynamo (utils/import_utils.py)."""
    if not callable(msg):

        def msg_callable():
            return msg
    else:
        msg_callable = msg
    if callable(cond):
        cond = cond()
    if isinstance(cond, torch.Tensor):
        torch._check_tensor_all_with(ValueError, cond, msg_callable)
    else:
        torch._check_with(ValueError, cond, msg_callable)


class ChecksItsFeatures(nn.Module):
    """LLaVA's ``get_placeholder_mask``: a tensor condition checked on traced values."""

    def __init__(self) -> None:
        super().__init__()
        self.tower = frozen(nn.Linear(4, 4))
        self.projector = nn.Linear(4, 4)

    def forward(self, pixels):
        features = self.tower(pixels)
        compilable_check(features.isfinite().all(), "features must be finite")
        compilable_check(features.shape[-1] == 4, "four channels")
        assert callable(features.size) and not callable(features)
        return self.projector(features).square().mean()


def test_a_traced_tensor_is_not_callable_and_checks_on_it_are_assumed_to_hold():
    split = split_and_verify(ChecksItsFeatures(), (batch(3, 4),))
    assert param_names(split.stage2, split._model) == {"projector.weight", "projector.bias"}
    assert "_is_all_true" not in split.stage1.code + split.stage2.code


def test_a_check_on_real_values_still_fails_while_tracing():
    class FailsItsCheck(ChecksItsFeatures):
        def forward(self, pixels):
            compilable_check(False, "always wrong")
            return super().forward(pixels)

    with pytest.raises(ValueError, match="always wrong"):
        graphsplit.split(FailsItsCheck(), (batch(3, 4),))


def contrastive_loss(logits):
    """CLIP's ``contrastive_loss`` (transformers/models/clip/modeling_clip.py)."""
    return F.cross_entropy(logits, torch.arange(len(logits), device=logits.device))


class LockedTower(nn.Module):
    """LiT: a locked image tower, a trained text tower, CLIP's loss."""

    def __init__(self) -> None:
        super().__init__()
        self.image_tower = frozen(nn.Linear(6, 4))
        self.text_tower = nn.Linear(5, 4)

    def forward(self, pixels, tokens):
        image = F.normalize(self.image_tower(pixels), dim=-1)
        text = F.normalize(self.text_tower(tokens), dim=-1)
        logits = text @ image.t()
        return (contrastive_loss(logits) + contrastive_loss(logits.t())) / 2


@pytest.mark.parametrize("size", [2, 3])
def test_len_of_a_traced_tensor_follows_the_batch_like_its_shape(size):
    model = LockedTower()
    split = split_and_verify(model, (batch(size, 6), batch(size, 5, seed=1)))
    assert param_names(split.stage2, model) == {"text_tower.weight", "text_tower.bias"}
    assert split.stage2.code.count("torch.arange(len_") == 2
    other = (batch(size + 3, 6, seed=2), batch(size + 3, 5, seed=3))  # another batch size
    assert torch.equal(split.stage2(**split.stage1(*other)), model(*other))


class CaptionedImages(nn.Module):
    """diffusers' ``encode_prompt``: the batch size is ``len(prompt)`` of the prompt list."""

    def __init__(self) -> None:
        super().__init__()
        self.text_encoder = frozen(nn.Embedding(16, 4))
        self.head = nn.Linear(12, 1)

    def forward(self, ids, prompts):
        prompts = [prompts] if isinstance(prompts, str) else prompts
        if not isinstance(prompts, list):
            raise TypeError("prompts must be a list, as the data loader gives it")
        batch_size = len(prompts)
        embeds = self.text_encoder(ids).view(batch_size, -1)
        return self.head(embeds).mean()


@pytest.mark.parametrize("size", [2, 3])
def test_len_and_isinstance_of_a_traced_list_answer_as_eager(size):
    model = CaptionedImages()
    ids = torch.arange(size * 3).reshape(size, 3) % 16
    prompts = [f"a photo number {i}" for i in range(size)]
    split = split_and_verify(model, (ids, prompts))
    assert "len(prompts)" in split.stage1.code
    assert "prompts" not in split.boundary


class PerImageRows(nn.Module):
    """LLaVA's ``image_features = list(image_features)``, then ``torch.cat(image_features)``."""

    def __init__(self) -> None:
        super().__init__()
        self.tower = frozen(nn.Linear(4, 4))
        self.projector = nn.Linear(4, 4)

    def forward(self, pixels):
        rows = list(self.projector(self.tower(pixels)))
        assert isinstance(rows, list)
        return torch.cat(rows, dim=0).square().mean()


@pytest.mark.parametrize("size", [2, 3])
def test_list_of_a_traced_tensor_is_one_node_not_a_loop_over_the_batch(size):
    split = split_and_verify(PerImageRows(), (batch(size, 2, 4),))
    assert "list(projector)" in split.stage2.code
    assert builtins.list is list and isinstance([], list)  # the builtin is back


class GuidancePerSample(nn.Module):
    """DiffSynth's guidance unit: ``torch.Tensor([embedded_guidance] * latents.shape[0])``."""

    def __init__(self) -> None:
        super().__init__()
        self.vae = frozen(nn.Linear(4, 4))
        self.dit = nn.Linear(5, 1)

    def forward(self, pixels):
        latents = self.vae(pixels)
        assert isinstance(latents.shape[0], int) and isinstance(latents.shape, tuple)
        guidance = torch.Tensor([3.5] * latents.shape[0]).to(device=latents.device)
        return self.dit(torch.cat([latents, guidance[:, None]], dim=1)).mean()


@pytest.mark.parametrize("size", [2, 3])
def test_the_legacy_tensor_constructor_takes_a_traced_list(size):
    model = GuidancePerSample()
    split = split_and_verify(model, (batch(size, 4),))
    assert "torch.Tensor(" in split.stage2.code
    assert "__new__" not in vars(torch.Tensor)  # torch's own constructor is back


class LossMadeInForward(nn.Module):
    """Whisper's ``loss_fct = CrossEntropyLoss()`` and a dropout module, made per call."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = frozen(nn.Linear(4, 4))
        self.decoder = nn.Linear(4, 3)
        self.class_weights = torch.tensor([1.0, 2.0, 0.5])

    def forward(self, features, labels):
        hidden = nn.Dropout(p=0.5)(self.decoder(self.encoder(features)))
        loss_fct = nn.CrossEntropyLoss(weight=self.class_weights)
        return loss_fct(hidden, labels)


def test_a_module_created_inside_forward_is_traced_through():
    model = LossMadeInForward()
    split = split_and_verify(model, (batch(3, 4), torch.tensor([0, 2, 1])))
    code = split.stage2.code
    assert "torch.nn.functional.cross_entropy(" in code and "dropout(" in code
    assert param_names(split.stage2, model) == {"decoder.weight", "decoder.bias"}


class ProjectionMadeInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = frozen(nn.Linear(4, 4))

    def forward(self, features):
        projection = nn.Linear(4, 1)
        return projection(self.encoder(features)).mean()


def test_a_module_with_parameters_created_inside_forward_is_refused_naming_the_line():
    model = ProjectionMadeInForward()
    state = torch.get_rng_state()
    with pytest.raises(TraceError) as caught:
        graphsplit.split(model, (batch(3, 4),), path="trace")
    message = str(caught.value)
    assert "Linear that is not a submodule of the model" in message
    assert "holds parameters (weight, ...)" in message
    assert line_of(ProjectionMadeInForward.forward, "projection(self.encoder") in message
    assert "fix:" in message and "(self.name = Linear(...) in __init__;" in message
    assert torch.equal(torch.get_rng_state(), state)  # the user's generator did not move


_COLLECTED: contextvars.ContextVar[list | None] = contextvars.ContextVar("collected", default=None)


def _collect(module, inputs, output):
    collected = _COLLECTED.get()
    if collected is not None:
        collected.append(output)


class CapturesHiddenStates(nn.Module):
    """transformers' output capturing: hooks installed on first call, a flag marks it done."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 6), nn.Linear(6, 8), nn.Linear(8, 10)])

    def forward(self, x):
        if not getattr(self, "_capturing_hooks_installed", False):
            for layer in self.layers:
                layer.register_forward_hook(_collect)
            self._capturing_hooks_installed = True
        token = _COLLECTED.set([])
        try:
            for layer in self.layers:
                x = layer(x)
            hidden_states = tuple(_COLLECTED.get())
        finally:
            _COLLECTED.reset(token)
        return hidden_states[-2]  # the layer before last, as output_hidden_states=-2 selects


class SelectsAHiddenLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tower = frozen(CapturesHiddenStates())
        self.projector = nn.Linear(8, 1)

    def forward(self, x):
        return self.projector(self.tower(x)).mean()


def test_hooks_a_module_installs_while_traced_are_undone_with_its_flag():
    model = SelectsAHiddenLayer()
    split = split_and_verify(model, (batch(3, 4),))
    assert set(split.boundary) == {"tower"}
    # verify() ran the model once: one hook per layer, installed by that eager call.
    assert [len(layer._forward_hooks) for layer in model.tower.layers] == [1, 1, 1]


_MADE_WHILE_TRACED: list[type] = []


class MakesAListSubclass(nn.Module):
    """A list subclass defined while traced (as a module imported lazily by the step would)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        class Rows(list):
            pass

        _MADE_WHILE_TRACED.append(Rows)
        return self.head(x).mean()


def test_a_list_subclass_made_while_traced_behaves_as_a_list_subclass_afterwards():
    _MADE_WHILE_TRACED.clear()
    graphsplit.split(MakesAListSubclass(), (batch(3, 4),))
    rows_type = _MADE_WHILE_TRACED[0]
    rows = rows_type([1, 2])
    assert type(rows) is rows_type and rows == [1, 2]
    assert isinstance(rows, list) and not isinstance([], rows_type)


class RoundsItsSizes(nn.Module):
    """``round()`` and ``divmod()`` of sizes, as patch and window code computes grids
    (``round(h / patch)``, ``rows, rest = divmod(length, window)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = frozen(nn.Linear(4, 4))
        self.head = nn.Linear(4, 4)

    def forward(self, tokens):
        features = self.encoder(tokens)
        grid = round(tokens.shape[1] / 2)
        rows, rest = divmod(tokens.shape[1], 3)
        return self.head(features).square().mean() * grid + rows - rest


def test_round_and_divmod_of_a_size_stay_traced_and_one_plan_serves_every_length():
    step = RoundsItsSizes()
    split = split_and_verify(step, (batch(2, 6, 4),))
    code = split.stage2.code
    assert "round(truediv)" in code and "divmod(" in code, code
    for length in (7, 9, 2):  # round(3.5) = 4 and round(4.5) = 4: Python's rounding, kept
        checks = graphsplit.verify(step, split, (batch(3, length, 4, seed=length),), seed=1)
        assert checks and all(c.ok for c in checks)
    assert len(split.plans) == 1
