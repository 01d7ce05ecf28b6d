"""Conformance: ``run_image_classification.py``, a frozen ViT backbone, via ``split_trainer``.

Upstream: huggingface/transformers ``examples/pytorch/image-classification/
run_image_classification.py``: the label mappings in the config, ``_train_transforms``
(``RandomResizedCrop(size)``, ``RandomHorizontalFlip()``, ``ToTensor()``, ``normalize``) and
``_val_transforms`` (``Resize``, ``CenterCrop``, ...) applied with ``set_transform``, the
script's ``collate_fn`` (copied verbatim) and the stock ``Trainer`` (``model(**inputs).loss``),
run with ``--remove_unused_columns False`` as its README does. The user's edit is the linear
probe: ``model.vit.requires_grad_(False)`` (the classifier head trains). torchvision is not
installed here: ``unseen13_b_checks`` holds its transforms (the same torch draws).

What must hold:

- with the validation transforms as the training ones (deterministic: the fix the
  ``RandomDatasetWarning`` names), ``split_trainer`` then ``trainer.train()`` logs the plain
  trainer's losses and grad norms and ends with its weights, bit for bit; stage 2 holds only
  the classifier, the boundary is the backbone's [CLS] output (no pixel stored);
- ``compute_loss`` verifies on batches of 2 and 3 and a cache through the disk trains stage 2
  exactly;
- with the script's random training transforms, ``split_trainer`` warns that the dataset draws
  random numbers (``RandomDatasetWarning`` naming ``pixel_values``): the cache freezes one crop
  per image.

Tiny config: ViT 32 wide, 2 layers, 16 px in 4 px patches, 3 labels.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from PIL import Image

import graphsplit
from graphsplit.errors import RandomDatasetWarning
from tests.conformance.unseen2_data_checks import assert_cache_round_trip
from tests.conformance.unseen13_b_checks import (
    random_horizontal_flip,
    random_images,
    random_resized_crop,
    to_normalized_tensor,
)
from tests.helpers import assert_stage1_holds_no_trainable

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
from accelerate.state import AcceleratorState  # noqa: E402

from graphsplit.integrations.transformers import TrainerLoss, split_trainer  # noqa: E402

IMAGE = 16
COUNT = 8
labels = ["cat", "dog", "bird"]


@pytest.fixture(autouse=True)
def _one_thread_and_fresh_accelerate_state():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    torch.set_num_threads(threads)


def collate_fn(examples):  # run_image_classification.py's
    pixel_values = torch.stack([example["pixel_values"] for example in examples])
    labels = torch.tensor([example["labels"] for example in examples])
    return {"pixel_values": pixel_values, "labels": labels}


# The PIL backend, named: torchvision may be a stand-in (examples/diffsynth/diffsynth_import.py).
image_processor = transformers.ViTImageProcessorPil(size={"height": IMAGE, "width": IMAGE})
size = (image_processor.size["height"], image_processor.size["width"])


def normalize(img):  # ToTensor(), Normalize(mean=image_mean, std=image_std)
    return to_normalized_tensor(img, image_processor.image_mean, image_processor.image_std)


def _train_transforms(img):  # Compose([RandomResizedCrop(size), RandomHorizontalFlip(), ...])
    return normalize(random_horizontal_flip(random_resized_crop(img, size)))


def _val_transforms(img):  # Compose([Resize(size), CenterCrop(size), ...]): size is square
    return normalize(img.resize(size[::-1], Image.BILINEAR))


def _dataset(transforms) -> Any:
    dataset = datasets.Dataset.from_dict(
        {"image": random_images(COUNT, seed=3), "labels": [i % len(labels) for i in range(COUNT)]}
    )

    def train_transforms(example_batch):
        """Apply _train_transforms across a batch."""
        example_batch["pixel_values"] = [
            transforms(pil_img.convert("RGB")) for pil_img in example_batch["image"]
        ]
        return example_batch

    dataset.set_transform(train_transforms)
    return dataset


def _model() -> Any:
    torch.manual_seed(0)
    label2id, id2label = {}, {}
    for i, label in enumerate(labels):
        label2id[label] = str(i)
        id2label[str(i)] = label
    config = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=IMAGE,
        patch_size=4,
        num_labels=len(labels),
        label2id=label2id,
        id2label=id2label,
        finetuning_task="image-classification",
    )
    model = transformers.ViTForImageClassification(config)
    model.vit.requires_grad_(False)  # the linear probe
    return model


def _trainer(output_dir: str, transforms=_val_transforms) -> Any:
    training_args = transformers.TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        max_steps=3,
        learning_rate=1e-2,
        remove_unused_columns=False,
        seed=1337,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    return transformers.Trainer(
        model=_model(),
        args=training_args,
        train_dataset=_dataset(transforms),
        processing_class=image_processor,
        data_collator=collate_fn,
    )


def _logged(trainer: Any) -> list[tuple[float, float]]:
    return [(e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "loss" in e]


def _assert_caches_the_backbone(split: Any) -> None:
    held = {name for name, _ in split.stage2.named_parameters()}
    assert held and all("classifier" in name for name in held), sorted(held)
    per_sample = {key: (spec.shape[1:], spec.dtype) for key, spec in split.boundary.items()}
    assert "pixel_values" not in per_sample
    assert ((32,), torch.float32) in per_sample.values(), per_sample


def test_split_trainer_trains_as_the_plain_trainer(tmp_path):
    plain = _trainer(str(tmp_path / "plain"))
    plain.train()
    trainer = _trainer(str(tmp_path / "split"))
    parts = split_trainer(trainer, str(tmp_path / "cache"))
    trainer.train()
    assert len(_logged(trainer)) == 3
    assert _logged(trainer) == _logged(plain)
    one, other = plain.model.state_dict(), trainer.model.state_dict()
    assert one.keys() == other.keys() and all(torch.equal(one[k], other[k]) for k in one)
    _assert_caches_the_backbone(parts.split)
    assert_stage1_holds_no_trainable(parts.split)
    assert len(parts.cached) == COUNT


def test_compute_loss_verifies_on_two_batch_sizes_and_round_trips(tmp_path):
    trainer = _trainer(str(tmp_path / "out"))
    trainer.model.train()
    loss = TrainerLoss(trainer)
    data = trainer.train_dataset
    example = collate_fn([data[0], data[1]])
    split = graphsplit.split(loss, (example,))
    for batch in (example, collate_fn([data[2], data[3], data[4]])):
        checks = graphsplit.verify(loss, split, (batch,))
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]
    _assert_caches_the_backbone(split)
    loader = [collate_fn([data[i] for i in range(s, min(s + 3, COUNT))]) for s in range(0, 8, 3)]
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    assert_cache_round_trip(split, loss, loader, tmp_path / "cache", params)


def test_the_scripts_random_crops_are_named_by_a_warning(tmp_path):
    trainer = _trainer(str(tmp_path / "out"), _train_transforms)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parts = split_trainer(trainer, str(tmp_path / "cache"))
    random_warnings = [w for w in caught if issubclass(w.category, RandomDatasetWarning)]
    assert random_warnings, [str(w.message) for w in caught]
    assert "pixel_values" in str(random_warnings[0].message)
    _assert_caches_the_backbone(parts.split)
