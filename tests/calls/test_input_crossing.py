"""How a step's non-tensor inputs cross the module-level boundary (``calls/call_plan.py``).

A webdataset batch is ``(image, text)``: the image a batched tensor, the text one caption a
sample that the step tokenizes itself. Both cross (the captions as code points) and stage 2
gets back the very strings, so a batch other than the example trains as the step would.
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
@given(texts=st.lists(st.text(), min_size=1, max_size=4), as_tuple=st.booleans())
def test_strings_cross_as_code_points_and_come_back_exactly(texts, as_tuple):
    value = tuple(texts) if as_tuple else texts
    spec = input_spec("text", value, len(texts))
    assert spec.kind == "strings"
    crossed = spec.crossing(value)["text"]
    assert crossed.dtype == torch.int32 and crossed.shape[0] == len(texts)
    assert spec.decode(crossed) == value


def test_a_fixed_list_of_strings_not_one_a_sample_stays_a_constant():
    spec = input_spec("templates", ["a photo of {}", "a drawing of {}", "art"], 2)
    assert spec.kind == "constant"


class CaptionStep(nn.Module):
    """Encodes the image (frozen), scores each caption's length with a trainable head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, batch):
        image, text = batch
        lengths = torch.tensor([float(len(caption)) for caption in text])
        return (self.head(self.encoder(image)).squeeze(1) * lengths).sum()


def _batch(seed: int, texts: list[str]) -> tuple[torch.Tensor, list[str]]:
    return (torch.randn(len(texts), WIDTH, generator=torch.Generator().manual_seed(seed)), texts)


def test_an_image_text_tuple_crosses_item_by_item_and_another_batch_trains_exactly():
    step = CaptionStep()
    split = graphsplit.split(step, (_batch(0, ["a red circle", "é ✓"]),), path="calls")
    assert {"batch__0", "batch__1", "encoder__0__out"} <= set(split.boundary)
    other = _batch(1, ["a much longer caption than before", ""])
    crossed = split.stage1(other)
    assert torch.equal(split.stage2(**crossed), step(other))


def test_the_captions_item_of_a_tuple_is_padded_text_and_the_image_is_not():
    """Its boundary spec's ``pad_dim`` marks the code points (zeros past each string's end),
    so a cache batches rows of other caption widths; the image's rows are batched as they are."""
    split = graphsplit.split(CaptionStep(), (_batch(0, ["a", "bcd"]),), path="calls")
    assert split.boundary["batch__1"].pad_dim == 1
    assert split.boundary["batch__0"].pad_dim is None
    assert split.boundary["encoder__0__out"].pad_dim is None


def test_a_batch_in_another_structure_than_the_example_is_named():
    split = graphsplit.split(CaptionStep(), (_batch(0, ["a", "b"]),), path="calls")
    image, text = _batch(1, ["c", "d"])
    with pytest.raises(graphsplit.SplitError) as caught:
        split.stage1([image, text, text])
    message = str(caught.value)
    assert (
        "the step's input 'batch' is a list of 3 items in this batch; the module-level plan "
        "was made with a tuple of 2."
    ) in message
    assert "pass every batch in the same structure as the example batch" in message


def test_a_constant_list_of_tensors_is_compared_tensor_by_tensor():
    """diffusers' DreamBooth collate keeps the prompts' attention masks as a list of tensors;
    held as a constant of the plan, a batch with equal masks passes (a list's ``==`` compares
    tensors elementwise, which has no truth value) and one with another mask is refused."""
    masks = [torch.tensor([[1, 1, 0]]), torch.tensor([[1, 0, 0]])]
    spec = input_spec("attention_mask", masks, 3)
    assert spec.kind == "constant"
    spec.encode([mask.clone() for mask in masks])  # equal: no refusal
    with pytest.raises(graphsplit.SplitError, match="the step's input 'attention_mask' is"):
        spec.encode([masks[0], torch.tensor([[1, 1, 1]])])
    with pytest.raises(graphsplit.SplitError, match="a non-tensor input is a constant"):
        spec.encode((masks[0], masks[1]))
