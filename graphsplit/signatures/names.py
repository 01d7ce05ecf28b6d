"""A plan's signature in a few words, for the report, the picture and error messages.

A signature lists every value a plan's checks expect, each as the traced expression
(:mod:`~graphsplit.signatures.signature`). DiffSynth's Wan step checks eight, among them
``(((1 - _tensor_constant1[argmin]) * pipe_vae.encode(to_1).to()) + …).shape[0] !=
pipe_dit_text_embedding.shape[0]``: listed whole, two plans of it are two paragraphs that
differ in one number. The short name keeps what tells plans apart:

- only the checks whose values differ between the split's plans (all of them when there is one
  plan, or when the plans differ in no check);
- a check as ``what = value`` when ``what`` is short, with the example's input sizes it reads
  (``((video.shape[2] - 1) // 4) + 1 = 2 (video.shape[2]=5)``); a longer one by those sizes
  alone; failing that, by its line and code
  (``the check at wan_video.py:1587 (if x.shape[0] != context.shape[0]:) = false``);
- a value read off frozen data by the name the user's line assigns it (``txt_seq_lens=[187]``).

plan.json keeps the full signature (each check, its value and line).

In and out::

    short_name(signature, varying, example) -> "((video.shape[2] - 1) // 4) + 1 = 2 (…=5)"
    check_text(what, value, line, example) -> one check in a few words
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from typing import Any

from graphsplit.signatures.signature import Signature

__all__ = ["check_text", "short_name"]

LONGEST_EXPRESSION = 40  # characters of a check's expression shown as it is
_SIZE = re.compile(r"\b([A-Za-z_]\w*)\.shape\[(-?\d+)\]")
_ASSIGNED = re.compile(r"\s*([A-Za-z_]\w*)\s*(?::[^=]+)?=(?!=)")
_READ_PREFIX = "the value read at "


def short_name(
    signature: Signature, varying: Collection[str] | None = None, example: str | None = None
) -> str:
    """``signature`` in a few words (see the module docstring). ``varying``: the checks whose
    values differ between the split's plans; ``example``: the plan's example record."""
    if not signature.values:
        return "(no size checks)"
    lines = dict(signature.lines)
    shown = [(w, v) for w, v in signature.values if varying and w in varying]
    texts = [check_text(w, v, lines.get(w), example) for w, v in shown or signature.values]
    return ", ".join(dict.fromkeys(texts))


def check_text(what: str, value: str, line: str | None, example: str | None) -> str:
    """One check in a few words: its expression if short, else the sizes it reads, else its
    line; a value read off frozen data by the name its line assigns."""
    code = _code(line)
    if what.startswith(_READ_PREFIX):
        assigned = _ASSIGNED.match(code or "")
        if assigned:
            return f"{assigned.group(1)}={value}"
        return f"the value read at {_place(line)} = {value}"
    sizes = _input_sizes(what, example)
    if len(what) <= LONGEST_EXPRESSION:
        plain = [size for size in sizes if size.split("=")[0] != what]
        return f"{what} = {value}" + (f" ({', '.join(plain)})" if plain else "")
    if sizes:
        return f"{', '.join(sizes)}: {value}"
    shown = code.strip() if code else ""
    if len(shown) > LONGEST_EXPRESSION:
        shown = shown[: LONGEST_EXPRESSION - 1] + "…"
    return f"the check at {_place(line)}" + (f" ({shown})" if shown else "") + f" = {value}"


def _code(line: str | None) -> str | None:
    """The code of a ``path:line  code`` source line."""
    if line is None or "  " not in line:
        return None
    return line.split("  ", 1)[1]


def _place(line: str | None) -> str:
    """``file.py:12`` of a ``path/file.py:12  code`` source line."""
    if not line:
        return "?"
    return line.split("  ", 1)[0].rsplit("/", 1)[-1]


def _input_sizes(what: str, example: str | None) -> list[str]:
    """``name.shape[i]=size`` for each input size ``what`` reads, off the example record."""
    if not example:
        return []
    try:
        shapes = _example_shapes(json.loads(example))
    except (ValueError, TypeError, KeyError):
        return []
    found = []
    for name, dim in _SIZE.findall(what):
        shape = shapes.get(name)
        if shape is None or not -len(shape) <= int(dim) < len(shape):
            return []  # a size of something not an input: the sizes alone would mislead
        found.append(f"{name}.shape[{dim}]={shape[int(dim)]}")
    return list(dict.fromkeys(found))


def _example_shapes(record: dict[str, Any]) -> dict[str, list[int]]:
    return {
        name: value["tensor"]
        for name, value in record.get("kwargs", {}).items()
        if isinstance(value, dict) and "tensor" in value
    }
