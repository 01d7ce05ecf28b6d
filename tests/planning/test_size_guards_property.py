"""Never silently wrong at another size (issue 25, item 1): a property test (hypothesis).

Each generated step uses its tensors' sizes the ways real steps do: a comparison, ``%``,
``bool()``, float division, a tuple of sizes, a size as a dict key, a size in a string given to
a module, ``int()`` of size arithmetic; some inside the frozen part (stage 1), some inside the
trainable part (stage 2). Split at one width and run at others, the plan gives exactly the
unsplit step's loss (bit for bit) or stops with a ``SplitError`` naming the user's line, at
split time or run time; never another number.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import graphsplit
from graphsplit.errors import SplitError
from tests.helpers import frozen, line_of

KINDS = ("mod", "compare", "bool", "float", "divide", "tuple", "key", "text", "int")
WIDTHS = (16, 17, 24, 25)


class Tagger(nn.Module):
    """A frozen module that reads a number out of the string it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()), requires_grad=False)

    def forward(self, x: torch.Tensor, tag: str) -> torch.Tensor:
        return x * self.scale * int(tag.removeprefix("w")) / 16


class SizeStep(nn.Module):
    """A frozen encoder, then ``uses`` on its output; a trainable head, then more ``uses``."""

    def __init__(self, frozen_uses: tuple[str, ...], trainable_uses: tuple[str, ...]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = frozen(nn.Conv2d(3, 4, 1))
        self.head = nn.Conv2d(4, 4, 1)
        self.tagger = frozen(Tagger())
        self.frozen_uses, self.trainable_uses = frozen_uses, trainable_uses

    def use(self, kind: str, t: torch.Tensor) -> torch.Tensor:
        if kind == "mod":
            if t.shape[-1] % 8 != 0:
                t = F.pad(t, (0, 1))
        elif kind == "compare":
            if t.shape[-1] > 20:
                t = t * 2
        elif kind == "bool":
            if bool(t.shape[-1] - 16):
                t = t + 1
        elif kind == "float":
            t = t * (float(t.shape[-1]) / 16)
        elif kind == "divide":
            t = t * (t.shape[-1] / 16)
        elif kind == "tuple":
            sizes = tuple(t.shape)
            t = t.reshape(sizes[0], -1).reshape(sizes) + sizes[-1]
        elif kind == "key":
            t = t * {16: 1.0, 17: 2.0, 24: 3.0, 25: 4.0, 18: 5.0, 26: 6.0}[t.shape[-1]]
        elif kind == "text":
            t = self.tagger(t, f"w{t.shape[-1]}")
        elif kind == "int":
            n = int(t.shape[-1] * 1.5)
            t = t[..., : n // 2]
        return t

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        h = self.encoder(pixels)
        for kind in self.frozen_uses:
            h = self.use(kind, h)
        g = self.head(h)
        for kind in self.trainable_uses:
            g = self.use(kind, g)
        return g.float().pow(2).mean()


def _use_lines() -> set[str]:
    """``file:line`` of each statement of :meth:`SizeStep.use` an error may name."""
    texts = [
        "if t.shape[-1] % 8 != 0:",
        "if t.shape[-1] > 20:",
        "if bool(t.shape[-1] - 16):",
        "t = t * (float(t.shape[-1]) / 16)",
        "{16: 1.0, 17: 2.0",
        't = self.tagger(t, f"w{t.shape[-1]}")',
        "n = int(t.shape[-1] * 1.5)",
    ]
    return {line_of(SizeStep.use, text) for text in texts}


def _pixels(width: int) -> torch.Tensor:
    return torch.randn(2, 3, 8, width, generator=torch.Generator().manual_seed(width))


def _names_a_use_line(error: SplitError) -> bool:
    message = str(error)
    return any(f"{line}  " in message for line in _use_lines()) and "fix:" in message


uses = st.lists(st.sampled_from(KINDS), max_size=2).map(tuple)


@settings(
    max_examples=20,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(frozen_uses=uses, trainable_uses=uses, split_width=st.sampled_from(WIDTHS))
def test_a_plan_at_another_size_is_exact_or_names_the_line(
    frozen_uses, trainable_uses, split_width
):
    model = SizeStep(frozen_uses, trainable_uses)
    try:
        split = graphsplit.split(model, (_pixels(split_width),))
    except SplitError as error:  # refused at split time: a size used as a dict key
        assert "key" in frozen_uses + trainable_uses and _names_a_use_line(error), str(error)
        return
    for width in WIDTHS:
        pixels = _pixels(width)
        with torch.no_grad():
            expected = model(pixels)
            try:
                got = split.stage2(**split.stage1(pixels))
            except SplitError as error:
                assert width != split_width and _names_a_use_line(error), str(error)
                continue
        assert torch.equal(got, expected), (width, got.item(), expected.item())


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("mod", "made for (encoder.shape[-1] % 8) != 0 = False, got True"),
        ("compare", "made for encoder.shape[-1] > 20 = False, got True"),
        ("bool", "made for bool(encoder.shape[-1] - 16) = False, got True"),
        ("float", "made for float(encoder.shape[-1]) = 16.0, got 25.0"),
        ("text", "made for f'{encoder.shape[-1]}' = '16', got '25'"),
        ("int", "made for int(encoder.shape[-1] * 1.5) = 24, got 37"),
    ],
)
def test_each_reading_of_a_size_stops_stage_1_at_another_size(kind, message):
    model = SizeStep((kind,), ())
    split = graphsplit.split(model, (_pixels(16),), max_plans=1)
    assert "graphsplit_runtime_check_size_read(" in split.stage1.code
    with pytest.raises(SplitError) as caught:
        split.stage1(_pixels(25))
    assert message in str(caught.value)
    assert "max_plans=1" in str(caught.value)
    assert _names_a_use_line(caught.value)


@pytest.mark.parametrize("kind", ["mod", "compare", "float", "int"])
def test_a_reading_in_the_trainable_part_is_checked_by_stage_2(kind):
    model = SizeStep((), (kind,))
    split = graphsplit.split(model, (_pixels(16),), max_plans=1)
    assert "graphsplit_runtime_check_size_read(" in split.stage2.code
    with pytest.raises(SplitError, match="max_plans=1") as caught:
        split.stage2(**split.stage1(_pixels(25)))
    assert _names_a_use_line(caught.value)


def test_a_size_as_a_dict_key_is_refused_at_split_time_at_its_line():
    with pytest.raises(SplitError) as caught:
        graphsplit.split(SizeStep(("key",), ()), (_pixels(16),), path="trace")
    message = str(caught.value)
    assert f"{line_of(SizeStep.use, '{16: 1.0, 17: 2.0')}  " in message
    assert "Python dict" in message and "fix:" in message


def test_sizes_that_only_flow_through_torch_ops_get_no_check():
    model = SizeStep(("divide", "tuple"), ("divide", "tuple"))
    split = graphsplit.split(model, (_pixels(16),))
    assert "check_size" not in split.stage1.code + split.stage2.code
    for width in WIDTHS:
        with torch.no_grad():
            assert torch.equal(split.stage2(**split.stage1(_pixels(width))), model(_pixels(width)))


def test_a_size_text_kept_in_python_is_not_checked():
    """A size's text used only as a Python cache key changes nothing the plan computes."""

    class Cached(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = frozen(nn.Conv2d(3, 4, 1))
            self.head = nn.Conv2d(4, 4, 1)
            self.cache: dict[str, torch.Tensor] = {}

        def forward(self, pixels):
            h = self.encoder(pixels)
            key = f"{h.shape[-1]}"
            if key not in self.cache:
                self.cache[key] = torch.ones(h.shape[-1])
            return (self.head(h) * self.cache.pop(key)).mean()

    model = Cached()
    split = graphsplit.split(model, (_pixels(16),))
    # The text is not checked. The width itself is (check_size, not check_size_read): the
    # per-dataset constant torch.ones(width) crosses the boundary, and a cache stores one
    # constant per plan (planning/rules/constant_sizes.py), so width 24 gets a plan of its own.
    assert "check_size_read" not in split.stage1.code + split.stage2.code
    with torch.no_grad():
        assert torch.equal(split.stage2(**split.stage1(_pixels(24))), model(_pixels(24)))


def test_this_file_names_its_own_lines():
    assert all(line.startswith(Path(__file__).name) for line in _use_lines())
