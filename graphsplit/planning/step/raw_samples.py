"""Raw samples: a batch that is one dataset item as it is, PIL images and strings, no tensor.

DiffSynth-Studio's loader hands the step its dataset's dict untouched (``collate_fn=lambda x:
x[0]``): ``{"video": [PIL.Image, ...], "prompt": "a cat"}``, and the step's own code turns the
frames into tensors and tokenizes the prompt. No collate stacks PIL images, so a batch holding
them is one sample, and its strings and images are that sample's: they vary from sample to
sample and must cross the boundary per sample, not be kept as constants of the plan.

Glossary:
    raw sample: a dict holding no tensor and at least one PIL image (alone or in a list).
    image codec: a PIL image (or a list of same-sized images of one mode) crosses as its
        pixels, ``numpy.asarray`` stacked, ``[1, frames?, height, width, channels?]`` with the
        sample's row first; it comes back as ``Image.fromarray`` of those pixels in that mode:
        the same pixels, size and mode (what the step's preprocessing reads), not the file's
        metadata (``format``, ``info``, ``filename``). Only modes whose pixels are their whole
        content (no palette) cross: ``MODES``.

PIL is never imported here: a value is an image only if ``PIL.Image`` is already loaded and
the value is one of its images.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch

from graphsplit.errors import Fix, SplitError, user_error

MODES = frozenset({"1", "L", "I", "F", "RGB", "RGBA"})
"""Modes whose ``numpy.asarray`` is all there is to the image (``P`` keeps a palette beside)."""


def is_image(value: Any) -> bool:
    """Whether ``value`` is a PIL image (never imports PIL)."""
    module = sys.modules.get("PIL.Image")
    return module is not None and isinstance(value, module.Image)


def holds_images(value: Any) -> bool:
    """A PIL image, or a non-empty list or tuple of them (a video's frames)."""
    if is_image(value):
        return True
    return type(value) in (list, tuple) and bool(value) and all(map(is_image, value))


def is_raw_sample(values: Mapping[str, Any]) -> bool:
    """Whether ``values`` is one raw sample: images somewhere, no tensor anywhere."""
    leaves = torch.utils._pytree.tree_leaves(list(values.values()), is_leaf=is_image)
    if any(isinstance(leaf, torch.Tensor) for leaf in leaves):
        return False
    return any(holds_images(value) for value in values.values())


def image_mode(name: str, value: Any) -> str:
    """The one mode of ``value``'s images; a SplitError for a mode that cannot cross."""
    frames = [value] if is_image(value) else list(value)
    modes = {frame.mode for frame in frames}
    if len(modes) != 1 or not modes <= MODES:
        raise user_error(
            SplitError,
            f"the sample's {name!r} holds images of mode {sorted(modes)}; graphsplit caches a "
            f"raw sample's images as their pixels, which it can do for one mode among "
            f"{sorted(MODES)} (a palette or other mode keeps more than its pixels).",
            fix=Fix(f"convert the images in the dataset, e.g. image.convert('RGB') for {name!r}"),
        )
    return modes.pop()


def encode_images(name: str, value: Any, mode: str) -> torch.Tensor:
    """The pixels of a sample's image(s), ``[1, ...]``: one row, the sample's."""
    import numpy as np

    frames = [value] if is_image(value) else list(value)
    if image_mode(name, value) != mode or len({frame.size for frame in frames}) != 1:
        sizes = sorted({frame.size for frame in frames})
        raise user_error(
            SplitError,
            f"the sample's {name!r} holds images of mode {frames[0].mode} and sizes {sizes}; "
            f"the plan was made with one size a sample and mode {mode}.",
            fix=Fix("resize and convert every sample's images alike in the dataset"),
        )
    pixels = np.stack([np.asarray(frame) for frame in frames])
    return torch.from_numpy(pixels[0] if is_image(value) else pixels).unsqueeze(0)


def decode_images(name: str, tensor: torch.Tensor, mode: str, container: type | None) -> Any:
    """The image(s) :func:`encode_images` made ``tensor`` of: the same pixels, size and mode."""
    from PIL import Image

    if tensor.dim() < 3 or tensor.shape[0] != 1:
        raise user_error(
            SplitError,
            f"the step takes one raw sample per batch (its example was a dataset item as it is, "
            f"with PIL images in {name!r}), and this batch holds {int(tensor.shape[0])}.",
            fix=Fix("read the cache one sample per batch: DataLoader(dataset, batch_size=1)"),
        )
    # ``fromarray`` finds each mode of MODES from the array's dtype and channels alone.
    pixels = tensor[0].numpy()
    if container is None:
        return Image.fromarray(pixels)
    return container(Image.fromarray(frame) for frame in pixels)
