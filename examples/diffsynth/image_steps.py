"""DiffSynth-Studio's FLUX.1 and Qwen-Image LoRA training steps, with real (random) weights.

The steps are DiffSynth's own (Apache-2.0, (c) ModelScope;
https://github.com/modelscope/DiffSynth-Studio): ``forward`` and ``get_pipeline_inputs`` are
those of ``examples/*/model_training/train.py`` as :mod:`examples.diffsynth.steps` writes them
(inherited from there, not copied), on DiffSynth's pipeline, units, ``FlowMatchSFTLoss``,
``pipe.model_fn`` and model classes, unmodified. The LoRA is DiffSynth's ``add_lora_to_model``
and the scheduler is set as ``switch_pipe_to_training_mode`` sets it.

Glossary:

- *prefix*: of a repeated-block ``ModuleList`` only the first ``n`` blocks are kept (the
  module's code iterates over the list, so it runs with fewer blocks unchanged).
- *materialise*: a model built on ``meta`` gets CPU storage (``to_empty``) and deterministic
  values from :func:`fill_deterministically` (seeded; no download, no checkpoint).

DiffSynth's FLUX and Qwen-Image classes fix their widths in code (no argument), so no tiny
config exists. What was made small, and how (everything else is DiffSynth's full model):

FLUX.1 (:func:`flux_lora_step`):

- ``FluxDiT(num_blocks=1)`` (its own argument: one joint block of 19), built on ``meta``, then
  ``single_blocks`` kept to a prefix of 1 (of 38), materialised: 3072 wide, ~0.47 B parameters.
- ``FluxTextEncoderT5`` (T5-XXL, no argument) built on ``meta``, ``encoder.block`` kept to a
  prefix of 1 (of 24), materialised: 4096 wide, ~0.32 B parameters (0.13 B of them its
  32,128-token vocabulary, tied between ``shared`` and ``encoder.embed_tokens``).
- ``FluxTextEncoderClip(vocab_size=1000, num_encoder_layers=2, encoder_intermediate_size=64)``
  (its own arguments; the width stays 768, which the DiT's pooled embedder expects; two layers
  because its ``clip_skip=2`` reads the second-to-last).
- ``FluxVAEEncoder()``: full size (34 M parameters).
- The data loader tokenizes the prompt to 77 CLIP tokens (CLIP's fixed length) and 32 T5
  tokens: train.py pads T5 to ``t5_sequence_length=512``; the pretokenized slot hands on what
  the dataset made, and 32 keeps the CPU step short (the code path is the same).

Qwen-Image (:func:`qwen_image_lora_step`):

- ``QwenImageDiT(num_layers=1)`` (its own argument: one block of 60), built for real on the CPU
  with torch's default init under the seed (its RoPE keeps plain tensors that ``to_empty``
  would miss): 3072 wide, text input 3584, ~0.38 B parameters.
- ``QwenImageTextEncoder`` (Qwen2.5-VL-7B, no argument) built on ``meta``;
  ``model.language_model.layers`` kept to a prefix of 1 (of 28) and ``model.visual.blocks`` to 1
  (of 32); materialised (3584 wide, its 152,064-token vocabulary alone 2.2 GB), its RoPE tables
  rebuilt from its config (:func:`rebuild_computed_buffers`). ``lm_head`` (another 2.2 GB)
  is never called (DiffSynth's ``forward`` returns hidden states), but stage 1 holds it as part
  of the text encoder and refuses to run holding a parameter on ``meta``; its weight is one
  real zero broadcast to its shape (stride 0, 4 bytes), as real as a loaded one to the stage.
- ``QwenImageVAE(base_dim=16)`` (its own argument; DiffSynth's is 96; ``z_dim`` stays 16, which
  the DiT's ``img_in`` expects).
- The tokenizer: DiffSynth loads ``Qwen2Tokenizer`` from the hub and its prompt unit formats the
  prompt *string* into a chat template first. :class:`PromptTokens` stands in the prompt's place
  and :class:`TemplateTokenizer` in the tokenizer's: the template is tokenized byte by byte and
  the dataset's token ids (8 here) are spliced in where the prompt stands.
- Resident memory: ~5.4 GB (the vocabulary and the one 3072-wide block dominate).

Why everything is float32 on the CPU: the split is checked bit for bit. Why ``lora_B`` is drawn
rather than zero (peft starts it at zero): so that gradients reach ``lora_A`` too and the exact
comparison covers both halves of every adapter.

    flux_lora_step(seed) -> (step, batch)        # FLUX.1 LoRA, real random weights, batch 1
    qwen_image_lora_step(seed) -> (step, batch)  # Qwen-Image LoRA, real random weights, batch 1
"""

from __future__ import annotations

import math
import re
import types
import weakref
from typing import Any

import torch

from examples.diffsynth.steps import (
    DIFFSYNTH,
    WHY_NOT,
    DiffusionTrainingModule,
    FluxTrainingModule,
    PretokenizedPair,
    _preprocessed,
    _sft_settings,
    _train_mode,
)

__all__ = [
    "DIFFSYNTH",
    "WHY_NOT",
    "PromptTokens",
    "TemplateTokenizer",
    "fill_deterministically",
    "flux_batch",
    "flux_lora_step",
    "qwen_image_batch",
    "qwen_image_lora_step",
]

FLUX_CLIP_VOCABULARY = 1000
FLUX_T5_TOKENS = 32
QWEN_VAE_BASE_DIM = 16
QWEN_LORA_TARGETS = [
    "to_q",
    "to_k",
    "to_v",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_out.0",
    "to_add_out",
]


def keep_prefix(blocks: torch.nn.ModuleList, count: int) -> None:
    """Keep the first ``count`` blocks of a repeated-block list (in place), before materialising."""
    del blocks[count:]


def fill_deterministically(module: torch.nn.Module, *, seed: int) -> torch.nn.Module:
    """Give a ``meta`` module CPU storage and seeded values, so a run is reproducible.

    Matrices and embeddings are drawn uniform in ``±1/sqrt(fan_in)`` (the scale of torch's
    default ``Linear`` init, so activations stay finite through 3072-wide blocks); 1-D
    ``weight`` tensors (norm scales) are one, other 1-D tensors (biases) small and random.
    Parameters are filled in name order from one generator, so the same seed gives the same
    model whatever else ran before. Tied parameters (T5's ``shared`` and ``embed_tokens``) stay
    tied.
    """
    shared = _shared_parameters(module)
    module.to_empty(device="cpu")
    for owners in shared:  # to_empty gives each owner its own tensor: tie them again
        (first_owner, first_name), *others = owners
        for owner, name in others:
            setattr(owner, name, getattr(first_owner, first_name))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in sorted(module.state_dict(keep_vars=True).items()):
            if tensor.dim() >= 2:
                bound = 1 / math.sqrt(tensor[0].numel())
                tensor.uniform_(-bound, bound, generator=generator)
            elif name.endswith("weight"):
                tensor.fill_(1.0)
            elif tensor.is_floating_point():
                tensor.uniform_(-0.02, 0.02, generator=generator)
            else:
                tensor.zero_()
    return module


def rebuild_computed_buffers(module: torch.nn.Module) -> None:
    """Rebuild, on the CPU, each submodule whose buffers are computed, not stored (RoPE tables).

    ``to_empty`` leaves non-persistent buffers (``inv_freq``) uninitialised and no state dict
    holds them, so each such submodule is constructed again from its owner's ``config``, as
    transformers constructs it. Any other module with such buffers is refused.
    """
    for owner_name, owner in list(module.named_modules()):
        for child_name, child in list(owner.named_children()):
            if not child._non_persistent_buffers_set:
                continue
            config = getattr(owner, "config", None)
            if config is None:
                raise TypeError(f"{owner_name}.{child_name}: computed buffers and no config")
            setattr(owner, child_name, type(child)(config))


def _shared_parameters(module: torch.nn.Module) -> list[list[tuple[torch.nn.Module, str]]]:
    """The (owner, attribute) pairs of every parameter held by more than one module (ties)."""
    owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for submodule in module.modules():
        for name, parameter in submodule.named_parameters(recurse=False):
            owners.setdefault(id(parameter), []).append((submodule, name))
    return [pairs for pairs in owners.values() if len(pairs) > 1]


def draw_lora_b(module: torch.nn.Module, *, seed: int) -> None:
    """Draw every ``lora_B`` (peft starts them at zero, which hides ``lora_A``'s gradient)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in sorted(module.named_parameters()):
            if "lora_B" in name:
                parameter.uniform_(-0.02, 0.02, generator=generator)


# -- FLUX.1 ---------------------------------------------------------------------------------------
class FluxLoraTrainingModule(FluxTrainingModule):
    """``FluxTrainingModule`` (train.py's ``forward``, task "sft") on real, shrunk weights.

    Only ``__init__`` differs from :class:`examples.diffsynth.steps.FluxTrainingModule`
    (which builds the full models on ``meta``): the models are built as the module docstring
    says. ``forward`` and ``get_pipeline_inputs`` are inherited unchanged.
    """

    def __init__(self, seed: int = 0) -> None:
        torch.nn.Module.__init__(self)
        from diffsynth.models.flux_dit import FluxDiT
        from diffsynth.models.flux_text_encoder_clip import FluxTextEncoderClip
        from diffsynth.models.flux_text_encoder_t5 import FluxTextEncoderT5
        from diffsynth.models.flux_vae import FluxVAEEncoder
        from diffsynth.pipelines.flux_image import FluxImagePipeline

        torch.manual_seed(seed)
        pipe = FluxImagePipeline(device="cpu", torch_dtype=torch.float32)
        pipe.text_encoder_1 = FluxTextEncoderClip(
            vocab_size=FLUX_CLIP_VOCABULARY, num_encoder_layers=2, encoder_intermediate_size=64
        )
        pipe.vae_encoder = FluxVAEEncoder()
        with torch.device("meta"):
            text_encoder_2 = FluxTextEncoderT5()
            dit = FluxDiT(num_blocks=1)
        keep_prefix(text_encoder_2.encoder.block, 1)
        keep_prefix(dit.single_blocks, 1)
        pipe.text_encoder_2 = fill_deterministically(text_encoder_2, seed=seed + 1)
        pipe.dit = fill_deterministically(dit, seed=seed + 2)
        pipe.tokenizer_1, pipe.tokenizer_2 = PretokenizedPair(0), PretokenizedPair(1)
        pipe.preprocess_image = types.MethodType(_preprocessed, pipe)
        self.pipe = _train_mode(self, pipe, ["a_to_qkv", "b_to_qkv", "to_qkv_mlp"])
        draw_lora_b(self.pipe.dit, seed=seed + 3)
        _sft_settings(self)


def flux_lora_step(seed: int = 0) -> tuple[FluxLoraTrainingModule, dict[str, torch.Tensor]]:
    """The FLUX.1 LoRA step on real random weights and one sample (a 32x32 image)."""
    return FluxLoraTrainingModule(seed), flux_batch(seed)


def flux_batch(seed: int) -> dict[str, torch.Tensor]:
    """One sample as the data loader hands it over: pixels in [-1, 1], CLIP and T5 token ids."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "image": torch.rand(1, 3, 32, 32, generator=generator) * 2 - 1,
        "clip_ids": torch.randint(0, FLUX_CLIP_VOCABULARY, (1, 77), generator=generator),
        "t5_ids": torch.randint(0, 32128, (1, FLUX_T5_TOKENS), generator=generator),
    }


# -- Qwen-Image -----------------------------------------------------------------------------------
_PROMPTS_BY_MARKER: weakref.WeakValueDictionary[str, PromptTokens] = weakref.WeakValueDictionary()
"""Marker text -> the :class:`PromptTokens` that formatted as it (while it lives)."""


class PromptTokens:
    """The prompt as the dataset tokenized it, standing where DiffSynth expects its string.

    ``QwenImageUnit_PromptEmbedder.encode_prompt`` formats the prompt into its chat template
    (``template.format(prompt)``) and tokenizes the text. A string cannot carry traced token
    ids, so this object formats as a marker naming itself, and :class:`TemplateTokenizer` puts
    the ids back where the marker stands.
    """

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __format__(self, spec: str) -> str:
        marker = f"<|prompt-{id(self)}|>"
        _PROMPTS_BY_MARKER[marker] = self
        return marker


class TemplateTokenizer:
    """The pipeline's ``tokenizer`` slot: DiffSynth's template byte by byte, the prompt as given.

    DiffSynth loads ``Qwen2Tokenizer`` from the hub (``Qwen/Qwen-Image``, ``tokenizer/``); no
    hub files here, so the template text around the prompt is tokenized one UTF-8 byte per token
    (ids 0..255) and the prompt's own ids (:class:`PromptTokens`) are spliced in. The output is
    what ``Qwen2Tokenizer`` returns for one prompt: a ``BatchEncoding`` of ``input_ids`` and an
    all-ones ``attention_mask``, shape ``(1, tokens)``. Qwen's tokenizer makes 34 tokens of the
    template's head, which DiffSynth drops (``drop_idx = 34``); byte by byte the head is 180
    tokens and the tail 33, so 146 + 33 template tokens stay in the prompt states here (the code
    path is the same).
    """

    def __call__(self, texts: list[str], **_: Any) -> Any:
        from transformers import BatchEncoding

        (text,) = texts  # DiffSynth tokenizes one prompt per batch
        head, marker, tail = re.split(r"(<\|prompt-\d+\|>)", text)
        prompt = _PROMPTS_BY_MARKER[marker].ids
        pieces = [_bytes_as_ids(head, prompt), prompt, _bytes_as_ids(tail, prompt)]
        input_ids = torch.cat(pieces, dim=1)
        return BatchEncoding({"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)})


def _bytes_as_ids(text: str, like: torch.Tensor) -> torch.Tensor:
    """``text`` as one token per UTF-8 byte, shaped ``(1, bytes)`` like the prompt's ids."""
    return torch.tensor([list(text.encode())], dtype=like.dtype, device=like.device)


class QwenImageLoraTrainingModule(DiffusionTrainingModule):
    """``examples/qwen_image/model_training/train.py``'s ``QwenImageTrainingModule``, task "sft".

    ``get_pipeline_inputs`` holds the inputs train.py's forward passes (the image, its size,
    ``cfg_scale=1``, the empty negative prompt, the device, the checkpointing flags); ``forward``
    is train.py's, with the batch as named tensors as in :mod:`examples.diffsynth.steps`.
    """

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        from diffsynth.models.qwen_image_dit import QwenImageDiT
        from diffsynth.models.qwen_image_text_encoder import QwenImageTextEncoder
        from diffsynth.models.qwen_image_vae import QwenImageVAE
        from diffsynth.pipelines.qwen_image import QwenImagePipeline

        torch.manual_seed(seed)
        pipe = QwenImagePipeline(device="cpu", torch_dtype=torch.float32)
        pipe.vae = QwenImageVAE(base_dim=QWEN_VAE_BASE_DIM).eval()
        # Real storage: its RoPE keeps plain tensors (``pos_freqs``) that ``to_empty`` misses.
        dit = QwenImageDiT(num_layers=1)
        with torch.device("meta"):
            text_encoder = QwenImageTextEncoder()
        keep_prefix(text_encoder.model.language_model.layers, 1)
        keep_prefix(text_encoder.model.visual.blocks, 1)
        lm_head = text_encoder.lm_head  # never called: DiffSynth's forward returns hidden states
        del text_encoder.lm_head
        zero = torch.zeros((), dtype=lm_head.weight.dtype)
        lm_head.weight = torch.nn.Parameter(zero.expand(lm_head.weight.shape), requires_grad=False)
        pipe.text_encoder = fill_deterministically(text_encoder, seed=seed + 1)
        rebuild_computed_buffers(text_encoder)
        text_encoder.lm_head = lm_head
        pipe.dit = dit
        pipe.tokenizer = TemplateTokenizer()
        pipe.preprocess_image = types.MethodType(_preprocessed, pipe)
        self.pipe = _train_mode(self, pipe, QWEN_LORA_TARGETS)
        draw_lora_b(self.pipe.dit, seed=seed + 3)
        _sft_settings(self)

    def get_pipeline_inputs(self, data: dict[str, Any]) -> tuple[dict, dict, dict]:
        """train.py's, with sizes read off the pixel tensor ``(1, C, H, W)``."""
        inputs_posi = {"prompt": data["prompt"]}
        inputs_nega = {"negative_prompt": ""}
        inputs_shared = {
            "input_image": data["image"],
            "height": data["image"].shape[2],
            "width": data["image"].shape[3],
            "cfg_scale": 1,
            "rand_device": self.pipe.device,
            "use_gradient_checkpointing": self.use_gradient_checkpointing,
            "use_gradient_checkpointing_offload": self.use_gradient_checkpointing_offload,
        }
        return inputs_shared, inputs_posi, inputs_nega

    def forward(self, image: torch.Tensor, prompt_ids: torch.Tensor) -> torch.Tensor:
        data = {"image": image, "prompt": PromptTokens(prompt_ids)}
        # From here on: train.py's forward(data), verbatim.
        inputs = self.get_pipeline_inputs(data)
        inputs = self.transfer_data_to_device(inputs, self.pipe.device, self.pipe.torch_dtype)
        for unit in self.pipe.units:
            inputs = self.pipe.unit_runner(unit, self.pipe, *inputs)
        loss = self.task_to_loss[self.task](self.pipe, *inputs)
        return loss


def qwen_image_lora_step(
    seed: int = 0,
) -> tuple[QwenImageLoraTrainingModule, dict[str, torch.Tensor]]:
    """The Qwen-Image LoRA step on real random weights and one sample (a 32x32 image)."""
    return QwenImageLoraTrainingModule(seed), qwen_image_batch(seed)


def qwen_image_batch(seed: int, *, prompt_tokens: int = 8) -> dict[str, torch.Tensor]:
    """One sample: pixels in [-1, 1] and the prompt's token ids (Qwen's vocabulary)."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "image": torch.rand(1, 3, 32, 32, generator=generator) * 2 - 1,
        "prompt_ids": torch.randint(256, 152064, (1, prompt_tokens), generator=generator),
    }
