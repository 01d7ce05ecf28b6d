"""The docs build offline with no warnings, and troubleshooting lists every error class."""

import importlib
import importlib.util
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import graphsplit
import graphsplit.errors

ROOT = Path(__file__).resolve().parent.parent


def _error_classes(module):
    return {
        name
        for name, value in vars(module).items()
        if inspect.isclass(value)
        and issubclass(value, BaseException)
        and value.__module__ == module.__name__
    }


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="mkdocs not installed")
def test_mkdocs_build_strict(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "index.html").is_file()
    assert (tmp_path / "troubleshooting" / "index.html").is_file()
    api = (tmp_path / "api" / "index.html").read_text()
    assert ":::" not in api  # every marker was expanded by docs/hooks/api_reference.py
    for name in ("split", "verify", "cache", "CachedDataset", "register_codec"):
        first_line = inspect.getdoc(getattr(graphsplit, name)).splitlines()[0]
        assert first_line.split("(")[0].split("``")[0][:40] in api, name


def test_troubleshooting_lists_every_error_class():
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    names = _error_classes(graphsplit.errors)
    for module_name in ("graphsplit.errors", "graphsplit.tools.spec"):
        if importlib.util.find_spec(module_name) is not None:
            names |= _error_classes(importlib.import_module(module_name))
    assert {"GraphsplitError", "TraceError", "SplitError"} <= names
    missing = sorted(name for name in names if f"## {name}" not in text)
    assert not missing, f"docs/troubleshooting.md has no section for {missing}"


def test_api_reference_covers_the_public_names():
    text = (ROOT / "docs" / "api.md").read_text()
    missing = [name for name in graphsplit.__all__ if name not in text]
    assert not missing, f"docs/api.md does not document {missing}"


# -- every Python snippet in README and docs/ runs ------------------------------------------------
# A page's snippets run in order in one namespace, as a reader would paste them. Hidden
# ``<!-- doctest-setup ... -->`` comments before a snippet supply what the page assumes exists
# (tiny real models from tests/docs_fixtures.py); ``<!-- doctest-check ... -->`` after one checks
# what it built. Nothing is skipped: a snippet that stops working fails the suite.
_BLOCK = re.compile(
    r"<!-- doctest-(?P<kind>setup|check)[^\n]*\n(?P<hidden>.*?)-->|```python\n(?P<code>.*?)```",
    re.DOTALL,
)
_PAGES = sorted(
    path.relative_to(ROOT).as_posix()
    for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    if "```python" in path.read_text()
)


def _snippets(page: str) -> list[tuple[str, str]]:
    """``(kind, code)`` in page order; kind is "setup", "check" or "snippet"."""
    return [
        (match["kind"], match["hidden"]) if match["kind"] else ("snippet", match["code"])
        for match in _BLOCK.finditer((ROOT / page).read_text())
    ]


def test_pages_with_snippets_are_found():
    assert {"README.md", "docs/index.md", "docs/howto.md"} <= set(_PAGES)


@pytest.mark.parametrize("page", _PAGES)
def test_every_snippet_runs(page, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # snippets write "cache/" and the like into the current folder
    torch.manual_seed(0)
    namespace: dict[str, object] = {"__name__": f"docs_snippets_{Path(page).stem}"}
    ran = 0
    for index, (kind, code) in enumerate(_snippets(page)):
        try:
            exec(compile(code, f"{page} block {index} ({kind})", "exec"), namespace)
        except Exception as error:
            pytest.fail(f"{page}: {kind} block {index} raised {type(error).__name__}: {error}")
        ran += kind == "snippet"
    assert ran == (ROOT / page).read_text().count("```python")
