"""Conformance: transformers steps with a frozen tower next to a trained one (issue 10).

LLaVA-style visual instruction tuning (frozen vision tower, trained projector, LoRA on the
language model), LiT (``run_clip.py --freeze_vision_model``: a locked image tower under a
trained text tower), Whisper fine-tuning of the decoder with LoRA (``model.freeze_encoder()``),
and the frozen-dropout trap: a frozen encoder left in train mode draws dropout masks, so it
consumes random values and must stay in stage 2. Each step calls the model the way the
Trainer does (``model(**batch).loss``); each is split and verified bit for bit at two batch
sizes and asserts which modules stage 2 holds.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.conformance.matrix import ids_and_mask
from tests.helpers import split_and_verify

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB = 64


def stage2_paths(split) -> set[str]:
    """Every submodule path stage 2 holds."""
    return {name for name, _ in split.stage2.named_modules() if name}


def _lora(model: nn.Module, targets: str) -> None:
    """peft LoRA on ``targets`` (a regex), with random ``lora_B`` so every gradient is real."""
    config = peft.LoraConfig(
        r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=targets
    )
    peft.inject_adapter_in_model(config, model)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0.0, 0.02)


def _clip_vision(**extra) -> transformers.CLIPVisionConfig:
    return transformers.CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=16,
        patch_size=4,
        **extra,
    )


IMAGE_TOKEN = VOCAB - 1
IMAGE_TOKENS = 16  # (16 / 4) ** 2 patches; the "default" strategy drops CLS


class VisualInstructionTuning(nn.Module):
    """LLaVA stage 2: frozen CLIP vision tower, trained projector, LoRA on the Llama LM."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.LlavaConfig(
            vision_config=_clip_vision(),
            text_config=transformers.LlamaConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                max_position_embeddings=64,
            ),
            image_token_index=IMAGE_TOKEN,
            image_seq_length=IMAGE_TOKENS,
            vision_feature_layer=-2,
        )
        model = transformers.LlavaForConditionalGeneration(config)
        model.requires_grad_(False)
        _lora(model, r".*language_model.*\.(q_proj|v_proj)")
        model.model.multi_modal_projector.requires_grad_(True)
        self.model = model

    def forward(self, input_ids, attention_mask, pixel_values, labels):
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            pixel_values=pixel_values,
            labels=labels,
        )
        return outputs.loss


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 3])
def test_llava_projector_and_lora_lm_cache_the_vision_tower(size):
    torch.manual_seed(0)
    text, text_mask = ids_and_mask(size, vocab=VOCAB - 1)
    image = torch.full((size, IMAGE_TOKENS), IMAGE_TOKEN)
    input_ids = torch.cat([image, text], dim=1)
    attention_mask = torch.cat([torch.ones_like(image), text_mask], dim=1)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :IMAGE_TOKENS] = -100
    batch = (input_ids, attention_mask, torch.randn(size, 3, 16, 16), labels)
    split = split_and_verify(VisualInstructionTuning(), batch)
    held = stage2_paths(split)
    assert "model.model.multi_modal_projector" in held
    assert "model.model.language_model" in held
    assert not {path for path in held if "vision_tower" in path}
    # The selected vision layer (output_hidden_states=-2, CLS dropped) is what is cached.
    assert "modeling_llava.py" in split.boundary["getitem"].source
    # list(image_features) stays one node: one row per image, whatever the batch size.
    assert "list(model_model_multi_modal_projector)" in split.stage2.code


class LockedImageTextTuning(nn.Module):
    """LiT as ``run_clip.py --freeze_vision_model`` trains it: CLIP's own contrastive loss."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.CLIPConfig(
            text_config=transformers.CLIPTextConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=32,
                eos_token_id=2,  # the legacy pooling path: argmax of the ids
            ),
            vision_config=_clip_vision(),
            projection_dim=16,
        )
        self.model = transformers.CLIPModel(config)
        # run_clip.py's _freeze_params(model.vision_model)
        for param in self.model.vision_model.parameters():
            param.requires_grad = False

    def forward(self, input_ids, attention_mask, pixel_values):
        outputs = self.model(
            input_ids=input_ids,
            pixel_values=pixel_values,
            attention_mask=attention_mask,
            return_loss=True,
        )
        return outputs.loss


@pytest.mark.parametrize("size", [2, 3])
def test_lit_contrastive_caches_the_locked_image_tower(size):
    torch.manual_seed(0)
    ids, mask = ids_and_mask(size, vocab=VOCAB)
    split = split_and_verify(LockedImageTextTuning(), (ids, mask, torch.randn(size, 3, 16, 16)))
    held = stage2_paths(split)
    assert "model.text_model" in held and "model.visual_projection" in held
    assert not {path for path in held if "vision_model" in path}
    assert "model_vision_model_pooler_output" in split.boundary
    # CLIP's contrastive_loss: torch.arange(len(logits)) follows the batch in stage 2.
    assert "torch.arange(len_" in split.stage2.code


class WhisperDecoderLoRA(nn.Module):
    """Whisper fine-tuning with ``model.freeze_encoder()`` and LoRA on the decoder attention."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.WhisperConfig(
            vocab_size=VOCAB,
            num_mel_bins=8,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=32,
            decoder_ffn_dim=32,
            d_model=16,
            max_source_positions=16,
            max_target_positions=32,
            pad_token_id=VOCAB - 1,
            decoder_start_token_id=VOCAB - 2,
            bos_token_id=VOCAB - 2,
            eos_token_id=VOCAB - 3,
        )
        model = transformers.WhisperForConditionalGeneration(config)
        model.requires_grad_(False)
        _lora(model, r".*decoder\.layers\.\d+\.(self_attn|encoder_attn)\.(q_proj|v_proj)")
        model.freeze_encoder()
        self.model = model

    def forward(self, input_features, labels):
        return self.model(input_features=input_features, labels=labels).loss


@pytest.mark.parametrize("size", [2, 3])
def test_whisper_decoder_lora_caches_the_frozen_encoder(size):
    torch.manual_seed(0)
    ids, mask = ids_and_mask(size, vocab=VOCAB - 3)
    labels = ids.masked_fill(mask == 0, -100)  # the seq2seq collator pads labels with -100
    features = torch.randn(size, 8, 32)  # 2 * max_source_positions frames
    split = split_and_verify(WhisperDecoderLoRA(), (features, labels))
    held = stage2_paths(split)
    assert "model.model.decoder" in held
    assert not {path for path in held if "encoder." in path or path.endswith("encoder")}
    assert "model_model_encoder_0" in split.boundary  # the encoder's last hidden state
    # loss_fct = CrossEntropyLoss() made inside forward: traced through to its function.
    assert "torch.nn.functional.cross_entropy(" in split.stage2.code


class FrozenEncoderInTrainMode(nn.Module):
    """The trap: a frozen BERT left in ``train()`` (the Trainer puts every module in train
    mode), so its dropout draws a fresh mask each step. Its output is random: caching it would
    freeze one dropout mask forever, so the encoder must run in stage 2."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=32,
            hidden_dropout_prob=0.1,
            attention_probs_dropout_prob=0.1,
        )
        self.encoder = transformers.BertModel(config).requires_grad_(False).train()
        self.probe = nn.Linear(32, 3)

    def forward(self, input_ids, attention_mask, labels):
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask)
        return F.cross_entropy(self.probe(hidden.last_hidden_state[:, 0]), labels)


@pytest.mark.parametrize("size", [2, 3])
def test_frozen_encoder_with_live_dropout_stays_in_stage_2(size):
    torch.manual_seed(0)
    ids, mask = ids_and_mask(size, vocab=VOCAB)
    step = FrozenEncoderInTrainMode()
    labels = torch.arange(size) % 3
    # verify() runs eager and both stages from one seed: the stage-2 dropout masks match.
    split = split_and_verify(step, (ids, mask, labels))
    assert {path.split(".")[0] for path in stage2_paths(split)} == {"encoder", "probe"}
    assert set(split.boundary) == {"input_ids", "attention_mask", "labels"}  # nothing cached
    # And the masks are live: two seeds give two losses, so a cached encoder output would
    # have frozen one mask into every epoch.
    losses = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        losses.append(step(ids, mask, labels))
    assert not torch.equal(losses[0], losses[1])
