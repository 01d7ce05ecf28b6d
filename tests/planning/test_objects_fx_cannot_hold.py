"""A leaf module handed an object fx cannot record as an argument is traced through.

transformers' decoders make a ``DynamicCache`` when ``use_cache`` is on (the default, also in
training) and hand it to every layer, which appends its keys and values. fx cannot record such
an object as a node argument ("NotImplementedError: argument of type DynamicCache"), so the
planning kept the whole model in stage 2. The layer's call is now traced through; the
object's methods run on the traced values, and the frozen work before it is cached.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graphsplit.planning.patching.traced_values import holds_an_object_fx_cannot_hold
from tests.helpers import batch, split_and_verify


class KeyStore:
    """A cache in the manner of ``DynamicCache``: layers append, later layers read."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []

    def update(self, key: torch.Tensor) -> torch.Tensor:
        self.keys.append(key)
        return torch.cat(self.keys, dim=-1)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.key = nn.Linear(4, 4).requires_grad_(False)
        self.out = nn.Linear(4 * 2, 4)

    def forward(self, x, store: KeyStore):
        keys = store.update(self.key(x))
        return self.out(torch.cat([keys[..., -4:], x], dim=-1))


class HandsAStoreToEachLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4).requires_grad_(False)
        self.layers = nn.ModuleList([Layer(), Layer()])

    def forward(self, x):
        store = KeyStore()  # made per step, as the decoder makes its cache
        hidden = self.embed(x)
        for layer in self.layers:
            hidden = layer(hidden, store=store)
        return hidden.square().mean()


def test_a_layer_handed_a_store_is_traced_through_and_its_frozen_work_cached():
    torch.manual_seed(0)
    step = HandsAStoreToEachLayer()
    split = split_and_verify(step, (batch(3, 4),), path="trace")
    assert "embed" in split.boundary
    assert "layers_0_key" in split.boundary  # the first layer's frozen key projection
    assert not split.notes


@pytest.mark.parametrize(
    ("value", "refused"),
    [
        ((1, "a", None, torch.float32, slice(0, 2), ...), False),
        ({"x": [torch.zeros(1), nn.Linear(1, 1)]}, False),
        ((KeyStore(),), True),
        ({"past_key_values": KeyStore()}, True),
        ((len,), False),
    ],
)
def test_what_fx_cannot_hold(value, refused):
    assert holds_an_object_fx_cannot_hold(value) is refused


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.key = nn.Linear(4, 4)

    def encode(self, x, store: KeyStore):
        return store.update(self.key(x))


class CallsALeafMethodWithAStore(nn.Module):
    """A frozen leaf's own method (recorded as one node otherwise) handed the store."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder().requires_grad_(False)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.encoder.encode(x, KeyStore())).mean()


def test_a_leaf_method_handed_a_store_is_traced_through():
    torch.manual_seed(0)
    split = split_and_verify(CallsALeafMethodWithAStore(), (batch(2, 4),), path="trace")
    assert "encoder" not in {name.split(".")[0] for name, _ in split.stage2.named_modules()}
