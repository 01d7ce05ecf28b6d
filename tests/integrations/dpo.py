"""A TRL ``DPOTrainer`` on a tiny random Qwen2 with a word-level tokenizer built in memory."""

from __future__ import annotations

from typing import Any

import torch
from datasets import Dataset
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from trl import DPOConfig, DPOTrainer

VOCAB = 64


def tiny_qwen2(seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    return Qwen2ForCausalLM(config)


def word_tokenizer() -> PreTrainedTokenizerFast:
    """Words ``t2`` .. ``t63`` are token ids 2 .. 63; 0 pads, 1 ends a completion."""
    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")


def preference_pairs(count: int, seed: int = 0) -> Dataset:
    """Prompts of 3 to 5 words, chosen and rejected completions of 2 to 5."""
    generator = torch.Generator().manual_seed(seed)

    def words(n: int) -> str:
        return " ".join(
            f"t{i}" for i in torch.randint(2, VOCAB, (n,), generator=generator).tolist()
        )

    rows = [
        {
            "prompt": words(3 + i % 3),
            "chosen": " " + words(2 + i % 4),
            "rejected": " " + words(3 + i % 2),
        }
        for i in range(count)
    ]
    return Dataset.from_list(rows)


def make_dpo_trainer(output_dir: str, pairs: Dataset, **arguments: Any) -> DPOTrainer:
    settings = {
        "per_device_train_batch_size": 4,
        "max_steps": 3,
        "logging_steps": 1,
        "seed": 3,
        "learning_rate": 1e-3,
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "disable_tqdm": True,
        **arguments,
    }
    return DPOTrainer(
        model=tiny_qwen2(1),
        ref_model=tiny_qwen2(2),
        args=DPOConfig(output_dir=output_dir, **settings),
        train_dataset=pairs,
        eval_dataset=pairs.select(range(4)),
        processing_class=word_tokenizer(),
    )
