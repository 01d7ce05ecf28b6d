"""Conformance: DistilBERT's distillation step (transformers' research project
``examples/research_projects/distillation/distiller.py``, the ``Distiller`` class).

A frozen ``BertForMaskedLM`` teacher (``teacher.eval()`` in ``Distiller.train``; it is in no
optimizer, here ``requires_grad_(False)``) and a ``DistilBertForMaskedLM`` student in train mode
(dropout live), both built with ``output_hidden_states=True`` as ``train.py`` builds them, and with
``return_dict=False`` (the tuple outputs of the transformers ``distiller.py`` was written for:
``s_logits, s_hidden_states = self.student(...)`` unpacks one; a v5 ``ModelOutput`` would unpack
into its keys). The flags are
``train.py``'s for DistilBERT: ``--mlm --alpha_ce 5.0 --alpha_mlm 2.0 --alpha_cos 1.0
--alpha_clm 0.0 --temperature 2.0``, ``mlm_mask_prop 0.15``, ``word_mask/keep/rand 0.8/0.1/0.1``,
``restrict_ce_to_mask`` off.

``Distiller.prepare_batch_mlm``, ``round_batch`` and ``step`` are verbatim but for ``step``'s
tail: the ``.item()`` bookkeeping of the losses and ``self.optimize(loss)`` (the backward) are
left out and the loss is returned. ``step`` runs the teacher under ``torch.no_grad()``, selects
the non-padding positions of both models' logits with ``torch.masked_select`` (a size that
depends on the mask's values), takes the temperature-scaled ``KLDivLoss(reduction="batchmean")``,
the MLM cross-entropy on the student's logits and a ``CosineEmbeddingLoss`` between both last
hidden states at those positions.

Two forms:

- ``distiller``: the body of ``Distiller.train``'s loop, ``prepare_batch_mlm(batch)`` then
  ``step(...)`` on the loader's ``(token_ids, lengths)``. The masking draws (``multinomial``,
  ``random_``) happen in the step, before the teacher: the teacher sees another masked input
  every step and nothing of it may be cached.
- ``premasked``: the masking done once, in the data (``prepare_batch_mlm`` run by the data
  pipeline), and ``step(input_ids, attention_mask, lm_labels)`` as the step: the teacher's work
  is a function of the sample and must be cached.

What must hold: each step splits on the default path exactly (loss and every student gradient
bit for bit, on the example and on a batch of another size), the teacher's weights are held by
stage 2 only where its input is random, and a cache through the disk trains stage 2 exactly.

Tiny configs: BERT and DistilBERT 32 wide, 2 layers, 2 heads, a vocabulary of 40.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import graphsplit
from tests.conformance.unseen2_data_checks import assert_cache_round_trip
from tests.helpers import assert_stage1_holds_no_trainable

transformers = pytest.importorskip("transformers")

VOCAB = 40
SPECIAL = {"pad_token": 0, "unk_token": 1, "cls_token": 2, "sep_token": 3, "mask_token": 4}


class Distiller:
    """``distiller.py``'s ``Distiller``: its ``__init__`` settings for MLM, and its methods."""

    def __init__(self, params, student, teacher, token_probs):
        self.params = params
        self.student = student
        self.teacher = teacher
        self.fp16 = params.fp16
        self.vocab_size = student.config.vocab_size
        self.temperature = params.temperature
        self.alpha_ce = params.alpha_ce
        self.alpha_mlm = params.alpha_mlm
        self.alpha_clm = params.alpha_clm
        self.alpha_mse = params.alpha_mse
        self.alpha_cos = params.alpha_cos
        self.mlm = params.mlm
        self.mlm_mask_prop = params.mlm_mask_prop
        self.pred_probs = torch.FloatTensor([params.word_mask, params.word_keep, params.word_rand])
        self.token_probs = token_probs
        self.ce_loss_fct = nn.KLDivLoss(reduction="batchmean")
        self.lm_loss_fct = nn.CrossEntropyLoss(ignore_index=-100)
        if self.alpha_mse > 0.0:
            self.mse_loss_fct = nn.MSELoss(reduction="sum")
        if self.alpha_cos > 0.0:
            self.cosine_loss_fct = nn.CosineEmbeddingLoss(reduction="mean")

    def prepare_batch_mlm(self, batch):
        token_ids, lengths = batch
        token_ids, lengths = self.round_batch(x=token_ids, lengths=lengths)
        assert token_ids.size(0) == lengths.size(0)

        attn_mask = (
            torch.arange(token_ids.size(1), dtype=torch.long, device=lengths.device)
            < lengths[:, None]
        )

        bs, max_seq_len = token_ids.size()
        mlm_labels = token_ids.new(token_ids.size()).copy_(token_ids)

        x_prob = self.token_probs[token_ids.flatten()]
        n_tgt = math.ceil(self.mlm_mask_prop * lengths.sum().item())
        tgt_ids = torch.multinomial(x_prob / x_prob.sum(), n_tgt, replacement=False)
        pred_mask = torch.zeros(
            bs * max_seq_len, dtype=torch.bool, device=token_ids.device
        )  # previously `dtype=torch.uint8`, cf pytorch 1.2.0 compatibility
        pred_mask[tgt_ids] = 1
        pred_mask = pred_mask.view(bs, max_seq_len)

        pred_mask[token_ids == self.params.special_tok_ids["pad_token"]] = 0

        # mask a number of words == 0 [8] (faster with fp16)
        if self.fp16:
            n1 = pred_mask.sum().item()
            if n1 > 8:
                pred_mask = pred_mask.view(-1)
                n2 = max(n1 % 8, 8 * (n1 // 8))
                if n2 != n1:
                    pred_mask[torch.nonzero(pred_mask).view(-1)[: n1 - n2]] = 0
                pred_mask = pred_mask.view(bs, max_seq_len)
                assert pred_mask.sum().item() % 8 == 0, pred_mask.sum().item()

        _token_ids_real = token_ids[pred_mask]
        _token_ids_rand = _token_ids_real.clone().random_(self.vocab_size)
        _token_ids_mask = _token_ids_real.clone().fill_(self.params.special_tok_ids["mask_token"])
        probs = torch.multinomial(self.pred_probs, len(_token_ids_real), replacement=True)
        _token_ids = (
            _token_ids_mask * (probs == 0).long()
            + _token_ids_real * (probs == 1).long()
            + _token_ids_rand * (probs == 2).long()
        )
        token_ids = token_ids.masked_scatter(pred_mask, _token_ids)

        mlm_labels[
            ~pred_mask
        ] = -100  # previously `mlm_labels[1-pred_mask] = -1`, cf pytorch 1.2.0 compatibility

        # sanity checks
        assert 0 <= token_ids.min() <= token_ids.max() < self.vocab_size

        return token_ids, attn_mask, mlm_labels

    def round_batch(self, x: torch.tensor, lengths: torch.tensor):
        if not self.fp16 or len(lengths) < 8:
            return x, lengths
        raise NotImplementedError("fp16 (apex) rounding is not exercised here")

    def step(self, input_ids: torch.tensor, attention_mask: torch.tensor, lm_labels: torch.tensor):
        if self.mlm:
            s_logits, s_hidden_states = self.student(
                input_ids=input_ids, attention_mask=attention_mask
            )  # (bs, seq_length, voc_size)
            with torch.no_grad():
                t_logits, t_hidden_states = self.teacher(
                    input_ids=input_ids, attention_mask=attention_mask
                )  # (bs, seq_length, voc_size)
        else:
            s_logits, _, s_hidden_states = self.student(
                input_ids=input_ids, attention_mask=None
            )  # (bs, seq_length, voc_size)
            with torch.no_grad():
                t_logits, _, t_hidden_states = self.teacher(
                    input_ids=input_ids, attention_mask=None
                )  # (bs, seq_length, voc_size)
        assert s_logits.size() == t_logits.size()

        # https://github.com/peterliht/knowledge-distillation-pytorch/blob/master/model/net.py#L100
        # https://github.com/peterliht/knowledge-distillation-pytorch/issues/2
        if self.params.restrict_ce_to_mask:
            mask = (lm_labels > -1).unsqueeze(-1).expand_as(s_logits)  # (bs, seq_length, voc_size)
        else:
            mask = attention_mask.unsqueeze(-1).expand_as(s_logits)  # (bs, seq_length, voc_size)
        s_logits_slct = torch.masked_select(
            s_logits, mask
        )  # (bs * seq_length * voc_size) modulo the 1s in mask
        s_logits_slct = s_logits_slct.view(
            -1, s_logits.size(-1)
        )  # (bs * seq_length, voc_size) modulo the 1s in mask
        t_logits_slct = torch.masked_select(
            t_logits, mask
        )  # (bs * seq_length * voc_size) modulo the 1s in mask
        t_logits_slct = t_logits_slct.view(
            -1, s_logits.size(-1)
        )  # (bs * seq_length, voc_size) modulo the 1s in mask
        assert t_logits_slct.size() == s_logits_slct.size()

        loss_ce = (
            self.ce_loss_fct(
                nn.functional.log_softmax(s_logits_slct / self.temperature, dim=-1),
                nn.functional.softmax(t_logits_slct / self.temperature, dim=-1),
            )
            * (self.temperature) ** 2
        )
        loss = self.alpha_ce * loss_ce

        if self.alpha_mlm > 0.0:
            loss_mlm = self.lm_loss_fct(s_logits.view(-1, s_logits.size(-1)), lm_labels.view(-1))
            loss += self.alpha_mlm * loss_mlm
        if self.alpha_clm > 0.0:
            shift_logits = s_logits[..., :-1, :].contiguous()
            shift_labels = lm_labels[..., 1:].contiguous()
            loss_clm = self.lm_loss_fct(
                shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1)
            )
            loss += self.alpha_clm * loss_clm

        if self.alpha_mse > 0.0:
            loss_mse = self.mse_loss_fct(s_logits_slct, t_logits_slct) / s_logits_slct.size(
                0
            )  # Reproducing batchmean reduction
            loss += self.alpha_mse * loss_mse
        if self.alpha_cos > 0.0:
            s_hidden_states = s_hidden_states[-1]  # (bs, seq_length, dim)
            t_hidden_states = t_hidden_states[-1]  # (bs, seq_length, dim)
            mask = attention_mask.unsqueeze(-1).expand_as(s_hidden_states)  # (bs, seq_length, dim)
            assert s_hidden_states.size() == t_hidden_states.size()
            dim = s_hidden_states.size(-1)

            s_hidden_states_slct = torch.masked_select(
                s_hidden_states, mask
            )  # (bs * seq_length * dim)
            s_hidden_states_slct = s_hidden_states_slct.view(-1, dim)  # (bs * seq_length, dim)
            t_hidden_states_slct = torch.masked_select(
                t_hidden_states, mask
            )  # (bs * seq_length * dim)
            t_hidden_states_slct = t_hidden_states_slct.view(-1, dim)  # (bs * seq_length, dim)

            target = s_hidden_states_slct.new(s_hidden_states_slct.size(0)).fill_(
                1
            )  # (bs * seq_length,)
            loss_cos = self.cosine_loss_fct(s_hidden_states_slct, t_hidden_states_slct, target)
            loss += self.alpha_cos * loss_cos

        # (the .item() bookkeeping and self.optimize(loss) follow here in distiller.py)
        return loss


def _distiller() -> Distiller:
    torch.manual_seed(0)
    teacher = transformers.BertForMaskedLM(
        transformers.BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=32,
            pad_token_id=SPECIAL["pad_token"],
            output_hidden_states=True,
            return_dict=False,  # the tuples the 2019 models returned, which step unpacks
        )
    )
    teacher.eval()  # Distiller.train
    teacher.requires_grad_(False)
    student = transformers.DistilBertForMaskedLM(
        transformers.DistilBertConfig(
            vocab_size=VOCAB,
            dim=32,
            n_layers=2,
            n_heads=2,
            hidden_dim=64,
            max_position_embeddings=32,
            pad_token_id=SPECIAL["pad_token"],
            output_hidden_states=True,
            return_dict=False,  # the tuples the 2019 models returned, which step unpacks
        )
    )
    student.train()  # Distiller.train
    params = SimpleNamespace(
        fp16=False,
        mlm=True,
        temperature=2.0,
        alpha_ce=5.0,
        alpha_mlm=2.0,
        alpha_clm=0.0,
        alpha_mse=0.0,
        alpha_cos=1.0,
        mlm_mask_prop=0.15,
        word_mask=0.8,
        word_keep=0.1,
        word_rand=0.1,
        restrict_ce_to_mask=False,
        special_tok_ids=SPECIAL,
    )
    # train.py: token counts ** -mlm_smoothing, special tokens never masked.
    token_probs = torch.ones(VOCAB)
    token_probs[list(SPECIAL.values())] = 0.0
    return Distiller(params, student, teacher, token_probs)


def _sequences(size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``LmSeqsDataset.batch_sequences``: ``[CLS] ... [SEP]`` right-padded, and the lengths."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 11, (size,), generator=generator)
    lengths[0] = 10  # the batch's longest
    token_ids = torch.full((size, 10), SPECIAL["pad_token"], dtype=torch.long)
    for row, length in enumerate(lengths.tolist()):
        words = torch.randint(len(SPECIAL), VOCAB, (length - 2,), generator=generator)
        token_ids[row, :length] = torch.cat(
            [torch.tensor([SPECIAL["cls_token"]]), words, torch.tensor([SPECIAL["sep_token"]])]
        )
    return token_ids, lengths


def build(form: str):
    distiller = _distiller()
    if form == "distiller":

        def training_step(token_ids, lengths):  # Distiller.train's loop body
            token_ids, attn_mask, lm_labels = distiller.prepare_batch_mlm(
                batch=(token_ids, lengths)
            )
            return distiller.step(
                input_ids=token_ids, attention_mask=attn_mask, lm_labels=lm_labels
            )

        def batch(size, seed):
            return _sequences(size, seed)

    else:

        def training_step(input_ids, attention_mask, lm_labels):
            return distiller.step(
                input_ids=input_ids, attention_mask=attention_mask, lm_labels=lm_labels
            )

        def batch(size, seed):
            # The masking done once in the data pipeline, with its own seeded draws.
            state = torch.random.get_rng_state()
            torch.manual_seed(1000 + seed)
            try:
                return distiller.prepare_batch_mlm(_sequences(size, seed))
            finally:
                torch.random.set_rng_state(state)

    params = [p for p in distiller.student.parameters() if p.requires_grad]
    return distiller, training_step, params, batch


FORMS = ["distiller", "premasked"]
_BUILT: dict[str, tuple] = {}


def _built(form: str):
    if form not in _BUILT:
        distiller, step, params, batch = build(form)
        split = graphsplit.split(step, batch(2, 0))
        _BUILT[form] = (distiller, step, params, batch, split)
    return _BUILT[form]


@pytest.mark.parametrize("form", FORMS)
def test_distiller_step_verifies_on_the_example_and_another_size(form):
    _, step, _params, batch, split = _built(form)
    assert_stage1_holds_no_trainable(split)
    for seed, example in enumerate([batch(2, 0), batch(3, 1)]):
        checks = graphsplit.verify(step, split, example, seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


def test_distiller_loop_body_keeps_the_teacher_fed_random_masks_in_stage_2():
    """``prepare_batch_mlm`` draws the masked positions and the replacement words before the
    teacher runs: its output differs every step, so it is not cached. The loop body's
    ``.item()`` on the lengths makes the whole-step trace refuse it; the module-level path
    runs it and sees the teacher's input change between two seeds."""
    _distiller, _step, _params, _batch, split = _built("distiller")
    assert split.path == "calls"
    held = {name for name, _ in split.stage2.named_parameters()}
    assert any(name.startswith("distiller.teacher.bert.encoder.") for name in held)
    assert any(name.startswith("distiller.student.") for name in held)
    assert not any(spec.shape[-1:] == (VOCAB,) for spec in split.boundary.values())
    report = split.report()
    assert "draws random numbers" in report
    assert "distiller.teacher.bert.embeddings.word_embeddings call 0: an input differs" in report


def test_premasked_step_caches_the_teacher():
    """On pre-masked batches the teacher's call is a function of the sample: its logits and
    its last hidden state (the two outputs the losses read) cross, its weights stay out of
    stage 2. ``masked_select`` (a size read from the mask's values) keeps the whole-step
    trace off; the default path takes the module-level plan."""
    distiller, _step, _params, _batch, split = _built("premasked")
    assert split.path == "calls"
    held = {name for name, _ in split.stage2.named_parameters()}
    assert not any("teacher" in name for name in held), sorted(held)
    trainable = {name for name, p in split.stage2.named_parameters() if p.requires_grad}
    assert trainable == {
        f"distiller.student.{name}" for name, p in distiller.student.named_parameters()
    }
    teacher = {key: spec.shape[1:] for key, spec in split.boundary.items() if "teacher" in key}
    assert sorted(teacher.values()) == [(10, 32), (10, VOCAB)], teacher


@pytest.mark.parametrize("form", FORMS)
def test_distiller_cache_round_trip(form, tmp_path):
    _, step, params, batch, split = _built(form)
    batches = [batch(2, 2), batch(3, 3)]
    names = list(split.input_names)
    loader = [dict(zip(names, example, strict=True)) for example in batches]
    assert_cache_round_trip(split, lambda raw: step(**raw), loader, tmp_path / "cache", params)


def test_premasked_trace_refusal_names_the_tied_trainable_weight():
    """DistilBERT ties ``vocab_projector.weight`` to its trainable word embeddings. The trace's
    refusal of the step's value-reading ``Distiller.step`` named the alias as "the frozen
    tensor ... on the meta device" (load the frozen weights, it said); the alias is named as
    ``named_parameters()`` names the tensor, and the refusal says it is trainable."""
    _distiller, step, _params, batch, _split = _built("premasked")
    with pytest.raises(graphsplit.TraceError) as caught:
        graphsplit.split(step, batch(2, 0), path="trace")
    message = str(caught.value)
    assert type(caught.value).__name__ == "TrainableSideError"
    assert "reads the trainable parameter distiller.student.distilbert.embeddings" in message
    assert "frozen tensor" not in message
