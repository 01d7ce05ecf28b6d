"""Conformance: distilbart's seq2seq distillation step, fed by ``DataCollatorForSeq2Seq``.

Upstream: ``examples/research_projects/seq2seq-distillation/distillation.py`` (transformers,
the distilbart / distil-T5 project): ``SummarizationDistiller._step`` and ``calc_ce_loss`` are
copied verbatim (``self`` is the distiller, ``self(...)`` its ``forward``, which calls the
student as ``finetune.py``'s ``SummarizationModule.forward`` does), with ``training_step`` from
``finetune.py`` and ``freeze_params`` / ``label_smoothed_nll_loss`` from that project's
``utils.py``. The student is a separate, smaller model (``--student``), so the teacher runs its
own encoder (``self.teacher.get_encoder()(...)``) and then its decoder on those states; the loss
blends the student's label-smoothed NLL (``--label_smoothing 0.1``) with a KL to the teacher's
logits over the target sequence, selected with ``torch.masked_select`` on the decoder's
non-pad positions. The student is a ``T5ForConditionalGeneration`` (the script's
``self.model._shift_right(labels)`` branch), trained in ``train()`` mode (dropout active); the
teacher is frozen by ``freeze_params`` and in ``eval()`` mode, as the script builds it.

The data pipeline is the one ``examples/pytorch/summarization/run_summarization.py`` builds: a
``datasets.Dataset`` of (document, summary) strings tokenized by its ``preprocess_function``
(variable-length token lists, ``labels`` from ``text_target``) and collated by
``DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=...,
pad_to_multiple_of=8)``: every batch is padded to its longest sequence rounded up to 8, and
gets ``decoder_input_ids`` the step ignores. The labels are padded with the pad id
(``label_pad_token_id=tokenizer.pad_token_id``), since the distiller's loss ignores
``pad_token_id``, not -100. Eleven examples in batches of 4: the last batch holds 3.

The loop is the plain PyTorch loop body of that ``training_step``
(``distiller.training_step(batch, batch_idx)["loss"]``), split with the default path (the
whole-step trace refuses ``torch.masked_select`` on the student's logits; the module-level path
splits). Checked: ``verify`` bit for bit on a batch of 4 and the short batch of 3, the teacher
cached and no teacher weights in stage 2, and a cache of the whole loader (batches of two
padded lengths and two sizes) round-tripped through disk with the step's loss and gradients.

With the whole student trained (the script's default) this used to fail: T5 ties
``encoder.embed_tokens`` / ``decoder.embed_tokens`` to ``shared``, and the module-level path
took the two embedding modules for frozen ones (judged by their own parameter paths, which the
root's deduplicated names do not list) and cached their lookups, so stage 2 lost that part of
``shared.weight``'s gradient (``verify`` reported it). graphsplit/calls/module_calls.py
``frozen_modules`` now tells trainable parameters by identity; the toy module below pins it.
With the script's ``--freeze_embeds`` (``freeze_embeds(self.model)``) caching the lookups is
right, and the same checks pass.

Models: T5, vocab of the word-level tokenizer (built locally), teacher 2+2 layers of width 32,
student 1+1 layers of width 24, random weights.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from torch import nn
from torch.utils.data import DataLoader
from transformers import DataCollatorForSeq2Seq, T5Config, T5ForConditionalGeneration

import graphsplit
from tests.conformance.unseen2_data_checks import assert_cache_round_trip
from tests.conformance.unseen_checks import stage2_top_modules, word_tokenizer
from tests.helpers import assert_stage1_holds_no_trainable

WORDS = [f"w{i}" for i in range(40)]


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# -- upstream: seq2seq-distillation/utils.py -----------------------------------------------------
def label_smoothed_nll_loss(lprobs, target, epsilon, ignore_index=-100):
    """From fairseq"""
    if target.dim() == lprobs.dim() - 1:
        target = target.unsqueeze(-1)
    nll_loss = -lprobs.gather(dim=-1, index=target)
    smooth_loss = -lprobs.sum(dim=-1, keepdim=True)
    if ignore_index is not None:
        pad_mask = target.eq(ignore_index)
        nll_loss.masked_fill_(pad_mask, 0.0)
        smooth_loss.masked_fill_(pad_mask, 0.0)
    else:
        nll_loss = nll_loss.squeeze(-1)
        smooth_loss = smooth_loss.squeeze(-1)

    nll_loss = nll_loss.sum()  # mean()? Scared to break other math.
    smooth_loss = smooth_loss.sum()
    eps_i = epsilon / lprobs.size(-1)
    loss = (1.0 - epsilon) * nll_loss + eps_i * smooth_loss
    return loss, nll_loss


def freeze_params(model: nn.Module):
    """Set requires_grad=False for each of model.parameters()"""
    for par in model.parameters():
        par.requires_grad = False


def freeze_embeds(model):
    """Freeze token embeddings and positional embeddings for bart, just token embeddings for t5."""
    model_type = model.config.model_type

    if model_type == "t5":
        freeze_params(model.shared)
        for d in [model.encoder, model.decoder]:
            freeze_params(d.embed_tokens)
    elif model_type == "fsmt":
        for d in [model.model.encoder, model.model.decoder]:
            freeze_params(d.embed_positions)
            freeze_params(d.embed_tokens)
    else:
        freeze_params(model.model.shared)
        for d in [model.model.encoder, model.model.decoder]:
            freeze_params(d.embed_positions)
            freeze_params(d.embed_tokens)


# -- upstream: seq2seq-distillation/distillation.py (SummarizationDistiller) ---------------------
class SummarizationDistiller(nn.Module):
    """Supports T5, Bart, Pegasus and other models that inherit from Bart."""

    loss_names = ["loss", "ce_loss", "mlm_loss", "hid_loss_enc", "hid_loss_dec"]  # noqa: RUF012

    def __init__(self, hparams, student, teacher, tokenizer):
        super().__init__()
        self.hparams = hparams
        self.model = student
        self.tokenizer = tokenizer
        # as in __init__ with --student given: different base models, so the teacher runs its
        # own encoder and no hidden-state loss is computed
        self.different_base_models = True
        self.do_calc_hidden_loss = False
        self.different_encoder = True
        self.teacher = teacher
        freeze_params(self.teacher)
        self.e_matches = None
        self.d_matches = None

        self.ce_loss_fct = nn.KLDivLoss(reduction="batchmean")
        self.temperature = 2.0
        self.alpha_mlm = hparams.alpha_mlm
        self.alpha_ce = hparams.alpha_ce
        self.alpha_hid = hparams.alpha_hid

    def forward(self, input_ids, **kwargs):  # finetune.py: SummarizationModule.forward
        return self.model(input_ids, **kwargs)

    @property
    def pad(self) -> int:  # finetune.py
        return self.tokenizer.pad_token_id

    def calc_ce_loss(self, mask, s_logits, t_logits):
        """Copy pasted from distillbert (transformers/examples/distillation/)"""
        # mask has False at padding_idx
        sel_mask = mask[:, :, None].expand_as(s_logits)
        vocab_size = s_logits.size(-1)
        # (bs * seq_length * voc_size) modulo the 1s in mask
        s_logits_slct = torch.masked_select(s_logits, sel_mask)
        # (bs * seq_length * voc_size) modulo the 1s in mask
        t_logits_slct = torch.masked_select(t_logits, sel_mask)
        # (bs * seq_length, voc_size) modulo the 1s in mask
        s_logits_slct = s_logits_slct.view(-1, vocab_size)
        # (bs * seq_length, voc_size) modulo the 1s in mask
        t_logits_slct = t_logits_slct.view(-1, vocab_size)
        assert t_logits_slct.size() == s_logits_slct.size()
        loss_ce = (
            self.ce_loss_fct(
                nn.functional.log_softmax(s_logits_slct / self.temperature, dim=-1),
                nn.functional.softmax(t_logits_slct / self.temperature, dim=-1),
            )
            * (self.temperature) ** 2
        )
        return loss_ce

    def _step(self, batch: dict) -> tuple:
        """Compute the loss for a batch"""
        pad_token_id = self.tokenizer.pad_token_id
        input_ids, src_mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
        if isinstance(self.model, T5ForConditionalGeneration):
            decoder_input_ids = self.model._shift_right(labels)
        else:
            decoder_input_ids = shift_tokens_right(labels, pad_token_id)  # noqa: F821 (BART only)

        # noinspection PyCallingNonCallable
        student_outputs = self(
            input_ids,
            attention_mask=src_mask,
            decoder_input_ids=decoder_input_ids,
            output_hidden_states=self.do_calc_hidden_loss,
            output_attentions=False,
            use_cache=False,
        )
        lm_logits = student_outputs["logits"]

        # Same cross entropy vs. label smoothing logic as finetune.py
        assert lm_logits.shape[-1] == self.model.config.vocab_size
        if self.hparams.label_smoothing == 0:
            # Same behavior as modeling_bart.py, besides ignoring pad_token_id
            loss_fct = nn.CrossEntropyLoss(ignore_index=pad_token_id)
            student_lm_loss = loss_fct(lm_logits.view(-1, lm_logits.shape[-1]), labels.view(-1))
        else:
            lprobs = nn.functional.log_softmax(lm_logits, dim=-1)
            student_lm_loss, _ = label_smoothed_nll_loss(
                lprobs, labels, self.hparams.label_smoothing, ignore_index=pad_token_id
            )

        def zero_tensor():
            return torch.tensor(0.0).type_as(student_lm_loss)

        teacher_enc_outputs = student_outputs[
            "encoder_last_hidden_state"
        ]  # use this unless self.different_base_models
        hid_loss_enc, hid_loss_dec = zero_tensor(), zero_tensor()
        if self.different_encoder:  # compute encoder hidden state loss
            all_teacher_encoder_outputs = self.teacher.get_encoder()(
                input_ids,
                attention_mask=src_mask,
                output_hidden_states=self.do_calc_hidden_loss,
            )
            if self.different_base_models:
                teacher_enc_outputs = all_teacher_encoder_outputs["last_hidden_state"]
            elif self.do_calc_hidden_loss:
                hid_loss_enc = self.calc_hidden_loss(
                    src_mask,
                    student_outputs["encoder_hidden_states"],
                    all_teacher_encoder_outputs["hidden_states"],
                    self.e_matches,
                    normalize_hidden=self.hparams.normalize_hidden,
                )

        teacher_outputs = self.teacher(
            input_ids,
            attention_mask=src_mask,
            encoder_outputs=(teacher_enc_outputs,),
            decoder_input_ids=decoder_input_ids,
            output_hidden_states=self.do_calc_hidden_loss,
            use_cache=False,  # since we are not passing labels, never let this default to True
        )
        dec_mask = decoder_input_ids.ne(pad_token_id)
        loss_ce = self.calc_ce_loss(dec_mask, lm_logits, teacher_outputs["logits"])
        if self.do_calc_hidden_loss:  # Intermediate supervision of decoder hidden states
            hid_loss_dec = self.calc_hidden_loss(
                dec_mask,
                student_outputs["decoder_hidden_states"],
                teacher_outputs["decoder_hidden_states"],
                self.d_matches,
                normalize_hidden=self.hparams.normalize_hidden,
            )

        blended_loss = (
            self.alpha_ce * loss_ce
            + self.alpha_mlm * student_lm_loss
            + self.hparams.alpha_hid * (hid_loss_enc + hid_loss_dec)
        )
        return blended_loss, loss_ce, student_lm_loss, hid_loss_enc, hid_loss_dec

    def training_step(self, batch, batch_idx) -> dict:  # finetune.py: SummarizationModule
        loss_tensors = self._step(batch)

        logs = {name: loss for name, loss in zip(self.loss_names, loss_tensors)}
        # tokens per batch
        logs["tpb"] = batch["input_ids"].ne(self.pad).sum() + batch["labels"].ne(self.pad).sum()
        logs["bs"] = batch["input_ids"].shape[0]
        logs["src_pad_tok"] = batch["input_ids"].eq(self.pad).sum()
        logs["src_pad_frac"] = batch["input_ids"].eq(self.pad).float().mean()
        # TODO(SS): make a wandb summary metric for this
        return {"loss": loss_tensors[0], "log": logs}


# -- the script's setup, on tiny models -----------------------------------------------------------
def t5(seed: int, vocab: int, width: int, layers: int) -> T5ForConditionalGeneration:
    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=vocab,
        d_model=width,
        d_kv=8,
        d_ff=2 * width,
        num_layers=layers,
        num_decoder_layers=layers,
        num_heads=2,
        relative_attention_num_buckets=8,
        dropout_rate=0.1,
        pad_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=0,
    )
    return T5ForConditionalGeneration(config)


def examples(count: int = 11) -> Dataset:
    generator = torch.Generator().manual_seed(4)

    def text(n: int) -> str:
        ids = torch.randint(0, len(WORDS), (n,), generator=generator).tolist()
        return " ".join(WORDS[i] for i in ids)

    documents = [3, 4, 5, 6, 9, 12, 7, 14, 10, 6, 13][:count]  # words; the tokenizer adds eos
    summaries = [2, 3, 5, 4, 6, 9, 3, 7, 4, 8, 2][:count]
    return Dataset.from_list(
        [
            {"document": text(d), "summary": text(s)}
            for d, s in zip(documents, summaries, strict=True)
        ]
    )


def build(*, freeze_embeds_flag: bool = False):
    tokenizer = word_tokenizer(WORDS)
    vocab = len(tokenizer)
    teacher = t5(0, vocab, 32, 2).eval()  # AutoModelForSeq2SeqLM.from_pretrained(teacher).eval()
    student = t5(1, vocab, 24, 1)
    if freeze_embeds_flag:  # finetune.py: if self.hparams.freeze_embeds: freeze_embeds(self.model)
        freeze_embeds(student)
    hparams = SimpleNamespace(
        label_smoothing=0.1, alpha_ce=0.8, alpha_mlm=0.2, alpha_hid=0.0, normalize_hidden=False
    )
    distiller = SummarizationDistiller(hparams, student, teacher, tokenizer)
    student.train()

    # run_summarization.py: preprocess_function (padding=False: "pad dynamically")
    max_source_length, max_target_length, padding, prefix = 32, 16, False, ""

    def preprocess_function(examples):
        inputs = [prefix + doc for doc in examples["document"]]
        model_inputs = tokenizer(
            inputs, max_length=max_source_length, padding=padding, truncation=True
        )
        labels = tokenizer(
            text_target=examples["summary"],
            max_length=max_target_length,
            padding=padding,
            truncation=True,
        )
        model_inputs["labels"] = labels["input_ids"]
        return model_inputs

    raw = examples()
    train_dataset = raw.map(preprocess_function, batched=True, remove_columns=raw.column_names)
    data_collator = DataCollatorForSeq2Seq(
        tokenizer,
        model=student,
        label_pad_token_id=tokenizer.pad_token_id,
        pad_to_multiple_of=8,
    )
    loader = DataLoader(train_dataset, batch_size=4, shuffle=False, collate_fn=data_collator)
    return distiller, loader


def training_step_of(distiller):
    def training_step(batch):  # the loop body: loss = ...["loss"]; loss.backward()
        return distiller.training_step(batch, 0)["loss"]

    return training_step


# -- tests ---------------------------------------------------------------------------------------
def test_the_collator_gives_batches_of_two_sizes_and_two_padded_lengths():
    _, loader = build()
    batches = list(loader)
    assert [b["input_ids"].shape[0] for b in batches] == [4, 4, 3]
    lengths = {b["input_ids"].shape[1] for b in batches} | {b["labels"].shape[1] for b in batches}
    assert lengths == {8, 16}, lengths
    assert all(b["input_ids"].shape[1] % 8 == 0 for b in batches)
    assert "decoder_input_ids" in batches[0]  # the collator's; the step shifts labels itself


def _check_split(distiller, loader):
    step = training_step_of(distiller)
    first, _, last = list(loader)
    split = graphsplit.split(step, (first,))
    for batch in (first, last):
        comparisons = graphsplit.verify(step, split, (batch,))
        assert comparisons and all(c.ok for c in comparisons)

    held = stage2_top_modules(split)
    assert not any("teacher" in name for name in held), held
    assert not any("teacher" in key for key in split.stage2.state_dict())
    trainable = [p for p in distiller.model.parameters() if p.requires_grad]
    assert {id(p) for p in split.stage2.parameters()} >= {id(p) for p in trainable}
    assert any(key.startswith("distiller_teacher__") for key in split.boundary), split.boundary
    assert_stage1_holds_no_trainable(split)


def test_a_tied_alias_of_a_trainable_embedding_is_not_a_frozen_module():
    """The mechanism alone, on the module-level path: a trainable ``shared`` embedding tied to
    an ``embed_tokens`` module, a frozen teacher; only the teacher may be cached."""

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.shared = nn.Embedding(10, 4)
            self.embed_tokens = nn.Embedding(10, 4)
            self.embed_tokens.weight = self.shared.weight  # as T5 / BART tie their embeddings
            self.teacher = nn.Linear(4, 4).requires_grad_(False)

        def forward(self, ids, target):
            h = self.embed_tokens(ids)
            logits = h @ self.shared.weight.T
            return logits.log_softmax(-1).mean() + (self.teacher(target) - h).pow(2).mean()

    torch.manual_seed(0)
    step, ids, target = Tied(), torch.randint(0, 10, (3, 5)), torch.randn(3, 5, 4)
    split = graphsplit.split(step, (ids, target), path="calls")
    assert not any(key.startswith("embed_tokens") for key in split.boundary), list(split.boundary)


def test_split_caches_the_teacher_and_verifies_on_full_and_short_batches():
    _check_split(*build())


def test_the_loader_round_trips_through_disk_with_the_steps_losses_and_gradients(tmp_path):
    distiller, loader = build()
    step = training_step_of(distiller)
    split = graphsplit.split(step, (next(iter(loader)),))
    params = [p for p in distiller.model.parameters() if p.requires_grad]
    assert len(assert_cache_round_trip(split, step, loader, tmp_path / "cache", params)) == 11


def test_with_frozen_embeddings_the_teacher_is_cached_and_verify_holds_on_both_sizes():
    """``--freeze_embeds`` (the script's own flag): the embeddings are frozen, so caching their
    lookups is right; the teacher is cached and ``verify`` holds on both batch sizes."""
    _check_split(*build(freeze_embeds_flag=True))


def test_with_frozen_embeddings_the_loader_round_trips_through_disk(tmp_path):
    distiller, loader = build(freeze_embeds_flag=True)
    step = training_step_of(distiller)
    split = graphsplit.split(step, (next(iter(loader)),))
    params = [p for p in distiller.model.parameters() if p.requires_grad]
    assert len(assert_cache_round_trip(split, step, loader, tmp_path / "cache", params)) == 11
