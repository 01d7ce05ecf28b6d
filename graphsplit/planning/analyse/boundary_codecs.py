"""Codecs: how a non-tensor value that stage 2 needs crosses the boundary as tensors.

Glossary:
    codec: a pair ``encode(obj) -> Tensor`` and ``decode(Tensor) -> obj`` such that
        ``decode(encode(obj))`` behaves exactly like ``obj`` for everything the step does next.
        The traced graph gets ``encode`` and ``decode`` nodes after every value of the type, so
        the cut can cache the tensor and stage 2 rebuilds the object from it (cheaply).

Built in: diffusers' ``DiagonalGaussianDistribution`` caches its ``parameters`` (mean and
log-variance), so ``.sample()`` draws fresh noise in stage 2 every step: exact, and what users of
hand-written caches ask for. Types are matched by qualified name so the core never imports
diffusers.

In: a traced graph whose nodes carry ``meta["val"]``. Out: the same graph, rewritten in place.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from graphsplit.planning.meta.analysis_view import meta_execution
from graphsplit.runtime import (
    decode_diagonal_gaussian,
    decode_diagonal_gaussian_deterministic,
    encode_diagonal_gaussian,
)


@dataclass(frozen=True)
class Codec:
    """Encode/decode functions for one type; ``suffix`` names the encoded boundary value."""

    encode: Callable[[Any], torch.Tensor]
    decode: Callable[[torch.Tensor], Any]
    suffix: str


_CODECS: dict[str, Codec] = {}


def _type_name(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


def register_codec(
    kind: type | str,
    encode: Callable[[Any], torch.Tensor],
    decode: Callable[[torch.Tensor], Any],
    *,
    suffix: str = "encoded",
) -> None:
    """Teach graphsplit to cache values of ``kind`` as the tensor ``encode`` returns.

    ``encode`` and ``decode`` must be module-level functions (the generated stage code calls
    them by name) and ``decode(encode(x))`` must behave exactly like ``x``.

    Example:
        >>> import torch, graphsplit
        >>> class Scaled:
        ...     def __init__(self, t): self.t = t
        >>> def encode_scaled(s): return s.t
        >>> graphsplit.register_codec(Scaled, encode_scaled, Scaled, suffix="t")
    """
    name = kind if isinstance(kind, str) else _type_name(kind)
    _CODECS[name] = Codec(encode, decode, suffix)


@contextlib.contextmanager
def scoped_registry() -> Iterator[None]:
    """Codecs registered inside the ``with`` block are forgotten when it ends (tests use it)."""
    saved = dict(_CODECS)
    try:
        yield
    finally:
        _CODECS.clear()
        _CODECS.update(saved)


def codec_for(value: Any) -> Codec | None:
    """The registered codec for ``value``'s exact type, if any."""
    return _CODECS.get(_type_name(type(value)))


register_codec(
    "diffusers.models.autoencoders.vae.DiagonalGaussianDistribution",
    encode_diagonal_gaussian,
    decode_diagonal_gaussian,
    suffix="parameters",
)


def insert_codecs(graph: fx.Graph) -> None:
    """After every value with a codec, insert ``encode -> decode`` and reroute its users."""
    for node in list(graph.nodes):
        value = node.meta.get("val")
        codec = codec_for(value)
        if codec is None or node.op in ("placeholder", "output"):
            continue
        decode = codec.decode
        if codec.decode is decode_diagonal_gaussian and getattr(value, "deterministic", False):
            decode = decode_diagonal_gaussian_deterministic
        with graph.inserting_after(node):
            encoded = graph.call_function(codec.encode, (node,))
        with graph.inserting_after(encoded):
            decoded = graph.call_function(decode, (encoded,))
        encoded.name = graph._graph_namespace.create_name(f"{node.name}_{codec.suffix}", None)
        decoded.name = graph._graph_namespace.create_name(f"{node.name}_decoded", None)
        for new in (encoded, decoded):
            new.meta["source"] = node.meta.get("source")
            new.meta["source_code"] = node.meta.get("source_code")
        with meta_execution():
            encoded.meta["val"] = codec.encode(value)
            decoded.meta["val"] = decode(encoded.meta["val"])
        node.replace_all_uses_with(
            decoded, delete_user_cb=lambda user, skip=encoded: user is not skip
        )
