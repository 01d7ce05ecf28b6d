"""Conformance: LiT tuning of a ``SiglipModel`` (image tower locked, text trained), sigmoid loss.

Upstream: transformers' ``examples/pytorch/contrastive-image-text/run_clip.py`` (it loads any
``AutoModel`` dual encoder; a SigLIP checkpoint gives ``SiglipModel``) with
``--freeze_vision_model``: ``_freeze_params(model.vision_model)`` (the script's, verbatim); the
text tower, its head, ``logit_scale`` and ``logit_bias`` train. ``tokenize_captions`` and
``collate_fn`` are the script's, verbatim (captions padded to ``max_seq_length``, the batch
dict with ``"return_loss": True``), the images prepared by SigLIP's own image processor
(``SiglipImageProcessorPil``) from PIL images of several sizes. The loss is transformers'
``SiglipModel`` sigmoid loss (``modeling_siglip.py``, adapted from big_vision's
``siglip.py``: ``eye``, ``m1_diag1``, ``logsigmoid``, ``-sum(dim=-1).mean()``), over the whole
batch, so stage 1 must stay per sample and every pair is scored in stage 2.

Two forms of the step:

- ``trainer``: ``Trainer.compute_loss``'s body, ``model(**inputs)`` and ``outputs["loss"]``;
- ``loop``: a LiT loop that calls the model without ``return_loss`` and computes the sigmoid
  loss itself from ``logits_per_text``, the lines copied from ``SiglipModel.forward``.

Variable token lengths: two runs of ``tokenize_captions`` with ``--max_seq_length`` 8 and 12
(the plan is made at 8); one cache holds both lengths, and the text tower must see each.

What must hold: split with the default path, verify bit for bit at batch 2 and 3 and at the
other token length, stage 2 holds no vision-tower weight (the tower's pooled output crosses),
and a cache written through the disk, both token lengths in it, trains stage 2 exactly.

Tiny config: SigLIP vision 32 wide, 2 layers, 16 px in 4 px patches (attention-pooling head);
text 32 wide, 2 layers, 16 positions.
"""

from __future__ import annotations

import pytest
import torch

import graphsplit
from tests.helpers import assert_stage1_holds_no_trainable, param_names

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

from tests.conformance.unseen2_data_checks import assert_cache_round_trip  # noqa: E402
from tests.conformance.unseen3_vlm_checks import images, tiny_tokenizer  # noqa: E402

IMAGE = 16
CAPTIONS = [
    "a red cat sat on the mat",
    "two big dogs",
    "a small blue picture of a dog and a cat",
    "one green cat",
    "the dog sat on a big red mat and the cat sat on it",
    "what is this",
]
SIZES = [(20, 24), (16, 16), (32, 18), (24, 40), (17, 23), (40, 40)]


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


tokenizer = tiny_tokenizer([])
image_processor = transformers.SiglipImageProcessorPil(size={"height": IMAGE, "width": IMAGE})


def _freeze_params(module):
    """The script's, verbatim."""
    for param in module.parameters():
        param.requires_grad = False


def _model():
    torch.manual_seed(0)
    config = transformers.SiglipConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "max_position_embeddings": 16,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": IMAGE,
            "patch_size": 4,
        },
    )
    model = transformers.SiglipModel(config)
    model.train()  # as Trainer leaves it
    _freeze_params(model.vision_model)
    return model


def tokenize_captions(examples, max_seq_length):
    """The script's, verbatim (``caption_column`` "caption", ``data_args.max_seq_length`` an
    argument)."""
    captions = [caption for caption in examples["caption"]]
    text_inputs = tokenizer(captions, max_length=max_seq_length, padding="max_length", truncation=True)  # fmt: skip # noqa: E501
    examples["input_ids"] = text_inputs.input_ids
    examples["attention_mask"] = text_inputs.attention_mask
    return examples


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


def _dataset(max_seq_length: int, seed: int = 0) -> list[dict]:
    """The mapped dataset's rows: ``tokenize_captions`` run batched over the captions, the
    images transformed on the fly (SigLIP's processor resizes every size to 16 px)."""
    columns = tokenize_captions({"caption": list(CAPTIONS)}, max_seq_length)
    pixels = image_processor(images(SIZES, seed=seed), return_tensors="pt")["pixel_values"]
    return [
        {
            "pixel_values": pixels[row],
            "input_ids": columns["input_ids"][row],
            "attention_mask": columns["attention_mask"][row],
        }
        for row in range(len(CAPTIONS))
    ]


SHORT, LONG = _dataset(8), _dataset(12, seed=1)


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
            outputs = model(
                input_ids=batch["input_ids"],
                pixel_values=batch["pixel_values"],
                attention_mask=batch["attention_mask"],
            )
            logits_per_text = outputs.logits_per_text
            # SiglipModel.forward's loss, verbatim
            eye = torch.eye(logits_per_text.size(0), device=logits_per_text.device)
            m1_diag1 = -torch.ones_like(logits_per_text) + 2 * eye
            loglik = torch.nn.functional.logsigmoid(m1_diag1 * logits_per_text)
            nll = -torch.sum(loglik, dim=-1)
            loss = nll.mean()
            return loss

    params = [p for p in model.parameters() if p.requires_grad]
    return model, training_step, params


FORMS = ["trainer", "loop"]
_BUILT: dict[str, tuple] = {}


def _built(form: str):
    if form not in _BUILT:
        model, step, params = build(form)
        split = graphsplit.split(step, (collate_fn(SHORT[:2]),))
        _BUILT[form] = (model, step, params, split)
    return _BUILT[form]


def test_the_loss_is_the_sigmoid_loss_of_the_model():
    model, trainer_step, _ = build("trainer")
    _, loop_step, _ = build("loop")
    batch = collate_fn(SHORT[:3])
    torch.manual_seed(0)
    assert torch.equal(trainer_step(batch), loop_step(batch))
    assert {n for n, p in model.named_parameters() if p.requires_grad} >= {
        "logit_scale",
        "logit_bias",
    }


@pytest.mark.parametrize("form", FORMS)
def test_lit_step_verifies_at_other_sizes_and_token_lengths(form):
    _, step, _params, split = _built(form)
    assert split.path == "trace"
    assert_stage1_holds_no_trainable(split)
    batches = [collate_fn(SHORT[:2]), collate_fn(SHORT[2:5]), collate_fn(LONG[:2])]
    batches.append(collate_fn(LONG[3:6]))
    for seed, batch in enumerate(batches):
        checks = graphsplit.verify(step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


@pytest.mark.parametrize("form", FORMS)
def test_lit_caches_the_locked_image_tower(form):
    model, _step, _params, split = _built(form)
    held = param_names(split.stage2, split._model)
    tower = {name for name in param_names(split._model, split._model) if ".vision_model." in name}
    assert tower and not held & tower, sorted(held & tower)[:4]
    trainable = {n for n, p in split.stage2.named_parameters() if p.requires_grad}
    expected = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {name.split(".", 1)[1] for name in trainable} == expected
    specs = dict(split.boundary)
    assert "pixel_values" not in specs
    texts = {key: specs.pop(key) for key in ("input_ids", "attention_mask")}
    assert {key: (spec.shape[1:], spec.batch_dim) for key, spec in texts.items()} == {
        "input_ids": ((8,), 0),
        "attention_mask": ((8,), 0),
    }
    # The tower's normalised pooled output as the logits' matmul reads it, transposed
    # (``image_embeds.t()``, modeling_siglip.py): 32 floats a sample along dim 1.
    ((name, spec),) = specs.items()
    assert (spec.batch_dim, spec.shape[0], spec.bytes_per_sample) == (1, 32, 128), name
    assert "modeling_siglip.py" in split.report()


@pytest.mark.parametrize("form", FORMS)
def test_lit_cache_of_two_token_lengths_round_trip(form, tmp_path):
    _, step, params, split = _built(form)
    loader = [collate_fn(SHORT[:2]), collate_fn(LONG[2:5]), collate_fn(SHORT[4:6])]
    cached = assert_cache_round_trip(split, step, loader, tmp_path / "cache", params)
    lengths = sorted(cached[row]["input_ids"].shape[-1] for row in range(len(cached)))
    assert lengths == [8, 8, 8, 8, 12, 12, 12]
    assert len(cached.buckets()) == 2
