"""Conformance: a frozen model fed, under ``torch.no_grad()``, a value of the trained weights.

Online-RL and distillation steps score the policy's own output with a frozen model inside
``no_grad``: a reward model reads the policy's predictions (TRL's online trainers score the
policy's completions), a teacher reads the student's input embeddings. The value carries no
autograd record, so two probes under different seeds see the frozen call's inputs alike; a
module-level split that cached the call would answer it with what the *old* weights gave once
an optimizer step moves them. The module-level path therefore moves the trainable parameters
in its second probe (``graphsplit/calls/provenance.py``, ``moved``): such a call is then judged
``trainable-value`` and runs in stage 2, or, when nothing else is left to cache, the split is
refused naming it.

The models are real transformers classes from tiny configs with random weights, LoRA'd with
peft as TRL's ``peft_config`` does (``init_lora_weights`` default: ``B`` starts at zero, and
the move must change it too). Each step is checked where the silent wrong split would show:
stage 1 caches under the first weights, an optimizer step moves the trainable ones, and stage
2 on the old cache must still equal the unsplit step, loss and every gradient bit for bit.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphsplit
from graphsplit.calls import Verdict
from tests.conformance.matrix import ids_and_mask
from tests.conformance.unseen_checks import loss_and_grads
from tests.helpers import tiny_llama_config

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
trl_utils = pytest.importorskip("trl.trainer.utils")

VOCAB = 64


def _gpt2_config(**overrides) -> object:
    settings = {"n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": VOCAB, "n_positions": 32}
    return transformers.GPT2Config(**{**settings, **overrides})


def _sequence_log_probs(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor):
    """TRL's ``selective_log_softmax`` summed over the completion tokens (shifted by one)."""
    logits, labels, mask = logits[:, :-1], labels[:, 1:], mask[:, 1:]
    per_token = torch.gather(logits.log_softmax(-1), 2, labels.unsqueeze(-1)).squeeze(-1)
    return (per_token * mask).sum(-1)


class RewardWeightedPolicy(nn.Module):
    """A KL-regularised policy-gradient step: a frozen reward model scores the policy's own
    (soft) predictions under ``no_grad``; the frozen reference model's log-probs of the batch
    give the KL term. The reward depends on the trained weights, the reference on the sample
    alone. Dropout is off in the policy (``disable_dropout=True``, TRL's online default), so
    no draw tells the two probes apart: only the moved weights do."""

    def __init__(self, beta: float = 0.1) -> None:
        super().__init__()
        lora = peft.LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules=["c_attn"])
        self.policy = peft.get_peft_model(transformers.GPT2LMHeadModel(_gpt2_config()), lora)
        trl_utils.disable_dropout_in_model(self.policy)  # TRL's online trainers' default
        self.ref_model = transformers.GPT2LMHeadModel(_gpt2_config()).eval()
        self.ref_model.requires_grad_(False)
        reward = transformers.GPT2ForSequenceClassification(_gpt2_config(num_labels=1))
        reward.config.pad_token_id = 0
        self.reward_model = reward.eval().requires_grad_(False)
        self.beta = beta

    def forward(self, input_ids, attention_mask):
        logits = self.policy(input_ids=input_ids, attention_mask=attention_mask).logits
        with torch.no_grad():
            ref_logits = self.ref_model(input_ids=input_ids, attention_mask=attention_mask).logits
            ref_logps = _sequence_log_probs(ref_logits, input_ids, attention_mask)
            # The reward model reads the policy's expected next-token embeddings.
            embeddings = self.reward_model.get_input_embeddings().weight
            soft_tokens = logits.detach().softmax(-1) @ embeddings
            rewards = self.reward_model(
                inputs_embeds=soft_tokens, attention_mask=attention_mask
            ).logits.squeeze(-1)
        logps = _sequence_log_probs(logits, input_ids, attention_mask)
        advantages = rewards - rewards.mean()
        kl = logps - ref_logps
        return (-(advantages * logps) + self.beta * kl).mean()


class EmbeddingDistillation(nn.Module):
    """A student distilled from a frozen teacher that reads the student's input embeddings
    (``student.get_input_embeddings()(ids)`` under ``no_grad``). The student's embedding is
    trained (peft ``modules_to_save``), so every frozen call depends on trained weights."""

    def __init__(self, temperature: float = 2.0) -> None:
        super().__init__()
        lora = peft.LoraConfig(
            task_type="CAUSAL_LM",
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj"],
            modules_to_save=["embed_tokens"],
        )
        student = transformers.LlamaForCausalLM(tiny_llama_config())
        self.student = peft.get_peft_model(student, lora)
        self.teacher = transformers.LlamaForCausalLM(tiny_llama_config()).eval()
        self.teacher.requires_grad_(False)
        self.temperature = temperature

    def forward(self, input_ids, attention_mask):
        with torch.no_grad():
            embeds = self.student.get_input_embeddings()(input_ids)
            teacher_logits = self.teacher(
                inputs_embeds=embeds, attention_mask=attention_mask
            ).logits
        student_logits = self.student(input_ids=input_ids, attention_mask=attention_mask).logits
        t = self.temperature
        return F.kl_div(
            F.log_softmax(student_logits / t, -1),
            F.log_softmax(teacher_logits / t, -1),
            log_target=True,
            reduction="batchmean",
        ) * (t * t)


def _trainable(step: nn.Module) -> list[nn.Parameter]:
    return [param for param in step.parameters() if param.requires_grad]


def _state(step: nn.Module) -> list[tuple[str, torch.Tensor, int, int, bool]]:
    return [
        (name, param.detach().clone(), param.data_ptr(), param._version, param.requires_grad)
        for name, param in step.named_parameters()
    ]


def _verdicts(split) -> dict[str, Verdict]:
    return {f"{v.path} call {v.index}": v.verdict for v in split.plan.verdicts}


def test_a_reward_model_fed_the_policy_under_no_grad_runs_in_stage2():
    torch.manual_seed(0)
    step = RewardWeightedPolicy()
    ids, mask = ids_and_mask(2, vocab=VOCAB)
    split = graphsplit.split(step, (ids, mask), path="calls")
    verdicts = _verdicts(split)
    assert verdicts["ref_model call 0"] is Verdict.CACHED
    assert verdicts["reward_model call 0"] is Verdict.TRAINABLE_VALUE
    report = split.report()
    assert "reward_model call 0: an input depends on a trainable parameter without" in report
    held = {name.split(".")[0] for name, _ in split.stage2.named_modules() if name}
    assert "reward_model" in held and "ref_model" not in held

    torch.manual_seed(1234)
    with torch.no_grad():
        boundary = split.stage1(ids, mask)
    params = _trainable(step)
    old_loss, _ = loss_and_grads(lambda: step(ids, mask), params, seed=7)
    optimizer = torch.optim.AdamW(params, lr=1e-2)  # moves every LoRA weight, B included
    torch.manual_seed(0)
    step(ids, mask).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    expected, expected_grads = loss_and_grads(lambda: step(ids, mask), params, seed=7)
    actual, actual_grads = loss_and_grads(lambda: split.stage2(**boundary), params, seed=7)
    assert not torch.equal(expected, old_loss)  # the weights moved, and the loss with them
    assert torch.equal(actual, expected), (actual, expected)
    for want, got in zip(expected_grads, actual_grads, strict=True):
        assert (want is None) == (got is None)
        assert want is None or torch.equal(want, got)


def test_a_teacher_fed_the_students_embeddings_is_refused_naming_the_call():
    torch.manual_seed(0)
    step = EmbeddingDistillation()
    ids, mask = ids_and_mask(2, vocab=VOCAB)
    with pytest.raises(graphsplit.SplitError) as caught:
        graphsplit.split(step, (ids, mask), path="calls")
    message = str(caught.value)
    assert "no frozen module call whose inputs are a function of the sample alone" in message
    assert (
        "teacher call 0: an input depends on a trainable parameter without autograd's record"
        in message
    )
    assert "fix:" in message


@pytest.mark.parametrize("make", [RewardWeightedPolicy, EmbeddingDistillation])
def test_split_leaves_every_parameter_as_it_was(make):
    torch.manual_seed(0)
    step = make()
    ids, mask = ids_and_mask(2, vocab=VOCAB)
    before = _state(step)
    # The distillation step is refused; its parameters must be untouched all the same.
    with contextlib.suppress(graphsplit.SplitError):
        graphsplit.split(step, (ids, mask), path="calls")
    after = _state(step)
    assert [entry[0] for entry in before] == [entry[0] for entry in after]
    for (name, value, pointer, version, flag), (_, now, pointer_now, version_now, flag_now) in zip(
        before, after
    ):
        assert torch.equal(value, now), name
        assert (pointer, version, flag) == (pointer_now, version_now, flag_now), name
