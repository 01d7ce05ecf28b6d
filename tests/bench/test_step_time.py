"""Smoke test of the step-time benchmark: structure of its output, not its speed."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("diffusers")

from benchmarks import bench_step_time


def test_quick_run_reports_same_round_ratios_on_both_clocks(tmp_path):
    assert bench_step_time.main(["--quick", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "step_time.json").read_text())
    assert payload["environment"]["torch_threads"] == 1  # single-threaded by default
    (result,) = payload["results"]
    assert result["size"] == "tiny" and result["rounds"] == 2
    for clock in ("wall", "cpu"):
        timed = result["timings"][clock]
        assert set(timed) == {"unsplit", "graphsplit_stage2", "hand_written"}
        assert all(len(variant["seconds"]) == 2 for variant in timed.values())
        ratio = result[clock]["stage2_over_hand_written"]
        assert ratio["q1"] <= ratio["median"] <= ratio["q3"] and ratio["count"] == 2
        # The reported ratio is the median of the same-round ratios, not a ratio of medians.
        stage2, hand = timed["graphsplit_stage2"]["seconds"], timed["hand_written"]["seconds"]
        assert ratio["median"] == pytest.approx(sum(s / h for s, h in zip(stage2, hand)) / 2)
    markdown = (tmp_path / "step_time.md").read_text()
    assert "| tiny | 2 × 32 | wall |" in markdown and "| tiny | 2 × 32 | cpu |" in markdown


def test_stage2_and_the_hand_written_step_do_the_same_work():
    # The ratio the benchmark reports is only noise around 1.0 if both variants run the same
    # ATen ops on the same shapes (so the same allocations) and compute the same numbers.
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import graphsplit
    from benchmarks.hand_written import denoising_loss, example_batch, frozen_outputs
    from tests.zoo import build_sd_lora_step

    class Recorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[tuple] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            outputs = out if isinstance(out, (tuple, list)) else [out]
            shapes = [tuple(o.shape) for o in outputs if isinstance(o, torch.Tensor)]
            self.ops.append((str(func), shapes))
            return out

    step = build_sd_lora_step(seed=0, size="tiny")
    pixels, ids = example_batch("tiny")
    split = graphsplit.split(step, (pixels, ids))
    with torch.no_grad():
        boundary = split.stage1(pixels, ids)
    hand = frozen_outputs(step, pixels, ids)
    for key, name in (("vae_encode_latent_dist_parameters", "latent_parameters"),
                      ("text_encoder_0", "text_embedding")):  # fmt: skip
        assert boundary[key].stride() == hand[name].stride()
    scaling = step.vae.config.scaling_factor
    variants = {
        "stage2": lambda: split.stage2(**boundary),
        "hand_written": lambda: denoising_loss(
            step.unet, step.scheduler, **hand, scaling_factor=scaling
        ),
    }
    seen = {}
    for name, loss_of in variants.items():
        torch.manual_seed(0)
        step.zero_grad(set_to_none=True)
        recorder = Recorder()
        with recorder:
            loss = loss_of()
            loss.backward()
        grads = [p.grad.clone() for p in step.parameters() if p.grad is not None]
        seen[name] = (recorder.ops, loss.detach(), grads)
    (ops, loss, grads), (hand_ops, hand_loss, hand_grads) = seen.values()
    assert len(ops) > 100 and ops == hand_ops
    assert torch.equal(loss, hand_loss)
    assert len(grads) == len(hand_grads) > 0
    assert all(torch.equal(a, b) for a, b in zip(grads, hand_grads))
