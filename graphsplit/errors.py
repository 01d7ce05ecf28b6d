"""graphsplit's exceptions and the one helper that formats every user-facing error.

Every error a user can fix names four things: the graph node, the user's source line, the
reason, and the fix. :func:`user_error` is the one way to build such an error: every raise of a
:class:`GraphsplitError` in the package goes through it (``tests/test_errors_built_one_way.py``
fails on any other), so all of them read alike and carry their fix as a typed value.

Glossary:
    fix (:class:`Fix`): what the user can do, in words, and the option it names when it is one.
        An error carries it as ``error.fix``.
    remedy (:class:`Remedy`): a fix that is one option of both the Python API and the command
        line (``overwrite=True`` is ``--overwrite``). An error carries it as a typed field,
        ``error.remedy``, so code decides by it and never by the message's text.
    wording (:class:`Wording`): whose words a message uses for its remedy. A message written
        with the slot ``{remedy}`` renders it as ``overwrite=True`` by default and as
        ``--overwrite`` inside ``speaking(Wording.CLI)``, which the ``graphsplit`` command wraps
        around everything it runs; ``error.args[0]`` always holds the Python wording.

    >>> error = user_error(CacheError, "the folder holds a cache", fix=Remedy.OVERWRITE)
    >>> print(error)
    the folder holds a cache
      fix:    pass overwrite=True
    >>> with speaking(Wording.CLI):
    ...     print(error)
    the folder holds a cache
      fix:    pass --overwrite
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from collections.abc import Iterator
from contextvars import ContextVar

import torch.fx

__all__ = [
    "CacheError",
    "CacheLockedError",
    "CorruptCacheError",
    "DiskFullError",
    "Fix",
    "GraphsplitError",
    "ManifestError",
    "MetaParameterError",
    "OpaqueCallError",
    "RandomDatasetWarning",
    "Remedy",
    "SplitError",
    "StaleCacheError",
    "TensorValueError",
    "TornFileError",
    "TraceError",
    "TrainableSideError",
    "UnsafeFileError",
    "VerifyError",
    "Wording",
    "speaking",
    "user_error",
]

REMEDY_SLOT = "{remedy}"
FIX_LINE = "  fix:    "  # how every message's fix line starts (user_error and Fix.line)


class Wording(enum.Enum):
    """Whose words an error's remedy is rendered in."""

    PYTHON = "python"
    CLI = "cli"


class Remedy(enum.Enum):
    """A fix that is one option, named in the Python API and on the command line."""

    OVERWRITE = ("overwrite=True", "--overwrite")
    STORE_BFLOAT16 = ("storage_dtype=torch.bfloat16", "--storage-dtype bfloat16")
    STORE_LOSSLESS = ("storage_dtype=None", "--storage-dtype none")
    NUM_WORKERS_0 = ("num_workers=0", "--num-workers 0")

    def __init__(self, python: str, cli: str) -> None:
        self.python = python
        self.cli = cli

    def words(self, wording: Wording | None = None) -> str:
        """The option in ``wording`` (default: the current one, see :func:`speaking`)."""
        wording = _WORDING.get() if wording is None else wording
        return self.cli if wording is Wording.CLI else self.python


@dataclasses.dataclass(frozen=True)
class Fix:
    """What the user can do about an error.

    ``words`` say it; where the fix is one option (``overwrite=True``), ``option`` names it and
    ``words`` holds the slot ``{remedy}`` where it goes, so the command line can say
    ``--overwrite`` instead. A bare :class:`Remedy` given as a fix reads "pass {remedy}".
    """

    words: str
    option: Remedy | None = None

    def __post_init__(self) -> None:
        if (REMEDY_SLOT in self.words) != (self.option is not None):
            raise ValueError(f"a Fix names its option with {REMEDY_SLOT} iff it has one")

    @classmethod
    def of(cls, fix: Fix | Remedy) -> Fix:
        return fix if isinstance(fix, Fix) else cls(f"pass {REMEDY_SLOT}", fix)

    def line(self) -> str:
        """The message's fix line, its option in the current :class:`Wording` (for a report
        that is not an error, such as ``check_cache``'s; an error renders its own)."""
        words = self.words
        if self.option is not None:
            words = words.replace(REMEDY_SLOT, self.option.words())
        return FIX_LINE + words


_WORDING: ContextVar[Wording] = ContextVar("graphsplit_wording", default=Wording.PYTHON)


@contextlib.contextmanager
def speaking(wording: Wording) -> Iterator[None]:
    """Render errors' remedies in ``wording`` inside the block (the CLI uses ``Wording.CLI``)."""
    token = _WORDING.set(wording)
    try:
        yield
    finally:
        _WORDING.reset(token)


class GraphsplitError(Exception):
    """Base class of every error graphsplit raises on purpose.

    Built by :func:`user_error`, never directly: ``fix`` is the typed fix and ``remedy`` its
    option (a :class:`Remedy`, or None), the value code decides by. The message may hold the
    slot ``{remedy}`` where the option is named; ``str(error)`` fills it in the current
    :class:`Wording`, and a message without the slot gets the command-line option on a line of
    its own when rendered for the command line.
    """

    remedy: Remedy | None = None
    fix: Fix | None = None  # set by user_error
    reason: str | None = None  # set by user_error: the first line, without node, source and fix

    def __init__(self, *args: object, remedy: Remedy | None = None) -> None:
        if remedy is not None:
            self.remedy = remedy
        self.template = args[0] if args and isinstance(args[0], str) else None
        if self.template is not None and self.remedy is not None:
            args = (self.template.replace(REMEDY_SLOT, self.remedy.python), *args[1:])
        super().__init__(*args)

    def __str__(self) -> str:
        if self.remedy is None or self.template is None or _WORDING.get() is Wording.PYTHON:
            return super().__str__()
        if REMEDY_SLOT in self.template:
            return self.template.replace(REMEDY_SLOT, self.remedy.cli)
        return f"{self.template}\n  on the command line: {self.remedy.cli}"


class TraceError(GraphsplitError):
    """The training step cannot be traced into a graph that is valid for every batch."""


class TensorValueError(TraceError):
    """The step reads a tensor's value while it is traced (``.item()``, ``.tolist()``, control
    flow, a data-dependent shape). A typed reason: the planning retries frozen code that does
    this as one opaque stage-1 step (:mod:`graphsplit.planning.opaque.sites`), or, planned one
    sample per batch, answers the read itself (:mod:`graphsplit.planning.opaque.value_reads`).

    ``read_at`` is the user's ``file:line  code`` that read the value, where the user's own code
    read it (None when an opaque call's example run raised it: its caller is tried next).
    """

    read_at: str | None = None


class OpaqueCallError(TraceError):
    """An opaque call's example run refused it (it writes into the model or its inputs, needs
    frozen weights that are on ``meta``, ...)."""


class TrainableSideError(OpaqueCallError):
    """The example run refused an opaque call because it belongs to the trainable side: it
    reads a trainable parameter, its inputs depend on one or on a random draw, or it draws
    random numbers. A typed reason: the planning then answers the value read that made the
    call opaque, when it can (:mod:`graphsplit.planning.opaque.value_reads`). ``site`` is the
    refused call's site (an ``OpaqueSite``)."""

    site: object = None


class SplitError(GraphsplitError):
    """The traced step cannot be cut into two exact stages (or the arguments are invalid)."""


class VerifyError(GraphsplitError, AssertionError):
    """The split stages do not reproduce the model's outputs or gradients."""


class MetaParameterError(GraphsplitError):
    """A stage was called while it holds a parameter or buffer on the ``meta`` device."""


# -- the disk side: writing, checking and reading a cache ---------------------------------------
# Each says what went wrong, where (the cache folder, the shard, the sample keys) and what to do.
class CacheError(GraphsplitError):
    """A cache cannot be written or read as asked (no disk space, bad loader, mixed batch...)."""


class CacheLockedError(CacheError):
    """Another ``graphsplit.cache`` run holds the cache folder's lock."""


class ManifestError(CacheError):
    """``manifest.json`` (or a resume record) is missing, malformed or not graphsplit's."""


class TornFileError(ManifestError):
    """A record of the cache is empty or not JSON at all: a write cut short (by a power cut
    before graphsplit fsync'd its records) rather than a file of another kind."""


class CorruptCacheError(CacheError):
    """A shard is missing, has the wrong size or checksum, or does not hold what it should."""


class StaleCacheError(CacheError):
    """The cache was produced by other weights, code, boundary or data than the ones given."""


class RandomDatasetWarning(UserWarning):
    """The dataset draws random numbers (augmentation): the cache holds one draw per sample,
    which every epoch trained from it sees again."""


class UnsafeFileError(CorruptCacheError):
    """A file of the cache folder is not a regular file inside it (a symlink, FIFO, device or
    folder), so graphsplit neither reads nor writes through it."""


class DiskFullError(CacheError):
    """The disk (or a quota, or the file size limit) had no room for a file of the cache; the
    run can be resumed once there is room."""


def describe_node(node: torch.fx.Node) -> str:
    """``name = target(args)`` in fx's own notation, short enough for one line."""
    text = node.format_node() or node.name
    text = text.strip().removeprefix("%")
    return text if len(text) <= 160 else text[:157] + "..."


def user_error(
    error_type: type[GraphsplitError],
    reason: str,
    *,
    fix: Fix | Remedy,
    node: torch.fx.Node | None = None,
    source: str | None = None,
) -> GraphsplitError:
    """Build an error whose message names the node, the user's source line, the reason and fix.

    ``source`` defaults to the ``file:line`` graphsplit recorded for ``node`` while tracing.
    ``fix`` is a :class:`Fix` (or a :class:`Remedy`, the fix "pass that option"); the error
    keeps it as ``error.fix`` and its option as ``error.remedy``.
    """
    if not isinstance(fix, Fix | Remedy):  # the words alone cannot be rendered for the CLI
        raise TypeError(f"user_error takes fix=Fix(...) or a Remedy, not {type(fix).__name__}")
    fix = Fix.of(fix)
    if source is None and node is not None:
        source = node.meta.get("source")
        code = node.meta.get("source_code")
        if source and code:
            source = f"{source}  {code}"
    lines = [reason]
    if node is not None:
        lines.append(f"  node:   {describe_node(node)}")
    if source:
        lines.append(f"  source: {source}")
    lines.append(FIX_LINE + fix.words)
    error = error_type("\n".join(lines), remedy=fix.option)
    error.fix = fix
    error.reason = reason
    return error


# storage errors
# -- caches on fsspec filesystems (s3://, gs://, hf://): see graphsplit.caching.store.remote
# ---------
class UnsupportedStorageError(CacheError):
    """A cache path graphsplit cannot open: a URL fsspec does not know or lacks the package
    for, or a local path that is a URL whose '//' was lost."""


class StorageError(CacheError):
    """A remote store refused or failed a request (credentials, network, a missing bucket)."""


__all__ += ["StorageError", "UnsupportedStorageError"]
