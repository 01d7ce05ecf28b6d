"""Conformance: LLaVA's stage 1, projector pretraining (vision tower and language model frozen).

LLaVA's ``llava/train/train.py`` (haotian-liu/LLaVA) with ``--tune_mm_mlp_adapter True``::

    if model_args.tune_mm_mlp_adapter:
        model.requires_grad_(False)
        for p in model.get_model().mm_projector.parameters():
            p.requires_grad = True

here on transformers' ``LlavaForConditionalGeneration``, whose ``mm_projector`` is
``model.model.multi_modal_projector`` (LLaVA-1.5's defaults: ``vision_feature_layer=-2``, the
"default" strategy dropping CLS). ``LLaVATrainer`` is a ``transformers.Trainer``: its step is
``Trainer.compute_loss`` (no label smoother, no ``compute_loss_func``)::

    outputs = model(**inputs)
    loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]

Batches come from a ``LlavaProcessor`` (a ``CLIPImageProcessor`` resizing to 16 px, the
``<image>`` token expanded to the 16 patch features) through TRL's
``DataCollatorForVisionLanguageModeling`` (``SFTTrainer``'s VLM collator: ``BatchFeature`` of
``input_ids``, ``attention_mask``, ``pixel_values``, ``labels`` -100 on padding), captions in
LLaVA's "plain" pretraining form (``<image>\\n`` then the caption).

What must hold: the step splits exactly (loss and the projector's gradients bit for bit on the
example and on a batch of another size and length), the frozen CLIP tower's work is cached
(its selected hidden layer crosses; stage 2 holds none of its weights), the frozen language
model stays in stage 2 (it reads the trained projector's output), and a cache written through
the disk trains stage 2 exactly.

Tiny configs: CLIP 32 wide, 2 layers, 16 px in 4 px patches; Llama 32 wide, 2 layers;
a word-level tokenizer; random weights.
"""

from __future__ import annotations

import pytest
import torch

import graphsplit
from tests.conformance.unseen2_data_checks import assert_cache_round_trip
from tests.conformance.unseen3_vlm_checks import images, stage2_paths, tiny_tokenizer
from tests.helpers import assert_stage1_holds_no_trainable

transformers = pytest.importorskip("transformers")
trl_sft = pytest.importorskip("trl.trainer.sft_trainer")

CAPTIONS = [
    "<image>\na cat sat on the mat",
    "<image>\ntwo big dogs",
    "<image>\nthe red picture of a small dog on the mat",
    "<image>\none green cat",
]
PATCHES = 16  # (16 / 4) ** 2; CLS dropped


def _processor_and_collator():
    tokenizer = tiny_tokenizer(["<image>"])
    image_processor = transformers.CLIPImageProcessorPil(
        size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}
    )
    processor = transformers.LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=4,
        vision_feature_select_strategy="default",
        image_token="<image>",
        num_additional_image_tokens=1,
    )
    return processor, trl_sft.DataCollatorForVisionLanguageModeling(processor)


def _model(tokenizer) -> transformers.LlavaForConditionalGeneration:
    torch.manual_seed(0)
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=16,
            patch_size=4,
        ),
        text_config=transformers.LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=64,
            pad_token_id=tokenizer.pad_token_id,
        ),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        image_seq_length=PATCHES,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    model = transformers.LlavaForConditionalGeneration(config)
    # train.py, --tune_mm_mlp_adapter True
    model.requires_grad_(False)
    for p in model.model.multi_modal_projector.parameters():
        p.requires_grad = True
    model.train()
    return model


def build():
    processor, collator = _processor_and_collator()
    model = _model(processor.tokenizer)

    def compute_loss(inputs):  # Trainer.compute_loss, as LLaVATrainer inherits it
        outputs = model(**inputs)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
        return loss

    return model, compute_loss, collator


def _batch(collator, size: int, seed: int = 0):
    captions = CAPTIONS[seed % 4 :] + CAPTIONS[: seed % 4]
    shapes = [(20 + 4 * i, 24) for i in range(size)]  # resized and cropped to 16 px
    examples = [
        {"images": [image], "text": text}
        for image, text in zip(images(shapes, seed=seed), captions, strict=False)
    ]
    return collator(examples)


_BUILT: dict[str, tuple] = {}


def _built():
    if not _BUILT:
        model, step, collator = build()
        example = _batch(collator, 2)
        split = graphsplit.split(step, (example,))
        _BUILT["llava"] = (model, step, collator, example, split)
    return _BUILT["llava"]


def test_llava_pretraining_verifies_on_the_example_and_another_size():
    model, step, collator, example, split = _built()
    other = _batch(collator, 3, seed=1)
    assert other["input_ids"].shape[1] != example["input_ids"].shape[1]
    assert_stage1_holds_no_trainable(split)
    for seed, batch in enumerate([example, other]):
        checks = graphsplit.verify(step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]
    trainable = {n for n, p in split.stage2.named_parameters() if p.requires_grad}
    assert {name.split(".", 1)[1] for name in trainable} == {
        n for n, p in model.named_parameters() if p.requires_grad
    }


def test_llava_pretraining_caches_the_vision_tower():
    _model, _step, _collator, _example, split = _built()
    assert split.path == "trace"
    held = stage2_paths(split)
    assert not any("vision_tower" in path for path in held), sorted(held)
    assert {"model.model.multi_modal_projector", "model.model.language_model"} <= held
    # The tower's selected layer (-2, CLS dropped) crosses, one row of 16 patches per image.
    per_sample = {key: (spec.shape[1:], spec.dtype) for key, spec in split.boundary.items()}
    tower = [key for key, spec in split.boundary.items() if "modeling_llava.py" in spec.source]
    assert ((PATCHES, 32), torch.float32) in [per_sample[key] for key in tower]
    assert "pixel_values" not in split.boundary
    # Stage 2 calls the language model as a module on ``inputs_embeds``; the token lookup is
    # cached, but the module still holds its (unused) embedding table.
    assert "model.model.language_model.embed_tokens" in held


def test_llava_pretraining_cache_round_trip(tmp_path):
    """TRL's collator's ``BatchFeature`` batches (2, 3 and 1 examples, each padded to its own
    length) cached as they are, every sample once and in order, each batch trained exactly."""
    model, step, collator, _example, split = _built()
    loader = [_batch(collator, 2, seed=2), _batch(collator, 3, seed=3), _batch(collator, 1)]
    params = [p for p in model.parameters() if p.requires_grad]
    cached = assert_cache_round_trip(split, step, loader, tmp_path / "cache", params)
    assert len(cached) == 6
