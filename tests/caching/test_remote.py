"""Caches on object stores, against a real S3-protocol server (moto's server mode, s3fs).

The round trip (cache, kill -9 mid-run, resume, read, check, the CLI) must end with the same
bytes as a local cache of the same data; the lock object, the fence, ranged and read-through
reads, damaged objects and URLs that cannot be opened are each checked by their outcome.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graphsplit.caching.read.audit import check_cache
from graphsplit.caching.read.collation import collate
from graphsplit.caching.read.dataset import CachedDataset
from graphsplit.caching.store.remote import RemotePath, location
from graphsplit.caching.store.remote_lock import RemoteLock
from graphsplit.caching.write.cache_run import cache
from graphsplit.errors import (
    CacheLockedError,
    CorruptCacheError,
    StaleCacheError,
    StorageError,
    UnsupportedStorageError,
)
from tests.caching.fixtures import (
    SMALL,
    WORKER,
    Pictures,
    cache_contents,
    loader,
    make_split,
    rows_by_key,
    worker_environment,
)
from tests.caching.s3_server import remote_names
from tests.helpers import free_port

LOCAL_FILES = {
    "manifest.json",
    "constants.safetensors",
    *(f"shard-{i:05d}.safetensors" for i in range(6)),
}


@pytest.fixture(scope="module")
def local_twin(tmp_path_factory):
    """The same cache (12 pictures, 6 shards) written to a local folder, to compare with."""
    path = tmp_path_factory.mktemp("twin")
    cache(make_split(), loader(Pictures(12)), path, shard_bytes=SMALL, progress=False)
    return path


def remote_contents(s3, prefix: str) -> dict:
    """:func:`cache_contents` of a remote cache."""
    s3.invalidate_cache()  # the test's own listings predate the run
    manifest = json.loads(s3.cat_file(f"{prefix}/manifest.json"))
    manifest.pop("created")
    # Each file's version (ETag), which a local cache has no need of: the rest is the same.
    for record in [manifest["constants"], *manifest["shards"]]:
        etag = record.pop("etag")
        assert etag == s3.info(f"{prefix}/{record['file']}")["ETag"]
    names = [name for name in remote_names(s3, prefix) if name.endswith(".safetensors")]
    return {
        "manifest": manifest,
        "files": {name: s3.cat_file(f"{prefix}/{name}") for name in names},
    }


def test_cache_read_and_check_round_trip_equals_a_local_cache(s3, bucket, local_twin):
    url = f"s3://{bucket}/runs/cache"
    info = cache(make_split(), loader(Pictures(12)), url, shard_bytes=SMALL, progress=False)
    assert (info.num_samples, info.num_shards, info.written_shards) == (12, 6, 6)
    assert str(info.path) == url
    # Published whole: no progress records, no lock, nothing temporary left behind.
    assert set(remote_names(s3, f"{bucket}/runs/cache")) == LOCAL_FILES
    assert remote_contents(s3, f"{bucket}/runs/cache") == cache_contents(local_twin)
    report = check_cache(url)
    assert report.ok and report.num_shards == 6, str(report)
    cached = CachedDataset(url, make_split())
    expected = rows_by_key(local_twin)
    for item in cached:
        for name, value in expected[item["key"]].items():
            assert torch.equal(item[name], value), (item["key"], name)
    batch = collate([cached[0], cached[1]])
    assert set(batch) == {"latents", "text", "table"} and batch["text"].shape[1] == 2
    # A rerun finds the complete cache and writes nothing.
    again = cache(make_split(), loader(Pictures(12)), url, shard_bytes=SMALL, progress=False)
    assert (again.written_shards, again.reused_shards) == (0, 6)


def test_a_run_killed_mid_way_resumes_to_the_same_bytes(s3, bucket, local_twin):
    url = f"s3://{bucket}/cache"
    command = [sys.executable, str(WORKER), url, "--shard-bytes", str(SMALL), "--pause-after", "2"]
    worker = subprocess.Popen(
        command,
        env=worker_environment(),  # the server's endpoint and keys included
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stdout.readline().strip() == "paused"  # 2 shards committed, then blocked
        os.kill(worker.pid, signal.SIGKILL)
    finally:
        worker.wait()
    assert worker.returncode == -signal.SIGKILL
    left = remote_names(s3, f"{bucket}/cache")
    assert "manifest.json" not in left and ".lock" in left  # the dead run's lock object
    finished = [name for name in left if name.startswith(".partial/shard-")]
    assert len(finished) >= 2
    # The lock names a dead process of this host: the same call takes it over and resumes.
    info = cache(make_split(), loader(Pictures(12)), url, shard_bytes=SMALL, progress=False)
    assert info.reused_shards == len(finished) and info.written_shards == 6 - len(finished)
    assert remote_contents(s3, f"{bucket}/cache") == cache_contents(local_twin)
    assert set(remote_names(s3, f"{bucket}/cache")) == LOCAL_FILES
    assert check_cache(url).ok


def test_the_cli_caches_to_and_checks_an_s3_url(s3, bucket, tmp_path, monkeypatch, capsys):
    from graphsplit.tools.cli import main
    from tests.tools.specs import TINY_STEP

    monkeypatch.chdir(tmp_path)  # a mangled URL would appear here as a folder "s3:"
    url = f"s3://{bucket}/cli-cache"
    assert main(["cache", f"{TINY_STEP}:step", "--out", url]) == 0
    assert f"graphsplit cache at {url}:" in capsys.readouterr().out
    assert "manifest.json" in remote_names(s3, f"{bucket}/cli-cache")
    assert main(["check-cache", url]) == 0
    assert "OK" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "path",
    [Path("s3://bucket/cache"), "s3:/bucket/cache", "gcs:/bucket/x"],
    ids=["pathlib-mangled", "one-slash", "gcs-one-slash"],
)
def test_a_mangled_url_is_refused_and_creates_no_local_folder(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        UnsupportedStorageError, match=r"(?s)looks like a URL.*fix:    pass the URL"
    ):
        cache(make_split(), loader(Pictures(2)), path, progress=False)
    with pytest.raises(UnsupportedStorageError, match="looks like a URL"):
        CachedDataset(path)
    assert list(tmp_path.iterdir()) == []


def test_the_cli_refuses_a_mangled_out(tmp_path, monkeypatch, capsys):
    from graphsplit.tools.cli import main
    from tests.tools.specs import TINY_STEP

    monkeypatch.chdir(tmp_path)
    assert main(["cache", f"{TINY_STEP}:step", "--out", "s3:/bucket/cache"]) == 2
    assert "--out: the cache path 's3:/bucket/cache' looks like a URL" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_urls_fsspec_cannot_open_are_named_errors():
    with pytest.raises(UnsupportedStorageError, match=r"(?s)nope://.*fsspec does not know.*fix"):
        location("nope://bucket/cache")
    with pytest.raises(UnsupportedStorageError, match=r"names no folder"):
        location("memory://")
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        with pytest.raises(UnsupportedStorageError, match=r"(?s)gs://.*pip install gcsfs"):
            location("gs://bucket/cache")


def test_file_urls_are_local_folders_with_every_local_guarantee(tmp_path):
    where = location(f"file://{tmp_path}/cache")
    assert where == tmp_path / "cache"
    info = cache(make_split(), loader(Pictures(4)), f"file://{tmp_path}/cache", progress=False)
    assert info.path == tmp_path / "cache" and (tmp_path / "cache" / "manifest.json").exists()


def test_a_missing_bucket_is_a_storage_error(s3_endpoint):
    with pytest.raises(StorageError, match=r"(?s)bucket 'no-such-bucket'.*fix:    create"):
        cache(make_split(), loader(Pictures(2)), "s3://no-such-bucket/cache", progress=False)


def test_the_lock_object_refuses_a_second_writer_and_takes_over_a_dead_one(s3, bucket):
    path = location(f"s3://{bucket}/cache") / ".lock"
    assert isinstance(path, RemotePath)
    first = RemoteLock(path)
    first.acquire()
    with pytest.raises(CacheLockedError, match=rf"(?s)names process {os.getpid()}.*wait"):
        RemoteLock(path).acquire()
    first.confirm()
    first.release()
    assert not s3.exists(f"{bucket}/cache/.lock")
    # A lock left by a dead process of this host is taken over.
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True
    )
    owner = {"pid": int(dead.stdout), "host": socket.gethostname(), "since": "x", "token": "abc"}
    s3.pipe_file(f"{bucket}/cache/.lock", json.dumps(owner).encode())
    second = RemoteLock(path)
    second.acquire()
    assert json.loads(s3.cat_file(f"{bucket}/cache/.lock"))["token"] == second.token
    second.release()
    assert remote_names(s3, f"{bucket}/cache") == []  # the takeover claim is gone too
    # Another host's lock is never guessed dead; garbage is reported, not parsed into a crash.
    s3.pipe_file(f"{bucket}/cache/.lock", json.dumps({**owner, "host": "elsewhere"}).encode())
    with pytest.raises(CacheLockedError, match=r"(?s)host 'elsewhere'.*If it is dead.*delete"):
        RemoteLock(path).acquire()
    s3.pipe_file(f"{bucket}/cache/.lock", b"\x00{garbage")
    with pytest.raises(CacheLockedError, match="does not name its writer"):
        RemoteLock(path).acquire()


def test_a_run_whose_lock_was_taken_publishes_nothing(s3, bucket, monkeypatch):
    from graphsplit.caching.write import cache_run as run

    def steal(self):
        s3.pipe_file(f"{bucket}/cache/.lock", b'{"pid": 1, "host": "thief", "token": "other"}')
        return original(self)

    original = RemoteLock.confirm
    monkeypatch.setattr(RemoteLock, "confirm", steal)
    with pytest.raises(CacheLockedError, match=r"(?s)lost the lock.*host 'thief'.*resumes"):
        run.cache(make_split(), loader(Pictures(4)), f"s3://{bucket}/cache", progress=False)
    left = remote_names(s3, f"{bucket}/cache")
    assert "manifest.json" not in left and ".lock" in left  # the thief's lock is kept


def test_damaged_remote_shards_are_found_by_check_and_refused_by_readers(s3, bucket):
    url = f"s3://{bucket}/cache"
    cache(make_split(), loader(Pictures(12)), url, shard_bytes=SMALL, progress=False)
    shard = f"{bucket}/cache/shard-00002.safetensors"
    data = bytearray(s3.cat_file(shard))
    data[-1] ^= 0xFF
    s3.pipe_file(shard, bytes(data))
    # The object is another version (ETag) than the manifest records: refused by every reader,
    # verify=False included.
    report = check_cache(url)
    assert [problem.file for problem in report.problems] == ["shard-00002.safetensors"]
    assert "changed after the cache was written" in str(report)
    cached = CachedDataset(url)
    assert torch.equal(cached[0]["latents"], CachedDataset(url, verify=False)[0]["latents"])
    with pytest.raises(CorruptCacheError, match=r"(?s)shard-00002.*changed after.*pic004"):
        cached[4]
    with pytest.raises(CorruptCacheError, match=r"(?s)shard-00002.*changed after.*pic004"):
        CachedDataset(url, verify=False)[4]
    # A cache written before records held versions is checked by checksum, and by header.
    manifest = json.loads(s3.cat_file(f"{bucket}/cache/manifest.json"))
    for record in manifest["shards"]:
        del record["etag"]
    s3.pipe_file(f"{bucket}/cache/manifest.json", json.dumps(manifest).encode())
    report = check_cache(url)
    assert [problem.file for problem in report.problems] == ["shard-00002.safetensors"]
    assert "checksum differs" in str(report)
    with pytest.raises(CorruptCacheError, match=r"(?s)shard-00002.*checksum differs.*pic004"):
        CachedDataset(url)[4]
    # verify=False still reads each shard's header by ranges: a swapped shard is refused.
    s3.pipe_file(shard, s3.cat_file(f"{bucket}/cache/shard-00003.safetensors"))
    with pytest.raises(CorruptCacheError, match=r"sample keys written inside it differ"):
        CachedDataset(url, verify=False)[4]


def test_local_cache_keeps_verified_copies_that_read_like_a_local_cache(
    s3, bucket, local_twin, tmp_path
):
    url = f"s3://{bucket}/cache"
    cache(make_split(), loader(Pictures(12)), url, shard_bytes=SMALL, progress=False)
    scratch = tmp_path / "scratch"
    cached = CachedDataset(url, make_split(), local_cache=scratch)
    expected = rows_by_key(local_twin)
    assert [item["key"] for item in cached] == list(expected)
    (copies,) = list(scratch.iterdir())
    records = {
        record.file: record for record in [cached.manifest.constants, *cached.manifest.shards]
    }
    # Copies are named by their content's checksum, not by their URL.
    named = {
        f"{record.checksum.replace(':', '-')}.safetensors": file for file, record in records.items()
    }
    assert sorted(entry.name for entry in copies.iterdir()) == sorted(named)
    for copy, name in named.items():
        assert (copies / copy).read_bytes() == (local_twin / name).read_bytes()
    # A damaged local copy is replaced by a fresh download; a damaged remote one is refused.
    by_file = {name: copy for copy, name in named.items()}
    (copies / by_file["shard-00001.safetensors"]).write_bytes(b"junk")
    assert torch.equal(
        CachedDataset(url, local_cache=scratch)[2]["text"], expected["pic002"]["text"]
    )
    shard = f"{bucket}/cache/shard-00005.safetensors"
    s3.pipe_file(shard, s3.cat_file(shard)[:-1] + b"\x00")
    with pytest.raises(CorruptCacheError, match=r"(?s)shard-00005.*changed after the cache"):
        CachedDataset(url, local_cache=tmp_path / "fresh")[10]


def test_a_remote_cache_of_another_split_is_refused_then_overwritten(s3, bucket):
    url = f"s3://{bucket}/cache"
    cache(make_split(), loader(Pictures(4)), url, progress=False)
    with pytest.raises(StaleCacheError, match="overwrite=True"):
        cache(make_split(scale=3.0), loader(Pictures(4)), url, progress=False)
    info = cache(make_split(scale=3.0), loader(Pictures(4)), url, progress=False, overwrite=True)
    assert info.written_shards == info.num_shards
    assert len(CachedDataset(url, make_split(scale=3.0))) == 4
    with pytest.raises(StaleCacheError, match="not made by this split"):
        CachedDataset(url, make_split())


@pytest.mark.parametrize("umask", [0o002, 0o022])
def test_shards_and_manifest_share_one_mode_that_honours_the_umask(tmp_path, umask):
    from graphsplit.caching.store.lock import FolderLock

    previous = os.umask(umask)
    try:
        cache(
            make_split(), loader(Pictures(4)), tmp_path / "cache", shard_bytes=SMALL, progress=False
        )
        lock = FolderLock(tmp_path / "cache" / ".lock")  # a teammate must be able to resume
        lock.acquire()
        lock_mode = (tmp_path / "cache" / ".lock").stat().st_mode & 0o777
        lock.release()
    finally:
        os.umask(previous)
    modes = {entry.name: entry.stat().st_mode & 0o777 for entry in (tmp_path / "cache").iterdir()}
    assert {"manifest.json", "constants.safetensors", "shard-00000.safetensors"} <= set(modes)
    modes[".lock"] = lock_mode
    assert set(modes.values()) == {0o666 & ~umask}, modes


@pytest.mark.slow
def test_two_accelerate_processes_write_one_s3_cache_and_train_from_it(
    s3, bucket, local_twin, tmp_path
):
    pytest.importorskip("accelerate")
    url = f"s3://{bucket}/shared"
    report = tmp_path / "report"
    command = [
        *(sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu"),
        *("--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no"),
        *("--dynamo_backend", "no", "--main_process_port", str(free_port())),
        *(str(WORKER), url, "--accelerate", "--train-steps", "2", "--report", str(report)),
    ]
    finished = subprocess.run(command, env=worker_environment(), capture_output=True, timeout=180)
    assert finished.returncode == 0, finished.stderr.decode()[-4000:]
    reports = [json.loads(report.with_suffix(f".{rank}.json").read_text()) for rank in (0, 1)]
    assert reports[0]["written"] == [0, 2, 4] and reports[1]["written"] == [1, 3, 5]
    assert reports[0]["checksum"] == reports[1]["checksum"]  # DDP trained from the bucket
    assert remote_contents(s3, f"{bucket}/shared") == cache_contents(local_twin)


def test_dataloader_workers_read_a_remote_cache(s3, bucket, local_twin):
    url = f"s3://{bucket}/cache"
    cache(make_split(), loader(Pictures(12)), url, shard_bytes=SMALL, progress=False)
    cached = CachedDataset(url, make_split())
    context = "fork" if "fork" in torch.multiprocessing.get_all_start_methods() else None
    batches = torch.utils.data.DataLoader(
        cached, batch_size=4, num_workers=2, collate_fn=collate, multiprocessing_context=context
    )
    local = CachedDataset(local_twin)
    expected = collate([local[i] for i in range(12)])
    together = {name: [] for name in expected}
    for batch in batches:  # each worker process opens the store itself (s3fs is not fork-safe)
        for name, value in batch.items():
            together[name].append(value)
    assert torch.equal(torch.cat(together["latents"]), expected["latents"])
    assert torch.equal(torch.cat(together["text"], dim=1), expected["text"])
