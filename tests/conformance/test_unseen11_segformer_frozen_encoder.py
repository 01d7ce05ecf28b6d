"""Conformance: SegFormer semantic segmentation with the encoder frozen, as transformers'
``examples/pytorch/semantic-segmentation/run_semantic_segmentation_no_trainer.py`` trains it.

The script builds ``AutoModelForSemanticSegmentation`` (here ``SegformerForSemanticSegmentation``
from a tiny config, random weights), its train transforms apply ``ReduceLabels`` (background 0
becomes the ignore index 255, every other class id moves down by one), the loader collates with
``default_data_collator`` (a dict of ``pixel_values`` and ``labels``) and the loop body is::

    model.train()
    for step, batch in enumerate(train_dataloader):
        outputs = model(**batch)
        loss = outputs.loss
        loss = loss / args.gradient_accumulation_steps
        accelerator.backward(loss)

The user freezes the Mix Transformer encoder (``model.segformer.requires_grad_(False)``) and
trains the all-MLP decode head; the loss is SegFormer's own (logits upsampled to the labels'
size, ``CrossEntropyLoss(ignore_index=config.semantic_loss_ignore_index)``).

Two forms of the same loop:

- ``as_written``: ``model.train()`` as the loop calls it. SegFormer's default config has
  ``drop_path_rate=0.1``, so the frozen encoder draws random numbers (stochastic depth) every
  step: it cannot be cached; the split must stay exact and say why and what to do.
- ``encoder_eval``: the user follows that advice, ``model.segformer.eval()`` after
  ``model.train()``: the encoder's four feature maps are cached, its weights not held by stage 2.

What must hold: loss and every trainable gradient bit for bit (example batch and a batch of
another size), the boundary, and a cache round trip through the disk.

Tiny config: 4 stages of one block, hidden sizes (8, 16, 24, 32), decoder 16 wide, 5 classes,
32 px images.
"""

from __future__ import annotations

import pytest
import torch

import graphsplit
from tests.helpers import assert_stage1_holds_no_trainable

transformers = pytest.importorskip("transformers")

from tests.conformance.unseen2_data_checks import assert_cache_round_trip  # noqa: E402

IMAGE = 32
CLASSES = 5
GRADIENT_ACCUMULATION_STEPS = 2
IGNORE = 255


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(form: str):
    torch.manual_seed(0)
    config = transformers.SegformerConfig(
        num_channels=3,
        num_encoder_blocks=4,
        depths=[1, 1, 1, 1],
        sr_ratios=[4, 2, 1, 1],
        hidden_sizes=[8, 16, 24, 32],
        num_attention_heads=[1, 1, 2, 2],
        decoder_hidden_size=16,
        num_labels=CLASSES,
        image_size=IMAGE,
    )
    model = transformers.SegformerForSemanticSegmentation(config)
    model.segformer.requires_grad_(False)  # the user's frozen encoder
    model.train()
    if form == "encoder_eval":
        model.segformer.eval()
    return model


def build(form: str):
    model = _model(form)

    def training_step(batch):
        outputs = model(**batch)
        loss = outputs.loss
        loss = loss / GRADIENT_ACCUMULATION_STEPS
        return loss

    return model, training_step


def _batch(size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``default_data_collator``'s batch after the script's transforms: normalised images and
    ``ReduceLabels``'d maps (annotation 0 is background, becomes 255; the rest move down)."""
    generator = torch.Generator().manual_seed(seed)
    pixel_values = torch.randn(size, 3, IMAGE, IMAGE, generator=generator)
    annotation = torch.randint(0, CLASSES + 1, (size, IMAGE, IMAGE), generator=generator)
    labels = annotation - 1
    labels[annotation == 0] = IGNORE
    return {"pixel_values": pixel_values, "labels": labels}


_BUILT: dict[str, tuple] = {}


def _built(form: str):
    if form not in _BUILT:
        model, step = build(form)
        split = graphsplit.split(step, (_batch(2),))
        _BUILT[form] = (model, step, split)
    return _BUILT[form]


FORMS = ["as_written", "encoder_eval"]


@pytest.mark.parametrize("form", FORMS)
def test_segformer_step_verifies_on_the_example_and_another_size(form):
    _model, step, split = _built(form)
    assert_stage1_holds_no_trainable(split)
    assert (_batch(3, seed=1)["labels"] == IGNORE).any()  # the ignore index is exercised
    for seed, batch in enumerate([_batch(2), _batch(3, seed=1)]):
        checks = graphsplit.verify(step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


def test_as_written_the_encoders_drop_path_keeps_it_in_stage2_and_says_why():
    """Stochastic depth in the frozen encoder (train mode) is a random draw: the encoder stays
    in stage 2 and the report names it, with the fix (``model.segformer.eval()``)."""
    _model, _step, split = _built("as_written")
    assert set(split.boundary) == {"pixel_values", "labels"}
    report = split.report()
    assert "model_segformer" in report and "random" in report
    assert "call model.segformer.eval() to make it cacheable" in report


def test_encoder_eval_caches_the_encoder_features_and_stage2_holds_only_the_head():
    model, _step, split = _built("encoder_eval")
    held = {name for name, _ in split.stage2.named_parameters()}
    assert not any(".segformer." in f".{name}" for name in held), sorted(held)
    trainable = {n for n, p in split.stage2.named_parameters() if p.requires_grad}
    assert {name.split(".", 1)[1] for name in trainable} == {
        n for n, p in model.named_parameters() if p.requires_grad
    }
    per_sample = {key: (spec.shape[1:], spec.dtype) for key, spec in split.boundary.items()}
    assert per_sample["labels"] == ((IMAGE, IMAGE), torch.int64)
    # the decode head's four inputs: the encoder's feature maps at 1/4 .. 1/32 resolution
    keys = split.plan.cached[("model.segformer", 0)].keys
    for index, (width, side) in enumerate([(8, 8), (16, 4), (24, 2), (32, 1)]):
        key = keys[f"hidden_states__{index}"]
        assert per_sample[key] == ((width, side, side), torch.float32)
    assert not any(
        spec.dtype.is_floating_point and spec.shape[1:] == (3, IMAGE, IMAGE)
        for spec in split.boundary.values()
    ), "the images themselves are not needed once the encoder is cached"


def test_encoder_eval_caches_each_distinct_tensor_once():
    """SegformerModel returns ``last_hidden_state is hidden_states[-1]``: one tensor, stored
    once (it was stored under both fields' keys, 1/5 of the cache twice)."""
    _model, _step, split = _built("encoder_eval")
    planned = split.plan.cached[("model.segformer", 0)]
    assert planned.shared == {"hidden_states__3": "last_hidden_state"}
    assert planned.keys["hidden_states__3"] == planned.keys["last_hidden_state"]
    encoder = [key for key in split.boundary if key.startswith("model_segformer__0__")]
    assert len(encoder) == 4, encoder  # the four feature maps, each once
    assert "the same tensor as another field: hidden_states__3 (is last_hidden_state)" in (
        split.report()
    )


@pytest.mark.parametrize("form", FORMS)
def test_segformer_cache_round_trip(form, tmp_path):
    """Batches as ``default_data_collator`` gives them, of sizes 2, 3 and 1, cached and read
    back: every sample once, in order, each batch trained exactly."""
    model, step, split = _built(form)
    loader = [_batch(2, seed=2), _batch(3, seed=3), _batch(1, seed=4)]
    params = [p for p in model.parameters() if p.requires_grad]
    assert_cache_round_trip(split, step, loader, tmp_path / "cache", params)
