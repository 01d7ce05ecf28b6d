"""Which module call each node of a split belongs to, for a picture people can read.

A traced step is flat: a UNet traced into, a scheduler's ``add_noise`` inlined, and the step's
own lines all sit side by side. The picture groups nodes by the call they came from:

Glossary:
    group: the call a node belongs to (:class:`Group`); ``Group.STEP`` is the step's own code.
    module call: a node traced inside a submodule's ``forward`` carries fx's
        ``nn_module_stack``; its group is the innermost module (``block.attn``). A leaf module's
        own ``call_module`` node belongs to the module that called it.
    method call on a leaf module: ``vae.encode(x)`` is a ``get_attr(vae)`` and a
        ``call_method(encode)``; both form the group ``vae.encode()``.
    function call: a node whose source line is in another file than the step's (a library
        function such as ``DDPMScheduler.add_noise``) belongs to the function around that line,
        found by parsing the file (``file:line`` is what tracing recorded).
    hidden value: a node neither stage runs (a shape query only Python control flow read): the
        picture leaves it out and says how many it left out.

In and out::

    group_nodes(split) -> dict[fx.Node, Group]     every node, in graph order
    is_hidden(split, node) -> bool
"""

from __future__ import annotations

import ast
import functools
import linecache
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.fx as fx
from torch import nn

if TYPE_CHECKING:
    from graphsplit.api import Split

__all__ = ["Group", "group_nodes", "is_hidden"]


@dataclass(frozen=True)
class Group:
    """A call nodes belong to: ``key`` identifies it, ``label`` names it for people."""

    key: str
    label: str

    STEP: ClassVar[Group]

    @property
    def is_step(self) -> bool:
        return self.key == ""


Group.STEP = Group("", "the step")


def is_hidden(split: Split, node: fx.Node) -> bool:
    """True for a value neither stage runs (``'unused'`` in the picture's colours)."""
    if node.op == "output":
        return False
    return node not in split.cut.stage1 and node not in split.cut.stage2


def group_nodes(split: Split) -> dict[fx.Node, Group]:
    """The group of every node of ``split.graph`` (see the module glossary)."""
    nodes = list(split.graph.nodes)
    step_file = next(
        (_file_of(node) for node in nodes if node.op == "placeholder" and _file_of(node)), None
    )
    root = getattr(split, "_model", None)
    groups: dict[fx.Node, Group] = {}
    for node in nodes:
        groups[node] = _module_group(node) or _method_group(node, root) or Group.STEP
        if groups[node].is_step and node.op not in ("placeholder", "output", "get_attr"):
            file = _file_of(node)
            if file is not None and step_file is not None and file != step_file:
                groups[node] = _function_group(node.meta["source"])
    for node in nodes:  # a module read only by its method calls joins their group
        if node.op == "get_attr" and node.users:
            users = {groups[user] for user in node.users}
            if len(users) == 1 and not next(iter(users)).is_step:
                groups[node] = next(iter(users))
    return groups


def _file_of(node: fx.Node) -> str | None:
    source = node.meta.get("source")
    if not isinstance(source, str) or ":" not in source:
        return None
    file, _, line = source.rpartition(":")
    return file if line.isdigit() else None


def _module_group(node: fx.Node) -> Group | None:
    stack = node.meta.get("nn_module_stack") or {}
    entries = list(stack.values())
    if node.op == "call_module":
        entries = entries[:-1]  # the call itself belongs to its caller
    if not entries:
        return None
    path, kind = entries[-1]
    name = getattr(kind, "__name__", str(kind))
    return Group(f"module:{path}", f"{path} ({name})")


def _method_group(node: fx.Node, root: Any) -> Group | None:
    if node.op != "call_method" or not node.args:
        return None
    owner = node.args[0]
    if not isinstance(owner, fx.Node) or owner.op != "get_attr":
        return None
    if isinstance(owner.meta.get("val"), torch.Tensor):  # a tensor's method, not a module's
        return None
    if root is not None and not isinstance(_resolve(root, str(owner.target)), nn.Module):
        return None
    return Group(f"method:{owner.target}.{node.target}", f"{owner.target}.{node.target}()")


def _resolve(root: Any, target: str) -> Any:
    value = root
    for part in target.split("."):
        value = getattr(value, part, None)
    return value


def _function_group(source: str) -> Group:
    file, _, line = source.rpartition(":")
    name = _enclosing_function(file, int(line))
    where = Path(file).name
    if name is None:
        return Group(f"file:{file}", where)
    return Group(f"function:{file}:{name}", f"{name}()  {where}")


@functools.lru_cache(maxsize=64)
def _functions(file: str) -> tuple[tuple[int, int, str], ...]:
    """``(first line, last line, qualified name)`` of every function defined in ``file``."""
    text = "".join(linecache.getlines(file))
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return ()
    found: list[tuple[int, int, str]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    found.append((child.lineno, child.end_lineno or child.lineno, name))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return tuple(found)


def _enclosing_function(file: str, line: int) -> str | None:
    around = [entry for entry in _functions(file) if entry[0] <= line <= entry[1]]
    return min(around, key=lambda entry: entry[1] - entry[0])[2] if around else None
