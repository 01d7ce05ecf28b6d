"""cache() across accelerate processes: a real two-process launch, and how processes agree."""

from __future__ import annotations

import json
import math
import subprocess
from types import SimpleNamespace

import pytest

from graphsplit.caching.format.fingerprint import fingerprint
from graphsplit.caching.read.dataset import CachedDataset
from graphsplit.caching.write.cache_run import cache
from graphsplit.caching.write.processes import Processes
from graphsplit.errors import CacheError, Fix, Remedy, StaleCacheError
from tests.caching.fixtures import (
    SMALL,
    WORKER,
    Pictures,
    cache_contents,
    loader,
    make_split,
    worker_environment,
)
from tests.helpers import two_process_launch

# -------------------------------------------------------------------------------- a real launch


def test_two_accelerate_processes_write_the_single_process_cache_and_train(tmp_path):
    pytest.importorskip("accelerate")
    single = tmp_path / "single"
    cache(make_split(), loader(Pictures(12)), single, shard_bytes=SMALL, progress=False)
    shared = tmp_path / "shared"
    report = tmp_path / "report"
    command = two_process_launch(
        str(WORKER), str(shared), "--accelerate", "--train-steps", "3", "--report", str(report)
    )
    finished = subprocess.run(command, env=worker_environment(), capture_output=True, timeout=120)
    assert finished.returncode == 0, finished.stderr.decode()[-4000:]
    reports = [json.loads(report.with_suffix(f".{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["world"] for r in reports] == [2, 2]
    assert reports[0]["written"] == [0, 2, 4] and reports[1]["written"] == [1, 3, 5]
    # the same cache as one process writes, file for file
    assert cache_contents(shared) == cache_contents(single)
    # stage 2 trained with DDP: finite losses, and both processes end with the same weights
    assert all(r["ddp"] == "DistributedDataParallel" for r in reports)
    assert all(math.isfinite(loss) for r in reports for loss in r["losses"])
    assert reports[0]["checksum"] == reports[1]["checksum"]
    assert len(CachedDataset(shared, make_split())) == 12


# ------------------------------------------------------- how processes agree (no launch needed)


def fake_processes(rank: int) -> Processes:
    return Processes(SimpleNamespace(process_index=rank, num_processes=2))


def test_a_failure_in_another_process_fails_every_process(monkeypatch):
    utils = pytest.importorskip("accelerate.utils")
    fix = Fix("pass {remedy} to rebuild it", Remedy.OVERWRITE)
    others = [None, ("StaleCacheError", "the frozen weights differ", fix)]
    monkeypatch.setattr(utils, "gather_object", lambda mine: [mine[0], others[1]])
    with pytest.raises(
        StaleCacheError, match="process 1 failed: the frozen weights differ"
    ) as caught:
        fake_processes(0).everywhere(lambda: None)
    assert caught.value.fix == fix  # the other process's fix, typed
    assert str(caught.value).endswith("\n  fix:    pass overwrite=True to rebuild it")


def test_a_failure_on_the_main_process_reaches_the_others(monkeypatch):
    utils = pytest.importorskip("accelerate.utils")

    def broadcast(objects, from_process):
        objects[0] = ("error", ("OSError", "disk on fire", None))
        return objects

    monkeypatch.setattr(utils, "broadcast_object_list", broadcast)
    with pytest.raises(CacheError, match="process 0 failed: OSError: disk on fire"):
        fake_processes(1).on_main(lambda: "never runs here")


def test_processes_with_other_weights_are_refused(monkeypatch):
    utils = pytest.importorskip("accelerate.utils")
    mine = fingerprint(make_split())
    other = {**mine.to_json(), "weights": "sha256:" + "0" * 64}
    monkeypatch.setattr(utils, "gather_object", lambda objects: [objects[0], other])
    with pytest.raises(CacheError, match=r"(?s)process 1 has other weights.*seed random init"):
        fake_processes(0).refuse_other_fingerprints(mine)
