"""graphsplit.cache end to end: round trips bit for bit, the folder it leaves, its options."""

from __future__ import annotations

import json

import pytest
import torch

from graphsplit.caching.read.collation import collate
from graphsplit.caching.read.dataset import CachedDataset
from graphsplit.caching.store.record_files import read_manifest
from graphsplit.caching.write.cache_run import CacheInfo, cache
from tests.caching.fixtures import (
    SMALL,
    Pictures,
    bucket_batches,
    loader,
    rows_by_key,
    stage1_rows,
)

# ----------------------------------------------------------------------------------- round trip


def test_round_trip_rows_constants_and_loss(split, tmp_path):
    dataset = Pictures(12)
    info = cache(split, loader(dataset), tmp_path / "c", shard_bytes=SMALL, progress=False)
    assert isinstance(info, CacheInfo)
    assert (info.num_samples, info.num_shards, info.written_shards) == (12, 6, 6)
    cached = CachedDataset(tmp_path / "c", split)
    assert len(cached) == 12 and cached[3]["key"] == "pic003"
    assert cached[0]["text"].shape == (6, 8)  # batch dim 1 dropped from the row
    batch = collate([cached[4], cached[5]])
    assert list(batch) == ["latents", "text", "table"]
    expected = stage1_rows(split, dataset, [4, 5])
    for name in expected:
        assert torch.equal(batch[name], expected[name]), name
    # stage 2 on the cache gives bit for bit the unsplit model's loss and gradients
    model = split.model
    torch.manual_seed(7)
    loss = split.stage2(**batch)
    loss.backward()
    cached_grads = [p.grad.clone() for p in model.head.parameters()]
    model.zero_grad()
    items = [dataset[4], dataset[5]]
    torch.manual_seed(7)
    reference = model(
        torch.stack([i["pixel_values"] for i in items]),
        torch.stack([i["input_ids"] for i in items]),
    )
    reference.backward()
    assert torch.equal(loss, reference)
    for grad, parameter in zip(cached_grads, model.head.parameters()):
        assert torch.equal(grad, parameter.grad)


def test_folder_layout_and_manifest(split, tmp_path):
    info = cache(split, loader(), tmp_path, shard_bytes=SMALL, progress=False)
    names = sorted(entry.name for entry in tmp_path.iterdir())
    assert names == ["constants.safetensors", "manifest.json"] + [
        f"shard-{k:05d}.safetensors" for k in range(6)
    ]
    manifest = read_manifest(tmp_path)
    assert manifest.header.layout.batches_per_shard == 1
    assert manifest.shards[0].keys == ("pic000", "pic001")
    assert manifest.shards[0].shapes[0] == ((4, 4, 4), (6, 8))
    assert len(manifest.shards[0].input_sha256[0]) == 64
    document = json.loads((tmp_path / "manifest.json").read_text())
    assert document["format"] == "graphsplit-cache" and document["format_version"] == 2
    assert document["fingerprint"]["versions"]["torch"] == torch.__version__
    assert info.total_bytes == sum(
        (tmp_path / f).stat().st_size for f in names if f.endswith(".safetensors")
    )


def test_variable_shapes_two_resolutions(split, tmp_path):
    dataset = Pictures(10, sizes=(8, 12))
    batches = bucket_batches(dataset, 2)
    bucketed = torch.utils.data.DataLoader(dataset, batch_sampler=batches)
    cache(split, bucketed, tmp_path, shard_bytes=SMALL, progress=False)
    cached = CachedDataset(tmp_path, split)
    by_key = {key: i for i, key in enumerate(cached.keys)}
    for indices in batches:
        expected = stage1_rows(split, dataset, indices)
        got = collate([cached[by_key[f"pic{i:03d}"]] for i in indices])
        for name in expected:
            assert torch.equal(got[name], expected[name])
    assert cached.shapes(by_key["pic001"]) == {"latents": (4, 6, 6), "text": (6, 8)}
    assert cached.sample_shapes[by_key["pic000"]]["latents"] == (4, 4, 4)
    groups = cached.buckets()
    assert sorted(len(group) for group in groups.values()) == [5, 5]


def test_rows_by_key_helper_reads_every_sample(split, tmp_path):
    cache(split, loader(Pictures(4)), tmp_path, progress=False)
    rows = rows_by_key(tmp_path)
    assert sorted(rows) == ["pic000", "pic001", "pic002", "pic003"]
    assert set(rows["pic002"]) == {"latents", "text"}


# -------------------------------------------------------------------- storage dtype and options


def test_bfloat16_storage_records_its_error_and_collate_restores_dtype(split, tmp_path):
    info = cache(split, loader(), tmp_path, storage_dtype=torch.bfloat16, progress=False)
    assert info.storage_dtype == torch.bfloat16
    assert set(info.max_abs_error) == {"latents", "text", "table"}
    assert all(0 < error < 0.1 for error in info.max_abs_error.values())
    assert "max abs error" in str(info)
    cached = CachedDataset(tmp_path, split)
    assert cached[0]["latents"].dtype == torch.bfloat16
    assert cached.max_abs_error == info.max_abs_error
    batch = collate([cached[0], cached[1]])
    assert batch["latents"].dtype == torch.float32 and batch["table"].dtype == torch.float32
    exact = stage1_rows(split, Pictures(), [0, 1])
    for name in exact:
        assert (batch[name] - exact[name]).abs().max() <= info.max_abs_error[name]


@pytest.mark.parametrize("bad", [torch.int8, torch.float64, "bfloat16"])
def test_invalid_storage_dtype(split, tmp_path, bad):
    with pytest.raises(ValueError, match="storage_dtype must be None"):
        cache(split, loader(), tmp_path, storage_dtype=bad)


def test_invalid_shard_bytes(split, tmp_path):
    with pytest.raises(ValueError, match="shard_bytes must be a positive integer"):
        cache(split, loader(), tmp_path, shard_bytes=0)


# ------------------------------------------------------------------------------------- progress


def test_progress_bar_shows_samples_and_bytes(split, tmp_path, capsys):
    cache(split, loader(), tmp_path / "a", shard_bytes=SMALL, progress=True)
    err = capsys.readouterr().err
    assert "12/12" in err and "sample" in err and "KiB written" in err


def test_progress_bar_is_quiet_off_a_terminal_and_when_disabled(split, tmp_path, capsys):
    cache(split, loader(), tmp_path / "a", progress=None)  # pytest's stderr is not a TTY
    cache(split, loader(), tmp_path / "b", progress=False)
    assert capsys.readouterr().err == ""


# ----------------------------------------------------------------------------------- real split


def _core_available() -> bool:
    try:
        import graphsplit

        return callable(getattr(graphsplit, "split", None))
    except Exception:
        return False


class InlineStep(torch.nn.Module):
    """A step written inline (frozen encoders + trainable head), for the real splitter."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.vae = torch.nn.Conv2d(3, 4, 3, stride=2, padding=1)
        self.text = torch.nn.Embedding(50, 8)
        self.unet = torch.nn.Linear(4, 4)
        self.words = torch.nn.Linear(8, 4)
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
        self.vae.requires_grad_(False)
        self.text.requires_grad_(False)

    def forward(self, pixel_values, input_ids):
        latents = self.vae(pixel_values) * 0.18
        states = self.text(input_ids)
        noisy = latents + torch.randn_like(latents)
        prediction = self.unet(noisy.mean(dim=(2, 3))) + self.words(states.mean(dim=1))
        return (prediction - latents.mean(dim=(2, 3))).pow(2).mean()


@pytest.mark.skipif(not _core_available(), reason="graphsplit.split is not available yet")
def test_round_trip_with_a_real_split(tmp_path):
    import graphsplit

    model = InlineStep()
    dataset = Pictures(8)
    example = next(iter(loader(dataset, batch_size=2)))
    real = graphsplit.split(model, args=(example["pixel_values"], example["input_ids"]))
    cache(real, loader(dataset, batch_size=4), tmp_path, progress=False)
    cached = CachedDataset(tmp_path, real)
    for indices in ([0, 1, 2, 3], [6, 7]):
        items = [dataset[i] for i in indices]
        pixels = torch.stack([i["pixel_values"] for i in items])
        ids = torch.stack([i["input_ids"] for i in items])
        torch.manual_seed(3)
        reference = model(pixels, ids)
        reference.backward()
        expected = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        model.zero_grad()
        torch.manual_seed(3)
        loss = real.stage2(**collate([cached[i] for i in indices]))
        loss.backward()
        assert torch.equal(loss, reference)
        got = [p.grad for p in model.parameters() if p.requires_grad]
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        model.zero_grad()


@pytest.mark.skipif(not _core_available(), reason="graphsplit.split is not available yet")
def test_round_trip_of_a_real_sd_step_is_bit_exact(tmp_path):
    """Frozen VAE + text encoder, LoRA UNet: stage 2 on the cache == the unsplit step."""
    pytest.importorskip("diffusers")
    import graphsplit
    from tests.zoo import CaptionedImages, build_sd_lora_step

    step = build_sd_lora_step(seed=0)
    dataset = CaptionedImages(length=6, resolution=32)
    batches = torch.utils.data.DataLoader(dataset, batch_size=2)
    example = next(iter(batches))
    real = graphsplit.split(step, (example["pixel_values"], example["input_ids"]))
    cache(real, batches, tmp_path, progress=False)
    cached = CachedDataset(tmp_path, real, dataset=dataset)
    trainable = [p for p in step.parameters() if p.requires_grad]
    for indices in ([0, 1], [4, 5]):
        batch = collate([cached[i] for i in indices])
        torch.manual_seed(11)
        loss = real.stage2(**batch)
        grads = torch.autograd.grad(loss, trainable)
        items = [dataset[i] for i in indices]
        torch.manual_seed(11)
        reference = step(
            torch.stack([i["pixel_values"] for i in items]),
            torch.stack([i["input_ids"] for i in items]),
        )
        assert torch.equal(loss, reference)
        expected = torch.autograd.grad(reference, trainable)
        assert all(torch.equal(a, b) for a, b in zip(grads, expected))
