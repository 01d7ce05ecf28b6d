"""Reading a cache: CachedDataset, collate, staleness, corruption, check_cache, security."""

from __future__ import annotations

import json
import pickle
import warnings
from pathlib import Path

import pytest
import torch

import graphsplit.caching.dataset as data_module
from graphsplit.artifacts import BoundarySpec
from graphsplit.caching.dataset import (
    CachedDataset,
    CachedSample,
    check_cache,
    collate,
    verify_inputs,
)
from graphsplit.caching.fingerprint import differences, fingerprint
from graphsplit.caching.run import cache
from graphsplit.errors import CacheError, CorruptCacheError, ManifestError, StaleCacheError
from tests._cache_fixtures import Model, Pictures, loader, make_split, trace

SMALL = 1500


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One cache of 12 samples in 6 shards, built once; tests copy it before damaging it."""
    path = tmp_path_factory.mktemp("cache")
    split = make_split()
    cache(split, loader(Pictures(12)), path, shard_bytes=SMALL, progress=False)
    return path


@pytest.fixture
def path(built, tmp_path):
    copy = tmp_path / "cache"
    copy.mkdir()
    for entry in built.iterdir():
        (copy / entry.name).write_bytes(entry.read_bytes())
    return copy


def rewrite_manifest(path: Path, change) -> None:
    document = json.loads((path / "manifest.json").read_text())
    change(document)
    (path / "manifest.json").write_text(json.dumps(document))


def flip_last_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[-1] ^= 0xFF
    file.write_bytes(bytes(data))


# -------------------------------------------------------------------------------------- reading


def test_items_are_dicts_of_rows_with_keys(path):
    cached = CachedDataset(path)
    item = cached[5]
    assert isinstance(item, dict) and isinstance(item, CachedSample)
    assert item["key"] == "pic005" and set(item) == {"key", "latents", "text"}
    assert cached[-1]["key"] == "pic011"
    with pytest.raises(IndexError, match="sample 12 is out of range for a cache of 12"):
        cached[12]
    assert set(cached.constants) == {"table"}


def test_reads_in_dataloader_workers(path):
    cached = CachedDataset(path)
    cached[0]  # opens a shard in this process first
    workers = torch.utils.data.DataLoader(
        cached, batch_size=4, shuffle=True, num_workers=2, collate_fn=collate
    )
    single = torch.utils.data.DataLoader(cached, batch_size=12, collate_fn=collate)
    total = sum(batch["latents"].sum() for batch in workers)
    assert torch.allclose(total, next(iter(single))["latents"].sum())
    pickle.loads(pickle.dumps(cached))[3]  # open handles are not pickled


def test_collate_refuses_mixed_shapes(tmp_path):
    split = make_split()
    dataset = Pictures(4, sizes=(8, 12))
    batches = torch.utils.data.DataLoader(dataset, batch_sampler=[[0, 2], [1, 3]])
    cache(split, batches, tmp_path, progress=False)
    cached = CachedDataset(tmp_path)
    with pytest.raises(
        CacheError,
        match=r"(?s)cannot batch 'latents'.*\(4, 4, 4\) for 'pic000'.*"
        r"\(4, 6, 6\) for 'pic001'.*buckets",
    ):
        collate([cached[0], cached[2]])


def test_collate_refuses_foreign_items_and_mixed_caches(path, tmp_path):
    with pytest.raises(CacheError, match=r"not an item of a graphsplit\.CachedDataset"):
        collate([{"latents": torch.zeros(1)}])
    with pytest.raises(ValueError, match="at least one item"):
        collate([])
    other = tmp_path / "other"
    cache(make_split(), loader(Pictures(2)), other, progress=False)
    with pytest.raises(CacheError, match="items of different caches"):
        collate([CachedDataset(path)[0], CachedDataset(other)[0]])


# ------------------------------------------------------------------------------------ staleness


def test_matching_split_is_accepted(path):
    CachedDataset(path, make_split())


def test_changed_frozen_weight_is_refused(path):
    split = make_split()
    with torch.no_grad():
        split.model.encoder.embed.weight[3, 1] += 0.5
    with pytest.raises(StaleCacheError, match=r"(?s)frozen weights differ.*overwrite=True"):
        CachedDataset(path, split)


def test_changed_frozen_buffer_is_refused(path):
    split = make_split()
    split.model.encoder.table[0, 0] = 9.0
    with pytest.raises(StaleCacheError, match="frozen weights differ"):
        CachedDataset(path, split)


def test_changed_step_code_is_refused(path):
    split = make_split()
    encoder = split.model.encoder
    split.stage1 = trace(EncoderWithOtherCode(encoder))
    with pytest.raises(StaleCacheError, match="stage-1 code differs") as caught:
        CachedDataset(path, split)
    assert "weights" not in str(caught.value).split("fix")[0]


class EncoderWithOtherCode(torch.nn.Module):
    def __init__(self, encoder):
        super().__init__()
        self.conv, self.embed, self.scale = encoder.conv, encoder.embed, encoder.scale
        self.register_buffer("table", encoder.table)

    def forward(self, pixel_values, input_ids):
        latents = self.conv(pixel_values * 0.5)
        text = self.embed(input_ids).transpose(0, 1)
        return {"latents": latents, "text": text, "table": self.table * self.scale}


def test_changed_boundary_is_refused(path):
    split = make_split()
    spec = split.boundary["latents"]
    split.boundary["latents"] = BoundarySpec(
        "latents", spec.shape, torch.float16, 0, spec.bytes_per_sample // 2, spec.source
    )
    with pytest.raises(StaleCacheError, match="boundary differs"):
        CachedDataset(path, split)


def test_other_versions_only_warn(path):
    rewrite_manifest(path, lambda d: d["fingerprint"]["versions"].update(torch="1.0.0"))
    with pytest.warns(UserWarning, match=r"(?s)other library versions.*torch 1.0.0"):
        CachedDataset(path, make_split())


def test_trace_time_sizes_do_not_change_the_fingerprint():
    split = make_split()
    other = make_split()
    spec = other.boundary["latents"]
    other.boundary["latents"] = BoundarySpec("latents", (7, 4, 9, 9), spec.dtype, 0, 1, "y:9")
    assert differences(fingerprint(split), fingerprint(other)) == ()


def test_changed_sample_image_is_refused(path):
    dataset = Pictures(12)
    CachedDataset(path, make_split(), dataset=dataset)  # unchanged: accepted
    dataset.changed[4] = 1e-3
    with pytest.raises(StaleCacheError, match=r"1 sample\(s\) changed \('pic004'\)"):
        CachedDataset(path, make_split(), dataset=dataset)


def test_added_and_removed_samples_are_named(path):
    with pytest.raises(StaleCacheError, match=r"(?s)2 sample\(s\) are new \('pic012', 'pic013'\)"):
        verify_inputs(path, Pictures(14))
    with pytest.raises(StaleCacheError, match=r"no longer there \('pic010', 'pic011'\)"):
        verify_inputs(CachedDataset(path), Pictures(10))


def test_verify_inputs_hints_at_transforming_collate(path):
    dataset = Pictures(12)
    dataset.changed = dict.fromkeys(range(12), 1.0)
    with pytest.raises(StaleCacheError, match="every sample differs"):
        verify_inputs(path, dataset)


def test_verify_inputs_needs_the_inputs(path):
    class NoIds(torch.utils.data.Dataset):
        def __len__(self):
            return 1

        def __getitem__(self, index):
            return {"pixel_values": torch.zeros(3, 8, 8)}

    with pytest.raises(CacheError, match=r"item 0 of the dataset lacks \['input_ids'\]"):
        verify_inputs(path, NoIds())


def test_expected_keys_name_missing_and_extra(path):
    keys = [f"pic{i:03d}" for i in range(12)]
    CachedDataset(path, expected_keys=keys)
    with pytest.raises(
        StaleCacheError, match=r"(?s)not in the cache \('new'\).*no longer there \('pic011'\)"
    ):
        CachedDataset(path, expected_keys=[*keys[:-1], "new"])


# ----------------------------------------------------------------------------------- corruption


def test_corrupt_shard_is_reported_and_other_shards_read(path):
    flip_last_byte(path / "shard-00002.safetensors")
    report = check_cache(path)
    assert not report.ok
    assert report.damaged_keys == ["pic004", "pic005"]
    assert "shard-00002.safetensors: its sha256 differs" in str(report)
    cached = CachedDataset(path)
    with pytest.raises(
        CorruptCacheError, match=r"(?s)shard-00002.safetensors.*'pic004', 'pic005'.*check_cache"
    ):
        cached[4]
    with pytest.raises(CorruptCacheError, match="shard-00002"):
        cached[5]  # remembered, not rehashed
    assert cached[3]["key"] == "pic003" and cached[6]["key"] == "pic006"


def test_verify_false_skips_checksums_but_still_checks_headers(path):
    shard = path / "shard-00001.safetensors"
    shard.write_bytes(b"\x00" * shard.stat().st_size)
    cached = CachedDataset(path, verify=False)
    with pytest.raises(CorruptCacheError, match="safetensors cannot open it"):
        cached[2]
    assert cached[0]["key"] == "pic000"


def test_missing_and_truncated_shards_are_reported(path):
    (path / "shard-00000.safetensors").unlink()
    truncated = path / "shard-00003.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:100])
    report = check_cache(path)
    text = str(report)
    assert "shard-00000.safetensors: the file is missing" in text
    assert "shard-00003.safetensors: it has 100 bytes, the manifest records" in text
    assert "4 of 12 samples unreadable" in text and "overwrite=True" in text
    with pytest.raises(CorruptCacheError, match="the file is missing"):
        CachedDataset(path)[0]


def test_corrupt_constants_are_refused(path):
    flip_last_byte(path / "constants.safetensors")
    assert "constants.safetensors" in str(check_cache(path))
    with pytest.raises(CorruptCacheError, match=r"constants.safetensors .* is damaged"):
        CachedDataset(path)


def test_shard_with_other_tensors_than_listed_is_reported(path):
    from safetensors.torch import save_file

    from graphsplit.caching.format import sha256_file

    shard = path / "shard-00000.safetensors"
    save_file({"0/latents": torch.zeros(4, 4, 4)}, shard)
    rewrite_manifest(
        path,
        lambda d: d["shards"][0].update(sha256=sha256_file(shard), bytes=shard.stat().st_size),
    )
    assert "its tensors differ from the manifest's" in str(check_cache(path))
    with pytest.raises(CorruptCacheError, match="tensors differ"):
        CachedDataset(path)[0]


def test_check_cache_of_a_good_cache(path):
    report = check_cache(path)
    assert report.ok and report.num_samples == 12 and report.num_shards == 6
    assert str(report).endswith("bytes verified)") and "OK" in str(report)


def test_check_cache_reports_a_bad_manifest(tmp_path):
    report = check_cache(tmp_path)
    assert not report.ok and "manifest.json is missing" in str(report)


# ------------------------------------------------------------------------------------- security


class Boom:
    """Unpickling this creates a marker file: the test fails if anything unpickles."""

    marker: Path

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def pickle_bomb(marker: Path) -> bytes:
    bomb = Boom()
    bomb.marker = marker
    return pickle.dumps(bomb)


@pytest.fixture
def no_unpickling(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("graphsplit must never unpickle cache files")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)


def test_pickle_files_in_the_folder_are_never_loaded(path, tmp_path, no_unpickling):
    marker = tmp_path / "executed"
    (path / "evil.pkl").write_bytes(pickle_bomb(marker))
    (path / "shard-00099.pt").write_bytes(pickle_bomb(marker))
    cached = CachedDataset(path)
    [cached[i] for i in range(len(cached))]
    assert check_cache(path).ok
    assert not marker.exists()


def test_a_pickle_in_place_of_a_shard_is_refused(path, tmp_path, no_unpickling):
    marker = tmp_path / "executed"
    shard = path / "shard-00001.safetensors"
    payload = pickle_bomb(marker)
    shard.write_bytes(payload)
    with pytest.raises(CorruptCacheError, match="shard-00001"):
        CachedDataset(path)[2]
    from graphsplit.caching.format import sha256_file

    rewrite_manifest(
        path, lambda d: d["shards"][1].update(sha256=sha256_file(shard), bytes=len(payload))
    )
    with pytest.raises(CorruptCacheError, match="safetensors cannot open it"):
        CachedDataset(path)[2]
    assert not marker.exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda d: d["shards"][0].update(file="../evil.safetensors"),
            r"shards\[0\]\.file is '\.\./",
        ),
        (
            lambda d: d["shards"][1].update(file="/etc/passwd"),
            r"shards\[1\]\.file is '/etc/passwd'",
        ),
        (lambda d: d["constants"].update(file="../x"), r"constants\.file is '\.\./x'"),
        (lambda d: d["shards"][0].update(bytes="12"), r"shards\[0\]\.bytes is str '12'"),
        (lambda d: d["shards"][0].update(bytes=True), r"shards\[0\]\.bytes is bool True"),
        (lambda d: d["shards"][0]["keys"].__setitem__(0, 5), r"keys\[0\] is int 5"),
        (lambda d: d["shards"][0].update(sha256="x" * 64), r"sha256 is 'xxx"),
        (lambda d: d["shards"][0].update(extra=1), r"unexpected field\(s\) \['extra'\]"),
        (lambda d: d.pop("fingerprint"), r"lacks the field\(s\) \['fingerprint'\]"),
        (lambda d: d.update(format="pickle"), r"format is 'pickle'"),
        (lambda d: d["boundary"][0].update(dtype="object"), r"unknown dtype 'object'"),
        (
            lambda d: d["boundary"][0].update(name="__import__('os')"),
            r"expected a Python identifier",
        ),
        (lambda d: d["boundary"][1].update(batch_dim=7), r"boundary\[1\]\.batch_dim is 7"),
        (lambda d: d["shards"][1]["keys"].__setitem__(0, "pic000"), r"sample key 'pic000' twice"),
        (lambda d: d["shards"][0]["shapes"][0].pop(), r"lists 1 shapes for 2 per-sample tensors"),
        (lambda d: d.update(num_samples=13), r"num_samples is 13 but the shards list 12"),
        (lambda d: d.update(shards={}), r"shards is dict \{\}; expected a list"),
        (
            lambda d: d["shards"][0]["dim_orders"][0].__setitem__(1, [0, 0, 1]),
            r"dim_orders\[0\]\[1\] is \[0, 0, 1\], not an order of 3 dims",
        ),
        (
            lambda d: d["constants"]["dim_orders"].update(table=[2, 0]),
            r"constants\.dim_orders\.table is \[2, 0\], not an order of 2 dims",
        ),
    ],
)
def test_crafted_manifests_are_refused(path, change, message):
    rewrite_manifest(path, change)
    with pytest.raises(ManifestError, match=message) as caught:
        CachedDataset(path)
    assert "manifest.json is not a valid graphsplit cache file" in str(caught.value)
    assert "overwrite=True" in str(caught.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "is not valid JSON"),
        ('{"a": NaN}', "NaN is not a JSON number"),
        ('{"a": 1, "a": 2}', "the key 'a' appears twice"),
        ("[1, 2]", "the document is list"),
        (b"\xff\xfe", "is not valid JSON"),
    ],
)
def test_malformed_manifests_are_refused(path, text, message):
    data = text if isinstance(text, bytes) else text.encode()
    (path / "manifest.json").write_bytes(data)
    with pytest.raises(ManifestError, match=message):
        CachedDataset(path)


def test_newer_format_version_asks_for_an_upgrade(path):
    rewrite_manifest(path, lambda d: d.update(format_version=2))
    with pytest.raises(ManifestError, match=r"(?s)format version 2.*upgrade graphsplit"):
        CachedDataset(path)


def test_missing_manifest(tmp_path):
    with pytest.raises(ManifestError, match=r"no graphsplit cache at .*manifest\.json is missing"):
        CachedDataset(tmp_path)


def test_unfinished_cache_says_to_rerun(tmp_path):
    (tmp_path / ".partial").mkdir()
    (tmp_path / ".partial" / "plan.json").write_text("{}")
    with pytest.raises(ManifestError, match=r"did not finish; rerun graphsplit\.cache"):
        CachedDataset(tmp_path)


def test_fingerprint_needs_real_weights():
    split = make_split()
    split.stage1 = trace(Model().encoder.to("meta"))
    with pytest.raises(CacheError, match="on the meta device"):
        fingerprint(split)


def test_no_warnings_on_a_clean_read(path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cached = CachedDataset(path, make_split())
        collate([cached[0], cached[1]])
    assert data_module.CachedDataset is CachedDataset


def test_a_split_with_frozen_weights_on_meta_checks_code_and_boundary_only(tmp_path):
    """A stage-2 process never loads the frozen weights; the cache run checked them."""

    def step(on_meta: bool) -> torch.nn.Module:
        with torch.device("meta" if on_meta else "cpu"):
            encoder = torch.nn.Linear(4, 4).requires_grad_(False)
        torch.manual_seed(0)
        return torch.nn.Sequential(encoder, torch.nn.Linear(4, 1))

    import graphsplit

    x = torch.randn(2, 4)
    cache(
        graphsplit.split(step(False), (x,)),
        [{"input": torch.randn(2, 4)}],
        tmp_path,
        progress=False,
    )
    with pytest.warns(UserWarning, match="checked for code and boundary only"):
        dataset = CachedDataset(tmp_path, graphsplit.split(step(True), (x,)))
    assert len(dataset) == 2
    other = torch.nn.Sequential(
        torch.nn.Linear(4, 4, device="meta").requires_grad_(False),
        torch.nn.Tanh(),
        torch.nn.Linear(4, 1),
    )
    with pytest.raises(StaleCacheError, match="stage-1 code differs"):
        CachedDataset(tmp_path, graphsplit.split(other, (x,)))
