"""What produced a cache, as a record two caches (or a cache and a split) can be compared by.

Glossary:
    fingerprint: four parts, each of which changes when what stage 1 computes changes:
        ``code``     sha256 of stage 1's generated source (comment and blank lines dropped);
        ``weights``  digest of the content of every frozen parameter, buffer and tensor
                     constant that stage 1 holds (names, dtypes, shapes and bytes):
                     ``xxh3:`` + the sha256 of the names, dtypes, shapes and the XXH3-128 of
                     each tensor's bytes, remembered per tensor storage within a process
                     (:class:`WeightHashes`; see :func:`fingerprint` for why this suffices).
                     Older caches hold ``crc32:`` (a CRC-32 per MiB instead of the XXH3) or,
                     from graphsplit 0.1, ``sha256:`` (the sha256 of the bytes themselves);
                     they are compared in their own terms (:func:`in_terms_of`).
        ``boundary`` sha256 of the boundary's names, dtypes, batch dims and ranks (not the trace-
                     time sizes: the batch size and the bucket sizes may differ between runs);
        ``versions`` graphsplit, torch and safetensors versions (informational: a difference
                     there alone warns rather than refuses).
    input digest: sha256 of one sample's stage-1 inputs, see
        :mod:`graphsplit.caching.format.input_digests` (it feeds tensors as
        :func:`update_with_tensor` does).

In and out::

    fingerprint(split) -> Fingerprint
    in_terms_of(current, cached, split) -> Fingerprint   # weights digested as cached's were
    differences(cached: Fingerprint, current: Fingerprint) -> tuple[str, ...]   # "weights", ...
    describe_differences(cached, current, *, parts=PARTS) -> str                 # for errors
    warn_about_versions(cached, current, folder, *, stacklevel)                  # only warns
    update_with_tensor(digest, tensor)            # its dtype, shape and bytes, into a digest
    WEIGHT_HASHES.content_hash(tensor) -> bytes   # XXH3-128 of its bytes, remembered per storage
    WEIGHT_HASHES.forget()                        # hash every weight afresh next time
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import threading
import warnings
import weakref
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from graphsplit.caching.format import checksums
from graphsplit.caching.format.records import json_field, to_json
from graphsplit.errors import CacheError, Fix, user_error
from graphsplit.runtime import LEGACY_NAMES
from graphsplit.version import __version__

__all__ = [
    "PARTS",
    "WEIGHT_HASHES",
    "Fingerprint",
    "WeightHashes",
    "describe_differences",
    "differences",
    "fingerprint",
    "in_terms_of",
    "update_with_tensor",
    "warn_about_versions",
]

PARTS = ("weights", "code", "boundary", "versions")
# Parts whose difference makes a cache unusable; "versions" only warns.
BINDING_PARTS = ("weights", "code", "boundary")
_CHUNK_BYTES = 64 << 20
_CRC_BYTES = 1 << 20  # one CRC-32 per MiB of a tensor's bytes
WEIGHTS_ALGORITHM = "crc32" if checksums.xxhash is None else "xxh3"
# xxh3: now; crc32: earlier 0.2 caches (and where xxhash is missing); sha256: graphsplit 0.1.
_WEIGHTS_ALGORITHMS = ("xxh3", "crc32", "sha256")
_WEIGHTS = re.compile(r"(?:xxh3|crc32|sha256):[0-9a-f]{64}")
_WEIGHTS_MEANING = "'xxh3:', 'crc32:' or 'sha256:' + 64 hex digits"
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_DIGEST_MEANING = "'sha256:' + 64 hex digits"


@dataclass(frozen=True)
class Fingerprint:
    """The digests of what produced a cache; see the module docstring for each part.

    Its fields are also its JSON form in the cache's manifest (see
    :mod:`graphsplit.caching.format.layout`); ``versions`` are kept sorted by name.
    """

    code: str = json_field(pattern=_DIGEST, meaning=_DIGEST_MEANING)
    weights: str = json_field(pattern=_WEIGHTS, meaning=_WEIGHTS_MEANING)
    boundary: str = json_field(pattern=_DIGEST, meaning=_DIGEST_MEANING)
    versions: Mapping[str, str] = json_field()
    # Digests of the same stage-1 code as older graphsplit releases spelled it (helpers that
    # lived elsewhere, see graphsplit.runtime): a cache they wrote still matches. Never stored.
    code_aliases: tuple[str, ...] = json_field(stored=False, default=(), compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "versions", dict(sorted(self.versions.items())))

    def to_json(self) -> dict[str, Any]:
        return to_json(self)


# The weights digest of a split whose frozen modules are on ``meta`` (a stage-2 process).
UNKNOWN_WEIGHTS = "unknown: stage 1's frozen tensors are on the meta device"


def fingerprint(
    split: Any, *, allow_meta: bool = False, weights_algorithm: str = WEIGHTS_ALGORITHM
) -> Fingerprint:
    """Fingerprint ``split.stage1``: its code, the frozen tensors it holds and its boundary.

    Hashing reads every frozen weight once per process: the XXH3-128 of each tensor's bytes
    (``benchmarks/bench_fingerprint.py`` measures its GB/s per core beside CRC-32 and sha256;
    see docs/benchmarks.md), remembered per storage, so the next ``cache()`` or
    ``CachedDataset(path, split)`` of the same weights in the same process hashes nothing
    (:class:`WeightHashes` says which in-place writes it sees). XXH3 is not cryptographic,
    and need not be: the weights digest tells a changed model from the one a cache was made
    with, it does not stand between a cache and someone forging one (who could as well
    rewrite the manifest). For a change nobody crafted against the hash, a changed tensor
    keeps its XXH3-128 with probability about 2^-128 (XXH3 passes SMHasher's avalanche and
    collision tests), so even a one-bit change in one tensor goes unseen with probability
    about 3e-39 (CRC-32 per MiB, the previous digest: 2^-32, about 2e-10, for a change within
    one MiB). ``weights_algorithm="crc32"`` or ``"sha256"`` gives the digests of older caches.
    With ``allow_meta``, a split whose frozen tensors are on ``meta`` (a training process that
    never loads them) gets :data:`UNKNOWN_WEIGHTS`: its code and boundary can still be checked.

    Example:
        >>> import torch
        >>> from types import SimpleNamespace
        >>> stage1 = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
        >>> a = fingerprint(SimpleNamespace(stage1=stage1, boundary={}))
        >>> with torch.no_grad():
        ...     _ = stage1.weight.add_(1.0)
        >>> differences(a, fingerprint(SimpleNamespace(stage1=stage1, boundary={})))
        ('weights',)
    """
    held = _held_tensors(split.stage1)
    on_meta = any(tensor.device.type == "meta" for _, tensor in held)
    code = _normalized_code(split.stage1.code)
    # Stage 1 as graphsplit 0.2 wrote it (fewer size checks, the same values), then each
    # spelling as 0.1 wrote it: a cache made by any of them is this split's own.
    spellings = [code] + [
        _normalized_code(alias) for alias in getattr(split.stage1, "graphsplit_code_aliases", ())
    ]
    spellings += [_legacy_spelling(spelling) for spelling in spellings]
    aliases = tuple(dict.fromkeys(_digest_text(s) for s in spellings[1:] if s != code))
    return Fingerprint(
        code=_digest_text(code),
        weights=(
            UNKNOWN_WEIGHTS if allow_meta and on_meta else _digest_tensors(held, weights_algorithm)
        ),
        boundary=_digest_text(json.dumps(_boundary_identity(split.boundary))),
        versions=current_versions(),
        code_aliases=aliases,
    )


def in_terms_of(current: Fingerprint, cached: Fingerprint, split: Any) -> Fingerprint:
    """``current``, with ``split``'s weights digested the way ``cached``'s were where the two
    differ (an older cache holds CRC-32s or a sha256 of the bytes), so that the two
    fingerprints compare like for like. Costs a second pass over the weights only then."""
    algorithm = cached.weights.partition(":")[0]
    if (
        UNKNOWN_WEIGHTS in (cached.weights, current.weights)
        or algorithm not in _WEIGHTS_ALGORITHMS
        or current.weights.startswith(f"{algorithm}:")
    ):
        return current
    weights = _digest_tensors(_held_tensors(split.stage1), algorithm)
    return dataclasses.replace(current, weights=weights)


def differences(cached: Fingerprint, current: Fingerprint) -> tuple[str, ...]:
    """The parts (in :data:`PARTS` order) whose digests differ between two fingerprints.

    Weights that one side could not read (:data:`UNKNOWN_WEIGHTS`) are not compared.
    """
    unknown = UNKNOWN_WEIGHTS in (cached.weights, current.weights)
    same_code = (
        cached.code == current.code
        or cached.code in current.code_aliases
        or current.code in cached.code_aliases
    )
    return tuple(
        part
        for part in PARTS
        if getattr(cached, part) != getattr(current, part)
        and not (part == "weights" and unknown)
        and not (part == "code" and same_code)
    )


def describe_differences(
    cached: Fingerprint, current: Fingerprint, *, parts: Sequence[str] = PARTS
) -> str:
    """One clause per differing part among ``parts``, in plain words, for an error or warning."""
    clauses = {
        "weights": "the frozen weights differ (a parameter or buffer that stage 1 reads has "
        "changed since the cache was written)",
        "code": "the stage-1 code differs (the training step, or how it was split, has changed"
        + _older_release(cached.versions, current.versions)
        + ")",
        "boundary": "the boundary differs (stage 2 now takes other tensors, dtypes or batch dims)",
        "versions": "the versions differ (cache: "
        f"{_format_versions(cached.versions)}; now: {_format_versions(current.versions)})",
    }
    return "; ".join(clauses[part] for part in differences(cached, current) if part in parts)


def warn_about_versions(
    cached: Fingerprint, current: Fingerprint, folder: Path, *, stacklevel: int
) -> None:
    """Warn when only the library versions differ: the cache is used as it is.

    ``stacklevel`` counts as for ``warnings.warn`` called where this is called.
    """
    if "versions" in differences(cached, current):
        warnings.warn(
            f"the cache at {folder} was written with other library versions; "
            f"{describe_differences(cached, current, parts=['versions'])}. Its weights, code "
            "and boundary match, so it is used as it is.",
            stacklevel=stacklevel + 1,
        )


def current_versions() -> dict[str, str]:
    """The versions of graphsplit, torch and safetensors in this process."""
    import safetensors

    return {
        "graphsplit": __version__,
        "safetensors": str(safetensors.__version__),
        "torch": str(torch.__version__),
    }


def _older_release(cached: Mapping[str, str], current: Mapping[str, str]) -> str:
    """A clause naming an older graphsplit as the likely cause of a code difference."""
    made_by, running = cached.get("graphsplit", "?"), current.get("graphsplit", "?")
    if _release(made_by) >= _release(running):
        return ""
    return (
        f"; or the cache was made by an older graphsplit, {made_by} (this is {running}), "
        "which generated other code"
    )


def _release(version: str) -> tuple[int, ...]:
    """``"0.2.0rc1" -> (0, 2, 0)``: enough to order graphsplit's own releases."""
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


_LEGACY_PATTERN = re.compile(r"\b(" + "|".join(map(re.escape, LEGACY_NAMES)) + r")\b")


def _legacy_spelling(code: str) -> str:
    """``code`` as graphsplit 0.1 wrote it: runtime helpers under their old module paths."""
    return _LEGACY_PATTERN.sub(lambda match: LEGACY_NAMES[match.group(1)], code)


def _normalized_code(code: str) -> str:
    """Stage-1 source without comment-only and blank lines (they carry user file paths)."""
    lines = (line.rstrip() for line in code.splitlines())
    return "\n".join(line for line in lines if line and not line.lstrip().startswith("#"))


def _boundary_identity(boundary: Mapping[str, Any]) -> list[list[Any]]:
    return [
        [name, str(spec.dtype).removeprefix("torch."), spec.batch_dim, len(spec.shape)]
        for name, spec in boundary.items()
    ]


def _held_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters, buffers and tensor constants of ``module``, each once, sorted by name."""
    seen: set[int] = set()
    found: list[tuple[str, torch.Tensor]] = []
    named = [*module.named_parameters(), *module.named_buffers()]
    graph = getattr(module, "graph", None)
    if graph is not None:
        for node in graph.nodes:
            if node.op == "get_attr":
                value = _resolve(module, str(node.target))
                if isinstance(value, torch.Tensor):
                    named.append((str(node.target), value))
    for name, tensor in named:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            found.append((name, tensor))
    return sorted(found, key=lambda pair: pair[0])


def _resolve(module: torch.nn.Module, target: str) -> Any:
    value: Any = module
    for part in target.split("."):
        value = getattr(value, part, None)
    return value


def _digest_tensors(tensors: Iterable[tuple[str, torch.Tensor]], algorithm: str) -> str:
    if algorithm == "xxh3":
        checksums.require_xxhash("weights fingerprint is an XXH3 digest")
    digest = hashlib.sha256()
    for name, tensor in tensors:
        if tensor.device.type == "meta":
            raise user_error(
                CacheError,
                f"cannot fingerprint stage 1: its tensor {name!r} is on the meta device, so its "
                "content is unknown.",
                fix=Fix(
                    "load the frozen weights before caching or checking a cache against this split."
                ),
            )
        digest.update(f"{name}|".encode())
        if algorithm == "sha256":
            update_with_tensor(digest, tensor)
        elif algorithm == "crc32":
            _update_with_crcs(digest, tensor)
        else:
            digest.update(_identity(tensor))
            digest.update(WEIGHT_HASHES.content_hash(tensor))
    return f"{algorithm}:" + digest.hexdigest()


def _identity(tensor: torch.Tensor) -> bytes:
    return f"{str(tensor.dtype).removeprefix('torch.')}{tuple(tensor.shape)}|".encode()


def _chunks(tensor: torch.Tensor) -> Iterator[Any]:
    """The tensor's bytes in logical (row-major) order, as buffers of at most 64 MiB: the
    memory itself for a contiguous CPU tensor, else CPU copies of one chunk at a time."""
    flat = tensor.detach().reshape(-1)
    if flat.device.type == "cpu" and flat.is_contiguous() and flat.numel():
        yield flat.view(torch.uint8).numpy().data
        return
    step = max(1, _CHUNK_BYTES // max(1, flat.element_size()))
    for start in range(0, flat.numel(), step):
        yield flat[start : start + step].to("cpu").contiguous().view(torch.uint8).numpy().data


def update_with_tensor(digest: Any, tensor: torch.Tensor) -> None:
    """Feed ``digest`` the tensor's dtype and shape, then its bytes in logical order (the
    weights digest of graphsplit 0.1, and every tensor of an input digest)."""
    digest.update(_identity(tensor))
    for chunk in _chunks(tensor):
        digest.update(chunk)


def _update_with_crcs(digest: Any, tensor: torch.Tensor) -> None:
    """Feed ``digest`` the tensor's dtype and shape, then the CRC-32 of each MiB of its bytes
    (the weights digest of earlier 0.2 caches)."""
    digest.update(_identity(tensor))
    crcs = bytearray()
    for chunk in _chunks(tensor):
        for offset in range(0, len(chunk), _CRC_BYTES):
            crcs += zlib.crc32(chunk[offset : offset + _CRC_BYTES]).to_bytes(4, "little")
    digest.update(bytes(crcs))


class WeightHashes:
    """The XXH3-128 of each frozen tensor's bytes, remembered per storage within a process.

    A tensor's entry is found by its storage (held weakly: a freed storage drops its entries,
    so a new one at the same address is never mistaken for it) and its view of it (offset,
    shape, strides, dtype), and is used only while the storage's address and size and the
    tensor's version counter are what they were when it was hashed, and a fixed sample of
    its elements (:data:`PROBED_ELEMENTS`, :func:`_probe`) still holds the same bytes. Every
    in-place change through torch (``add_``, ``copy_``, ``load_state_dict``, an optimizer
    step) bumps the version counter, so it is seen; writes that bypass it (through
    ``param.data``, as an EMA teacher's update does, a numpy or DLPack view, or a file mapped
    into the tensor and changed on disk) are seen by the sample when they change any sampled
    element (an EMA update changes them all). A write to a few elements between the sampled
    ones through ``.data`` is not seen within this process: :meth:`forget` drops everything;
    a new process always hashes afresh.
    """

    def __init__(self) -> None:
        self._known: weakref.WeakKeyDictionary[Any, dict[tuple, tuple[tuple, bytes]]]
        self._known = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self.hashed_bytes = 0  # bytes read to hash (not remembered), for tests and benchmarks

    def content_hash(self, tensor: torch.Tensor) -> bytes:
        """The 16-byte XXH3-128 digest of ``tensor``'s bytes in logical order."""
        place = _place(tensor)
        probe = None if place is None else _probe(tensor)
        if probe is None:
            place = None  # nothing to sample it by: hashed every time
        if place is not None:
            storage, view, state = place
            with self._lock:
                found = self._known.get(storage, {}).get(view)
            if found is not None and found[0] == (*state, probe):
                return found[1]
        running = checksums.xxhash.xxh3_128()
        for chunk in _chunks(tensor):
            running.update(chunk)
        value = running.digest()
        with self._lock:
            self.hashed_bytes += tensor.numel() * tensor.element_size()
            if place is not None:
                self._known.setdefault(storage, {})[view] = ((*state, probe), value)
        return value

    def forget(self) -> None:
        """Drop every remembered hash (the next fingerprint reads every weight again)."""
        with self._lock:
            self._known = weakref.WeakKeyDictionary()


def _place(tensor: torch.Tensor) -> tuple[Any, tuple, tuple] | None:
    """``(storage, view, state)`` that :class:`WeightHashes` remembers ``tensor`` by, or None
    for a tensor it must always hash (no version counter: made under inference mode; no
    storage: sparse, or a tensor subclass)."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.layout != torch.strided:
        return None
    try:
        version = tensor._version
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    view = (tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
    return storage, view, (storage.data_ptr(), storage.nbytes(), version)


# Elements of a tensor sampled at fixed, evenly spaced places (the last one included) each
# time a remembered hash is reused: a write that bypasses the version counter (an EMA
# teacher's ``p.data.copy_(...)`` / ``p.data.mul_(d).add_(...)``, a numpy view) changes nearly
# every element, so the sample differs and the tensor is hashed again. A write to a few
# elements between the sampled ones can still go unseen: WEIGHT_HASHES.forget() covers that.
PROBED_ELEMENTS = 256
_SAME_SIZE_INTEGER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _probe(tensor: torch.Tensor) -> bytes | None:
    """The bytes of :data:`PROBED_ELEMENTS` (or fewer) elements of ``tensor`` at fixed places:
    a copy of those elements only, whatever the tensor's size, device and strides (None: a
    tensor that cannot be sampled so, such as a quantized one)."""
    try:
        return _sampled_bytes(tensor)
    except (RuntimeError, TypeError, NotImplementedError):
        return None


def _sampled_bytes(tensor: torch.Tensor) -> bytes:
    count = tensor.numel()
    if count == 0:
        return b""
    values = tensor.detach()
    if values.is_contiguous():
        flat = values.view(-1)
        step = max(1, count // PROBED_ELEMENTS)
        sample = torch.cat([flat[::step], flat[-1:]])
    else:  # only the sampled elements are gathered (reshape(-1) would copy them all)
        places = torch.linspace(0, count - 1, min(count, PROBED_ELEMENTS + 1)).long()
        sample = values[torch.unravel_index(places.to(values.device), values.shape)]
    integer = _SAME_SIZE_INTEGER.get(sample.element_size())
    sample = sample.to("cpu").contiguous()
    sample = sample.view(integer) if integer is not None else sample.view(torch.uint8)
    return sample.numpy().tobytes()


# The one per process: cache(), CachedDataset and check_cache share what was hashed.
WEIGHT_HASHES = WeightHashes()


def _digest_text(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _format_versions(versions: Mapping[str, str]) -> str:
    return ", ".join(f"{name} {version}" for name, version in sorted(versions.items()))
