"""cache(durable=False): no fsyncs, the same files, and never read wrong after a restart.

A restart is simulated by changing what ``durability.boot_id`` answers; a power cut's damage
by flipping a byte of a shard after the cache was written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from graphsplit.caching.format.layout import Manifest, Unsynced
from graphsplit.caching.read.audit import check_cache
from graphsplit.caching.read.dataset import CachedDataset
from graphsplit.caching.store import durability
from graphsplit.caching.store.record_files import read_manifest
from graphsplit.caching.store.remote import RemotePath
from graphsplit.caching.write.cache_run import cache
from graphsplit.errors import CorruptCacheError, ManifestError
from graphsplit.tools.cli import main
from tests.caching.fixtures import (
    SMALL,
    Interrupt,
    cache_contents,
    flip_last_byte,
    interrupt_after,
    loader,
    make_split,
    rewrite_manifest,
    short_name,
)
from tests.tools.specs import TINY_STEP

OTHER_BOOT = "00000000-0000-4000-8000-000000000000"
THIS_BOOT = durability.boot_id()


def write(folder: Path, **options) -> Path:
    cache(make_split(), loader(), folder, shard_bytes=SMALL, progress=False, **options)
    return folder


def manifest_document(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def without_unsynced(contents: dict) -> dict:
    contents["manifest"].pop("unsynced", None)
    return contents


@pytest.fixture
def restarted(monkeypatch):
    """From here on the machine has restarted: another boot id."""
    monkeypatch.setattr(durability, "boot_id", lambda: OTHER_BOOT)


@pytest.fixture
def unsynced(tmp_path):
    """A cache written with durable=False in this boot (6 shards)."""
    return write(tmp_path / "unsynced", durable=False)


@pytest.fixture
def fsyncs(monkeypatch):
    """The paths of every os.fsync call from here on."""
    synced: list[str] = []
    fsync = os.fsync

    def spy(descriptor):
        synced.append(os.readlink(f"/proc/self/fd/{descriptor}"))
        return fsync(descriptor)

    monkeypatch.setattr(os, "fsync", spy)
    return synced


# ------------------------------------------------------------------------------- writing


def test_durable_false_makes_no_fsync_and_writes_the_same_files(tmp_path, fsyncs):
    write(tmp_path / "fast", durable=False)
    assert fsyncs == []
    write(tmp_path / "durable")
    assert fsyncs  # the durable run does fsync (tests/caching/test_faults.py says what)
    fast, durable = cache_contents(tmp_path / "fast"), cache_contents(tmp_path / "durable")
    assert fast["files"] == durable["files"]  # byte for byte
    assert without_unsynced(fast) == durable


def test_the_manifest_records_the_boot_of_an_unsynced_cache_only(tmp_path, unsynced):
    assert manifest_document(unsynced)["unsynced"] == {"boot_id": durability.boot_id()}
    assert read_manifest(unsynced).unsynced == Unsynced(durability.boot_id())
    durable = write(tmp_path / "durable")
    assert "unsynced" not in manifest_document(durable)  # as graphsplit wrote it before
    assert read_manifest(durable).unsynced is None


def test_the_boot_id_is_linuxs(tmp_path):
    if not durability.BOOT_ID_FILE.exists():
        pytest.skip("no boot id on this system")
    assert durability.boot_id() == durability.BOOT_ID_FILE.read_text().strip() != ""


def test_a_cache_on_an_object_store_is_never_recorded_as_unsynced():
    remote = RemotePath.__new__(RemotePath)  # an object store's puts are durable anyway
    assert durability.unsynced_record(remote, durable=False) is None
    assert durability.unsynced_record(Path("/x"), durable=True) is None
    assert durability.unsynced_record(Path("/x"), durable=False) == Unsynced(durability.boot_id())


def test_a_malformed_boot_id_is_a_manifest_error_naming_the_field(unsynced):
    rewrite_manifest(unsynced, lambda d: d["unsynced"].update(boot_id="Robert'); DROP"))
    with pytest.raises(ManifestError, match=r"unsynced\.boot_id is .*not a boot id"):
        read_manifest(unsynced)
    rewrite_manifest(unsynced, lambda d: d.update(unsynced={"boot": "x"}))
    with pytest.raises(ManifestError, match=r"unsynced lacks the field\(s\) \['boot_id'\]"):
        read_manifest(unsynced)


# ------------------------------------------------------------------------------- resuming


def killed_after_three_shards_unsynced(folder, monkeypatch):
    """A ``durable=False`` run interrupted after its third shard (as ``kill -9`` would)."""
    with monkeypatch.context() as patch:
        interrupt_after(patch, 3)
        with pytest.raises(Interrupt):
            write(folder, durable=False)


def test_killed_then_resumed_without_fsync_ends_byte_identical(tmp_path, monkeypatch, fsyncs):
    whole = write(tmp_path / "whole")
    folder = tmp_path / "resumed"
    killed_after_three_shards_unsynced(folder, monkeypatch)
    fsyncs.clear()
    info = cache(make_split(), loader(), folder, shard_bytes=SMALL, progress=False, durable=False)
    assert (info.reused_shards, info.written_shards) == (3, 3)
    assert fsyncs == []
    assert without_unsynced(cache_contents(folder)) == cache_contents(whole)
    assert manifest_document(folder)["unsynced"] == {"boot_id": durability.boot_id()}


def test_a_durable_resume_fsyncs_the_shards_an_unsynced_run_left(tmp_path, monkeypatch, fsyncs):
    folder = tmp_path / "mixed"
    killed_after_three_shards_unsynced(folder, monkeypatch)
    info = cache(make_split(), loader(), folder, shard_bytes=SMALL, progress=False)
    assert info.reused_shards == 3
    reused = {str(folder / f"shard-0000{i}.safetensors") for i in range(3)}
    assert reused | {str(folder / "constants.safetensors")} <= set(fsyncs)
    assert "unsynced" not in manifest_document(folder)  # every file is durable now


def test_a_resume_redoes_the_shards_a_power_cut_damaged(tmp_path, monkeypatch):
    whole = write(tmp_path / "whole")
    folder = tmp_path / "cut"
    killed_after_three_shards_unsynced(folder, monkeypatch)
    flip_last_byte(folder / "shard-00001.safetensors")  # its record survived, its bytes did not
    info = cache(make_split(), loader(), folder, shard_bytes=SMALL, progress=False)
    assert (info.reused_shards, info.written_shards) == (2, 4)
    assert cache_contents(folder) == cache_contents(whole)


# ------------------------------------------------------------------------ reading, same boot


def test_in_the_same_boot_an_unsynced_cache_reads_without_verifying(unsynced):
    assert not durability.restarted_since(read_manifest(unsynced))
    flip_last_byte(unsynced / "shard-00002.safetensors")  # not a power cut: a stray write
    cached = CachedDataset(unsynced, verify=False)
    assert not cached.verify
    cached[4]  # read unverified, as any verify=False cache is


# --------------------------------------------------------------------- reading, after restart


def test_after_a_restart_every_shard_is_verified_even_with_verify_false(unsynced, restarted):
    assert durability.restarted_since(read_manifest(unsynced))
    expected = [dict(item) for item in CachedDataset(unsynced)]  # intact: reads as before
    cached = CachedDataset(unsynced, verify=False)
    assert cached.verify
    for item, want in zip(cached, expected):
        assert all(torch.equal(item[name], want[name]) for name in ("latents", "text"))


def test_after_a_restart_a_damaged_shard_is_refused_naming_the_cause(unsynced, restarted):
    flip_last_byte(unsynced / "shard-00002.safetensors")
    cached = CachedDataset(unsynced, verify=False)
    cached[0]  # the other shards still read
    with pytest.raises(CorruptCacheError) as caught:
        cached[4]
    message = str(caught.value)
    assert "shard-00002.safetensors" in message and "checksum differs" in message
    assert "written with durable=False" in message and "restarted since" in message
    assert "overwrite=True" in message
    report = check_cache(unsynced)
    assert not report.ok and "shard-00002.safetensors" in str(report)
    assert "written with durable=False" in report.problems[0].reason


def test_check_cache_names_no_restart_for_a_durable_cache(tmp_path):
    folder = write(tmp_path / "durable")
    flip_last_byte(folder / "shard-00002.safetensors")
    report = check_cache(folder)
    assert not report.ok and "checksum differs" in report.problems[0].reason
    assert "durable=False" not in str(report)


def test_after_a_restart_damaged_constants_are_refused_naming_the_cause(unsynced, restarted):
    flip_last_byte(unsynced / "constants.safetensors")
    with pytest.raises(CorruptCacheError, match=r"durable=False.*restarted since.*every batch"):
        CachedDataset(unsynced, verify=False)


def test_an_unknown_boot_always_counts_as_a_restart(tmp_path, monkeypatch):
    monkeypatch.setattr(durability, "boot_id", lambda: "")
    folder = write(tmp_path / "c", durable=False)
    assert manifest_document(folder)["unsynced"] == {"boot_id": ""}
    assert durability.restarted_since(read_manifest(folder))
    assert CachedDataset(folder, verify=False).verify
    write(folder, durable=False)  # verified, fsync'd, and recorded as durable
    assert "unsynced" not in manifest_document(folder)


# ------------------------------------------------------------- cache() again after a restart


def test_cache_again_after_a_restart_verifies_and_records_the_cache_as_durable(
    tmp_path, unsynced, restarted, fsyncs
):
    durable = write(tmp_path / "durable")
    info = write(unsynced, durable=False)
    assert info is not None
    assert cache_contents(unsynced) == cache_contents(durable)  # no "unsynced" any more
    shards = {str(unsynced / f"shard-0000{i}.safetensors") for i in range(6)}
    assert shards | {str(unsynced / "constants.safetensors"), str(unsynced)} <= set(fsyncs)
    assert any(
        short_name(Path(path).name) == ".manifest.json.tmp" for path in fsyncs
    )  # written durably
    assert not durability.restarted_since(read_manifest(unsynced))


def test_cache_again_after_a_restart_refuses_a_damaged_cache_naming_the_fix(unsynced, restarted):
    flip_last_byte(unsynced / "shard-00003.safetensors")
    with pytest.raises(CorruptCacheError) as caught:
        write(unsynced)
    message = str(caught.value)
    assert "written with durable=False" in message and "restarted since" in message
    assert "1 of its files" in message and "shard-00003.safetensors" in message
    assert "overwrite=True" in message
    assert manifest_document(unsynced)["unsynced"] == {"boot_id": THIS_BOOT}  # kept as it was


def test_overwrite_rebuilds_a_damaged_unsynced_cache(tmp_path, unsynced, restarted):
    durable = write(tmp_path / "durable")
    flip_last_byte(unsynced / "shard-00003.safetensors")
    write(unsynced, overwrite=True)
    assert cache_contents(unsynced) == cache_contents(durable)


# ------------------------------------------------------------------------------ format


def test_a_manifest_without_the_field_is_read_as_durable(unsynced):
    rewrite_manifest(unsynced, lambda d: d.pop("unsynced"))
    assert read_manifest(unsynced).unsynced is None
    assert "unsynced" in {field.name for field in Manifest.__dataclass_fields__.values()}


# ------------------------------------------------------------------------------- CLI


def test_the_cli_no_fsync_flag_writes_an_unsynced_cache(tmp_path, capsys):
    out = tmp_path / "cache"
    assert main(["cache", f"{TINY_STEP}:step", "--out", str(out), "--no-fsync"]) == 0
    assert manifest_document(out)["unsynced"] == {"boot_id": durability.boot_id()}
    assert main(["check-cache", str(out)]) == 0
    durable = tmp_path / "durable"
    assert main(["cache", f"{TINY_STEP}:step", "--out", str(durable)]) == 0
    assert "unsynced" not in manifest_document(durable)
