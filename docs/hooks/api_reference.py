"""mkdocs hook: render ``::: graphsplit.name`` lines of the docs from the live docstrings.

The API reference is therefore the docstrings themselves: signature, text, ``Args:`` /
``Returns:`` / ``Raises:`` sections as lists, ``Example:`` as a code block, and a dataclass's
fields. No plugin to install; mkdocs runs this file (``hooks:`` in mkdocs.yml).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re

_MARKER = re.compile(r"^::: ([\w.]+)\s*$", re.MULTILINE)
_SECTIONS = ("Args:", "Returns:", "Raises:", "Example:", "Examples:")


def _resolve(path: str):
    module_name, _, attribute = path.rpartition(".")
    return getattr(importlib.import_module(module_name), attribute)


def _signature(path: str, obj) -> str:
    try:
        signature = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""
    prefix = "class " if inspect.isclass(obj) else ""
    return f"```python\n{prefix}{path}{signature}\n```\n"


_ROLE = re.compile(r":(?:class|func|meth|data|mod|attr):`~?([^`]+)`")


def _render_docstring(text: str) -> str:
    text = _ROLE.sub(r"`\1`", text)
    out: list[str] = []
    section = None
    code: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped in _SECTIONS:
            if code:
                out += ["```python", *code, "```", ""]
                code = []
            section = stripped.rstrip(":")
            out += ["", f"**{section}**", ""]
            continue
        if section in ("Example", "Examples"):
            if stripped:
                code.append(line[4:] if line.startswith("    ") else line)
            continue
        if section in ("Args", "Returns", "Raises") and stripped:
            if line.startswith("    ") and not line.startswith("        "):
                out.append(f"- {stripped}")
            else:
                out[-1] = f"{out[-1]} {stripped}" if out else stripped
            continue
        out.append(line)
    if code:
        out += ["```python", *code, "```"]
    return "\n".join(out).strip() + "\n"


def _fields(obj) -> str:
    if not (inspect.isclass(obj) and dataclasses.is_dataclass(obj)):
        return ""
    rows = [f"| `{field.name}` | `{field.type}` |" for field in dataclasses.fields(obj)
            if not field.name.startswith("_")]
    methods = [
        f"- `{name}{inspect.signature(member)}`: {inspect.getdoc(member).splitlines()[0]}"
        for name, member in vars(obj).items()
        if inspect.isfunction(member) and not name.startswith("_") and inspect.getdoc(member)
    ]
    table = "\n**Fields**\n\n| field | type |\n|---|---|\n" + "\n".join(rows) + "\n"
    return table + ("\n**Methods**\n\n" + "\n".join(methods) + "\n" if methods else "")


def render(path: str) -> str:
    """The markdown for one ``::: path`` marker."""
    obj = _resolve(path)
    doc = inspect.getdoc(obj) or ""
    return "\n".join([_signature(path, obj), _render_docstring(doc), _fields(obj)])


def on_page_markdown(markdown: str, page, config, files) -> str:
    """mkdocs hook: expand every ``::: graphsplit.name`` line of a page."""
    return _MARKER.sub(lambda match: render(match.group(1)), markdown)
