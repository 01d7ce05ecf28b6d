"""DiffSynth-Studio's own LoRA training steps, tiny and random, for graphsplit to split.

Each step is a :class:`diffsynth.diffusion.DiffusionTrainingModule` whose ``forward`` is the
one in DiffSynth-Studio's ``examples/*/model_training/train.py`` (Apache-2.0, (c) ModelScope;
https://github.com/modelscope/DiffSynth-Studio): pipeline inputs, ``transfer_data_to_device``,
every unit of ``pipe.units`` through ``pipe.unit_runner``, then ``FlowMatchSFTLoss`` (which calls
``pipe.model_fn``). Pipelines, units, models, scheduler and loss are DiffSynth's, unmodified;
the models are built from DiffSynth's own classes with tiny configs and random weights, the
LoRA by DiffSynth's ``add_lora_to_model``, the scheduler set as ``switch_pipe_to_training_mode``
sets it.

What differs from DiffSynth's script, and why (graphsplit traces tensors):

- ``forward`` takes the batch as named tensors and builds DiffSynth's ``data`` dict from them.
  DiffSynth trains one sample per batch (``collate_fn=lambda x: x[0]``); so do these steps.
- The dataset does the two conversions DiffSynth's units do on Python objects: PIL frames to a
  pixel tensor (``pipe.preprocess_video`` / ``preprocess_image``, run by the data loader here, so
  the pipeline's preprocess is the identity) and the prompt string to token ids and a mask
  (:class:`Pretokenized` stands in the pipeline's ``tokenizer`` slot and hands them on).
- Weights are float32 on the CPU, so that the split can be checked bit for bit.

    wan_t2v_lora_step() -> (step, batch)        # Wan 2.1 text-to-video, tiny, runs
    flux_lora_step_on_meta() -> (step, batch)   # FLUX.1: full widths on meta, plans only

Qwen-Image is not here: ``QwenImageDiT`` fixes its width (3072, text 3584) and its prompt unit
formats the prompt *string* into a chat template before tokenizing, so there is neither a tiny
model nor a tensor path for the prompt.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from examples.diffsynth.diffsynth_import import diffsynth_or_reason

DIFFSYNTH, WHY_NOT = diffsynth_or_reason()
if DIFFSYNTH:
    from diffsynth.diffusion import DiffusionTrainingModule, FlowMatchSFTLoss
else:  # so that the module imports and callers can print WHY_NOT
    DiffusionTrainingModule = torch.nn.Module  # type: ignore[misc,assignment]


class Pretokenized:
    """The pipeline's tokenizer slot, for prompts the dataset already tokenized.

    DiffSynth's prompt units call ``pipe.tokenizer(prompt, return_mask=True, ...)`` on the
    prompt string; here ``prompt`` is ``(ids, mask)`` from the data loader, handed on as is.
    """

    def __call__(self, prompt: Any, return_mask: bool = False, **_: Any) -> Any:
        ids, mask = prompt
        return (ids, mask) if return_mask else ids


def _preprocessed(self: Any, video: Any, **_: Any) -> Any:
    """``pipe.preprocess_video`` when the data loader already made the pixel tensor."""
    return video


def _train_mode(module: DiffusionTrainingModule, pipe: Any, lora_targets: list[str]) -> Any:
    """What ``switch_pipe_to_training_mode`` does for a LoRA on ``pipe.dit``."""
    pipe.scheduler.set_timesteps(1000, training=True)
    pipe.freeze_except([])
    pipe.dit = module.add_lora_to_model(pipe.dit, target_modules=lora_targets, lora_rank=4)
    return pipe


def _sft_settings(module: DiffusionTrainingModule) -> None:
    """The rest of train.py's constructor for ``--task sft``: no checkpointing, no extra inputs,
    ``FlowMatchSFTLoss`` as the loss."""
    module.use_gradient_checkpointing = False
    module.use_gradient_checkpointing_offload = False
    module.extra_inputs = []
    module.task = "sft"
    module.task_to_loss = {
        "sft": lambda pipe, inputs_shared, inputs_posi, inputs_nega: FlowMatchSFTLoss(
            pipe, **inputs_shared, **inputs_posi
        ),
    }


# -- Wan 2.1 text-to-video -----------------------------------------------------------------------
def tiny_wan_pipeline() -> Any:
    """DiffSynth's ``WanVideoPipeline`` with a tiny UMT5 text encoder, Wan VAE and DiT (random
    weights); the caller sets its tokenizer."""
    from diffsynth.models.wan_video_dit import WanModel
    from diffsynth.models.wan_video_text_encoder import WanTextEncoder
    from diffsynth.models.wan_video_vae import VideoVAE_, WanVideoVAE
    from diffsynth.pipelines.wan_video import WanVideoPipeline

    pipe = WanVideoPipeline(device="cpu", torch_dtype=torch.float32)
    pipe.text_encoder = WanTextEncoder(
        vocab=64, dim=32, dim_attn=32, dim_ffn=64, num_heads=2, num_layers=1, num_buckets=8
    )
    pipe.vae = WanVideoVAE(z_dim=16)
    pipe.vae.model = VideoVAE_(dim=8, z_dim=16).eval().requires_grad_(False)
    pipe.dit = WanModel(
        dim=48, in_dim=16, ffn_dim=64, out_dim=16, text_dim=32, freq_dim=16, eps=1e-6,
        patch_size=(1, 2, 2), num_heads=2, num_layers=2, has_image_input=False,
        require_vae_embedding=False, require_clip_embedding=False,
    )  # fmt: skip
    return pipe


class WanTrainingModule(DiffusionTrainingModule):
    """``examples/wanvideo/model_training/train.py``'s ``WanTrainingModule``, tiny, task "sft"."""

    def __init__(self) -> None:
        super().__init__()
        pipe = tiny_wan_pipeline()
        pipe.tokenizer = Pretokenized()
        pipe.preprocess_video = types.MethodType(_preprocessed, pipe)
        self.pipe = _train_mode(self, pipe, ["q", "k", "v", "o", "ffn.0", "ffn.2"])
        _sft_settings(self)
        self.max_timestep_boundary = 1.0
        self.min_timestep_boundary = 0.0

    def get_pipeline_inputs(self, data: dict[str, Any]) -> tuple[dict, dict, dict]:
        """train.py's, with sizes read off the pixel tensor ``(1, C, T, H, W)``."""
        inputs_posi = {"prompt": data["prompt"]}
        inputs_nega: dict[str, Any] = {}
        inputs_shared = {
            "input_video": data["video"],
            "height": data["video"].shape[3],
            "width": data["video"].shape[4],
            "num_frames": data["video"].shape[2],
            "cfg_scale": 1,
            "tiled": False,
            "rand_device": self.pipe.device,
            "use_gradient_checkpointing": self.use_gradient_checkpointing,
            "use_gradient_checkpointing_offload": self.use_gradient_checkpointing_offload,
            "cfg_merge": False,
            "vace_scale": 1,
            "max_timestep_boundary": self.max_timestep_boundary,
            "min_timestep_boundary": self.min_timestep_boundary,
        }
        return inputs_shared, inputs_posi, inputs_nega

    def forward(
        self, video: torch.Tensor, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor
    ) -> torch.Tensor:
        data = {"video": video, "prompt": (prompt_ids, prompt_mask)}
        # From here on: train.py's forward(data), verbatim.
        inputs = self.get_pipeline_inputs(data)
        inputs = self.transfer_data_to_device(inputs, self.pipe.device, self.pipe.torch_dtype)
        for unit in self.pipe.units:
            inputs = self.pipe.unit_runner(unit, self.pipe, *inputs)
        loss = self.task_to_loss[self.task](self.pipe, *inputs)
        return loss


def wan_t2v_lora_step(seed: int = 0) -> tuple[WanTrainingModule, dict[str, torch.Tensor]]:
    """The tiny Wan step and one batch: 5 frames of 32x32 pixels, 8 prompt tokens."""
    torch.manual_seed(seed)
    step = WanTrainingModule()
    batch = wan_batch(seed)
    return step, batch


def wan_batch(seed: int) -> dict[str, torch.Tensor]:
    """One sample as DiffSynth's data loader hands it over (after preprocess/tokenize)."""
    generator = torch.Generator().manual_seed(seed)
    mask = torch.ones(1, 8, dtype=torch.long)
    mask[:, 5 + seed % 3 :] = 0
    return {
        "video": torch.rand(1, 3, 5, 32, 32, generator=generator) * 2 - 1,
        "prompt_ids": torch.randint(1, 64, (1, 8), generator=generator) * mask,
        "prompt_mask": mask,
    }


# -- FLUX.1 ---------------------------------------------------------------------------------------
class PretokenizedPair:
    """FLUX's two tokenizer slots (CLIP, T5) for a prompt the dataset tokenized for both.

    DiffSynth calls ``tokenizer(prompt, return_tensors="pt", ...).input_ids``; ``prompt`` is
    ``(clip_ids, t5_ids)`` here, and slot ``index`` hands on its half.
    """

    def __init__(self, index: int) -> None:
        self.index = index

    def __call__(self, prompt: Any, **_: Any) -> Any:
        return types.SimpleNamespace(input_ids=prompt[self.index])


class FluxTrainingModule(DiffusionTrainingModule):
    """``examples/flux/model_training/train.py``'s ``FluxTrainingModule``, task "sft", on meta.

    DiffSynth's FLUX classes fix their widths (``FluxDiT``: 3072 wide, 38 single blocks;
    ``FluxTextEncoderT5``: T5-XXL), so there is no tiny FLUX: the models are built on ``meta``
    (10.7 B parameters, no memory) with the fewest joint blocks (1), which is enough to plan
    the split but not to run it.
    """

    def __init__(self) -> None:
        super().__init__()
        from diffsynth.models.flux_dit import FluxDiT
        from diffsynth.models.flux_text_encoder_clip import FluxTextEncoderClip
        from diffsynth.models.flux_text_encoder_t5 import FluxTextEncoderT5
        from diffsynth.models.flux_vae import FluxVAEEncoder
        from diffsynth.pipelines.flux_image import FluxImagePipeline

        pipe = FluxImagePipeline(device="cpu", torch_dtype=torch.float32)
        with torch.device("meta"):
            pipe.text_encoder_1 = FluxTextEncoderClip()
            pipe.text_encoder_2 = FluxTextEncoderT5()
            pipe.dit = FluxDiT(num_blocks=1)
            pipe.vae_encoder = FluxVAEEncoder()
        pipe.tokenizer_1, pipe.tokenizer_2 = PretokenizedPair(0), PretokenizedPair(1)
        pipe.preprocess_image = types.MethodType(_preprocessed, pipe)
        self.pipe = _train_mode(self, pipe, ["a_to_qkv", "b_to_qkv", "to_qkv_mlp"])
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
            "embedded_guidance": 1,
            "t5_sequence_length": 512,
            "tiled": False,
            "rand_device": self.pipe.device,
            "use_gradient_checkpointing": self.use_gradient_checkpointing,
            "use_gradient_checkpointing_offload": self.use_gradient_checkpointing_offload,
        }
        return inputs_shared, inputs_posi, inputs_nega

    def forward(
        self, image: torch.Tensor, clip_ids: torch.Tensor, t5_ids: torch.Tensor
    ) -> torch.Tensor:
        data = {"image": image, "prompt": (clip_ids, t5_ids)}
        # From here on: train.py's forward(data), verbatim.
        inputs = self.get_pipeline_inputs(data)
        inputs = self.transfer_data_to_device(inputs, self.pipe.device, self.pipe.torch_dtype)
        for unit in self.pipe.units:
            inputs = self.pipe.unit_runner(unit, self.pipe, *inputs)
        loss = self.task_to_loss[self.task](self.pipe, *inputs)
        return loss


def flux_lora_step_on_meta() -> tuple[FluxTrainingModule, dict[str, torch.Tensor]]:
    """The FLUX step on meta weights and one batch: a 32x32 image, 77 CLIP and 512 T5 tokens."""
    generator = torch.Generator().manual_seed(0)
    batch = {
        "image": torch.rand(1, 3, 32, 32, generator=generator) * 2 - 1,
        "clip_ids": torch.randint(0, 1000, (1, 77), generator=generator),
        "t5_ids": torch.randint(0, 1000, (1, 512), generator=generator),
    }
    return FluxTrainingModule(), batch
