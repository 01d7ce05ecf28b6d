"""The folder lock: live, foreign, unreadable and stale locks."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from graphsplit.caching import run
from graphsplit.caching.run import cache
from graphsplit.errors import CacheLockedError
from tests.caching.fixtures import loader


def write_lock(folder: Path, **owner) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ".lock").write_text(json.dumps({"since": "earlier", **owner}))


def test_lock_held_by_a_live_process_refuses(split, tmp_path):
    write_lock(tmp_path, pid=os.getpid(), host=socket.gethostname())
    with pytest.raises(
        CacheLockedError, match=rf"being written by process {os.getpid()}"
    ) as caught:
        cache(split, loader(), tmp_path, progress=False)
    assert "delete" in str(caught.value) and ".lock" in str(caught.value)
    assert (tmp_path / ".lock").exists()  # not ours to remove


def test_lock_of_another_host_refuses(split, tmp_path):
    write_lock(tmp_path, pid=1, host="elsewhere")
    with pytest.raises(CacheLockedError, match="on host 'elsewhere'"):
        cache(split, loader(), tmp_path, progress=False)


def test_unreadable_lock_refuses(split, tmp_path):
    tmp_path.joinpath(".lock").write_text("garbage")
    with pytest.raises(CacheLockedError, match="unknown process"):
        cache(split, loader(), tmp_path, progress=False)


def test_stale_lock_of_a_dead_process_is_taken_over(split, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write_lock(tmp_path, pid=dead.pid, host=socket.gethostname())
    cache(split, loader(), tmp_path, progress=False)
    assert not (tmp_path / ".lock").exists()


def test_lock_is_held_while_writing(split, tmp_path, monkeypatch):
    seen = []
    original = run.write_shards

    def spy(*args, **kwargs):
        seen.append(json.loads((tmp_path / ".lock").read_text()))
        return original(*args, **kwargs)

    monkeypatch.setattr(run, "write_shards", spy)
    cache(split, loader(), tmp_path, progress=False)
    assert seen[0]["pid"] == os.getpid() and seen[0]["host"] == socket.gethostname()
