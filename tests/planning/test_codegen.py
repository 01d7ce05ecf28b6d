"""The generated stages return what the step returned, in the same structure."""

from __future__ import annotations

import torch
from torch import nn

from tests.helpers import (
    batch,
    boundary_summary,
    frozen,
    split_and_verify,
)


# -- outputs -----------------------------------------------------------------------------------
class TupleOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = frozen(nn.Linear(4, 4))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        features = self.encoder(x)
        prediction = self.head(features)
        return prediction.pow(2).mean(), prediction, features


class DictOutput(TupleOutput):
    def forward(self, x):
        features = self.encoder(x)
        prediction = self.head(features)
        return {"loss": prediction.pow(2).mean(), "prediction": prediction, "features": features}


def test_tuple_output_is_returned_as_a_tuple():
    model = TupleOutput()
    x = batch(3, 4)
    split = split_and_verify(model, (x,))
    assert boundary_summary(split) == {"encoder": ((3, 4), 0, 16)}
    out = split.stage2(**split.stage1(x))
    assert isinstance(out, tuple) and len(out) == 3
    assert torch.equal(out[2], model.encoder(x))


def test_dict_output_is_returned_as_a_dict():
    model = DictOutput()
    x = batch(3, 4)
    split = split_and_verify(model, (x,))
    assert boundary_summary(split) == {"encoder": ((3, 4), 0, 16)}
    out = split.stage2(**split.stage1(x))
    assert isinstance(out, dict) and list(out) == ["loss", "prediction", "features"]
    assert torch.equal(out["features"], model.encoder(x))
