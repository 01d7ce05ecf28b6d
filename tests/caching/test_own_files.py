"""graphsplit deletes or replaces only the files it wrote (issue 26, item 4): its temporary
files have unmistakable names, and a folder holding another tool's ``manifest.json`` is refused,
``overwrite`` or not, with a fix that keeps the file."""

from __future__ import annotations

import json

import pytest

from graphsplit.caching.read.dataset import CachedDataset
from graphsplit.caching.write.cache_run import cache
from graphsplit.caching.write.own_files import manifest_is_ours
from graphsplit.errors import ManifestError, StaleCacheError
from tests.caching.fixtures import SMALL, Interrupt, interrupt_after, loader, make_split

THEIRS = {".env.tmp": "SECRET=1", ".notes.tmp": "notes", ".manifest.json.tmp": "{}"}


def _plant(folder) -> None:
    folder.mkdir(exist_ok=True)
    for name, text in THEIRS.items():
        (folder / name).write_text(text)


def _intact(folder) -> None:
    assert {name: (folder / name).read_text() for name in THEIRS} == THEIRS


def test_other_tools_tmp_files_survive_every_cache_call(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    _plant(folder)
    (folder / ".partial").mkdir()
    (folder / ".partial" / "notes.json").write_text("{}")  # .partial is a common name
    with monkeypatch.context() as patch:
        interrupt_after(patch, 2)
        with pytest.raises(Interrupt):
            cache(make_split(), loader(), folder, shard_bytes=SMALL, progress=False)
    _intact(folder)
    cache(make_split(), loader(), folder, shard_bytes=SMALL, progress=False)  # resumes
    _intact(folder)
    cache(make_split(), loader(), folder, shard_bytes=SMALL, progress=False)  # nothing to do
    cache(make_split(), loader(), folder, shard_bytes=SMALL, overwrite=True, progress=False)
    _intact(folder)
    assert len(CachedDataset(folder)) == 12
    assert sorted(p.name for p in (folder / ".partial").iterdir()) == ["notes.json"]


@pytest.mark.parametrize(
    "content",
    [
        json.dumps({"name": "my-app", "version": 3}),
        json.dumps({"format": "other-tool", "files": []}),
        "{not json",
        "",
    ],
)
@pytest.mark.parametrize("overwrite", [False, True])
def test_another_tools_manifest_is_refused_and_kept(tmp_path, content, overwrite):
    folder = tmp_path / "cache"
    folder.mkdir()
    (folder / "manifest.json").write_text(content)
    (folder / "shard-00000.safetensors").write_bytes(b"theirs too")
    with pytest.raises(StaleCacheError, match=r"manifest\.json that graphsplit did not write") as e:
        cache(make_split(), loader(), folder, overwrite=overwrite, progress=False)
    message = str(e.value)
    assert "fix:" in message and "another (new or empty) folder" in message
    assert "move manifest.json" in message and "pass overwrite=True" not in message
    assert (folder / "manifest.json").read_text() == content
    assert (folder / "shard-00000.safetensors").read_bytes() == b"theirs too"
    assert sorted(entry.name for entry in folder.iterdir() if entry.name != ".lock") == [
        "manifest.json",
        "shard-00000.safetensors",
    ]


def test_graphsplits_own_manifest_is_recognised_by_its_stamp(tmp_path):
    assert manifest_is_ours(tmp_path) is None
    cache(make_split(), loader(), tmp_path, shard_bytes=SMALL, progress=False)
    assert manifest_is_ours(tmp_path) is True
    (tmp_path / "manifest.json").write_text('{"format": "graphsplit-cache", "form')  # torn
    assert manifest_is_ours(tmp_path) is True
    (tmp_path / "manifest.json").write_text('["graphsplit-cache"]')
    assert manifest_is_ours(tmp_path) is False


def test_another_tools_manifest_on_s3_is_refused_and_kept(s3, bucket):
    s3.pipe_file(f"{bucket}/run/manifest.json", b'{"name": "my-app"}')
    with pytest.raises(StaleCacheError, match=r"manifest\.json that graphsplit did not write"):
        cache(make_split(), loader(), f"s3://{bucket}/run", overwrite=True, progress=False)
    assert s3.cat_file(f"{bucket}/run/manifest.json") == b'{"name": "my-app"}'


@pytest.mark.parametrize(
    "content",
    [json.dumps({"name": "my-app", "version": 3}), json.dumps({"format": "other-tool"})],
)
def test_reading_another_tools_manifest_names_it_and_offers_no_overwrite(tmp_path, content):
    (tmp_path / "manifest.json").write_text(content)
    with pytest.raises(ManifestError, match=r"is not a graphsplit manifest") as e:
        CachedDataset(tmp_path)
    message = str(e.value)
    assert "manifest.json" in message and "another tool" in message
    assert "never replaces or deletes a file it did not write" in message
    assert "overwrite=True" not in message
    assert (tmp_path / "manifest.json").read_text() == content
