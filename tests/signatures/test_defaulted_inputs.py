"""Step inputs whose parameter defaults (``original_sizes=None``, FLUX's ``prompts=None``):
``cache()`` reads from a batch what the split was made with, and a batch that would make the
split compute something else than ``step(**batch)`` is refused by name, before any stage 1."""

from __future__ import annotations

import pytest
import torch

import graphsplit
from graphsplit.errors import CacheError


class Step(torch.nn.Module):
    """A frozen encoder and a trainable head; ``shift`` (default None) is added when given."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = torch.nn.Linear(4, 4).requires_grad_(False)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, x, y, shift=None):
        h = self.encoder(x)
        if shift is not None:
            h = h + shift
        return torch.nn.functional.mse_loss(self.head(h), y)


def _batches(count: int, *, shift: bool = False) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        batch = {
            "x": torch.randn(2, 4, generator=generator),
            "y": torch.randn(2, 1, generator=generator),
        }
        if shift:
            batch["shift"] = torch.randn(2, 4, generator=generator)
        out.append(batch)
    return out


def test_an_input_left_at_its_default_is_not_asked_of_the_batches(tmp_path):
    step = Step()
    batches = _batches(3)
    split = graphsplit.split(step, kwargs=batches[0])
    info = graphsplit.cache(split, batches, tmp_path / "c", progress=False)
    assert info.num_samples == 6
    cached = graphsplit.CachedDataset(tmp_path / "c", split)
    assert cached.manifest.header.inputs == ("x", "y")
    for batch, got in zip(batches, cached.loader(batch_size=2, shuffle=False), strict=True):
        assert torch.equal(split.stage2(**got), step(**batch))


def test_a_batch_carrying_none_for_a_defaulted_input_is_cached_as_without_it(tmp_path):
    step = Step()
    batches = _batches(2)
    split = graphsplit.split(step, kwargs=batches[0])
    with_none = [{**batch, "shift": None} for batch in batches]
    assert graphsplit.cache(split, with_none, tmp_path / "c", progress=False).num_samples == 4


def test_a_batch_giving_a_value_the_split_took_as_default_is_refused(tmp_path):
    step = Step()
    split = graphsplit.split(step, kwargs=_batches(1)[0])
    with pytest.raises(CacheError) as caught:
        graphsplit.cache(split, _batches(2, shift=True), tmp_path / "c", progress=False)
    message = str(caught.value)
    assert "the batch carries 'shift'" in message
    assert "took the default shift=None" in message
    assert "pass 'shift' in graphsplit.split's example too" in message
    assert not list((tmp_path / "c").glob("*.safetensors"))


def test_a_batch_lacking_an_input_the_split_was_made_with_is_refused(tmp_path):
    step = Step()
    split = graphsplit.split(step, kwargs=_batches(1, shift=True)[0])
    with pytest.raises(CacheError) as caught:
        graphsplit.cache(split, _batches(2), tmp_path / "c", progress=False)
    message = str(caught.value)
    assert "the batch lacks 'shift', which graphsplit.split's example gave" in message
    assert "return 'shift' from the dataset" in message
    assert "split from an example without 'shift'" in message


def test_an_input_without_default_missing_from_the_batch_is_refused_as_before(tmp_path):
    step = Step()
    split = graphsplit.split(step, kwargs=_batches(1)[0])
    lacking_y = [{"x": batch["x"]} for batch in _batches(2)]
    with pytest.raises(CacheError, match=r"the loader's batches lack \['y'\]"):
        graphsplit.cache(split, lacking_y, tmp_path / "c", progress=False)
