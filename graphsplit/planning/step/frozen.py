"""Resolve the ``frozen=`` argument of :func:`graphsplit.split` into parameter names.

Accepted forms (see ``split``'s docstring): ``None`` (every parameter with
``requires_grad=False``), a predicate ``(name, param) -> bool``, an iterable of modules, or an
iterable of qualified-name prefixes. Buffers are always constants and never listed here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn

from graphsplit.errors import Fix, SplitError, user_error

FrozenSpec = None | Callable[[str, nn.Parameter], bool] | Iterable[nn.Module] | Iterable[str]


def resolve_frozen(
    model: nn.Module,
    frozen: FrozenSpec,
    *,
    named: list[tuple[str, nn.Parameter]] | None = None,
) -> frozenset[str]:
    """The qualified names of ``model``'s frozen parameters.

    ``named``: ``list(model.named_parameters())`` when the caller already has it (a walk of
    every module of a big model, which ``split`` needs once for itself too).
    """
    named = list(model.named_parameters()) if named is None else named
    if frozen is None:
        return frozenset(name for name, param in named if not param.requires_grad)
    if callable(frozen) and not isinstance(frozen, nn.Module):
        return frozenset(name for name, param in named if frozen(name, param))
    if isinstance(frozen, (str, nn.Module)):
        frozen = [frozen]
    items = list(frozen)
    if all(isinstance(item, str) for item in items):
        return _by_prefix(named, items)
    if all(isinstance(item, nn.Module) for item in items):
        return _by_module(model, named, items)
    kinds = sorted({type(item).__name__ for item in items})
    raise user_error(
        SplitError,
        f"frozen= mixes or uses unsupported types ({', '.join(kinds)}).",
        fix=Fix("pass None, a predicate (name, param) -> bool, modules, or name prefixes"),
    )


def _by_prefix(named: list[tuple[str, nn.Parameter]], prefixes: list[str]) -> frozenset[str]:
    names = set()
    for prefix in prefixes:
        matched = {
            name for name, _ in named if name == prefix or name.startswith(prefix.rstrip(".") + ".")
        }
        if not matched:
            raise user_error(
                SplitError,
                f"frozen= prefix {prefix!r} matches no parameter of the model.",
                fix=Fix(f"use a qualified module path such as {_example_prefix(named)!r}"),
            )
        names |= matched
    return frozenset(names)


def _by_module(
    model: nn.Module, named: list[tuple[str, nn.Parameter]], modules: list[nn.Module]
) -> frozenset[str]:
    owned_ids: set[int] = set()
    for module in modules:
        if not any(module is candidate for candidate in model.modules()):
            raise user_error(
                SplitError,
                f"frozen= lists a {type(module).__name__} that is not a submodule of the model.",
                fix=Fix("pass the module objects the model itself holds"),
            )
        owned_ids |= {id(param) for param in module.parameters()}
    return frozenset(name for name, param in named if id(param) in owned_ids)


def _example_prefix(named: list[tuple[str, nn.Parameter]]) -> str:
    return named[0][0].rsplit(".", 1)[0] if named else "encoder"
