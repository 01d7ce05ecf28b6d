"""Per-dataset constants whose value depends on the plan: a frozen table sliced by a value read
off frozen data (``table[:max(lengths)]``), then used by stage 2. One split, one cache over a
mixed loader; each plan's stage 2 reads its own constants (``constants-<key>.safetensors``
beside batch 0's ``constants.safetensors``), every batch bit-equal to the unsplit step; a fresh
CachedDataset and check_cache read the two-plan cache; a damaged plan file names its samples."""

from __future__ import annotations

import json

import pytest
import torch

import graphsplit
from graphsplit.caching.format.layout import (
    CONSTANTS_FILE,
    PLAN_CONSTANTS_PATTERN,
    ShardRecord,
    plan_constants_file,
)
from graphsplit.caching.write.plan_constants import refuse_unrecorded_constants
from graphsplit.errors import CacheError
from tests.planning.test_value_reads import ReadsPromptLengths, prompt
from tests.signatures.epoch import epoch_exact


def _plan_files(path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if PLAN_CONSTANTS_PATTERN.fullmatch(p.name))


@pytest.mark.parametrize(("size", "lengths"), [(1, (4, 3, 4, 3)), (2, (3, 4, 3))])
def test_a_frozen_constant_sliced_by_a_read_value_is_cached_per_plan(tmp_path, size, lengths):
    """Batch 1 split at 4; batch 2 split at 4 with loader batch 0 of another plan (3): then
    constants.safetensors holds plan 3's constants and the first plan gets a file of its own."""
    step = ReadsPromptLengths()
    split = graphsplit.split(step, kwargs=prompt(4, size=size), path="trace")
    batches = [prompt(n, seed=seed, size=size) for seed, n in enumerate(lengths, 1)]
    path = tmp_path / "cache"
    result = epoch_exact(step, split, batches, path, batch_size=size)
    assert len(split.signatures) == 2
    assert len(result.batches) == len(lengths)
    manifest = json.loads((path / "manifest.json").read_text())
    own = {key: plan["constants"] for key, plan in manifest["plans"].items() if "constants" in plan}
    (key,) = own  # one plan reads constants.safetensors (batch 0's), the other its own file
    assert own[key]["file"] == plan_constants_file(key)
    assert _plan_files(path) == [plan_constants_file(key)]
    assert (path / CONSTANTS_FILE).exists()


def test_a_two_plan_cache_reads_in_a_fresh_dataset_and_check_cache(tmp_path):
    step = ReadsPromptLengths()
    split = graphsplit.split(step, kwargs=prompt(4), path="trace")
    loader = [{**prompt(n, seed=i), "key": [f"s{i}"]} for i, n in enumerate((4, 3, 3))]
    path = tmp_path / "cache"
    graphsplit.cache(split, loader, path, progress=False)
    fresh = graphsplit.CachedDataset(path)  # no split: the manifest alone
    by_key = {fresh[i]["key"]: graphsplit.collate([fresh[i]]) for i in range(len(fresh))}
    tables = {key: batch["sum_2"] for key, batch in by_key.items()}
    assert tables["s0"].shape == (4,) and tables["s1"].shape == (3,)
    assert torch.equal(tables["s1"], tables["s2"])
    assert torch.equal(tables["s0"][:3], tables["s1"])  # the same table, sliced per plan
    assert graphsplit.check_cache(path).ok
    (plan_file,) = _plan_files(path)
    (path / plan_file).write_bytes((path / plan_file).read_bytes()[:-1] + b"\0")
    report = graphsplit.check_cache(path)
    assert not report.ok
    (problem,) = report.problems
    assert problem.file == plan_file
    assert "every batch of its plan needs it" in problem.reason
    assert sorted(problem.keys) == ["s1", "s2"]


def test_rows_whose_plan_constants_were_not_recorded_stop_the_manifest():
    """A process other than the main one took batch 0 to be the first plan's; it was not."""
    header = type("Header", (), {"constant_specs": ("c",)})()
    shards = [
        ShardRecord("shard-00000.safetensors", "xxh3:0", 1, keys=("a",), shapes=((),),
                    row_orders=((),), input_sha256=("0" * 64,), signatures=("b" * 16,)),
        ShardRecord("shard-00001.safetensors", "xxh3:0", 1, keys=("c",), shapes=((),),
                    row_orders=((),), input_sha256=("0" * 64,)),
    ]  # fmt: skip
    plans = {"b" * 16: object()}
    with pytest.raises(CacheError) as caught:
        refuse_unrecorded_constants("cache", header, shards, plans, "a" * 16)
    message = str(caught.value)
    assert f"the per-dataset constants of plan {'a' * 16} of cache were not recorded" in message
    assert f"it was plan {'b' * 16}'s" in message
    assert "fix:    cache on one process, or put a batch of the split's own example" in message


def test_a_cache_with_constants_of_several_plans_is_not_exported(tmp_path):
    from graphsplit.caching.read.hf_export import HFExportError, to_hf_dataset

    split = graphsplit.split(ReadsPromptLengths(), kwargs=prompt(4), path="trace")
    loader = [{**prompt(n, seed=i), "key": [f"s{i}"]} for i, n in enumerate((4, 3))]
    graphsplit.cache(split, loader, tmp_path / "cache", progress=False)
    with pytest.raises(HFExportError) as caught:
        to_hf_dataset(tmp_path / "cache")
    message = str(caught.value)
    assert "holds per-dataset constants of several plans (2 sets); an export carries one" in message
    assert "fix:    train from the cache folder with graphsplit.CachedDataset" in message
