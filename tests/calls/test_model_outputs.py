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

from graphsplit import SplitError
from graphsplit.calls import model_outputs
from graphsplit.calls.model_outputs import build
from graphsplit.calls.outputs import Structure, answerer, rebuild


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


@pytest.mark.parametrize(
    "container, items",
    [
        (CausalLMOutputWithPast, {"logits": t}),
        (CausalLMOutputWithPast, {"logits": t, "loss": u}),  # given out of field order
        (BaseModelOutputWithPooling, {"pooler_output": u}),  # the first field not given
        (Renamed, {"first": t}),  # always constructed
    ],
)
def test_a_maker_makes_what_the_constructor_makes_on_every_call(container, items):
    make = model_outputs.maker(container, tuple(items))
    for scale in (1.0, 2.0, 3.0):  # the first call builds and checks, the later ones fill
        values = {name: value * scale for name, value in items.items()}
        made = make[0](tuple(values.values()))
        assert _same(made, container(**values))


def test_an_answer_with_left_out_fields_is_the_rebuilt_output_on_every_call():
    structure = Structure(
        "mapping", CausalLMOutputWithPast, ("logits",), (Structure("tensor"),), ("loss", "cache")
    )
    answer = answerer(structure, {"logits": "teacher__0__logits"}, "teacher call 0")
    for _ in range(3):
        logits = torch.randn(2, 3)
        made = answer({"teacher__0__logits": logits})
        want = rebuild(structure, {"logits": logits}, label="teacher call 0")
        assert type(made) is type(want) and type(made).__mro__[1] is CausalLMOutputWithPast
        assert made.logits is logits and made["logits"] is logits
        with pytest.raises(SplitError) as caught:
            made.loss  # noqa: B018 (the read is the test)
        assert "left out ['loss', 'cache']" in str(caught.value) and "fix:" in str(caught.value)


def test_a_lone_tensor_and_a_tuple_are_answered_as_rebuilt():
    assert answerer(Structure("tensor"), {"out": "k"}, "m call 0")({"k": t}) is t
    pair = Structure("tuple", tuple, (), (Structure("tensor"), Structure("none")))
    made = answerer(pair, {"0": "a"}, "m call 0")({"a": u})
    assert type(made) is tuple and len(made) == 2 and made[0] is u and made[1] is None
