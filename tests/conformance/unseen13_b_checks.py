"""What the unseen13 image-script tests share: torchvision's transforms without torchvision.

``run_mae.py`` and ``run_image_classification.py`` compose torchvision's ``RandomResizedCrop``,
``RandomHorizontalFlip``, ``ToTensor`` and ``Normalize``; torchvision is not installed here.
``get_params`` is torchvision's ``RandomResizedCrop.get_params`` (the same torch draws), the
flip is torchvision's ``torch.rand(1) < p``, the resize PIL's, and ``to_normalized_tensor`` is
``ToTensor()`` then ``Normalize(mean, std)`` in torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image


def get_params(img, scale, ratio):  # torchvision's RandomResizedCrop.get_params
    width, height = img.size
    area = height * width

    log_ratio = torch.log(torch.tensor(ratio))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1]).item()
        aspect_ratio = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1])).item()

        w = int(round(math.sqrt(target_area * aspect_ratio)))  # noqa: RUF046
        h = int(round(math.sqrt(target_area / aspect_ratio)))  # noqa: RUF046

        if 0 < w <= width and 0 < h <= height:
            i = torch.randint(0, height - h + 1, size=(1,)).item()
            j = torch.randint(0, width - w + 1, size=(1,)).item()
            return i, j, h, w

    # Fallback to central crop
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))  # noqa: RUF046
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))  # noqa: RUF046
    else:  # whole image
        w = width
        h = height
    i = (height - h) // 2
    j = (width - w) // 2
    return i, j, h, w


def random_resized_crop(img, size: tuple[int, int], scale=(0.08, 1.0), resample=Image.BILINEAR):
    """``RandomResizedCrop(size, scale)`` on a PIL image (``size`` is (height, width))."""
    i, j, h, w = get_params(img, scale, (3.0 / 4.0, 4.0 / 3.0))
    return img.crop((j, i, j + w, i + h)).resize(size[::-1], resample)


def random_horizontal_flip(img, p: float = 0.5):
    if torch.rand(1) < p:
        return img.transpose(Image.FLIP_LEFT_RIGHT)
    return img


def to_normalized_tensor(img, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """``ToTensor()`` then ``Normalize(mean, std)``."""
    tensor = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1)
    return (tensor - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1)


def random_images(count: int, seed: int = 0) -> list:
    """PIL RGB images of a few sizes (20 to 24 rows, 24 columns)."""
    rng = np.random.default_rng(seed)
    return [
        Image.fromarray(rng.integers(0, 256, (20 + 2 * (i % 3), 24, 3), dtype=np.uint8))
        for i in range(count)
    ]
