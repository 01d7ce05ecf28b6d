"""Conformance: ``run_mim.py`` (SimMIM) with the patch projection frozen, masks drawn per sample.

Upstream: huggingface/transformers ``examples/pytorch/image-pretraining/run_mim.py``, run as its
``mim.sh`` / README run it (``--model_type vit`` or ``swin`` from scratch, here with a tiny
``--config_name_or_path``, ``--remove_unused_columns False --label_names bool_masked_pos``).
Copied verbatim: the script's ``MaskGenerator`` (``np.random.permutation`` of the mask patches,
upsampled to model patches),
``preprocess_images`` (the transforms, then ``mask_generator()`` per example, under
``ds["train"].set_transform``) and ``collate_fn`` (``{"pixel_values", "bool_masked_pos"}``); the
model is ``AutoModelForMaskedImageModeling.from_config`` of ``CONFIG_MAPPING[model_type]()``
updated with ``image_size`` / ``patch_size`` / ``encoder_stride``. The step is the stock
``Trainer.compute_loss``'s default branch (no ``labels`` in the batch, so no
``num_items_in_batch``)::

    outputs = model(**inputs)
    loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]

The loss is the model's own (SimMIM's L1 on the masked pixels, normalised by the mask's sum).
The script's transforms are torchvision's ``RandomResizedCrop(image_size, scale=(0.67, 1.0),
ratio=(3/4, 4/3))``, ``RandomHorizontalFlip()``, ``ToTensor()``, ``Normalize`` (torchvision is
not installed: ``unseen13_b_checks`` holds them, with torchvision's draws).

The frozen part: the user freezes the patch projection (``model.<vit|swin>.embeddings.
patch_embeddings.requires_grad_(False)``, MoCo v3's "random patch projection" trick). SimMIM
replaces the masked patches' embeddings by the trainable ``mask_token`` after the projection, so
the projection's output (before the mask) is per sample and cacheable.

What must hold: the split is exact on batches of two sizes (loss and every trainable gradient
bit for bit), the patch projection's weights are not held by stage 2 and its output is in the
boundary beside ``bool_masked_pos`` (the collator's mask is data, cached with the sample), a
cache round trip through the disk trains exactly, and caching the script's own ``DataLoader``
says that it freezes one draw of the mask (and of the crop) per sample
(``RandomDatasetWarning`` naming ``bool_masked_pos``).

Tiny configs: ViT 32 wide, 2 layers, 16 px in 4 px patches (mask patches 8 px); Swin 16 wide,
depths (1, 1), window 4, 32 px in 4 px patches, encoder stride 8 (mask patches 8 px).
"""

from __future__ import annotations

import warnings

import numpy as np
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

from torch.utils.data import DataLoader  # noqa: E402

CONFIGS = {
    # model_type: (the tiny config's fields, image_size, patch_size, encoder_stride)
    "vit": (
        {
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "intermediate_size": 64,
        },
        16,
        4,
        4,
    ),
    "swin": ({"embed_dim": 16, "depths": [1, 1], "num_heads": [1, 2], "window_size": 4}, 32, 4, 8),
}
MASK_PATCH_SIZE = 8
MASK_RATIO = 0.6
COUNT = 6


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- upstream: run_mim.py's MaskGenerator and collate_fn, verbatim --------------------------------
class MaskGenerator:
    """
    A class to generate boolean masks for the pretraining task.

    A mask is a 1D tensor of shape (model_patch_size**2,) where the value is either 0 or 1,
    where 1 indicates "masked".
    """

    def __init__(self, input_size=192, mask_patch_size=32, model_patch_size=4, mask_ratio=0.6):
        self.input_size = input_size
        self.mask_patch_size = mask_patch_size
        self.model_patch_size = model_patch_size
        self.mask_ratio = mask_ratio

        if self.input_size % self.mask_patch_size != 0:
            raise ValueError("Input size must be divisible by mask patch size")
        if self.mask_patch_size % self.model_patch_size != 0:
            raise ValueError("Mask patch size must be divisible by model patch size")

        self.rand_size = self.input_size // self.mask_patch_size
        self.scale = self.mask_patch_size // self.model_patch_size

        self.token_count = self.rand_size**2
        self.mask_count = int(np.ceil(self.token_count * self.mask_ratio))

    def __call__(self):
        mask_idx = np.random.permutation(self.token_count)[: self.mask_count]
        mask = np.zeros(self.token_count, dtype=int)
        mask[mask_idx] = 1

        mask = mask.reshape((self.rand_size, self.rand_size))
        mask = mask.repeat(self.scale, axis=0).repeat(self.scale, axis=1)

        return torch.tensor(mask.flatten())


def collate_fn(examples):
    pixel_values = torch.stack([example["pixel_values"] for example in examples])
    mask = torch.stack([example["mask"] for example in examples])
    return {"pixel_values": pixel_values, "bool_masked_pos": mask}


# The PIL backend of run_mim.py's default image processor (ViTImageProcessor for both types).
image_processor = transformers.ViTImageProcessorPil()


def _model(model_type: str):
    fields, image_size, patch_size, encoder_stride = CONFIGS[model_type]
    # ``--config_name_or_path`` of a tiny config (``--config_overrides`` cannot set Swin's lists)
    config = transformers.CONFIG_MAPPING[model_type](**fields)
    # make sure the decoder_type is "simmim" (only relevant for BEiT)
    if hasattr(config, "decoder_type"):
        config.decoder_type = "simmim"
    config.update(
        {"image_size": image_size, "patch_size": patch_size, "encoder_stride": encoder_stride}
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForMaskedImageModeling.from_config(config)
    # the user's frozen part: the patch projection (MoCo v3's random patch projection)
    getattr(model, model_type).embeddings.patch_embeddings.requires_grad_(False)
    model.train()
    return model


def _dataset(model_type: str):
    """The script's train split under ``set_transform(preprocess_images)``."""
    _, image_size, patch_size, _ = CONFIGS[model_type]
    ds = datasets.Dataset.from_dict({"image": random_images(COUNT)})
    image_column_name = "image"

    def transforms(img):  # the script's Compose, torchvision's draws
        img = img.convert("RGB") if img.mode != "RGB" else img
        img = random_resized_crop(
            img, (image_size, image_size), scale=(0.67, 1.0), resample=Image.BILINEAR
        )
        img = random_horizontal_flip(img)
        return to_normalized_tensor(img, image_processor.image_mean, image_processor.image_std)

    # create mask generator
    mask_generator = MaskGenerator(
        input_size=image_size,
        mask_patch_size=MASK_PATCH_SIZE,
        model_patch_size=patch_size,
        mask_ratio=MASK_RATIO,
    )

    def preprocess_images(examples):
        """Preprocess a batch of images by applying transforms + creating a corresponding mask,
        indicating which patches to mask."""

        examples["pixel_values"] = [transforms(image) for image in examples[image_column_name]]
        examples["mask"] = [mask_generator() for i in range(len(examples[image_column_name]))]

        return examples

    ds.set_transform(preprocess_images)
    return ds


def build(model_type: str):
    model = _model(model_type)

    def compute_loss(inputs):  # Trainer.compute_loss, default branch
        outputs = model(**inputs)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
        return loss

    return model, compute_loss


def _batches(model_type: str, sizes, seed: int) -> list[dict]:
    """The Trainer's batches (sequential here), each read once: the transform draws."""
    np.random.seed(seed)
    torch.manual_seed(seed)
    ds = _dataset(model_type)
    batches, start = [], 0
    for size in sizes:
        batches.append(collate_fn([ds[i] for i in range(start, start + size)]))
        start += size
    return batches


_BUILT: dict[str, tuple] = {}


def _built(model_type: str):
    if model_type not in _BUILT:
        model, step = build(model_type)
        example = _batches(model_type, [2], seed=0)[0]
        _BUILT[model_type] = (model, step, example, graphsplit.split(step, (example,)))
    return _BUILT[model_type]


MODEL_TYPES = list(CONFIGS)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_simmim_batch_is_the_scripts(model_type):
    _, image_size, patch_size, _ = CONFIGS[model_type]
    (batch,) = _batches(model_type, [2], seed=0)
    assert set(batch) == {"pixel_values", "bool_masked_pos"}
    assert batch["pixel_values"].shape == (2, 3, image_size, image_size)
    assert batch["bool_masked_pos"].shape == (2, (image_size // patch_size) ** 2)
    assert batch["bool_masked_pos"].dtype == torch.int64  # torch.tensor of an int array


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_simmim_step_verifies_on_two_batch_sizes(model_type):
    _model, step, example, split = _built(model_type)
    assert_stage1_holds_no_trainable(split)
    other = _batches(model_type, [3], seed=1)[0]
    for seed, batch in enumerate([example, other]):
        checks = graphsplit.verify(step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_simmim_caches_the_frozen_patch_projection(model_type):
    model, _step, _example, split = _built(model_type)
    assert split.path == "trace"
    held = {name for name, _ in split.stage2.named_parameters()}
    assert not any("patch_embeddings" in name for name in held), sorted(held)
    trainable = {n for n, p in split.stage2.named_parameters() if p.requires_grad}
    assert {name.split(".", 1)[1] for name in trainable} == {
        n for n, p in model.named_parameters() if p.requires_grad
    }
    # The mask crosses as data; the projection's output (before the mask token replaces the
    # masked patches) is cached; the loss reads the pixels too (SimMIM's L1 target).
    projection = f"model_{model_type}_embeddings_patch_embeddings"
    assert set(split.boundary) == {
        "pixel_values",
        "bool_masked_pos",
        projection if model_type == "vit" else f"{projection}_0",  # Swin's (embeddings, dims)
    }, split.report()


def test_simmim_report_lists_only_frozen_work_as_not_cached():
    _model, _step, _example, split = _built("vit")
    report = split.report()
    not_cached = report.split("Not cached (frozen work that stays in stage 2):")[-1]
    assert "truediv" not in not_cached.split("Notes:")[0], report


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_simmim_cache_round_trip(model_type, tmp_path):
    model, step, _example, split = _built(model_type)
    loader = _batches(model_type, [2, 3, 1], seed=2)
    params = [p for p in model.parameters() if p.requires_grad]
    assert_cache_round_trip(split, step, loader, tmp_path / "cache", params)


def test_simmim_caching_the_scripts_loader_says_the_mask_is_frozen_per_sample(tmp_path):
    """The mask generator and the crop draw in the dataset's transform: a cache keeps one
    draw per sample, where ``run_mim.py`` draws a new mask every epoch."""
    _model, _step, _example, split = _built("vit")
    np.random.seed(0)
    loader = DataLoader(_dataset("vit"), batch_size=2, collate_fn=collate_fn)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphsplit.cache(split, loader, tmp_path / "cache", progress=False)
    messages = [str(w.message) for w in caught if issubclass(w.category, RandomDatasetWarning)]
    assert messages, [str(w.message) for w in caught]
    assert "bool_masked_pos" in messages[0], messages[0]
