"""Conformance: VideoMAE video classification with the encoder frozen, as transformers' video
classification guide trains it (``docs/source/en/tasks/video_classification.md``).

The guide fine-tunes ``VideoMAEForVideoClassification`` (here from a tiny config, random
weights) with ``Trainer`` and its own collator::

    def collate_fn(examples):
        # permute to (num_frames, num_channels, height, width)
        pixel_values = torch.stack(
            [example["video"].permute(1, 0, 2, 3) for example in examples]
        )
        labels = torch.tensor([example["label"] for example in examples])
        return {"pixel_values": pixel_values, "labels": labels}

The user freezes the encoder (``model.videomae.requires_grad_(False)``) and trains the head
(``fc_norm`` over the mean-pooled tokens, ``classifier``). The step is what ``Trainer`` runs on
each batch (``transformers/trainer.py``): ``VideoMAEForVideoClassification.forward`` takes
``**kwargs``, so ``model_accepts_loss_kwargs`` is true and ``_get_num_items_in_batch`` counts
the labels (``sum(labels.ne(-100).sum() for labels in labels_for_count)``, divided by the
tp*cp*sp sizes, 1 here); ``compute_loss``'s default branch then runs::

    inputs = {**inputs, **kwargs}          # kwargs = {"num_items_in_batch": num_items_in_batch}
    outputs = model(**inputs)
    loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]

VideoMAE passes those ``**kwargs`` on to its encoder (``self.videomae(pixel_values,
**kwargs)``), so the frozen encoder gets the batch's item count beside the video.

Two forms: ``trainer`` (that step) and ``plain`` (``model(**inputs)`` alone, a control without
the item count). What must hold: loss and every trainable gradient bit for bit (example batch
and a batch of another size), the frozen encoder cached (its weights not held by stage 2), and a
cache round trip through the disk.

Tiny config: 4 frames of 16 px in 8 px patches, tubelet 2 (8 tokens), 32 wide, 2 layers,
4 classes.
"""

from __future__ import annotations

import pytest
import torch

import graphsplit
from tests.helpers import assert_stage1_holds_no_trainable

transformers = pytest.importorskip("transformers")

from tests.conformance.unseen2_data_checks import assert_cache_round_trip  # noqa: E402

FRAMES = 4
IMAGE = 16
CLASSES = 4
HIDDEN = 32


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model():
    torch.manual_seed(0)
    config = transformers.VideoMAEConfig(
        image_size=IMAGE,
        patch_size=8,
        num_channels=3,
        num_frames=FRAMES,
        tubelet_size=2,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=CLASSES,
    )
    model = transformers.VideoMAEForVideoClassification(config)
    model.videomae.requires_grad_(False)  # the user's frozen encoder
    model.train()
    return model


def build(form: str):
    model = _model()

    if form == "trainer":

        def training_step(inputs):
            # Trainer._get_num_items_in_batch, one batch, one device
            labels_for_count = [inputs["labels"]]
            num_items_in_batch = sum(labels.ne(-100).sum() for labels in labels_for_count)
            num_items_in_batch = num_items_in_batch / (1 * 1 * 1)
            # Trainer.compute_loss, default branch (model_accepts_loss_kwargs)
            kwargs = {}
            if num_items_in_batch is not None:
                kwargs["num_items_in_batch"] = num_items_in_batch
            inputs = {**inputs, **kwargs}
            outputs = model(**inputs)
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
            return loss

    else:

        def training_step(inputs):
            outputs = model(**inputs)
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
            return loss

    return model, training_step


def collate_fn(examples):
    # permute to (num_frames, num_channels, height, width)
    pixel_values = torch.stack([example["video"].permute(1, 0, 2, 3) for example in examples])
    labels = torch.tensor([example["label"] for example in examples])
    return {"pixel_values": pixel_values, "labels": labels}


def _batch(size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``collate_fn`` over pytorchvideo's samples: ``video`` is (C, T, H, W), normalised."""
    generator = torch.Generator().manual_seed(seed)
    examples = [
        {
            "video": torch.randn(3, FRAMES, IMAGE, IMAGE, generator=generator),
            "label": int(torch.randint(0, CLASSES, (), generator=generator)),
        }
        for _ in range(size)
    ]
    return collate_fn(examples)


_BUILT: dict[str, tuple] = {}


def _built(form: str):
    if form not in _BUILT:
        model, step = build(form)
        split = graphsplit.split(step, (_batch(2),))
        _BUILT[form] = (model, step, split)
    return _BUILT[form]


FORMS = ["trainer", "plain"]


@pytest.mark.parametrize("form", FORMS)
def test_videomae_step_verifies_on_the_example_and_another_size(form):
    _model, step, split = _built(form)
    assert_stage1_holds_no_trainable(split)
    for seed, batch in enumerate([_batch(2), _batch(3, seed=1)]):
        checks = graphsplit.verify(step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


def _assert_caches_the_encoder(split, model):
    held = {name for name, _ in split.stage2.named_parameters()}
    assert not any(".videomae." in f".{name}" for name in held), sorted(held)
    trainable = {n for n, p in split.stage2.named_parameters() if p.requires_grad}
    assert {name.split(".", 1)[1] for name in trainable} == {
        n for n, p in model.named_parameters() if p.requires_grad
    }
    per_sample = {key: (spec.shape[1:], spec.dtype) for key, spec in split.boundary.items()}
    assert per_sample.pop("labels") == ((), torch.int64)
    # the head reads the encoder's tokens (or their mean): no video crosses the boundary
    assert per_sample and all(
        shape[-1] == HIDDEN and dtype == torch.float32 for shape, dtype in per_sample.values()
    ), per_sample


def test_plain_caches_the_encoder():
    model, _step, split = _built("plain")
    _assert_caches_the_encoder(split, model)


def test_trainer_caches_the_encoder():
    """The item count makes the tracer open the frozen encoder, where VideoMAEEmbeddings adds
    ``self.position_embeddings.detach().type_as(embeddings)``: ``type_as`` reads only the
    embeddings' dtype, so the sum is the batch's data with its batch dimension and the encoder
    is cached (``type_as``'s other argument was taken as data, a constant with no batch
    dimension, and kept every layer after the patch embedding in stage 2)."""
    model, _step, split = _built("trainer")
    _assert_caches_the_encoder(split, model)


@pytest.mark.parametrize("form", FORMS)
def test_videomae_cache_round_trip(form, tmp_path):
    """Batches of ``collate_fn`` of sizes 2, 3 and 1, cached and read back: every sample once,
    in order, each batch trained exactly."""
    model, step, split = _built(form)
    loader = [_batch(2, seed=2), _batch(3, seed=3), _batch(1, seed=4)]
    params = [p for p in model.parameters() if p.requires_grad]
    assert_cache_round_trip(split, step, loader, tmp_path / "cache", params)
