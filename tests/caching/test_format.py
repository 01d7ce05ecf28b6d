"""The on-disk format: strict reading of crafted and malformed files; graphsplit 0.1's files."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from graphsplit.caching.read.audit import check_cache
from graphsplit.caching.read.dataset import CachedDataset
from graphsplit.caching.store.record_files import (
    read_constants_progress,
    read_manifest,
    read_resume_header,
    read_shard_progress,
    write_manifest,
    write_progress,
    write_resume_header,
)
from graphsplit.caching.write.cache_run import cache
from graphsplit.errors import CorruptCacheError, ManifestError
from tests.caching.fixtures import (
    SMALL,
    Interrupt,
    flip_last_byte,
    interrupt_after,
    loader,
    make_split,
    rewrite_manifest,
)

# ------------------------------------------------------------------------------- strict reading


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
        (lambda d: d["shards"][0].update(checksum="x" * 64), r"checksum is 'xxx"),
        (lambda d: d["shards"][0].update(checksum="crc32:1234"), r"checksum is 'crc32:1234'"),
        (lambda d: d["shards"][0].update(extra=1), r"unexpected field\(s\) \['extra'\]"),
        (lambda d: d.pop("fingerprint"), r"lacks the field\(s\) \['fingerprint'\]"),
        (lambda d: d["boundary"][0].update(dtype="object"), r"unknown dtype 'object'"),
        (
            lambda d: d["boundary"][0].update(name="__import__('os')"),
            r"expected a Python identifier",
        ),
        (lambda d: d["boundary"][1].update(batch_dim=7), r"boundary\[1\]\.batch_dim is 7"),
        (lambda d: d["shards"][1]["keys"].__setitem__(0, "pic000"), r"sample key 'pic000' twice"),
        (lambda d: d["shards"][0]["shapes"][0].pop(), r"lists 1 shapes for 2 per-sample tensors"),
        (
            lambda d: d["shards"][0]["shapes"][0][1].__setitem__(0, -2),
            r"shards\[0\]\.shapes\[0\]\[1\]\[0\] is int -2; expected an integer >= 0",
        ),
        (
            lambda d: d["shards"][0]["shapes"][0][1].__setitem__(0, 2.0),
            r"shapes\[0\]\[1\]\[0\] is float 2\.0",
        ),
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


def test_a_manifest_of_another_format_is_foreign_not_damaged(path):
    # Not graphsplit's stamp: cache() would refuse to replace it, so the reader offers no
    # overwrite either (see caching/write/own_files.py).
    rewrite_manifest(path, lambda d: d.update(format="pickle"))
    with pytest.raises(ManifestError, match=r"not a graphsplit manifest \(its format is 'pickle'"):
        CachedDataset(path)


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
    rewrite_manifest(path, lambda d: d.update(format_version=3))
    with pytest.raises(
        ManifestError, match=r"(?s)format version 3.*reads versions 1 to 2.*upgrade"
    ):
        CachedDataset(path)


def test_missing_manifest(tmp_path):
    with pytest.raises(ManifestError, match=r"no graphsplit cache at .*manifest\.json is missing"):
        CachedDataset(tmp_path)


@pytest.mark.parametrize("name", ["header.json", "plan.json"])  # plan.json: graphsplit 0.1's name
def test_unfinished_cache_says_to_rerun(tmp_path, name):
    (tmp_path / ".partial").mkdir()
    (tmp_path / ".partial" / name).write_text("{}")
    with pytest.raises(ManifestError, match=r"did not finish; rerun graphsplit\.cache"):
        CachedDataset(tmp_path)


# ------------------------------------------------------------------------------- graphsplit 0.1


DATA_0_1 = Path(__file__).parent / "data" / "graphsplit-0.1"


def _as_format_2(text: str) -> str:
    """A format-1 document as format 2 writes the same records: sha256 becomes the checksum."""
    text = text.replace('"format_version": 1,', '"format_version": 2,')
    return text.replace('"sha256": "', '"checksum": "sha256:')


def test_a_manifest_of_graphsplit_0_1_reads_and_writes_back_the_same_records(tmp_path):
    written = DATA_0_1 / "complete" / "manifest.json"
    manifest = read_manifest(written.parent)
    assert manifest.num_samples == 4 and manifest.header.storage_dtype == "bfloat16"
    assert manifest.shards[1].row_orders[0] == (None, (1, 0, 2))
    assert manifest.shards[0].checksum.startswith("sha256:") and '"sha256"' in written.read_text()
    write_manifest(tmp_path, manifest)
    assert (tmp_path / "manifest.json").read_text() == _as_format_2(written.read_text())
    assert read_manifest(tmp_path) == manifest


def test_resume_records_of_graphsplit_0_1_read_and_write_back_the_same_records(tmp_path):
    old, new = tmp_path / "old" / ".partial", tmp_path / "new"
    shutil.copytree(DATA_0_1 / "partial", old)
    header = read_resume_header(old.parent)  # from .partial/plan.json
    assert header is not None and header.layout.batches_per_shard == 1
    shard = read_shard_progress(old.parent, 0, header)
    constants = read_constants_progress(old.parent, header)
    assert shard is not None and shard.positions == (0, 1) and shard.shard.keys[1] == "pic001"
    assert constants is not None and constants.constants.dim_orders == {"table": None}
    new.mkdir()
    write_resume_header(new, header)
    write_progress(new, shard)
    write_progress(new, constants)
    for old_name, new_name in [
        ("plan.json", "header.json"),
        ("shard-00000.json", "shard-00000.json"),
        ("constants.json", "constants.json"),
    ]:
        expected = _as_format_2((old / old_name).read_text())
        assert (new / ".partial" / new_name).read_text() == expected


# --------------------------------------------------------- format 1: files recorded by sha256


def _to_format_1(document: dict, folder: Path) -> None:
    """Rewrite a manifest as graphsplit 0.1 wrote it: each file's sha256, format 1."""
    document["format_version"] = 1
    for record in [document["constants"], *document["shards"]]:
        del record["checksum"]
        record["sha256"] = hashlib.sha256((folder / record["file"]).read_bytes()).hexdigest()


def test_a_cache_written_in_format_1_still_opens_and_verifies_by_sha256(path):
    expected = {item["key"]: item["latents"].clone() for item in CachedDataset(path)}
    rewrite_manifest(path, lambda d: _to_format_1(d, path))
    assert '"sha256"' in (path / "manifest.json").read_text()
    cached = CachedDataset(path)  # verify=True: each shard is checked against its sha256
    assert cached.manifest.shards[0].checksum.startswith("sha256:")
    assert {item["key"]: item["latents"] for item in cached}.keys() == expected.keys()
    assert all(torch.equal(item["latents"], expected[item["key"]]) for item in cached)
    assert check_cache(path).ok
    flip_last_byte(path / "shard-00001.safetensors")
    assert "shard-00001.safetensors: its sha256 checksum differs" in str(check_cache(path))
    with pytest.raises(CorruptCacheError, match="sha256 checksum differs"):
        CachedDataset(path)[2]


def test_a_run_interrupted_in_format_1_resumes_from_its_shards(tmp_path, monkeypatch):
    whole = tmp_path / "whole"
    cache(make_split(), loader(), whole, shard_bytes=SMALL, progress=False)
    folder = tmp_path / "cache"
    with monkeypatch.context() as patch:
        interrupt_after(patch, 3)
        with pytest.raises(Interrupt):
            cache(make_split(), loader(), folder, shard_bytes=SMALL, progress=False)
    partial = folder / ".partial"
    for record in partial.glob("*.json"):  # as graphsplit <= 0.2 left them
        document = json.loads(record.read_text())
        if record.name == "header.json":
            document["format_version"] = 1
        for file_record in [document, document.get("constants")]:
            if isinstance(file_record, dict) and "checksum" in file_record:
                del file_record["checksum"]
                data = (folder / file_record["file"]).read_bytes()
                file_record["sha256"] = hashlib.sha256(data).hexdigest()
        record.write_text(json.dumps(document))
    assert '"sha256"' in (partial / "shard-00000.json").read_text()
    info = cache(make_split(), loader(), folder, shard_bytes=SMALL, progress=False)
    assert (info.reused_shards, info.written_shards) == (3, 3)
    manifest = read_manifest(folder)
    algorithms = [shard.checksum.partition(":")[0] for shard in manifest.shards]
    assert algorithms == ["sha256"] * 3 + ["xxh3"] * 3
    assert [(path.name, path.read_bytes()) for path in sorted(folder.glob("*.safetensors"))] == [
        (path.name, path.read_bytes()) for path in sorted(whole.glob("*.safetensors"))
    ]
