"""Captions that cross as code points do not split a cache's buckets (``read/collation.py``).

On the module-level path a batch's list of strings (captions the step reads or tokenizes
itself) crosses as code points, ``[B, longest]``, zero past each string's end; each row is
stored as wide as the longest caption of the raw batch stage 1 saw. The width is no property
of a sample: the boundary spec's ``pad_dim`` says so, ``CachedDataset.buckets()`` ignores it and
``graphsplit.collate`` pads such rows with zeros to a stage-2 batch's widest, which stage 2
decodes to nothing. Checked here: rows of raw batches of other caption widths share a bucket,
batch together, decode to the very strings (NUL, accents, beyond the BMP) and train as the
unsplit step on the same samples, bit for bit; a cache written before ``pad_dim`` existed reads
and buckets as it did; a crafted ``pad_dim`` is refused; an exported dataset pads as well.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

import graphsplit
from graphsplit.artifacts import BoundarySpec
from graphsplit.errors import CacheError, ManifestError
from tests.caching.fixtures import rewrite_manifest
from tests.conformance.unseen2_data_checks import assert_same_step

WIDTH = 4
CAPTIONS = [
    "a",
    "a red circle on a blue square",
    "é ✓",
    "",
    "ends in NUL\x00",
    "🙂 beyond the BMP",
    "xy",
    "a photo of a cat on a mat under a lamp, at night",
]
KEYS = [f"s{index * 37}" for index in range(len(CAPTIONS))]  # keys of other lengths too
PIXELS = torch.randn(len(CAPTIONS), WIDTH, generator=torch.Generator().manual_seed(0))


class CaptionedStep(nn.Module):
    """A frozen image encoder (cached) and a trainable head weighted by every character of
    each caption: the step reads the strings themselves."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, batch):
        weights = torch.tensor(
            [len(caption) + sum(map(ord, caption)) % 97 / 97 for caption in batch["captions"]]
        )
        return (self.head(self.encoder(batch["pixels"])).squeeze(1) * weights).mean()


def raw_batch(indices: list[int]) -> dict:
    return {
        "key": [KEYS[index] for index in indices],
        "pixels": PIXELS[indices],
        "captions": [CAPTIONS[index] for index in indices],
    }


RAW_BATCHES = [raw_batch([index, index + 1]) for index in range(0, len(CAPTIONS), 2)]


@pytest.fixture(scope="module")
def step():
    return CaptionedStep()


@pytest.fixture(scope="module")
def split(step):
    return graphsplit.split(step, (RAW_BATCHES[0],), path="calls")


@pytest.fixture(scope="module")
def folder(split, tmp_path_factory):
    path = tmp_path_factory.mktemp("captions") / "cache"
    graphsplit.cache(split, RAW_BATCHES, path, progress=False)
    return path


def spec_of(split, name):
    (spec,) = [spec for spec in split.plan.inputs if spec.name == name]
    return spec


def test_code_point_fields_carry_their_pad_dim_and_nothing_else_does(split):
    assert split.boundary["captions"].pad_dim == 1
    assert split.boundary["key__text"].pad_dim == 1
    assert split.boundary["encoder__0__out"].pad_dim is None


def test_rows_of_one_shape_share_a_bucket_whatever_their_captions_widths(split, folder):
    cached = graphsplit.CachedDataset(folder, split)
    widths = {cached.shapes(index)["captions"] for index in range(len(cached))}
    assert len(widths) == len(RAW_BATCHES)  # each raw batch's longest caption differs
    assert list(cached.buckets().values()) == [list(range(len(CAPTIONS)))]
    (key,) = cached.buckets()
    names = [name for name, _, _ in cached.collation.rows]
    assert key[names.index("captions")] == key[names.index("key__text")] == (None,)
    assert key[names.index("encoder__0__out")] == (WIDTH,)


@pytest.mark.parametrize("pair", [(0, 3), (1, 7), (2, 5), (4, 6), (7, 0)])
def test_rows_of_other_raw_batches_batch_decode_exactly_and_train_as_the_step(
    step, split, folder, pair
):
    cached = graphsplit.CachedDataset(folder, split)
    indices = list(pair)
    batch = graphsplit.collate([cached[index] for index in indices])
    widest = max(len(CAPTIONS[index]) for index in indices)
    stored = max(cached.shapes(index)["captions"][0] for index in indices)
    assert batch["captions"].shape == (2, stored) and stored >= widest
    for row, index in enumerate(indices):  # zeros past each string's end, decoding to nothing
        assert not batch["captions"][row, len(CAPTIONS[index]) :].any()
    assert spec_of(split, "captions").decode(batch["captions"]) == [CAPTIONS[i] for i in indices]
    assert spec_of(split, "key").decode(batch["key__text"]) == [KEYS[i] for i in indices]
    params = [param for param in step.parameters() if param.requires_grad]
    raw = raw_batch(indices)
    assert_same_step(lambda: step(raw), lambda: split.stage2(**batch), params, seed=pair[0])


def test_the_loader_batches_every_sample_across_caption_widths(step, split, folder):
    cached = graphsplit.CachedDataset(folder, split)
    loader = cached.loader(batch_size=4, seed=0)
    seen = []
    for batch in loader:
        keys = spec_of(split, "key").decode(batch["key__text"])
        captions = spec_of(split, "captions").decode(batch["captions"])
        assert captions == [CAPTIONS[KEYS.index(key)] for key in keys]
        seen += keys
        split.stage2(**batch)
    assert sorted(seen) == sorted(KEYS) and len(loader) == 2


def test_a_cache_written_before_pad_dim_reads_and_buckets_by_width_as_before(
    split, folder, tmp_path
):
    old = tmp_path / "old"
    shutil.copytree(folder, old)

    def forget_pad_dims(document):
        for spec in document["boundary"]:
            spec.pop("pad_dim", None)

    rewrite_manifest(old, forget_pad_dims)
    cached = graphsplit.CachedDataset(old, split)  # not stale: the same split's cache
    assert len(cached.buckets()) == len(RAW_BATCHES)
    with pytest.raises(CacheError, match="the samples have different shapes"):
        graphsplit.collate([cached[0], cached[3]])
    rows = graphsplit.collate([cached[0], cached[1]])  # one raw batch's rows, as before
    assert spec_of(split, "captions").decode(rows["captions"]) == CAPTIONS[:2]


@pytest.mark.parametrize("pad_dim", [0, 2])
def test_a_pad_dim_that_is_the_batch_dim_or_no_dim_is_refused(folder, tmp_path, pad_dim):
    crafted = tmp_path / "crafted"
    shutil.copytree(folder, crafted)

    def craft(document):
        for spec in document["boundary"]:
            if spec["name"] == "captions":
                spec["pad_dim"] = pad_dim

    rewrite_manifest(crafted, craft)
    with pytest.raises(ManifestError) as caught:
        graphsplit.CachedDataset(crafted)
    message = str(caught.value)
    assert ".pad_dim is " + str(pad_dim) in message
    assert "other than the batch dim of a per-sample tensor" in message


def test_boundary_spec_json_names_pad_dim_only_where_set():
    plain = BoundarySpec("latents", (2, 4), torch.float32, 0, 16, "x:1")
    text = BoundarySpec("captions", (2, 9), torch.int32, 0, 36, "input", pad_dim=1)
    assert "pad_dim" not in plain.to_json()
    assert text.to_json()["pad_dim"] == 1
    assert BoundarySpec.from_json(text.to_json()) == text
    assert BoundarySpec.from_json(plain.to_json()) == plain


def test_an_exported_dataset_pads_captions_as_the_folder_does(split, folder):
    pytest.importorskip("datasets")
    from graphsplit.caching.read.hf_export import HFCachedDataset, to_hf_dataset

    exported = HFCachedDataset(to_hf_dataset(folder), split)
    cached = graphsplit.CachedDataset(folder, split)
    from_export = graphsplit.collate([exported[1], exported[7]])
    from_folder = graphsplit.collate([cached[1], cached[7]])
    assert torch.equal(from_export["captions"], from_folder["captions"])
    assert spec_of(split, "captions").decode(from_export["captions"]) == [
        CAPTIONS[1],
        CAPTIONS[7],
    ]
