"""Conformance: TRL's ``SFTTrainer`` on a tiny LLaVA, vision tower frozen, via ``split_trainer``.

Upstream: TRL 1.16's ``SFTTrainer`` (trl/trainer/sft_trainer.py), unchanged, as its VLM
fine-tuning docs build it: a vision dataset (``images`` plus ``prompt`` / ``completion``: the
trainer skips dataset preparation and collates raw examples with
``DataCollatorForVisionLanguageModeling``, which runs the processor and pads each batch to its
longest, completion-only labels), ``processing_class`` the model's processor, and the vision
tower frozen (``model.model.vision_tower.requires_grad_(False)``; the projector and the
language model train). ``SFTConfig`` defaults otherwise (``gradient_checkpointing=True``,
``max_length=None`` so the image tokens are not truncated). Its ``compute_loss`` runs
``model(**inputs, fused_lm_head=True)``, divides the summed ``-log_probs`` by the token count
and logs entropy, token accuracy and ``num_tokens`` with ``.item()``.

Model: ``LlavaForConditionalGeneration`` (CLIP 32 wide, 2 layers, 16 px in 4 px patches;
Llama 32 wide, 2 layers), processor and images as in
tests/conformance/test_unseen9_llava_projector_pretraining.py, random weights.

What holds: ``compute_loss`` (``TrainerLoss``) splits on the default path (the module-level
one: TRL's metrics branch on ``num_valid > 0``), caches the tower's selected hidden layer
(stage 2 holds no tower weight), verifies bit for bit on batches of 2 and 3, and a cache
through the disk trains stage 2 exactly.

What was wrong, and is fixed:

- the losses of ``trainer.train()`` after ``split_trainer`` differed from the plain
  ``SFTTrainer``'s (3.2981694 against 3.2986596 at step 1): ``SFTConfig`` defaults to
  ``bf16=True``, and ``train()`` has accelerate wrap the student's ``forward`` in a bfloat16
  autocast; ``split_trainer`` planned and cached before that, so the vision tower (inside the
  student) was cached in float32. It now plans and caches with the forward wrapped as
  ``train()`` wraps it (``graphsplit/integrations/trainer_loss.py:prepared_forward``), and
  the losses, gradient norms and final weights are the plain trainer's.
- the split run logs other metrics: ``split_trainer``'s planning probes and caching pass run
  TRL's ``compute_loss``, whose bookkeeping (``self._total_train_tokens += ...``,
  ``self._metrics["train"][...].append``) ran each time, so the first logged ``num_tokens``
  was 126 instead of 36; the trainer's plain-data attributes are now put back after planning
  and caching (``graphsplit/integrations/trainer_bookkeeping.py``).
"""

from __future__ import annotations

import pytest
import torch

import graphsplit
from tests.conformance.unseen2_data_checks import assert_cache_round_trip
from tests.conformance.unseen3_vlm_checks import images, tiny_tokenizer
from tests.conformance.unseen_checks import stage2_top_modules
from tests.helpers import assert_stage1_holds_no_trainable, param_names

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")
from graphsplit.integrations.transformers import (  # noqa: E402
    TrainerLoss,
    batch_by_padded_length,
    split_trainer,
)

COMPLETIONS = ["a cat sat on the mat", "two big dogs", "the red picture of a dog", "one cat"]


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _processor():
    tokenizer = tiny_tokenizer(["<image>"])
    image_processor = transformers.CLIPImageProcessorPil(
        size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}
    )
    return transformers.LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=4,
        vision_feature_select_strategy="default",
        image_token="<image>",
        num_additional_image_tokens=1,
    )


PROCESSOR = _processor()


def _model():
    tokenizer = PROCESSOR.tokenizer
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
        image_seq_length=16,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    model = transformers.LlavaForConditionalGeneration(config)
    model.model.vision_tower.requires_grad_(False)
    return model


def _dataset():
    pictures = images([(20 + 4 * (i % 3), 24) for i in range(8)], seed=0)
    return datasets.Dataset.from_list(
        [
            {"images": [picture], "prompt": "<image>\n", "completion": COMPLETIONS[i % 4]}
            for i, picture in enumerate(pictures)
        ]
    )


def _trainer(output_dir: str):
    args = trl.SFTConfig(
        output_dir=output_dir,
        per_device_train_batch_size=2,
        max_steps=2,
        seed=42,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        max_length=None,
    )
    return trl.SFTTrainer(
        model=_model(), args=args, train_dataset=_dataset(), processing_class=PROCESSOR
    )


def _logged(trainer, *keys):
    return [tuple(e[k] for k in keys) for e in trainer.state.log_history if "loss" in e]


def _train_both(tmp_path):
    plain = _trainer(str(tmp_path / "plain"))
    assert batch_by_padded_length(plain) is not None  # the split run's batches
    plain.train()
    trainer = _trainer(str(tmp_path / "split"))
    parts = split_trainer(trainer, str(tmp_path / "cache"))
    trainer.train()
    return plain, trainer, parts


# -- tests ---------------------------------------------------------------------------------------
def test_sft_compute_loss_caches_the_vision_tower_and_verifies(tmp_path):
    trainer = _trainer(str(tmp_path / "out"))
    trainer.model.train()
    loss = TrainerLoss(trainer)
    rows, collate = _dataset(), trainer.data_collator
    example = collate([rows[0], rows[4]])
    split = graphsplit.split(loss, (example,))
    for batch in (example, collate([rows[1], rows[5]]), collate([rows[2], rows[6], rows[3]])):
        comparisons = graphsplit.verify(loss, split, (batch,))
        assert comparisons and all(c.ok for c in comparisons)
    assert_stage1_holds_no_trainable(split)
    tower = {f"model.{n}" for n in param_names(trainer.model.model.vision_tower, trainer.model)}
    assert not param_names(split.stage2, split._model) & tower
    assert "model" in stage2_top_modules(split)
    cached = [key for key in split.boundary if "vision_tower" in key]
    assert cached and split.boundary[cached[0]].shape[1:] == (17, 32), cached
    assert "pixel_values" not in split.boundary
    loader = [collate([rows[1], rows[3]]), collate([rows[0], rows[4]]), collate([rows[2]])]
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    assert_cache_round_trip(split, loss, loader, tmp_path / "cache", params)


def test_split_trainer_trains_as_the_plain_sft_trainer(tmp_path):
    """``SFTConfig`` turns ``bf16`` on: ``train()`` has accelerate wrap the student's forward in
    a bfloat16 autocast, the vision tower inside it. ``split_trainer`` cached the tower in
    float32 before ``train()`` (the first loss off in the 4th digit); it now plans and caches
    with the forward wrapped as ``train()`` will wrap it (``trainer_loss.prepared_forward``)."""
    plain, trainer, parts = _train_both(tmp_path)
    assert plain.args.bf16 and plain.accelerator.native_amp  # the trainer's own default
    assert [key for key in parts.split.boundary if "vision_tower" in key]
    assert len(_logged(trainer, "loss")) == 2
    assert _logged(trainer, "loss", "grad_norm") == _logged(plain, "loss", "grad_norm")
    one, other = plain.model.state_dict(), trainer.model.state_dict()
    assert one.keys() == other.keys() and all(torch.equal(one[k], other[k]) for k in one)


def test_split_trainer_leaves_the_trainers_metrics_as_plain(tmp_path):
    plain, trainer, _parts = _train_both(tmp_path)
    assert _logged(trainer, "num_tokens") == _logged(plain, "num_tokens")
