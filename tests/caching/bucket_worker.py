"""Read one epoch of a mixed-shape cache with ``CachedDataset.loader`` in one of several processes.

Run as::

    accelerate launch --multi_gpu --num_processes 2 tests/caching/bucket_worker.py PATH REPORT

Each process starts ``Accelerator(cpu=True)`` (which initialises ``torch.distributed``), builds
``CachedDataset(PATH).loader(batch_size=3, seed=3)`` with no ``num_replicas`` or ``rank`` (they
come from ``torch.distributed``), trains the loader as it is (not through
``accelerator.prepare``, which would shard the batches again), and writes the sample keys of
each of its batches, the default sharding it found and one all-reduce per batch (which would
hang if the processes had different batch counts) to ``REPORT.<rank>.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from tests.caching.cache_worker import exit_without_interpreter_teardown


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("report")
    args = parser.parse_args()

    from accelerate import Accelerator

    from graphsplit.caching.read.dataset import CachedDataset

    accelerator = Accelerator(cpu=True)
    cached = CachedDataset(args.path)
    loader = cached.loader(batch_size=3, seed=3)
    sampler = loader.batch_sampler
    batches = []
    for batch in loader:
        keys = [cached.keys[index] for index in sampler.epoch_batches(0)[len(batches)]]
        shapes = {name: list(value.shape) for name, value in batch.items()}
        together = torch.ones(())
        torch.distributed.all_reduce(together)  # every process reaches it once per batch
        batches.append({"keys": keys, "shapes": shapes, "processes": int(together)})
    report = {
        "rank": accelerator.process_index,
        "num_replicas": sampler.num_replicas,
        "sampler_rank": sampler.rank,
        "batches": batches,
        "state": loader.state_dict(),
    }
    Path(f"{args.report}.{accelerator.process_index}.json").write_text(json.dumps(report))
    accelerator.wait_for_everyone()
    accelerator.end_training()
    exit_without_interpreter_teardown()


if __name__ == "__main__":
    main()
