"""A cache written by graphsplit 0.2 before the second redesign stays valid after it.

The folder ``data/graphsplit-0.2-format-2`` was written by ``python -m
tests.caching.format2_fixture`` on the release before the modules moved. Moving a module must
not change stage 1's code (whose digest is the cache's ``code`` fingerprint), the weights digest
or the format: the same split made today reads the old folder as its own, rerunning ``cache``
on it writes nothing, and stage 2 trains from it exactly as the step does.
"""

from __future__ import annotations

import shutil

import torch
from torch.utils.data import DataLoader

import graphsplit
from tests.caching.format2_fixture import FIXTURE, SAMPLES, Step, dataset, example


def _split() -> tuple[Step, graphsplit.Split]:
    step = Step()
    return step, graphsplit.split(step, args=example())


def test_the_old_cache_checks_healthy():
    report = graphsplit.check_cache(FIXTURE)
    assert report.ok, str(report)
    assert report.num_samples == SAMPLES


def test_the_old_cache_is_read_as_this_splits_own_and_holds_stage_1_outputs_bit_for_bit():
    _, split = _split()
    data = graphsplit.CachedDataset(FIXTURE, split)
    assert len(data) == SAMPLES
    # Batches of two, as the cache was written: a conv over another batch size may round
    # differently, and the cache promises stage 1's outputs for the batches it was given.
    for first, raw in enumerate(DataLoader(dataset(), batch_size=2)):
        with torch.inference_mode():
            expected = split.stage1(**raw)
        for row in range(2):
            item = data[2 * first + row]
            assert item["key"] == str(2 * first + row)
            for name, value in expected.items():
                assert torch.equal(item[name], value[row]), name


def test_rerunning_cache_on_the_old_folder_writes_nothing(tmp_path):
    _, split = _split()
    folder = tmp_path / "cache"
    shutil.copytree(FIXTURE, folder)
    before = {path.name: path.read_bytes() for path in folder.iterdir()}
    info = graphsplit.cache(split, DataLoader(dataset(), batch_size=2), folder, progress=False)
    assert (info.written_shards, info.reused_shards) == (0, 1)
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == before


def test_stage_2_from_the_old_cache_gives_the_steps_loss_and_gradients_bit_for_bit():
    step, split = _split()
    loader = DataLoader(
        graphsplit.CachedDataset(FIXTURE, split), batch_size=2, collate_fn=graphsplit.collate
    )
    for cached, raw in zip(loader, DataLoader(dataset(), batch_size=2), strict=True):
        cached.pop("key", None)
        torch.manual_seed(7)
        loss = split.stage2(**cached)
        loss.backward()
        grads = [p.grad.clone() for p in step.head.parameters()]
        step.zero_grad()
        torch.manual_seed(7)
        expected = step(raw["pixels"], raw["ids"])
        expected.backward()
        assert torch.equal(loss, expected)
        for grad, param in zip(grads, step.head.parameters(), strict=True):
            assert torch.equal(grad, param.grad)
        step.zero_grad()
