"""DPO reference log-probs: graphsplit's cache against TRL's ``precompute_ref_log_probs``.

A TRL ``DPOTrainer`` on a small random Qwen2 (CPU, one torch thread) and ``--pairs`` random
preference pairs. Variants, interleaved round by round (each round on a fresh cache):

    trl_batch_4      TRL's own precompute (``DPOTrainer._precompute_ref_logps``, what
                     ``precompute_ref_log_probs=True`` runs in ``__init__``) at batch 4
    trl_batch_1      the same at ``precompute_ref_batch_size=1``
    graphsplit       ``cache_reference_log_probs``: split (planning) + cache + columns added
    graphsplit_again the same call on a complete cache (the cache is checked and read back)

Also measured once: bytes on disk per pair (graphsplit: the cache folder's shards and
manifest; TRL: the Arrow file it writes beside the dataset), and how far each set of values is
from graphsplit's (max absolute difference; 0 is bit for bit).

    python -m benchmarks.bench_dpo_reference --help
    python -m benchmarks.bench_dpo_reference --quick --out /tmp/results     # smoke test
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    environment,
    interleaved,
    markdown_table,
    parser,
    report,
    timing_options,
    torch_threads,
    write_results,
)

VARIANTS = ("trl_batch_4", "trl_batch_1", "graphsplit", "graphsplit_again")
COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")


def _model(seed: int, hidden: int, vocab: int) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    return Qwen2ForCausalLM(config)


def _pairs(count: int, vocab: int, seed: int) -> Any:
    from datasets import Dataset

    generator = torch.Generator().manual_seed(seed)

    def words(low: int, high: int) -> str:
        n = int(torch.randint(low, high, (1,), generator=generator))
        ids = torch.randint(2, vocab, (n,), generator=generator).tolist()
        return " ".join(f"t{i}" for i in ids)

    return Dataset.from_list(
        [
            {"prompt": words(16, 33), "chosen": " " + words(8, 25), "rejected": " " + words(8, 25)}
            for _ in range(count)
        ]
    )


def _tokenizer(vocab: int) -> Any:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, vocab)}}
    tokenizer = Tokenizer(WordLevel(words, unk_token="<pad>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")


class _Setup:
    """The models, the pairs and a factory of fresh trainers (never precomputing)."""

    def __init__(self, pairs: int, hidden: int, vocab: int, folder: Path) -> None:
        self.policy, self.reference = _model(1, hidden, vocab), _model(2, hidden, vocab)
        self.pairs, self.tokenizer, self.folder = _pairs(pairs, vocab, 0), _tokenizer(vocab), folder

    def trainer(self) -> Any:
        from trl import DPOConfig, DPOTrainer

        args = DPOConfig(
            output_dir=str(self.folder / "out"),
            per_device_train_batch_size=4,
            report_to=[],
            use_cpu=True,
            bf16=False,
            disable_tqdm=True,
            save_strategy="no",
        )
        return DPOTrainer(
            model=self.policy,
            ref_model=self.reference,
            args=args,
            train_dataset=self.pairs,
            processing_class=self.tokenizer,
        )


def _trl_precompute(trainer: Any, batch_size: int, tag: str) -> Any:
    """TRL's precompute on the trainer's tokenized dataset, under a fresh cache name."""
    trainer._precompute_model_hash = tag  # a new fingerprint: TRL computes and writes anew
    return trainer._precompute_ref_logps(trainer.train_dataset, "train", batch_size)


def _values(dataset: Any) -> torch.Tensor:
    return torch.tensor([dataset[column] for column in COLUMNS], dtype=torch.float32)


def _new_files(dataset: Any, before: Any) -> list[Path]:
    old = {entry["filename"] for entry in before.cache_files}
    return [Path(e["filename"]) for e in dataset.cache_files if e["filename"] not in old]


def _folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def measure(pairs: int, hidden: int, vocab: int, rounds: int) -> dict[str, Any]:
    from graphsplit.integrations.trl import cache_reference_log_probs

    folder = Path(tempfile.mkdtemp(prefix="bench_dpo_"))
    try:
        setup = _Setup(pairs, hidden, vocab, folder)
        trainers = {name: setup.trainer() for name in VARIANTS}
        counter = iter(range(10**6))
        fresh: dict[str, Any] = {}

        def before_each(name: str, index: int) -> None:
            if name == "graphsplit":
                trainers[name] = setup.trainer()
                fresh["dir"] = folder / f"cache-{next(counter)}"
            elif name == "graphsplit_again":
                trainers[name] = setup.trainer()
            fresh["tag"] = f"bench-{next(counter)}"

        again_dir = folder / "cache-again"
        cache_reference_log_probs(setup.trainer(), str(again_dir))
        variants = {
            "trl_batch_4": lambda: _trl_precompute(trainers["trl_batch_4"], 4, fresh["tag"]),
            "trl_batch_1": lambda: _trl_precompute(trainers["trl_batch_1"], 1, fresh["tag"]),
            "graphsplit": lambda: cache_reference_log_probs(
                trainers["graphsplit"], str(fresh["dir"])
            ),
            "graphsplit_again": lambda: cache_reference_log_probs(
                trainers["graphsplit_again"], str(again_dir)
            ),
        }
        timings = interleaved(variants, rounds=rounds, before_each=before_each)
        # bytes and exactness, once
        base = setup.trainer()
        trl = {size: _trl_precompute(base, size, f"bytes-{size}") for size in (4, 1)}
        ours = setup.trainer()
        cache_reference_log_probs(ours, str(folder / "cache-bytes"))
        values = _values(ours.train_dataset)
        trl_bytes = {
            size: sum(path.stat().st_size for path in _new_files(trl[size], base.train_dataset))
            for size in trl
        }
        return {
            "pairs": pairs,
            "hidden": hidden,
            "vocab": vocab,
            "timings": timings.to_json(),
            "vs_trl_batch_4": {
                clock: {
                    name: timings.ratio(name, "trl_batch_4", clock).to_json() for name in VARIANTS
                }
                for clock in ("wall", "cpu")
            },
            "bytes_per_pair": {
                "graphsplit": _folder_bytes(folder / "cache-bytes" / "train") / pairs,
                "trl_batch_4": trl_bytes[4] / pairs,
                "trl_batch_1": trl_bytes[1] / pairs,
            },
            "max_abs_difference_from_graphsplit": {
                f"trl_batch_{size}": float((_values(trl[size]) - values).abs().max())
                for size in trl
            },
        }
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _markdown(result: dict[str, Any]) -> str:
    rows = []
    for name in VARIANTS:
        wall = result["timings"]["wall"][name]
        cpu = result["timings"]["cpu"][name]
        ratio = result["vs_trl_batch_4"]["cpu"][name]
        size = result["bytes_per_pair"].get(name, result["bytes_per_pair"]["graphsplit"])
        difference = result["max_abs_difference_from_graphsplit"].get(name, 0.0)
        rows.append(
            [
                name,
                f"{wall['median']:.3f} ({wall['q1']:.3f}–{wall['q3']:.3f})",
                f"{cpu['median']:.3f} ({cpu['q1']:.3f}–{cpu['q3']:.3f})",
                f"{ratio['median']:.2f} ({ratio['q1']:.2f}–{ratio['q3']:.2f})",
                f"{size:.1f}",
                f"{difference:.3g}",
            ]
        )
    header = [
        "variant",
        "wall s (IQR)",
        "CPU s (IQR)",
        "CPU vs trl_batch_4",
        "bytes / pair",
        "max abs diff vs graphsplit",
    ]
    return markdown_table(header, rows, "lrrrrr")


def main(argv: list[str] | None = None) -> int:
    command = timing_options(parser(__name__, __doc__.splitlines()[0]), rounds=5)
    command.add_argument("--pairs", type=int, default=64, help="preference pairs (default 64)")
    command.add_argument("--hidden", type=int, default=128, help="model width (default 128)")
    command.add_argument("--vocab", type=int, default=512, help="vocabulary (default 512)")
    options = command.parse_args(argv)
    if options.quick:
        options.pairs, options.hidden, options.vocab, options.rounds = 6, 16, 64, 1
    with torch_threads(options.threads) as threads:
        result = measure(options.pairs, options.hidden, options.vocab, options.rounds)
        env = environment("torch", "transformers", "trl", "datasets", torch_threads=True)
        env["torch_threads"] = threads
    markdown = _markdown(result)
    write_results(options.out, "dpo_reference", report("dpo_reference", result, env), markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
