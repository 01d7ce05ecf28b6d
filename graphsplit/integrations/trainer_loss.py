"""A trainer's ``compute_loss`` as the module graphsplit splits, and the trainer's own methods.

Apart from :mod:`.transformers` so that planning the padding groups (:mod:`.trainer_regroup`,
which splits this module on an example batch) and :func:`.transformers.split_trainer` build
the same module without importing each other.

In and out::

    TrainerLoss(trainer)(inputs)   # == trainer.compute_loss(trainer.model, inputs), unsplit
    originals(trainer)             # {"compute_loss": ..., "train": ...} before any split
"""

from __future__ import annotations

import contextlib
import inspect
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = [
    "TrainerLoss",
    "checkpointing_as_train",
    "neftune_as_train",
    "originals",
    "prepared_forward",
    "train_mode_as_train",
]


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
        object.__setattr__(self, "_trainer", trainer)

    def forward(self, inputs: dict[str, Any]) -> torch.Tensor:
        with prepared_forward(self._trainer, self.model):
            return self._compute_loss(self.model, inputs)

    def graphsplit_runs_kept(self) -> contextlib.AbstractContextManager[None]:
        """What graphsplit's extra runs of the step put back: the trainer's logged metrics
        and counters (:mod:`graphsplit.row_pairing` runs it with NaN rows)."""
        from graphsplit.integrations.trainer_bookkeeping import bookkeeping_kept

        return bookkeeping_kept(self._trainer)


@contextlib.contextmanager
def prepared_forward(trainer: Any, model: nn.Module) -> Iterator[None]:
    """``model.forward`` as ``trainer.train()`` will run it, for planning and caching before.

    With mixed precision (``bf16=True``: TRL's ``SFTConfig`` default), ``train()`` has
    accelerate's ``prepare_model`` wrap the student's ``forward`` in its autocast (and its
    outputs cast back to float32). ``split_trainer`` plans and caches before ``train()``: a
    LLaVA's vision tower, inside the student, was cached in float32 where the plain trainer
    ran it in bfloat16 (the first loss off in the 4th digit). Here the forward is wrapped as
    accelerate wraps it, with accelerate's own functions, and put back after; a model already
    prepared (``_original_forward`` set) runs as it is.
    """
    accelerator = getattr(trainer, "accelerator", None)
    if not getattr(accelerator, "native_amp", False) or "_original_forward" in vars(model):
        yield
        return
    from accelerate.utils import convert_outputs_to_fp32, get_mixed_precision_context_manager

    autocast = get_mixed_precision_context_manager(True, accelerator.autocast_handler)
    own = vars(model).get("forward")
    forward = model.forward
    if hasattr(forward, "__func__"):  # prepare_model's branch for a bound method
        wrapped = types.MethodType(autocast(forward.__func__), model)
        model.forward = types.MethodType(convert_outputs_to_fp32(wrapped.__func__), model)
    else:
        model.forward = convert_outputs_to_fp32(autocast(forward))
    try:
        yield
    finally:
        if own is None:
            del model.forward
        else:
            model.forward = own


def checkpointing_as_train(trainer: Any) -> None:
    """Switch activation checkpointing on now, as ``trainer.train()`` will, with its options.

    ``train()`` enables it (``args.activation_checkpointing``, formerly
    ``gradient_checkpointing``) on ``trainer.model`` only as training starts, after
    ``split_trainer`` planned. A plan made without it caches frozen calls inside what becomes
    a checkpointed layer; at ``train()`` the layer's recomputation in backward reruns them
    outside stage 2's answers from the cache, and torch refuses the recomputed values
    (``CheckpointError``). Planned with it on, calls inside checkpoint regions stay in stage 2.
    ``train()`` enabling it again changes nothing.
    """
    args = trainer.args
    enabled = getattr(args, "activation_checkpointing", None)
    if enabled is None:  # transformers before the rename
        enabled = getattr(args, "gradient_checkpointing", False)
    if not enabled:
        return
    options = getattr(args, "activation_checkpointing_kwargs", None)
    if options is None:
        options = getattr(args, "gradient_checkpointing_kwargs", None)
    options = dict(options or {})
    every_n_layers, offload = options.pop("every_n_layers", 1), options.pop("offload", False)
    model = trainer.model
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs=options or None,
            every_n_layers=every_n_layers,
            offload=offload,
        )
        return
    enable = model.gradient_checkpointing_enable
    accepted = inspect.signature(enable).parameters
    extra = {"every_n_layers": every_n_layers, "offload": offload}
    enable(
        gradient_checkpointing_kwargs=options or None,
        **{name: value for name, value in extra.items() if name in accepted},
    )


@contextlib.contextmanager
def neftune_as_train(trainer: Any) -> Iterator[None]:
    """NEFTune's embedding hook attached while graphsplit plans and caches, as ``train()`` will.

    ``TrainingArguments(neftune_noise_alpha=...)`` (TRL's SFT configs set it) makes ``train()``
    register ``neftune_post_forward_hook`` on the input embeddings, a frozen module under LoRA,
    only as training starts: after ``split_trainer`` planned. A plan made without the hook
    cached the clean embeddings (and the frozen work after them) and stage 2 never called the
    embedding module, so the hook ``train()`` registers never ran: training silently went
    without NEFTune's noise. Planned with the hook on, the module-level path caches the
    embedding's own output and stage 2 runs the hook on it, drawing new noise every step.
    The hook is removed again before ``train()`` attaches its own, so it never runs twice.
    """
    alpha = getattr(trainer, "neftune_noise_alpha", None)
    if alpha is None:
        yield
        return
    from transformers.integrations.neftune import activate_neftune, deactivate_neftune

    accelerator = getattr(trainer, "accelerator", None)
    handle = activate_neftune(trainer.model, alpha, accelerator)
    try:
        yield
    finally:
        deactivate_neftune(trainer.model, handle, accelerator)


@contextlib.contextmanager
def train_mode_as_train(trainer: Any) -> Iterator[None]:
    """``trainer.model`` in training mode while graphsplit plans and caches, as ``train()``
    will run it; every module's own mode put back after.

    ``from_pretrained`` returns a model in eval mode and ``train()`` switches the whole model
    to training mode as it starts, submodules included: a frozen text encoder held inside the
    model (MusicGen's T5) then runs with its dropout active every step. Planned in eval mode,
    its output was cached without dropout and the split run trained on it, silently apart from
    the plain trainer. Planned in training mode, the encoder's own draws keep it in stage 2.
    Modules the trainer holds beside the model (a teacher, a reference model) keep their mode,
    as ``train()`` leaves them.
    """
    model = trainer.model
    modes = [(module, module.training) for module in model.modules()]
    model.train()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def originals(trainer: Any) -> dict[str, Any]:
    """The trainer's own ``compute_loss`` and ``train``, as they were before any split (a
    second ``split_trainer`` wraps these, not the first one's replacements)."""
    return trainer.__dict__.setdefault(
        "_graphsplit_originals", {"compute_loss": trainer.compute_loss, "train": trainer.train}
    )
