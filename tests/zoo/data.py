"""Procedural image/caption pairs, so tests and benchmarks need no downloads and no files.

Every item is a pure function of ``(seed, index, constructor arguments)``: two datasets built with
the same arguments return bit-identical tensors, in any order and in any process. That is what a
cache test needs: an item encoded in stage 1 and the same item re-read in stage 2 must match.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence

import torch
from torch.utils.data import Dataset

__all__ = ["CaptionedImages", "special_token_ids", "tokenize"]

_COLORS = {
    "red": (1.0, -0.6, -0.6),
    "green": (-0.6, 0.9, -0.5),
    "blue": (-0.7, -0.4, 1.0),
    "yellow": (1.0, 0.9, -0.8),
    "white": (1.0, 1.0, 1.0),
    "black": (-1.0, -1.0, -1.0),
    "purple": (0.5, -0.8, 0.7),
    "orange": (1.0, 0.2, -0.9),
}
_SHAPES = ("circle", "square", "stripes", "gradient")


def special_token_ids(vocab_size: int) -> tuple[int, int, int]:
    """Return ``(bos, eos, pad)`` for a vocabulary, the CLIP convention of SD 1.x.

    The two highest ids are BOS and EOS and padding repeats EOS, as the SD 1.x CLIP tokenizer
    does; the zoo's CLIP configs use the same ids so ``pooler_output`` finds the EOS token.
    """
    return vocab_size - 2, vocab_size - 1, vocab_size - 1


def _word_id(word: str, vocab_size: int) -> int:
    """Map a word to a stable id in ``[1, vocab_size - 2)``; crc32 is not salted per process."""
    return 1 + zlib.crc32(word.encode("utf-8")) % (vocab_size - 3)


def tokenize(
    caption: str,
    max_tokens: int = 16,
    vocab_size: int = 1000,
    prefix_ids: Sequence[int] = (),
) -> torch.Tensor:
    """Tokenise a caption into ``(max_tokens,)`` int64: BOS, prefix ids, word ids, EOS, padding.

    ``prefix_ids`` lets textual-inversion tests put placeholder ids (>= the base vocabulary)
    right after BOS. Words that do not fit are dropped; EOS is always kept.
    """
    bos, eos, pad = special_token_ids(vocab_size)
    words = [_word_id(w, vocab_size) for w in caption.lower().split()]
    body = [*prefix_ids, *words][: max_tokens - 2]
    ids = [bos, *body, eos]
    ids += [pad] * (max_tokens - len(ids))
    return torch.tensor(ids, dtype=torch.int64)


def _draw_image(gen: torch.Generator, size: int) -> tuple[torch.Tensor, str]:
    """Draw one (3, size, size) image in [-1, 1] and the caption that describes it."""
    names = list(_COLORS)
    pick = torch.randint(0, len(names), (2,), generator=gen).tolist()
    fg_index = pick[0]
    bg_index = (fg_index + 1 + pick[1] % (len(names) - 1)) % len(names)  # any colour but fg
    fg_name, bg_name = names[fg_index], names[bg_index]
    shape = _SHAPES[int(torch.randint(0, len(_SHAPES), (1,), generator=gen))]
    cx, cy, radius, phase = torch.rand(4, generator=gen).tolist()
    fg = torch.tensor(_COLORS[fg_name]).view(3, 1, 1)
    bg = torch.tensor(_COLORS[bg_name]).view(3, 1, 1)
    axis = torch.linspace(0.0, 1.0, size)
    yy, xx = torch.meshgrid(axis, axis, indexing="ij")
    if shape == "circle":
        mask = ((xx - cx) ** 2 + (yy - cy) ** 2 < (0.15 + 0.3 * radius) ** 2).float()
    elif shape == "square":
        half = 0.1 + 0.25 * radius
        mask = (((xx - cx).abs() < half) & ((yy - cy).abs() < half)).float()
    elif shape == "stripes":
        mask = (torch.sin((xx + yy) * (4 + 8 * radius) * math.pi + phase * 6.28) > 0).float()
    else:
        mask = (xx * (0.5 + cx) + yy * (0.5 - cx) + phase).remainder(1.0)
    image = bg + (fg - bg) * mask
    image = image + 0.05 * torch.randn(3, size, size, generator=gen)
    caption = f"a {fg_name} {shape} on {bg_name}"
    return image.clamp(-1.0, 1.0).to(torch.float32), caption


class CaptionedImages(Dataset):
    """Synthetic captioned images: coloured circles, squares, stripes and gradients.

    Item ``i`` is ``{"key": "sample-00000i", "pixel_values": (3, H, W) float32 in [-1, 1],
    "input_ids": (max_tokens,) int64}``. ``resolutions`` (e.g. ``[32, 48]``) gives sample ``i``
    the side ``resolutions[i % len(resolutions)]``, for aspect-ratio-bucket style tests where a
    batch must not mix sizes. ``placeholder_ids`` are inserted after BOS in every caption (for
    textual inversion, ids at or above ``vocab_size``).
    """

    def __init__(
        self,
        length: int = 16,
        resolution: int = 32,
        seed: int = 0,
        max_tokens: int = 16,
        vocab_size: int = 1000,
        resolutions: Sequence[int] | None = None,
        placeholder_ids: Sequence[int] = (),
    ) -> None:
        if max_tokens < 2:
            raise ValueError("max_tokens must leave room for BOS and EOS")
        self.length = length
        self.resolution = resolution
        self.seed = seed
        self.max_tokens = max_tokens
        self.vocab_size = vocab_size
        self.resolutions = list(resolutions) if resolutions else None
        self.placeholder_ids = tuple(placeholder_ids)

    def __len__(self) -> int:
        return self.length

    def resolution_of(self, index: int) -> int:
        """Side length of item ``index`` without generating it (bucketing samplers need this)."""
        if self.resolutions:
            return self.resolutions[index % len(self.resolutions)]
        return self.resolution

    def caption_of(self, index: int) -> str:
        """The caption of item ``index`` (same generator as the image, so they agree)."""
        return self._generate(index)[1]

    def _generate(self, index: int) -> tuple[torch.Tensor, str]:
        if not 0 <= index < self.length:
            raise IndexError(index)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        return _draw_image(gen, self.resolution_of(index))

    def __getitem__(self, index: int) -> dict[str, object]:
        image, caption = self._generate(index)
        ids = tokenize(caption, self.max_tokens, self.vocab_size, self.placeholder_ids)
        return {"key": f"sample-{index:06d}", "pixel_values": image, "input_ids": ids}
