"""Whether a cache is a given split's: made by its frozen weights, stage-1 code and boundary, and
recording the stage-1 batches its stage 2 needs whole.

In and out::

    refuse_other_split(manifest, current, path, paired=None)
        # StaleCacheError: another split's cache, or a cache without the stage-1 batches of a
        # split whose stage 2 pairs rows (``paired``: its ``paired_rows``); other versions warn
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from graphsplit.caching.format.fingerprint import (
    BINDING_PARTS,
    UNKNOWN_WEIGHTS,
    Fingerprint,
    describe_differences,
    warn_about_versions,
)
from graphsplit.caching.format.layout import Manifest
from graphsplit.caching.format.records import REBUILD
from graphsplit.errors import Fix, Remedy, StaleCacheError, user_error

__all__ = ["refuse_other_split"]


def refuse_other_split(
    manifest: Manifest, current: Fingerprint, path: Path, paired: Any = None
) -> None:
    """Refuse a cache made from other weights, code or boundary, or (``paired``: the split's
    ``paired_rows``) one that does not record the stage-1 batches; warn on other versions."""
    cached = manifest.header.fingerprint
    if paired is not None and manifest.header.paired_rows is None:
        raise user_error(
            StaleCacheError,
            f"{paired.describe()}, but the cache at {path} was written without recording its "
            "stage-1 batches (before graphsplit knew the step pairs rows), so stage 2 cannot be "
            "given them whole; regrouped rows would pair the wrong samples.",
            fix=Fix(REBUILD, Remedy.OVERWRITE),
            source=paired.source or None,
        )
    binding = describe_differences(cached, current, parts=BINDING_PARTS)
    if binding:
        raise user_error(
            StaleCacheError,
            f"the cache at {path} was not made by this split: {binding}.",
            fix=Fix(REBUILD, Remedy.OVERWRITE),
        )
    if current.weights == UNKNOWN_WEIGHTS:
        warnings.warn(
            f"the frozen weights of this split are on the meta device, so the cache at {path} is "
            "checked for code and boundary only; its weights were fingerprinted when it was "
            "written (graphsplit.cache refuses stale weights then).",
            stacklevel=3,
        )
    warn_about_versions(cached, current, path, stacklevel=3)
