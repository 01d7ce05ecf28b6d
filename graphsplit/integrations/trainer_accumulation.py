"""Refuse gradient accumulation that the Trainer normalises over the whole accumulated batch.

With ``gradient_accumulation_steps > 1`` the Trainer (transformers >= 4.46) counts the label
tokens of every micro-batch of an optimizer step (``num_items_in_batch``, from each batch's
``labels``) when the model takes loss kwargs (``model_accepts_loss_kwargs``) or a
``compute_loss_func`` is set. It hands that count to ``compute_loss``, whose own code passes it
to the model (the loss becomes ``sum / num_items_in_batch``) or to the label smoother, and it
then does not divide the loss by the accumulation steps (``training_step``: the loss is taken as
already scaled for accumulation whenever the count is not ``None``).

Stage 2 is ``compute_loss`` of one cached micro-batch, split without a count: its loss is that
micro-batch's mean. Trained from the cache the run then differs from the unsplit run, silently:

- the cached batch holds no ``labels`` (they did not cross the boundary): the Trainer counts
  nothing, divides each micro-batch's mean by the accumulation steps, where the unsplit run
  divides the sum by the tokens of the whole step; micro-batches of unequal token counts are
  weighted differently;
- ``compute_loss`` reads the count (the Trainer's own does, through the model): stage 2 drops it.

The count is a value of the whole accumulated batch, not of any sample, so no cache can hold
it; training from the cache with it would need stage 2 to take it as a live input and the
Trainer to count the tokens of cached batches (a per-sample label count stored beside the
rows). Until then :func:`refuse_item_counted_accumulation` refuses such a trainer with the
options that make the two runs agree. Whether ``compute_loss`` reads the count is found by
running it twice on the example batch under one random state, with no count and with one
(the loss changes or not): typed values, not the code's text, decide.

    refuse_item_counted_accumulation(trainer, inputs, boundary_keys, compute_loss) -> None
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from graphsplit.errors import Fix, SplitError, user_error
from graphsplit.planning.rules.random_draws import generator_states, set_generator_states

__all__ = ["refuse_item_counted_accumulation"]


def refuse_item_counted_accumulation(
    trainer: Any,
    inputs: dict[str, Any],
    boundary_keys: Iterable[str],
    compute_loss: Callable[..., Any],
) -> None:
    """Raise ``SplitError`` where the Trainer would scale accumulated micro-batches by a token
    count that training from the cache cannot reproduce (see the module docstring)."""
    steps = trainer.args.gradient_accumulation_steps
    counts = "labels" in inputs and (
        bool(getattr(trainer, "model_accepts_loss_kwargs", False))
        or getattr(trainer, "compute_loss_func", None) is not None
    )
    if steps <= 1 or not counts:
        return
    scaled_by_user = getattr(trainer, "loss_is_scaled_for_ga", None) is not None
    if "labels" not in set(boundary_keys) and not scaled_by_user:
        why = (
            "the cached batches hold no labels (they do not cross the boundary), so the Trainer "
            "counts nothing there and divides each micro-batch's mean by the accumulation "
            "steps, where the unsplit run divides the token sum by the step's whole count"
        )
    elif _reads_the_count(trainer, inputs, compute_loss):
        why = (
            "compute_loss reads num_items_in_batch (the Trainer's own passes it to the model "
            "or the label smoother), and stage 2, one cached micro-batch's loss, cannot have it"
        )
    else:
        return
    raise user_error(
        SplitError,
        f"gradient_accumulation_steps={steps}: the Trainer counts the label tokens of all the "
        "micro-batches of an optimizer step (num_items_in_batch) and normalises the loss by "
        f"that count; {why}. Training from the cache would weigh the micro-batches differently "
        "from the unsplit run.",
        fix=Fix(
            "train with gradient_accumulation_steps=1 and a per_device_train_batch_size that "
            "many times larger (the same samples per optimizer step), or set "
            "trainer.model_accepts_loss_kwargs = False (and no compute_loss_func) before "
            "split_trainer, so that both runs divide each micro-batch's mean by the "
            "accumulation steps"
        ),
    )


def _reads_the_count(trainer: Any, inputs: dict[str, Any], compute_loss: Callable) -> bool:
    """Whether ``compute_loss``'s loss on the example batch depends on ``num_items_in_batch``:
    run without one and with an odd one, under the same random state, without gradients."""
    batch = trainer._prepare_inputs(dict(inputs))
    labels = batch["labels"]
    count = labels.ne(-100).sum() * 3 + 1  # never the batch's own count
    devices = [labels.device.index or 0] if labels.device.type == "cuda" else []
    states = generator_states()  # Python's and NumPy's too; fork_rng restores torch's
    losses = []
    try:
        for items in (None, count):
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                torch.manual_seed(0)  # the same draws (dropout) in both runs
                loss = compute_loss(trainer.model, dict(batch), num_items_in_batch=items)
            losses.append(loss.detach())
    finally:
        set_generator_states(states)
    return not torch.equal(losses[0], losses[1])
