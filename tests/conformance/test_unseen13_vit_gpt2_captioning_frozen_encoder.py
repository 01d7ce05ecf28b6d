"""Conformance: image captioning, a ``VisionEncoderDecoderModel`` (ViT -> GPT-2), encoder frozen.

Upstream: huggingface/transformers ``docs/source/en/model_doc/vision-encoder-decoder.md``,
section "Training": the image processor's ``pixel_values``, the tokenizer's ``input_ids`` as
``labels``, ``model.config.decoder_start_token_id`` / ``pad_token_id`` set from the tokenizer,
and the step::

    # the forward function automatically creates the correct decoder_input_ids
    loss = model(pixel_values=pixel_values, labels=labels).loss

run in a loop over batches of (image, caption) pairs, the captions padded to the batch's
longest and the padding set to -100 as ``run_summarization.py`` does for labels (the model
shifts the labels into ``decoder_input_ids``, putting ``pad_token_id`` back for -100). The
encoder is frozen the way captioning fine-tunes on a small dataset do it
(``for param in model.encoder.parameters(): param.requires_grad = False``); the GPT-2 decoder,
its new cross-attention and the ``enc_to_dec_proj`` (ViT 32 wide, GPT-2 48 wide) train, in
train mode with GPT-2's default dropout (0.1), so random draws stay in stage 2.

What must hold: the step splits exactly (loss and every trainable gradient bit for bit, on the
example and on a batch of another size, under the dropout's draws), the frozen ViT's last
hidden state is the boundary's image part (no pixel is stored, no encoder weight is held by
stage 2), and a cache written through the disk from the script's ``DataLoader`` (a
``collate_fn`` that runs the image processor and the tokenizer) trains stage 2 exactly.

Tiny configs: ViT 32 wide, 2 layers, 16 px in 4 px patches; GPT-2 48 wide, 2 layers, 2 heads; a
word-level tokenizer.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import graphsplit
from tests.conformance.unseen2_data_checks import assert_cache_round_trip
from tests.conformance.unseen_checks import word_tokenizer
from tests.helpers import assert_stage1_holds_no_trainable

transformers = pytest.importorskip("transformers")

WORDS = ["a", "cat", "dog", "on", "the", "couch", "two", "sitting", "grass", "red", "ball"]
IMAGE = 16


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


tokenizer = word_tokenizer(WORDS)
# The PIL backend, named: torchvision may be a stand-in (examples/diffsynth/diffsynth_import.py).
image_processor = transformers.ViTImageProcessorPil(size={"height": IMAGE, "width": IMAGE})


def _model():
    torch.manual_seed(0)
    config_encoder = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=IMAGE,
        patch_size=4,
    )
    config_decoder = transformers.GPT2Config(
        vocab_size=len(tokenizer),
        n_embd=48,
        n_layer=2,
        n_head=2,
        n_positions=32,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    config = transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(
        config_encoder, config_decoder
    )
    model = transformers.VisionEncoderDecoderModel(config=config)
    model.config.decoder_start_token_id = tokenizer.eos_token_id  # GPT-2's bos is its eos
    model.config.pad_token_id = tokenizer.pad_token_id
    for param in model.encoder.parameters():
        param.requires_grad = False
    model.train()
    return model


model = _model()
params = [p for p in model.parameters() if p.requires_grad]


def training_step(batch):
    pixel_values, labels = batch["pixel_values"], batch["labels"]
    # the forward function automatically creates the correct decoder_input_ids
    loss = model(pixel_values=pixel_values, labels=labels).loss
    return loss


# -- the data: PIL images and captions, a collate_fn running the processor and the tokenizer ----
def _pairs(count: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    pairs = []
    for index in range(count):
        pixels = rng.integers(0, 256, (24 + 4 * (index % 3), 20, 3), dtype=np.uint8)
        caption = " ".join(rng.choice(WORDS, size=3 + (index + seed) % 4))
        pairs.append({"image": Image.fromarray(pixels), "caption": caption})
    return pairs


def collate_fn(examples):
    pixel_values = image_processor(
        [example["image"] for example in examples], return_tensors="pt"
    ).pixel_values
    labels = tokenizer(
        [example["caption"] for example in examples], padding=True, return_tensors="pt"
    ).input_ids
    labels[labels == tokenizer.pad_token_id] = -100
    return {"pixel_values": pixel_values, "labels": labels}


def _batch(size: int, seed: int = 0) -> dict:
    return collate_fn(_pairs(size, seed))


_SPLIT: list = []


def _split():
    if not _SPLIT:
        _SPLIT.append(graphsplit.split(training_step, (_batch(2),)))
    return _SPLIT[0]


# -- tests ---------------------------------------------------------------------------------------
def test_captioning_step_verifies_on_the_example_and_another_size():
    split = _split()
    assert_stage1_holds_no_trainable(split)
    for seed, batch in enumerate([_batch(2), _batch(3, seed=1)]):
        assert (batch["labels"] == -100).any()  # padded captions in both
        checks = graphsplit.verify(training_step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


def test_the_frozen_vit_is_cached_and_not_held_by_stage_2():
    split = _split()
    held = {name for name, _ in split.stage2.named_parameters()}
    assert not [name for name in held if "encoder" in name and "enc_to_dec" not in name], held
    trainable = {n for n, p in split.stage2.named_parameters() if p.requires_grad}
    assert {name.split(".", 1)[1] for name in trainable} == {
        n for n, p in model.named_parameters() if p.requires_grad
    }
    per_sample = {key: (spec.shape[1:], spec.dtype) for key, spec in split.boundary.items()}
    assert "batch_pixel_values" not in per_sample and "pixel_values" not in per_sample
    # ViT's last hidden state: 16 patches and [CLS], 32 wide.
    assert ((17, 32), torch.float32) in per_sample.values(), per_sample


def test_captioning_cache_round_trip(tmp_path):
    split = _split()
    loader = torch.utils.data.DataLoader(_pairs(7, seed=5), batch_size=3, collate_fn=collate_fn)
    assert_cache_round_trip(split, training_step, loader, tmp_path / "cache", params)
