"""The folder lock: held, stale, garbage and planted lock files; races between runs."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from graphsplit.caching.store.lock import FolderLock
from graphsplit.caching.write import cache_run as run
from graphsplit.caching.write.cache_run import cache
from graphsplit.errors import CacheLockedError, UnsafeFileError
from tests.caching.fixtures import loader


def hold_lock(folder: Path, content: bytes) -> int:
    """Lock ``folder/.lock`` as another run would (its own open file), with ``content``."""
    folder.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT)
    os.write(descriptor, content)
    fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return descriptor


def owner(**fields) -> bytes:
    return json.dumps({"since": "earlier", **fields}).encode()


def test_a_held_lock_refuses_and_names_its_holder(split, tmp_path):
    held = hold_lock(tmp_path, owner(pid=4242, host="node-7"))
    try:
        with pytest.raises(
            CacheLockedError, match=r"(?s)being written by process 4242 on host 'node-7'.*wait"
        ):
            cache(split, loader(), tmp_path, progress=False)
        assert (tmp_path / ".lock").read_bytes() == owner(pid=4242, host="node-7")  # untouched
    finally:
        os.close(held)
    cache(split, loader(), tmp_path, progress=False)  # released: the next run goes ahead


@pytest.mark.parametrize(
    "content", [b"garbage", b"[1, 2]", owner(pid=2**80, host=7), b"[" * 100_000, b""]
)
def test_garbage_in_a_held_lock_is_reported_never_a_crash(split, tmp_path, content):
    held = hold_lock(tmp_path, content)
    try:
        with pytest.raises(CacheLockedError, match=r"being written by (another process|process)"):
            cache(split, loader(), tmp_path, progress=False)
    finally:
        os.close(held)


@pytest.mark.parametrize("content", [b"garbage", owner(pid=2**80, host=socket.gethostname())])
def test_a_lock_file_nobody_holds_is_taken_over(split, tmp_path, content):
    (tmp_path / ".lock").write_bytes(content)  # left by a run that died
    cache(split, loader(), tmp_path, progress=False)
    assert not (tmp_path / ".lock").exists()


def test_the_lock_of_a_killed_run_is_taken_over(split, tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys; d = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
            "fcntl.flock(d, fcntl.LOCK_EX); print('locked', flush=True); sys.stdin.read()",
            str(tmp_path / ".lock"),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert holder.stdout.readline() == b"locked\n"
    with pytest.raises(CacheLockedError):
        cache(split, loader(), tmp_path, progress=False)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    holder.stdin.close()
    holder.stdout.close()
    cache(split, loader(), tmp_path, progress=False)
    assert not (tmp_path / ".lock").exists()


def test_runs_racing_for_a_stale_lock_never_both_take_it(tmp_path):
    for round_ in range(30):
        folder = tmp_path / str(round_)
        folder.mkdir()
        (folder / ".lock").write_bytes(owner(pid=999_999_999, host=socket.gethostname()))
        locks = [FolderLock(folder / ".lock") for _ in range(6)]
        start, done = threading.Barrier(len(locks)), threading.Barrier(len(locks))
        outcomes: list[str] = []

        def race(
            lock: FolderLock,
            start: threading.Barrier = start,
            done: threading.Barrier = done,
            outcomes: list[str] = outcomes,
        ) -> None:
            start.wait()
            try:
                lock.acquire()
                outcomes.append("held")
            except CacheLockedError:
                outcomes.append("refused")
            done.wait()  # the winner holds the lock until everyone has tried
            lock.release()

        threads = [threading.Thread(target=race, args=(lock,)) for lock in locks]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sorted(outcomes) == ["held"] + ["refused"] * 5
        assert not (folder / ".lock").exists()


def test_release_removes_only_its_own_lock(tmp_path):
    first = FolderLock(tmp_path / ".lock")
    first.acquire()
    (tmp_path / ".lock").unlink()  # a user deleted it; another run locked a new file
    second = FolderLock(tmp_path / ".lock")
    second.acquire()
    first.release()
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    with pytest.raises(CacheLockedError):
        FolderLock(tmp_path / ".lock").acquire()
    second.release()
    assert not (tmp_path / ".lock").exists()


def test_a_planted_lock_symlink_is_refused_and_its_target_untouched(split, tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    folder = tmp_path / "cache"
    folder.mkdir()
    (folder / ".lock").symlink_to(outside)
    with pytest.raises(UnsafeFileError, match=r"(?s)\.lock is a symlink.*fix:    delete"):
        cache(split, loader(), folder, progress=False)
    assert outside.read_text() == "precious"


def test_a_fifo_lock_is_refused_without_hanging(split, tmp_path):
    os.mkfifo(tmp_path / ".lock")
    with pytest.raises(UnsafeFileError, match=r"\.lock is a FIFO"):
        cache(split, loader(), tmp_path, progress=False)


def test_lock_is_held_while_writing(split, tmp_path, monkeypatch):
    seen = []
    original = run.write_shards

    def spy(*args, **kwargs):
        seen.append(json.loads((tmp_path / ".lock").read_text()))
        with pytest.raises(CacheLockedError):
            FolderLock(tmp_path / ".lock").acquire()
        return original(*args, **kwargs)

    monkeypatch.setattr(run, "write_shards", spy)
    cache(split, loader(), tmp_path, progress=False)
    assert seen[0]["pid"] == os.getpid() and seen[0]["host"] == socket.gethostname()
