"""Conformance: TRL and transformers steps the other conformance files do not cover.

Each step computes its loss as its upstream trainer or script does (the lines are TRL 1.16's
and transformers' own, less the metrics they log), from real classes with tiny configs and
random weights:

- TRL reward modelling (``RewardTrainer.compute_loss``): a LoRA'd
  ``LlamaForSequenceClassification`` (peft ``task_type="SEQ_CLS"``, the score head in
  ``modules_to_save``) scores chosen and rejected stacked along the batch;
- TRL KTO (``KTOTrainer._compute_loss`` with a frozen reference model): the fused LM head TRL
  patches onto both models, the mismatched KL batch, ``torch.nonzero`` on the labels. The
  whole-step trace refuses ``nonzero``; the module-level path caches the reference model's
  two calls and never the policy's (its KL log-probs are taken under ``no_grad`` but depend on
  trained weights);
- ``run_image_classification.py`` with a frozen ViT backbone under a trainable head.

Beyond ``verify`` (one batch, the same weights and seed for both runs), every step is trained
*from its cache*: stage 1 runs under one seed, the trainable parameters then move (an
optimizer step), and stage 2 on the old boundary must still equal the unsplit step under a
new seed, loss and every gradient bit for bit. That is what a cache that held anything
depending on a trainable parameter or a random draw would fail. Some steps go through
``graphsplit.cache`` and ``CachedDataset`` on disk, and one runs batches of two lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphsplit
from tests.conformance.matrix import ids_and_mask
from tests.helpers import split_and_verify, tiny_llama_config

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
trl_utils = pytest.importorskip("trl.trainer.utils")

VOCAB = 64


def stage2_paths(split) -> set[str]:
    """Every submodule path stage 2 holds."""
    return {name for name, _ in split.stage2.named_modules() if name}


def _trainable(step: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(name, p) for name, p in step.named_parameters() if p.requires_grad]


def _loss_and_grads(
    run, inputs, params, seed: int
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    for _, param in params:
        param.grad = None
    torch.manual_seed(seed)
    loss = run(*inputs) if isinstance(inputs, tuple) else run(**inputs)
    loss.backward()
    return loss.detach(), [None if p.grad is None else p.grad.clone() for _, p in params]


def _boundary_from_disk(split, batches: Sequence[tuple], folder: Path) -> list[dict]:
    loader = [dict(zip(split.input_names, batch)) for batch in batches]
    graphsplit.cache(split, loader, folder, progress=False)
    dataset = graphsplit.CachedDataset(folder, split=split)
    rows, boundaries = 0, []
    for batch in batches:
        size = batch[0].shape[0]
        boundaries.append(graphsplit.collate([dataset[rows + i] for i in range(size)]))
        rows += size
    assert len(dataset) == rows
    return boundaries


def assert_trains_from_its_cache(
    step: nn.Module, split, batches: Sequence[tuple], folder: Path | None = None
) -> None:
    """Cache under one seed, move every trainable parameter, train stage 2 from the old cache.

    Stage 2's loss and gradients must equal the unsplit step's (new weights, new seed) bit for
    bit: a boundary tensor that depended on a trainable parameter or on a random draw would
    still hold the old value.
    """
    params = _trainable(step)
    torch.manual_seed(1234)
    if folder is None:
        with torch.no_grad():
            boundaries = [split.stage1(*batch) for batch in batches]
    else:
        boundaries = _boundary_from_disk(split, batches, folder)
    generator = torch.Generator().manual_seed(99)
    with torch.no_grad():  # an optimizer step
        for _, param in params:
            param.add_(torch.randn(param.shape, generator=generator).to(param.dtype) * 0.05)
    for index, (batch, boundary) in enumerate(zip(batches, boundaries)):
        seed = 7 + index
        expected, expected_grads = _loss_and_grads(step, batch, params, seed)
        actual, actual_grads = _loss_and_grads(split.stage2, boundary, params, seed)
        assert torch.equal(expected, actual), (expected, actual)
        for (name, _), want, got in zip(params, expected_grads, actual_grads):
            assert (want is None) == (got is None), name
            assert want is None or torch.equal(want, got), f"grad of {name} differs"


# --- TRL reward modelling -------------------------------------------------------------------


class RewardModelling(nn.Module):
    """``RewardTrainer.compute_loss``: ``use_cache=False``, chosen and rejected stacked, the
    Bradley-Terry loss. The model is what ``RewardTrainer`` builds with a ``peft_config``."""

    def __init__(self) -> None:
        super().__init__()
        config = tiny_llama_config(num_labels=1, pad_token_id=0)
        model = transformers.LlamaForSequenceClassification(config)
        lora = peft.LoraConfig(
            task_type="SEQ_CLS",
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj"],
            init_lora_weights="gaussian",
        )
        self.model = peft.get_peft_model(model, lora)

    def forward(self, input_ids, attention_mask):
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        inputs["use_cache"] = False
        outputs = self.model(**inputs)
        rewards_chosen, rewards_rejected = torch.chunk(outputs.logits.squeeze(-1), chunks=2)
        return -nn.functional.logsigmoid(rewards_chosen - rewards_rejected).mean()


def _preference_batch(pairs: int, tokens: int = 8, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """``DataCollatorForPreference``'s layout: the chosen rows, then the rejected, right-padded
    with ``pad_token_id`` (the classifier reads the last non-pad token)."""
    ids, mask = ids_and_mask(2 * pairs, tokens=tokens, vocab=VOCAB - 1, seed=seed)
    ids = (ids + 1).masked_fill(mask == 0, 0)
    return ids, mask


@pytest.mark.parametrize("pairs", [2, 3])
def test_reward_model_with_lora_caches_only_frozen_work(pairs):
    torch.manual_seed(0)
    step = RewardModelling()
    batch = _preference_batch(pairs)
    split = split_and_verify(step, batch)
    held = stage2_paths(split)
    score = "model.base_model.model.score.modules_to_save.default"
    assert score in held
    # The frozen embedding is cached; every LoRA'd layer runs in stage 2.
    assert "model.base_model.model.model.embed_tokens" not in held
    assert {f"model.base_model.model.model.layers.{i}.self_attn" for i in (0, 1)} <= held
    assert_trains_from_its_cache(step, split, [batch])


def test_reward_model_trains_from_one_cache_of_two_lengths(tmp_path):
    torch.manual_seed(0)
    step = RewardModelling()
    short, long = _preference_batch(2, tokens=8), _preference_batch(2, tokens=13, seed=1)
    split = split_and_verify(step, short)
    assert all(c.ok for c in graphsplit.verify(step, split, long))
    # The sequence classifier's last-token search reads the length (torch.arange(
    # input_ids.shape[-1])) off the raw ids, which stage 2 lacks: it used to be a number baked
    # into stage 2, a plan per length; stage 2 now reads it off a cached tensor computed from
    # the ids, checked in stage 1 (planning/cut/twin_reads.py): one plan for both lengths.
    assert len(split.plans) == 1
    assert "check_same_read" in split.stage1.code
    assert_trains_from_its_cache(step, split, [short, long], tmp_path / "cache")


# --- TRL KTO ----------------------------------------------------------------------------------


class KahnemanTverskyOptimisation(nn.Module):
    """``KTOTrainer._compute_loss`` (loss_type="kto", a separate frozen ``ref_model``,
    ``calculate_KL``) with ``add_fused_lm_head`` patched onto both models as the trainer does."""

    def __init__(self, beta: float = 0.1) -> None:
        super().__init__()
        self.model = transformers.LlamaForCausalLM(tiny_llama_config())
        trl_utils.add_fused_lm_head(self.model, outputs=("log_probs", "entropy", "mean_logits"))
        self.ref_model = transformers.LlamaForCausalLM(tiny_llama_config())
        self.ref_model.eval().requires_grad_(False)
        trl_utils.add_fused_lm_head(self.ref_model)
        self.beta = beta
        self.desirable_weight = 1.0
        self.undesirable_weight = 1.0

    def _compute_kl_logps(self, model, batch):
        _non_model_keys = {
            "input_ids",
            "attention_mask",
            "completion_mask",
            "KL_completion_mask",
            "label",
        }
        KL_model_kwargs = {k: v for k, v in batch.items() if k not in _non_model_keys}
        KL_model_kwargs["input_ids"] = KL_model_kwargs.pop("KL_input_ids")
        KL_model_kwargs["attention_mask"] = KL_model_kwargs.pop("KL_attention_mask")
        KL_model_kwargs["use_cache"] = False
        KL_labels = batch["KL_input_ids"].masked_fill(batch["KL_completion_mask"] == 0, -100)
        with torch.no_grad():
            KL_per_token_logps = model(
                **KL_model_kwargs, labels=KL_labels, fused_lm_head=True
            ).log_probs
        return KL_per_token_logps[:, -(KL_labels.size(1) - 1) :].sum(-1)

    def forward(
        self,
        input_ids,
        attention_mask,
        completion_mask,
        KL_input_ids,
        KL_attention_mask,
        KL_completion_mask,
        label,
    ):
        batch = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "completion_mask": completion_mask,
            "KL_input_ids": KL_input_ids,
            "KL_attention_mask": KL_attention_mask,
            "KL_completion_mask": KL_completion_mask,
            "label": label,
        }
        KL_logps = self._compute_kl_logps(self.model, batch)
        _non_model_keys = {
            "completion_mask",
            "KL_input_ids",
            "KL_attention_mask",
            "KL_completion_mask",
            "label",
        }
        model_kwargs = {k: v for k, v in batch.items() if k not in _non_model_keys}
        model_kwargs["use_cache"] = False
        completion_labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
        outputs = self.model(**model_kwargs, labels=completion_labels, fused_lm_head=True)
        seq_len = batch["input_ids"].size(1) - 1
        per_token_logps = outputs.log_probs[:, -seq_len:]
        completion_logps = per_token_logps.sum(-1)

        device = per_token_logps.device
        bool_labels = torch.as_tensor(batch["label"], dtype=torch.bool, device=device)
        chosen_idx = torch.nonzero(bool_labels, as_tuple=False).view(-1)
        rejected_idx = torch.nonzero(~bool_labels, as_tuple=False).view(-1)
        chosen_logps = completion_logps.index_select(0, chosen_idx)
        rejected_logps = completion_logps.index_select(0, rejected_idx)

        ref_model_kwargs = {k: v for k, v in model_kwargs.items() if k != "output_router_logits"}
        with torch.no_grad():
            ref_KL_logps = self._compute_kl_logps(self.ref_model, batch)
            ref_outputs = self.ref_model(
                **ref_model_kwargs, labels=completion_labels, fused_lm_head=True
            )
        ref_completion_logps = ref_outputs.log_probs[:, -seq_len:].sum(-1)
        ref_chosen_logps = ref_completion_logps.index_select(0, chosen_idx)
        ref_rejected_logps = ref_completion_logps.index_select(0, rejected_idx)

        kl = (KL_logps - ref_KL_logps).mean().detach()
        kl = kl.clamp(min=0)  # the trainer's gather_for_metrics is the identity in one process
        if chosen_logps.shape[0] != 0 or ref_chosen_logps.shape[0] != 0:
            chosen_logratios = chosen_logps - ref_chosen_logps
            chosen_losses = 1 - F.sigmoid(self.beta * (chosen_logratios - kl))
        else:
            chosen_losses = torch.Tensor([]).to(device)
        if rejected_logps.shape[0] != 0 or ref_rejected_logps.shape[0] != 0:
            rejected_logratios = rejected_logps - ref_rejected_logps
            rejected_losses = 1 - F.sigmoid(self.beta * (kl - rejected_logratios))
        else:
            rejected_losses = torch.Tensor([]).to(device)
        losses = torch.cat(
            (self.desirable_weight * chosen_losses, self.undesirable_weight * rejected_losses),
            0,
        )
        return losses.nanmean()


def _kto_batch(size: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """``DataCollatorForUnpairedPreference`` with KL completions: a 3-token prompt, the
    completion, and the KL row pairing each prompt with the next sample's completion."""
    ids, mask = ids_and_mask(size, seed=seed)
    completion_mask = mask.clone()
    completion_mask[:, :3] = 0
    kl_ids = torch.cat([ids[:, :3], ids.roll(1, 0)[:, 3:]], dim=1)
    kl_mask = mask.roll(1, 0).clone()
    kl_mask[:, :3] = 1
    kl_completion_mask = kl_mask.clone()
    kl_completion_mask[:, :3] = 0
    label = torch.arange(size) % 2 == 0
    return ids, mask, completion_mask, kl_ids, kl_mask, kl_completion_mask, label


@pytest.mark.parametrize("size", [2, 3])
def test_kto_caches_the_reference_log_probs_and_never_the_policys(size, tmp_path):
    torch.manual_seed(0)
    step = KahnemanTverskyOptimisation()
    batch = _kto_batch(size)
    split = graphsplit.split(step, batch)
    assert all(c.ok for c in graphsplit.verify(step, split, batch))
    # torch.nonzero on the labels refuses the whole-step trace; the module path takes it.
    assert isinstance(split, graphsplit.CallSplit)
    assert "nonzero" in split.report()
    cached = {key for key in split.boundary if key not in split.input_names}
    assert cached == {"ref_model__0__log_probs", "ref_model__1__log_probs"}
    assert "ref_model" not in {n.split(".")[0] for n, _ in split.stage2.named_parameters()}
    assert_trains_from_its_cache(step, split, [batch], folder=tmp_path / "cache")


# --- run_image_classification.py with a frozen backbone --------------------------------------


class FrozenBackboneClassification(nn.Module):
    """``ViTForImageClassification`` with ``model.vit`` frozen: ``model(**batch).loss``."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.ViTConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            image_size=16,
            patch_size=4,
            num_labels=3,
        )
        self.model = transformers.ViTForImageClassification(config)
        self.model.vit.requires_grad_(False)

    def forward(self, pixel_values, labels):
        return self.model(pixel_values=pixel_values, labels=labels).loss


def _images(size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, 3, 16, 16, generator=generator), torch.arange(size) % 3


@pytest.mark.parametrize("size", [2, 3])
def test_frozen_vit_backbone_caches_the_cls_state(size, tmp_path):
    torch.manual_seed(0)
    step = FrozenBackboneClassification()
    batch = _images(size)
    split = split_and_verify(step, batch)
    assert stage2_paths(split) == {"model", "model.classifier"}
    features = [spec for key, spec in split.boundary.items() if key not in split.input_names]
    assert [spec.shape[1:] for spec in features] == [(32,)]  # the [CLS] state, not the patches
    assert_trains_from_its_cache(step, split, [batch, _images(size, seed=1)], tmp_path / "c")


def test_the_cache_check_catches_a_boundary_that_depends_on_a_trained_weight(tmp_path):
    """The check above has teeth: told the backbone is frozen while its last norm trains,
    graphsplit caches the norm's output, which an optimizer step makes stale."""
    torch.manual_seed(0)
    step = FrozenBackboneClassification()
    step.model.vit.layernorm.requires_grad_(True)
    batch = _images(2)
    split = graphsplit.split(step, batch, frozen=lambda name, _: name.startswith("model.vit"))
    with pytest.raises(AssertionError):
        assert_trains_from_its_cache(step, split, [batch])


# --- distillation across architectures ------------------------------------------------------


class CrossArchitectureDistillation(nn.Module):
    """transformers' research distillation loss: a frozen BERT teacher (eval) scores the
    sequence, a DistilBERT student (dropout live) matches its temperature-softened logits
    beside its own cross-entropy."""

    def __init__(self, temperature: float = 2.0, alpha: float = 0.5) -> None:
        super().__init__()
        teacher = transformers.BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=32,
            num_labels=3,
        )
        student = transformers.DistilBertConfig(
            vocab_size=VOCAB,
            dim=32,
            n_layers=1,
            n_heads=2,
            hidden_dim=64,
            max_position_embeddings=32,
            num_labels=3,
        )
        self.teacher = transformers.BertForSequenceClassification(teacher)
        self.teacher.eval().requires_grad_(False)
        self.student = transformers.DistilBertForSequenceClassification(student).train()
        self.temperature, self.alpha = temperature, alpha

    def forward(self, input_ids, attention_mask, labels):
        student_output = self.student(
            input_ids=input_ids, attention_mask=attention_mask, labels=labels
        )
        with torch.no_grad():
            teacher_output = self.teacher(input_ids=input_ids, attention_mask=attention_mask)
        t = self.temperature
        loss_kd = F.kl_div(
            F.log_softmax(student_output.logits / t, dim=-1),
            F.softmax(teacher_output.logits / t, dim=-1),
            reduction="batchmean",
        ) * (t**2)
        return self.alpha * student_output.loss + (1.0 - self.alpha) * loss_kd


@pytest.mark.parametrize("size", [2, 3])
def test_bert_to_distilbert_distillation_caches_the_teachers_soft_targets(size, tmp_path):
    torch.manual_seed(0)
    step = CrossArchitectureDistillation()
    ids, mask = ids_and_mask(size)
    batch = (ids, mask, torch.arange(size) % 3)
    split = split_and_verify(step, batch)
    assert {path.split(".")[0] for path in stage2_paths(split)} == {"student"}
    cached = {key: spec.shape for key, spec in split.boundary.items()}
    assert cached.pop("softmax") == (size, 3)  # the softened targets, 3 floats a sample
    assert set(cached) == set(split.input_names)
    assert_trains_from_its_cache(step, split, [batch], tmp_path / "cache")
