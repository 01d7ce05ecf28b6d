"""Conformance: finetrainers' LTX-Video LoRA loop over clips of 5, 9 and 13 frames, bucketed by
finetrainers' own ``BucketSampler``, one cache for every frame count, an epoch trained from it.

The step is a-r-r-o-w/finetrainers' ``Trainer.train()`` loop body for ``ltx_video`` LoRA
without ``--precompute_conditions`` (the frozen ``AutoencoderKLLTXVideo`` encodes the clip and
its latent distribution is sampled from the trainer's generator; the frozen T5 embeds the
captions, tokenized in the step; the LoRA ``LTXVideoTransformer3DModel`` is given the latent
grid's ``num_frames`` as an int): ``build`` of ``test_unseen8_ltx_video_lora.py``, where the
loop body and the model functions of ``finetrainers/ltx_video/ltx_video_lora.py`` are copied
verbatim, imported here as it is.

The data pipeline is finetrainers' ``finetrainers/dataset.py``: ``BucketSampler`` (copied
verbatim) groups the dataset's items by ``(num_frames, height, width)`` and yields *the items
themselves*, a bucket's worth at a time; ``VideoDataset.__getitem__`` passes such a list through
(``if isinstance(index, list): return index``, as upstream), and the trainer builds
``DataLoader(dataset, batch_size=1, sampler=BucketSampler(dataset, batch_size=...,
shuffle=True), collate_fn=collate_fn_t2v)``. The caching pass uses ``shuffle=False``: graphsplit
refuses random order, and with ``shuffle=False`` upstream's sampler never yields a bucket's
leftover (its ``drop_last=False`` branch yields only under ``if self.shuffle``), so every bucket
here holds a multiple of the batch size. Twelve clips: 4 of 5 frames, 4 of 9, 4 of 13 (latent
grids of 2, 3 and 4 frames, the VAE compressing time by 4), interleaved in the dataset,
batches of 2.

What must hold: verify on a batch of each frame count and of another size; stage 2 holds
neither the VAE's nor T5's weights; one cache of the whole loader, every sample equal to stage
1 on its raw batch, stage 2 on each written batch exact; then an epoch of ``cached.loader``
(batches of one frame count), each batch exactly the step on those clips.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

import graphsplit
from tests.conformance.unseen15_d_checks import cache_whole_loader, train_epoch_from_cache
from tests.conformance.unseen_checks import stage2_top_modules
from tests.helpers import assert_stage1_holds_no_trainable

pytest.importorskip("diffusers")
pytest.importorskip("peft")
from tests.conformance.test_unseen8_ltx_video_lora import (
    CAPTIONS,
    SIZE,
    build,
    collate_fn_t2v,
)

FRAME_COUNTS = [5, 9, 13, 9, 5, 13, 13, 5, 9, 5, 9, 13]  # interleaved, four of each
BATCH_SIZE = 2


@pytest.fixture(autouse=True, scope="module")
def _one_thread():  # module scope: the module's fixtures (split, cache) run on one thread too
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class VideoDataset(Dataset):
    """finetrainers' ``VideoDataset`` reduced to its in-memory part: the clips are made here,
    not read with decord; ``__getitem__``'s list passthrough and its item are upstream's."""

    def __init__(self) -> None:
        self.id_token = ""
        self.prompts = [CAPTIONS[index % len(CAPTIONS)] for index in range(len(FRAME_COUNTS))]
        self.videos = [
            torch.rand(frames, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(900 + i)) * 2
            - 1
            for i, frames in enumerate(FRAME_COUNTS)
        ]
        self.resolutions = sorted({(frames, SIZE, SIZE) for frames in FRAME_COUNTS})

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index):
        if isinstance(index, list):
            # Here, index is actually a list of data objects that we need to return.
            # The BucketSampler should ideally return indices. But, in the sampler, we'd like
            # to have information about num_frames, height and width. Since this is not stored
            # as metadata, we need to read the video to get this information. ...
            return index

        video = self.videos[index]
        return {
            "prompt": self.id_token + self.prompts[index],
            "image": None,
            "video": video,
            "video_metadata": {
                "num_frames": video.shape[0],
                "height": video.shape[2],
                "width": video.shape[3],
            },
        }


class BucketSampler(Sampler):
    r"""
    PyTorch Sampler that groups 3D data by height, width and frames.

    Args:
        data_source (`VideoDataset`):
            A PyTorch dataset object that is an instance of `VideoDataset`.
        batch_size (`int`, defaults to `8`):
            The batch size to use for training.
        shuffle (`bool`, defaults to `True`):
            Whether or not to shuffle the data in each batch before dispatching to dataloader.
        drop_last (`bool`, defaults to `False`):
            Whether or not to drop incomplete buckets of data after completely iterating over
            all data in the dataset. If set to True, only batches that have `batch_size` number
            of entries will be yielded. If set to False, it is guaranteed that all data in the
            dataset will be processed and batches that do not have `batch_size` number of
            entries will also be yielded.
    """

    def __init__(
        self,
        data_source: VideoDataset,
        batch_size: int = 8,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> None:
        self.data_source = data_source
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last

        self.buckets = {resolution: [] for resolution in data_source.resolutions}

        self._raised_warning_for_drop_last = False

    def __len__(self):
        if self.drop_last and not self._raised_warning_for_drop_last:
            self._raised_warning_for_drop_last = True
        return (len(self.data_source) + self.batch_size - 1) // self.batch_size

    def __iter__(self):
        for index, data in enumerate(self.data_source):  # noqa: B007 (upstream's)
            video_metadata = data["video_metadata"]
            f, h, w = (
                video_metadata["num_frames"],
                video_metadata["height"],
                video_metadata["width"],
            )

            self.buckets[(f, h, w)].append(data)
            if len(self.buckets[(f, h, w)]) == self.batch_size:
                if self.shuffle:
                    random.shuffle(self.buckets[(f, h, w)])
                yield self.buckets[(f, h, w)]
                del self.buckets[(f, h, w)]
                self.buckets[(f, h, w)] = []

        if self.drop_last:
            return

        for fhw, bucket in list(self.buckets.items()):
            if len(bucket) == 0:
                continue
            if self.shuffle:
                random.shuffle(bucket)
                yield bucket
                del self.buckets[fhw]
                self.buckets[fhw] = []


dataset = VideoDataset()


def _loader() -> DataLoader:
    return DataLoader(
        dataset,
        batch_size=1,
        sampler=BucketSampler(dataset, batch_size=BATCH_SIZE, shuffle=False),
        collate_fn=collate_fn_t2v,
    )


@pytest.fixture(scope="module")
def parts():
    return build()


@pytest.fixture(scope="module")
def split(parts):
    return graphsplit.split(parts.step, (next(iter(_loader())),))


def _trainer_seeded(parts):
    """Both sides draw latents, sigmas and noise from the trainer's generator: reseed it from
    torch's seed (``manual_seed`` does not reach a ``torch.Generator``)."""

    def wrap(run):
        parts.generator.manual_seed(1000 + torch.initial_seed())
        return run()

    return wrap


def test_the_bucket_sampler_s_batches():
    """A batch as soon as a bucket holds two clips: 9, 5, 13, 5, 9, 13 frames."""
    batches = list(_loader())
    assert [tuple(b["videos"].shape[:2]) for b in batches] == [
        (2, 9),
        (2, 5),
        (2, 13),
        (2, 5),
        (2, 9),
        (2, 13),
    ]


def test_verifies_on_each_frame_count_and_another_size(parts, split):
    batches = list(_loader())
    three = collate_fn_t2v([[dataset[i] for i in (0, 4, 7)]])  # three clips of 5 frames
    for seed, batch in enumerate([*batches[:3], three]):
        parts.generator.manual_seed(seed)
        checks = graphsplit.verify(parts.step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]
    assert_stage1_holds_no_trainable(split)


def test_stage2_holds_no_vae_or_t5_weight(parts, split):
    held = {name for name, _ in split.stage2.named_parameters()}
    assert not any(name.startswith(("vae.", "text_encoder.")) for name in held), sorted(held)
    assert "text_encoder" not in stage2_top_modules(split)
    trainable = {n for n, p in split.stage2.named_parameters() if p.requires_grad}
    assert trainable == {
        f"transformer.{n}" for n, p in parts.transformer.named_parameters() if p.requires_grad
    }
    per_sample = {key: tuple(spec.shape[1:]) for key, spec in split.boundary.items()}
    assert per_sample["vae_encoder__0__out"] == (16, 3, 4, 4)  # the example: 9 frames


@pytest.fixture(scope="module")
def cache_run(parts, split, tmp_path_factory):
    folder = tmp_path_factory.mktemp("cache") / "cache"
    return cache_whole_loader(
        split, parts.step, _loader(), folder, parts.params, wrap=_trainer_seeded(parts)
    )


def test_the_trainer_s_loader_as_it_is_is_read_as_it_comes(split, cache_run):
    """finetrainers' ``BucketSampler`` yields the dataset's items, not indices, under
    ``batch_size=1``: ``cache()`` reads the loader's batches as they come, as an iterable's.
    (It used to take each yielded list as a dataset index and blame the collate function in a
    message of 20,000 characters of tensor values.)"""
    assert cache_run.wrong_samples == []
    assert len(cache_run.cached) == 12


def test_one_cache_of_three_frame_counts_each_sample_right(split, cache_run):
    assert cache_run.wrong_samples == []
    assert len(cache_run.cached) == 12
    frames = sorted(
        cache_run.cached.shapes(index)["vae_encoder__0__out"][1]
        for index in range(len(cache_run.cached))
    )
    assert frames == [2] * 4 + [3] * 4 + [4] * 4
    assert len(cache_run.cached.buckets()) == 3
    assert split.path == "calls" and cache_run.plans == 0


def test_an_epoch_of_the_cache_loader_trains_as_the_step(parts, split, cache_run):
    """``cached.loader(2, seed=0)``: batches of one frame count, shuffled, which mix clips of
    two written batches; each against the step on those clips (``collate_fn_t2v``)."""
    cached = cache_run.cached
    items = [item for raw in _loader_items() for item in raw]  # written order
    by_key = {str(cached[row]["key"]): items[row] for row in range(len(cached))}

    def eager(keys):
        return collate_fn_t2v([[by_key[key] for key in keys]])

    seen = train_epoch_from_cache(
        split,
        parts.step,
        cached,
        eager,
        parts.params,
        batch_size=BATCH_SIZE,
        wrap=_trainer_seeded(parts),
    )
    assert len(seen) == 6


def _loader_items():
    """The sampler's buckets, as lists of dataset items, in the loader's order."""
    return list(BucketSampler(dataset, batch_size=BATCH_SIZE, shuffle=False))
