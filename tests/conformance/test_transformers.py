"""Conformance: transformers training steps written as their own scripts write them (issue 10).

Each step is built from real library classes with tiny configs and random weights, split, and
verified bit for bit at two batch sizes; each asserts which modules stage 2 holds (frozen
encoders must not be among them). Attention masks with padding are what these steps needed
the trace-safe analysis for (transformers' ``masking_utils`` reads mask values otherwise).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import split_and_verify, tiny_llama_config

transformers = pytest.importorskip("transformers")

VOCAB = 64


def _ids_and_mask(size: int, tokens: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (size, tokens), generator=generator)
    mask = torch.ones(size, tokens, dtype=torch.long)
    mask[0, -3:] = 0  # right padding on the first sample
    return ids, mask


def _stage2_modules(split) -> set[str]:
    return {name.split(".")[0] for name, _ in split.stage2.named_modules() if name}


def _gpt2(**overrides):
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=32, **overrides
    )
    return transformers.GPT2LMHeadModel(config)


class DistillFromFrozenTeacher(nn.Module):
    """Knowledge distillation: a frozen teacher scores the tokens, the student matches it."""

    def __init__(self, teacher: nn.Module, student: nn.Module, temperature: float = 2.0):
        super().__init__()
        self.teacher = teacher.eval().requires_grad_(False)
        self.student = student
        self.temperature = temperature

    def forward(self, input_ids, attention_mask):
        with torch.no_grad():
            teacher_logits = self.teacher(input_ids=input_ids, attention_mask=attention_mask).logits
        student_logits = self.student(input_ids=input_ids, attention_mask=attention_mask).logits
        t = self.temperature
        loss = F.kl_div(
            F.log_softmax(student_logits / t, dim=-1),
            F.softmax(teacher_logits / t, dim=-1),
            reduction="none",
        ).sum(-1)
        return (loss * attention_mask).sum() / attention_mask.sum() * t**2


@pytest.mark.parametrize("size", [2, 3])
def test_gpt2_distillation_with_padding_caches_the_teacher(size):
    torch.manual_seed(0)
    model = DistillFromFrozenTeacher(_gpt2(), _gpt2())
    split = split_and_verify(model, _ids_and_mask(size))
    assert _stage2_modules(split) == {"student"}


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 3])
def test_llama_distillation_with_padding_caches_the_teacher(size):
    torch.manual_seed(0)
    teacher = transformers.LlamaForCausalLM(tiny_llama_config(vocab_size=VOCAB))
    model = DistillFromFrozenTeacher(teacher, _gpt2())
    split = split_and_verify(model, _ids_and_mask(size))
    assert _stage2_modules(split) == {"student"}


class BertProbe(nn.Module):
    """A linear probe on a frozen BERT in eval mode (dropout off), on the [CLS] state."""

    def __init__(self):
        super().__init__()
        config = transformers.BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=32,
            chunk_size_feed_forward=4,  # apply_chunking_to_forward inspects the leaf's method
        )
        self.encoder = transformers.BertModel(config).eval().requires_grad_(False)
        self.probe = nn.Linear(32, 3)

    def forward(self, input_ids, attention_mask, token_type_ids, labels):
        hidden = self.encoder(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
        ).last_hidden_state
        return F.cross_entropy(self.probe(hidden[:, 0]), labels)


@pytest.mark.parametrize("size", [2, 3])
def test_bert_probe_in_eval_caches_the_encoder(size):
    torch.manual_seed(0)
    ids, mask = _ids_and_mask(size)
    types = torch.zeros_like(ids)
    labels = torch.arange(size) % 3
    split = split_and_verify(BertProbe(), (ids, mask, types, labels))
    assert _stage2_modules(split) == {"probe"}


class T5EncoderProbe(nn.Module):
    """Mean-pooled frozen T5 encoder states (padding masked out) under a trainable head."""

    def __init__(self):
        super().__init__()
        config = transformers.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=2
        )
        self.encoder = transformers.T5EncoderModel(config).eval().requires_grad_(False)
        self.head = nn.Linear(32, 1)

    def forward(self, input_ids, attention_mask, target):
        states = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        weights = attention_mask.unsqueeze(-1).to(states.dtype)
        pooled = (states * weights).sum(1) / weights.sum(1)
        return F.mse_loss(self.head(pooled).squeeze(-1), target)


@pytest.mark.parametrize("size", [2, 3])
def test_t5_encoder_probe_with_padding_caches_the_encoder(size):
    torch.manual_seed(0)
    ids, mask = _ids_and_mask(size)
    split = split_and_verify(T5EncoderProbe(), (ids, mask, torch.randn(size)))
    assert _stage2_modules(split) == {"head"}


class DirectPreference(nn.Module):
    """DPO as TRL computes it: chosen and rejected stacked along the batch (2B rows),
    ``use_cache=False``, a frozen reference model scoring the same rows."""

    def __init__(self, beta: float = 0.1):
        super().__init__()
        self.policy = _gpt2()
        self.reference = _gpt2().eval().requires_grad_(False)
        self.beta = beta

    @staticmethod
    def _logps(logits, labels, mask):
        logits, labels, mask = logits[:, :-1], labels[:, 1:], mask[:, 1:]
        per_token = torch.gather(logits.log_softmax(-1), 2, labels.unsqueeze(2)).squeeze(2)
        return (per_token * mask).sum(-1)

    def forward(self, chosen_ids, chosen_mask, rejected_ids, rejected_mask):
        ids = torch.cat([chosen_ids, rejected_ids], dim=0)
        mask = torch.cat([chosen_mask, rejected_mask], dim=0)
        rows = chosen_ids.shape[0]
        logits = self.policy(input_ids=ids, attention_mask=mask, use_cache=False).logits
        logps = self._logps(logits, ids, mask)
        with torch.no_grad():
            ref_logits = self.reference(input_ids=ids, attention_mask=mask, use_cache=False).logits
            ref_logps = self._logps(ref_logits, ids, mask)
        chosen, rejected = logps[:rows], logps[rows:]
        ref_chosen, ref_rejected = ref_logps[:rows], ref_logps[rows:]
        margin = (chosen - ref_chosen) - (rejected - ref_rejected)
        return -F.logsigmoid(self.beta * margin).mean()


@pytest.mark.parametrize("size", [2, 3])
def test_dpo_on_the_stacked_layout_caches_the_reference_model(size):
    torch.manual_seed(0)
    chosen, chosen_mask = _ids_and_mask(size, seed=1)
    rejected, rejected_mask = _ids_and_mask(size, seed=2)
    split = split_and_verify(DirectPreference(), (chosen, chosen_mask, rejected, rejected_mask))
    assert _stage2_modules(split) == {"policy"}
