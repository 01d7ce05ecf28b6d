"""Conformance: ``run_mae.py`` (ViTMAE pre-training): random masking drawn inside the model.

Upstream: huggingface/transformers ``examples/pytorch/image-pretraining/run_mae.py``, run as its
README runs it (``--remove_unused_columns False``, ``--base_learning_rate 1.5e-4``, a
``ViTMAEConfig`` with ``mask_ratio=0.75`` and ``norm_pix_loss=True``, the model trained from
scratch): the dataset's ``set_transform(preprocess_images)``, the script's ``collate_fn``
(copied verbatim: ``{"pixel_values": torch.stack(...)}``) and the stock ``Trainer``
(``model(**inputs).loss``). ``ViTMAEForPreTraining`` draws its mask inside the model
(``ViTMAEEmbeddings.random_masking``: ``noise = torch.rand(batch_size, seq_length)``, argsorted),
after the patch embedding, and computes the loss on the masked patches of the normalised
target ``patchify(pixel_values)``.

The script's transforms are torchvision's ``RandomResizedCrop(size, scale=(0.2, 1.0),
BICUBIC)`` and ``RandomHorizontalFlip()`` (torchvision is not installed here:
``unseen13_b_checks`` holds ``RandomResizedCrop.get_params`` copied from torchvision, the flip
as torchvision draws it, the resize PIL's bicubic, ``ToTensor`` and ``Normalize`` in torch).

Forms:

- ``scratch``: ``run_mae.py`` as written, every parameter trained. Nothing is cacheable but the
  data; the mask must be drawn in stage 2 every step.
- ``frozen patch embedding``: the user also freezes the patch projection
  (``model.vit.embeddings.patch_embeddings.requires_grad_(False)``, the MoCo v3 "random patch
  projection" trick). Its output, taken before the masking draw, is per sample and cacheable;
  the masking must still be drawn in stage 2.

What must hold: the step (``Trainer.compute_loss`` via ``TrainerLoss``) splits exactly on
batches of two sizes under the mask's draws; with the frozen patch embedding its weight is not
held by stage 2; a cache through the disk trains stage 2 exactly; ``split_trainer`` on a
deterministic dataset (``Resize`` only: the fix the warning names) logs the plain trainer's
losses and grad norms and ends with its weights, bit for bit; with the script's random
transforms, ``split_trainer`` warns (``RandomDatasetWarning``, naming ``pixel_values``).

Tiny config: ViTMAE 32 wide, 2 layers, decoder 32 wide and 1 layer, 16 px in 4 px patches.
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


@pytest.fixture(autouse=True)
def _one_thread_and_fresh_accelerate_state():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    torch.set_num_threads(threads)


# -- upstream: run_mae.py's collate_fn, and torchvision's transforms it composes -------------------
def collate_fn(examples):
    pixel_values = torch.stack([example["pixel_values"] for example in examples])
    return {"pixel_values": pixel_values}


# The PIL backend, named: torchvision may be a stand-in (examples/diffsynth/diffsynth_import.py).
image_processor = transformers.ViTImageProcessorPil(size={"height": IMAGE, "width": IMAGE})
size = (image_processor.size["height"], image_processor.size["width"])


def _to_normalized_tensor(img):  # ToTensor(), Normalize(image_mean, image_std)
    return to_normalized_tensor(img, image_processor.image_mean, image_processor.image_std)


def random_transforms(img):  # the script's Compose
    img = img.convert("RGB") if img.mode != "RGB" else img
    img = random_resized_crop(img, size, scale=(0.2, 1.0), resample=Image.BICUBIC)
    img = random_horizontal_flip(img)
    return _to_normalized_tensor(img)


def deterministic_transforms(img):  # Resize only: what the RandomDatasetWarning suggests
    img = img.convert("RGB") if img.mode != "RGB" else img
    return _to_normalized_tensor(img.resize(size[::-1], Image.BICUBIC))


def _dataset(transforms) -> Any:
    ds = datasets.Dataset.from_dict({"image": random_images(COUNT)})
    image_column_name = "image"

    def preprocess_images(examples):
        """Preprocess a batch of images by applying transforms."""

        examples["pixel_values"] = [transforms(image) for image in examples[image_column_name]]
        return examples

    # Set the training transforms
    ds.set_transform(preprocess_images)
    return ds


def _model(form: str) -> Any:
    torch.manual_seed(0)
    config = transformers.ViTMAEConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        decoder_hidden_size=32,
        decoder_num_hidden_layers=1,
        decoder_num_attention_heads=2,
        decoder_intermediate_size=64,
        image_size=IMAGE,
        patch_size=4,
    )
    # adapt config
    config.update({"mask_ratio": 0.75, "norm_pix_loss": True})
    model = transformers.ViTMAEForPreTraining(config)
    if form == "frozen_patch_embedding":
        model.vit.embeddings.patch_embeddings.requires_grad_(False)
    return model


def _trainer(output_dir: str, form: str, transforms=deterministic_transforms) -> Any:
    model = _model(form)
    training_args = transformers.TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        max_steps=3,
        remove_unused_columns=False,
        seed=1337,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    # Compute absolute learning rate (--base_learning_rate 1.5e-4)
    total_train_batch_size = (
        training_args.train_batch_size
        * training_args.gradient_accumulation_steps
        * training_args.world_size
    )
    training_args.learning_rate = 1.5e-4 * total_train_batch_size / 256
    return transformers.Trainer(
        model=model,
        args=training_args,
        train_dataset=_dataset(transforms),
        processing_class=image_processor,
        data_collator=collate_fn,
    )


FORMS = ["scratch", "frozen_patch_embedding"]
_BUILT: dict[str, tuple] = {}


def _built(form: str, tmp_path_factory) -> tuple:
    if form not in _BUILT:
        trainer = _trainer(str(tmp_path_factory.mktemp("out")), form)
        trainer.model.train()
        loss = TrainerLoss(trainer)
        data = trainer.train_dataset
        example = collate_fn([data[0], data[1]])
        _BUILT[form] = (trainer, loss, data, graphsplit.split(loss, (example,)))
    return _BUILT[form]


def _logged(trainer: Any) -> list[tuple[float, float]]:
    return [(e["loss"], e["grad_norm"]) for e in trainer.state.log_history if "loss" in e]


# -- tests ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("form", FORMS)
def test_mae_step_verifies_on_two_batch_sizes_under_the_mask_draws(form, tmp_path_factory):
    _owner, loss, data, split = _built(form, tmp_path_factory)
    assert_stage1_holds_no_trainable(split)
    for seed, batch in enumerate(
        [collate_fn([data[0], data[1]]), collate_fn([data[2], data[3], data[4]])]
    ):
        checks = graphsplit.verify(loss, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]
    # The mask is drawn every step: two seeds, two losses, from the same cached row.
    row = split.stage1(**collate_fn([data[0], data[1]]))
    torch.manual_seed(0)
    first = split.stage2(**row)
    torch.manual_seed(1)
    assert not torch.equal(first, split.stage2(**row))


def test_frozen_patch_embedding_is_cached_before_the_masking(tmp_path_factory):
    _owner, _loss, _data, split = _built("frozen_patch_embedding", tmp_path_factory)
    held = {name for name, _ in split.stage2.named_parameters()}
    assert not [name for name in held if "patch_embeddings" in name], sorted(held)
    per_sample = {key: (spec.shape[1:], spec.dtype) for key, spec in split.boundary.items()}
    # The projected patches (16 of them, 32 wide), taken before the mask is drawn, and the
    # normalised target (16 patches of 4 x 4 x 3 pixels): no pixel is stored.
    assert ((16, 32), torch.float32) in per_sample.values(), per_sample
    assert ((16, 48), torch.float32) in per_sample.values(), per_sample
    assert "pixel_values" not in per_sample


@pytest.mark.parametrize("form", FORMS)
def test_mae_cache_round_trip(form, tmp_path_factory, tmp_path):
    trainer, loss, data, split = _built(form, tmp_path_factory)
    loader = [collate_fn([data[i] for i in range(s, min(s + 3, COUNT))]) for s in range(0, 8, 3)]
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    assert_cache_round_trip(split, loss, loader, tmp_path / "cache", params)


@pytest.mark.parametrize("form", FORMS)
def test_split_trainer_trains_as_the_plain_run_mae_trainer(form, tmp_path):
    plain = _trainer(str(tmp_path / "plain"), form)
    plain.train()
    trainer = _trainer(str(tmp_path / "split"), form)
    parts = split_trainer(trainer, str(tmp_path / "cache"))
    trainer.train()
    assert len(_logged(trainer)) == 3
    assert _logged(trainer) == _logged(plain)
    one, other = plain.model.state_dict(), trainer.model.state_dict()
    assert one.keys() == other.keys() and all(torch.equal(one[k], other[k]) for k in one)
    assert len(parts.cached) == COUNT


def test_the_scripts_random_crops_are_named_by_a_warning(tmp_path):
    trainer = _trainer(str(tmp_path / "out"), "frozen_patch_embedding", random_transforms)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        split_trainer(trainer, str(tmp_path / "cache"))
    random_warnings = [w for w in caught if issubclass(w.category, RandomDatasetWarning)]
    assert random_warnings, [str(w.message) for w in caught]
    assert "pixel_values" in str(random_warnings[0].message)
