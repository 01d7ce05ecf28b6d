"""Frozen calls taking k rows a sample on the module-level path (graphsplit/calls/row_folds).

Video steps encode ``rearrange(frames, "b f c h w -> (b f) c h w")`` (SVD-Xtend, AnimateDiff),
preference steps ``torch.cat(pixel_values.chunk(2, dim=1))`` (Diffusion-DPO): the call's rows
are the batch's samples k at a time, grouped or strided. Such a call used to be judged "not per
sample" and kept in stage 2. Now it is cached one sample's k rows an entry, when the probes
show which order its rows follow, and refused when they cannot.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphsplit
from graphsplit.calls.row_folds import RowFold, candidates
from graphsplit.calls.verdicts import Verdict
from tests.conformance.unseen_checks import assert_cache_round_trip
from tests.helpers import batch

FRAMES = 3


class Frames(nn.Module):
    """A clip's frames folded onto the batch before a frozen conv, as SVD-Xtend encodes them;
    ``channels_last`` makes the conv's output channels-last, whose strides ``randn_like``
    follows (stage 2 must answer with the same strides)."""

    def __init__(self, channels_last: bool = False) -> None:
        super().__init__()
        self.channels_last = channels_last
        self.encoder = nn.Conv2d(3, 4, 3, padding=1).requires_grad_(False)
        self.head = nn.Conv2d(4, 4, 1)

    def forward(self, video):
        frames = video.flatten(0, 1)  # "b f c h w -> (b f) c h w"
        if self.channels_last:
            frames = frames.contiguous(memory_format=torch.channels_last)
        latents = self.encoder(frames)
        noisy = latents + torch.randn_like(latents)
        return (self.head(noisy) - latents).pow(2).mean()


class Pairs(nn.Module):
    """Two images a sample on the channels, folded as the Diffusion-DPO script folds them."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Conv2d(3, 4, 3, padding=1).requires_grad_(False)
        self.head = nn.Conv2d(4, 4, 1)

    def forward(self, pixel_values):
        feed = torch.cat(pixel_values.chunk(2, dim=1))
        latents = self.encoder(feed)
        winner, loser = self.head(latents).mean(dim=(1, 2, 3)).chunk(2)
        return -nn.functional.logsigmoid(winner - loser).mean()


class MixesFrames(Frames):
    """The frozen module normalizes over every row of the call: not per sample."""

    def forward(self, video):
        frames = video.flatten(0, 1)
        latents = self.encoder(frames - frames.mean(0))
        return self.head(latents).pow(2).mean()


def _clips(size: int, seed: int = 0) -> torch.Tensor:
    return batch(size, FRAMES, 3, 6, 6, seed=seed)


def _verdict(split, path: str):
    return next(v for v in split.plan.verdicts if v.path == path)


@pytest.mark.parametrize("channels_last", [False, True])
def test_frames_are_cached_a_clip_an_entry(tmp_path, channels_last):
    torch.manual_seed(0)
    step = Frames(channels_last)
    split = graphsplit.split(step, (_clips(2),), path="calls")
    verdict = _verdict(split, "encoder")
    assert verdict.cached and verdict.fold == RowFold(FRAMES, strided=False)
    assert f"{FRAMES} rows a sample, grouped" in verdict.line()
    spec = split.boundary["encoder__0__out"]
    assert spec.batch_dim == 0 and spec.shape == (2, FRAMES, 4, 6, 6)
    assert "video" not in split.boundary  # only the cached call computes with it
    assert not any(name.startswith("encoder.") for name, _ in split.stage2.named_parameters())
    for seed, clips in enumerate([_clips(2), _clips(3, seed=1)]):
        checks = graphsplit.verify(step, split, (clips,), seed=seed)
        assert checks and all(check.ok for check in checks)
    loader = [{"video": _clips(2, seed=2)}, {"video": _clips(2, seed=3)}]
    assert_cache_round_trip(
        split, step, loader, tmp_path, step, rows_per_batch=2, call=lambda f, b: f(b["video"])
    )


def test_a_channels_last_output_is_answered_with_its_strides():
    """The eager conv's output is channels-last; stage 2's answer has the very same strides,
    so ``randn_like`` fills it in the same order (without them the loss differs)."""
    torch.manual_seed(0)
    step = Frames(channels_last=True)
    clips = _clips(2)
    split = graphsplit.split(step, (clips,), path="calls")
    seen = []
    hook = step.encoder.register_forward_hook(lambda m, i, out: seen.append(out.stride()))
    step(clips)
    hook.remove()
    cached = split.stage1(clips)["encoder__0__out"]
    unfolded = RowFold(FRAMES, strided=False).unfold(cached)
    assert unfolded.stride() == seen[0]
    assert not unfolded.is_contiguous()  # channels-last, not plain


def test_pairs_are_cached_a_pair_an_entry(tmp_path):
    torch.manual_seed(0)
    step = Pairs()
    split = graphsplit.split(step, (batch(2, 6, 6, 6),), path="calls")
    verdict = _verdict(split, "encoder")
    assert verdict.cached and verdict.fold == RowFold(2, strided=True)
    assert split.boundary["encoder__0__out"].shape == (2, 2, 4, 6, 6)
    for seed, size in enumerate([2, 3, 1]):
        checks = graphsplit.verify(step, split, (batch(size, 6, 6, 6, seed=seed),), seed=seed)
        assert checks and all(check.ok for check in checks)
    loader = [{"pixel_values": batch(3, 6, 6, 6, seed=s)} for s in (4, 5)]
    assert_cache_round_trip(
        split,
        step,
        loader,
        tmp_path,
        step,
        rows_per_batch=3,
        call=lambda f, b: f(b["pixel_values"]),
    )


def test_a_call_mixing_the_samples_rows_stays_in_stage_2():
    torch.manual_seed(0)
    step = MixesFrames()
    with pytest.raises(graphsplit.SplitError) as info:
        graphsplit.split(step, (_clips(2),), path="calls")
    message = str(info.value)
    assert "encoder call 0" in message
    assert "rows (3 a sample) follow their samples in neither" in message
    assert "fix:" in message


def test_alike_samples_show_no_order():
    """Every frame of every sample the same: the rows match either order, so nothing is
    cached. (Distinct frames in alike samples still tell the orders apart.)"""
    torch.manual_seed(0)
    step = Frames()
    frame = batch(1, 1, 3, 6, 6)
    with pytest.raises(graphsplit.SplitError) as info:
        graphsplit.split(step, (frame.expand(2, FRAMES, 3, 6, 6).clone(),), path="calls")
    assert "follow their samples in either order on this example" in str(info.value)
    assert "split with distinct samples" in str(info.value)


class FixedBatch(Frames):
    """Binds the batch size as scripts bind ``args.train_batch_size``: it cannot run one
    sample alone, so the order is shown by the reordered runs (calls/reordered)."""

    def forward(self, video):
        if video.shape[0] != 2:
            raise ValueError("this step trains with batches of 2")
        frames = video.flatten(0, 1)
        return self.head(self.encoder(frames)).pow(2).mean()


def test_a_step_at_its_own_batch_size_shows_the_order_by_reordering():
    torch.manual_seed(0)
    step = FixedBatch()
    split = graphsplit.split(step, (_clips(2),), path="calls")
    verdict = _verdict(split, "encoder")
    assert verdict.cached and verdict.fold == RowFold(FRAMES, strided=False)
    checks = graphsplit.verify(step, split, (_clips(2, seed=7),))
    assert checks and all(check.ok for check in checks)


def test_candidates_need_every_input_and_output_at_k_times_the_batch():
    rows = torch.zeros(6, 2)
    assert candidates([rows], {"out": rows}, 2) == [RowFold(3, False), RowFold(3, True)]
    assert candidates([rows], {"out": torch.zeros(2, 2)}, 2) == []  # an output of B rows
    assert candidates([rows, torch.zeros(4, 2)], {"out": rows}, 2) == []  # two row counts
    assert candidates([torch.zeros(5, 2)], {"out": torch.zeros(5, 2)}, 2) == []  # not k * B
    assert candidates([rows], {"out": rows}, 1) == []  # one sample shows no order


@pytest.mark.parametrize("strided", [False, True])
def test_fold_and_unfold_are_inverse_views(strided):
    fold = RowFold(3, strided)
    tensor = torch.arange(2 * 3 * 4.0).reshape(6, 4)
    folded = fold.fold(tensor)
    assert folded.shape == (2, 3, 4)
    assert folded.data_ptr() == tensor.data_ptr()  # a view: the cache records its order
    rows = fold.rows((1,), 2)
    assert torch.equal(folded[1], tensor[rows])
    unfolded = fold.unfold(folded)
    assert torch.equal(unfolded, tensor) and unfolded.stride() == tensor.stride()


def test_verdict_names_the_order_when_not_cached_for_another_reason():
    """A folded call fed a random draw is judged on the draw first (the fold is never shown)."""

    class Noisy(Frames):
        def forward(self, video):
            frames = video.flatten(0, 1)
            return self.head(self.encoder(frames + torch.randn_like(frames))).pow(2).mean()

    torch.manual_seed(0)
    with pytest.raises(graphsplit.SplitError) as info:
        graphsplit.split(Noisy(), (_clips(2),), path="calls")
    assert Verdict.RANDOM_INPUT.why in str(info.value)
