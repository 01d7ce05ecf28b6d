"""Conformance: TRL preference steps with no separate reference model.

- DPO on a LoRA policy with ``ref_model=None`` (``DPOTrainer._compute_loss``, trl 1.16
  ``trl/trainer/dpo_trainer.py``): the reference is the policy's own base model, called under
  ``use_adapter(model, adapter_name=None)``, i.e. ``with model.disable_adapter():``. The
  reference log-probs depend on the frozen base weights only, so they may be cached; the
  policy's call, which runs the same modules with the adapters on, must never be;
- ORPO (``ORPOTrainer.get_batch_loss_metrics``, ``trl/experimental/orpo/orpo_trainer.py``): no
  reference model; the trainer concatenates chosen and rejected inside the step and scores
  them with ``selective_log_softmax``, whose Python loop over the rows ties the trace to one
  row count: exact at one pair per batch, refused (naming TRL's line) at several.

Each supported one is verified bit for bit and trained from its cache after an
optimizer step (:func:`~tests.conformance.test_unseen_lm.assert_trains_from_its_cache`).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphsplit
from tests.conformance.matrix import ids_and_mask
from tests.conformance.test_unseen_lm import assert_trains_from_its_cache, stage2_paths
from tests.helpers import split_and_verify, tiny_llama_config

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
trl_utils = pytest.importorskip("trl.trainer.utils")
orpo = pytest.importorskip("trl.experimental.orpo.orpo_trainer")

VOCAB = 64


def _lora_llama() -> nn.Module:
    """What ``DPOTrainer`` builds from a model and a ``peft_config``: the fused LM head patched
    onto the base model, then LoRA (random ``lora_B`` so the LoRA output is not zero)."""
    model = transformers.LlamaForCausalLM(tiny_llama_config())
    trl_utils.add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    config = peft.LoraConfig(
        task_type="CAUSAL_LM",
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        init_lora_weights="gaussian",
    )
    model = peft.get_peft_model(model, config)
    generator = torch.Generator().manual_seed(5)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data = torch.randn(param.shape, generator=generator) * 0.02
    return model


def _preference_batch(pairs: int, tokens: int = 8, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """``DataCollatorForPreference``: chosen rows then rejected rows, right-padded, a 3-token
    prompt outside the completion mask."""
    ids, mask = ids_and_mask(2 * pairs, tokens=tokens, seed=seed)
    completion_mask = mask.clone()
    completion_mask[:, :3] = 0
    return ids, mask, completion_mask


class DirectPreferenceOptimisationWithAdapterReference(nn.Module):
    """``DPOTrainer._compute_loss`` with ``ref_model=None``, a peft policy, ``loss_type=
    ["sigmoid"]``, ``ld_alpha=None``, ``precompute_ref_log_probs=False`` (the metrics left
    out). ``use_adapter(model, None)`` is TRL's ``with model.disable_adapter():``."""

    def __init__(self, beta: float = 0.1) -> None:
        super().__init__()
        self.model = _lora_llama()
        self.ref_model = None
        self.beta = beta
        self.loss_types, self.loss_weights = ["sigmoid"], [1.0]

    def forward(self, input_ids, attention_mask, completion_mask):
        inputs = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "completion_mask": completion_mask,
        }
        _non_model_keys = {"completion_mask", "ref_chosen_logps", "ref_rejected_logps"}
        model_kwargs = {k: v for k, v in inputs.items() if k not in _non_model_keys}
        model_kwargs["use_cache"] = False
        completion_mask = inputs["completion_mask"]
        shift_completion_mask = completion_mask[..., 1:]
        labels = inputs["input_ids"].masked_fill(completion_mask == 0, -100)
        outputs = self.model(**model_kwargs, labels=labels, fused_lm_head=True)
        seq_len = shift_completion_mask.size(1)
        per_token_logps = outputs.log_probs[:, -seq_len:]
        logps = per_token_logps.sum(dim=1)
        chosen_logps, rejected_logps = logps.chunk(2, dim=0)

        ref_model_kwargs = {k: v for k, v in model_kwargs.items() if k != "output_router_logits"}
        with torch.no_grad():
            if self.ref_model is None:
                ref_model_unwrapped = self.model
                with trl_utils.use_adapter(
                    ref_model_unwrapped,
                    adapter_name="ref" if "ref" in ref_model_unwrapped.peft_config else None,
                ):
                    ref_outputs = self.model(**ref_model_kwargs, labels=labels, fused_lm_head=True)
        ref_per_token_logps = ref_outputs.log_probs[:, -seq_len:]
        ref_logps = ref_per_token_logps.sum(dim=1)
        ref_chosen_logps, ref_rejected_logps = ref_logps.chunk(2, dim=0)

        chosen_logratios = chosen_logps - ref_chosen_logps
        rejected_logratios = rejected_logps - ref_rejected_logps
        delta_score = chosen_logratios - rejected_logratios
        loss = 0.0
        for loss_type, loss_weight in zip(self.loss_types, self.loss_weights, strict=True):
            if loss_type == "sigmoid":
                per_sequence_loss = -F.logsigmoid(self.beta * delta_score)
            loss = loss + per_sequence_loss.mean() * loss_weight
        return loss


@pytest.mark.parametrize("pairs", [1, 2, 3])
def test_dpo_with_the_adapter_disabled_reference_caches_the_base_models_log_probs(pairs, tmp_path):
    torch.manual_seed(0)
    step = DirectPreferenceOptimisationWithAdapterReference()
    batch = _preference_batch(pairs)
    split = split_and_verify(step, batch)
    rows = 2 * pairs
    # The whole reference forward (adapters off) runs in stage 1, down to the step's own
    # ``ref_logps = ref_per_token_logps.sum(dim=1)``: one number per row is cached. (The fused
    # head also computes a mean ``loss`` over the batch that DPO never reads; that dead
    # reduction runs in neither stage and does not hold the cut at the per-token log-probs.)
    policy_head, reference_head = _fused_heads(split)
    assert policy_head in split.cut.stage2 and reference_head in split.cut.stage1
    cached = {key: spec.shape for key, spec in split.boundary.items()}
    log_probs = [spec for spec in split.boundary.values() if spec.dtype == torch.float32]
    (row_sum,) = [spec for spec in log_probs if spec.shape == (rows,)]
    assert row_sum.source.endswith(f":{_line_of('ref_logps = ref_per_token_logps.sum(dim=1)')}")
    assert (rows, 7) not in {spec.shape for spec in log_probs}
    # The policy's frozen work below its first LoRA layer is cached too; no LoRA layer is.
    assert cached["model_base_model_model_model_embed_tokens"] == (rows, 8, 32)
    held = stage2_paths(split)
    assert "model.base_model.model.model.layers.1.self_attn.q_proj.lora_A.default" in held
    assert all("lora" not in name for name, _ in split.stage1.named_parameters())
    assert_trains_from_its_cache(
        step, split, [batch, _preference_batch(pairs, seed=1)], tmp_path / "cache"
    )


def _line_of(text: str) -> int:
    """The line of this file that holds ``text``."""
    lines = Path(__file__).read_text().splitlines()
    return next(number for number, line in enumerate(lines, 1) if text in line)


def _fused_heads(split) -> list:
    """The calls of TRL's chunked log-prob kernel, in the order the step makes them."""
    return [
        node
        for node in split.graph.nodes
        if "ChunkedLogProb" in getattr(node.target, "__name__", "")
    ]


# --- ORPO: no reference model ---------------------------------------------------------------


class OddsRatioPreferenceOptimisation(nn.Module):
    """``ORPOTrainer.get_batch_loss_metrics`` on a LoRA Llama (decoder-only, no aux loss, the
    metrics it logs with ``.item()`` left out): the trainer's own ``concatenated_inputs`` and
    ``get_batch_logps``, its ``concatenated_forward`` and ``odds_ratio_loss`` as written."""

    def __init__(self, beta: float = 0.1) -> None:
        super().__init__()
        model = transformers.LlamaForCausalLM(tiny_llama_config())
        config = peft.LoraConfig(
            task_type="CAUSAL_LM",
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj"],
            init_lora_weights="gaussian",
        )
        self.model = peft.get_peft_model(model, config)
        self.beta, self.padding_value, self.is_encoder_decoder = beta, 0, False

    def concatenated_forward(self, model, batch):
        concatenated_batch = orpo.ORPOTrainer.concatenated_inputs(
            batch, is_encoder_decoder=self.is_encoder_decoder, padding_value=self.padding_value
        )
        len_chosen = batch["chosen_labels"].shape[0]
        outputs = model(
            concatenated_batch["concatenated_input_ids"],
            attention_mask=concatenated_batch["concatenated_attention_mask"],
            use_cache=False,
        )
        all_logits = outputs.logits

        def cross_entropy_loss(logits, labels):
            logits = logits[..., :-1, :].contiguous()
            labels = labels[..., 1:].contiguous()
            loss_fct = nn.CrossEntropyLoss()
            logits = logits.view(-1, logits.shape[-1])
            labels = labels.view(-1)
            labels = labels.to(logits.device)
            return loss_fct(logits, labels)

        labels = concatenated_batch["concatenated_input_ids"].clone()
        attention_mask = concatenated_batch["concatenated_attention_mask"]
        labels = torch.where(attention_mask == 1, labels, -100)
        chosen_nll_loss = cross_entropy_loss(all_logits[:len_chosen], labels[:len_chosen])
        all_logps = orpo.ORPOTrainer.get_batch_logps(
            all_logits,
            concatenated_batch["concatenated_labels"],
            average_log_prob=True,
            is_encoder_decoder=self.is_encoder_decoder,
        )
        return all_logps[:len_chosen], all_logps[len_chosen:], chosen_nll_loss

    def odds_ratio_loss(self, policy_chosen_logps, policy_rejected_logps):
        policy_chosen_logps = policy_chosen_logps.float()
        policy_rejected_logps = policy_rejected_logps.float()
        log_odds = (policy_chosen_logps - policy_rejected_logps) - (
            orpo.log1mexp(policy_chosen_logps) - orpo.log1mexp(policy_rejected_logps)
        )
        ratio = F.logsigmoid(log_odds)
        return self.beta * ratio

    def forward(
        self,
        chosen_input_ids,
        chosen_attention_mask,
        chosen_labels,
        rejected_input_ids,
        rejected_attention_mask,
        rejected_labels,
    ):
        batch = {
            "chosen_input_ids": chosen_input_ids,
            "chosen_attention_mask": chosen_attention_mask,
            "chosen_labels": chosen_labels,
            "rejected_input_ids": rejected_input_ids,
            "rejected_attention_mask": rejected_attention_mask,
            "rejected_labels": rejected_labels,
        }
        policy_chosen_logps, policy_rejected_logps, policy_nll_loss = self.concatenated_forward(
            self.model, batch
        )
        losses = self.odds_ratio_loss(policy_chosen_logps, policy_rejected_logps)
        return policy_nll_loss - losses.mean()


def _orpo_batch(pairs: int, chosen: int = 8, rejected: int = 6, seed: int = 0) -> tuple:
    """``DPODataCollatorWithPadding``: chosen and rejected padded apart (the trainer pads them
    to one length), labels -100 over the 3-token prompt and the padding."""
    fields = []
    for tokens, offset in ((chosen, 0), (rejected, 10)):
        ids, mask = ids_and_mask(pairs, tokens=tokens, seed=seed + offset, pad=2)
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :3] = -100
        fields += [ids, mask, labels]
    return tuple(fields)


def test_orpo_of_one_pair_per_batch_is_exact_and_trains_from_its_cache():
    """One pair per batch: ``selective_log_softmax``'s loop over the rows runs twice (chosen,
    rejected) in every batch. Exact; but the frozen embedding is not cached: the trainer
    concatenates chosen and rejected along the batch inside the step, so its rows are not
    the batch's samples, and only the padded inputs cross the boundary."""
    torch.manual_seed(0)
    step = OddsRatioPreferenceOptimisation()
    batch = _orpo_batch(1)
    split = split_and_verify(step, batch)
    per_sample = {key for key, spec in split.boundary.items() if spec.batch_dim is not None}
    assert per_sample == set(split.input_names)
    held = stage2_paths(split)
    assert {f"model.base_model.model.model.layers.{i}.self_attn" for i in (0, 1)} <= held
    assert_trains_from_its_cache(step, split, [batch, _orpo_batch(1, seed=1)])


@pytest.mark.parametrize("pairs", [2, 3])
def test_orpo_of_several_pairs_caches_the_frozen_work_a_pair_an_entry(pairs):
    """``selective_log_softmax`` (trl/trainer/utils.py) loops in Python over the logits' rows
    (``torch.stack([torch.logsumexp(lg, dim=-1) for lg in logits])``): the traced step would
    hold one row count, so the trace refuses, naming TRL's line. The module-level path takes
    the step: the trainer concatenates chosen then rejected rows (``torch.cat``'s order, two
    rows a pair), and the frozen base's calls on them (the embedding, layer 0's projections)
    are cached a pair an entry (graphsplit/calls/row_folds); it used to refuse them as
    "not per sample"."""
    torch.manual_seed(0)
    step = OddsRatioPreferenceOptimisation()
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(step, _orpo_batch(pairs), path="trace")
    message = str(caught.value)
    assert "Python control flow depends on the batch size" in message
    line = inspect.getsourcelines(trl_utils.selective_log_softmax)
    loop = next(
        line[1] + offset for offset, text in enumerate(line[0]) if "for lg in logits" in text
    )
    assert f"trl/trainer/utils.py:{loop}" in message
    split = graphsplit.split(step, _orpo_batch(pairs))
    assert split.path == "calls"
    embedding = next(v for v in split.plan.verdicts if v.path.endswith("model.embed_tokens"))
    assert embedding.cached and "2 rows a sample, strided" in embedding.line()
    for size, seed in ((pairs, 1), (1, 2), (pairs + 1, 3)):
        checks = graphsplit.verify(step, split, _orpo_batch(size, seed=seed), seed=seed)
        assert checks and all(check.ok for check in checks)
    assert_trains_from_its_cache(step, split, [_orpo_batch(pairs, seed=4), _orpo_batch(2, seed=5)])
