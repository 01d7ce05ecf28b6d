"""Autocast's state asked about the meta device answers for the device the weights are on.

Library code asks autocast about the device of its own tensors (TRL's chunked log-prob
kernel: ``torch.is_autocast_enabled(hidden.device.type)``); on the analysis's meta stand-ins
torch has no autocast state and raises "unknown device type for autocast". The stand-ins are
for tensors on the weights' device, whose autocast state is the answer. Installed through the
planning's one patcher, so it is undone with everything else.

    autocast_queries_answer_for_meta(patcher, device_type)
"""

from __future__ import annotations

from typing import Any

import torch

from graphsplit.planning.patching.patcher import Patcher

__all__ = ["autocast_queries_answer_for_meta"]


def autocast_queries_answer_for_meta(switches: Patcher, device_type: str) -> None:
    """``torch.is_autocast_enabled("meta")`` and ``get_autocast_dtype("meta")`` answer for the
    device the step's weights are on, instead of raising.

    Library code asks autocast about the device of its own tensors (TRL's chunked log-prob
    kernel: ``torch.is_autocast_enabled(hidden.device.type)``); on the analysis's meta stand-ins
    torch has no autocast state and raises "unknown device type for autocast". The stand-ins
    are for tensors on the weights' device, whose autocast state is the answer.
    """
    enabled, dtype = torch.is_autocast_enabled, torch.get_autocast_dtype

    def asked(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return args[0] if args else kwargs.get("device_type")

    def is_autocast_enabled(*args: Any, **kwargs: Any) -> bool:
        if asked(args, kwargs) == "meta":
            return enabled(device_type)
        return enabled(*args, **kwargs)

    def get_autocast_dtype(*args: Any, **kwargs: Any) -> torch.dtype:
        if asked(args, kwargs) == "meta":
            return dtype(device_type)
        return dtype(*args, **kwargs)

    switches.patch(torch, "is_autocast_enabled", is_autocast_enabled)
    switches.patch(torch, "get_autocast_dtype", get_autocast_dtype)
