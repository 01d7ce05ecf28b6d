"""Conformance: MusicGen fine-tuning as ylacombe/musicgen-dreamboothing trains it.

Upstream: ylacombe/musicgen-dreamboothing ``dreambooth_musicgen.py``. The script encodes the
target audio once, before training, in a ``datasets.map`` (``apply_audio_decoder``, copied
verbatim below but for its GPU placement lines: ``audio_decoder.encode(...)["audio_codes"]``,
a pad column, the decoder's ``build_delay_pattern_mask`` / ``apply_delay_pattern_mask``, the
first BOS timestamp dropped),
pads the batches with its ``DataCollatorMusicGenWithPadding`` (copied verbatim: labels
``(bsz, seq_len, num_codebooks)`` padded with -100, the prompt ids through the tokenizer's
``pad``), freezes the encoders (``model.freeze_audio_encoder()``, ``model.freeze_text_encoder()``)
and trains with ``MusicgenTrainer(Seq2SeqTrainer)``, whose loss is the stock
``Trainer.compute_loss`` (``outputs = model(**inputs)``; ``loss = outputs["loss"] if
isinstance(outputs, dict) else outputs[0]``). Inside, ``MusicgenForConditionalGeneration``
runs the frozen T5 text encoder on the prompt, projects it (``enc_to_dec_proj``, trainable),
masks it with the attention mask, shifts the labels into decoder inputs and computes the
per-codebook cross entropy in ``MusicgenForCausalLM.forward``.

So the only frozen work of the training step is the text encoder: its output is what
graphsplit should cache. ``Trainer.train()`` puts the model in train mode: the T5's dropout
(``dropout_rate``, 0.1 in musicgen-small's T5) is then active and draws on the frozen
encoder's activations every step, so its output is a function of the sample only in eval
mode. Three cases, each as a user would run it:

- ``dropout``: the script as it is (text encoder in train mode, dropout 0.1): nothing frozen
  is a function of the sample, so ``split`` refuses; the refusal must say why and how to fix
  it (it does, in its module-level part; its headline does not, see the xfail).
- ``split_trainer`` on the script's ``MusicgenTrainer``, the model as ``from_pretrained``
  leaves it (eval mode) until ``train()`` switches it, submodules included, to train mode. It
  used to be a silent wrong result: ``split_trainer`` planned in eval mode, cached the T5's
  dropout-free output, and trained apart from the plain trainer (first loss 6.9188 against
  6.9317). It now plans in training mode, as ``train()`` runs the model
  (``trainer_loss.train_mode_as_train``): the T5's dropout keeps it in stage 2, nothing else
  is frozen work, and the refusal says so; the model's modes are put back.
- ``eval-text-encoder``: ``model.text_encoder.eval()`` after ``freeze_text_encoder()`` (the
  fix the refusal gives): its output is cached (module-level path: the whole-step trace refuses
  the decoder's Python ``random.uniform`` draw), the T5's weights are not in stage 2, the step
  is exact on two batch sizes and through a disk cache.

Tiny config: T5 16 wide, 1 layer; EnCodec 8 filters, hop 4, 2 codebooks of 1024; decoder 24
wide, 1 layer, 2 codebooks. Waveforms of 32 and 48 samples (8 and 12 frames).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Dict, List, Optional, Union  # noqa: UP035 (copied verbatim)

import pytest
import torch

import graphsplit

pytest.importorskip("transformers")

from datasets import Dataset
from transformers import (
    AutoProcessor,
    EncodecConfig,
    MusicgenConfig,
    MusicgenDecoderConfig,
    MusicgenForConditionalGeneration,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    T5Config,
)

from graphsplit.integrations.transformers import batch_by_padded_length, split_trainer
from tests.conformance.unseen2_data_checks import assert_cache_round_trip
from tests.conformance.unseen_checks import word_tokenizer
from tests.helpers import assert_stage1_holds_no_trainable

WORDS = [
    "punk",
    "rock",
    "track",
    "with",
    "loud",
    "guitars",
    "bassy",
    "drums",
    "80s",
    "blues",
    "humming",
    "song",
]
CODEBOOK = 1024  # 10 bits a code, as EnCodec 24 kHz: 2 codebooks at 0.5 kbps, 25 frames/s
NUM_CODEBOOKS = 2


@dataclass
class DataCollatorMusicGenWithPadding:
    """
    Data collator that will dynamically pad the inputs received.
    """

    processor: AutoProcessor
    padding: Union[bool, str] = "longest"  # noqa: UP007
    feature_extractor_input_name: Optional[str] = "input_values"  # noqa: UP045

    def __call__(
        self,
        features: List[Dict[str, Union[List[int], torch.Tensor]]],  # noqa: UP006, UP007
    ) -> Dict[str, torch.Tensor]:  # noqa: UP006
        # split inputs and labels since they have to be of different lengths and need
        # different padding methods
        labels = [torch.tensor(feature["labels"]).transpose(0, 1) for feature in features]
        # (bsz, seq_len, num_codebooks)
        labels = torch.nn.utils.rnn.pad_sequence(labels, batch_first=True, padding_value=-100)

        input_ids = [{"input_ids": feature["input_ids"]} for feature in features]
        input_ids = self.processor.tokenizer.pad(input_ids, return_tensors="pt")

        batch = {"labels": labels, **input_ids}

        if self.feature_extractor_input_name in features[0]:
            input_values = [
                {self.feature_extractor_input_name: feature[self.feature_extractor_input_name]}
                for feature in features
            ]
            input_values = self.processor.feature_extractor.pad(input_values, return_tensors="pt")

            batch[self.feature_extractor_input_name : input_values]

        return batch


def _model(text_encoder_eval: bool):
    torch.manual_seed(0)
    text_encoder = T5Config(
        vocab_size=len(WORDS) + 3,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=1,
        num_heads=2,
        dropout_rate=0.1,
    )
    audio_encoder = EncodecConfig(
        sampling_rate=100,
        audio_channels=1,
        num_filters=8,
        hidden_size=16,
        upsampling_ratios=[2, 2],
        num_residual_layers=1,
        num_lstm_layers=1,
        codebook_size=CODEBOOK,
        codebook_dim=16,
        target_bandwidths=[0.5],
        chunk_length_s=None,
    )
    decoder = MusicgenDecoderConfig(
        vocab_size=CODEBOOK,
        hidden_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        ffn_dim=32,
        num_codebooks=NUM_CODEBOOKS,
        max_position_embeddings=64,
        pad_token_id=CODEBOOK,
        bos_token_id=CODEBOOK,
        decoder_start_token_id=CODEBOOK,
    )
    config = MusicgenConfig(
        text_encoder=text_encoder.to_dict(),
        audio_encoder=audio_encoder.to_dict(),
        decoder=decoder.to_dict(),
    )
    config.pad_token_id = CODEBOOK
    config.decoder_start_token_id = CODEBOOK
    model = MusicgenForConditionalGeneration(config)
    # Freeze Encoders
    model.freeze_audio_encoder()
    model.freeze_text_encoder()
    model.train()  # Trainer.train() -> model.train()
    if text_encoder_eval:
        model.text_encoder.eval()
    return model


def _vectorized(model, size, seed, *, one_length=False):
    """The script's two ``datasets.map`` passes on ``size`` (prompt, waveform) samples."""
    tokenizer = word_tokenizer(WORDS)
    generator = torch.Generator().manual_seed(seed)
    audio_decoder = model.audio_encoder
    audio_encoder_pad_token_id = model.config.decoder.pad_token_id
    num_codebooks = model.decoder.config.num_codebooks
    pad_labels = torch.ones((1, 1, num_codebooks, 1)) * audio_encoder_pad_token_id

    def apply_audio_decoder(batch, rank=None):
        with torch.no_grad():
            labels = audio_decoder.encode(torch.tensor(batch["labels"]).to(audio_decoder.device))[
                "audio_codes"
            ]

        # add pad token column
        labels = torch.cat([pad_labels.to(labels.device).to(labels.dtype), labels], dim=-1)

        labels, delay_pattern_mask = model.decoder.build_delay_pattern_mask(
            labels.squeeze(0),
            audio_encoder_pad_token_id,
            labels.shape[-1] + num_codebooks,
        )

        labels = model.decoder.apply_delay_pattern_mask(labels, delay_pattern_mask)

        # the first timestamp is associated to a row full of BOS, let's get rid of it
        batch["labels"] = labels[:, 1:].cpu()
        return batch

    rows = []
    for _ in range(size):
        words = 4 if one_length else int(torch.randint(2, 6, (1,), generator=generator))
        text = " ".join(
            WORDS[int(i)] for i in torch.randint(0, len(WORDS), (words,), generator=generator)
        )
        samples = (
            32 if one_length else 32 + 16 * int(torch.randint(0, 2, (1,), generator=generator))
        )
        waveform = torch.randn(1, 1, samples, generator=generator).tolist()
        batch = {"input_ids": tokenizer(text)["input_ids"], "labels": waveform}
        rows.append(apply_audio_decoder(batch))
        rows[-1]["labels"] = rows[-1]["labels"].tolist()
    return rows, SimpleNamespace(tokenizer=tokenizer)


def _batch(model, size, seed=0):
    rows, processor = _vectorized(model, size, seed)
    return DataCollatorMusicGenWithPadding(processor=processor)(rows)


_BUILT: dict = {}


def _split(text_encoder_eval):
    if text_encoder_eval not in _BUILT:
        model = _model(text_encoder_eval)

        def compute_loss(inputs):  # Trainer.compute_loss, its plain branch
            outputs = model(**inputs)
            # We don't use .loss here since the model may return tuples instead of ModelOutput.
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
            return loss

        split = graphsplit.split(compute_loss, (_batch(model, 4),))
        params = [p for p in model.parameters() if p.requires_grad]
        _BUILT[text_encoder_eval] = (model, compute_loss, split, params)
    return _BUILT[text_encoder_eval]


def test_musicgen_eval_text_encoder_verifies_on_the_example_and_another_size():
    model, step, split, _params = _split(True)
    assert split.path == "calls"  # the trace refuses the decoder's random.uniform (LayerDrop)
    assert_stage1_holds_no_trainable(split)
    for seed, batch in enumerate([_batch(model, 4), _batch(model, 3, seed=1)]):
        checks = graphsplit.verify(step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


def test_musicgen_eval_text_encoder_is_cached_and_not_held():
    model, _step, split, _params = _split(True)
    held = {name for name, _ in split.stage2.named_parameters()}
    assert not [n for n in held if "text_encoder" in n or "audio_encoder" in n], sorted(held)
    assert [n for n in held if "enc_to_dec_proj" in n], sorted(held)  # trainable, after it
    batch = _batch(model, 4)
    torch.manual_seed(0)
    first = split.stage1(**batch)
    torch.manual_seed(1)
    second = split.stage1(**batch)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first), "stage 1 moves with the seed"
    cached = [k for k in first if "text_encoder" in k]
    assert len(cached) == 1, list(first)
    with torch.no_grad():
        want = model.text_encoder(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).last_hidden_state
    assert torch.equal(first[cached[0]], want)


def test_musicgen_eval_text_encoder_cache_round_trip(tmp_path):
    model, step, split, params = _split(True)
    loader = [_batch(model, 4, seed=2), _batch(model, 4, seed=3), _batch(model, 2, seed=4)]
    assert_cache_round_trip(split, step, loader, tmp_path / "cache", params)


def _dropout_refusal() -> str:
    model = _model(False)

    def compute_loss(inputs):  # Trainer.compute_loss, its plain branch
        outputs = model(**inputs)
        # We don't use .loss here since the model may return tuples instead of ModelOutput.
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
        return loss

    with pytest.raises(graphsplit.GraphsplitError) as caught:
        graphsplit.split(compute_loss, (_batch(model, 4),))
    return "\n".join([str(caught.value), *getattr(caught.value, "__notes__", [])])


def test_musicgen_as_the_script_runs_it_refuses_naming_the_text_encoders_dropout():
    """The script trains with the frozen T5 in train mode: its dropout draws every step, so
    nothing frozen is cacheable. The refusal (the module-level path's part of it) says so and
    names the fix (eval mode)."""
    message = _dropout_refusal()
    assert "model.text_encoder call 0: the call draws random numbers itself" in message
    assert "call them in eval mode" in message


@pytest.mark.xfail(
    strict=True,
    reason=(
        "the headline refusal names no line and a fix the user cannot apply: the whole-step "
        "trace sees Python's `random` move (transformers MusicgenDecoder.forward, "
        "modeling_musicgen.py:530 `dropout_probability = random.uniform(0, 1)`, LayerDrop's "
        "draw, taken every layer even at layerdrop=0.0) and "
        "graphsplit/planning/rules/random_draws.py:random_draw_refusal asks locate_random_draw "
        "to rerun the trace line by line; that rerun (planning/tracing/tracer.py:_retrace) "
        "raises a TensorValueError at transformers configuration_utils.py:659 (`key in "
        "attribute_map`, aten.equal) before reaching the draw, the exception is swallowed and "
        "the message has no source line; its fix ('draw with torch ... or move the "
        "Python/NumPy draw into the data pipeline') points at user code that draws nothing"
    ),
)
def test_musicgen_refusal_names_the_librarys_draw():
    message = _dropout_refusal()
    assert "modeling_musicgen.py" in message and "random.uniform" in message, message


# -- the script's Trainer: split_trainer against the plain MusicgenTrainer ---------------------


class MusicgenTrainer(Seq2SeqTrainer):
    def _pad_tensors_to_max_len(self, tensor, max_length):
        if self.tokenizer is not None and hasattr(self.tokenizer, "pad_token_id"):
            # If PAD token is not defined at least EOS token has to be defined
            pad_token_id = (
                self.tokenizer.pad_token_id
                if self.tokenizer.pad_token_id is not None
                else self.tokenizer.eos_token_id
            )
        else:
            if self.model.config.pad_token_id is not None:
                pad_token_id = self.model.config.pad_token_id
            else:
                raise ValueError(
                    "Pad_token_id must be set in the configuration of the model, in order to pad tensors"  # noqa: E501
                )

        padded_tensor = pad_token_id * torch.ones(
            (tensor.shape[0], max_length, tensor.shape[2]),
            dtype=tensor.dtype,
            device=tensor.device,
        )
        length = min(max_length, tensor.shape[1])
        padded_tensor[:, :length] = tensor[:, :length]
        return padded_tensor


def _trainer(output_dir: str) -> MusicgenTrainer:
    """As the script builds it: the model as ``from_pretrained`` leaves it (``eval()``), the
    encoders frozen, ``MusicgenTrainer`` on the vectorized dataset and the script's collator."""
    model = _model(False)
    model.eval()  # from_pretrained returns the model in eval mode
    rows, processor = _vectorized(model, 8, seed=7, one_length=True)  # one padding group
    train_dataset = Dataset.from_list(rows)
    training_args = Seq2SeqTrainingArguments(
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
    return MusicgenTrainer(
        model=model,
        data_collator=DataCollatorMusicGenWithPadding(processor=processor),
        args=training_args,
        train_dataset=train_dataset,
    )


def _logged(trainer, *keys):
    return [tuple(e[k] for k in keys) for e in trainer.state.log_history if "loss" in e]


@pytest.fixture
def _fresh_accelerate_state():
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_split_trainer_plans_the_model_in_training_mode_as_train_runs_it(
    tmp_path, _fresh_accelerate_state
):
    plain = _trainer(str(tmp_path / "plain"))
    batch_by_padded_length(plain)  # the batches split_trainer trains (one group here)
    plain.train()
    assert plain.model.text_encoder.training  # train() put the frozen T5 in train mode
    trainer = _trainer(str(tmp_path / "split"))
    assert not trainer.model.text_encoder.training  # from_pretrained's eval mode, as loaded
    # It used to cache the T5's dropout-free output (planned in eval mode) and train apart
    # from the plain trainer, silently. Planned in training mode, as train() runs the model,
    # the T5's own dropout keeps it in stage 2 and nothing else is frozen work: refused.
    with pytest.raises(graphsplit.GraphsplitError) as caught:
        split_trainer(trainer, str(tmp_path / "cache"))
    message = "\n".join([str(caught.value), *getattr(caught.value, "__notes__", [])])
    assert "model.text_encoder call 0: the call draws random numbers itself" in message
    assert not trainer.model.training and not trainer.model.text_encoder.training  # put back
