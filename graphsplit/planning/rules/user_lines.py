"""Locate the user's code behind a traced operation: its ``file:line`` and the line's text.

Glossary:
    user code: any frame that belongs neither to torch, graphsplit, NumPy nor the standard
        library.
    location: ``("path:line", "code on that line")``; the path relative to the cwd when inside
        it. Traced nodes store it as ``node.meta["source"]`` and ``node.meta["source_code"]``.

While tracing, the Python stack holds torch's and graphsplit's own frames on top of the user's.
The innermost frame that belongs to neither is where the user wrote the operation; we record it
as ``file:line  code`` on every node so reports and errors can point at it.
"""

from __future__ import annotations

import importlib.util
import inspect
import linecache
import os
import sys
import sysconfig
from types import FrameType
from typing import Any

import torch

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
# The package root (this file is graphsplit/planning/rules/user_lines.py): every graphsplit frame.
_GRAPHSPLIT_DIR = (
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
)
# NumPy (``np.prod(x.shape)`` in a library's model): the line is the caller's, never NumPy's.
_NUMPY = importlib.util.find_spec("numpy")
_NUMPY_DIRS = (os.path.dirname(_NUMPY.origin) + os.sep,) if _NUMPY and _NUMPY.origin else ()
# The standard library (contextlib, functools): never where the user wrote the operation. In
# an installation without a virtual environment, site-packages sits inside it: not internal.
_STDLIB_DIRS = tuple(
    os.path.realpath(sysconfig.get_paths()[key]) + os.sep for key in ("stdlib", "platstdlib")
) + tuple(sysconfig.get_paths()[key] + os.sep for key in ("stdlib", "platstdlib"))
_PACKAGE_DIRS = tuple(
    path + os.sep
    for key in ("purelib", "platlib")
    for path in (sysconfig.get_paths()[key], os.path.realpath(sysconfig.get_paths()[key]))
)


def is_internal(filename: str) -> bool:
    """True for frames of torch, of graphsplit itself, of NumPy or of Python's standard library.

    Asked for every frame between a traced op and the user's line, for every node: the
    answer depends on the file name only, so it is kept per name.
    """
    known = _INTERNAL.get(filename)
    if known is None:
        internal = (_GRAPHSPLIT_DIR, _TORCH_DIR, "<", *_NUMPY_DIRS)
        known = _INTERNAL[filename] = filename.startswith(internal) or (
            filename.startswith(_STDLIB_DIRS) and not filename.startswith(_PACKAGE_DIRS)
        )
    return known


_INTERNAL: dict[str, bool] = {}


def is_user_code(filename: str) -> bool:
    """True for the user's own files: neither internal (:func:`is_internal`) nor an installed
    package's (site-packages)."""
    return not is_internal(filename) and not filename.startswith(_PACKAGE_DIRS)


def user_frame() -> FrameType | None:
    """The innermost frame on the current stack that is not torch's or graphsplit's."""
    frame = sys._getframe(1)
    while frame is not None and is_internal(frame.f_code.co_filename):
        frame = frame.f_back
    return frame


def frame_location(frame: FrameType | None) -> tuple[str, str]:
    """``("path:line", "code on that line")``, the path relative to the cwd when inside it."""
    if frame is None:
        return "<unknown>", ""
    return frame_location_of(frame.f_code.co_filename, frame.f_lineno)


def frame_location_of(filename: str, line: int) -> tuple[str, str]:
    """As :func:`frame_location`, for a file name and line number."""
    code = linecache.getline(filename, line).strip()
    return f"{_shown_path(filename)}:{line}", code


def _shown_path(filename: str) -> str:
    """``filename`` relative to the cwd when inside it (``os.path.relpath`` per node was about
    3% of a 10k-node chain's split in a sampling profile: it is kept per cwd and name)."""
    key = (os.getcwd(), filename)
    shown = _SHOWN.get(key)
    if shown is None:
        shown = filename
        try:
            relative = os.path.relpath(filename)
            if not relative.startswith(".."):
                shown = relative
        except ValueError:  # another drive on Windows
            pass
        _SHOWN[key] = shown
    return shown


_SHOWN: dict[tuple[str, str], str] = {}


def current_location() -> tuple[str, str]:
    """The user's ``("file:line", code)`` for the operation being traced right now."""
    return frame_location(user_frame())


def current_line() -> str:
    """:func:`current_location` as one string, ``file:line  code``, for error messages."""
    return describe(current_location())


def definition_of(function: Any) -> tuple[str, str]:
    """``("file:line", "def forward(...)")`` of a function (the step's forward: where its
    inputs come from), ``("<unknown>", "")`` for one without Python code."""
    code = getattr(inspect.unwrap(function), "__code__", None)
    if code is None:
        return "<unknown>", ""
    return frame_location_of(code.co_filename, code.co_firstlineno)


def describe(location: tuple[str, str]) -> str:
    """``file:line  code`` (or just ``file:line`` when the code is not available)."""
    place, code = location
    return f"{place}  {code}" if code else place
