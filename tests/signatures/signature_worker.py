"""Cache batches of two shape signatures from two accelerate processes into one cache.

Run as::

    accelerate launch --multi_gpu --num_processes 2 tests/signatures/signature_worker.py PATH REPORT

Each process starts ``Accelerator(cpu=True)``, splits :class:`~tests.signatures.test_dispatch.
SizeBranch` from a width-16 example and caches the loader of :func:`widths_loader` with one
batch per shard: shards go to the processes in turn, so process 0 computes only the width-16
batches (the first plan) and process 1 only the width-24 ones (a plan only it makes). Each
writes the signature keys of the plans it made to ``REPORT.<rank>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

WIDTHS = (16, 24, 16, 24)  # batch j goes to process j % 2


def widths_loader() -> list[dict]:
    """Two-sample batches of :data:`WIDTHS`, keyed ``"<batch>-<row>"``."""
    from tests.signatures.test_dispatch import _batch

    return [
        {**_batch(width, 2, 10 + i), "key": [f"{i}-{row}" for row in range(2)]}
        for i, width in enumerate(WIDTHS)
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("path")
    parser.add_argument("report")
    args = parser.parse_args()

    from accelerate import Accelerator

    import graphsplit
    from tests.caching.cache_worker import exit_without_interpreter_teardown
    from tests.signatures.test_dispatch import _batch, _model

    accelerator = Accelerator(cpu=True)
    split = graphsplit.split(_model(), kwargs=_batch(16, 2, 0))
    # shard_bytes=1: one batch per shard, so the processes take the batches in turn.
    graphsplit.cache(
        split, widths_loader(), args.path, accelerator=accelerator, shard_bytes=1, progress=False
    )
    report = {"rank": accelerator.process_index, "plans": [p.key for p in split.plans]}
    Path(f"{args.report}.{accelerator.process_index}.json").write_text(json.dumps(report))
    accelerator.wait_for_everyone()
    accelerator.end_training()
    exit_without_interpreter_teardown()


if __name__ == "__main__":
    main()
