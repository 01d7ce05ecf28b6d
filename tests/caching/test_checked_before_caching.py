"""Checked before caching (issue 25, item 2): stage 1 runs every size check the plan holds.

A size check stage 2 would run (the step read a size of a tensor stage 2 receives as a Python
value) is also run by stage 1 wherever stage 1 can recompute it, and before the batch's frozen
work when it reads only the inputs' sizes. So ``cache()`` over a loader that mixes sizes stops
at the first batch of a size no plan could train, naming the user's line, and writes nothing
of it: the folder holds the shards already finished, never samples stage 2 would refuse.
"""

from __future__ import annotations

import json
import operator

import pytest
import torch
from torch import nn

import graphsplit
from graphsplit.caching.format import fingerprint as fingerprint_module
from graphsplit.errors import SplitError, StaleCacheError
from tests.helpers import frozen, line_of


class MaskedPositions(nn.Module):
    """A frozen encoder and a trainable projection of the same tokens; the trainable part
    reads their length as a Python int (stage 2 has the tokens, so it can recheck it)."""

    def __init__(self, *, plain_int: bool = False) -> None:
        super().__init__()
        self.plain_int = plain_int
        torch.manual_seed(0)
        self.encoder = frozen(nn.Linear(4, 4))
        self.projection = nn.Linear(4, 4)
        self.positions = nn.Parameter(torch.randn(64, 4))
        self.head = nn.Linear(4, 1)

    def forward(self, tokens):
        hidden = self.encoder(tokens) + self.projection(tokens)
        if self.plain_int:  # noqa: SIM108 (one line per reading: errors name it)
            length = operator.index(tokens.shape[1])  # int() of it would stay traced
        else:
            length = int(tokens.shape[1] * 1.0)  # size arithmetic, as latent packing does
        hidden = hidden + self.positions[:length]
        return self.head(hidden).mean()


def _batch(length: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"tokens": torch.randn(2, length, 4, generator=generator)}


def test_stage_1_holds_stage_2s_check_before_the_frozen_work():
    split = graphsplit.split(MaskedPositions(), kwargs=_batch(6, 0))
    assert "graphsplit_runtime_check_size_read(" in split.stage2.code
    code = split.stage1.code
    assert "graphsplit_runtime_check_size_read(" in code
    assert code.index("check_size_read(") < code.index("self.encoder(")


def test_cache_stops_at_the_first_batch_of_another_size_and_writes_none_of_it(tmp_path):
    split = graphsplit.split(MaskedPositions(), kwargs=_batch(6, 0), max_plans=1)
    folder = tmp_path / "cache"
    batches = [_batch(6, 1), _batch(6, 2), _batch(9, 3), _batch(6, 4)]
    with pytest.raises(SplitError) as caught:
        graphsplit.cache(split, batches, folder, progress=False, shard_bytes=1)
    message = str(caught.value)
    assert "this plan was made for int(tokens.shape[1] * 1.0) = 6, got 9" in message
    assert f"{line_of(MaskedPositions.forward, '* 1.0)')}  " in message
    data = graphsplit.CachedDataset(folder, split) if (folder / "manifest.json").exists() else []
    assert len(data) <= 4  # at most the two batches of the plan's size, never the third
    for index in range(len(data)):
        assert data[index]["tokens"].shape == (6, 4)


def test_a_loader_of_one_size_caches_and_trains_exactly(tmp_path):
    model = MaskedPositions()
    split = graphsplit.split(model, kwargs=_batch(6, 0))
    batches = [_batch(6, 1), _batch(6, 2)]
    graphsplit.cache(split, batches, tmp_path / "cache", progress=False)
    data = graphsplit.CachedDataset(tmp_path / "cache", split)
    rows = [data[index] for index in range(2)]
    cached = {key: torch.stack([row[key] for row in rows]) for key in split.boundary}
    assert torch.equal(split.stage2(**cached), model(**batches[0]))


def test_an_int_stage_2_checks_is_checked_by_stage_1_too(tmp_path):
    """``operator.index(tokens.shape[1])``: stage 2 always rechecked it; now ``cache()`` does as
    well."""
    split = graphsplit.split(MaskedPositions(plain_int=True), kwargs=_batch(6, 0), max_plans=1)
    assert "graphsplit_runtime_check_size(" in split.stage2.code
    assert "graphsplit_runtime_check_size(" in split.stage1.code
    with pytest.raises(SplitError, match=r"made for tokens.shape\[1\] = 6, got 9"):
        graphsplit.cache(split, [_batch(9, 1)], tmp_path / "cache", progress=False)
    assert not (tmp_path / "cache" / "manifest.json").exists()


def test_a_cache_made_by_0_2_without_the_new_checks_is_still_this_splits_own(tmp_path):
    # Stage 1's code is the cache's code fingerprint; the check stage 1 now holds changes no
    # value, so a cache whose stage 1 was 0.2's (the same code without it) must not go stale.
    # Here a cache is written, then its manifest given the digest of 0.2's stage-1 code.
    split = graphsplit.split(MaskedPositions(plain_int=True), kwargs=_batch(6, 0))
    (as_in_0_2,) = split.stage1.graphsplit_code_aliases
    assert "check_size(" in split.stage1.code and "check_size(" not in as_in_0_2
    folder = tmp_path / "cache"
    batches = [_batch(6, 1), _batch(6, 2)]
    graphsplit.cache(split, batches, folder, progress=False)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["fingerprint"]["code"] = fingerprint_module._digest_text(
        fingerprint_module._normalized_code(as_in_0_2)
    )
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2))
    again = graphsplit.cache(split, batches, folder, progress=False)
    assert (again.written_shards, again.reused_shards) == (0, 1)
    assert len(graphsplit.CachedDataset(folder, split)) == 4
    # Any other code is still another split's cache.
    manifest["fingerprint"]["code"] = "sha256:" + "0" * 64
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2))
    with pytest.raises(StaleCacheError, match="code"):
        graphsplit.CachedDataset(folder, split)
