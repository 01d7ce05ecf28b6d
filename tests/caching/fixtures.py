"""A small split and dataset for the cache tests, independent of the splitting core.

``make_split()`` builds by hand what ``graphsplit.split`` returns: a traced frozen stage 1 whose
boundary has the three kinds of tensor a cache must handle (batch dim 0, batch dim 1, and a
per-dataset constant with no batch dim), a trainable stage 2, and the boundary specs. Helpers
here also damage caches (``rewrite_manifest``, ``flip_last_byte``), interrupt a run like a crash
(``interrupt_after``), and run ``cache_worker.py`` in other processes (``worker_environment``).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from graphsplit.artifacts import BoundarySpec

INPUT_NAMES = ("pixel_values", "input_ids")
SMALL = 1500  # shard_bytes: one batch of two samples per shard
ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("cache_worker.py")
TOKENS = 6
VOCAB = 50


class FrozenEncoder(nn.Module):
    """Stand-in for a VAE plus a text encoder: everything stage 1 computes."""

    def __init__(self, seed: int = 0, scale: float = 2.0) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, stride=2, padding=1)
        self.embed = nn.Embedding(VOCAB, 8)
        self.register_buffer("table", torch.zeros(3, 5))
        self.scale = scale
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for tensor in [*self.parameters(), *self.buffers()]:
                tensor.copy_(torch.randn(tensor.shape, generator=generator))
        self.requires_grad_(False)

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor) -> dict[str, Any]:
        latents = self.conv(pixel_values)  # (B, 4, H/2, W/2): batch dim 0
        text = self.embed(input_ids).transpose(0, 1)  # (T, B, 8): batch dim 1
        table = self.table * self.scale  # (3, 5): per-dataset constant
        return {"latents": latents, "text": text, "table": table}


class Head(nn.Module):
    """The trainable rest of the step; draws noise, like a diffusion loss."""

    def __init__(self, seed: int = 1) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.image = nn.Linear(4, 1)
        self.words = nn.Linear(8, 1)
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator))

    def forward(
        self, latents: torch.Tensor, text: torch.Tensor, table: torch.Tensor
    ) -> torch.Tensor:
        noisy = latents + 0.1 * torch.randn_like(latents)
        image = self.image(noisy.mean(dim=(2, 3)))
        words = self.words(text.mean(dim=0))
        return (image + words + table.mean()).pow(2).mean()


class Model(nn.Module):
    """The unsplit step: ``model(pixels, ids) == head(**encoder(pixels, ids))``."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.encoder = FrozenEncoder(seed)
        self.head = Head(seed + 1)

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(**self.encoder(pixel_values, input_ids))


class ChannelsLastEncoder(torch.nn.Module):
    """Stage 1 whose output is channels-last, like a VAE on CPU can be."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1).requires_grad_(False)

    def forward(self, pixel_values):
        return {"latents": self.conv(pixel_values).contiguous(memory_format=torch.channels_last)}


_OWN_TEMPORARY = re.compile(r"\.graphsplit-(.+)\.[0-9]+-[0-9a-f]{16}\.tmp")


def short_name(name: str) -> str:
    """A graphsplit temporary file's name without its prefix and process suffix
    (``.graphsplit-manifest.json.123-0a1b….tmp`` -> ``.manifest.json.tmp``); others as they are."""
    return _OWN_TEMPORARY.sub(r".\1.tmp", name)


def make_split(model: Model | None = None, *, scale: float = 2.0) -> SimpleNamespace:
    """What ``graphsplit.split(model, ...)`` returns, built by hand for ``Model``."""
    model = model or Model()
    model.encoder.scale = scale
    stage1 = trace(model.encoder)
    boundary = {
        "latents": BoundarySpec("latents", (2, 4, 4, 4), torch.float32, 0, 4 * 4 * 4 * 4, "x:1"),
        "text": BoundarySpec("text", (TOKENS, 2, 8), torch.float32, 1, TOKENS * 8 * 4, "x:2"),
        "table": BoundarySpec("table", (3, 5), torch.float32, None, 0, "x:3"),
    }
    return SimpleNamespace(
        stage1=stage1, stage2=model.head, boundary=boundary, input_names=INPUT_NAMES, model=model
    )


class _BufferTracer(torch.fx.Tracer):
    proxy_buffer_attributes = True  # keep buffers as attributes, as graphsplit's stages do


def trace(module: nn.Module) -> torch.fx.GraphModule:
    """``symbolic_trace`` that shares ``module``'s buffers instead of baking them in."""
    return torch.fx.GraphModule(module, _BufferTracer().trace(module))


class Pictures(torch.utils.data.Dataset):
    """Item ``i`` is a pure function of ``(i, seed, sizes)``; ``sizes`` cycle per index."""

    def __init__(
        self, length: int = 12, sizes: tuple[int, ...] = (8,), *, keys: bool = True, seed: int = 0
    ) -> None:
        self.length, self.sizes, self.keys, self.seed = length, sizes, keys, seed
        self.changed: dict[int, float] = {}

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not 0 <= index < self.length:
            raise IndexError(index)
        generator = torch.Generator().manual_seed(self.seed * 10_007 + index)
        size = self.sizes[index % len(self.sizes)]
        item: dict[str, Any] = {
            "pixel_values": torch.randn(3, size, size, generator=generator)
            + self.changed.get(index, 0.0),
            "input_ids": torch.randint(0, VOCAB, (TOKENS,), generator=generator),
        }
        if self.keys:
            item["key"] = f"pic{index:03d}"
        return item


def loader(dataset: Any = None, batch_size: int = 2, **kwargs: Any) -> torch.utils.data.DataLoader:
    dataset = Pictures() if dataset is None else dataset
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, **kwargs)


def bucket_batches(dataset: Pictures, batch_size: int) -> list[list[int]]:
    """Index lists holding one size each, in a fixed order (aspect-ratio buckets)."""
    batches = []
    for size in dataset.sizes:
        same = [i for i in range(len(dataset)) if dataset.sizes[i % len(dataset.sizes)] == size]
        batches += [same[i : i + batch_size] for i in range(0, len(same), batch_size)]
    return batches


def cache_contents(path: Path) -> dict[str, Any]:
    """Everything a cache holds, for equality checks: manifest fields minus the timestamp, and
    every file's bytes."""
    manifest = json.loads((Path(path) / "manifest.json").read_text())
    manifest.pop("created")
    files = {
        entry.name: entry.read_bytes()
        for entry in sorted(Path(path).iterdir())
        if entry.suffix == ".safetensors"
    }
    return {"manifest": manifest, "files": files}


def rows_by_key(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Every sample's rows, by key (layout independent)."""
    from graphsplit.caching.read.dataset import CachedDataset

    cached = CachedDataset(path)
    return {item["key"]: {k: v for k, v in item.items() if k != "key"} for item in cached}


def stage1_rows(split: SimpleNamespace, dataset: Any, indices: list[int]) -> dict[str, Any]:
    """The rows stage 1 computes for ``indices``, straight from the model."""
    items = [dataset[i] for i in indices]
    pixels = torch.stack([item["pixel_values"] for item in items])
    ids = torch.stack([item["input_ids"] for item in items])
    return split.stage1(pixels, ids)


def rewrite_manifest(path: Path, change: Any) -> None:
    """Apply ``change`` to the manifest's JSON document, as a damaged or crafted file would."""
    document = json.loads((path / "manifest.json").read_text())
    change(document)
    (path / "manifest.json").write_text(json.dumps(document))


def flip_last_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[-1] ^= 0xFF
    file.write_bytes(bytes(data))


class Interrupt(Exception):
    """A simulated crash."""


def interrupt_after(monkeypatch: Any, shards: int) -> None:
    """Make the writer fail after ``shards`` shards were committed, like a crash."""
    from graphsplit.caching.write.shards import ShardWriter

    original = ShardWriter.commit
    done = []

    def commit(self, shard, temporary, checksum):
        if len(done) >= shards:
            raise Interrupt("simulated crash")
        done.append(shard.index)
        return original(self, shard, temporary, checksum)

    monkeypatch.setattr(ShardWriter, "commit", commit)


def worker_environment() -> dict[str, str]:
    """The environment ``cache_worker.py`` runs in: this checkout first, one thread."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("ACCELERATE_CONFIG_FILE", None)
    return env
