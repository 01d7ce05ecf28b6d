"""Conformance: TRL's ``examples/scripts/sft_vlm.py`` on a tiny Qwen2-VL, the vision tower frozen.

Upstream: huggingface/trl ``examples/scripts/sft_vlm.py``. Its ``collate_fn`` is copied
verbatim (the chat template applied per example, ``processor(images=..., text=...,
return_tensors="pt", padding=True)``, labels -100 on padding and on the image token); the
trainer's ``compute_loss`` is ``model(**inputs)`` and ``outputs["loss"]``. Run without
``--use_peft`` the script trains the whole model; here the vision tower is frozen as the
Qwen2-VL fine-tuning recipes freeze it (``model.model.visual.requires_grad_(False)``: this
transformers has the tower at ``model.model.visual``), the language model and its head train.

The processor is transformers' own ``Qwen2VLProcessor`` over ``Qwen2VLImageProcessorPil``
(``min_pixels`` / ``max_pixels`` small, 2 px patches, 2x2 merge) and a word-level tokenizer
holding Qwen's special tokens. Images of *different* sizes in one batch: ``pixel_values`` is
every image's patches concatenated, ``(sum of patches, 24)``, and ``image_grid_thw`` one
``(t, h, w)`` row per image, so no tensor of the tower's input has a batch dimension. (The
processor is subclassed only to skip its video-processor class check: the video processor
needs torchvision, which is not installed; no video is passed.)

What a user expects: the frozen tower's output cached per sample (it runs each image on its
own: ``cu_seqlens`` attention), stage 2 holding no tower weight, verify bit for bit at batch 2
and 3, and one cache holding images of several sizes.

What happens (graphsplit as of this test), each case an xfail with the diagnosis:

- at batch 2 the default path refuses. The trace opens ``Qwen2VLModel.forward`` (it reads
  tensor values), finds ``get_image_features`` (``.tolist()`` of the grid) and runs it as an
  opaque stage-1 step; ``planning/opaque/example_run.py:ExampleRun._batch_dims`` re-runs it
  on one sample and cannot (the packed patches are cut by the batch dim of ``image_grid_thw``
  only), so it is "mixing"; its caller reads the trainable ``embed_tokens``, so the trace
  refuses, and the module-level path refuses the tower too (``pooler_output`` has no batch dim
  first). The refusal's fix line says "plan at batch 1".
- at batch 1, as that fix says, it refuses again: ``_batch_dims`` returns ``None`` for every
  opaque output when the example batch is 1, so the tower's ``(tokens, 32)`` output, and the
  ``torch.cat`` of it the language model reads, has no batch dim, and
  ``planning/cut/boundary.py:_min_cut`` raises ``_explain``'s "does not hold one row per sample"
  with a fix ("keep the batch as its own dimension in frozen code ... classifier-free
  guidance") that a user of transformers' model cannot apply.

Tiny config: vision 1 block, 16 wide (32 after the merger), 2 px patches; Qwen2 text 32 wide,
2 layers.
"""

from __future__ import annotations

import pytest
import torch

import graphsplit

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

from tests.conformance.unseen2_data_checks import assert_cache_round_trip  # noqa: E402
from tests.conformance.unseen3_vlm_checks import images, tiny_tokenizer  # noqa: E402
from tests.helpers import param_names  # noqa: E402

SPECIALS = [
    "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
    "<|video_pad|>",
]  # fmt: skip
# Qwen2-VL's chat template, cut down to what these messages use (an image part, text parts).
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }} "
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ content['text'] }}{% endif %} "
    "{% endfor %}<|im_end|> {% endfor %}"
)
# (height, width): 4, 12, 15 and 6 image tokens after the 2x2 merge.
SHAPES = [(8, 8), (16, 12), (12, 20), (8, 12)]
ANSWERS = ["a red cat", "two big dogs on the mat", "a small blue picture", "one cat"]


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class _ImageOnlyQwen2VLProcessor(transformers.Qwen2VLProcessor):
    """``Qwen2VLProcessor`` without a video processor (its class needs torchvision)."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


def _processor():
    image_processor = transformers.Qwen2VLImageProcessorPil(
        min_pixels=8 * 8, max_pixels=32 * 32, patch_size=2, temporal_patch_size=2, merge_size=2
    )
    return _ImageOnlyQwen2VLProcessor(
        image_processor=image_processor,
        tokenizer=tiny_tokenizer(SPECIALS),
        chat_template=CHAT_TEMPLATE,
    )


processor = _processor()


def _model():
    tokenizer = processor.tokenizer
    torch.manual_seed(0)
    config = transformers.Qwen2VLConfig(
        vision_config={
            "depth": 1,
            "embed_dim": 16,
            "hidden_size": 32,
            "num_heads": 2,
            "patch_size": 2,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
        },
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 128,
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3]},
            "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": None,
            "eos_token_id": None,
        },
        image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
    )
    model = transformers.Qwen2VLForConditionalGeneration(config)
    model.model.visual.requires_grad_(False)
    model.train()
    return model


model = _model()


def collate_fn(examples):
    """sft_vlm.py's, verbatim (its LLaVA-1.5 branch left out: the model is a Qwen2-VL)."""
    # Get the texts and images, and apply the chat template
    texts = [processor.apply_chat_template(example["messages"], tokenize=False) for example in examples]  # fmt: skip # noqa: E501
    images = [example["images"] for example in examples]

    # Tokenize the texts and process the images
    batch = processor(images=images, text=texts, return_tensors="pt", padding=True)

    # The labels are the input_ids, and we mask the padding tokens in the loss computation
    labels = batch["input_ids"].clone()
    labels[labels == processor.tokenizer.pad_token_id] = -100  #
    # Ignore the image token index in the loss computation (model specific)
    image_token_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    labels[labels == image_token_id] = -100
    batch["labels"] = labels

    return batch


def training_step(inputs):
    """``Trainer.compute_loss``'s body for a model that returns its loss."""
    outputs = model(**inputs)
    loss = outputs["loss"]
    return loss


def _examples(seed: int = 0):
    pictures = images(SHAPES, seed=seed)
    return [
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image"}, {"type": "text", "text": "what is this"}],
                },
                {"role": "assistant", "content": [{"type": "text", "text": ANSWERS[index]}]},
            ],
            "images": [picture],
        }
        for index, picture in enumerate(pictures)
    ]


EXAMPLES = _examples()
TOWER = {f"model.{name}" for name in param_names(model.model.visual, model)}
PARAMS = [param for param in model.parameters() if param.requires_grad]


def _assert_caches_the_tower(split):
    held = param_names(split.stage2, split._model)
    assert held and not held & TOWER, sorted(held & TOWER)[:4]
    assert "pixel_values" not in split.boundary


def test_the_collator_packs_images_of_several_sizes():
    batch = collate_fn(EXAMPLES[:3])
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4], [1, 8, 6], [1, 6, 10]]
    assert batch["pixel_values"].shape == (16 + 48 + 60, 24)  # no batch dimension
    assert torch.isfinite(training_step(batch))


@pytest.mark.xfail(
    strict=True,
    reason="the packed tower input has no batch dim: at batch 2 the trace finds "
    "get_image_features mixing samples (opaque/example_run.py:ExampleRun._batch_dims cannot "
    "re-run it on one sample), its caller reads the trainable embed_tokens, and the "
    "module-level path refuses model.model.visual (pooler_output has no batch dim first)",
)
def test_sft_vlm_step_caches_the_tower_at_batch_2(tmp_path):
    example = collate_fn(EXAMPLES[:2])
    split = graphsplit.split(training_step, (example,))
    _assert_caches_the_tower(split)
    for seed, batch in enumerate([example, collate_fn(EXAMPLES[1:4])]):
        checks = graphsplit.verify(training_step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks)
    loader = [collate_fn(EXAMPLES[:2]), collate_fn(EXAMPLES[2:4]), collate_fn(EXAMPLES[1:3])]
    assert_cache_round_trip(split, training_step, loader, tmp_path / "cache", PARAMS)


def test_batch_2_refusal_names_the_tower_call_and_says_plan_at_batch_1():
    """The refusal is graphsplit's own error (not a torch stack trace), names transformers'
    ``get_image_features`` line and the tower, and advises planning at batch 1."""
    with pytest.raises(graphsplit.GraphsplitError) as caught:
        graphsplit.split(training_step, (collate_fn(EXAMPLES[:2]),))
    message = str(caught.value)
    assert "Qwen2VLModel.get_image_features reads tensor values and mixes the samples" in message
    assert "modeling_qwen2_vl.py" in message and "self.get_image_features(" in message
    assert "fix:    plan at batch 1" in message
    # The module-level path's refusal is chained to it.
    assert (
        "model.model.visual call 0: its inputs depend on the batch but an output has no "
        "batch dimension first" in str(caught.value.__cause__)
    )


@pytest.mark.xfail(
    strict=True,
    reason="the refusal's own fix (plan at batch 1) refuses too: at batch 1 "
    "opaque/example_run.py:ExampleRun._batch_dims gives every opaque output batch dim None, "
    "so the tower's (tokens, 32) output has none and cut/boundary.py:_min_cut raises "
    "_explain's 'does not hold one row per sample' (fix: keep the batch as its own dimension)",
)
def test_planned_at_batch_1_as_the_fix_says_it_caches_the_tower(tmp_path):
    example = collate_fn(EXAMPLES[:1])
    split = graphsplit.split(training_step, (example,))
    _assert_caches_the_tower(split)
    for seed, index in enumerate([1, 2, 3]):
        batch = collate_fn(EXAMPLES[index : index + 1])
        checks = graphsplit.verify(training_step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks)
    # One cache of four image sizes, one sample per batch.
    loader = [collate_fn([example]) for example in EXAMPLES]
    assert_cache_round_trip(split, training_step, loader, tmp_path / "cache", PARAMS)


def test_batch_1_refusal_as_it_stands():
    """What the batch-1 plan says today (the xfail above records why it should not refuse)."""
    with pytest.raises(graphsplit.GraphsplitError) as caught:
        graphsplit.split(training_step, (collate_fn(EXAMPLES[:1]),))
    message = str(caught.value)
    assert "does not hold one row per sample along a single batch dimension" in message
    assert 'torch.cat(mm_encoder_outputs["image"].pooler_output' in message
