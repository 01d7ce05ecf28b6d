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

    wan_t2v_lora_step() -> (step, batch)   # Wan 2.1 text-to-video
    qwen_image_lora_step() -> (step, batch)
    flux_lora_step() -> (step, batch)
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


# -- Wan 2.1 text-to-video -----------------------------------------------------------------------
class WanTrainingModule(DiffusionTrainingModule):
    """``examples/wanvideo/model_training/train.py``'s ``WanTrainingModule``, tiny, task "sft"."""

    def __init__(self) -> None:
        super().__init__()
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
        pipe.tokenizer = Pretokenized()
        pipe.preprocess_video = types.MethodType(_preprocessed, pipe)
        self.pipe = _train_mode(self, pipe, ["q", "k", "v", "o", "ffn.0", "ffn.2"])
        self.use_gradient_checkpointing = False
        self.use_gradient_checkpointing_offload = False
        self.extra_inputs: list[str] = []
        self.task = "sft"
        self.task_to_loss = {
            "sft": lambda pipe, inputs_shared, inputs_posi, inputs_nega: FlowMatchSFTLoss(
                pipe, **inputs_shared, **inputs_posi
            ),
        }
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
