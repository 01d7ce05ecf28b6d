"""Train the KD trainer unsplit, then split, in each process of an ``accelerate launch``.

    accelerate launch --multi_gpu --num_processes 2 tests/integrations/trainer_worker.py FOLDER
    accelerate launch ... tests/integrations/trainer_worker.py FOLDER live
    accelerate launch ... tests/integrations/trainer_worker.py FOLDER groups

(``--multi_gpu`` picks accelerate's torchrun launcher; ``use_cpu=True`` makes a gloo DDP run.)
Each process writes ``FOLDER/report.<rank>.json``: both runs' logged losses, whether the split
run's student weights equal the unsplit run's, and the cache's sample count. With ``live`` the
split run caches while training (``cache_while_training=True``), for 3 epochs. With ``groups``
the samples are unpadded and ``DataCollatorWithPadding`` pads each batch to its longest: both
runs train batches of one padded length (the unsplit one through ``batch_by_padded_length``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from graphsplit.integrations.transformers import batch_by_padded_length, split_trainer
from tests.caching.cache_worker import exit_without_interpreter_teardown
from tests.integrations.kd import (
    logged_losses,
    make_padding_trainer,
    make_trainer,
    padded_samples,
    unpadded_samples,
)


def _trainer(folder: Path, grouped: bool, **arguments):
    if not grouped:
        return make_trainer(str(folder), padded_samples(16), **arguments)
    from transformers import DataCollatorWithPadding

    from tests.integrations.dpo import word_tokenizer

    lengths = [[4, 5, 6, 7, 9, 10, 11, 12][i % 8] for i in range(32)]
    collator = DataCollatorWithPadding(word_tokenizer())
    return make_padding_trainer(str(folder), unpadded_samples(lengths), collator, **arguments)


def main() -> None:
    folder = Path(sys.argv[1])
    live = sys.argv[2:] == ["live"]
    grouped = sys.argv[2:] == ["groups"]
    epochs = {"num_train_epochs": 3} if live else {}
    runs = {}
    for name in ("unsplit", "split"):
        trainer = _trainer(folder / name, grouped, **epochs)
        if name == "split":
            parts = split_trainer(trainer, str(folder / "cache"), cache_while_training=live)
        elif grouped:
            batch_by_padded_length(trainer)
        trainer.train()
        runs[name] = trainer
    unsplit, split = runs["unsplit"].model.state_dict(), runs["split"].model.state_dict()
    rank = runs["split"].args.process_index
    report = {
        "world": runs["split"].args.world_size,
        "unsplit": logged_losses(runs["unsplit"]),
        "split": logged_losses(runs["split"]),
        "same_weights": all(torch.equal(unsplit[key], split[key]) for key in unsplit),
        "cached": len(parts.live.dataset() if live else parts.cached),
        "wrapped": type(runs["split"].model_wrapped).__name__,
    }
    (folder / f"report.{rank}.json").write_text(json.dumps(report))
    exit_without_interpreter_teardown()


if __name__ == "__main__":
    main()
