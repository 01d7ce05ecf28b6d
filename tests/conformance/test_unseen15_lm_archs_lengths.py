"""Conformance: PEFT LoRA on more decoder-only LMs, dynamic padding, many padded lengths.

The twin-read change (graphsplit/planning/cut/twin_reads.py) lets stage 2 read a size it needs
off a boundary tensor computed from the tensor the model read it from (OPT's and BART's
``inputs_embeds.shape[1]``), stage 1 checking both reads agree on every batch. It was tested on
OPT and BART. Here, the architectures of transformers that make their positions or attention
bias from the padded length in other ways:

- BLOOM: ALiBi built from the attention mask (``build_alibi_tensor``), no position table;
- Falcon, rotary (the default) and with ``alibi=True`` (its own ``build_alibi_tensor``, which
  casts the bias to bfloat16 and reshapes it by ``attention_mask.shape[1]``);
- GPT-J and CodeGen: rotary from a ``sin``/``cos`` buffer indexed by ``arange(length)``;
- XGLM: sinusoidal positions, rows of a parameterless module's buffer picked by
  ``arange(length)``;
- BioGPT: learned positions indexed by ``cumsum(attention_mask)`` (data, as OPT);
- OPT with ``word_embed_proj_dim != hidden_size`` (OPT-350m's ``project_in`` /
  ``project_out``, post-layer-norm);
- GPT-BigCode (multi-query): learned positions ``wpe(arange(length))``, GPT-2 style;
- Phi (``partial_rotary_factor=0.5``, parallel attention and MLP; Phi3 is in
  test_unseen14_rope_archs_lengths.py).

Step: the Trainer's ``compute_loss`` body ``model(**inputs).loss``. Batches: six padded lengths,
``DataCollatorForLanguageModeling(tokenizer, mlm=False)`` padding each to its longest row.
Split at the first length; ``verify`` exact (loss and every LoRA gradient bit for bit) at
each; a cache of all six read back and stage 2 on ``cached.loader`` batches exact against the
eager step on the same samples; the plans after stage 1 saw every length pinned.

Plans: one for every length, except

- GPT-BigCode: ``wpe(position_ids)`` is a frozen embedding's rows for ``arange(length)``, a
  per-dataset constant read through a frozen module, stored and guarded per length (as GPT-2
  in test_unseen14_learned_positions_lengths.py): a plan per length, by design.
Falcon with ALiBi and 2 heads: the bias ``slopes.bfloat16() * positions`` (B, 2, L) in
bfloat16 is 4 bytes a token, fewer than the int64 ``attention_mask`` (8), so the min-cut caches
the bias and not the mask; stage 2 then needs ``seq_length = attention_mask.shape[1]`` for
``alibi.reshape(batch * heads, 1, seq_length)``, and no boundary tensor computed from the mask
holds that length at index 1 (the bias holds it at index 2, the 4-d padding mask at 3). The
number is read as the bias's ``shape[2]`` (planning/cut/number_twins.py), checked in stage 1:
one plan serves every length, as with 4 heads or more (the Falcon RW ALiBi checkpoints have
tens), where the mask is the cheaper tensor and is on the boundary. Before, it was baked, a
plan per length.

Twin chosen by coincidence: ``twins_for`` compares reads at the example batch only. Split at
length 2, the 2-head bias's heads dimension equals the length and is taken as the mask's twin;
stage 1's check refuses every other length for that plan, and the plan made at the next length
reads it at index 2, serving every length after. Checked on the minimal model below (and seen
on Falcon ALiBi split at length 2, not pinned here).
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

from tests.conformance.unseen14_d_checks import lora, run_causal_lm, signatures
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


def _bloom():
    config = transformers.BloomConfig(
        vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=2, pad_token_id=0
    )
    return transformers.BloomForCausalLM(config), ["query_key_value"]


def _falcon(**extra):
    config = transformers.FalconConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, pad_token_id=0, **extra
    )
    return transformers.FalconForCausalLM(config), ["query_key_value"]


def _falcon_rotary():
    return _falcon(num_attention_heads=2)


def _falcon_alibi_2_heads():
    return _falcon(num_attention_heads=2, alibi=True)


def _falcon_alibi_4_heads():
    return _falcon(num_attention_heads=4, alibi=True)


def _gptj():
    config = transformers.GPTJConfig(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=64,
        rotary_dim=8,
        pad_token_id=0,
    )
    return transformers.GPTJForCausalLM(config), ["q_proj", "v_proj"]


def _codegen():
    config = transformers.CodeGenConfig(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=64,
        n_ctx=64,
        rotary_dim=8,
        pad_token_id=0,
    )
    return transformers.CodeGenForCausalLM(config), ["qkv_proj"]


def _xglm():
    config = transformers.XGLMConfig(
        vocab_size=VOCAB,
        d_model=32,
        num_layers=2,
        attention_heads=2,
        ffn_dim=64,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    return transformers.XGLMForCausalLM(config), ["q_proj", "v_proj"]


def _biogpt():
    config = transformers.BioGptConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    return transformers.BioGptForCausalLM(config), ["q_proj", "v_proj"]


def _opt_projected():
    config = transformers.OPTConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=64,
        word_embed_proj_dim=16,
        do_layer_norm_before=False,
        pad_token_id=0,
    )
    model = transformers.OPTForCausalLM(config)
    assert model.model.decoder.project_in is not None
    assert model.model.decoder.project_out is not None
    return model, ["q_proj", "v_proj"]


def _gpt_bigcode():
    config = transformers.GPTBigCodeConfig(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    assert config.multi_query
    return transformers.GPTBigCodeForCausalLM(config), ["c_attn"]


def _phi():
    config = transformers.PhiConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=64,
        partial_rotary_factor=0.5,
        pad_token_id=0,
    )
    return transformers.PhiForCausalLM(config), ["q_proj", "v_proj"]


EVERY_LENGTH = len(LENGTHS)
# name: (build, plans after every length, whether stage 2 makes reads on a twin)
CASES = {
    # word_embeddings' .shape[1] / .device read off word_embeddings_layernorm's output
    "bloom-alibi": (_bloom, 1, True),
    "falcon-rotary": (_falcon_rotary, 1, False),
    # seq_length = attention_mask.shape[1] read off the bf16 bias at index 2 (see the module
    # docstring and test_minimal_a_number_read_off_a_placeholder_at_another_index).
    "falcon-alibi-2-heads": (_falcon_alibi_2_heads, 1, False),
    "falcon-alibi-4-heads": (_falcon_alibi_4_heads, 1, False),
    "gptj": (_gptj, 1, False),
    "codegen": (_codegen, 1, False),
    "xglm-sinusoidal": (_xglm, 1, True),
    "biogpt": (_biogpt, 1, False),
    # embed_tokens' (16 wide) .shape[1] read off project_in(...) + positions (32 wide)
    "opt-project-in-out": (_opt_projected, 1, True),
    # wpe's rows for arange(length): a frozen table sliced to the length, stored per length.
    "gpt-bigcode": (_gpt_bigcode, EVERY_LENGTH, False),
    "phi": (_phi, 1, False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_lora_lm_exact_at_every_padded_length(tmp_path, name):
    build, plans, twins = CASES[name]
    torch.manual_seed(0)
    model, targets = build()
    model = lora(model, targets)
    collator = DataCollatorForLanguageModeling(word_tokenizer(WORDS), mlm=False)
    split = run_causal_lm(model, collator, LENGTHS, tmp_path / "cache", vocab=VOCAB)
    assert split.path == "trace"
    assert len(split.plans) == plans, signatures(split)
    assert bool(split.plans[0].cut.twin_reads) == twins, split.plans[0].cut.twin_reads


def test_gpt_bigcode_stores_the_position_rows_and_recomputes_the_mask():
    torch.manual_seed(0)
    model, targets = _gpt_bigcode()
    model = lora(model, targets)
    collator = DataCollatorForLanguageModeling(word_tokenizer(WORDS), mlm=False)
    from tests.conformance.unseen14_d_checks import lm_batch

    def compute_loss(inputs):
        return model(**inputs).loss

    split = graphsplit.split(compute_loss, (lm_batch(collator, LENGTHS[0], vocab=VOCAB),))
    constants = [key for key, spec in split.boundary.items() if spec.is_constant]
    assert len(constants) == 1, constants  # wpe's rows; the causal mask is recomputed
    (spec,) = (split.boundary[key] for key in constants)
    assert spec.shape == (1, LENGTHS[0], 32)


class AlibiFromTheMask(nn.Module):
    """Falcon's ALiBi in miniature: a bfloat16 bias ``slopes * positions`` (B, 2, L) made from
    the mask (cheaper per token than the int64 mask, so the min-cut caches it), reshaped in
    stage 2 by ``mask.shape[1]``, a size that boundary tensor holds at index 2, not 1."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(16, 8).requires_grad_(False)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, ids, mask):
        batch, length = mask.shape
        slopes = torch.tensor([0.5, 0.25])
        positions = ((mask.cumsum(-1) - 1) * mask)[:, None, :]
        bias = (slopes[..., None].bfloat16() * positions).reshape(batch * 2, 1, length).float()
        bias = bias.reshape(batch, -1, *bias.shape[1:])  # (B, 2, 1, L), float32
        hidden = self.tokens(ids) * self.scale
        scores = hidden @ hidden.transpose(1, 2)  # (B, L, L)
        scores = scores[:, None] + bias
        return scores.mean()


def _mask_batch(length):
    generator = torch.Generator().manual_seed(length)
    ids = torch.randint(0, 16, (2, length), generator=generator)
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, length - 1 :] = 0
    return ids, mask


def test_minimal_alibi_from_the_mask_is_exact_at_every_length_from_one_plan():
    torch.manual_seed(0)
    step = AlibiFromTheMask()
    split = graphsplit.split(step, _mask_batch(5))
    assert "mask" not in split.boundary and "mul_1" in split.boundary  # the bias, not the mask
    for length in (7, 3, 5):
        checks = graphsplit.verify(step, split, _mask_batch(length), seed=0)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]
    assert len(split.plans) == 1, signatures(split)


def test_minimal_a_number_read_off_a_placeholder_at_another_index():
    """``mask.shape[1]``, which stage 2 needs for the reshape, is the cached bias's index 2:
    stage 2 reads it there, stage 1 checks the two agree."""
    torch.manual_seed(0)
    step = AlibiFromTheMask()
    split = graphsplit.split(step, _mask_batch(5))
    ((number, (twin, dim)),) = split.cut.number_twins.items()
    assert (number.name, twin.name, dim) == ("shape_1", "mul_1", 2) and not split.cut.baked
    assert "mask.shape[1]" in split.report() and "read as mul_1.shape[2]" in split.report()
    for length in (7, 3):
        split.stage1(*_mask_batch(length))
    assert len(split.plans) == 1, signatures(split)


def test_a_twin_matching_by_coincidence_at_the_example_is_caught_in_stage_1():
    """At length 2 the bias (B, 2, L) has 2 heads at index 1, the length the mask holds there:
    ``twins_for`` takes the bias as the mask's twin for ``mask.shape[1]`` (the heads, not the
    length). Stage 1's ``check_same_read`` refuses every other length for that plan, so each
    gets a plan of its own, and every step stays exact. The plan made at 7 reads the length off
    the bias's index 2 (planning/cut/number_twins.py) and serves 3 and 5 too."""
    torch.manual_seed(0)
    step = AlibiFromTheMask()
    split = graphsplit.split(step, _mask_batch(2))
    (read,) = split.plans[0].cut.twin_reads  # mask.shape[1], read off the bias
    assert split.plans[0].cut.twin_reads[read].name == "mul_1"
    for length in (7, 3, 2, 5):
        checks = graphsplit.verify(step, split, _mask_batch(length), seed=0)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]
    assert len(split.plans) == 2, signatures(split)
    (later,) = split.plans[1:]
    assert not later.cut.twin_reads and [dim for _, dim in later.cut.number_twins.values()] == [2]
