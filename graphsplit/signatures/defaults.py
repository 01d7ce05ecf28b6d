"""The step inputs a plan took at their default, and the inputs a batch must carry.

``forward(self, pixel_values, ..., original_sizes=None)`` split from an example without
``original_sizes`` traces that parameter as its default, a constant of the plan: stage 1 never
reads it. A loader whose batches do not carry it is then what the user's script feeds the unsplit
step (``step(**batch)`` takes the default too), so ``cache()`` must not ask for it. Two batches
would make the split differ from the unsplit step, and are refused by name: one that carries
another value for such an input (stage 1 would ignore it), and one that lacks an input the
split was made *with* (stage 1 would take the default, the plan was traced on a value).

Glossary:
    defaulted input: a parameter of ``forward`` with a default that the example did not give;
        the plan holds its default (:attr:`~graphsplit.signatures.dispatch.Plan.defaulted`).
    batch inputs: the step's inputs less the defaulted ones: what ``cache()`` reads from each
        batch, digests per sample and records in the cache header.

In and out::

    defaults_taken(model, given) -> {name: default}      # at planning, per plan
    batch_input_names(split) -> (name, ...)              # what cache() reads from a batch
    defaulted_inputs(split) -> {name: default}
    refuse_unread_values(batch, split)      # a defaulted input given another value
    refuse_missing_given(batch, split)      # an input the split was made with, missing
    signature_default(split, name) -> (has_default, default)
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from graphsplit.errors import CacheError, Fix, user_error

__all__ = [
    "batch_input_names",
    "defaulted_inputs",
    "defaults_taken",
    "refuse_missing_given",
    "refuse_unread_values",
    "signature_default",
]

_PLAIN = (bool, int, float, str, bytes)


def defaults_taken(model: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    """``{name: default}`` of ``model.forward``'s parameters with a default not in ``given``."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {
        name: parameter.default
        for name, parameter in parameters.items()
        if name not in given
        and parameter.default is not inspect.Parameter.empty
        and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
    }


def defaulted_inputs(split: Any) -> dict[str, Any]:
    """The inputs the split's first plan took at their default (none for other splits)."""
    plan_set = getattr(split, "plan_set", None)
    first = getattr(plan_set, "first", None)
    return dict(getattr(first, "defaulted", None) or {})


def batch_input_names(split: Any) -> tuple[str, ...]:
    """The step inputs ``cache()`` reads from each batch (see the module glossary)."""
    defaulted = defaulted_inputs(split)
    return tuple(name for name in split.input_names if name not in defaulted)


def signature_default(split: Any, name: str) -> tuple[bool, Any]:
    """Whether the step's ``forward`` gives ``name`` a default, and which."""
    model = getattr(split, "_model", None)
    try:
        parameter = inspect.signature(model.forward).parameters.get(name)  # type: ignore[union-attr]
    except (AttributeError, TypeError, ValueError):
        return False, None
    if parameter is None or parameter.default is inspect.Parameter.empty:
        return False, None
    return True, parameter.default


def is_default(value: Any, default: Any) -> bool:
    """Whether a batch's value is the default itself (None, or an equal plain value)."""
    if value is default:
        return True
    return type(value) is type(default) and isinstance(default, _PLAIN) and value == default


def refuse_unread_values(batch: Any, split: Any) -> None:
    """Refuse a batch carrying another value for an input the split took at its default."""
    if not isinstance(batch, Mapping):
        return
    for name, default in defaulted_inputs(split).items():
        if name in batch and not is_default(batch[name], default):
            raise user_error(
                CacheError,
                f"the batch carries {name!r} ({type(batch[name]).__name__}), but the split "
                f"was made from an example without it: its plan took the default {name}="
                f"{default!r}, so stage 1 would ignore the batch's value and compute another "
                "result than the unsplit step called with this batch.",
                fix=Fix(
                    f"pass {name!r} in graphsplit.split's example too (split(step, "
                    "kwargs=batch) with a batch as the loader yields it), or leave it out of "
                    "the batches"
                ),
            )


def refuse_missing_given(batch: Any, split: Any) -> None:
    """Refuse a batch lacking an input the split was made with, though ``forward`` gives it a
    default: the plan was traced on a value, the batch would run it on the default."""
    if not isinstance(batch, Mapping):
        return
    for name in batch_input_names(split):
        if name in batch:  # the usual batch: no signature looked up (it runs every batch)
            continue
        has_default, default = signature_default(split, name)
        if not has_default:
            continue
        raise user_error(
            CacheError,
            f"the batch lacks {name!r}, which graphsplit.split's example gave (forward's "
            f"default is {name}={default!r}): the plan was made with it and would run on "
            "another value than the unsplit step called with this batch, which takes the "
            "default.",
            fix=Fix(
                f"return {name!r} from the dataset (or the collate function) in every batch, "
                f"or split from an example without {name!r} if the batches never carry it"
            ),
        )
