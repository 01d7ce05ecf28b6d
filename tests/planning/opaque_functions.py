"""A frozen value-reading function in a module of its own, imported by name by the tests.

``from tests.planning.opaque_functions import trim_to_lengths`` binds the name in the importing
module, and the call looks it up there: graphsplit must patch it there too.
"""

from __future__ import annotations

import torch


def trim_to_lengths(states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Zero each row's states past its prompt length (the lengths read as Python ints)."""
    states = states.clone()
    for row, length in enumerate(mask.sum(dim=1).tolist()):
        states[row, length:] = 0
    return states
