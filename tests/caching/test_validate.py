"""Strict JSON to dataclasses and back, driven by the dataclasses' fields and rules."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from graphsplit.caching.format.records import JsonReader, json_field, json_names, to_json
from graphsplit.errors import ManifestError


@dataclass(frozen=True)
class Size:
    rows: int = json_field(minimum=1)
    dtype: torch.dtype


@dataclass(frozen=True)
class Entry:
    name: str = json_field(identifier=True)
    size: Size = json_field(inline=True)  # noqa: RUF009 (a dataclasses.field)
    kind: str | None = json_field(choices=("a", "b"))
    digest: str = json_field("sha", pattern=re.compile(r"[0-9a-f]{4}"), meaning="4 hex digits")
    shapes: tuple[tuple[int, ...], ...]
    errors: Mapping[str, float]
    hidden: tuple[str, ...] = json_field(stored=False, default=())


DOCUMENT = {
    "name": "latents",
    "rows": 2,
    "dtype": "bfloat16",
    "kind": None,
    "sha": "00ff",
    "shapes": [[4, 4], []],
    "errors": {"latents": 0.5},
}


def read(document):
    return JsonReader(Path("entry.json")).read(Entry, document)


def test_a_document_reads_into_its_dataclass_and_writes_back_unchanged():
    entry = read(DOCUMENT)
    assert entry == Entry(
        "latents", Size(2, torch.bfloat16), None, "00ff", ((4, 4), ()), {"latents": 0.5}
    )
    assert json_names(Entry) == tuple(DOCUMENT)
    assert to_json(entry) == DOCUMENT


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"name": "not a name"}, "name is 'not a name'; expected a Python identifier"),
        ({"rows": 0}, "rows is int 0; expected an integer >= 1"),
        ({"rows": True}, "rows is bool True; expected an integer >= 1"),
        ({"dtype": "object"}, "dtype names an unknown dtype 'object'"),
        ({"kind": "c"}, r"kind is 'c'; expected null or one of \('a', 'b'\)"),
        ({"sha": "00FF"}, "sha is '00FF', not 4 hex digits"),
        ({"shapes": [[4, "4"]]}, r"shapes\[0\]\[1\] is str '4'; expected an integer >= 0"),
        ({"errors": {"latents": float("inf")}}, "errors.latents is float inf; expected a finite"),
        ({"errors": []}, r"errors is list \[\]; expected an object"),
        ({"hidden": []}, r"the document has unexpected field\(s\) \['hidden'\]"),
        ({"size": 1}, r"has unexpected field\(s\) \['size'\]"),
    ],
)
def test_refusals_name_the_file_and_the_field(change, message):
    with pytest.raises(ManifestError, match=message) as caught:
        read({**DOCUMENT, **change})
    assert str(caught.value).startswith("entry.json is not a valid graphsplit cache file: ")
    assert "overwrite=True" in str(caught.value)


def test_a_missing_field_of_an_inline_record_is_named_at_the_top():
    document = {key: value for key, value in DOCUMENT.items() if key != "rows"}
    with pytest.raises(ManifestError, match=r"the document lacks the field\(s\) \['rows'\]"):
        read(document)
