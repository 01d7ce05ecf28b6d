"""Two accelerate processes caching batches of different shape signatures into one cache: the
manifest records every plan (the one only process 1 made too), each sample's plan, and stage 2
from that cache, in a process that made neither, is bit-equal to the unsplit step."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

import graphsplit
from tests.caching.fixtures import worker_environment
from tests.helpers import two_process_launch
from tests.signatures.signature_worker import WIDTHS, widths_loader
from tests.signatures.test_dispatch import _batch, _loss_and_grads, _model

WORKER = Path(__file__).with_name("signature_worker.py")


def test_two_processes_caching_two_signatures_record_both_plans_and_train_exactly(tmp_path):
    pytest.importorskip("accelerate")
    path, report = tmp_path / "cache", tmp_path / "report"
    command = two_process_launch(str(WORKER), str(path), str(report))
    finished = subprocess.run(command, env=worker_environment(), capture_output=True, timeout=240)
    assert finished.returncode == 0, finished.stderr.decode()[-4000:]
    made = [json.loads(report.with_suffix(f".{rank}.json").read_text())["plans"] for rank in (0, 1)]
    assert len(made[0]) == 1 and len(made[1]) == 2  # only process 1 saw width 24
    first, second = made[1]
    assert made[0] == [first]

    manifest = json.loads((path / "manifest.json").read_text())
    assert list(manifest["plans"]) == [first, second] and manifest["first_plan"] == first
    signed = {
        key: sig
        for shard in manifest["shards"]
        for key, sig in zip(shard["keys"], shard.get("signatures") or [first] * len(shard["keys"]))
    }
    expected = {
        f"{i}-{row}": (first if w == 16 else second)
        for i, w in enumerate(WIDTHS)
        for row in range(2)
    }
    assert signed == expected

    model = _model()
    fresh = graphsplit.split(model, kwargs=_batch(16, 2, 0))  # a stage-2 process
    cached = graphsplit.CachedDataset(path, fresh)
    raw = {
        key: {name: value[row] for name, value in batch.items() if name != "key"}
        for batch in widths_loader()
        for row, key in enumerate(batch["key"])
    }
    seen = []
    for step, indices in enumerate(cached.loader(batch_size=2, seed=0).batch_sampler):
        batch = graphsplit.collate([cached[i] for i in indices])
        keys = [cached.keys[i] for i in indices]
        unsplit = {k: torch.stack([raw[key][k] for key in keys]) for k in ("pixels", "target")}
        got = _loss_and_grads(model, lambda b: fresh.stage2(**b), step, dict(batch))
        want = _loss_and_grads(model, lambda b: model(**b), step, unsplit)
        assert torch.equal(got[0], want[0]), keys
        assert all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True)), keys
        seen += keys
    assert sorted(seen) == sorted(raw)
    assert [p.key for p in fresh.plans] == [first, second]  # width 24's rebuilt from the record
