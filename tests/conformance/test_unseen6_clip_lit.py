"""Conformance: LiT-style contrastive tuning (locked image, trained text) of a dual encoder.

transformers' ``examples/pytorch/contrastive-image-text/run_clip.py`` with
``--freeze_vision_model``: a ``VisionTextDualEncoderModel`` (a CLIP vision tower and a BERT text
tower, as the example's README builds it), ``_freeze_params(model.vision_model)`` and everything
else trained (the text tower, both projections, ``logit_scale``). The model is in train mode as
``Trainer`` leaves it (BERT's dropout is live, in the trained text tower). The batch is the
script's ``collate_fn`` output, ``return_loss: True`` included, and the step is ``Trainer.
compute_loss``'s body (``model(**inputs)``, the loss taken from the output). A second form calls
the model with its keywords, ``model(input_ids=..., pixel_values=..., attention_mask=...,
return_loss=True).loss``, on a batch of the three tensors.

The CLIP loss is over the whole batch (every caption against every image): stage 1 must stay
per sample and the contrast must be computed in stage 2.

What must hold: the step splits exactly (loss and every trainable gradient bit for bit, on the
example and on a batch of another size), the frozen vision tower's pooled output is in the
boundary and its weights are not held by stage 2, and a cache written through the disk (the
collated ``return_loss`` included) trains stage 2 exactly.

Tiny configs: CLIP vision 32 wide, 2 layers, 16 px in 4 px patches; BERT 32 wide, 2 layers,
64 tokens; projection 16.
"""

from __future__ import annotations

import pytest
import torch

import graphsplit
from tests.helpers import assert_stage1_holds_no_trainable

transformers = pytest.importorskip("transformers")

from tests.conformance.unseen2_data_checks import assert_cache_round_trip  # noqa: E402

VOCAB = 64
WIDTH = 32
IMAGE = 16
TOKENS = 7


def _freeze_params(module):
    """The script's, verbatim."""
    for param in module.parameters():
        param.requires_grad = False


def _model():
    vision = transformers.CLIPVisionConfig(
        hidden_size=WIDTH,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE,
        patch_size=4,
    )
    text = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=32,
    )
    config = transformers.VisionTextDualEncoderConfig.from_vision_text_configs(
        vision, text, projection_dim=16
    )
    torch.manual_seed(0)
    model = transformers.VisionTextDualEncoderModel(config)
    model.train()
    _freeze_params(model.vision_model)
    return model


def build(form: str):
    model = _model()

    if form == "trainer":

        def training_step(inputs):
            # Trainer.compute_loss
            outputs = model(**inputs)
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
            return loss

    else:

        def training_step(batch):
            loss = model(
                input_ids=batch["input_ids"],
                pixel_values=batch["pixel_values"],
                attention_mask=batch["attention_mask"],
                return_loss=True,
            ).loss
            return loss

    params = [p for p in model.parameters() if p.requires_grad]
    return model, training_step, params


def collate_fn(examples):
    """The script's, verbatim."""
    pixel_values = torch.stack([example["pixel_values"] for example in examples])
    input_ids = torch.tensor([example["input_ids"] for example in examples], dtype=torch.long)
    attention_mask = torch.tensor(
        [example["attention_mask"] for example in examples], dtype=torch.long
    )
    return {
        "pixel_values": pixel_values,
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "return_loss": True,
    }


def _example(index: int) -> dict:
    """``transform_images`` / ``tokenize_captions``' sample: a normalised image, the caption's
    ids padded to ``max_seq_length`` and its mask (lists, as ``datasets`` stores them)."""
    generator = torch.Generator().manual_seed(900 + index)
    length = 3 + index % (TOKENS - 3)
    ids = torch.randint(1, VOCAB, (length,), generator=generator).tolist()
    return {
        "pixel_values": torch.randn(3, IMAGE, IMAGE, generator=generator),
        "input_ids": ids + [0] * (TOKENS - length),
        "attention_mask": [1] * length + [0] * (TOKENS - length),
    }


def _batch(form: str, indices) -> dict:
    batch = collate_fn([_example(i) for i in indices])
    if form != "trainer":
        del batch["return_loss"]
    return batch


_BUILT: dict[str, tuple] = {}


def _built(form: str):
    if form not in _BUILT:
        model, step, params = build(form)
        split = graphsplit.split(step, (_batch(form, [0, 1]),))
        _BUILT[form] = (model, step, params, split)
    return _BUILT[form]


FORMS = ["trainer", "keywords"]


@pytest.mark.parametrize("form", FORMS)
def test_lit_step_verifies_on_the_example_and_another_size(form):
    _, step, _params, split = _built(form)
    assert_stage1_holds_no_trainable(split)
    for seed, batch in enumerate([_batch(form, [0, 1]), _batch(form, [2, 3, 4])]):
        checks = graphsplit.verify(step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


@pytest.mark.parametrize("form", FORMS)
def test_lit_caches_the_locked_vision_tower(form):
    model, _step, _params, split = _built(form)
    assert split.path == "trace"
    held = {name for name, _ in split.stage2.named_parameters()}
    assert not any(".vision_model." in f".{name}" for name in held), sorted(held)[:5]
    trainable = {n for n, p in split.stage2.named_parameters() if p.requires_grad}
    expected = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {name.split(".", 1)[1] for name in trainable} == expected
    assert len(trainable) == len(held)  # stage 2 holds no frozen weight
    # The vision tower's pooled [CLS] state (``vision_outputs[1]``; the trained
    # ``visual_projection`` runs in stage 2), and the ids and mask the text tower reads.
    # Neither the pixels nor ``return_loss`` (a constant) cross.
    per_sample = {key: spec.shape[1:] for key, spec in split.boundary.items()}
    assert per_sample == {
        "model_vision_model_1": (WIDTH,),
        "input_ids": (TOKENS,),
        "attention_mask": (TOKENS,),
    }


@pytest.mark.parametrize("form", FORMS)
def test_lit_cache_round_trip(form, tmp_path):
    _, step, params, split = _built(form)
    loader = [_batch(form, [5, 6]), _batch(form, [7, 8, 9]), _batch(form, [10])]
    assert_cache_round_trip(split, step, loader, tmp_path / "cache", params)
