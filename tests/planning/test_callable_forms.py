"""Steps that reach their models through defaults, ``functools.partial`` or a plain trainer.

Training scripts bind their models in more ways than closures and globals: ``def step(batch,
unet=unet)``, ``functools.partial(step, unet=unet)`` (also over a trainer's method), and a
trainer object (not a module) whose method reads ``self.unet``. Each must find the same module
objects (so the user's optimizer trains stage 2), name them as the code does, and reproduce the
step bit for bit at every batch size.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import graphsplit
from tests.helpers import batch, frozen, split_and_verify
from tests.zoo import CaptionedImages, build_sd_lora_step

SIZES = pytest.mark.parametrize("size", [1, 2, 3])


def _models(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    return frozen(nn.Linear(8, 4)), nn.Linear(4, 1)


def _xy(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return batch(size, 8, seed=size), batch(size, 1, seed=size + 10)


def _same_on_another_batch(split: graphsplit.Split, step, size: int) -> None:
    """The stages, split at one batch size, give the step's own loss at another."""
    x, y = _xy(size + 2)
    assert torch.equal(split.stage2(**split.stage1(x=x, y=y)), step(x=x, y=y))


def _trainable_keys(split: graphsplit.Split) -> set[str]:
    return set(split.stage2.state_dict())


# -- default arguments ---------------------------------------------------------------------------
@SIZES
def test_modules_in_default_arguments_are_named_after_the_parameter(size):
    encoder, head = _models(1)

    def training_step(x, y, frozen=encoder, head=head):
        return F.mse_loss(head(frozen(x)), y)

    split = split_and_verify(training_step, _xy(size))
    assert split.stage1.frozen is encoder and split.stage2.head is head
    assert _trainable_keys(split) == {"head.weight", "head.bias"}
    assert split.input_names == ("x", "y")  # a default left to itself is not a batch input
    _same_on_another_batch(split, training_step, size)


def test_a_module_passed_for_a_defaulted_parameter_wins_over_the_default():
    encoder, head = _models(2)
    _, other_head = _models(3)

    def training_step(x, y, frozen=encoder, head=head):
        return F.mse_loss(head(frozen(x)), y)

    split = split_and_verify(training_step, _xy(2), {"head": other_head})
    assert split.stage2.head is other_head
    assert not any(p is head.weight for p in split.stage2.parameters())


ENCODER, HEAD = _models(4)


def _encode(x, encoder=ENCODER):  # a helper beside the step: its defaults are reached too
    return encoder(x)


def helper_step(x, y):
    return F.mse_loss(HEAD(_encode(x)), y)


def test_defaults_of_a_helper_function_beside_the_step_are_reached():
    split = split_and_verify(helper_step, _xy(2))
    assert split.stage1.encoder is ENCODER and split.stage2.HEAD is HEAD


# -- functools.partial ---------------------------------------------------------------------------
def _loss(frozen, head, x, y, weight=1.0):
    return F.mse_loss(head(frozen(x)), y) * weight


@SIZES
@pytest.mark.parametrize("how", ["keywords", "positions"])
def test_a_partial_binding_the_models_names_them_after_the_parameters(size, how):
    encoder, head = _models(5)
    if how == "keywords":
        step = functools.partial(_loss, frozen=encoder, head=head)
    else:
        step = functools.partial(_loss, encoder, head)
    split = split_and_verify(step, (), dict(zip("xy", _xy(size))))
    assert split.stage1.frozen is encoder and split.stage2.head is head
    assert _trainable_keys(split) == {"head.weight", "head.bias"}
    assert split.input_names == ("x", "y")
    _same_on_another_batch(split, step, size)


def test_a_partial_of_a_partial_keeps_the_outer_keyword():
    encoder, head = _models(6)
    _, outer_head = _models(7)
    step = functools.partial(functools.partial(_loss, encoder, head=head), head=outer_head)
    split = split_and_verify(step, (), dict(zip("xy", _xy(2))))
    assert split.stage2.head is outer_head


def test_a_tensor_a_partial_binds_is_a_constant_of_the_stages():
    # Per-dataset constants (class weights) bound once: the same tensor for every batch.
    encoder, head = _models(8)
    weight = torch.tensor([0.5])
    step = functools.partial(_loss, encoder, head, weight=weight)
    split = split_and_verify(step, _xy(2))
    assert split.input_names == ("x", "y")
    _same_on_another_batch(split, step, 2)


def test_a_partial_binding_what_the_function_does_not_take_is_refused_by_name():
    encoder, head = _models(9)
    step = functools.partial(_loss, encoder, head, scale=2.0)
    with pytest.raises(graphsplit.SplitError) as caught:
        graphsplit.split(step, _xy(2))
    message = str(caught.value)
    assert "functools.partial(_loss (" in message and "'scale'" in message
    assert "fix:    bind only the function's own parameters in the partial" in message


class Step(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.head = _models(10)

    def forward(self, x, y, weight):
        return F.mse_loss(self.head(self.encoder(x)), y) * weight


def test_a_partial_of_a_module_splits_its_forward():
    model = Step()
    split = split_and_verify(functools.partial(model, weight=2.0), _xy(2))
    assert _trainable_keys(split) == {"head.weight", "head.bias"}
    assert split.stage2.head is model.head


# -- bound methods of plain objects --------------------------------------------------------------
class Trainer:
    """A trainer (not a module) holding its models; ``_teacher`` is private, as trainers keep."""

    def __init__(self, weight: float = 1.0) -> None:
        self._teacher, self.head = _models(11)
        self.weight = weight

    def compute_loss(self, x, y):
        return F.mse_loss(self.head(self._teacher(x)), y) * self.weight


class SlottedTrainer:
    __slots__ = ("encoder", "head")

    def __init__(self) -> None:
        self.encoder, self.head = _models(12)

    def compute_loss(self, x, y):
        return F.mse_loss(self.head(self.encoder(x)), y)


class ClassLevelTrainer:
    encoder, head = _models(13)  # set once on the class, shared by every instance

    def compute_loss(self, x, y):
        return F.mse_loss(self.head(self.encoder(x)), y)


def _method(owner, partial: bool = False):
    return owner, functools.partial(owner.compute_loss) if partial else owner.compute_loss


@SIZES
@pytest.mark.parametrize(
    ("make", "frozen_name"),
    [
        (lambda: _method(Trainer()), "_teacher"),
        (lambda: _method(Trainer(), partial=True), "_teacher"),
        (lambda: _method(SlottedTrainer()), "encoder"),
        (lambda: _method(ClassLevelTrainer()), "encoder"),
    ],
    ids=["private-attribute", "partial-of-the-method", "slots", "class-attribute"],
)
def test_a_plain_trainers_method_names_modules_by_attribute(size, make, frozen_name):
    owner, step = make()
    split = split_and_verify(step, _xy(size))
    assert split.stage2.head is owner.head
    assert getattr(split.stage1, frozen_name) is getattr(owner, frozen_name)
    assert _trainable_keys(split) == {"head.weight", "head.bias"}
    _same_on_another_batch(split, step, size)


def test_a_partial_keyword_over_a_trainers_method_is_a_step_argument_not_a_batch_input():
    trainer = Trainer()
    step = functools.partial(trainer.compute_loss, y=_xy(2)[1])
    split = split_and_verify(step, (_xy(2)[0],))
    assert split.input_names == ("x",) and split.stage2.head is trainer.head


# -- a real step: the tiny Stable-Diffusion LoRA (tests/zoo) ------------------------------------
def sd_loss(batch, vae, text_encoder, unet, scheduler):
    latents = vae.encode(batch["pixel_values"]).latent_dist.sample() * vae.config.scaling_factor
    states = text_encoder(batch["input_ids"])[0]
    noise = torch.randn_like(latents)
    steps = scheduler.config.num_train_timesteps
    timesteps = torch.randint(0, steps, (latents.shape[0],), device=latents.device)
    pred = unet(scheduler.add_noise(latents, noise, timesteps), timesteps, states).sample
    return F.mse_loss(pred.float(), noise.float())


class SDTrainer:
    """A trainer object holding the diffusers models, as kohya-style scripts do."""

    def __init__(self, parts) -> None:
        self.vae, self.text_encoder, self.unet = parts.vae, parts.text_encoder, parts.unet
        self.noise_scheduler = parts.scheduler

    def training_step(self, batch):
        return sd_loss(batch, self.vae, self.text_encoder, self.unet, self.noise_scheduler)


def _sd_step(form: str, parts):
    models = {
        "vae": parts.vae,
        "text_encoder": parts.text_encoder,
        "unet": parts.unet,
        "scheduler": parts.scheduler,
    }
    if form == "defaults":

        def training_step(
            batch,
            vae=parts.vae,
            text_encoder=parts.text_encoder,
            unet=parts.unet,
            scheduler=parts.scheduler,
        ):
            return sd_loss(batch, vae, text_encoder, unet, scheduler)

        return training_step
    if form == "partial":
        return functools.partial(sd_loss, **models)
    if form == "trainer":
        return SDTrainer(parts).training_step
    return functools.partial(lambda trainer, batch: trainer.training_step(batch), SDTrainer(parts))


@SIZES
@pytest.mark.parametrize("form", ["defaults", "partial", "trainer", "partial-of-a-lambda"])
def test_the_sd_lora_step_splits_bit_for_bit_in_every_form(form, size):
    parts = build_sd_lora_step(seed=0)
    step = _sd_step(form, parts)
    example = next(iter(DataLoader(CaptionedImages(length=size), batch_size=size)))
    del example["key"]
    split = split_and_verify(step, (example,))
    if form == "partial-of-a-lambda":  # the trainer is an argument: its attributes' names
        assert split.stage2.trainer.unet is parts.unet
        assert all(key.startswith("trainer.unet.") for key in split.stage2.state_dict())
        return
    assert split.stage2.unet is parts.unet  # the script's optimizer trains stage 2
    assert all(key.startswith("unet.") for key in split.stage2.state_dict())
    assert split.input_names == ("pixel_values", "input_ids")
    assert list(split.boundary) == ["vae_encode_latent_dist_parameters", "text_encoder_0"]


def test_modules_under_a_name_nn_module_uses_itself_are_refused_with_the_fix():
    # The step module is an nn.Module: it cannot hold a child called "modules" or "half".
    encoder, head = _models(14)
    modules = {"encoder": encoder, "head": head}

    def training_step(x, y):
        return F.mse_loss(modules["head"](modules["encoder"](x)), y)

    with pytest.raises(graphsplit.SplitError) as caught:
        graphsplit.split(training_step, _xy(2))
    message = str(caught.value)
    assert "reaches modules through the name 'modules', which torch.nn.Module uses" in message
    assert "fix:    rename 'modules' in the step's code (e.g. my_modules)" in message
