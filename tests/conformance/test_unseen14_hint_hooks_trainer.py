"""Conformance: FitNets-style hint distillation in a Trainer, features taken by forward hooks.

The pattern: feature distillation code does not change the models' forwards; it registers
forward hooks on the layers whose outputs it compares and lets them write the outputs into a
dict the loss reads afterwards (FitNets' "hint" loss, Romero et al. 2015: an MSE between a
trainable regressor of the student's guided layer and the frozen teacher's hint layer). The
hook-and-feature-store form is the one distillation toolkits use (a ``MetaDistiller`` with
``_hook_teacher_module_output(name)`` returning ``def hook_module_output(module, input,
output): self.teacher_intermediate_state[name].append(output)``), here written as a
``transformers.Trainer`` subclass as docs/howto.md's ``DistillationTrainer`` is (its
``compute_loss`` signature, the teacher in ``eval()`` and frozen, called under ``no_grad``),
with the hooks of the brief's form: ``layer.register_forward_hook(lambda m, i, o:
feats.__setitem__(key, o))``. No single upstream file: the step is the pattern's.

The frozen teacher's hint layer writes ``feats["teacher"]`` from inside the teacher's call;
the student's guided layer writes ``feats["student"]``; the loss reads both after the calls.
In stage 2 the teacher is answered from the cache, so its hook does not run: the cached
feature must still reach the loss (the dict entry is what the step reads), never a stale
value left by an earlier call.

What must hold: ``split`` of the trainer's loss and ``split_trainer`` + ``train()`` are exact
(loss, every student and regressor gradient bit for bit; the trainer's logged losses and final
weights equal the plain trainer's), the teacher's hint feature is cached and its weights are
not held by stage 2, and a cache through the disk trains stage 2 exactly.

Result: exact on every path; the teacher is not cached. It used to be a silent wrong result:
the default path (module-level: the whole-step trace refuses, reading ``self.feats["student"]``
as a constant) answered the teacher's whole call from the cache, so the hook inside it never
ran in stage 2 and nothing of the teacher was stored; stage 2 read a stale feature or none (a
fresh process: ``KeyError``). Now a call whose module holds hooked submodules is not cached
(``Verdict.HOOKED``, graphsplit/calls/verdicts.py ``unhooked``): the teacher is opened and its
own frozen calls judged; ``teacher.model`` returns a ``DynamicCache`` (eval mode:
``use_cache``), which no cache stores, so it runs in stage 2 and its hook writes the feature
there; only ``teacher.lm_head`` is cached. The remaining xfail (``HELD_REASON``): the teacher's
weights are still held by stage 2.

Tiny configs: teacher Llama 32 wide, 2 layers (hint: layer 1's output); student Llama 24 wide,
2 layers, 2 heads (guided: layer 0's output), a ``Linear(24, 32)`` regressor on the student.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import graphsplit

pytest.importorskip("transformers")

from accelerate.state import AcceleratorState
from datasets import Dataset
from transformers import LlamaForCausalLM, Trainer, TrainingArguments, default_data_collator

from graphsplit.calls.verdicts import Verdict
from graphsplit.integrations.trainer_loss import TrainerLoss
from graphsplit.integrations.transformers import split_trainer
from tests.conformance.unseen_checks import loss_and_grads
from tests.helpers import assert_stage1_holds_no_trainable, tiny_llama_config

VOCAB = 64
SEQ = 8

HELD_REASON = (
    "a call whose module holds hooked submodules is not cached (graphsplit/calls/verdicts.py "
    "unhooked: stage 2 answers a call whole, so hooks inside it would not run), so the "
    "teacher is opened; teacher.model's output holds a DynamicCache (the teacher is in eval "
    "mode, use_cache defaults on), which calls/analysis.py judges NON_TENSOR, so the whole "
    "LlamaModel runs in stage 2 with its hook, and only teacher.lm_head is cached. Caching "
    "teacher.model.layers.0 and answering layers.1 (whose own hook runs around the answer) "
    "would need the opening to go on below a call refused as NON_TENSOR."
)


@pytest.fixture(autouse=True)
def _one_thread_and_fresh_accelerate_state():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    torch.set_num_threads(threads)


class HintDistillationTrainer(Trainer):
    """docs/howto.md's ``DistillationTrainer`` with a FitNets hint loss instead of the KL: the
    features come from forward hooks writing into a dict."""

    def __init__(self, *args, teacher, hint_weight=1.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.teacher = teacher.eval().requires_grad_(False)
        self.hint_weight = hint_weight
        feats = self.feats = {}
        # the hint layer of the teacher, the guided layer of the student
        self.teacher.model.layers[1].register_forward_hook(
            lambda m, i, o: feats.__setitem__("teacher", o)
        )
        self.model.model.layers[0].register_forward_hook(
            lambda m, i, o: feats.__setitem__("student", o)
        )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        with torch.no_grad():
            self.teacher(**inputs)
        outputs = model(**inputs)
        hint_loss = F.mse_loss(model.hint_regressor(self.feats["student"]), self.feats["teacher"])
        loss = outputs.loss + self.hint_weight * hint_loss
        return (loss, outputs) if return_outputs else loss


def _train_dataset(size: int = 16, seed: int = 0) -> Dataset:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (size, SEQ), generator=generator).tolist()
    return Dataset.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": [[1] * SEQ] * size,
            "labels": [list(row) for row in input_ids],
        }
    )


def _trainer(output_dir: str) -> HintDistillationTrainer:
    torch.manual_seed(0)
    teacher = LlamaForCausalLM(tiny_llama_config(vocab_size=VOCAB))
    student = LlamaForCausalLM(
        tiny_llama_config(vocab_size=VOCAB, hidden_size=24, intermediate_size=48)
    )
    student.hint_regressor = torch.nn.Linear(24, 32)  # FitNets' regressor, trained with it
    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        num_train_epochs=2,
        learning_rate=1e-2,
        logging_steps=1,
        seed=3,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )
    return HintDistillationTrainer(
        model=student,
        args=args,
        train_dataset=_train_dataset(),
        data_collator=default_data_collator,
        teacher=teacher,
    )


def _batch(trainer, start: int, size: int):
    rows = trainer.train_dataset
    return default_data_collator([rows[i] for i in range(start, start + size)])


_BUILT: dict[str, tuple] = {}


def _split(tmp_path_factory):
    if "split" not in _BUILT:
        trainer = _trainer(str(tmp_path_factory.mktemp("out")))
        trainer.model.train()
        loss = TrainerLoss(trainer)  # compute_loss(model, inputs), as split_trainer splits it
        split = graphsplit.split(loss, (_batch(trainer, 0, 4),))
        params = [p for p in trainer.model.parameters() if p.requires_grad]
        _BUILT["split"] = (trainer, loss, split, params)
    return _BUILT["split"]


def test_hint_loss_verifies_on_the_example_and_another_size(tmp_path_factory):
    trainer, loss, split, _params = _split(tmp_path_factory)
    assert_stage1_holds_no_trainable(split)
    for seed, batch in enumerate([_batch(trainer, 0, 4), _batch(trainer, 4, 3)]):
        checks = graphsplit.verify(loss, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


@pytest.mark.xfail(strict=True, reason=HELD_REASON)
def test_teacher_hint_feature_is_cached_and_the_teacher_not_held(tmp_path_factory):
    _trainer, _loss, split, _params = _split(tmp_path_factory)
    held = {name for name, _ in split.stage2.named_parameters()}
    assert not [name for name in held if name.startswith("teacher.")], sorted(held)
    computed = [key for key, spec in split.boundary.items() if spec.source != "input"]
    assert computed, split.report()  # the teacher's layer-1 output (4x8x32), or its call's


def test_stage2_reads_no_stale_feature(tmp_path_factory):
    """Stage 1 of one batch, then of the next one (as ``cache()`` runs it), then stage 2 of
    the first from its stored boundary: the unsplit loss of the first batch."""
    trainer, loss, split, _params = _split(tmp_path_factory)
    first, second = _batch(trainer, 0, 4), _batch(trainer, 4, 4)
    boundary = split.stage1(**first)
    split.stage1(**second)
    torch.manual_seed(0)
    expected = loss(first)
    split.stage1(**second)
    torch.manual_seed(0)
    assert torch.equal(split.stage2(**boundary), expected)


def test_hint_loss_cache_round_trip(tmp_path_factory, tmp_path):
    """Cached through the disk, then trained as an epoch from a cache is: the unsplit losses
    of every batch first (the reference run), then stage 2 on every cached batch; each the
    unsplit step's loss and gradients. (``assert_cache_round_trip`` runs the unsplit step of
    a batch just before stage 2 of the same batch, which refills the feature store with the
    right feature: it passes.)"""
    trainer, loss, split, params = _split(tmp_path_factory)
    loader = [_batch(trainer, 0, 4), _batch(trainer, 4, 4), _batch(trainer, 8, 4)]
    info = graphsplit.cache(split, loader, tmp_path / "cache", progress=False)
    cached = graphsplit.CachedDataset(tmp_path / "cache", split)
    assert info.num_samples == len(cached) == 12
    expected = [
        loss_and_grads(lambda raw=raw: loss(raw), params, seed) for seed, raw in enumerate(loader)
    ]
    for seed, (want_loss, want) in enumerate(expected):
        rows = graphsplit.collate([cached[4 * seed + offset] for offset in range(4)])
        got_loss, got = loss_and_grads(lambda rows=rows: split.stage2(**rows), params, seed)
        assert torch.equal(got_loss, want_loss), (seed, got_loss, want_loss)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def _logged(trainer, *keys):
    return [tuple(e[k] for k in keys) for e in trainer.state.log_history if "loss" in e]


def test_split_trainer_trains_as_the_plain_hint_trainer(tmp_path):
    plain = _trainer(str(tmp_path / "plain"))
    plain.train()
    trainer = _trainer(str(tmp_path / "split"))
    parts = split_trainer(trainer, str(tmp_path / "cache"))
    trainer.train()
    assert len(_logged(trainer, "loss")) == len(_logged(plain, "loss")) == 8
    assert _logged(trainer, "loss", "grad_norm") == _logged(plain, "loss", "grad_norm")
    one, other = plain.model.state_dict(), trainer.model.state_dict()
    assert all(torch.equal(one[k], other[k]) for k in one)
    verdicts = {(v.path, v.index): v.verdict for v in parts.split.plan.verdicts}
    assert verdicts[("teacher.model", 0)] is Verdict.NON_TENSOR  # runs, hook and all, in stage 2
    assert verdicts[("teacher.lm_head", 0)] is Verdict.CACHED


def test_the_report_names_the_hooked_layer(tmp_path_factory):
    _trainer, _loss, split, _params = _split(tmp_path_factory)
    report = split.report()
    assert "opened: teacher: every call takes an input that" in report
    assert "or holds hooks that must run" in report
    assert "teacher.lm_head call 0: cached" in report
    assert "a value a forward hook stored inside a module call" in split.reason
