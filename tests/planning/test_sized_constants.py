"""A per-dataset constant made from the padded length is recomputed in stage 2: one plan.

A PEFT LoRA Llama traced whole caches its frozen embeddings and layer 0's frozen projections.
Its rotary ``cos`` / ``sin`` (the buffer ``inv_freq`` times ``arange(seq_len)``) and its causal
mask read no batch value, so the cut stored them as per-dataset constants, and their length
became a size guard: every padded length was a plan of its own. Stage 2 now computes them from
the cached embeddings' length, as the eager step does, and one plan serves every length. A
constant read through a frozen *parameter* stays stored and guarded
(tests/planning/test_constant_sizes.py pins the module-call case).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphsplit
from tests.conformance.unseen2_data_checks import assert_cache_round_trip, assert_same_step
from tests.helpers import split_and_verify, tiny_llama_config

LENGTHS = (10, 12, 7)


class RotaryFromABuffer(nn.Module):
    """Llama's rotary table in miniature: a buffer times ``arange`` of the cached length."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(16, 8).requires_grad_(False)
        self.register_buffer("inv_freq", 1.0 / 10_000 ** (torch.arange(0, 8, 2) / 8.0))
        self.scale = nn.Parameter(torch.ones(8))
        self.head = nn.Linear(8, 1)

    def forward(self, ids):
        hidden = self.tokens(ids)
        positions = torch.arange(hidden.shape[1], device=hidden.device).float()
        angles = torch.outer(positions, self.inv_freq.to(hidden.device))
        table = torch.cat((angles, angles), dim=-1).cos()  # a constant per length
        return self.head(hidden * self.scale * table).mean()


class PositionsSlicedOffAParameter(nn.Module):
    """CLIP-like: the positions are rows of a frozen parameter, sliced to the length."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(16, 8).requires_grad_(False)
        self.positions = nn.Parameter(torch.randn(32, 8), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(8))
        self.head = nn.Linear(8, 1)

    def forward(self, ids):
        hidden = self.tokens(ids)
        return self.head(hidden * self.scale + self.positions[: hidden.shape[1]] * 2).mean()


class EmptyCacheOnTheKeysDevice(nn.Module):
    """transformers' ``DynamicLayer``: an empty tensor made on a frozen tensor's device."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(16, 8).requires_grad_(False)
        self.keys = nn.Linear(8, 8).requires_grad_(False)
        self.scale = nn.Parameter(torch.ones(8))
        self.head = nn.Linear(8, 1)

    def forward(self, ids):
        keys = self.keys(self.tokens(ids)).view(*ids.shape, 2, 4).flatten(2)  # reads the length
        empty = torch.tensor([], dtype=keys.dtype, device=keys.device)  # (0,) at every length
        return self.head(
            torch.cat([empty.expand(*keys.shape[:-1], 0), keys * self.scale], -1)
        ).mean()


def _ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 16, (2, length), generator=torch.Generator().manual_seed(seed))


def test_a_constant_made_from_a_buffer_and_the_length_is_computed_in_stage2():
    torch.manual_seed(0)
    step = RotaryFromABuffer()
    split = split_and_verify(step, (_ids(5),))
    assert not [key for key, spec in split.boundary.items() if spec.is_constant]
    for length in (7, 3):
        assert all(c.ok for c in graphsplit.verify(step, split, (_ids(length, seed=length),)))
    assert len(split.plans) == 1


def test_a_constant_read_through_a_frozen_parameter_is_still_stored_and_guarded():
    torch.manual_seed(0)
    step = PositionsSlicedOffAParameter()
    split = split_and_verify(step, (_ids(5),))
    assert [key for key, spec in split.boundary.items() if spec.is_constant]
    assert all(c.ok for c in graphsplit.verify(step, split, (_ids(7, seed=1),)))
    assert len(split.plans) == 2


def test_an_empty_tensor_made_on_a_device_guards_no_length():
    torch.manual_seed(0)
    step = EmptyCacheOnTheKeysDevice()
    split = split_and_verify(step, (_ids(5),))
    assert all(c.ok for c in graphsplit.verify(step, split, (_ids(7, seed=1),)))
    assert len(split.plans) == 1


@pytest.fixture(scope="module")
def lora_llama():
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config(num_key_value_heads=2))
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    return peft.get_peft_model(model, config)


def _batch(length: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (2, length), generator=torch.Generator().manual_seed(length))
    mask = torch.ones(2, length, dtype=torch.long)
    mask[0, -2:] = 0  # right padding, as DataCollatorWithPadding makes it
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}


def test_a_lora_llama_gets_one_plan_for_every_padded_length(lora_llama, tmp_path):
    def step(input_ids, attention_mask, labels):
        return lora_llama(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss

    split = split_and_verify(step, (), _batch(LENGTHS[0]))
    assert split.path == "trace"
    assert not any(key.startswith(("cos", "sin")) for key in split.boundary)
    for length in LENGTHS:
        assert all(c.ok for c in graphsplit.verify(step, split, (), _batch(length), seed=0))
    assert len(split.plans) == 1

    raw = {length: {**_batch(length), "key": [f"{length}a", f"{length}b"]} for length in LENGTHS}
    trainable = [p for p in lora_llama.parameters() if p.requires_grad]
    eager = lambda batch: step(**{k: v for k, v in batch.items() if k != "key"})  # noqa: E731
    cached = assert_cache_round_trip(split, eager, list(raw.values()), tmp_path / "c", trainable)
    assert len(split.plans) == 1
    lengths = []
    for seed, rows in enumerate(cached.loader(batch_size=2, shuffle=False)):
        embeddings = next(v for k, v in rows.items() if k.endswith("embed_tokens"))  # (2, L, 32)
        lengths.append(length := embeddings.shape[1])
        assert_same_step(
            lambda batch=raw[length]: eager(batch),
            lambda rows=rows: split.stage2(**rows),
            trainable,
            seed,
        )
    assert sorted(lengths) == sorted(LENGTHS)
