"""Stage 2 rebuilds a cached call's ``ModelOutput`` without its constructor: the object must
be the one the constructor makes (type, items in order, every attribute), or be constructed."""

from __future__ import annotations

import pytest
import torch
from transformers.modeling_outputs import (
    BaseModelOutputWithPooling,
    CausalLMOutputWithPast,
    ModelOutput,
)

from graphsplit.calls import model_outputs
from graphsplit.calls.model_outputs import build


def _same(made, want) -> bool:
    return (
        type(made) is type(want)
        and list(made.items()) == list(want.items())
        and all(made[k] is want[k] for k in want)
        and vars(made).keys() == vars(want).keys()
        and all(vars(made)[k] is vars(want)[k] for k in vars(want))
        and made.to_tuple() == want.to_tuple()
    )


t = torch.randn(2, 3)
u = torch.randn(2)


@pytest.mark.parametrize(
    "container, items",
    [
        (CausalLMOutputWithPast, {"logits": t}),
        (CausalLMOutputWithPast, {"loss": u, "logits": t}),
        (CausalLMOutputWithPast, {"logits": t, "hidden_states": (t, t)}),
        (BaseModelOutputWithPooling, {"last_hidden_state": t, "pooler_output": u}),
        (BaseModelOutputWithPooling, {"last_hidden_state": t}),
        (BaseModelOutputWithPooling, {}),
        (BaseModelOutputWithPooling, {"last_hidden_state": (t, u)}),  # the iterator branch
    ],
)
def test_build_makes_what_the_constructor_makes(container, items):
    for _ in range(2):  # the first build is checked against the constructor, the next is not
        made = build(container, items)
        assert _same(made, container(**items))
        assert made[0] is container(**items)[0] if items else len(made) == 0


class Renamed(ModelOutput):
    """A ModelOutput whose ``__post_init__`` does more than copy its fields."""

    first: torch.Tensor | None = None
    second: torch.Tensor | None = None

    def __post_init__(self):
        super().__post_init__()
        self.second = self.first


Renamed = __import__("dataclasses").dataclass(Renamed)


def test_a_class_whose_constructor_does_more_is_always_constructed():
    made = build(Renamed, {"first": t})
    assert model_outputs._CHECKED[Renamed] is None
    assert _same(made, Renamed(first=t)) and made.second is t
    assert _same(build(Renamed, {"first": u}), Renamed(first=u))
