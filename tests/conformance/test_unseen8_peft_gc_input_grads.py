"""Conformance: PEFT's LoRA recipe with non-reentrant gradient checkpointing and
``enable_input_require_grads()`` on a tiny Qwen2, trained as transformers 5's ``Trainer`` runs it.

The model is set up as PEFT's examples and ``prepare_model_for_kbit_training`` (peft/utils/
other.py) set it up, and as ``TrainingArguments(gradient_checkpointing=True,
gradient_checkpointing_kwargs={"use_reentrant": False})`` makes the Trainer do::

    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()   # a forward hook: the embedding's output requires grad
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05,
                                             target_modules=[q, k, v, o], task_type="CAUSAL_LM"))

The batches are ``DataCollatorForLanguageModeling(tokenizer, mlm=False)``'s (a
``BatchEncoding`` of ``input_ids``, ``attention_mask``, ``labels`` with the padding at -100).
The step is the Trainer's loop body (transformers/trainer.py, 5.24) with one device and no
gradient accumulation: ``_get_num_items_in_batch``'s count of the shifted labels (a causal LM's
loss shifts them, ``_loss_shifts_labels``), then ``compute_loss`` verbatim for a model that
takes loss kwargs and no label smoother or ``compute_loss_func``:
``inputs = {**inputs, "num_items_in_batch": ...}``, ``outputs = model(**inputs)``,
``loss = outputs["loss"]``. Qwen2's loss then divides a sum by the count.

What must hold: the step splits on the default path, exactly (loss and every LoRA gradient bit
for bit, on the example and on a batch of another size and length), the frozen token embedding
and the frozen projections below the first LoRA are cached (the embedding's weights not in
stage 2), stage 2 still checkpoints the decoder layers, and the collated loader cached through
the disk trains stage 2 exactly.

A variant the Trainer's own signature invites (``Trainer.training_step(model, inputs,
num_items_in_batch)``): the count handed to the step as an argument instead of counted in it.

Tiny config: Qwen2 32 wide, 2 layers, 2 heads (1 KV head), a word-level tokenizer of 14 words.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils.data import DataLoader

import graphsplit
from graphsplit.errors import CacheError
from tests.conformance.unseen2_data_checks import assert_cache_round_trip
from tests.conformance.unseen_checks import word_tokenizer
from tests.helpers import assert_stage1_holds_no_trainable

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "ran", "far", "away", "big", "small"]
WORDS += ["red", "blue"]
EMBEDDING = "model.base_model.model.model.embed_tokens"  # as stage 2 names it


def _model():
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
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    lora_config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.05,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        task_type="CAUSAL_LM",
    )
    model = peft.get_peft_model(model, lora_config)
    # lora_B starts at zero; give it values (as after some optimizer steps) so that lora_A
    # gets a gradient to compare too.
    generator = torch.Generator().manual_seed(5)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data = torch.randn(param.shape, generator=generator) * 0.02
    model.train()  # Trainer.train
    return model


def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
    """``Trainer.compute_loss`` (5.24) for a model that takes loss kwargs, with no label
    smoother, no ``compute_loss_func`` and one process."""
    kwargs = {}
    if num_items_in_batch is not None:
        kwargs["num_items_in_batch"] = num_items_in_batch
    inputs = {**inputs, **kwargs}
    outputs = model(**inputs)
    # We don't use .loss here since the model may return tuples instead of ModelOutput.
    loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
    return (loss, outputs) if return_outputs else loss


def num_items_in_batch_of(batch_samples):
    """``Trainer._get_num_items_in_batch`` for a causal LM on one device."""
    # Causal LM losses shift labels; count over `labels[..., 1:]` to avoid over-counting position 0.
    labels_for_count = [batch["labels"][..., 1:] for batch in batch_samples]
    return sum(labels.ne(-100).sum() for labels in labels_for_count)


def build():
    model = _model()

    def training_step(inputs):
        num_items_in_batch = num_items_in_batch_of([inputs])  # get_batch_samples
        return compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)

    params = [p for p in model.parameters() if p.requires_grad]
    return model, training_step, params


_TOKENIZER = word_tokenizer(WORDS)
_COLLATOR = transformers.DataCollatorForLanguageModeling(_TOKENIZER, mlm=False)


def _examples(count: int, seed: int, longest: int = 9) -> list[dict]:
    rng = random.Random(seed)
    texts = [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, longest))) for _ in range(count)
    ]
    return [_TOKENIZER(text) for text in texts]


def _batch(size: int, seed: int = 0, longest: int = 9):
    return _COLLATOR(_examples(size, seed, longest))


_BUILT: dict[str, tuple] = {}


def _built():
    if "step" not in _BUILT:
        model, step, params = build()
        split = graphsplit.split(step, (_batch(2),))
        _BUILT["step"] = (model, step, params, split)
    return _BUILT["step"]


def test_peft_gc_step_verifies_on_the_example_and_another_size():
    model, step, _params, split = _built()
    assert split.path == "trace"
    assert_stage1_holds_no_trainable(split)
    # The hook enable_input_require_grads() registers is live: the eager embedding output
    # requires grad although the embedding is frozen.
    embedding = model.get_input_embeddings()
    assert not embedding.weight.requires_grad
    assert embedding(torch.tensor([[1, 2]])).requires_grad
    batches = [_batch(2), _batch(3, seed=1, longest=12)]
    assert batches[0]["input_ids"].shape[1] != batches[1]["input_ids"].shape[1]
    for seed, batch in enumerate(batches):
        checks = graphsplit.verify(step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


def test_peft_gc_step_caches_the_frozen_embedding_and_keeps_checkpointing():
    model, _step, _params, split = _built()
    held = {name for name, _ in split.stage2.named_parameters()}
    assert not any(name.startswith(EMBEDDING) for name in held), sorted(held)
    trainable = {name for name, p in split.stage2.named_parameters() if p.requires_grad}
    assert trainable == {f"model.{n}" for n, p in model.named_parameters() if p.requires_grad}
    per_sample = {
        key: spec.shape[1:] for key, spec in split.boundary.items() if not spec.is_constant
    }
    # The token embedding (32 floats a token) and the frozen work under the first LoRA layer
    # (its input norm and the base layers of q/k/v) cross, with the labels and the mask.
    assert per_sample.pop("model_base_model_model_model_embed_tokens")[-1] == 32
    assert "labels" in per_sample
    assert "input_ids" not in per_sample
    assert any("q_proj_base_layer" in key for key in per_sample)
    code = split.stage2.code
    # Layer 0, traced into, is checkpointed by graphsplit; layer 1 is called as the module,
    # whose GradientCheckpointingLayer.__call__ checkpoints it.
    assert "torch.utils.checkpoint.checkpoint(" in code
    assert 'getattr(self.model.base_model.model.model.layers, "1")(' in code
    # LoRA dropout draws stay in stage 2; the count of label tokens is computed there.
    assert "aten.bernoulli_" in split.report()
    assert "num_items_in_batch" not in split.boundary


def test_peft_gc_step_cache_round_trip(tmp_path):
    """The Trainer's collated loader (``DataCollatorForLanguageModeling``, padded to each
    batch's longest: two lengths, two plans), cached as it is and trained exactly."""
    _model, step, params, split = _built()
    examples = _examples(4, seed=7) + _examples(3, seed=8, longest=12)
    loader = DataLoader(examples, batch_size=2, collate_fn=_COLLATOR)
    lengths = {batch["input_ids"].shape[1] for batch in loader}
    assert len(lengths) >= 2
    assert_cache_round_trip(split, step, loader, tmp_path / "cache", params)


@pytest.mark.xfail(
    strict=True,
    reason="a 0-dim step input (the Trainer's num_items_in_batch handed to the step, as "
    "Trainer.training_step(model, inputs, num_items_in_batch) takes it) enters the boundary "
    "with batch_dim=None, so BoundarySpec.is_constant (artifacts.py) calls it a per-dataset "
    "constant; split() accepts it, and graphsplit.cache refuses only at the second batch of a "
    "plan, in caching/write/plan_constants.py PlanConstants.handle, with "
    "a refusal naming the per-batch value and the fix (compute it in the step); a loader "
    "with one batch per plan caches the first batch's count silently as every batch's. A "
    "split-time refusal of every unbatched tensor input was tried and reverted: a constant "
    "tensor input (tests/planning/test_callable.py's scale) looks the same at split time",
)
def test_count_handed_to_the_step_is_refused_at_split_naming_it():
    model = _model()

    def training_step(inputs, num_items_in_batch):
        return compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)

    batch = _batch(2)
    with pytest.raises(graphsplit.SplitError) as error:
        graphsplit.split(training_step, (batch, num_items_in_batch_of([batch])))
    assert "num_items_in_batch" in str(error.value)


def test_count_handed_to_the_step_today(tmp_path):
    """What happens today with the count as an argument (see the xfail above): the split is
    made and verifies; a cache of one batch per plan stores that batch's count once and hands
    it to every later batch of cached rows; two batches of one plan are refused, naming the
    per-batch value and the fix (the message used to call it a bug of graphsplit's)."""
    model = _model()

    def training_step(inputs, num_items_in_batch):
        return compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)

    def with_count(raw):
        return {**raw, "num_items_in_batch": num_items_in_batch_of([raw])}

    batch = _batch(2)
    split = graphsplit.split(training_step, (batch, num_items_in_batch_of([batch])))
    assert split.boundary["num_items_in_batch"].is_constant
    assert all(
        c.ok
        for c in graphsplit.verify(
            training_step, split, (batch, with_count(batch)["num_items_in_batch"])
        )
    )

    # One batch: cached without a word; a batch of its first row alone gets the pair's count.
    raw = _batch(2, seed=3)
    graphsplit.cache(split, [with_count(raw)], tmp_path / "one", progress=False)
    cached = graphsplit.CachedDataset(tmp_path / "one", split)
    row = graphsplit.collate([cached[0]])
    one = {key: value[:1] for key, value in raw.items()}  # the same sample, trained alone
    assert num_items_in_batch_of([one]) < num_items_in_batch_of([raw])
    assert torch.equal(row["num_items_in_batch"], num_items_in_batch_of([raw]))
    for count, same in ((num_items_in_batch_of([one]), False), (row["num_items_in_batch"], True)):
        torch.manual_seed(0)
        expected = training_step(one, count)
        torch.manual_seed(0)
        assert torch.equal(split.stage2(**row), expected) is same

    # Two batches of one plan (one length), two counts: refused, naming the per-batch value.
    loader = [with_count(_batch(2, seed=seed)) for seed in (3, 11)]
    assert loader[0]["input_ids"].shape == loader[1]["input_ids"].shape
    assert not torch.equal(loader[0]["num_items_in_batch"], loader[1]["num_items_in_batch"])
    with pytest.raises(CacheError, match="it is a per-batch value"):
        graphsplit.cache(split, loader, tmp_path / "two", progress=False)
