"""Safe by default (issue 26, item 5): an item changed in place does not change what the next
epoch reads, and frozen weights changed through ``.data`` (an EMA teacher's update) are seen by
the weights fingerprint, so a cache of the old teacher's outputs is refused, not served."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

import graphsplit
from graphsplit.caching.format.fingerprint import PROBED_ELEMENTS, WEIGHT_HASHES, fingerprint
from graphsplit.caching.read.collation import collate
from graphsplit.caching.read.dataset import CachedDataset
from graphsplit.errors import StaleCacheError
from tests.caching.fixtures import Model, make_split


def _hashed(function):
    before = WEIGHT_HASHES.hashed_bytes
    result = function()
    return WEIGHT_HASHES.hashed_bytes - before, result


# --------------------------------------------------------------------------- items changed


def test_an_item_changed_in_place_does_not_change_the_next_epoch(built):
    cached = CachedDataset(built)
    first = {name: cached[3][name].clone() for name in ("latents", "text")}
    item = cached[3]
    item["latents"].mul_(0)
    item["text"].add_(1)  # text is stored with its batch dim second: a permuted row
    for epoch in range(2):
        again = cached[3]
        assert torch.equal(again["latents"], first["latents"]), epoch
        assert torch.equal(again["text"], first["text"]), epoch
    batch = collate([cached[2], cached[3]])
    batch["latents"].zero_()
    assert torch.equal(cached[3]["latents"], first["latents"])
    loader = torch.utils.data.DataLoader(cached, batch_size=4, collate_fn=collate)
    epochs = []
    for _ in range(2):
        batches = [b["latents"].clone() for b in loader]
        for b in loader:
            b["latents"].mul_(0)  # a training loop writing into its batch
        epochs.append(batches)
    assert all(torch.equal(a, b) for a, b in zip(*epochs))


def test_an_hf_item_changed_in_place_does_not_change_the_next_read(built):
    pytest.importorskip("datasets", reason="the optional datasets package is not installed")
    from graphsplit.caching.read.hf_export import HFCachedDataset, to_hf_dataset

    back = HFCachedDataset(to_hf_dataset(built))
    first = back[1]["latents"].clone()
    back[1]["latents"].mul_(0)
    assert torch.equal(back[1]["latents"], first)


# ----------------------------------------------------------------- writes through .data


@pytest.mark.parametrize(
    "write",
    [
        "data.copy_",
        "data.mul_add_",
        "numpy view",
        "transposed data",
        "bfloat16 data",
    ],
)
def test_writes_that_bypass_the_version_counter_are_seen(write):
    split = make_split(Model(seed=3))
    conv = split.model.encoder.conv
    if write == "transposed data":  # a non-contiguous weight: sampled without a full copy
        conv.weight = nn.Parameter(
            conv.weight.detach().transpose(0, 1).contiguous().transpose(0, 1)
        )
        conv.requires_grad_(False)
        split = make_split(split.model)
        assert not conv.weight.is_contiguous()
    if write == "bfloat16 data":
        conv.to(torch.bfloat16)
        split = make_split(split.model)
    weight = conv.weight
    size = weight.numel() * weight.element_size()
    before = fingerprint(split).weights
    assert _hashed(lambda: fingerprint(split).weights) == (0, before)  # remembered
    version = weight._version
    if write == "data.copy_":
        weight.data.copy_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(1)))
    elif write == "numpy view":
        view = weight.detach().numpy()
        np.multiply(view, 0.5, out=view)
    else:  # an EMA update: t = decay * t + (1 - decay) * s
        weight.data.mul_(0.99).add_(torch.ones_like(weight), alpha=0.01)
    assert weight._version == version  # the version counter did not see it
    hashed, after = _hashed(lambda: fingerprint(split).weights)
    assert after != before and hashed == size  # seen, and only that tensor read again
    WEIGHT_HASHES.forget()
    assert fingerprint(split).weights == after  # what a new process would compute


def test_a_write_between_the_sampled_elements_needs_forget_as_documented():
    weight = torch.zeros(PROBED_ELEMENTS * 64)
    before = WEIGHT_HASHES.content_hash(weight)
    weight.data[1] = 1.0  # one element, between two sampled ones (every 64th is sampled)
    assert WEIGHT_HASHES.content_hash(weight) == before  # the documented limit
    WEIGHT_HASHES.forget()
    assert WEIGHT_HASHES.content_hash(weight) != before
    weight.data[64] = 1.0  # a sampled element: seen without forget
    changed = WEIGHT_HASHES.content_hash(weight)
    assert changed != before
    weight.data[-1] = 2.0  # the last element is always sampled
    assert WEIGHT_HASHES.content_hash(weight) != changed


# --------------------------------------------------------------- an EMA teacher, end to end


class Distillation(nn.Module):
    """A student trained on an EMA teacher's outputs: the teacher is frozen (stage 1)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.student = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
        self.teacher = copy.deepcopy(self.student).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        target = self.teacher(x)
        return (self.student(x) - target).pow(2).mean()

    def ema_update(self, decay: float = 0.9) -> None:
        """The update many trainers write: through ``.data``, bypassing autograd's counter."""
        for t, s in zip(self.teacher.parameters(), self.student.parameters()):
            t.data.copy_(decay * t.data + (1 - decay) * s.data)


class Points(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> dict:
        generator = torch.Generator().manual_seed(index)
        return {"x": torch.randn(8, generator=generator), "key": f"p{index}"}


def test_an_ema_teacher_changed_through_data_makes_its_cache_stale(tmp_path):
    model = Distillation()
    example = torch.utils.data.default_collate([Points()[0], Points()[1]])
    split = graphsplit.split(model, args=(example["x"],))
    loader = torch.utils.data.DataLoader(Points(), batch_size=2)
    graphsplit.cache(split, loader, tmp_path, progress=False)
    CachedDataset(tmp_path, split)  # fresh: accepted

    optimizer = torch.optim.SGD(model.student.parameters(), lr=0.5)
    for batch in CachedDataset(tmp_path, split).loader(batch_size=4, seed=0):
        optimizer.zero_grad()
        split.stage2(**batch).backward()
        optimizer.step()
    model.ema_update()
    assert any(
        not torch.equal(t, s)
        for t, s in zip(model.teacher.parameters(), Distillation().teacher.parameters())
    )

    with pytest.raises(StaleCacheError, match="was not made by this split") as caught:
        CachedDataset(tmp_path, split)
    message = str(caught.value)
    assert "weights" in message and "fix:" in message
    with pytest.raises(StaleCacheError, match="made differently"):
        graphsplit.cache(split, loader, tmp_path, progress=False)
    graphsplit.cache(split, loader, tmp_path, overwrite=True, progress=False)  # rebuilt
    rebuilt = CachedDataset(tmp_path, split)
    boundary = [name for name in rebuilt.boundary if name in rebuilt[0]]
    batch = torch.utils.data.default_collate([Points()[0], Points()[1]])
    rows = split.stage1(batch["x"])
    for name in boundary:
        fresh = rows[name] if isinstance(rows, dict) else rows
        assert torch.equal(torch.stack([rebuilt[0][name], rebuilt[1][name]]), fresh)
