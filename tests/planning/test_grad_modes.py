"""Grad mode and autocast switched inside the traced step (planning/rules/grad_modes.py).

torch.fx records no node for a ``with`` block, so stage code runs the step's ops under the
caller's modes. Accepted where that is exact (verified bit for bit against eager), refused
where it is not, with the user's line and the fix in the message.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphsplit
from graphsplit.planning.meta.meta_failures import AUTOCAST_INSIDE_FIX
from graphsplit.planning.rules.grad_modes import (
    AUTOCAST_FIX,
    ENABLE_GRAD_FIX,
    INFERENCE_MODE_FIX,
    NO_GRAD_FIX,
)
from tests.helpers import batch, line_of, split_and_verify, stage1_names

WIDTH = 8


def _xy(size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    return batch(size, WIDTH), batch(size, 1, seed=1)


def _refusal(model: nn.Module, args: tuple) -> str:
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(model, args, path="trace")
    return str(caught.value)


class Encoder(nn.Module):
    """A frozen VAE-like module: ``encode`` is a leaf method."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return torch.tanh(self.linear(x))

    def encode(self, x):
        return self.linear(x).sin()


# -- accepted: no_grad around frozen-only work ----------------------------------------------------
class NoGradAroundFrozenEncoder(nn.Module):
    """The diffusers pattern: ``with torch.no_grad(): latents = vae.encode(x)``."""

    def __init__(self) -> None:
        super().__init__()
        self.vae = Encoder().requires_grad_(False)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x, y):
        with torch.no_grad():
            latents = self.vae.encode(x) * 0.18215
            latents = latents + self.vae(x)
        return F.mse_loss(self.head(latents), y)


def test_no_grad_around_a_frozen_encoder_is_exact():
    split = split_and_verify(NoGradAroundFrozenEncoder(), _xy())
    assert any("vae" in name for name in stage1_names(split))


class FrozenHelpers(nn.Module):
    """Frozen work under grad switches at several depths: the step, a helper function, a
    module without parameters that is traced through, a mixed module traced into."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder().requires_grad_(False)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        with torch.set_grad_enabled(False):
            h = self.encoder(x)
        return self.head(_frozen_features(self.encoder, h))


def _frozen_features(encoder: nn.Module, h: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        h = encoder.encode(h)
    return _NoParameters()(h)  # created here: traced through (it holds no parameters)


class _NoParameters(nn.Module):
    @torch.no_grad()
    def forward(self, h):
        return h.cos() * 2


class Outer(nn.Module):
    """Mixed (a frozen and a trainable child): traced into, since its input is cacheable."""

    def __init__(self) -> None:
        super().__init__()
        self.helpers = FrozenHelpers()
        self.norm = _NoParameters()
        self.proj = nn.Linear(1, 1)

    def forward(self, x, y):
        with torch.no_grad():
            x = self.norm(x) + x.shape[0]
        return F.mse_loss(self.proj(self.helpers(x)), y)


def test_grad_switches_around_frozen_work_at_several_depths_are_exact():
    split = split_and_verify(Outer(), _xy())
    assert any("encoder" in name for name in stage1_names(split))


def test_metadata_of_trainable_work_read_under_no_grad_is_exact():
    class ReadsShape(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(WIDTH, 1)

        def forward(self, x, y):
            out = self.head(x)
            with torch.no_grad():
                rows = out.shape[0]
            return F.mse_loss(out, y) * rows

    split_and_verify(ReadsShape(), _xy())


class EnablesGrad(nn.Module):
    """``torch.enable_grad()`` around trainable work: a no-op under grad mode, a switch under a
    caller's ``no_grad``."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x, y):
        with torch.enable_grad():
            out = self.head(x)
        return F.mse_loss(out, y)


def test_enable_grad_under_grad_enabled_changes_nothing():
    split_and_verify(EnablesGrad(), _xy())


# -- accepted: autocast inside a leaf module's forward ---------------------------------------
class AutocastInside(nn.Module):
    def __init__(self, width_out: int = WIDTH) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, width_out)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.linear(x).float()


class LeavesWithAutocast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = AutocastInside().requires_grad_(False)
        self.trainable = AutocastInside(1)

    def forward(self, x, y):
        return F.mse_loss(self.trainable(self.frozen(x)), y)


def test_autocast_inside_frozen_and_trainable_leaves_is_exact():
    model = LeavesWithAutocast()
    x, y = _xy()
    split = split_and_verify(model, (x, y))
    assert "frozen" in stage1_names(split)
    # The leaves really computed in bfloat16: their plain float32 layer gives other values.
    assert not torch.equal(model.frozen(x), model.frozen.linear(x))


# -- accepted: the caller's modes around split and the stages ------------------------------
class FrozenThenTrainable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder().requires_grad_(False)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x, y):
        return F.mse_loss(self.head(self.encoder(x)).float(), y)


def test_ambient_autocast_around_split_and_stages_is_exact():
    model, args = FrozenThenTrainable(), _xy()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        split = split_and_verify(model, args)
        assert split.stage1.code == graphsplit.split(model, args).stage1.code


def test_ambient_no_grad_around_split_and_stages_is_exact():
    model, (x, y) = FrozenThenTrainable(), _xy()
    with torch.no_grad():
        split = graphsplit.split(model, (x, y))
        loss = split.stage2(**split.stage1(x, y))
        assert torch.equal(loss, model(x, y))
        assert not loss.requires_grad


# -- refused: autocast switched in traced code ---------------------------------------------
class AutocastInTheStep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Encoder().requires_grad_(False)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs = [self.block(x).float() for _ in range(3)]
        return F.mse_loss(self.head(sum(outs)), y)


def test_autocast_in_the_step_is_refused_naming_the_line_and_the_fix():
    message = _refusal(AutocastInTheStep(), _xy())
    assert "switches autocast" in message
    assert "autocast off around graphsplit.split, autocast on (cpu: bfloat16) here" in message
    assert line_of(AutocastInTheStep.forward, "outs = [self.block(x)") in message
    assert AUTOCAST_FIX.words in message


def _in_bfloat16(module: nn.Module, h: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return module(h).float()


class AutocastInAHelper(nn.Module):
    """The autocast is in a function the tracer traces through, not in a leaf's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = Encoder().requires_grad_(False)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x, y):
        return F.mse_loss(self.head(_in_bfloat16(self.frozen, x)), y)


def test_autocast_in_a_function_traced_through_is_refused():
    message = _refusal(AutocastInAHelper(), _xy())
    assert line_of(_in_bfloat16, "return module(h).float()") in message
    assert AUTOCAST_FIX.words in message


def test_autocast_turned_off_under_the_callers_autocast_is_refused():
    class TurnsItOff(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(WIDTH, 1)

        def forward(self, x, y):
            with torch.autocast("cpu", enabled=False):
                out = self.head(x)
            return F.mse_loss(out, y)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        message = _refusal(TurnsItOff(), _xy())
    assert "autocast on (cpu: bfloat16) around graphsplit.split, autocast off here" in message
    assert line_of(TurnsItOff.forward, "out = self.head(x)") in message


# -- refused: grad switched around trainable work ------------------------------------------
class SelfDistillation(nn.Module):
    """A target from the trained model itself: eager gives it no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder().requires_grad_(False)
        self.student = nn.Linear(WIDTH, 1)

    def forward(self, x, y):
        h = self.encoder(x)
        with torch.no_grad():
            target = self.student(h * 0.5)
        return F.mse_loss(self.student(h), target + y)


def test_no_grad_around_trainable_work_is_refused_naming_the_line_and_the_fix():
    message = _refusal(SelfDistillation(), _xy())
    assert "disables gradients" in message
    assert "student.weight" in message
    assert line_of(SelfDistillation.forward, "target = self.student(h * 0.5)") in message
    assert NO_GRAD_FIX.words in message


def test_the_detach_fix_is_exact():
    class Detached(SelfDistillation):
        def forward(self, x, y):
            h = self.encoder(x)
            target = self.student(h * 0.5).detach()
            return F.mse_loss(self.student(h), target + y)

    model, args = Detached(), _xy()
    split_and_verify(model, args)
    eager = SelfDistillation()
    eager.load_state_dict(model.state_dict())
    eager(*args).backward()
    model(*args).backward()
    assert torch.equal(eager.student.weight.grad, model.student.weight.grad)


def test_set_grad_enabled_false_around_trainable_work_is_refused():
    class Switches(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(WIDTH, 1)

        def forward(self, x, y):
            with torch.set_grad_enabled(False):
                target = self.head(x).sigmoid()
            return F.mse_loss(self.head(x), target * y)

    message = _refusal(Switches(), _xy())
    assert "disables gradients" in message
    assert line_of(Switches.forward, "target = self.head(x).sigmoid()") in message
    assert NO_GRAD_FIX.words in message


def test_enable_grad_under_the_callers_no_grad_around_trainable_work_is_refused():
    with torch.no_grad():
        message = _refusal(EnablesGrad(), _xy())
    assert "enables gradients (torch.enable_grad())" in message
    assert line_of(EnablesGrad.forward, "out = self.head(x)") in message
    assert ENABLE_GRAD_FIX.words in message


@pytest.mark.parametrize("frozen_work", [True, False])
def test_inference_mode_in_the_step_is_refused(frozen_work):
    class InferenceMode(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = Encoder().requires_grad_(frozen_work is False)
            self.head = nn.Linear(WIDTH, 1)

        def forward(self, x, y):
            with torch.inference_mode():
                h = self.encoder(x)
            return F.mse_loss(self.head(h.clone()), y)

    message = _refusal(InferenceMode(), _xy())
    assert "enters torch.inference_mode()" in message
    assert line_of(InferenceMode.forward, "h = self.encoder(x)") in message
    assert INFERENCE_MODE_FIX.words in message


def test_a_module_run_under_no_grad_only_is_told_to_be_frozen():
    """A teacher put in eval() but never frozen (the philschmid distillation post's): its
    parameters require grad, yet only no_grad work reads them. .detach() would trace, but the
    teacher would still count as trained and nothing of it be cached: the fix says freeze it."""
    teacher, student = nn.Linear(4, 4).eval(), nn.Linear(4, 4)

    def step(x):
        with torch.no_grad():
            target = teacher(x)
        return (student(x) - target).pow(2).mean()

    with pytest.raises(graphsplit.TraceError) as info:
        graphsplit.split(step, (torch.randn(2, 4),), path="trace")
    fix = str(info.value).split("fix:", 1)[1]
    assert fix.strip().startswith("if teacher is not trained, freeze it before splitting")
    assert "teacher.requires_grad_(False)" in fix and ".detach()" in fix


def test_a_module_also_run_with_gradients_is_told_to_detach():
    """The student's own prediction as a no_grad target (self-distillation): it is trained, so
    the fix is .detach() alone."""
    student = nn.Linear(4, 4)

    def step(x):
        with torch.no_grad():
            target = student(x) * 0.5
        return (student(x) - target).pow(2).mean()

    with pytest.raises(graphsplit.TraceError) as info:
        graphsplit.split(step, (torch.randn(2, 4),), path="trace")
    fix = str(info.value).split("fix:", 1)[1]
    assert "requires_grad_(False)" not in fix and ".detach()" in fix


# -- refused: an autocast entered inside a leaf, on meta ------------------------------------
class PreparedUnet(nn.Module):
    """A trainable module whose ``forward`` accelerate's ``prepare`` wrapped in its autocast."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.forward = torch.autocast("cpu", dtype=torch.bfloat16)(self.forward)

    def forward(self, latents):
        return self.conv(latents)


class Bfloat16VaeThenPreparedUnet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.vae = nn.Conv2d(3, 4, 3, padding=1).to(torch.bfloat16).requires_grad_(False)
        self.unet = PreparedUnet()

    def forward(self, pixels, target):
        latents = self.vae(pixels.to(torch.bfloat16))
        return F.mse_loss(self.unet(latents).float(), target)


def test_a_meta_failure_under_an_autocast_the_step_entered_names_it_and_the_fix():
    step = Bfloat16VaeThenPreparedUnet()
    args = (torch.randn(2, 3, 8, 8), torch.randn(2, 4, 8, 8))
    with pytest.raises(graphsplit.TraceError) as refusal:
        graphsplit.split(step, args, path="trace")
    message = str(refusal.value)
    assert "failed under an autocast (cpu: bfloat16) the step's code entered" in message
    assert "Input type (c10::BFloat16)" in message  # torch's own words, kept
    assert AUTOCAST_INSIDE_FIX.words in message
    assert line_of(Bfloat16VaeThenPreparedUnet.forward, "self.unet(latents)") in message
    split = graphsplit.split(step, args)  # path="auto": the module-level path, exact
    assert "failed under an autocast" in split.reason
    checks = graphsplit.verify(step, split, args)
    assert checks and all(check.ok for check in checks)
