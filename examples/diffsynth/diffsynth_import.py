"""Import DiffSynth-Studio (``pip install diffsynth==2.1.12``) where torchvision cannot load.

Why: ``import diffsynth`` imports torchvision at the top of modules the training steps need
(``diffsynth/core/data/operators.py``, ``diffsynth/models/wan_video_image_encoder.py``, ...), but
only *calls* it in data loading and image-encoder preprocessing, which these steps never run.
PyPI's torchvision wheels are CUDA builds: beside a CPU torch (``torch==2.13.0+cpu``) the
wheel's ``_C.so`` cannot load (it links ``libtorch_cuda.so``) and ``import torchvision`` fails
with ``operator torchvision::nms does not exist``.

So: use the real torchvision when it imports; otherwise (and only if no torchvision loads)
install a stand-in package whose every attribute is a placeholder that raises
:class:`TorchvisionUnavailable` when called or used. Nothing of DiffSynth is changed.

    diffsynth_or_reason() -> (True, "") | (False, why diffsynth cannot be imported)
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any

DIFFSYNTH_VERSION = "2.1.12"


class TorchvisionUnavailable(RuntimeError):
    """DiffSynth code reached for torchvision, which cannot load beside this torch build."""


class _PlaceholderType(type):
    """The metaclass of torchvision placeholders: attributes are placeholders, calls refuse.

    Placeholders are classes, so library code may use them where a type is expected:
    ``isinstance(value, torchvision.io.VideoReader)`` (``datasets`` asks this of every value it
    formats once torchvision is in ``sys.modules``) is False, and ``class X(torchvision.Foo)``
    defines an ordinary class.
    """

    def __getattr__(cls, attr: str) -> type:
        if attr.startswith("__") or not cls.__dict__.get("_graphsplit_placeholder"):
            raise AttributeError(attr)
        return _placeholder(f"{cls.__qualname__}.{attr}")

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if not cls.__dict__.get("_graphsplit_placeholder"):
            return super().__call__(*args, **kwargs)  # a class DiffSynth derived from one
        raise TorchvisionUnavailable(
            f"{cls.__qualname__} was called, but torchvision cannot be imported beside this "
            "torch build (see examples/diffsynth/diffsynth_import.py); the graphsplit DiffSynth "
            "steps never need it"
        )


def _placeholder(name: str) -> type:
    """A stand-in for the torchvision attribute ``name``."""
    namespace = {"__qualname__": name, "__module__": "torchvision", "_graphsplit_placeholder": True}
    return _PlaceholderType(name.rsplit(".", 1)[-1], (), namespace)


def _module_attribute(module_name: str) -> Any:
    """A module ``__getattr__``: placeholders for names, AttributeError for dunders.

    Tools that scan ``sys.modules`` (hypothesis, inspect, pytest) read ``__file__`` and
    friends; they must find them missing, not get a placeholder.
    """

    def attribute(attr: str) -> type:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _placeholder(f"{module_name}.{attr}")

    return attribute


class _StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``torchvision`` and every ``torchvision.*`` as a module of placeholders."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torchvision" and not name.startswith("torchvision."):
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []  # a package: submodules import through this finder too
        module.__getattr__ = _module_attribute(spec.name)  # type: ignore[method-assign]
        module.__graphsplit_stand_in__ = True
        # transformers reads the version to pick image backends: an old one makes it pick none.
        module.__version__ = "0.0.0"
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def _torchvision_loads() -> bool:
    try:
        importlib.import_module("torchvision")
    except Exception:  # ImportError, or RuntimeError: operator torchvision::nms does not exist
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]  # a half-imported real torchvision must not linger
        return False
    return True


def uses_stand_in() -> bool:
    """Whether ``torchvision`` is the stand-in (the real one could not load)."""
    module = sys.modules.get("torchvision")
    return bool(getattr(module, "__graphsplit_stand_in__", False))


def diffsynth_or_reason() -> tuple[bool, str]:
    """Import diffsynth (with the torchvision stand-in if needed); or say why it cannot."""
    if "diffsynth" in sys.modules:
        return True, ""
    if importlib.util.find_spec("diffsynth") is None:
        return False, (
            f"diffsynth is not installed (pip install --no-deps diffsynth=={DIFFSYNTH_VERSION}"
            " einops ftfy sentencepiece imageio modelscope pandas)"
        )
    if not _torchvision_loads() and not uses_stand_in():
        sys.meta_path.insert(0, _StandIn())
    try:
        import diffsynth  # noqa: F401
    except Exception as exc:
        return False, f"diffsynth {DIFFSYNTH_VERSION} does not import: {type(exc).__name__}: {exc}"
    return True, ""
