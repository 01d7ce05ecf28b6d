"""Conformance: TRL 1.16's ``SFTTrainer`` with ``padding_free=True`` on a LoRA'd tiny Qwen2.

The trainer is TRL's own (trl/trainer/sft_trainer.py), built with
``SFTConfig(padding_free=True, max_length=None)`` (TRL refuses ``padding_free`` without packing
unless ``max_length`` is off or the inputs are already truncated) and a ``peft_config`` (LoRA
on ``q_proj`` / ``v_proj``): it wraps the model with peft and patches its fused LM head. Its
collator, ``DataCollatorForLanguageModeling(padding_free=True)``, concatenates the batch's
samples into one row: ``input_ids``, ``labels``, ``position_ids`` restarting at every sample,
no attention mask, and the flash-attention fields ``cu_seq_lens_q/k`` (tensors), ``seq_idx``
and ``max_length_q/k`` (Python ints: the longest sample's length).

The step is the Trainer's loop body with one device and no accumulation:
``num_items_in_batch = trainer._get_num_items_in_batch([inputs], device)``, then
``trainer.compute_loss(model, inputs, num_items_in_batch=...)``, TRL's unchanged: ``use_cache
= False``, ``model(**inputs, fused_lm_head=True)``, ``-outputs.log_probs`` summed over the
count, and its metrics (entropy, token accuracy, ``.item()`` of the token count).

What must hold: the step splits on the default path, exactly (loss and every LoRA gradient
bit for bit, on the example and on another packed batch), the frozen token embedding is cached
(its weights not held by stage 2), and the packed batches cached through the disk train
stage 2 exactly.

Tiny config: Qwen2 32 wide, 2 layers, 2 heads (1 KV head), 32 tokens.
"""

from __future__ import annotations

import random
import tempfile

import pytest
import torch

import graphsplit
from graphsplit.errors import CacheError
from tests.conformance.unseen2_data_checks import assert_cache_round_trip
from tests.conformance.unseen_checks import word_tokenizer
from tests.helpers import assert_stage1_holds_no_trainable

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")

WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "ran", "far", "away", "big", "small"]


def build():
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    model = transformers.Qwen2ForCausalLM(config)
    rng = random.Random(0)
    samples = [
        {"input_ids": [rng.randrange(3, 15) for _ in range(rng.randint(3, 8))]} for _ in range(12)
    ]
    args = trl.SFTConfig(
        output_dir=tempfile.mkdtemp(),
        padding_free=True,
        max_length=None,
        per_device_train_batch_size=3,
        report_to=[],
        use_cpu=True,
    )
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
    )
    trainer = trl.SFTTrainer(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_list(samples),
        processing_class=word_tokenizer(WORDS),
        peft_config=lora,
    )
    model = trainer.model
    generator = torch.Generator().manual_seed(5)
    for name, param in model.named_parameters():  # lora_B starts at zero
        if "lora_B" in name:
            param.data = torch.randn(param.shape, generator=generator) * 0.02
    model.train()  # Trainer.train

    def training_step(inputs):
        num_items_in_batch = trainer._get_num_items_in_batch([inputs], torch.device("cpu"))
        return trainer.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)

    def packed(indices):
        return trainer.data_collator([trainer.train_dataset[i] for i in indices])

    params = [p for p in model.parameters() if p.requires_grad]
    return model, training_step, params, packed


_BUILT: dict[str, tuple] = {}


def _built():
    if "step" not in _BUILT:
        model, step, params, packed = build()
        split = graphsplit.split(step, (packed([0, 1, 2]),))
        _BUILT["step"] = (model, step, params, packed, split)
    return _BUILT["step"]


def _longest(batch) -> int:
    return batch["max_length_q"]


def test_padding_free_batch_is_one_row_with_restarting_positions():
    *_, packed, _split = _built()
    batch = packed([0, 1, 2])
    assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch
    starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist()
    assert len(starts) == 3 and starts[0] == 0
    assert isinstance(batch["max_length_q"], int)


def test_padding_free_step_verifies_on_the_example_and_caches_the_embedding():
    _model, step, _params, packed, split = _built()
    assert_stage1_holds_no_trainable(split)
    checks = graphsplit.verify(step, split, (packed([0, 1, 2]),), seed=0)
    assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]
    held = {name for name, _ in split.stage2.named_parameters()}
    assert not any("embed_tokens" in name for name in held), sorted(held)
    assert any(key.endswith("embed_tokens__0__out") for key in split.boundary)


def test_padding_free_step_verifies_on_a_batch_of_the_same_longest_sample():
    _model, step, _params, packed, split = _built()
    example = packed([0, 1, 2])
    other = next(
        packed([i, i + 1])
        for i in range(3, 11)
        if _longest(packed([i, i + 1])) == _longest(example)
    )
    assert other["input_ids"].shape != example["input_ids"].shape
    checks = graphsplit.verify(step, split, (other,), seed=1)
    assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


@pytest.mark.xfail(
    strict=True,
    raises=graphsplit.SplitError,
    reason="the default path is the module-level plan (the whole-step trace refuses "
    "SFTTrainer.compute_loss); calls/call_plan.py (encode, via calls/stages.py forward) "
    "freezes every non-tensor input of the example batch as a constant of the plan, and the "
    "padding-free collator's max_length_q / max_length_k are Python ints, the batch's longest "
    "sample: a packed batch whose longest sample differs is refused ('the step's input "
    "'max_length_q' is 5 in this batch; the module-level plan was made with 6') instead of "
    "getting a plan of its own, as a guard of the traced path does",
)
def test_padding_free_step_verifies_on_a_batch_of_another_longest_sample():
    _model, step, _params, packed, split = _built()
    example = packed([0, 1, 2])
    other = next(
        packed([i, i + 1])
        for i in range(3, 11)
        if _longest(packed([i, i + 1])) != _longest(example)
    )
    checks = graphsplit.verify(step, split, (other,), seed=1)
    assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


@pytest.mark.xfail(
    strict=True,
    raises=CacheError,
    reason="the module-level plan gives a step input a batch dim only where its dim 0 equals "
    "the batch size (calls/analysis.py batch_dim): cu_seq_lens_q / cu_seq_lens_k (one entry "
    "per packed sample, plus one) and the batch's one packed row disagree, so they become "
    "BoundarySpecs with batch_dim=None, i.e. per-dataset constants (calls/stored spec_of, "
    "artifacts.py BoundarySpec.is_constant); graphsplit.cache then refuses the second batch "
    "of the plan in caching/write/plan_constants.py PlanConstants.handle with "
    "a refusal naming the per-batch value and the fix (verify passes: it "
    "hands stage 1's values to stage 2 without the cache)",
)
def test_padding_free_cache_round_trip(tmp_path):
    """Packed batches of the example's longest sample, passed as an iterable (a packed row is
    several dataset items: its rows are numbered as they come), cached and trained exactly."""
    _model, step, params, packed, split = _built()
    example = packed([0, 1, 2])
    loader = [example] + [
        packed([i, i + 1])
        for i in range(3, 11)
        if _longest(packed([i, i + 1])) == _longest(example)
    ]
    assert len(loader) >= 2
    assert_cache_round_trip(split, step, loader, tmp_path / "cache", params)


def test_padding_free_cache_refusal_today(tmp_path):
    """What the xfail above meets: the flash-attention offsets are taken for per-dataset
    constants, and two packed batches of one plan are refused, naming the per-batch value."""
    _model, _step, _params, packed, split = _built()
    assert split.boundary["cu_seq_lens_q"].is_constant
    example = packed([0, 1, 2])
    other = next(
        packed([i, i + 1])
        for i in range(3, 11)
        if _longest(packed([i, i + 1])) == _longest(example)
    )
    with pytest.raises(CacheError, match="'cu_seq_lens_q' differs between batches") as error:
        graphsplit.cache(split, [example, other], tmp_path / "cache", progress=False)
    assert "it is a per-batch value" in str(error.value)
    assert "compute it inside the step" in str(error.value)
