"""Conformance: an SD-1.5 LoRA step fed by datasets and loaders built as users' scripts build them.

The step is the loop body of diffusers' ``train_text_to_image_lora.py`` (a function of the
batch, its models read as globals of the script). The datasets and loaders around it are the
ones the scripts and users write: a Hugging Face ``datasets.Dataset`` of PIL images with
``.with_transform(preprocess_train)`` and the script's ``collate_fn``, a ``set_format("torch")``
dataset, a streaming ``IterableDataset`` without ``__len__``, worker processes with
``persistent_workers`` and ``prefetch_factor``, a last short batch, batch size 1, an aspect-ratio
bucket ``batch_sampler`` of three sizes, batches with fields the step ignores (strings, ints,
floats, numpy arrays, ``None``, nested dicts, lists of captions of differing lengths) and a
shuffled loader. Each goes through ``graphsplit.cache`` as it is and is read back with
``CachedDataset`` (:func:`~tests.conformance.unseen2_data_checks.assert_cache_round_trip`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, Sampler, default_collate

import graphsplit
from graphsplit.errors import CacheError
from tests.conformance.unseen2_data_checks import (
    assert_cache_round_trip,
    assert_epoch_covers_each_sample_once,
    assert_same_step,
)
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


def collate_fn(examples):  # the script's own
    pixel_values = torch.stack([example["pixel_values"] for example in examples])
    pixel_values = pixel_values.to(memory_format=torch.contiguous_format).float()
    input_ids = torch.stack([example["input_ids"] for example in examples])
    return {"pixel_values": pixel_values, "input_ids": input_ids}


@pytest.fixture(scope="module")
def split():
    """One split from a batch of 4 at 32 pixels, as a script makes it from its first batch."""
    first = collate_fn([CaptionedImages(length=4)[i] for i in range(4)])
    return graphsplit.split(training_step, (first,))


# --- Hugging Face datasets ------------------------------------------------------------------


def _hf_images(length: int, sizes=(32,)) -> datasets.Dataset:
    """An ``imagefolder``-like dataset: PIL images, a caption column, an int id column."""
    source = CaptionedImages(length=length, resolutions=list(sizes))
    images, texts = [], []
    for index in range(length):
        pixels = source[index]["pixel_values"]
        array = ((pixels + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
        images.append(PIL_Image.fromarray(array.permute(1, 2, 0).numpy()))
        texts.append(source.caption_of(index))
    features = datasets.Features(
        {"image": datasets.Image(), "text": datasets.Value("string"), "id": datasets.Value("int64")}
    )
    return datasets.Dataset.from_dict(
        {"image": images, "text": texts, "id": list(range(length))}, features=features
    )


def _tokenize_captions(examples):
    from tests.zoo.data import tokenize

    return [tokenize(caption) for caption in examples["text"]]


def preprocess_train(examples):  # the script's, with numpy for torchvision's transforms
    images = [image.convert("RGB") for image in examples["image"]]
    arrays = [np.asarray(image, dtype=np.float32) / 127.5 - 1.0 for image in images]
    examples["pixel_values"] = [torch.from_numpy(a).permute(2, 0, 1).contiguous() for a in arrays]
    examples["input_ids"] = _tokenize_captions(examples)
    return examples


def test_hf_dataset_with_transform_and_a_short_last_batch(split, tmp_path):
    """10 samples at batch 4: batches of 4, 4 and 2; no key, so the rows are numbered."""
    train_dataset = _hf_images(10).with_transform(preprocess_train)
    loader = DataLoader(train_dataset, shuffle=False, collate_fn=collate_fn, batch_size=4)
    assert [len(batch["input_ids"]) for batch in loader] == [4, 4, 2]
    cached = assert_cache_round_trip(split, training_step, loader, tmp_path / "cache", PARAMS)
    # Stage 2's own loader, unshuffled, gives the same batches: 4, 4 and the short 2.
    stage2 = cached.loader(batch_size=4, shuffle=False)
    assert stage2.batch_sampler.epoch_batches(0) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    for batch, start in zip(stage2, (0, 4, 8), strict=True):
        rows = graphsplit.collate([cached[row] for row in range(start, min(start + 4, 10))])
        assert batch.keys() == rows.keys()
        assert all(torch.equal(batch[name], rows[name]) for name in rows)


def test_hf_set_format_torch_at_batch_size_one(split, tmp_path):
    """``set_format("torch")`` columns through ``default_collate``, one sample per batch."""
    source = CaptionedImages(length=3)
    rows = [source[index] for index in range(3)]
    table = datasets.Dataset.from_dict(
        {
            "pixel_values": [row["pixel_values"].numpy() for row in rows],
            "input_ids": [row["input_ids"].tolist() for row in rows],
            "key": [row["key"] for row in rows],
            "label": [0, 1, 0],
        }
    )
    table.set_format(
        "torch", columns=["pixel_values", "input_ids", "label"], output_all_columns=True
    )
    loader = DataLoader(table, batch_size=1)
    batch = next(iter(loader))
    assert batch["input_ids"].dtype == torch.int64 and batch["key"] == [rows[0]["key"]]
    assert_cache_round_trip(split, training_step, loader, tmp_path / "cache", PARAMS)


# --- streaming, workers ---------------------------------------------------------------------


class StreamedImages(IterableDataset):
    """A streaming dataset (webdataset, ``load_dataset(streaming=True)``): no ``__len__``."""

    def __init__(self, length: int) -> None:
        self.images = CaptionedImages(length=length)

    def __iter__(self):
        for index in range(len(self.images)):
            yield self.images[index]


def test_iterable_dataset_without_len(split, tmp_path):
    dataset = StreamedImages(6)
    assert not hasattr(dataset, "__len__")
    loader = DataLoader(dataset, batch_size=4, collate_fn=default_collate)
    keys = [f"sample-{index:06d}" for index in range(6)]
    assert_cache_round_trip(
        split, training_step, loader, tmp_path / "cache", PARAMS, expected_keys=keys
    )


def test_hf_iterable_dataset_streams_without_keys(split, tmp_path):
    """``Dataset.to_iterable_dataset()`` (what ``streaming=True`` gives) with the transform
    applied by ``.map``; the samples are numbered as they come."""
    stream = (
        _hf_images(5)
        .to_iterable_dataset(num_shards=1)
        .map(preprocess_train, batched=True, remove_columns=["image"])
    )
    loader = DataLoader(stream, batch_size=2, collate_fn=collate_fn)
    assert [len(batch["input_ids"]) for batch in loader] == [2, 2, 1]
    assert_cache_round_trip(split, training_step, loader, tmp_path / "cache", PARAMS)


def test_workers_persistent_with_prefetch(split, tmp_path):
    loader = DataLoader(
        CaptionedImages(length=8),
        batch_size=4,
        num_workers=2,
        persistent_workers=True,
        prefetch_factor=3,
    )
    assert_cache_round_trip(split, training_step, loader, tmp_path / "cache", PARAMS)


# --- shapes: aspect-ratio buckets -------------------------------------------------------------


class AspectRatioBuckets(Sampler):
    """A user's bucket batch sampler: the indices grouped by image size, cut into batches."""

    def __init__(self, sizes, batch_size: int) -> None:
        self.buckets: dict[int, list[int]] = {}
        for index, size in enumerate(sizes):
            self.buckets.setdefault(size, []).append(index)
        self.batch_size = batch_size

    def __iter__(self):
        for indices in self.buckets.values():
            for start in range(0, len(indices), self.batch_size):
                yield indices[start : start + self.batch_size]

    def __len__(self) -> int:
        return sum(-(-len(i) // self.batch_size) for i in self.buckets.values())


@pytest.mark.slow
def test_bucket_batch_sampler_of_three_sizes(split, tmp_path):
    """Each bucket holds a multiple of the batch size: a bucket's short last batch is stored
    in another memory layout and stage 2 refuses to batch it with full ones (tests/caching/
    test_shards.py checks that message)."""
    images = CaptionedImages(length=12, resolutions=[32, 48, 64])
    sampler = AspectRatioBuckets([images.resolution_of(i) for i in range(12)], batch_size=2)
    loader = DataLoader(images, batch_sampler=sampler)
    assert {batch["pixel_values"].shape[-1] for batch in loader} == {32, 48, 64}
    cached = assert_cache_round_trip(split, training_step, loader, tmp_path / "cache", PARAMS)
    assert len(cached.buckets()) == 3
    # Stage 2's loader: batches of one shape, every sample once per epoch.
    stage2 = cached.loader(batch_size=2, seed=0)
    for epoch in range(2):
        keys = assert_epoch_covers_each_sample_once(cached, stage2, epoch)
        assert len(keys) == len(stage2) == 6
        batches = stage2.batch_sampler.epoch_batches(epoch)
        for indices in batches:
            assert len({str(cached.shapes(index)) for index in indices}) == 1
        trained = 0
        for batch, indices in zip(stage2, batches, strict=True):
            rows = graphsplit.collate([cached[index] for index in indices])
            assert all(torch.equal(batch[name], rows[name]) for name in rows)
            trained += 1
        assert trained == 6


# --- fields the step ignores -------------------------------------------------------------------


class Annotated(torch.utils.data.Dataset):
    """Items with everything a real dataset carries beside the model inputs."""

    def __init__(self, length: int) -> None:
        self.images = CaptionedImages(length=length)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        item = dict(self.images[index])
        item.update(
            caption=self.images.caption_of(index),
            index=index,
            aesthetic=0.25 * index,
            crop_coords=np.array([index, 2 * index], dtype=np.int64),
            mask_path=None,
            tags=["synthetic", f"t{index}"],
            meta={"source": "zoo", "size": {"h": 32, "w": 32}},
            thumbnails=[torch.zeros(3, 4, 4), torch.ones(3, 4, 4)],
            captions=[f"caption {n}" for n in range(1 + index % 3)],  # 1 to 3 of them
        )
        return item


def keep_everything(examples):
    """A user's collate: tensors stacked, everything else kept as a list per field."""
    batch = {"pixel_values": None, "input_ids": None}
    for name in examples[0]:
        values = [example[name] for example in examples]
        if name in batch:
            batch[name] = torch.stack(values)
        else:
            batch[name] = values
    batch["index"] = torch.tensor(batch["index"])
    batch["crop_coords"] = np.stack(batch["crop_coords"])
    return batch


@pytest.mark.slow
def test_batches_with_fields_the_step_ignores(tmp_path):
    loader = DataLoader(Annotated(6), batch_size=3, collate_fn=keep_everything)
    first = next(iter(loader))
    assert [len(c) for c in first["captions"]] == [1, 2, 3]
    split = graphsplit.split(training_step, (first,))  # from the batch as it comes
    assert set(split.boundary) and "caption" not in split.boundary
    assert all(c.ok for c in graphsplit.verify(training_step, split, (first,)))
    assert_cache_round_trip(split, training_step, loader, tmp_path / "cache", PARAMS)


def test_default_collate_on_caption_lists_of_differing_length_is_torch_s_error():
    """Not graphsplit's: ``default_collate`` cannot batch lists of differing lengths; the
    user's collate (above) keeps them as lists."""
    loader = DataLoader(
        Annotated(3),
        batch_size=3,
        collate_fn=lambda e: default_collate(
            [{k: v for k, v in x.items() if k not in ("mask_path",)} for x in e]
        ),
    )
    with pytest.raises(RuntimeError, match="each element in list of batch should be of equal size"):
        next(iter(loader))


# --- shuffling ---------------------------------------------------------------------------------


def test_a_shuffled_loader_is_refused_naming_the_sampler_and_the_fix(split, tmp_path):
    loader = DataLoader(CaptionedImages(length=4), batch_size=2, shuffle=True)
    with pytest.raises(CacheError) as caught:
        graphsplit.cache(split, loader, tmp_path / "cache", progress=False)
    message = str(caught.value)
    assert "RandomSampler" in message and "shuffle=False" in message
    assert not (tmp_path / "cache" / "manifest.json").exists()


@pytest.mark.slow
def test_the_cache_read_back_shuffled_trains_as_the_step_on_those_samples(split, tmp_path):
    """Stage 2 reads the cache in another order than it was written: every sample once per
    epoch, another order each epoch, and each batch trains exactly as the unsplit step on the
    same samples collated in the same order."""
    images = CaptionedImages(length=8)
    loader = DataLoader(images, batch_size=4)
    cached = assert_cache_round_trip(split, training_step, loader, tmp_path / "cache", PARAMS)
    stage2 = cached.loader(batch_size=4, seed=3)
    by_key = {images[i]["key"]: images[i] for i in range(len(images))}
    orders = []
    for epoch in range(2):
        keys = assert_epoch_covers_each_sample_once(cached, stage2, epoch)
        orders.append(keys)
        for seed, (batch, batch_keys) in enumerate(zip(stage2, keys, strict=True)):
            raw = default_collate([by_key[key] for key in batch_keys])
            assert_same_step(
                lambda raw=raw: training_step(raw),
                lambda batch=batch: split.stage2(**batch),
                PARAMS,
                seed,
            )
    assert orders[0] != orders[1]
    written = [[images[i]["key"] for i in range(s, s + 4)] for s in (0, 4)]
    assert orders[0] != written


# --- streaming with workers --------------------------------------------------------------------


class ShardedStream(StreamedImages):
    """A streaming dataset that gives each worker its own samples, as the torch docs say to."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for index in range(start, len(self.images), step):
            yield self.images[index]


@pytest.mark.slow
def test_streaming_with_two_workers(split, tmp_path):
    """Sharded per worker, the batches come from the workers in turn: cached in that order.
    Not sharded, every worker yields every sample: cache() refuses the repeated keys."""
    loader = DataLoader(ShardedStream(8), batch_size=2, num_workers=2)
    keys = [f"sample-{index:06d}" for index in (0, 2, 1, 3, 4, 6, 5, 7)]
    assert_cache_round_trip(
        split, training_step, loader, tmp_path / "cache", PARAMS, expected_keys=keys
    )
    repeated = DataLoader(StreamedImages(2), batch_size=2, num_workers=2)
    with pytest.raises(CacheError, match="sample key 'sample-000000' twice") as caught:
        graphsplit.cache(split, repeated, tmp_path / "repeated", progress=False)
    message = str(caught.value)
    assert "2 workers over an IterableDataset" in message and "get_worker_info()" in message
