"""DiffSynth-Studio's training modules as train.py writes them, on DiffSynth's real data format.

``examples/diffsynth/steps.py`` hands DiffSynth's units tensors (the dataset preprocesses PIL and
tokenizes). Here nothing is converted: the batch is what DiffSynth's ``UnifiedDataset`` yields
and its loader (``collate_fn=lambda x: x[0]``) hands over, ``{"video": [PIL.Image, ...],
"prompt": "a cat"}``, and ``forward(data)`` is train.py's own: DiffSynth's units preprocess the
PIL frames (``pipe.preprocess_video``) and tokenize the string with the pipeline's tokenizer.

Copied from DiffSynth-Studio (Apache-2.0, (c) ModelScope; https://github.com/modelscope/
DiffSynth-Studio, commit fed7b18f), ``examples/wanvideo/model_training/train.py``:
``WanTrainingModule.parse_extra_inputs``, ``get_pipeline_inputs`` and ``forward``, verbatim.
Only the constructor differs: ``WanVideoPipeline.from_pretrained`` downloads, so the models are
DiffSynth's classes with tiny configs and random weights (as ``steps.py`` builds them), and the
tokenizer is DiffSynth's ``HuggingfaceTokenizer`` (what ``from_pretrained`` sets) loading a tiny
word-level tokenizer written to a local folder (no hub), with ``seq_len`` 16 instead of 512.

    wan_real_step(tokenizer_dir) -> WanTrainingModule
    wan_sample(seed) -> {"video": [PIL.Image] * 5, "prompt": str}
    write_tiny_tokenizer(folder, vocab_size) -> folder
    UnifiedLikeDataset(samples): a map-style dataset of such dicts
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from examples.diffsynth.steps import DIFFSYNTH, DiffusionTrainingModule, tiny_wan_pipeline

if DIFFSYNTH:
    from diffsynth.diffusion import FlowMatchSFTLoss

WORDS = ["a", "an", "the", "cat", "dog", "bird", "runs", "sits", "flies", "on", "in", "under"]
WORDS += ["red", "blue", "green", "tree", "house", "sky"]


def write_tiny_tokenizer(folder: Path, vocab_size: int = 64) -> Path:
    """A word-level ``PreTrainedTokenizerFast`` saved to ``folder``, loadable by AutoTokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "</s>": 2}
    for word in WORDS:
        vocab.setdefault(word, len(vocab))
    assert len(vocab) <= vocab_size
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", eos_token="</s>"
    )
    tokenizer.save_pretrained(str(folder))
    return folder


def frames(seed: int, count: int = 5, size: int = 32) -> list[Any]:
    """``count`` RGB PIL frames of random pixels, as ``LoadVideo`` yields them."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8), mode="RGB")
        for _ in range(count)
    ]


PROMPTS = [
    "a cat sits on the red house",
    "the dog runs",
    "a blue bird flies in the sky under a tree",
]


def wan_sample(seed: int) -> dict[str, Any]:
    """One sample as ``UnifiedDataset`` yields it for Wan: PIL frames and the prompt string."""
    return {"video": frames(seed), "prompt": PROMPTS[seed % len(PROMPTS)]}


class UnifiedLikeDataset(torch.utils.data.Dataset):
    """Map-style, one dict per index, as ``UnifiedDataset.__getitem__`` returns."""

    def __init__(self, samples: list[dict[str, Any]]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.samples[index]


class TrainPyWanSteps:
    """``parse_extra_inputs``, ``get_pipeline_inputs`` and ``forward`` of train.py's
    ``WanTrainingModule``, verbatim, for every tiny module built like it here and in the tests
    (each sets ``pipe``, ``extra_inputs``, ``task_to_loss`` and the other configs itself)."""

    # -- verbatim from examples/wanvideo/model_training/train.py --------------------------------
    # fmt: off
    def parse_extra_inputs(self, data, extra_inputs, inputs_shared):
        for extra_input in extra_inputs:
            if extra_input == "input_image":
                inputs_shared["input_image"] = data["video"][0]
            elif extra_input == "end_image":
                inputs_shared["end_image"] = data["video"][-1]
            elif extra_input in ("reference_image", "vace_reference_image", "animate2_reference_image"):  # noqa: E501
                inputs_shared[extra_input] = data[extra_input][0]
            else:
                inputs_shared[extra_input] = data[extra_input]
        if inputs_shared.get("framewise_decoding", False):
            # WanToDance global model
            inputs_shared["num_frames"] = 4 * (len(data["video"]) - 1) + 1
        return inputs_shared

    def get_pipeline_inputs(self, data):
        inputs_posi = {"prompt": data["prompt"]}
        inputs_nega = {}
        inputs_shared = {
            # Assume you are using this pipeline for inference,
            # please fill in the input parameters.
            "input_video": data["video"],
            "height": data["video"][0].size[1],
            "width": data["video"][0].size[0],
            "num_frames": len(data["video"]),
            # Please do not modify the following parameters
            # unless you clearly know what this will cause.
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
        inputs_shared = self.parse_extra_inputs(data, self.extra_inputs, inputs_shared)
        return inputs_shared, inputs_posi, inputs_nega

    def forward(self, data, inputs=None):
        if inputs is None: inputs = self.get_pipeline_inputs(data)  # noqa: E701
        inputs = self.transfer_data_to_device(inputs, self.pipe.device, self.pipe.torch_dtype)
        for unit in self.pipe.units:
            inputs = self.pipe.unit_runner(unit, self.pipe, *inputs)
        loss = self.task_to_loss[self.task](self.pipe, *inputs)
        return loss
    # fmt: on


class WanTrainingModule(TrainPyWanSteps, DiffusionTrainingModule):
    """train.py's ``WanTrainingModule`` for ``--task sft`` with a LoRA on ``dit``, tiny."""

    def __init__(self, tokenizer_dir: Path) -> None:
        super().__init__()
        from diffsynth.models.wan_video_text_encoder import HuggingfaceTokenizer

        pipe = tiny_wan_pipeline()
        # What from_pretrained sets (seq_len 512 there), on a local tokenizer folder.
        pipe.tokenizer = HuggingfaceTokenizer(
            name=str(tokenizer_dir), seq_len=16, clean="whitespace"
        )
        # switch_pipe_to_training_mode for a LoRA on dit (DiffSynth's own calls).
        pipe.scheduler.set_timesteps(1000, training=True)
        pipe.freeze_except([])
        pipe.dit = self.add_lora_to_model(
            pipe.dit, target_modules=["q", "k", "v", "o", "ffn.0", "ffn.2"], lora_rank=4
        )
        self.pipe = pipe
        # "Store other configs", as train.py; no checkpointing (a CPU float32 check).
        self.use_gradient_checkpointing = False
        self.use_gradient_checkpointing_offload = False
        self.extra_inputs = []
        self.task = "sft"
        self.task_to_loss = {
            "sft": lambda pipe, inputs_shared, inputs_posi, inputs_nega: FlowMatchSFTLoss(
                pipe, **inputs_shared, **inputs_posi
            ),
        }
        self.max_timestep_boundary = 1.0
        self.min_timestep_boundary = 0.0


def wan_real_step(tokenizer_dir: Path, seed: int = 0) -> WanTrainingModule:
    """The tiny Wan T2V LoRA module, random weights drawn under ``seed``."""
    torch.manual_seed(seed)
    return WanTrainingModule(tokenizer_dir)
