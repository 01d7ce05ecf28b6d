"""A size guard that compares a batch size with a frozen weight's size (CLIP's
``if seq_length > max_position_embedding``) is rechecked with the weight's size as a number,
even where no stage holds the weight (see graphsplit/planning/rules/weight_sizes.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphsplit
from graphsplit.errors import SplitError
from tests.helpers import split_and_verify


class TrainedTokensFrozenPositions(nn.Module):
    """CLIPTextEmbeddings as textual inversion trains it: the token table trains, the position
    table is frozen, and the length is checked against the position table's rows."""

    def __init__(self) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(20, 8)
        self.position_embedding = nn.Embedding(12, 8).requires_grad_(False)
        self.register_buffer("position_ids", torch.arange(12)[None], persistent=False)
        self.head = nn.Linear(8, 1)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq_length = input_ids.shape[-1]
        max_position_embedding = self.position_embedding.weight.shape[0]
        if seq_length > max_position_embedding:
            raise ValueError("Sequence length must be less than max_position_embeddings")
        position_ids = self.position_ids[:, :seq_length]
        hidden = self.token_embedding(input_ids) + self.position_embedding(position_ids)
        return self.head(hidden).mean()


def _ids(size: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 20, (size, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("size", [1, 2, 3])
def test_the_length_check_against_a_frozen_table_nobody_holds_is_rechecked(size):
    model = TrainedTokensFrozenPositions()
    split = split_and_verify(model, (_ids(size, 6),))
    # The frozen positions are cached, so stage 2 holds no position table: the weight's size
    # is written as the number it is into stage 2's recheck.
    assert "position_embedding" not in {name for name, _ in split.stage2.named_modules()}
    assert "> 12" in split.stage2.code
    other = _ids(size, 9, seed=1)
    assert torch.equal(split.stage2(**split.stage1(other)), model(other))


def test_a_batch_past_the_table_still_stops_with_the_users_line():
    model = TrainedTokensFrozenPositions()
    split = graphsplit.split(model, (_ids(2, 6),))
    split.plan_set.max_plans = 1  # another length is refused, not given a plan of its own
    with pytest.raises(SplitError) as caught:
        split.stage2(**split.stage1(_ids(2, 9, seed=1)))
    assert "this plan was made for input_ids.shape[-1] = 6, got 9" in str(caught.value)
