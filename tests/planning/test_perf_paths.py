"""The planning's fast paths give what the paths they stand in for give.

``arguments_key`` (one walk of a node's arguments) against ``sameness`` and ``value_key`` (two
walks), on the usual arguments and on every kind the one walk leaves to the two functions;
the tracer's ``create_arg`` by exact type against torch.fx's own ``Tracer.create_arg``.
"""

from __future__ import annotations

import enum
import random
from collections import OrderedDict, namedtuple

import pytest
import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.immutable_collections import immutable_dict, immutable_list

from graphsplit.planning.meta.call_signature import DEPTH, arguments_key, sameness, value_key
from graphsplit.planning.tracing.proxies import PLAIN_ARGUMENTS


def _both(arguments, module=None):
    """``(sameness, value_key)`` of the two functions, or the exception type value_key raised."""
    same = sameness(arguments, module)
    try:
        return same, value_key(arguments, DEPTH)
    except TypeError:
        return TypeError


def _one(arguments, module=None):
    try:
        return arguments_key(arguments, module)
    except TypeError:
        return TypeError


class _Colour(enum.Enum):
    RED = 1


_Pair = namedtuple("_Pair", "a b")


@pytest.fixture(scope="module")
def fakes():
    mode = FakeTensorMode()
    with mode:
        a = torch.empty(4, 8)
        b = torch.empty(2, 3, dtype=torch.float16)
        view = a[1:]
    meta = torch.empty(3, device="meta")
    return a, b, view, meta


def _cases(fakes):
    a, b, view, meta = fakes
    linear = nn.Linear(8, 8, device="meta")
    nested = a
    for _ in range(DEPTH + 2):
        nested = (nested,)
    deep_dict = {"x": a}
    for _ in range(DEPTH):
        deep_dict = {"x": deep_dict}
    return [
        (((a,), {}), None),
        (((a, a, b), {"scale": 0.5, "flag": True}), None),
        (((a, view, meta), {}), None),
        (((linear.weight, a), {}), linear),
        (((a,), {"bias": linear.bias}), linear),
        (((-0.0, 0.0, 1, True, 1.0, "x", None, torch.float32), {}), None),
        (((float("nan"),), {}), None),
        (([a, [b, (a,)]], {"k": {"inner": b}}), None),
        ((nested, {}), None),  # too deep: value_key refuses, the collection stops quietly
        ((deep_dict, {}), None),
        (({1: a, 2.5: b, None: 3}, {}), None),
        (({}, {}), None),
        ((({},), {}), None),
        (((torch.ones(2),), {}), None),  # a real tensor: no key
        ((({a: 1},), {}), None),  # a tensor as a dict key
        (((_Colour.RED, a), {}), None),
        (((_Pair(a, b),), {}), None),  # a named tuple: no key, still collected
        (((OrderedDict(x=a, y=b),), {}), None),
        ((({"s": {1, 2}},), {}), None),
        (((immutable_list([a]),), immutable_dict(x=b)), None),
        (((len, max), {}), None),
    ]


def test_arguments_key_is_sameness_and_value_key(fakes):
    with torch._C.DisableTorchFunction():
        for arguments, module in _cases(fakes):
            assert _one(arguments, module) == _both(arguments, module), arguments


def test_arguments_key_on_random_trees(fakes):
    rng = random.Random(0)
    leaves = [*fakes, 1, 2.0, -0.0, True, "s", None, torch.float16]
    containers = [tuple, list, dict, OrderedDict, immutable_list]

    def tree(depth):
        if depth == 0 or rng.random() < 0.3:
            return rng.choice(leaves)
        kind = rng.choice(containers)
        items = [tree(depth - 1) for _ in range(rng.randrange(4))]
        if kind in (dict, OrderedDict):
            return kind((f"k{i}", item) for i, item in enumerate(items))
        return kind(items)

    with torch._C.DisableTorchFunction():
        for _ in range(500):
            arguments = (tuple(tree(DEPTH + 1) for _ in range(2)), {"kw": tree(3)})
            assert _one(arguments) == _both(arguments), arguments


class _Root(nn.Module):
    def forward(self, x):
        return x


@pytest.mark.parametrize(
    "value",
    [
        (1, 2.5, "a", None, True),
        [1, [2, (3,)]],
        {"a": 1, "b": [None, "c"]},
        immutable_list([1, 2]),
        immutable_dict(a=1),
        7,
        -0.0,
        "text",
        None,
        False,
    ],
)
def test_plain_arguments_are_what_fx_makes_of_them(value):
    tracer = fx.Tracer()
    tracer.root = _Root()
    tracer.graph = fx.Graph(tracer_cls=fx.Tracer)
    tracer.tensor_attrs = {}
    ours = PLAIN_ARGUMENTS[type(value)](tracer, value)
    theirs = fx.Tracer.create_arg(tracer, value)
    assert type(ours) is type(theirs)
    assert ours == theirs
    assert len(tracer.graph.nodes) == 0
