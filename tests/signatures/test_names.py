"""A plan's signature in a few words: the report, the picture and errors name each plan by the
checks that tell the plans apart, with the example's input sizes; plan.json keeps the whole
signature. Built on the size-branch step and on a signature as DiffSynth's Wan step makes it
(eight checks, some of them expressions of a hundred characters)."""

from __future__ import annotations

import json

import torch

import graphsplit
from graphsplit.signatures.names import short_name
from graphsplit.signatures.signature import Signature, example_record
from graphsplit.tools.picture_page import to_html
from tests.signatures.test_dispatch import _batch, _model

LONG = (
    "(((1 - _tensor_constant1[argmin]) * pipe_vae.encode(to_1).to()) + (_tensor_constant1"
    "[argmin] * (randn_like * 1.0))).shape[0] != pipe_dit_text_embedding.shape[0]"
)
WAN = "/site-packages/diffsynth/pipelines/wan_video.py"


def _wan(frames: int) -> Signature:
    values = {
        LONG: "false",
        "((video.shape[2] - 1) // 4) + 1": str((frames - 1) // 4 + 1),
        "(video.shape[3] % 16) != 0": "false",
        "video.shape[3] // 8": "4",
        "((((video.shape[3] // 8) * (video.shape[4] // 8)) * 2) // 4) * 3": "24",
    }
    lines = {
        LONG: f"{WAN}:1587  if x.shape[0] != context.shape[0]:",
        "((video.shape[2] - 1) // 4) + 1": f"{WAN}:402  length = (num_frames - 1) // 4 + 1",
    }
    return Signature(tuple(sorted(values.items())), tuple(sorted(lines.items())))


def _example(frames: int) -> str:
    record = example_record((), {"video": torch.zeros(1, 3, frames, 32, 48)})
    assert record is not None
    return record


def test_a_plan_is_named_by_the_checks_that_vary_with_the_input_sizes_they_read():
    varying = {"((video.shape[2] - 1) // 4) + 1"}
    assert short_name(_wan(9), varying, _example(9)) == (
        "((video.shape[2] - 1) // 4) + 1 = 3 (video.shape[2]=9)"
    )


def test_with_nothing_varying_every_check_is_shortened():
    name = short_name(_wan(5), None, _example(5))
    assert name.split(", ") == [
        "video.shape[3]=32",  # the sorted checks' first, a long product of two input sizes
        "video.shape[4]=48: 24",
        "the check at wan_video.py:1587 (if x.shape[0] != context.shape[0]:) = false",
        "((video.shape[2] - 1) // 4) + 1 = 2 (video.shape[2]=5)",
        "(video.shape[3] % 16) != 0 = false (video.shape[3]=32)",
        "video.shape[3] // 8 = 4 (video.shape[3]=32)",
    ]
    assert LONG not in name


def test_a_value_read_off_frozen_data_is_named_by_the_variable_its_line_assigns():
    what = "the value read at pipeline.py:88 (tolist)"
    line = "/x/qwen_image.py:88      txt_seq_lens = prompt_emb_mask.sum(dim=1).tolist()"
    signature = Signature(((what, "[187]"),), ((what, line),), reads_values=True)
    assert short_name(signature) == "txt_seq_lens=[187]"
    bare = Signature(((what, "[9]"),), ((what, "/x/q.py:9  f(mask.tolist())"),), True)
    assert short_name(bare) == "the value read at q.py:9 = [9]"
    assert short_name(Signature(())) == "(no size checks)"


def test_the_report_picture_errors_and_plan_json_use_the_names(tmp_path):
    model = _model()
    split = graphsplit.split(model, kwargs=_batch(16, 2, 0))
    split.stage1(**_batch(24, 2, 1))
    first, second = split.plans
    report = split.report()
    assert f"  {first.key} (the first plan): (encoder.shape[-1] % 16) != 0 = false\n" in report
    assert f"  {second.key}: (encoder.shape[-1] % 16) != 0 = true\n" in report
    assert "  checked values that differ between the plans, read at:\n" in report
    assert "    (encoder.shape[-1] % 16) != 0  " in report
    assert "if h.shape[-1] % 16 != 0:" in report
    entries = json.loads(json.dumps(split.to_json()))["signatures"]
    assert [entry["name"] for entry in entries] == [
        "(encoder.shape[-1] % 16) != 0 = false",
        "(encoder.shape[-1] % 16) != 0 = true",
    ]
    assert entries[0]["checks"][0]["what"] == "(encoder.shape[-1] % 16) != 0"  # the whole one
    page = to_html(split)
    assert f"<td>{second.key}</td><td>(encoder.shape[-1] % 16) != 0 = true</td>" in page
