"""What an opaque call or an answered value read is, in words the other opaque modules share.

The bottom of ``planning/opaque/``: :mod:`~graphsplit.planning.opaque.example_run` runs the
calls these name, :mod:`~graphsplit.planning.opaque.sites` finds and patches them, and
:mod:`~graphsplit.planning.opaque.value_reads` answers reads at a :class:`ValueSite`; each of
them imports this module and none of them imports a module above it, so the folder has no
import circle.

Glossary:
    opaque site (:class:`OpaqueSite`): a function of user or library code that read a tensor's
        value while the step was traced, and the attribute it is looked up by (a class's or a
        module's), so that the retrace can patch it there.
    value site (:class:`ValueSite`): a value read answered with its example value; the example
        run's refusals name it as they name an opaque site.
    value fix (:data:`VALUE_FIX`): what the user can do about code that reads tensor values.

Out:

    OpaqueSite(owner, attribute, read_at, leaf=None, aliases=(), trace_into=False)
        .raw / .label / .same(other)
    ValueSite(label, read_at)
    VALUE_FIX: Fix
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

from graphsplit.errors import Fix

__all__ = ["VALUE_FIX", "OpaqueSite", "ValueSite"]

VALUE_FIX = Fix(
    "replace .item()/.tolist()/nonzero-style code with tensor ops (torch.where, masking), or "
    "move it into the data pipeline"
)


@dataclass(frozen=True, eq=False)
class OpaqueSite:
    """A function to record as one opaque node, and the attribute it is looked up by."""

    owner: type | ModuleType
    attribute: str
    read_at: str  # "file:line  code" where it read a tensor value
    # A frozen leaf module whose own method read the value: traced as a call, no longer a leaf.
    leaf: str | None = None
    # Other modules' globals bound to the same function (``from x import f``): patched too.
    aliases: tuple[tuple[ModuleType, str], ...] = ()
    # A mixed leaf (frozen and trainable parameters: a peft-wrapped VLM) whose meta run read the
    # value: it cannot be opaque (its trainable half runs in stage 2), so it is only traced into
    # (no longer a leaf, nothing patched) and the read is looked for again inside it.
    trace_into: bool = False

    @property
    def raw(self) -> Any:
        """What the owner holds: a function, ``staticmethod`` or ``classmethod``."""
        return vars(self.owner)[self.attribute]

    @property
    def label(self) -> str:
        owner = getattr(self.owner, "__qualname__", None) or self.owner.__name__
        return f"{owner}.{self.attribute}"

    def same(self, other: OpaqueSite) -> bool:
        if self.trace_into or other.trace_into:  # one module, not its class's method
            return self.leaf == other.leaf and self.trace_into == other.trace_into
        return self.owner is other.owner and self.attribute == other.attribute


@dataclass(frozen=True)
class ValueSite:
    """A value read answered with its example value (:mod:`graphsplit.planning.opaque.value_reads`):
    what the example run's refusals name, as an :class:`OpaqueSite` does."""

    label: str
    read_at: str
