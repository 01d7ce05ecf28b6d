"""Conformance: a COCO-style dataset, five captions per image, one picked at random per read.

diffusers' ``examples/text_to_image/train_text_to_image_lora.py`` accepts a caption column of
*lists* of strings (COCO's five captions per image): its ``tokenize_captions`` takes
``random.choice(caption)`` for a list (``is_train=True``), its ``preprocess_train`` runs on
each read through ``dataset.with_transform(preprocess_train)``, its ``collate_fn`` stacks
``pixel_values`` and ``input_ids``, and the loop body (``training_step`` below) encodes both
with the frozen VAE and text encoder and trains the LoRA UNet. All four are copied from the
script as written (torchvision's transforms are numpy here, as in ``test_unseen2_data_images``;
the tokenizer is a word-level ``PreTrainedTokenizerFast`` called as the script calls CLIP's).

The dataset is a Hugging Face ``datasets.Dataset`` built as a dict of lists, ``{"image": [PIL
images], "text": [[5 captions], ...]}``. Checked: the split (default path) verifies on batches
of two sizes and stage 2 holds only the LoRA UNet; ``graphsplit.cache`` on the script's loader
warns that the dataset draws random numbers (``RandomDatasetWarning``, naming ``input_ids``);
with Python's ``random`` seeded alike before the raw pass and the cache's, each raw batch's
cached rows train stage 2 exactly as the step on the raw batch (loss and every LoRA gradient
bit for bit), each row under its dataset index, and its cached text embedding is one of its
own image's five captions'; a rerun that draws other captions is refused as changed data.
"""

from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import graphsplit
from graphsplit.errors import RandomDatasetWarning, StaleCacheError
from tests.conformance.unseen2_data_checks import assert_same_step
from tests.conformance.unseen_checks import stage2_top_modules, word_tokenizer
from tests.zoo import CaptionedImages, build_sd_lora_step

datasets = pytest.importorskip("datasets")
PIL_Image = pytest.importorskip("PIL.Image")

_STEP = build_sd_lora_step(seed=0)
vae, text_encoder, unet, noise_scheduler = (
    _STEP.vae,
    _STEP.text_encoder,
    _STEP.unet,
    _STEP.scheduler,
)
PARAMS = [param for param in unet.parameters() if param.requires_grad]

COUNT = 6
ADJECTIVES = ["a photo of", "an image of", "a picture of", "a drawing of", "a render of"]
caption_column, image_column = "text", "image"


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _coco_like() -> datasets.Dataset:
    """Six images, five captions each (a list per row), as COCO's captions are."""
    source = CaptionedImages(length=COUNT)
    images, texts = [], []
    for index in range(COUNT):
        pixels = source[index]["pixel_values"]
        array = ((pixels + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
        images.append(PIL_Image.fromarray(array.permute(1, 2, 0).numpy()))
        caption = source.caption_of(index)
        texts.append([f"{prefix} {caption}" for prefix in ADJECTIVES])
    return datasets.Dataset.from_dict({"image": images, "text": texts})


WORDS = sorted({word for captions in _coco_like()["text"] for c in captions for word in c.split()})
tokenizer = word_tokenizer(WORDS)
tokenizer.model_max_length = 16


def tokenize_captions(examples, is_train=True):  # the script's
    captions = []
    for caption in examples[caption_column]:
        if isinstance(caption, str):
            captions.append(caption)
        elif isinstance(caption, (list, np.ndarray)):
            # take a random caption if there are multiple
            captions.append(random.choice(caption) if is_train else caption[0])
        else:
            raise ValueError(
                f"Caption column `{caption_column}` should contain either strings or lists of "
                "strings."
            )
    inputs = tokenizer(
        captions,
        max_length=tokenizer.model_max_length,
        padding="max_length",
        truncation=True,
        return_tensors="pt",
    )
    return inputs.input_ids


def train_transforms(image):  # Resize/CenterCrop are identities at 32 px; ToTensor, Normalize
    array = np.asarray(image, dtype=np.float32) / 255.0
    return (torch.from_numpy(array).permute(2, 0, 1).contiguous() - 0.5) / 0.5


def preprocess_train(examples):  # the script's
    images = [image.convert("RGB") for image in examples[image_column]]
    examples["pixel_values"] = [train_transforms(image) for image in images]
    examples["input_ids"] = tokenize_captions(examples)
    return examples


def collate_fn(examples):  # the script's
    pixel_values = torch.stack([example["pixel_values"] for example in examples])
    pixel_values = pixel_values.to(memory_format=torch.contiguous_format).float()
    input_ids = torch.stack([example["input_ids"] for example in examples])
    return {"pixel_values": pixel_values, "input_ids": input_ids}


def training_step(batch):  # train_text_to_image_lora.py's loop body
    latents = vae.encode(batch["pixel_values"]).latent_dist.sample()
    latents = latents * vae.config.scaling_factor
    noise = torch.randn_like(latents)
    bsz = latents.shape[0]
    timesteps = torch.randint(
        0, noise_scheduler.config.num_train_timesteps, (bsz,), device=latents.device
    )
    noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
    encoder_hidden_states = text_encoder(batch["input_ids"], return_dict=False)[0]
    model_pred = unet(noisy_latents, timesteps, encoder_hidden_states, return_dict=False)[0]
    return F.mse_loss(model_pred.float(), noise.float(), reduction="mean")


def _loader(batch_size: int = 2):
    train_dataset = _coco_like().with_transform(preprocess_train)
    return DataLoader(train_dataset, shuffle=False, collate_fn=collate_fn, batch_size=batch_size)


@pytest.fixture(scope="module")
def split():
    random.seed(0)
    return graphsplit.split(training_step, (next(iter(_loader())),))


def test_the_split_verifies_on_two_batch_sizes_and_holds_the_lora_unet(split):
    random.seed(1)
    for batch in (next(iter(_loader(2))), next(iter(_loader(3)))):
        assert all(c.ok for c in graphsplit.verify(training_step, split, (batch,)))
    assert stage2_top_modules(split) == {"unet"}
    assert all(name.startswith("unet.") for name in split.stage2.state_dict())


def test_the_random_caption_is_named_by_a_warning(split, tmp_path):
    random.seed(0)
    with pytest.warns(RandomDatasetWarning) as caught:
        graphsplit.cache(split, _loader(), tmp_path / "cache", progress=False)
    message = str(caught[0].message)
    assert "input_ids" in message and "pixel_values" not in message


def test_each_batch_s_rows_train_as_the_step_on_its_captions(split, tmp_path):
    loader = _loader()
    random.seed(0)
    raw_batches = list(loader)
    random.seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RandomDatasetWarning)
        info = graphsplit.cache(split, loader, tmp_path / "cache", progress=False)
    cached = graphsplit.CachedDataset(tmp_path / "cache", split)
    assert info.num_samples == len(cached) == COUNT
    assert [cached[row]["key"] for row in range(COUNT)] == [str(i) for i in range(COUNT)]
    for seed, raw in enumerate(raw_batches):
        rows = [cached[2 * seed + offset] for offset in range(2)]
        assert_same_step(
            lambda raw=raw: training_step(raw),
            lambda rows=rows: split.stage2(**graphsplit.collate(rows)),
            PARAMS,
            seed,
        )
    # Each row holds one of its own image's captions, encoded.
    texts = _coco_like()["text"]
    with torch.no_grad():
        for row in range(COUNT):
            own = text_encoder(tokenize_captions({"text": texts[row]}), return_dict=False)[0]
            stored = [
                value
                for value in cached[row].values()
                if isinstance(value, torch.Tensor) and value.shape == own.shape[1:]
            ]
            assert len(stored) == 1
            assert any(torch.equal(stored[0], own[k]) for k in range(5)), row


def test_a_rerun_that_draws_other_captions_is_refused_as_changed_data(split, tmp_path):
    random.seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RandomDatasetWarning)
        graphsplit.cache(split, _loader(), tmp_path / "cache", progress=False)
        random.seed(12345)
        with pytest.raises(StaleCacheError) as caught:
            graphsplit.cache(split, _loader(), tmp_path / "cache", progress=False)
    message = str(caught.value)
    assert "changed" in message and "draws random numbers" in message, message
