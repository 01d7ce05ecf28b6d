"""The field-bytes benchmark: the module-level path's cached bytes per sample, by case."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_field_bytes

pytestmark = pytest.mark.slow


def test_the_benchmark_counts_the_stored_fields_and_those_left_out(tmp_path):
    argv = ["--quick", "--out", str(tmp_path)]
    assert bench_field_bytes.main(argv) == 0
    (result,) = json.loads((tmp_path / "field_bytes.json").read_text())["results"]
    current = result["current"]
    assert result["baseline"] is None
    # CLIP-L's hidden_states[-2]; CLIP-G's text_embeds and hidden_states[-2]: 7 tokens, 16 wide
    assert current["output_tensors"] == 3
    assert current["output_bytes_per_sample"] == (7 * 16 + 16 + 7 * 16) * 4
    # the other 4 hidden states and last hidden state of each, and CLIP-L's pooled output
    assert current["not_stored_bytes_per_sample"] == (2 * 4 * 7 * 16 + 16) * 4
    assert "| clip-tiny | - |" in (tmp_path / "field_bytes.md").read_text()
