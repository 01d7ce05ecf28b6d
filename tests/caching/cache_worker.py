"""Run graphsplit.cache in a separate process, for the kill -9 and accelerate tests.

    python tests/caching/cache_worker.py PATH [--length N] [--shard-bytes B] [--delay S]
        [--die-at K] [--pause-after K] [--seed S]
    accelerate launch --multi_gpu --num_processes 2 tests/caching/cache_worker.py PATH \
        --accelerate [--train-steps N] [--report FILE]

(``--multi_gpu`` picks accelerate's torchrun launcher; ``Accelerator(cpu=True)`` here makes the
processes CPU ones. ``accelerate launch --cpu --num_processes 2`` starts a single process
unless MPI is set up.) ``--delay`` sleeps after each finished shard so a test can kill the run
mid-way; ``--die-at K`` dies like ``kill -9`` before the K-th durable file operation
(0: print how many there are); ``--pause-after K`` prints ``paused`` once K shards are
committed and then blocks until stdin closes, so a test can ``kill -9`` it at a known point
without sleeping; PATH may be a URL (``s3://...``); ``--seed`` picks other pictures;
``--train-steps`` then trains stage 2 on the cache with ``accelerator.prepare`` (DDP) and
writes each process's shards, losses and final parameter checksum to ``FILE.<rank>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from graphsplit.caching.read.collation import collate
from graphsplit.caching.read.dataset import CachedDataset
from graphsplit.caching.write.cache_run import cache
from graphsplit.caching.write.shards import ShardWriter
from tests.caching.fixtures import Pictures, loader, make_split

WRITTEN: list[int] = []  # the shards this process wrote


def watch_shards(delay: float, pause_after: int | None = None) -> None:
    """Record each shard this process commits, then sleep ``delay`` seconds; after
    ``pause_after`` commits, say so and block (until stdin closes: the test kills us first)."""
    original = ShardWriter.commit
    guard = threading.Lock()

    def commit(self, shard, temporary, checksum):
        progress = original(self, shard, temporary, checksum)
        with guard:
            WRITTEN.append(shard.index)
            pause = len(WRITTEN) == pause_after
        if pause:
            print("paused", flush=True)
            sys.stdin.read()
        time.sleep(delay)
        return progress

    ShardWriter.commit = commit


def die_at(point: int) -> None:
    """Count the file operations that make a cache durable (write, fsync, rename, truncate) and
    die like ``kill -9`` (``os._exit``, no cleanup) just before operation ``point``; with
    ``point`` 0, only count them and print the total at exit."""
    import atexit
    import os
    import threading

    count = [0]
    guard = threading.Lock()

    def counted(original):
        def operation(*args, **kwargs):
            with guard:
                count[0] += 1
                if count[0] == point:
                    os._exit(137)
            return original(*args, **kwargs)

        return operation

    for name in ("write", "writev", "fsync", "replace", "ftruncate"):
        setattr(os, name, counted(getattr(os, name)))
    if point == 0:
        atexit.register(lambda: print(f"operations: {count[0]}", flush=True))


def train(split, path: Path, accelerator, steps: int) -> dict[str, object]:
    cached = CachedDataset(path, split)
    data = torch.utils.data.DataLoader(cached, batch_size=2, collate_fn=collate)
    optimizer = torch.optim.SGD(split.stage2.parameters(), lr=0.1)
    stage2, optimizer, data = accelerator.prepare(split.stage2, optimizer, data)
    torch.manual_seed(accelerator.process_index)
    losses = []
    batches = iter(data)
    for _ in range(steps):
        loss = stage2(**next(batches))
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    weights = accelerator.unwrap_model(stage2).state_dict()
    return {
        "losses": losses,
        "checksum": float(sum(value.double().sum() for value in weights.values())),
        "ddp": type(stage2).__name__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("path")  # a folder or a URL: never through Path, which mangles URLs
    parser.add_argument("--length", type=int, default=12)
    parser.add_argument("--shard-bytes", type=int, default=1500)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--accelerate", action="store_true")
    parser.add_argument("--train-steps", type=int, default=0)
    parser.add_argument("--report", type=Path)
    parser.add_argument("--die-at", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pause-after", type=int)
    args = parser.parse_args()
    watch_shards(args.delay, args.pause_after)
    if args.die_at is not None:
        die_at(args.die_at)
    accelerator = None
    if args.accelerate:
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
    split = make_split()
    info = cache(
        split,
        loader(Pictures(args.length, seed=args.seed)),
        args.path,
        accelerator=accelerator,
        shard_bytes=args.shard_bytes,
        progress=False,
    )
    report: dict[str, object] = {
        "num_samples": info.num_samples,
        "shards": info.num_shards,
        "written": sorted(WRITTEN),
    }
    if accelerator is not None:
        report["world"] = accelerator.num_processes
        if args.train_steps:
            report.update(train(split, args.path, accelerator, args.train_steps))
    if args.report:
        rank = 0 if accelerator is None else accelerator.process_index
        args.report.with_suffix(f".{rank}.json").write_text(json.dumps(report))
    if accelerator is not None:
        accelerator.wait_for_everyone()  # no process tears the group down under another
        accelerator.end_training()
        exit_without_interpreter_teardown()


def exit_without_interpreter_teardown() -> None:
    """Leave once the work and its reports are done, skipping interpreter finalization.

    torch 2.13's gloo backend can abort the process while the interpreter is torn down
    ("terminate called without an active exception", SIGABRT; pytorch/pytorch#179291: its C++
    worker threads may still hold Python references), even after ``destroy_process_group``,
    about one run in ten here, at the graphsplit release before this worker changed too. The
    abort comes after every file and report is written, so it says nothing about graphsplit;
    ``os._exit`` after flushing keeps it from failing the test.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
