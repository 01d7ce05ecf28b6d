"""Conformance: DETR object detection with the backbone frozen, as transformers'
``examples/pytorch/object-detection/run_object_detection.py`` trains it.

The script fine-tunes ``AutoModelForObjectDetection`` (here ``DetrForObjectDetection`` from a
tiny config with transformers' own ``ResNetBackbone``, random weights) with ``Trainer`` and its
``collate_fn``::

    def collate_fn(batch: List[BatchFeature]) -> Mapping[str, Union[torch.Tensor, List[Any]]]:
        data = {}
        data["pixel_values"] = torch.stack([x["pixel_values"] for x in batch])
        data["labels"] = [x["labels"] for x in batch]
        if "pixel_mask" in batch[0]:
            data["pixel_mask"] = torch.stack([x["pixel_mask"] for x in batch])
        return data

(``return_pixel_mask`` is False in its transform, so no ``pixel_mask``). The user freezes the
CNN backbone with DETR's own ``model.model.freeze_backbone()``. ``Trainer.compute_loss``'s
default branch is the step (``DetrForObjectDetection.forward`` takes no ``**kwargs``, so no
``num_items_in_batch``)::

    outputs = model(**inputs)
    loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]

DETR's loss is its own (``loss/loss_for_object_detection.py``): a Hungarian matching of queries
to boxes (``scipy.optimize.linear_sum_assignment`` on the trainable outputs' cost matrix), then
class, L1 and GIoU losses.

Two forms:

- ``as_written``: the script's batch, ``labels`` a list of per-image dicts holding a different
  number of boxes each. graphsplit refuses it up front (a ragged per-sample list has no batch
  dim to cache rows along); the message must name the field and the fix.
- ``padded``: the fix that message gives: the collator pads ``class_labels`` / ``boxes`` to the
  batch's most boxes with a ``boxes_mask``, and the step turns them back into DETR's list of
  dicts before ``model(**inputs)``. Split, verified (example batch and another size), the
  backbone cached and not held by stage 2, the images not stored (stage 2 reads only their
  shape, dtype and ``.device``, which the stand-in answers with the device of stage 2's
  batch), and a cache round trip through the disk.

DETR's loss needs scipy (not a graphsplit dependency): the ``padded`` tests are skipped without
it. Tiny config: ResNet basic blocks (8, 16), d_model 16, one encoder and one decoder layer,
5 queries, 3 classes, 32 px images.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import graphsplit
from tests.helpers import assert_stage1_holds_no_trainable

transformers = pytest.importorskip("transformers")

from tests.conformance.unseen2_data_checks import assert_cache_round_trip  # noqa: E402

IMAGE = 32
CLASSES = 3


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model():
    torch.manual_seed(0)
    config = transformers.DetrConfig(
        backbone_config=transformers.ResNetConfig(
            embedding_size=8,
            hidden_sizes=[8, 16],
            depths=[1, 1],
            layer_type="basic",
            out_features=["stage2"],
        ),
        use_timm_backbone=False,
        use_pretrained_backbone=False,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        num_queries=5,
        num_labels=CLASSES,
    )
    model = transformers.DetrForObjectDetection(config)
    model.model.freeze_backbone()  # the user's frozen backbone
    model.train()
    return model


def build(form: str):
    model = _model()

    if form == "as_written":

        def training_step(inputs):
            outputs = model(**inputs)
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
            return loss

    else:

        def training_step(inputs):
            inputs = dict(inputs)
            class_labels = inputs.pop("class_labels")
            boxes = inputs.pop("boxes")
            boxes_mask = inputs.pop("boxes_mask")
            inputs["labels"] = [
                {"class_labels": labels[mask], "boxes": image_boxes[mask]}
                for labels, image_boxes, mask in zip(class_labels, boxes, boxes_mask)
            ]
            outputs = model(**inputs)
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
            return loss

    return model, training_step


def collate_fn(batch: list[dict[str, Any]]) -> dict[str, Any]:
    """The script's ``collate_fn`` (no ``pixel_mask``)."""
    data = {}
    data["pixel_values"] = torch.stack([x["pixel_values"] for x in batch])
    data["labels"] = [x["labels"] for x in batch]
    if "pixel_mask" in batch[0]:
        data["pixel_mask"] = torch.stack([x["pixel_mask"] for x in batch])
    return data


def padded_collate_fn(batch: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The refusal's fix: the boxes padded to the batch's most, with a mask of the real ones."""
    most = max(len(x["labels"]["class_labels"]) for x in batch)
    class_labels = torch.zeros(len(batch), most, dtype=torch.int64)
    boxes = torch.zeros(len(batch), most, 4)
    boxes_mask = torch.zeros(len(batch), most, dtype=torch.bool)
    for row, x in enumerate(batch):
        count = len(x["labels"]["class_labels"])
        class_labels[row, :count] = x["labels"]["class_labels"]
        boxes[row, :count] = x["labels"]["boxes"]
        boxes_mask[row, :count] = True
    return {
        "pixel_values": torch.stack([x["pixel_values"] for x in batch]),
        "class_labels": class_labels,
        "boxes": boxes,
        "boxes_mask": boxes_mask,
    }


def _examples(size: int, seed: int) -> list[dict[str, Any]]:
    """What ``augment_and_transform_batch`` yields per image: normalised pixels and the
    image processor's ``labels`` (``class_labels``, ``boxes`` as normalised cx, cy, w, h)."""
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for index in range(size):
        count = 1 + (index + seed) % 3
        centres = torch.rand(count, 2, generator=generator) * 0.5 + 0.25
        sizes = torch.rand(count, 2, generator=generator) * 0.3 + 0.1
        examples.append(
            {
                "pixel_values": torch.randn(3, IMAGE, IMAGE, generator=generator),
                "labels": {
                    "class_labels": torch.randint(0, CLASSES, (count,), generator=generator),
                    "boxes": torch.cat([centres, sizes], dim=1),
                },
            }
        )
    return examples


def _batch(form: str, size: int, seed: int = 0) -> dict[str, Any]:
    collate = collate_fn if form == "as_written" else padded_collate_fn
    return collate(_examples(size, seed))


def test_as_written_the_ragged_labels_list_is_refused_naming_the_field_and_the_fix():
    _model, step = build("as_written")
    batch = _batch("as_written", 2)
    assert len({len(labels["boxes"]) for labels in batch["labels"]}) == 2  # ragged
    with pytest.raises(graphsplit.SplitError) as caught:
        graphsplit.split(step, (batch,))
    message = str(caught.value)
    assert "inputs['labels']" in message and "per-sample" in message
    assert "fix:" in message and "pad and stack inputs['labels']" in message
    assert "mask" in message


_BUILT: dict[str, tuple] = {}


def _padded():
    pytest.importorskip("scipy")  # DETR's Hungarian matcher
    if "padded" not in _BUILT:
        model, step = build("padded")
        split = graphsplit.split(step, (_batch("padded", 2),))
        _BUILT["padded"] = (model, step, split)
    return _BUILT["padded"]


def test_padded_step_verifies_on_the_example_and_another_size():
    _model, step, split = _padded()
    assert_stage1_holds_no_trainable(split)
    for seed, batch in enumerate([_batch("padded", 2), _batch("padded", 3, seed=1)]):
        checks = graphsplit.verify(step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


def test_padded_caches_the_backbone_and_stage2_does_not_hold_it():
    model, _step, split = _padded()
    held = {name for name, _ in split.stage2.named_parameters()}
    assert not any(".backbone." in f".{name}" for name in held), sorted(held)
    trainable = {n for n, p in split.stage2.named_parameters() if p.requires_grad}
    assert {name.split(".", 1)[1] for name in trainable} == {
        n for n, p in model.named_parameters() if p.requires_grad
    }
    per_sample = {key: (spec.shape[1:], spec.dtype) for key, spec in split.boundary.items()}
    # the backbone's last feature map (16 channels at 1/8) and its downsampled pixel mask
    assert ((16, 4, 4), torch.float32) in per_sample.values()
    assert ((4, 4), torch.bool) in per_sample.values()


def test_padded_does_not_store_the_images():
    """Stage 2 reads only the images' shape, dtype and device (``DetrModel.forward``'s
    ``device = pixel_values.device`` builds the pixel mask and position embeddings there):
    their shape is stored (12 KiB a sample here, 12x the cached feature map, 7.7 MB at DETR's
    800 px), and the stand-in answers ``.device`` with the device of stage 2's batch."""
    _model, _step, split = _padded()
    assert "pixel_values" not in split.boundary
    assert split.boundary["pixel_values__shape"].bytes_per_sample == 4 * 8
    assert "input 'pixel_values' not stored" in split.report()


def test_padded_cache_round_trip(tmp_path):
    """Batches of ``padded_collate_fn`` of sizes 2, 3 and 1, cached and read back: every
    sample once, in order, each batch trained exactly."""
    model, step, split = _padded()
    loader = [_batch("padded", 2, seed=2), _batch("padded", 3, seed=3), _batch("padded", 1, 4)]
    params = [p for p in model.parameters() if p.requires_grad]
    assert_cache_round_trip(split, step, loader, tmp_path / "cache", params)
