"""A scheduler-like helper in a file of its own, as diffusers' ``add_noise`` is: the picture
groups its nodes under the function, and hides the shape queries its loop reads."""

import torch


def add_noise(samples: torch.Tensor, noise: torch.Tensor, alphas: torch.Tensor) -> torch.Tensor:
    """``sqrt(a) * samples + sqrt(1 - a) * noise``, broadcast the way DDPMScheduler does."""
    alpha = alphas[0] ** 0.5
    alpha = alpha.flatten()
    while len(alpha.shape) < len(samples.shape):
        alpha = alpha.unsqueeze(-1)
    rest = (1 - alphas[0]) ** 0.5
    rest = rest.flatten()
    while len(rest.shape) < len(samples.shape):
        rest = rest.unsqueeze(-1)
    return alpha * samples + rest * noise
