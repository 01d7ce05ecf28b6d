"""Checks the unseen-diffusers conformance steps repeat: what stage 2 holds, a cache round trip.

``split_and_verify`` already feeds stage 1's outputs to stage 2 and compares loss and every
trainable gradient bit for bit; the round trip here goes further, through the disk: the
script's own loader is cached with ``graphsplit.cache``, read back with ``CachedDataset``, and
stage 2 on each cached batch must train exactly as the step on the loader's raw batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import graphsplit


def stage2_top_modules(split: Any) -> set[str]:
    """Top-level modules stage 2 holds: its frozen encoders, VAE or teacher must not be."""
    return {name.split(".")[0] for name, _ in split.stage2.named_modules() if name}


def loss_and_grads(
    run: Callable[[], torch.Tensor], params: Sequence[nn.Parameter], seed: int
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """The loss and a copy of every parameter's gradient (None where it got none) of one step
    under ``seed``; the gradients are cleared before and after."""
    for param in params:
        param.grad = None
    torch.manual_seed(seed)
    loss = run()
    loss.backward()
    grads = [None if param.grad is None else param.grad.clone() for param in params]
    for param in params:
        param.grad = None
    return loss.detach(), grads


def assert_cache_round_trip(
    split: Any,
    step: Callable[..., torch.Tensor],
    loader: Iterable[Any],
    folder: Path,
    trainable: nn.Module,
    *,
    rows_per_batch: int,
    as_iterable: bool = False,
    call: Callable[[Callable[..., torch.Tensor], Any], torch.Tensor] = lambda f, b: f(b),
) -> None:
    """Cache ``loader`` and check stage 2 on every cached batch against ``step`` on the raw one.

    ``rows_per_batch`` is how many cached rows one raw batch became (a prior-preservation batch
    of two examples is four rows), ``as_iterable`` passes the loader's batches to ``cache`` as a
    generator, numbered as they come. ``call(step, raw)`` runs the step on a raw batch.
    """
    graphsplit.cache(
        split, (batch for batch in loader) if as_iterable else loader, folder / "cache"
    )
    dataset = graphsplit.CachedDataset(folder / "cache", split)
    # Rows in the order they were written (``loader()`` groups the batches by shape).
    starts = range(0, len(dataset), rows_per_batch)
    cached = (
        graphsplit.collate([dataset[row] for row in range(start, start + rows_per_batch)])
        for start in starts
    )
    params = [param for param in trainable.parameters() if param.requires_grad]
    assert params
    compared = 0
    for seed, raw in enumerate(loader):
        expected_loss, expected = loss_and_grads(lambda raw=raw: call(step, raw), params, seed)
        batch = next(cached)
        loss, grads = loss_and_grads(lambda batch=batch: split.stage2(**batch), params, seed)
        assert torch.equal(loss, expected_loss), (loss, expected_loss)
        assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True))
        compared += 1
    assert compared >= 2
    assert next(cached, None) is None


def word_tokenizer(words: Iterable[str], *, eos: str | None = "</s>") -> Any:
    """A real ``PreTrainedTokenizerFast`` over a word-level vocabulary (no hub download).

    The scripts call their tokenizer on the batch's strings inside the step (``padding=
    "max_length"``, ``truncation=True``, ``return_tensors="pt"``); this one runs the same
    transformers code path. Id 0 is ``<pad>``, 1 is ``<unk>``, 2 is ``eos`` when given (appended
    to every text, as T5's tokenizer appends ``</s>``).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>"] + ([eos] if eos else [])
    vocab = {word: index for index, word in enumerate([*specials, *dict.fromkeys(words)])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    if eos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"$A {eos}", special_tokens=[(eos, vocab[eos])]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", unk_token="<unk>", eos_token=eos
    )
