"""Cache DPO reference log-probs and train, beside TRL's live-reference run, in each process
of an ``accelerate launch``.

    accelerate launch --multi_gpu --num_processes 2 tests/integrations/dpo_worker.py FOLDER

Each process writes ``FOLDER/report.<rank>.json``: its reference columns, both runs' losses and
the cache's pair count. (TRL's own precompute cannot run here: under two processes each one
looks for the Arrow file in its own temporary folder when the dataset lives in memory.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from graphsplit.integrations.trl import COLUMNS, cache_reference_log_probs
from tests.caching.cache_worker import exit_without_interpreter_teardown
from tests.integrations.dpo import make_dpo_trainer, preference_pairs


def main() -> None:
    folder = Path(sys.argv[1])
    pairs = preference_pairs(12)
    live = make_dpo_trainer(str(folder / "live"), pairs)
    ours = make_dpo_trainer(str(folder / "ours"), pairs)
    reference = cache_reference_log_probs(ours, str(folder / "ref"))
    live.train()
    ours.train()

    def losses(trainer):
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    report = {
        "world": ours.args.world_size,
        "columns": {column: list(ours.train_dataset[column]) for column in COLUMNS},
        "live": losses(live),
        "ours": losses(ours),
        "cached": len(reference.cached["train"]),
    }
    (folder / f"report.{ours.args.process_index}.json").write_text(json.dumps(report))
    exit_without_interpreter_teardown()


if __name__ == "__main__":
    main()
