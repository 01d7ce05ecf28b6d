"""DiffSynth-Studio's ``WanTrainingModule`` for Wan variants beyond T2V, tiny, on raw samples.

The module is ``examples/wanvideo/model_training/train.py``'s (DiffSynth-Studio, Apache-2.0,
(c) ModelScope; https://github.com/modelscope/DiffSynth-Studio, commit fed7b18f): its
constructor's steps after the model download (``split_pipeline_units``,
``switch_pipe_to_training_mode`` -- DiffSynth's own methods --, the stored configs, with
gradient checkpointing forced on as train.py forces it), and ``parse_extra_inputs``,
``get_pipeline_inputs`` and ``forward`` verbatim
(:class:`examples.diffsynth.real_data.TrainPyWanSteps`). Only the download differs:
``WanVideoPipeline.from_pretrained`` is replaced by DiffSynth's model classes with tiny configs
and random weights, set on the pipeline as ``from_pretrained`` sets them, and the tokenizer is
DiffSynth's ``HuggingfaceTokenizer`` on a tiny local word-level tokenizer
(:func:`examples.diffsynth.real_data.write_tiny_tokenizer`).

The variants, each as its ``examples/wanvideo/model_training/lora/*.sh`` trains it:

- ``i2v`` (Wan2.1-I2V-14B-480P): ``--extra_inputs input_image``; a CLIP image encoder and the
  VAE-encoded first frame (``y``) condition the DiT (``has_image_input``, ``in_dim`` 36).
- ``flf2v`` (Wan2.1-FLF2V-14B-720P): ``input_image,end_image``; both frames through CLIP
  (``has_image_pos_emb``) and the VAE.
- ``fun_control`` (Wan2.1-Fun-1.3B-Control): ``control_video``, VAE-encoded into ``y``
  (``in_dim`` 48); the CLIP encoder is loaded, as the script loads it, and never called.
- ``ti2v`` (Wan2.2-TI2V-5B): ``input_image`` with the Wan 2.2 VAE (``z_dim`` 48, 16x
  upsampling) and the first frame's latents fused into the noisy latents.
- ``vace`` (Wan2.1-VACE-1.3B): ``vace_video,vace_reference_image``, the LoRA on ``vace``.

Tiny, and why each is still the model's code: the CLIP image encoder is DiffSynth's
``WanImageEncoder`` holding an ``XLMRobertaCLIP`` whose vision width stays 1280 (the DiT's
``img_emb`` and its cross-attention take 1280-wide features, 257 of them) with one block run
(``use_31_block`` drops the last of two) on 32x32 images in 2x2 patches (256 + 1 tokens). Its
``transforms`` are torchvision's, which cannot load beside this CPU torch build
(:mod:`examples.diffsynth.diffsynth_import`); ``encode_image`` uses only the last one,
``Normalize``, so :class:`Normalize` computes what torchvision's does. The VAEs are built with
their tiny ``VideoVAE_`` / ``VideoVAE38_`` in place of the full-size ones (built full, they take
seconds and are replaced anyway).

    wan_variant_step(variant, tokenizer_dir) -> WanTrainingModule
    variant_sample(variant, seed) -> {"video": [PIL.Image] * 5, "prompt": str, ...}
    assert_two_steps_exact(step, split, data, folder)
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch.utils.data import DataLoader

import graphsplit
from examples.diffsynth.real_data import PROMPTS, TrainPyWanSteps, UnifiedLikeDataset, frames
from examples.diffsynth.steps import DIFFSYNTH

if DIFFSYNTH:
    from diffsynth.diffusion import DiffusionTrainingModule, FlowMatchSFTLoss
else:  # so that the module imports and the tests can skip
    DiffusionTrainingModule = torch.nn.Module  # type: ignore[misc,assignment]

VARIANTS = ("i2v", "flf2v", "fun_control", "ti2v", "vace")

EXTRA_INPUTS = {
    "i2v": "input_image",
    "flf2v": "input_image,end_image",
    "fun_control": "control_video",
    "ti2v": "input_image",
    "vace": "vace_video,vace_reference_image",
}
"""Each variant's ``--extra_inputs`` in its ``lora/*.sh``."""

LORA_BASE_MODEL = {"vace": "vace"}
"""``--lora_base_model`` where it is not ``dit``."""

SIZE = {"ti2v": 32}
"""Frame sides: a multiple of the pipeline's division factor (twice the VAE's upsampling)."""


class Normalize(torch.nn.Module):
    """``torchvision.transforms.Normalize(mean, std)`` on a float image tensor, out of place:
    ``(x - mean[c]) / std[c]`` per channel ``c`` (dim -3)."""

    def __init__(self, mean: list[float], std: list[float]) -> None:
        super().__init__()
        self.mean = mean
        self.std = std

    def forward(self, tensor: torch.Tensor) -> torch.Tensor:
        mean = torch.as_tensor(self.mean, dtype=tensor.dtype, device=tensor.device)
        std = torch.as_tensor(self.std, dtype=tensor.dtype, device=tensor.device)
        return tensor.clone().sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))


class Compose:
    """``torchvision.transforms.Compose``'s ``transforms`` list, all ``encode_image`` reads."""

    def __init__(self, transforms: list[Any]) -> None:
        self.transforms = transforms


def tiny_image_encoder() -> Any:
    """DiffSynth's ``WanImageEncoder`` with a tiny ``XLMRobertaCLIP`` (vision width 1280)."""
    from diffsynth.models.wan_video_image_encoder import WanImageEncoder, XLMRobertaCLIP

    encoder = WanImageEncoder.__new__(WanImageEncoder)  # its __init__ builds ViT-H/14 whole
    torch.nn.Module.__init__(encoder)
    encoder.model = XLMRobertaCLIP(
        image_size=32, patch_size=2, vision_dim=1280, vision_mlp_ratio=0.25, vision_heads=2,
        vision_layers=2,
    )  # fmt: skip
    # _clip's transforms for an XLM-RoBERTa CLIP: Resize, ToTensor, Normalize(mean, std).
    encoder.transforms = Compose(
        [
            None,
            None,
            Normalize(
                mean=[0.48145466, 0.4578275, 0.40821073], std=[0.26862954, 0.26130258, 0.27577711]
            ),
        ]
    )
    return encoder.eval()


def tiny_vae(variant: str) -> Any:
    """DiffSynth's ``WanVideoVAE`` (Wan 2.1) or ``WanVideoVAE38`` (Wan 2.2, ``ti2v``), tiny."""
    from diffsynth.models import wan_video_vae

    if variant == "ti2v":
        tiny = functools.partial(wan_video_vae.VideoVAE38_, dec_dim=8)
        with mock.patch.object(wan_video_vae, "VideoVAE38_", tiny):
            return wan_video_vae.WanVideoVAE38(z_dim=48, dim=8)
    tiny = functools.partial(wan_video_vae.VideoVAE_, dim=8)
    with mock.patch.object(wan_video_vae, "VideoVAE_", tiny):
        return wan_video_vae.WanVideoVAE(z_dim=16)


def tiny_dit(variant: str) -> Any:
    """DiffSynth's ``WanModel`` with the variant's flags (its ``model_configs.py`` entry)."""
    from diffsynth.models.wan_video_dit import WanModel

    flags: dict[str, Any] = {
        "i2v": {"has_image_input": True, "in_dim": 36, "out_dim": 16},
        "flf2v": {"has_image_input": True, "in_dim": 36, "out_dim": 16, "has_image_pos_emb": True},
        "fun_control": {"has_image_input": True, "in_dim": 48, "out_dim": 16},
        "ti2v": {
            "has_image_input": False, "in_dim": 48, "out_dim": 48, "seperated_timestep": True,
            "require_clip_embedding": False, "require_vae_embedding": False,
            "fuse_vae_embedding_in_latents": True,
        },
        "vace": {"has_image_input": False, "in_dim": 16, "out_dim": 16},
    }[variant]  # fmt: skip
    return WanModel(
        dim=48, ffn_dim=64, text_dim=32, freq_dim=16, eps=1e-6, patch_size=(1, 2, 2),
        num_heads=2, num_layers=2, **flags,
    )  # fmt: skip


def tiny_pipeline(variant: str, tokenizer_dir: Path) -> Any:
    """The variant's ``WanVideoPipeline``, its models set as ``from_pretrained`` sets them."""
    from diffsynth.models.wan_video_text_encoder import HuggingfaceTokenizer, WanTextEncoder
    from diffsynth.models.wan_video_vace import VaceWanModel
    from diffsynth.pipelines.wan_video import WanVideoPipeline

    pipe = WanVideoPipeline(device="cpu", torch_dtype=torch.float32)
    pipe.text_encoder = WanTextEncoder(
        vocab=64, dim=32, dim_attn=32, dim_ffn=64, num_heads=2, num_layers=1, num_buckets=8
    )
    pipe.dit = tiny_dit(variant)
    pipe.vae = tiny_vae(variant)
    if variant in ("i2v", "flf2v", "fun_control"):
        pipe.image_encoder = tiny_image_encoder()
    if variant == "vace":
        pipe.vace = VaceWanModel(
            vace_layers=(0,), vace_in_dim=96, patch_size=(1, 2, 2), has_image_input=False,
            dim=48, num_heads=2, ffn_dim=64, eps=1e-6,
        )  # fmt: skip
    # from_pretrained: the size division factor, the tokenizer (seq_len 512 there).
    pipe.height_division_factor = pipe.vae.upsampling_factor * 2
    pipe.width_division_factor = pipe.vae.upsampling_factor * 2
    pipe.tokenizer = HuggingfaceTokenizer(name=str(tokenizer_dir), seq_len=16, clean="whitespace")
    return pipe


class WanTrainingModule(TrainPyWanSteps, DiffusionTrainingModule):
    """train.py's ``WanTrainingModule`` with ``--task sft`` and a LoRA, on a tiny pipeline."""

    # -- from examples/wanvideo/model_training/train.py's __init__, after the download ---------
    # fmt: off
    def __init__(
        self,
        pipe,
        trainable_models=None,
        lora_base_model=None, lora_target_modules="", lora_rank=32, lora_checkpoint=None,
        preset_lora_path=None, preset_lora_model=None,
        use_gradient_checkpointing=True,
        use_gradient_checkpointing_offload=False,
        extra_inputs=None,
        fp8_models=None,
        task="sft",
        max_timestep_boundary=1.0,
        min_timestep_boundary=0.0,
    ):
        super().__init__()
        # Warning
        if not use_gradient_checkpointing:
            warnings.warn("Gradient checkpointing is detected as disabled. To prevent out-of-memory errors, the training framework will forcibly enable gradient checkpointing.")  # noqa: B028, E501
            use_gradient_checkpointing = True

        self.pipe = pipe
        self.pipe = self.split_pipeline_units(task, self.pipe, trainable_models, lora_base_model)

        # Training mode
        self.switch_pipe_to_training_mode(
            self.pipe, trainable_models,
            lora_base_model, lora_target_modules, lora_rank, lora_checkpoint,
            preset_lora_path, preset_lora_model,
            task=task,
        )

        # Store other configs
        self.use_gradient_checkpointing = use_gradient_checkpointing
        self.use_gradient_checkpointing_offload = use_gradient_checkpointing_offload
        self.extra_inputs = extra_inputs.split(",") if extra_inputs is not None else []
        self.fp8_models = fp8_models
        self.task = task
        self.task_to_loss = {
            "sft": lambda pipe, inputs_shared, inputs_posi, inputs_nega: FlowMatchSFTLoss(pipe, **inputs_shared, **inputs_posi),  # noqa: E501
        }
        self.max_timestep_boundary = max_timestep_boundary
        self.min_timestep_boundary = min_timestep_boundary

    # fmt: on


def wan_variant_step(variant: str, tokenizer_dir: Path, seed: int = 0) -> WanTrainingModule:
    """The variant's module as its ``lora/*.sh`` makes it (rank 4 instead of 32)."""
    torch.manual_seed(seed)
    return WanTrainingModule(
        tiny_pipeline(variant, tokenizer_dir),
        lora_base_model=LORA_BASE_MODEL.get(variant, "dit"),
        lora_target_modules="q,k,v,o,ffn.0,ffn.2",
        lora_rank=4,
        extra_inputs=EXTRA_INPUTS[variant],
    )


def variant_sample(variant: str, seed: int) -> dict[str, Any]:
    """One sample as ``UnifiedDataset`` yields it for the variant: PIL frames (a file key's
    image is a list of one frame, ``ToList``), the prompt string."""
    size = SIZE.get(variant, 16)
    data: dict[str, Any] = {"video": frames(seed, size=size), "prompt": PROMPTS[seed % 3]}
    if variant == "fun_control":
        data["control_video"] = frames(100 + seed, size=size)
    if variant == "vace":
        data["vace_video"] = frames(200 + seed, size=size)
        data["vace_reference_image"] = frames(300 + seed, count=1, size=size)
    return data


def assert_two_steps_exact(step: Any, split: Any, data: dict[str, Any], folder: Path) -> None:
    """Cache ``data`` through DiffSynth's loader and disk, then train two AdamW steps (train.py's
    optimizer, on ``trainable_modules()``) from the unsplit step and two from the cache, from
    the same weights: each step's loss and every trainable gradient must be equal bit for bit,
    and the first optimizer step must have moved every LoRA ``B`` (so step 2 is on new weights).
    """
    loader = DataLoader(UnifiedLikeDataset([data]), collate_fn=lambda x: x[0])
    graphsplit.cache(split, loader, folder, progress=False)
    rows = DataLoader(
        graphsplit.CachedDataset(folder, split), batch_size=1, collate_fn=graphsplit.collate
    )
    (batch,) = list(rows)
    named = [(name, p) for name, p in step.named_parameters() if p.requires_grad]
    assert named and all("lora_" in name for name, _ in named)
    start = [p.detach().clone() for _, p in named]

    def train(run: Any) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
        with torch.no_grad():
            for (_, param), value in zip(named, start, strict=True):
                param.copy_(value)
        optimizer = torch.optim.AdamW(step.trainable_modules(), lr=1e-3, weight_decay=1e-2)
        steps = []
        for index in range(2):
            torch.manual_seed(index)
            loss = run()
            loss.backward()
            grads = [p.grad.clone() for _, p in named]
            steps.append((loss.detach(), grads))
            optimizer.step()
            optimizer.zero_grad()
            if index == 0:
                moved = [n for (n, p), s in zip(named, start, strict=True) if not torch.equal(p, s)]
                assert {n for n, _ in named if "lora_B" in n} <= set(moved)
        return steps

    expected = train(lambda: step(data))
    actual = train(lambda: split.stage2(**batch))
    for index, ((want_loss, want), (got_loss, got)) in enumerate(
        zip(expected, actual, strict=True)
    ):
        assert torch.equal(want_loss, got_loss), (index, want_loss, got_loss)
        for (name, _), a, b in zip(named, want, got, strict=True):
            assert torch.equal(a, b), f"step {index}: the gradient of {name} differs"
