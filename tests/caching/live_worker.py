"""Train one epoch with a LiveCache in a separate process, for the kill -9 and accelerate tests.

    python tests/caching/live_worker.py PATH [--die-after K] [--length N]
    accelerate launch --multi_gpu --num_processes 2 tests/caching/live_worker.py PATH --accelerate

The epoch is the fixtures' N pictures (12) in a seeded shuffled order, batches of 2, shards of one
batch. ``--die-after K`` kills this process (SIGKILL, like ``kill -9``) once K shards are
committed, in the middle of the epoch. ``--accelerate`` runs under ``accelerate launch``: each
process steps through its half of the epoch (``accelerator.prepare`` on the loader) and writes
its losses to ``PATH.losses.<rank>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from graphsplit.caching.live import LiveCache
from graphsplit.caching.write.shards import ShardWriter
from tests.caching.fixtures import SMALL, Pictures, loader, make_split


def die_after(count: int) -> None:
    original = ShardWriter.commit
    done: list[int] = []

    def commit(self, shard, temporary, checksum):
        progress = original(self, shard, temporary, checksum)
        done.append(shard.index)
        if len(done) >= count:
            os.kill(os.getpid(), signal.SIGKILL)
        return progress

    ShardWriter.commit = commit  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("--die-after", type=int)
    parser.add_argument("--accelerate", action="store_true")
    parser.add_argument("--length", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.die_after is not None:
        die_after(args.die_after)
    split = make_split()
    epoch = loader(Pictures(args.length), shuffle=True, generator=torch.Generator().manual_seed(3))
    accelerator = None
    if args.accelerate:
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
        epoch = accelerator.prepare(epoch)
    losses = []
    with LiveCache(split, args.path, accelerator=accelerator, shard_bytes=SMALL) as live:
        for batch in epoch:
            torch.manual_seed(len(losses))
            losses.append(float(live.step(batch)))
    if accelerator is not None:
        rank = accelerator.process_index
        Path(f"{args.path}.losses.{rank}.json").write_text(json.dumps(losses))
        from tests.caching.cache_worker import exit_without_interpreter_teardown

        exit_without_interpreter_teardown()  # gloo's teardown abort (see its docstring)


if __name__ == "__main__":
    main()
