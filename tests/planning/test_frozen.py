"""Every form of ``frozen=`` (``planning.frozen``) gives the same plan."""

from __future__ import annotations

import pytest
from torch import nn

from tests.helpers import (
    batch,
    boundary_summary,
    param_names,
    split_and_verify,
)


# -- the forms of frozen= -----------------------------------------------------------------------
class TwoEncoders(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.image_encoder = nn.Linear(4, 4)
        self.text_encoder = nn.Linear(3, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, pixels, ids):
        return self.head(self.image_encoder(pixels) * self.text_encoder(ids)).mean()


FROZEN_FORMS = {
    "modules": lambda model: [model.image_encoder, model.text_encoder],
    "prefixes": lambda model: ["image_encoder", "text_encoder."],
    "predicate": lambda model: lambda name, param: "encoder" in name,
    "requires_grad": None,
}


@pytest.mark.parametrize("form", sorted(FROZEN_FORMS))
def test_frozen_forms_give_the_same_plan(form):
    model = TwoEncoders()
    if form == "requires_grad":
        model.image_encoder.requires_grad_(False)
        model.text_encoder.requires_grad_(False)
        frozen_arg = None
    else:
        frozen_arg = FROZEN_FORMS[form](model)
    split = split_and_verify(model, (batch(3, 4), batch(3, 3, seed=1)), frozen=frozen_arg)
    assert split.trainable == {"head.weight", "head.bias"}
    assert boundary_summary(split) == {"mul": ((3, 4), 0, 16)}
    assert param_names(split.stage2, model) == {"head.weight", "head.bias"}
    assert len(param_names(split.stage1, model)) == 4


def test_default_frozen_with_everything_trainable_caches_only_the_inputs():
    model = TwoEncoders()
    split = split_and_verify(model, (batch(3, 4), batch(3, 3, seed=1)))
    assert list(split.boundary) == ["pixels", "ids"]
    assert param_names(split.stage1, model) == set()
