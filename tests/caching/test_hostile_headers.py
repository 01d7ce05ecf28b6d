"""Every reader of a shard reaches one verdict on a hostile file, and it is safetensors'.

The same hostile variants of a real shard (:mod:`tests.caching.hostile_shards`) are installed
in a cache whose manifest records their size, checksum and (on S3) version, so that only the
header decides; then each is read by safetensors (``load`` and ``safe_open``), by
``tensors_from_bytes`` (what the Hugging Face export and import call), and by every graphsplit
reader: a local ``CachedDataset`` (``verify`` on and off), ``check_cache``, the same on the
real S3-protocol server (ranged reads), and through a read-through ``local_cache``. A reader
that accepts serves the original rows; one that refuses raises a graphsplit error naming the
shard (``check_cache`` lists it). The only verdicts that differ from safetensors' are the
variants marked STRICTER (a key named twice), which graphsplit refuses on purpose.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load

from graphsplit.caching.format.checksums import of_buffer
from graphsplit.caching.format.tensor_places import tensors_from_bytes
from graphsplit.caching.read.audit import check_cache
from graphsplit.caching.read.dataset import CachedDataset
from graphsplit.caching.write.cache_run import cache
from graphsplit.errors import CorruptCacheError
from tests.caching.fixtures import SMALL, Pictures, loader, make_split
from tests.caching.hostile_shards import variant_names, variants

SHARD = "shard-00000.safetensors"  # samples 0 and 1


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """One cache of 12 samples in 6 shards."""
    path = tmp_path_factory.mktemp("clean")
    cache(make_split(), loader(Pictures(12)), path, shard_bytes=SMALL, progress=False)
    return path


@pytest.fixture(scope="module")
def hostile(clean):
    """The variants of the clean cache's shard 0, by name."""
    return {variant.name: variant for variant in variants((clean / SHARD).read_bytes())}


def _items(cached, count=2):
    return [
        {k: v.clone() if torch.is_tensor(v) else v for k, v in cached[i].items()}
        for i in range(count)
    ]


def _same(items, expected):
    assert [item["key"] for item in items] == [item["key"] for item in expected]
    for item, want in zip(items, expected):
        for name, value in want.items():
            if name != "key":
                assert torch.equal(item[name], value), (item["key"], name)


def _dataset_verdict(make, expected) -> str:
    try:
        items = _items(make())
    except CorruptCacheError as error:
        assert f"shard {SHARD} of the cache" in str(error) and "fix:" in str(error), str(error)
        return "refuse"
    _same(items, expected)
    return "accept"


def _check_verdict(url) -> str:
    report = check_cache(url)
    if report.ok:
        return "accept"
    assert [problem.file for problem in report.problems] == [SHARD], str(report)
    return "refuse"


def _safetensors_verdicts(blob, tmp_path) -> dict[str, str]:
    verdicts = {}
    try:
        load(blob)
        verdicts["safetensors.load"] = "accept"
    except Exception:
        verdicts["safetensors.load"] = "refuse"
    file = tmp_path / "alone.safetensors"
    file.write_bytes(blob)
    try:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                handle.get_tensor(name)
        verdicts["safe_open"] = "accept"
    except Exception:
        verdicts["safe_open"] = "refuse"
    return verdicts


def _with_variant(manifest: dict, blob: bytes, etags: dict | None = None) -> dict:
    manifest = json.loads(json.dumps(manifest))
    record = manifest["shards"][0]
    record.update(bytes=len(blob), checksum=of_buffer(blob))
    for entry in [manifest["constants"], *manifest["shards"]]:
        entry.pop("etag", None)
        if etags is not None:
            entry["etag"] = etags[entry["file"]]
    return manifest


@pytest.mark.parametrize("name", variant_names())
def test_every_reader_reaches_safetensors_verdict(name, hostile, clean, tmp_path, s3, bucket):
    variant = hostile[name]
    expected_items = _items(CachedDataset(clean))
    verdicts = _safetensors_verdicts(variant.blob, tmp_path)
    try:
        tensors_from_bytes(variant.blob, source=SHARD)
        verdicts["tensors_from_bytes"] = "accept"
    except CorruptCacheError as error:
        assert f"{SHARD} is not a valid safetensors file" in str(error)
        verdicts["tensors_from_bytes"] = "refuse"

    # A local cache holding the variant, its manifest recording its size and checksum.
    local = tmp_path / "cache"
    shutil.copytree(clean, local)
    (local / SHARD).write_bytes(variant.blob)
    manifest = json.loads((clean / "manifest.json").read_text())
    (local / "manifest.json").write_text(json.dumps(_with_variant(manifest, variant.blob)))
    verdicts["local verify"] = _dataset_verdict(lambda: CachedDataset(local), expected_items)
    verdicts["local verify=False"] = _dataset_verdict(
        lambda: CachedDataset(local, verify=False), expected_items
    )
    verdicts["local check_cache"] = _check_verdict(local)

    # The same cache on the S3 server, the manifest recording each object's ETag.
    prefix = f"{bucket}/cache"
    for file in clean.iterdir():
        if file.name != "manifest.json":
            s3.pipe_file(f"{prefix}/{file.name}", (local / file.name).read_bytes())
    etags = {
        file.name: s3.info(f"{prefix}/{file.name}")["ETag"]
        for file in clean.iterdir()
        if file.name != "manifest.json"
    }
    remote_manifest = _with_variant(manifest, variant.blob, etags)
    s3.pipe_file(f"{prefix}/manifest.json", json.dumps(remote_manifest).encode())
    url = f"s3://{prefix}"
    verdicts["s3 verify"] = _dataset_verdict(lambda: CachedDataset(url), expected_items)
    verdicts["s3 verify=False"] = _dataset_verdict(
        lambda: CachedDataset(url, verify=False), expected_items
    )
    verdicts["s3 check_cache"] = _check_verdict(url)
    verdicts["s3 read-through"] = _dataset_verdict(
        lambda: CachedDataset(url, local_cache=tmp_path / "copies"), expected_items
    )

    graphsplit = "accept" if variant.graphsplit_accepts else "refuse"
    safetensors = "accept" if variant.safetensors_accepts else "refuse"
    wanted = {name: graphsplit for name in verdicts}
    wanted["safetensors.load"] = wanted["safe_open"] = safetensors
    assert verdicts == wanted
