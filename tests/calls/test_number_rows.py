"""A per-sample list of number tuples crosses the module-level boundary (``calls/call_plan.py``).

SDXL's training scripts collate ``batch["original_sizes"]`` and ``batch["crop_top_lefts"]``:
one ``(height, width)`` tuple of ints a sample, which the step turns into ``add_time_ids``. It
varies from batch to batch, so a plan that kept it as a constant of the example refused every
other batch; it now crosses as a ``[B, 2]`` int64 tensor and comes back as the same tuples.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import graphsplit
from graphsplit.calls.call_plan import input_spec

WIDTH = 4


@settings(max_examples=50, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.integers(-(2**40), 2**40), st.integers(-(2**40), 2**40)),
        min_size=1,
        max_size=4,
    ),
    as_lists=st.booleans(),
    outer_tuple=st.booleans(),
)
def test_rows_of_ints_cross_as_a_tensor_and_come_back_exactly(rows, as_lists, outer_tuple):
    value = [list(row) for row in rows] if as_lists else rows
    value = tuple(value) if outer_tuple else value
    spec = input_spec("sizes", value, len(rows))
    assert spec.kind == "rows"
    crossed = spec.crossing(value)["sizes"]
    assert crossed.dtype == torch.int64 and crossed.shape == (len(rows), 2)
    assert spec.decode(crossed) == value
    assert type(spec.decode(crossed)) is type(value)


def test_rows_of_floats_keep_their_values():
    value = [(0.1, 1e-30, 3.0), (2.5, -0.0, 1e300)]
    spec = input_spec("scales", value, 2)
    decoded = spec.decode(spec.crossing(value)["scales"])
    assert decoded == value and all(type(item) is float for row in decoded for item in row)


@pytest.mark.parametrize(
    "value",
    [
        [(1, 2), (3,)],  # ragged
        [(1, 2), [3, 4]],  # tuples and lists mixed
        [(1, 2.0), (3, 4)],  # ints and floats mixed
        [("a", "b"), ("c", "d")],  # not numbers
    ],
)
def test_anything_else_stays_a_constant(value):
    assert input_spec("sizes", value, 2).kind == "constant"


def test_a_table_not_one_row_a_sample_stays_a_constant():
    assert input_spec("table", [(1, 2), (3, 4), (5, 6)], 2).kind == "constant"


class TimeIdsStep(nn.Module):
    """SDXL's use: a frozen encoder on the image, the sizes turned into a tensor per sample."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        self.head = nn.Linear(WIDTH + 2, 1)

    def forward(self, pixels, original_sizes):
        time_ids = torch.cat(
            [torch.tensor([list(size)], dtype=torch.float32) for size in original_sizes]
        )
        return self.head(torch.cat([self.encoder(pixels), time_ids], dim=1)).sum()


def _batch(seed: int, sizes: list[tuple[int, int]]) -> dict:
    pixels = torch.randn(len(sizes), WIDTH, generator=torch.Generator().manual_seed(seed))
    return {"pixels": pixels, "original_sizes": sizes}


def test_another_batchs_sizes_train_exactly_from_stage1(tmp_path):
    step = TimeIdsStep()
    split = graphsplit.split(step, (), _batch(0, [(32, 32), (40, 36)]), path="calls")
    assert split.boundary["original_sizes"].shape == (2, 2)
    other = _batch(1, [(48, 40), (56, 44), (64, 64)])
    assert torch.equal(split.stage2(**split.stage1(**other)), step(**other))
    graphsplit.cache(split, [other], tmp_path / "cache", progress=False)
    data = graphsplit.CachedDataset(tmp_path / "cache", split)
    rows = graphsplit.collate([data[index] for index in range(3)])
    assert torch.equal(split.stage2(**rows), step(**other))


def test_a_row_of_another_width_is_refused_naming_the_input_and_the_fix():
    split = graphsplit.split(TimeIdsStep(), (), _batch(0, [(32, 32), (40, 36)]), path="calls")
    with pytest.raises(graphsplit.SplitError) as caught:
        split.stage1(**_batch(1, [(48, 40, 1), (56, 44, 2)]))
    message = str(caught.value)
    assert (
        "the step's input 'original_sizes' is [(48, 40, 1), (56, 44, 2)] in this batch" in message
    )
    assert "made with 2 ints a sample in a tuple" in message
    assert "give every sample a row of the same width and number type" in message
