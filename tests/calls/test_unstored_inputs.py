"""Inputs only cached calls compute with are not stored (``calls/unstored_inputs/``).

A diffusion step's ``pixel_values`` reach nothing but the VAE: the cache stores their shape,
stage 2 holds a stand-in on ``meta``. The probe follows everything the step's own code derives
from an input and keeps the input stored wherever stage 2 would need its values: a read that
hands Python a value, a write in place, a random draw, a call that cannot run on ``meta``, a
frozen call stage 2 runs, or a result the step returns. In stage 2 the stand-in raises on the
same reads (a branch the example batch did not take), naming the line; it never computes.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import graphsplit
from graphsplit.calls.unstored_inputs.stand_in import UnstoredInput, stand_in
from graphsplit.errors import SplitError
from tests.helpers import split_and_verify

WIDTH = 4


class Encodes(nn.Module):
    """``loss = head(encoder(prepare(x)))``: ``prepare`` is the step's own code on ``x``."""

    def __init__(self, prepare=None, extra=None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        self.head = nn.Linear(WIDTH, 1)
        self.prepare = prepare or (lambda x: x)
        self.extra = extra

    def forward(self, x):
        z = self.encoder(self.prepare(x))
        loss = self.head(z).square().mean()
        return loss if self.extra is None else loss + self.extra(x)


def _x(rows: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(seed))


def _split(step: nn.Module, x: torch.Tensor | None = None) -> graphsplit.Split:
    return split_and_verify(step, (_x() if x is None else x,), path="calls")


def test_an_input_only_the_cached_call_takes_crosses_as_its_shape():
    split = _split(Encodes(lambda x: x.to(torch.float64).to(torch.float32) * 2))
    assert list(split.boundary) == ["x__shape", "encoder__0__out"]
    assert split.boundary["x__shape"].bytes_per_sample == 2 * 8  # [1, WIDTH] as int64
    crossed = split.stage1(_x())
    assert torch.equal(crossed["x__shape"], torch.tensor([[1, WIDTH]] * 3))
    assert "input 'x' not stored: only cached calls compute with it" in split.report()


def test_another_batch_size_gets_a_stand_in_of_its_own_shape_and_trains_exactly():
    split = _split(Encodes(lambda x: x[:, :2].repeat(1, 2) * x.shape[1]))
    reference = copy.deepcopy(split._model)
    other = _x(5, seed=3)
    loss = split.stage2(**split.stage1(other))
    expected = reference(other)
    loss.backward()
    expected.backward()
    assert torch.equal(loss, expected)
    for param, other_param in zip(split._model.head.parameters(), reference.head.parameters()):
        assert torch.equal(param.grad, other_param.grad)


class Moves(nn.Module):
    """``x.to(accelerator.device)`` and ``.cuda()`` before the frozen call: no values read."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Encodes()

    def forward(self, x):
        return self.inner(x.to(torch.device("cpu")).to("cpu", torch.float32).cpu())


def test_moving_the_input_to_a_device_keeps_it_unstored():
    split = _split(Moves())
    assert "x__shape" in split.boundary and "x" not in split.boundary


def _reads_device_after_type(x):
    """``.type()`` may move (``"torch.cuda.FloatTensor"``): the device is unknown after it."""
    y = x.type(torch.float32)
    return y.to(y.device)


def _branches_on_values(x):
    return x * 2 if (x.abs() >= 0).all() else x


def _writes_in_place(x):
    return x.clone().add_(1)


def _drops(x):
    return F.dropout(x, 0.5, training=True)


def _masks(x):
    return x + 0 * x[x > 0].sum()


@pytest.mark.parametrize(
    ("prepare", "why"),
    [
        (_reads_device_after_type, "reads its .device, which stage 2 cannot answer"),
        (_branches_on_values, "hands its values to Python (__bool__)"),
        (_writes_in_place, "writes into a tensor in place (add_)"),
        (_masks, "cannot run without the values"),
    ],
    ids=["device", "branch", "in-place", "mask"],
)
def test_a_read_stage2_could_not_make_on_a_stand_in_keeps_the_input_stored(prepare, why):
    split = _split(Encodes(prepare))
    assert list(split.boundary) == ["x", "encoder__0__out"]
    report = split.report()
    line = next(line for line in report.splitlines() if line.startswith("note: input 'x' stored"))
    assert why in line
    assert "test_unstored_inputs.py:" in line  # the user's line


def test_a_random_draw_on_the_input_keeps_it_stored():
    """Dropout on ``x`` draws: the call's input is random, so nothing is cached at all."""
    with pytest.raises(SplitError, match="found no frozen module call"):
        graphsplit.split(Encodes(_drops), (_x(),), path="calls")
    step = Encodes(extra=lambda x: F.dropout(x, 0.5, training=True).sum() * 0)
    split = _split(step)
    assert "x" in split.boundary
    assert "draws random numbers (dropout)" in split.report()


def test_an_input_the_loss_computes_with_is_stored():
    split = _split(Encodes(extra=lambda x: x.mean()))
    assert "x" in split.boundary
    assert "input 'x' stored: the step returns a value computed from it" in split.report()


class KeepsARandomCall(nn.Module):
    """A frozen call that draws (never cached) takes ``x`` beside the cached one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        self.noisy = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Dropout(0.5)).requires_grad_(False)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x):
        return self.head(self.encoder(x) + self.noisy(x)).square().mean()


def test_an_input_a_frozen_call_left_in_stage2_takes_is_stored():
    split = _split(KeepsARandomCall())
    assert "x" in split.boundary
    assert "input 'x' stored: noisy call 0, which stage 2 runs, takes it" in split.report()


class Branches(Encodes):
    """Reads ``x``'s values only when ``log`` is set (after the split: a branch not probed)."""

    def __init__(self) -> None:
        super().__init__()
        self.log = False
        self.give_x = False

    def forward(self, x):
        if self.log:
            print(float(x.sum()))  # the stage-2 read
        loss = self.head(self.encoder(x)).square().mean()
        return (loss, x * 1) if self.give_x else loss


def test_stage2_raises_at_a_value_read_the_example_batch_did_not_make():
    step = Branches()
    split = _split(step)
    assert "x" not in split.boundary
    batch = split.stage1(_x())
    step.log = True
    with pytest.raises(SplitError) as caught:
        split.stage2(**batch)
    message = str(caught.value)
    assert "passes a value computed from the input 'x' to a call that hands its values" in message
    assert "print(float(x.sum()))  # the stage-2 read" in message
    assert "the same branches" in message


def test_stage2_refuses_a_result_computed_from_a_stand_in():
    step = Branches()
    split = _split(step)
    batch = split.stage1(_x())
    step.give_x = True
    with pytest.raises(SplitError, match="the step returns a value computed from the input 'x'"):
        split.stage2(**batch)


def test_a_stand_in_gives_stand_ins_and_refuses_every_value_read():
    made = stand_in("pixel_values", (2, 3), torch.float32)
    derived = (made.to(torch.float16)[:, :2] * 3).reshape(4)
    assert isinstance(derived, UnstoredInput) and derived.shape == (4,)
    assert derived.dtype == torch.float16
    assert made.shape == (2, 3) and made.dtype == torch.float32 and made.dim() == 2
    for read in (
        lambda: made.item(),
        lambda: bool(made.sum()),
        lambda: made.tolist(),
        lambda: made.device,
        lambda: made.numpy(),
        lambda: torch.rand_like(made),
        lambda: torch.zeros(2, 3).add_(made),
        lambda: made.mul_(2),
        lambda: made[made > 0],
        lambda: repr(made),
    ):
        with pytest.raises(SplitError, match="'pixel_values'"):
            read()


def test_a_batch_of_another_dtype_or_of_mixed_shapes_is_refused():
    split = _split(Encodes())
    with pytest.raises(SplitError) as caught:
        split.stage1(_x().double())
    assert "the step's input 'x' is a torch.float64 tensor of shape (3, 4) in this batch" in str(
        caught.value
    )
    spec = next(spec for spec in split.plan.inputs if spec.name == "x")
    with pytest.raises(SplitError, match="in different shapes"):
        spec.decode(torch.tensor([[1, 4], [1, 5]]))


def test_a_cache_of_an_unstored_input_holds_its_shape_and_trains_exactly(tmp_path):
    step = Encodes(lambda x: x.to(torch.float32))
    rows = _x(4, seed=5)
    split = _split(step, rows[:2])
    loader = torch.utils.data.DataLoader([{"x": row} for row in rows], batch_size=2)
    graphsplit.cache(split, loader, tmp_path / "cache")
    cached = graphsplit.CachedDataset(tmp_path / "cache")
    assert "x" not in cached[0] and torch.equal(cached[0]["x__shape"], torch.tensor([1, WIDTH]))
    reference = copy.deepcopy(step)
    for first in (0, 2):
        batch = graphsplit.collate([cached[first], cached[first + 1]])
        loss, expected = split.stage2(**batch), reference(rows[first : first + 2])
        loss.backward()
        expected.backward()
        assert torch.equal(loss, expected)
        for param, other in zip(step.head.parameters(), reference.head.parameters()):
            assert torch.equal(param.grad, other.grad)
            param.grad, other.grad = None, None


# -- property: any program of the step's own code on x -------------------------------------
ALLOWED = {
    "to float64 and back": lambda x: x.double().float(),
    "scale": lambda x: x * 3 - 1,
    "reshape": lambda x: x.reshape(x.shape[0], 2, 2).flatten(1),
    "slice and cat": lambda x: torch.cat([x[:, 2:], x[:, :2]], dim=1),
    "clamp": lambda x: x.clamp(-1, 1),
    "shape read": lambda x: x + x.shape[1],
    "device read": lambda x: x.to(x.device),
}
REFUSED = {
    # Each keeps every row a function of its own sample (else nothing is cached at all).
    "item": lambda x: x + 0.0 * x[:1].abs().sum().item(),
    "device after type()": lambda x: x.to(x.type(torch.float32).device),
    "in place": lambda x: x.clone().mul_(2),
    "bool branch": lambda x: x if bool((x.abs() >= 0).all()) else -x,
    "tolist": lambda x: x + 0 * len(x.tolist()),
}


@settings(max_examples=30, deadline=None)
@given(
    ops=st.lists(st.sampled_from(sorted({**ALLOWED, **REFUSED})), min_size=0, max_size=4),
    loss_reads_x=st.booleans(),
)
def test_an_input_is_unstored_exactly_when_only_allowed_code_leads_to_the_cached_call(
    ops, loss_reads_x
):
    table = {**ALLOWED, **REFUSED}

    def prepare(x):
        for op in ops:
            x = table[op](x)
        return x

    step = Encodes(prepare, extra=(lambda x: x.sum() * 0.5) if loss_reads_x else None)
    split = _split(step)  # exact in every case
    unstored = not loss_reads_x and not any(op in REFUSED for op in ops)
    assert ("x__shape" in split.boundary) is unstored
    assert ("x" in split.boundary) is not unstored


def test_diffusers_sd_lora_step_stores_neither_pixels_nor_token_ids(tmp_path):
    """The zoo's SD-1.5 LoRA step (diffusers' ``train_text_to_image_lora.py`` loop body) on the
    module-level path: the pixels reach only the VAE, the token ids only the text encoder."""
    from tests.zoo import CaptionedImages
    from tests.zoo.sd import build_sd_lora_step

    step = build_sd_lora_step(seed=0)
    items = CaptionedImages(length=4, resolution=16)
    loader = torch.utils.data.DataLoader([items[i] for i in range(4)], batch_size=2)
    example = {name: value for name, value in next(iter(loader)).items() if name != "key"}
    split = split_and_verify(step, (), example, path="calls")
    assert {"pixel_values__shape", "input_ids__shape"} <= set(split.boundary)
    assert not {"pixel_values", "input_ids"} & set(split.boundary)
    graphsplit.cache(split, loader, tmp_path / "cache")
    cached = graphsplit.CachedDataset(tmp_path / "cache")
    reference = copy.deepcopy(step)
    for first, batch in zip((0, 2), loader):
        rows = graphsplit.collate([cached[first], cached[first + 1]])  # keeps the latents' layout
        torch.manual_seed(first)
        loss = split.stage2(**rows)
        torch.manual_seed(first)
        expected = reference(pixel_values=batch["pixel_values"], input_ids=batch["input_ids"])
        assert torch.equal(loss, expected)
