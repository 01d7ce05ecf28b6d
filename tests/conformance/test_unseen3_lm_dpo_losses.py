"""Conformance: TRL DPO with a separate frozen reference model, in the loss variants users pick.

``DPOTrainer._compute_loss`` (trl 1.16, ``trl/trainer/dpo_trainer.py``) with a fully trained
Llama policy and a frozen ``ref_model`` (``precompute_ref_log_probs=False``), the fused LM head
TRL patches onto both (``add_fused_lm_head``), copied line for line less the metrics it logs:
``loss_type`` in ``sigmoid``, ``hinge``, ``ipo``, ``robust`` (label smoothing 0.1),
``exo_pair`` (label smoothing 1e-3), ``bco_pair``, ``nca_pair``, ``sppo_hard``, ``apo_zero``,
``apo_down``, ``aot`` and ``aot_unpaired`` (sort across the batch), ``discopop``,
``sigmoid_norm``; RPO, which trl 1.16 spells
``loss_type=["sigmoid", "sft"]`` with ``loss_weights=[1.0, alpha]`` (the policy's NLL on
the chosen completions: the ``rpo_alpha`` of earlier TRL); WPO's ``use_weighting=True`` (the
policy's ``log_sum_sq_probs`` under ``no_grad``); LD-DPO's ``ld_alpha``; an f-divergence;
MPO's weighted mix of three losses.

The reference's log-probs are cached (one number per row, down to TRL's
``ref_logps = ref_per_token_logps.sum(dim=1)``), the policy's never, whatever the loss does
with them. Each variant is verified bit for bit (on the example and on a batch of another
size and seed) and trained from its cache after an optimizer step
(:func:`~tests.conformance.test_unseen_lm.assert_trains_from_its_cache`).

Two variants take the module-level path, after a refusal of the trace that names TRL's line:
RPO's ``sft`` term indexes by a boolean mask (an output size read from values) and WPO's
weights are computed under ``torch.no_grad()`` from the trained policy's outputs. There the
reference model's per-token log-probs are cached, as its call's output.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphsplit
from tests.conformance.matrix import ids_and_mask
from tests.conformance.test_unseen_lm import assert_trains_from_its_cache
from tests.helpers import split_and_verify, tiny_llama_config

transformers = pytest.importorskip("transformers")
trl_utils = pytest.importorskip("trl.trainer.utils")
dpo_trainer = pytest.importorskip("trl.trainer.dpo_trainer")


class DirectPreferenceOptimisation(nn.Module):
    """``DPOTrainer._compute_loss`` with a separate frozen reference model (the trainer's
    ``self.model`` / ``self.ref_model``, ``aux_loss_enabled=False``, the metrics left out)."""

    def __init__(
        self,
        loss_type: list[str],
        loss_weights: list[float] | None = None,
        *,
        beta: float = 0.1,
        label_smoothing: float = 0.0,
        use_weighting: bool = False,
        ld_alpha: float | None = None,
        f_divergence_type: str = "reverse_kl",
        discopop_tau: float = 0.05,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = transformers.LlamaForCausalLM(tiny_llama_config())
        torch.manual_seed(1)
        self.ref_model = transformers.LlamaForCausalLM(tiny_llama_config()).requires_grad_(False)
        self.ref_model.eval()
        # DPOTrainer.__init__: the fused LM head on both models.
        outputs = ("log_probs", "entropy", "mean_logits", "is_top1")
        if use_weighting:
            outputs += ("log_sum_sq_probs",)
        trl_utils.add_fused_lm_head(self.model, outputs=outputs)
        trl_utils.add_fused_lm_head(self.ref_model)
        self.loss_types = loss_type
        self.loss_weights = loss_weights or [1.0] * len(loss_type)
        self.beta, self.label_smoothing, self.use_weighting = beta, label_smoothing, use_weighting
        self.ld_alpha, self.f_divergence_type = ld_alpha, f_divergence_type
        self.f_alpha_divergence_coef, self.discopop_tau = 0.5, discopop_tau
        self.precompute_ref_logps = False

    def forward(self, input_ids, attention_mask, completion_mask):
        inputs = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "completion_mask": completion_mask,
        }
        model = self.model
        device = input_ids.device
        _non_model_keys = {"completion_mask", "ref_chosen_logps", "ref_rejected_logps"}
        model_kwargs = {k: v for k, v in inputs.items() if k not in _non_model_keys}
        model_kwargs["use_cache"] = False
        completion_mask = inputs["completion_mask"]
        shift_completion_mask = completion_mask[..., 1:]
        labels = inputs["input_ids"].masked_fill(completion_mask == 0, -100)
        outputs = model(**model_kwargs, labels=labels, fused_lm_head=True)
        # Prompt-learning PEFT prepends virtual tokens to the outputs; keep the real tokens'
        seq_len = shift_completion_mask.size(1)
        per_token_logps = outputs.log_probs[:, -seq_len:]
        if self.ld_alpha is None:
            logps = per_token_logps.sum(dim=1)  # sum over sequence length
        else:
            comp_pos = shift_completion_mask.cumsum(dim=1)
            comp_lens = shift_completion_mask.sum(dim=1).long()
            chosen_lens, rejected_lens = comp_lens.chunk(2, dim=0)
            shared_lens = torch.minimum(chosen_lens, rejected_lens)
            shared_lens = torch.cat([shared_lens, shared_lens], dim=0).to(device)
            shared_mask = (comp_pos > 0) & (
                comp_pos <= shared_lens.unsqueeze(1)
            )  # shared: 1 <= pos <= shared_len
            tail_mask = comp_pos > shared_lens.unsqueeze(1)  # tail: pos > shared_len
            shared_logps = (per_token_logps * shared_mask).sum(dim=1)
            tail_logps = (per_token_logps * tail_mask).sum(dim=1)
            logps = shared_logps + self.ld_alpha * tail_logps
        chosen_logps, rejected_logps = logps.chunk(2, dim=0)  # batch is [chosen, rejected]

        # The reference forward only needs logits for log-probs.
        ref_model_kwargs = {k: v for k, v in model_kwargs.items() if k != "output_router_logits"}
        with torch.no_grad():
            ref_outputs = self.ref_model(**ref_model_kwargs, labels=labels, fused_lm_head=True)
        ref_per_token_logps = ref_outputs.log_probs[:, -seq_len:]
        if self.ld_alpha is None:
            ref_logps = ref_per_token_logps.sum(dim=1)  # sum over sequence length
        else:
            # reuse comp_pos/shared_mask/tail_mask computed above (completion_mask only)
            ref_shared_logps = (ref_per_token_logps * shared_mask).sum(dim=1)
            ref_tail_logps = (ref_per_token_logps * tail_mask).sum(dim=1)
            ref_logps = ref_shared_logps + self.ld_alpha * ref_tail_logps
        ref_chosen_logps, ref_rejected_logps = ref_logps.chunk(
            2, dim=0
        )  # batch is [chosen, rejected]

        # Get the log ratios for the chosen and rejected responses
        chosen_logratios = chosen_logps - ref_chosen_logps
        rejected_logratios = rejected_logps - ref_rejected_logps

        if self.f_divergence_type == "reverse_kl":  # standard DPO
            chosen_scores = chosen_logratios
            rejected_scores = rejected_logratios
        elif self.f_divergence_type == "forward_kl":
            # f'(t) = 1 - 1/t
            chosen_scores = 1 - torch.exp(-chosen_logratios)
            rejected_scores = 1 - torch.exp(-rejected_logratios)
        elif self.f_divergence_type == "js_divergence":
            # f'(t) = log(2t/(t+1)) = log 2 + logsigmoid(log t)
            chosen_scores = math.log(2) + F.logsigmoid(chosen_logratios)
            rejected_scores = math.log(2) + F.logsigmoid(rejected_logratios)

        delta_score = chosen_scores - rejected_scores

        loss = 0.0
        for loss_type, loss_weight in zip(self.loss_types, self.loss_weights, strict=True):
            if loss_type == "sigmoid":
                per_sequence_loss = -F.logsigmoid(self.beta * delta_score)

            elif loss_type == "hinge":
                per_sequence_loss = torch.relu(1 - self.beta * delta_score)

            elif loss_type == "ipo":
                chosen_mask, rejected_mask = completion_mask.chunk(2, dim=0)
                chosen_avg_score = chosen_scores / chosen_mask.sum(dim=1).clamp(min=1.0)
                rejected_avg_score = rejected_scores / rejected_mask.sum(dim=1).clamp(min=1.0)
                ipo_delta = chosen_avg_score - rejected_avg_score
                # (Eq. 17) of the paper, beta the IPO loss's regularization parameter τ.
                per_sequence_loss = (ipo_delta - 1 / (2 * self.beta)) ** 2

            elif loss_type == "exo_pair":
                epsilon = torch.tensor(self.label_smoothing, device=device)
                qw = torch.sigmoid(self.beta * delta_score)
                log_qw = F.logsigmoid(self.beta * delta_score)
                log_pw = torch.log1p(-epsilon)
                ql = torch.sigmoid(-self.beta * delta_score)
                log_ql = F.logsigmoid(-self.beta * delta_score)
                log_pl = torch.log(epsilon)
                per_sequence_loss = qw * (log_qw - log_pw) + ql * (log_ql - log_pl)

            elif loss_type == "nca_pair":
                chosen_rewards = self.beta * chosen_logratios
                rejected_rewards = self.beta * rejected_logratios
                per_sequence_loss = (
                    -F.logsigmoid(chosen_rewards)
                    - 0.5 * F.logsigmoid(-chosen_rewards)
                    - 0.5 * F.logsigmoid(-rejected_rewards)
                )

            elif loss_type == "robust":
                clean_loss_term = -(1 - self.label_smoothing) * F.logsigmoid(
                    self.beta * delta_score
                )
                flipped_loss_term = -self.label_smoothing * F.logsigmoid(-self.beta * delta_score)
                per_sequence_loss = (clean_loss_term - flipped_loss_term) / (
                    1 - 2 * self.label_smoothing
                )

            elif loss_type == "bco_pair":
                chosen_rewards = self.beta * chosen_logratios
                rejected_rewards = self.beta * rejected_logratios
                per_sequence_loss = -F.logsigmoid(chosen_rewards) - F.logsigmoid(-rejected_rewards)

            elif loss_type == "sppo_hard":
                winner_margin_error = (chosen_logratios - 0.5 / self.beta) ** 2
                loser_margin_error = (rejected_logratios + 0.5 / self.beta) ** 2
                per_sequence_loss = winner_margin_error + loser_margin_error

            elif loss_type == "aot":
                logratios = chosen_logps - rejected_logps
                ref_logratios = ref_chosen_logps - ref_rejected_logps
                logratios_sorted, _ = torch.sort(logratios, dim=0)
                ref_logratios_sorted, _ = torch.sort(ref_logratios, dim=0)
                delta = logratios_sorted - ref_logratios_sorted
                per_sequence_loss = (
                    -F.logsigmoid(self.beta * delta) * (1 - self.label_smoothing)
                    - F.logsigmoid(-self.beta * delta) * self.label_smoothing
                )

            elif loss_type == "aot_unpaired":
                chosen_logratios_sorted, _ = torch.sort(chosen_logratios, dim=0)
                rejected_logratios_sorted, _ = torch.sort(rejected_logratios, dim=0)
                delta = chosen_logratios_sorted - rejected_logratios_sorted
                per_sequence_loss = (
                    -F.logsigmoid(self.beta * delta) * (1 - self.label_smoothing)
                    - F.logsigmoid(-self.beta * delta) * self.label_smoothing
                )

            elif loss_type == "apo_zero":
                # Eqn (7) of the APO paper (https://huggingface.co/papers/2408.06266)
                losses_chosen = 1 - torch.sigmoid(self.beta * chosen_logratios)
                losses_rejected = torch.sigmoid(self.beta * rejected_logratios)
                per_sequence_loss = losses_chosen + losses_rejected

            elif loss_type == "apo_down":
                # Eqn (8) of the APO paper (https://huggingface.co/papers/2408.06266)
                losses_chosen = torch.sigmoid(self.beta * chosen_logratios)
                losses_rejected = 1 - torch.sigmoid(
                    self.beta * (chosen_logratios - rejected_logratios)
                )
                per_sequence_loss = losses_chosen + losses_rejected

            elif loss_type == "discopop":
                # Eqn (5) of the DiscoPOP paper (https://huggingface.co/papers/2406.08414)
                logits = delta_score * self.beta
                # Modulate the mixing coefficient based on the log ratio magnitudes
                log_ratio_modulation = torch.sigmoid(logits / self.discopop_tau)
                logistic_component = -F.logsigmoid(logits)
                exp_component = torch.exp(-logits)
                # Blend between logistic and exponential component based on log ratio modulation
                per_sequence_loss = (
                    logistic_component * (1 - log_ratio_modulation)
                    + exp_component * log_ratio_modulation
                )

            elif loss_type == "sft":
                chosen_mask, _ = shift_completion_mask.chunk(2, dim=0)
                chosen_per_token_logps, _ = per_token_logps.chunk(2, dim=0)
                batch_loss = -chosen_per_token_logps[chosen_mask.bool()].mean()
                batch_size = chosen_per_token_logps.size(0)
                per_sequence_loss = batch_loss.expand(batch_size)

            elif loss_type == "sigmoid_norm":
                chosen_mask, rejected_mask = completion_mask.chunk(2, dim=0)
                chosen_avg_score = chosen_scores / chosen_mask.sum(dim=1).clamp(min=1.0)
                rejected_avg_score = rejected_scores / rejected_mask.sum(dim=1).clamp(min=1.0)
                delta = chosen_avg_score - rejected_avg_score
                per_sequence_loss = -F.logsigmoid(self.beta * delta)

            if self.use_weighting:
                # Eq (2) of the WPO paper: https://huggingface.co/papers/2406.11827
                completion_lengths = shift_completion_mask.sum(dim=1).clamp_min(1)
                with torch.no_grad():
                    aligned_logps = (
                        per_token_logps - outputs.log_sum_sq_probs[:, -seq_len:]
                    ) * shift_completion_mask
                mean_logps = aligned_logps.sum(dim=1) / completion_lengths
                weights = torch.exp(mean_logps)
                chosen_weights, rejected_weights = weights.chunk(2, dim=0)
                per_sequence_loss *= chosen_weights * rejected_weights

            loss += per_sequence_loss.mean() * loss_weight

        return loss


def _preference_batch(pairs: int, tokens: int = 8, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """``DataCollatorForPreference``: chosen rows then rejected rows, right-padded, a 3-token
    prompt outside the completion mask."""
    ids, mask = ids_and_mask(2 * pairs, tokens=tokens, seed=seed)
    completion_mask = mask.clone()
    completion_mask[:, :3] = 0
    return ids, mask, completion_mask


VARIANTS = {
    "sigmoid": {"loss_type": ["sigmoid"]},
    "hinge": {"loss_type": ["hinge"]},
    "ipo": {"loss_type": ["ipo"]},
    "robust": {"loss_type": ["robust"], "label_smoothing": 0.1},
    "exo_pair": {"loss_type": ["exo_pair"], "label_smoothing": 1e-3},
    "bco_pair": {"loss_type": ["bco_pair"]},
    "apo_zero": {"loss_type": ["apo_zero"]},
    "apo_down": {"loss_type": ["apo_down"]},
    "aot": {"loss_type": ["aot"]},
    "aot_unpaired": {"loss_type": ["aot_unpaired"], "label_smoothing": 0.1},
    "nca_pair": {"loss_type": ["nca_pair"]},
    "sppo_hard": {"loss_type": ["sppo_hard"]},
    "discopop": {"loss_type": ["discopop"]},
    "sigmoid_norm": {"loss_type": ["sigmoid_norm"]},
    "ld_dpo": {"loss_type": ["sigmoid"], "ld_alpha": 0.5},
    "js_divergence": {"loss_type": ["sigmoid"], "f_divergence_type": "js_divergence"},
    "mpo": {"loss_type": ["sigmoid", "bco_pair", "ipo"], "loss_weights": [0.8, 0.2, 1.0]},
}


def _fused_heads(split) -> list:
    """The calls of TRL's chunked log-prob kernel, in the order the step makes them."""
    return [
        node
        for node in split.graph.nodes
        if "ChunkedLogProb" in getattr(node.target, "__name__", "")
    ]


def _reference_only_in_stage1(split) -> None:
    held = {name for name, _ in split.stage1.named_modules() if name}
    assert held and all(name.startswith("ref_model") for name in held), held
    assert not any(name.startswith("ref_model") for name, _ in split.stage2.named_parameters())


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_dpo_variant_caches_the_reference_log_probs_and_never_the_policys(variant, tmp_path):
    step = DirectPreferenceOptimisation(**VARIANTS[variant])
    pairs = 2
    batch = _preference_batch(pairs)
    split = split_and_verify(step, batch)
    assert split.path == "trace"
    # The policy, all trainable, is one stage-2 call; the frozen reference is traced into, its
    # fused head (TRL's chunked log-prob kernel) in stage 1.
    (policy,) = [n for n in split.graph.nodes if n.op == "call_module" and n.target == "model"]
    assert policy in split.cut.stage2
    (reference_head,) = _fused_heads(split)
    assert reference_head in split.cut.stage1
    _reference_only_in_stage1(split)
    floats = {
        key: spec.shape
        for key, spec in split.boundary.items()
        if spec.dtype == torch.float32 and spec.batch_dim is not None  # EXO: log(ε) constants
    }
    if VARIANTS[variant].get("ld_alpha") is None:
        # One number per row: TRL's ``ref_logps = ref_per_token_logps.sum(dim=1)``.
        assert list(floats.values()) == [(2 * pairs,)], floats
    else:
        # LD-DPO weights the tail tokens: the shared and tail sums (or what makes them).
        assert all(shape[0] == 2 * pairs for shape in floats.values()), floats
    other = _preference_batch(3, seed=1)
    assert all(c.ok for c in graphsplit.verify(step, split, other, seed=2))
    assert_trains_from_its_cache(step, split, [batch, other], tmp_path / "cache")


def test_rpo_adds_the_policys_nll_on_chosen_which_the_trace_refuses_at_boolean_indexing(
    tmp_path,
):
    """RPO (``loss_type=["sigmoid", "sft"]``, ``loss_weights=[1.0, 0.5]``): the ``sft`` term is
    ``-chosen_per_token_logps[chosen_mask.bool()].mean()``, a boolean-mask index, whose output
    size depends on the mask's values. The trace refuses it; the module-level path caches the
    reference model's call (its inputs are the sample alone) and runs the policy and the
    indexing live in stage 2."""
    step = DirectPreferenceOptimisation(["sigmoid", "sft"], [1.0, 0.5])
    batch = _preference_batch(2)
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(step, batch, path="trace")
    assert "reads the value of a tensor" in str(caught.value)
    assert "chosen_per_token_logps[chosen_mask.bool()].mean()" in str(caught.value)
    split = split_and_verify(step, batch)
    assert split.path == "calls"
    cached = {k for k, s in split.boundary.items() if s.dtype.is_floating_point}
    assert cached and all(key.startswith("ref_model") for key in cached), cached
    other = _preference_batch(3, seed=1)
    assert all(c.ok for c in graphsplit.verify(step, split, other, seed=2))
    assert_trains_from_its_cache(step, split, [batch, other], tmp_path / "cache")


def test_wpo_weighting_under_no_grad_takes_the_module_level_path(tmp_path):
    """WPO (``use_weighting=True``) computes its weights from the policy's log-probs inside
    ``with torch.no_grad():``. fx records ops, not ``with`` blocks: the trace refuses it,
    naming TRL's line and the fix (``.detach()``); the module-level path runs the step's own
    Python in stage 2, ``no_grad`` included, and caches the reference model's per-token
    log-probs (its call's inputs are the sample alone)."""
    step = DirectPreferenceOptimisation(["sigmoid"], use_weighting=True)
    batch = _preference_batch(2)
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(step, batch, path="trace")
    message = str(caught.value)
    assert "disables gradients" in message
    assert "outputs.log_sum_sq_probs[:, -seq_len:]" in message
    assert ".detach()" in caught.value.fix.words
    split = split_and_verify(step, batch)
    assert split.path == "calls"
    floats = {k: s.shape for k, s in split.boundary.items() if s.dtype.is_floating_point}
    assert floats == {"ref_model__0__log_probs": (4, 7)}
    other = _preference_batch(3, seed=1)
    assert all(c.ok for c in graphsplit.verify(step, split, other, seed=2))
    assert_trains_from_its_cache(step, split, [batch, other], tmp_path / "cache")


def test_a_lora_policy_beside_a_separate_reference_caches_both_frozen_parts(tmp_path):
    """``DPOTrainer(model, ref_model=..., peft_config=...)``: the fused head patched onto the
    base model, then LoRA; the separate reference stays a full frozen model. Stage 1 computes
    the reference's row sums and the policy's frozen work below its first LoRA layer; no LoRA
    layer runs there, and the policy's log-probs are never cached."""
    peft = pytest.importorskip("peft")
    step = DirectPreferenceOptimisation(["sigmoid"])
    config = peft.LoraConfig(
        task_type="CAUSAL_LM",
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        init_lora_weights="gaussian",
    )
    step.model = peft.get_peft_model(step.model, config)
    generator = torch.Generator().manual_seed(5)
    for name, param in step.model.named_parameters():
        if "lora_B" in name:
            param.data = torch.randn(param.shape, generator=generator) * 0.02
    batch = _preference_batch(2)
    split = split_and_verify(step, batch)
    assert split.path == "trace"
    rows = {k: s.shape for k, s in split.boundary.items() if s.dtype == torch.float32}
    assert rows["model_base_model_model_model_embed_tokens"] == (4, 8, 32)
    reference_sums = [k for k, shape in rows.items() if shape == (4,)]
    assert len(reference_sums) == 1
    assert split.boundary[reference_sums[0]].source.endswith(
        f":{_line_of('ref_logps = ref_per_token_logps.sum(dim=1)  # sum over sequence length')}"
    )
    assert all("lora" not in name for name, _ in split.stage1.named_parameters())
    held = {name for name, _ in split.stage2.named_modules()}
    assert "model.base_model.model.model.layers.0.self_attn.q_proj.lora_A.default" in held
    assert not any(name.startswith("ref_model") for name in held)
    other = _preference_batch(3, seed=1)
    assert all(c.ok for c in graphsplit.verify(step, split, other, seed=2))
    assert_trains_from_its_cache(step, split, [batch, other], tmp_path / "cache")


def _line_of(text: str) -> int:
    """The line of this file that starts with ``text`` (once)."""
    from pathlib import Path

    lines = Path(__file__).read_text().splitlines()
    (number,) = [n for n, line in enumerate(lines, 1) if line.strip().startswith(text)]
    return number
