"""Conformance: PEFT LoRA on LMs with learned absolute positions (GPT-2, OPT), many lengths.

The sized-constant change (graphsplit/planning/cut/sized_constants.py) recomputes in stage 2
the boundary constants made from the padded length, unless a module call, a placeholder or a
parameter lies on the way back. GPT-2 adds ``wpe(position_ids)``, a frozen embedding's rows
for ``arange(length)``: a per-dataset constant read through a frozen module, stored and guarded
per length, as the docstring says (its causal mask is recomputed). OPT's positions come from
``cumsum(attention_mask)`` (data, not a constant); its only sized constant is the causal mask,
built from ``inputs_embeds.shape[1]`` / ``.device``. OPT's boundary carries ``inputs_embeds
+ positions`` (``add``), not ``embed_tokens``'s output: the walk back from the mask reaches the
frozen ``embed_tokens`` call, read for its size and device only. It used to stop there, the
mask stayed stored and every padded length was a plan (past ``max_plans`` lengths the dataset
was refused). Now stage 2 makes those reads on a boundary tensor computed from it, checked in
stage 1 (graphsplit/planning/cut/twin_reads.py): one plan for every length.

Step: ``model(**inputs).loss``; batches: ``DataCollatorForLanguageModeling(mlm=False)``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphsplit

pytest.importorskip("transformers")
pytest.importorskip("peft")

import transformers
from transformers import DataCollatorForLanguageModeling

from tests.conformance.unseen14_d_checks import lm_batch, lora, run_causal_lm, signatures
from tests.conformance.unseen_checks import word_tokenizer

WORDS = [f"w{i}" for i in range(40)]
VOCAB = len(WORDS) + 3
LENGTHS = (9, 6, 11, 7, 13, 5)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _collator():
    return DataCollatorForLanguageModeling(word_tokenizer(WORDS), mlm=False)


def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64, pad_token_id=0
    )
    return lora(transformers.GPT2LMHeadModel(config), ["c_attn"])


def _opt():
    torch.manual_seed(0)
    config = transformers.OPTConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=64,
        word_embed_proj_dim=32,
        pad_token_id=0,
    )
    return lora(transformers.OPTForCausalLM(config), ["q_proj", "v_proj"])


def test_lora_gpt2_keeps_a_plan_per_length_and_is_exact(tmp_path):
    split = run_causal_lm(_gpt2(), _collator(), LENGTHS, tmp_path / "cache", vocab=VOCAB)
    assert split.path == "trace"
    assert len(split.plans) == len(LENGTHS), signatures(split)
    constants = [key for key, spec in split.boundary.items() if spec.is_constant]
    assert len(constants) == 1, constants  # wpe's rows; the causal mask is recomputed


def test_lora_opt_is_exact_at_every_length(tmp_path):
    split = run_causal_lm(_opt(), _collator(), LENGTHS, tmp_path / "cache", vocab=VOCAB)
    assert split.path == "trace"


def test_lora_opt_one_plan_for_every_padded_length():
    model = _opt()
    collator = _collator()

    def compute_loss(inputs):
        return model(**inputs).loss

    split = graphsplit.split(compute_loss, (lm_batch(collator, LENGTHS[0], vocab=VOCAB),))
    for length in LENGTHS[1:]:
        split.stage1(**lm_batch(collator, length, vocab=VOCAB))
    assert len(split.plans) == 1, signatures(split)


class MaskFromTheEmbeddingsSize(nn.Module):
    """OPT in miniature: the boundary is ``tokens(ids) + positions`` (positions from the mask's
    cumsum, data), and the causal mask is made from ``tokens(ids)``'s length and device."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(16, 8).requires_grad_(False)
        self.positions = nn.Embedding(32, 8).requires_grad_(False)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, ids, mask):
        embeds = self.tokens(ids)
        hidden = embeds + self.positions(mask.cumsum(1))
        n = embeds.shape[1]
        rows = torch.arange(n, device=embeds.device)
        causal = rows[:, None] >= rows[None, :]  # a constant per length
        scores = (hidden * self.scale) @ hidden.transpose(1, 2)
        return scores.masked_fill(~causal, 0.0).mean()


def test_minimal_a_mask_from_a_frozen_outputs_size_gets_one_plan():
    torch.manual_seed(0)
    step = MaskFromTheEmbeddingsSize()

    def batch(length):
        ids = torch.randint(0, 16, (2, length), generator=torch.Generator().manual_seed(length))
        return ids, torch.ones(2, length, dtype=torch.long)

    split = graphsplit.split(step, batch(5))
    for length in (7, 3):
        checks = graphsplit.verify(step, split, batch(length), seed=0)
        assert all(c.ok for c in checks)
    assert len(split.plans) == 1, signatures(split)
