"""A per-dataset constant on the boundary takes the name the user gave it.

Stage 2's code and the cache name a boundary value after the node that computed it
(``text_encoder_1_0``: the output ``[0]`` of the second call of ``text_encoder``). For a
per-sample value that name is what users know from the report; a constant is rarer and is what
they look for when they read stage 2 (where did this tensor come from, why is it not
per sample?), so it takes the variable of the user's line that assigned it:
``null_conditioning = text_encoder(tokenize_captions([""]).to(latents.device))[0]`` gives
``null_conditioning`` in stage 2's ``forward``, in ``constants.safetensors`` and in the report.

Only a plain ``name = ...`` line whose last value is the constant is used (no other node of
that line reads it); otherwise the node keeps its name. fx keeps names unique (a clash gets a
suffix).

    name_constants(cut) -> None   # renames the nodes in place
"""

from __future__ import annotations

import keyword
import re

from graphsplit.artifacts import Cut
from graphsplit.planning.rules.taint import facts

__all__ = ["name_constants"]

_ASSIGNMENT = re.compile(r"^\s*([A-Za-z_]\w*)\s*(?::[^=]*)?=(?!=)")


def name_constants(cut: Cut) -> None:
    """Rename each constant of ``cut``'s boundary after the variable its line assigns."""
    for node in cut.boundary:
        if not facts(node).is_constant:
            continue
        match = _ASSIGNMENT.match(node.meta.get("source_code") or "")
        if match is None or keyword.iskeyword(match.group(1)):
            continue
        source = node.meta.get("source")
        if any(user.meta.get("source") == source for user in node.users):
            continue  # the line goes on computing: the variable is a later value
        if node.name != match.group(1):
            node._rename(match.group(1))
