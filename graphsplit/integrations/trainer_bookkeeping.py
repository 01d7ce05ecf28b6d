"""The trainer's own bookkeeping, as it was before graphsplit ran its ``compute_loss``.

``split_trainer`` plans by running the trainer's ``compute_loss`` on the example (the probes:
several runs) and caches by running stage 1 over the whole train dataset. TRL's trainers count
and log inside ``compute_loss``: ``SFTTrainer`` adds each batch's tokens to
``self._total_train_tokens`` and appends its entropy and accuracy to ``self._metrics``. Left
as they are, the first logged ``num_tokens`` counts every probe and every cached batch (126
tokens where the plain trainer logs 36), and the first logged means average the probes' values
in.

So the plain-data attributes of the trainer (numbers, strings, and lists, tuples and dicts of
them, TRL's ``defaultdict(list)`` included) are copied before and put back after; attributes of
that kind added meanwhile are removed. Anything else (the model, the optimizer, the
accelerator, callbacks, the state object) is left alone: graphsplit's runs do not train.

    with bookkeeping_kept(trainer):
        ... split and cache ...
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

__all__ = ["bookkeeping_kept"]

_PLAIN = (type(None), bool, int, float, complex, str, bytes)


def _plain(value: Any, depth: int = 0) -> bool:
    """Numbers and strings, and containers holding only them (a few levels deep)."""
    if isinstance(value, _PLAIN):
        return True
    if depth > 4:
        return False
    if type(value) in (list, tuple, set, frozenset):
        return all(_plain(item, depth + 1) for item in value)
    if isinstance(value, dict) and type(value).__module__ in ("builtins", "collections"):
        return all(
            _plain(key, depth + 1) and _plain(item, depth + 1) for key, item in value.items()
        )
    return False


@contextlib.contextmanager
def bookkeeping_kept(trainer: Any) -> Iterator[None]:
    """Run the body, then put the trainer's plain-data attributes back as they were."""
    attributes = vars(trainer)
    saved = {name: copy.deepcopy(value) for name, value in attributes.items() if _plain(value)}
    try:
        yield
    finally:
        for name in [n for n, v in attributes.items() if n not in saved and _plain(v)]:
            del attributes[name]
        for name, value in saved.items():
            _put_back(attributes, name, value)


def _put_back(attributes: dict[str, Any], name: str, value: Any) -> None:
    """``attributes[name]`` as ``value``: a list, set or dict still held there is refilled in
    place (a callback may hold the trainer's ``_metrics`` itself)."""
    current = attributes.get(name)
    if type(current) is type(value) and isinstance(current, (list, dict, set)):
        current.clear()
        if isinstance(current, list):
            current.extend(value)
        else:
            current.update(value)  # type: ignore[arg-type]
        return
    attributes[name] = value
