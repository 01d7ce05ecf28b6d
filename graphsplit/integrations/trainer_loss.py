"""A trainer's ``compute_loss`` as the module graphsplit splits, and the trainer's own methods.

Apart from :mod:`.transformers` so that planning the padding groups (:mod:`.trainer_regroup`,
which splits this module on an example batch) and :func:`.transformers.split_trainer` build
the same module without importing each other.

In and out::

    TrainerLoss(trainer)(inputs)   # == trainer.compute_loss(trainer.model, inputs), unsplit
    originals(trainer)             # {"compute_loss": ..., "train": ...} before any split
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["TrainerLoss", "originals"]


class TrainerLoss(nn.Module):
    """A trainer's ``compute_loss(model, inputs)`` as a module that takes the collated batch.

    Children: the student as ``model``, then every other module the trainer holds as an
    attribute (a teacher, a reference model) under that attribute's name, each object once
    (``model_wrapped`` is the student before training). The trainer itself is kept as a plain
    attribute: it holds the student again in its callback handler, which must not name it.
    """

    def __init__(self, trainer: Any) -> None:
        super().__init__()
        self.model = trainer.model
        for name, value in vars(trainer).items():
            if not isinstance(value, nn.Module) or not name.isidentifier():
                continue
            if name.startswith("_") or any(value is child for child in self.children()):
                continue
            self.add_module(name, value)
        object.__setattr__(self, "_compute_loss", originals(trainer)["compute_loss"])

    def forward(self, inputs: dict[str, Any]) -> torch.Tensor:
        return self._compute_loss(self.model, inputs)


def originals(trainer: Any) -> dict[str, Any]:
    """The trainer's own ``compute_loss`` and ``train``, as they were before any split (a
    second ``split_trainer`` wraps these, not the first one's replacements)."""
    return trainer.__dict__.setdefault(
        "_graphsplit_originals", {"compute_loss": trainer.compute_loss, "train": trainer.train}
    )
