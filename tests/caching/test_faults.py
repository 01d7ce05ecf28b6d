"""Fault injection: each attack on the cache from issue 12, and what it must end in.

Every attack ends in a graphsplit error naming the file and the fix, or in an exact cache;
nothing outside the cache folder is read or written, and nothing hangs (``no_hang`` turns a
hang into a failure). The kill-at-random-points loop is at the end.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from graphsplit.caching.read.audit import check_cache
from graphsplit.caching.read.dataset import CachedDataset
from graphsplit.caching.store import file_writes
from graphsplit.caching.write.cache_run import cache
from graphsplit.errors import (
    CacheError,
    CorruptCacheError,
    DiskFullError,
    ManifestError,
    StaleCacheError,
    UnsafeFileError,
)
from graphsplit.tools.cli import main
from tests.caching.fixtures import (
    SMALL,
    WORKER,
    Interrupt,
    Pictures,
    cache_contents,
    interrupt_after,
    loader,
    make_split,
    rows_by_key,
    short_name,
    worker_environment,
)
from tests.tools.specs import TINY_STEP


@pytest.fixture
def no_hang():
    """Fail a test that blocks for 30 s (a FIFO opened for reading blocks until a writer)."""

    def hung(signum, frame):
        raise TimeoutError("the call hung")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def outside_copy(tmp_path: Path, file: Path) -> Path:
    """A copy of ``file`` outside the cache folder, with identical bytes."""
    outside = tmp_path / "outside" / file.name
    outside.parent.mkdir(exist_ok=True)
    shutil.copyfile(file, outside)
    return outside


def interrupted(tmp_path_or_folder: Path, monkeypatch, shards: int, dataset=None) -> Path:
    folder = tmp_path_or_folder
    with monkeypatch.context() as patch:
        interrupt_after(patch, shards)
        with pytest.raises(Interrupt):
            cache(make_split(), loader(dataset), folder, shard_bytes=SMALL, progress=False)
    return folder


# ------------------------------------------------------------------ power cut before an fsync


@pytest.mark.parametrize("content", [b"", b'{"format": "graphsplit-cache", "form'])
@pytest.mark.parametrize("name", ["header.json", "plan.json"])
def test_a_torn_resume_header_resumes_from_the_shards_that_verify(
    tmp_path, monkeypatch, name, content
):
    whole = tmp_path / "whole"
    cache(make_split(), loader(), whole, shard_bytes=SMALL, progress=False)
    folder = interrupted(tmp_path / "torn", monkeypatch, 3)
    (folder / ".partial" / "header.json").unlink()
    (folder / ".partial" / name).write_bytes(content)  # what a power cut left
    with pytest.warns(UserWarning, match=rf"{name[:-5]}\.json (is empty|is not valid JSON)"):
        info = cache(make_split(), loader(), folder, shard_bytes=SMALL, progress=False)
    assert (info.reused_shards, info.written_shards) == (3, 3)
    assert cache_contents(folder) == cache_contents(whole)


def test_every_file_is_fsynced_before_it_is_renamed_or_named(split, tmp_path, monkeypatch):
    """Progress records excepted: hints checked before use (tests/caching/test_shards.py)."""
    synced: set[str] = set()
    renamed: list[str] = []
    fsync, replace = os.fsync, os.replace

    def spy_fsync(descriptor):
        synced.add(os.readlink(f"/proc/self/fd/{descriptor}"))
        return fsync(descriptor)

    def spy_replace(source, target):
        renamed.append(str(source))
        name = short_name(Path(source).name)
        hint = Path(source).parent.name == ".partial" and name != ".header.json.tmp"
        assert hint or str(source) in synced, source
        return replace(source, target)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "replace", spy_replace)
    cache(split, loader(), tmp_path, shard_bytes=SMALL, progress=False)
    names = {short_name(Path(name).name) for name in renamed}
    expected = {".manifest.json.tmp", ".header.json.tmp", ".constants.safetensors.tmp"}
    assert expected | {f".shard-0000{i}.safetensors.tmp" for i in range(6)} <= names
    records = {f".shard-0000{i}.json.tmp" for i in range(6)} | {".constants.json.tmp"}
    assert records <= names and not records & {short_name(Path(name).name) for name in synced}
    assert str(tmp_path) in synced  # the folder, before the manifest names the shards
    assert str(tmp_path / ".lock") in synced


# ------------------------------------------------------------- symlinks and special files


@pytest.mark.parametrize("verify", [True, False])
def test_a_shard_symlinked_out_of_the_folder_is_never_read(path, tmp_path, verify):
    shard = path / "shard-00001.safetensors"
    outside = outside_copy(tmp_path, shard)
    shard.unlink()
    shard.symlink_to(outside)  # same bytes: only the symlink check can refuse it
    cached = CachedDataset(path, verify=verify)
    assert torch.is_tensor(cached[0]["latents"])  # other shards still read
    with pytest.raises(CorruptCacheError, match=r"(?s)shard-00001.safetensors .*is a symlink"):
        cached[2]
    report = check_cache(path)
    assert [problem.file for problem in report.problems] == ["shard-00001.safetensors"]
    assert "is a symlink" in str(report)


def test_constants_symlinked_out_of_the_folder_are_refused(path, tmp_path):
    constants = path / "constants.safetensors"
    outside = outside_copy(tmp_path, constants)
    constants.unlink()
    constants.symlink_to(outside)
    with pytest.raises(CorruptCacheError, match=r"(?s)constants.safetensors .*is a symlink.*fix"):
        CachedDataset(path)


@pytest.mark.parametrize("target", ["outside", "/proc/self/mem", "/dev/zero"])
def test_a_symlinked_manifest_is_refused_by_every_reader(path, tmp_path, target, capsys):
    manifest = path / "manifest.json"
    outside = outside_copy(tmp_path, manifest) if target == "outside" else Path(target)
    manifest.unlink()
    manifest.symlink_to(outside)
    message = r"(?s)manifest.json is a symlink.*fix:    delete"
    with pytest.raises(ManifestError, match=message):
        CachedDataset(path)
    assert "is a symlink" in str(check_cache(path))
    assert main(["check-cache", str(path)]) == 1
    assert "is a symlink" in capsys.readouterr().out
    with pytest.raises(ManifestError, match=message):
        cache(make_split(), loader(), path, shard_bytes=SMALL, progress=False)


def test_fifos_in_place_of_cache_files_never_hang(path, no_hang):
    (path / "shard-00002.safetensors").unlink()
    os.mkfifo(path / "shard-00002.safetensors")
    cached = CachedDataset(path)
    with pytest.raises(CorruptCacheError, match=r"shard-00002.safetensors .*is a FIFO"):
        cached[4]
    assert "is a FIFO" in str(check_cache(path))
    with pytest.raises(UnsafeFileError, match="is a FIFO"):
        cache(make_split(), loader(), path, shard_bytes=SMALL, progress=False)
    (path / "manifest.json").unlink()
    os.mkfifo(path / "manifest.json")
    with pytest.raises(ManifestError, match=r"manifest\.json is a FIFO"):
        CachedDataset(path)


def test_a_fifo_progress_record_is_redone_without_hanging(tmp_path, monkeypatch, no_hang):
    folder = interrupted(tmp_path, monkeypatch, 3)
    (folder / ".partial" / "shard-00001.json").unlink()
    os.mkfifo(folder / ".partial" / "shard-00001.json")
    info = cache(make_split(), loader(), folder, shard_bytes=SMALL, progress=False)
    assert (info.reused_shards, info.written_shards) == (2, 4)


def test_a_symlinked_partial_folder_is_refused_and_left_alone(split, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "header.json").write_text("precious")
    (elsewhere / ".x.tmp").write_text("precious")
    folder = tmp_path / "cache"
    folder.mkdir()
    (folder / ".partial").symlink_to(elsewhere)
    with pytest.raises(UnsafeFileError, match=r"(?s)\.partial is a symlink.*fix:    delete"):
        cache(split, loader(), folder, progress=False)
    assert sorted(p.name for p in elsewhere.iterdir()) == [".x.tmp", "header.json"]


@pytest.mark.parametrize(
    "planted",
    [".manifest.json.tmp", ".shard-00000.safetensors.tmp", ".constants.safetensors.tmp"],
)
def test_planted_temporary_symlinks_never_redirect_a_write(split, tmp_path, planted):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    folder = tmp_path / "cache"
    folder.mkdir()
    (folder / planted).symlink_to(outside)  # the names graphsplit 0.2 used
    ours = file_writes.temporary_path(folder / short_name(planted)[1:-4])
    ours.symlink_to(outside)  # this process's own name, should anyone guess it
    lock_file = folder / f".lock-{socket.gethostname()}-{os.getpid()}"  # graphsplit 0.1's
    lock_file.symlink_to(outside)
    cache(split, loader(), folder, shard_bytes=SMALL, progress=False)
    assert outside.read_text() == "precious"
    assert len(CachedDataset(folder)) == 12


# ------------------------------------------------------------------------------- JSON bombs


@pytest.mark.parametrize("bomb", ["[" * 200_000, '{"a":' * 200_000])
def test_a_deeply_nested_manifest_is_a_manifest_error_everywhere(path, bomb, capsys):
    (path / "manifest.json").write_text(bomb)
    with pytest.raises(ManifestError, match=r"(?s)nests lists or objects too deeply.*fix"):
        CachedDataset(path)
    assert "too deeply" in str(check_cache(path))
    assert main(["check-cache", str(path)]) == 1
    assert "too deeply" in capsys.readouterr().out


def test_a_deeply_nested_resume_header_is_refused(tmp_path, monkeypatch):
    folder = interrupted(tmp_path, monkeypatch, 1)
    (folder / ".partial" / "header.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ManifestError, match=r"header.json .*too deeply"):
        cache(make_split(), loader(), folder, shard_bytes=SMALL, progress=False)


def test_a_huge_manifest_is_refused_before_it_is_read(path):
    with open(path / "manifest.json", "r+b") as handle:
        handle.truncate(3 << 30)  # sparse: no disk used
    with pytest.raises(ManifestError, match=r"(?s)manifest.json holds 3\.0 GiB, more than"):
        CachedDataset(path)


# ------------------------------------------------------------------------- changed data


def renamed(dataset: Pictures) -> Pictures:
    class Renamed(Pictures):
        def __getitem__(self, index):
            item = super().__getitem__(index)
            item["key"] = f"photo{index:03d}"
            return item

    return Renamed(dataset.length)


def test_a_rerun_with_renamed_keys_is_refused_naming_them(split, tmp_path):
    cache(split, loader(), tmp_path, shard_bytes=SMALL, progress=False)
    with pytest.raises(
        StaleCacheError,
        match=r"(?s)12 sample\(s\) are new \('photo000'.*12 cached sample\(s\) are no longer "
        r"there \('pic000'.*overwrite=True",
    ):
        cache(split, loader(renamed(Pictures())), tmp_path, shard_bytes=SMALL, progress=False)


@pytest.mark.parametrize("keys", [True, False])
def test_a_rerun_with_changed_images_is_refused_naming_them(split, tmp_path, keys):
    cache(split, loader(Pictures(keys=keys)), tmp_path, shard_bytes=SMALL, progress=False)
    changed = Pictures(keys=keys)
    changed.changed = {3: 0.5, 7: 0.5}
    name = "pic00{}" if keys else "{}"
    with pytest.raises(
        StaleCacheError,
        match=rf"2 sample\(s\) changed \('{name.format(3)}', '{name.format(7)}'\)",
    ):
        cache(split, loader(changed), tmp_path, shard_bytes=SMALL, progress=False)
    info = cache(
        split, loader(changed), tmp_path, shard_bytes=SMALL, overwrite=True, progress=False
    )
    assert info.written_shards == 6
    fresh = tmp_path / "fresh"
    cache(split, loader(changed), fresh, shard_bytes=SMALL, progress=False)
    assert cache_contents(tmp_path) == cache_contents(fresh)


def test_kill_change_the_images_rerun_is_refused_or_redone_with_overwrite(tmp_path, monkeypatch):
    folder = interrupted(tmp_path / "cache", monkeypatch, 5)
    changed = Pictures()
    changed.changed = {1: 1.0, 9: 1.0}  # shards 0 and 4 are finished
    with pytest.raises(
        StaleCacheError,
        match=r"(?s)2 sample\(s\) changed \('pic001', 'pic009'\), in finished shard\(s\) "
        r"\[0, 4\].*overwrite=True to redo the changed shards",
    ):
        cache(make_split(), loader(changed), folder, shard_bytes=SMALL, progress=False)
    info = cache(
        make_split(), loader(changed), folder, shard_bytes=SMALL, overwrite=True, progress=False
    )
    assert (info.reused_shards, info.written_shards) == (3, 3)
    fresh = tmp_path / "fresh"
    cache(make_split(), loader(changed), fresh, shard_bytes=SMALL, progress=False)
    assert cache_contents(folder) == cache_contents(fresh)


# ------------------------------------------------------------------------- verify=False


def test_verify_false_refuses_swapped_shards(path):
    first, second = path / "shard-00000.safetensors", path / "shard-00001.safetensors"
    data = first.read_bytes()
    first.write_bytes(second.read_bytes())
    second.write_bytes(data)
    cached = CachedDataset(path, verify=False)
    with pytest.raises(CorruptCacheError, match=r"(?s)shard-00000.*sample keys written inside"):
        cached[0]
    assert torch.is_tensor(cached[4]["latents"])


def test_flipped_bytes_are_the_checksums_job(path):
    shard = path / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # inside the last tensor's data: headers, sizes and keys still agree
    shard.write_bytes(bytes(data))
    CachedDataset(path, verify=False)[2]  # documented: verify=False does not hash
    with pytest.raises(CorruptCacheError, match="xxh3 checksum differs"):
        CachedDataset(path)[2]


# ----------------------------------------------------------------------------- disk full


def full_at(monkeypatch, name: str) -> None:
    """The disk runs full while writing the file whose name contains ``name``."""
    write_all = file_writes._write_all

    def write(descriptor, data):
        if name in short_name(Path(os.readlink(f"/proc/self/fd/{descriptor}")).name):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write_all(descriptor, data)

    monkeypatch.setattr(file_writes, "_write_all", write)


@pytest.mark.parametrize(
    "name",
    [
        ".shard-00003.safetensors.tmp",
        ".constants.safetensors.tmp",
        ".lock",
        ".header.json.tmp",
        ".shard-00002.json.tmp",
        ".manifest.json.tmp",
    ],
)
def test_a_full_disk_anywhere_is_one_error_and_the_run_resumes(tmp_path, monkeypatch, name):
    whole = tmp_path / "whole"
    cache(make_split(), loader(), whole, shard_bytes=SMALL, progress=False)
    folder = tmp_path / "cache"
    with monkeypatch.context() as patch:
        full_at(patch, name)
        with pytest.raises(DiskFullError, match=r"(?s)no room to write .*needs .* resumes"):
            cache(make_split(), loader(), folder, shard_bytes=SMALL, progress=False)
    leftovers = [entry.name for entry in folder.rglob("*") if entry.name.endswith(".tmp")]
    assert leftovers == [] and not (folder / "manifest.json").exists()
    cache(make_split(), loader(), folder, shard_bytes=SMALL, progress=False)  # room again
    assert cache_contents(folder) == cache_contents(whole)


def test_a_real_file_size_limit_is_a_disk_full_error_and_the_run_resumes(tmp_path):
    """No mount needed: ``ulimit -f 3`` makes the kernel refuse writes past 1536 bytes (EFBIG),
    which every shard and record fits under and the manifest does not."""
    folder = tmp_path / "cache"
    command = f"trap '' XFSZ; ulimit -f 3; exec {sys.executable} {WORKER} {folder}"
    worker = subprocess.run(
        ["bash", "-c", command],
        env=worker_environment(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert worker.returncode == 1
    assert "DiskFullError: no room to write" in worker.stderr
    assert "File too large" in worker.stderr and "resumes" in worker.stderr
    assert "manifest.json" in worker.stderr and not list(folder.rglob("*.tmp"))
    info = cache(make_split(), loader(), folder, shard_bytes=SMALL, progress=False)
    assert (info.reused_shards, info.written_shards) == (6, 0)
    whole = tmp_path / "whole"
    cache(make_split(), loader(), whole, shard_bytes=SMALL, progress=False)
    assert cache_contents(folder) == cache_contents(whole)


# ------------------------------------------------------------------------------ the folder


def test_a_cache_path_that_is_a_file_is_a_cache_error(split, tmp_path, capsys):
    existing = tmp_path / "cache"
    existing.write_text("not a folder")
    with pytest.raises(CacheError, match=r"(?s)is an existing file, not a folder.*fix"):
        cache(split, loader(), existing, progress=False)
    with pytest.raises(CacheError, match="is an existing file"):
        cache(split, loader(), existing / "inner", progress=False)
    assert existing.read_text() == "not a folder"
    assert main(["cache", f"{TINY_STEP}:step", "--out", str(existing)]) == 2
    error = capsys.readouterr().err
    assert "--out" in error and "is an existing file, not a folder" in error and "fix:" in error
    assert "Traceback" not in error


# ------------------------------------------------------- killed at random points, resumed


@pytest.mark.slow
def test_killed_at_20_random_points_then_resumed_equals_an_uninterrupted_cache(tmp_path):
    whole = tmp_path / "whole"
    cache(make_split(), loader(Pictures(12)), whole, shard_bytes=SMALL, progress=False)
    expected = rows_by_key(whole)
    counted = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path / "counted"), "--die-at", "0"],
        env=worker_environment(),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    operations = int(counted.stdout.split("operations:")[1])
    points = sorted(random.Random(12).sample(range(1, operations + 1), 20))
    for point in points:
        folder = tmp_path / f"killed-at-{point}"
        died = subprocess.run(
            [sys.executable, str(WORKER), str(folder), "--die-at", str(point)],
            env=worker_environment(),
            capture_output=True,
            timeout=120,
        )
        assert died.returncode == 137, (point, died.stderr[-2000:])
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing torn: every record was fsync'd
            info = cache(
                make_split(), loader(Pictures(12)), folder, shard_bytes=SMALL, progress=False
            )
        assert info.num_samples == 12, point
        assert cache_contents(folder) == cache_contents(whole), point
        resumed = rows_by_key(folder)
        assert resumed.keys() == expected.keys()
        for key, rows in expected.items():
            for name, value in rows.items():
                assert torch.equal(resumed[key][name], value), (point, key, name)
        assert sorted(entry.name for entry in folder.iterdir()) == sorted(
            entry.name for entry in whole.iterdir()
        ), point
