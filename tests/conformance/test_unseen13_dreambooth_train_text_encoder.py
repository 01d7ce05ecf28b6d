"""Conformance: ``examples/dreambooth/train_dreambooth.py`` (huggingface/diffusers), full
fine-tuning, as ``accelerate launch train_dreambooth.py --train_text_encoder
--with_prior_preservation --offset_noise`` runs it, with and without ``--gradient_checkpointing``.

Unlike the LoRA script (``test_unseen_diffusers_dreambooth.py``), this one trains the UNet *and*
the CLIP text encoder in full: ``text_encoder.requires_grad_(False)`` is skipped, both are
passed to ``accelerator.prepare`` and put in ``train()`` at each epoch, and with
``--gradient_checkpointing`` both checkpoint (``unet.enable_gradient_checkpointing()``,
``text_encoder.gradient_checkpointing_enable()``, transformers' own). Only the VAE is frozen.
The script's ``DreamBoothDataset`` gives each example the instance image and prompt and a class
image and prompt (``tokenize_prompt``: ``padding="max_length"``, ids of shape ``(1, L)``), its
``collate_fn(examples, with_prior_preservation=True)`` concatenates them into one batch of
``2 * N`` rows; the loop body draws offset noise (``torch.randn_like`` plus ``0.1 *
torch.randn(bsz, C, 1, 1)``), encodes the prompts with the script's ``encode_prompt`` (no
``--text_encoder_use_attention_mask``), chunks prediction and target in two halves and adds
``prior_loss_weight`` times the class loss.

The loop body and ``encode_prompt`` / ``tokenize_prompt`` / ``collate_fn`` are the script's,
verbatim, moved into ``training_step(batch)``; the models are ``main()``'s locals.

What must hold: split with the default path; the step verifies exactly (loss and every UNet and
text-encoder gradient bit for bit) on the example and on a batch of another size; the VAE's
latent distribution is cached and the VAE is not in stage 2, the text encoder (trained) is, and
the token ids reach it; a cache written through the disk trains stage 2 exactly (a batch of two
examples is four rows: the batches are passed to ``graphsplit.cache`` as an iterable, the fix
graphsplit names for a DataLoader whose batches hold more rows than its sampler's indices).

Tiny configs: the zoo's ``tiny`` SD components (UNet (32, 64), CLIP 32 wide, VAE (32, 64)),
32 px, a real ``PreTrainedTokenizerFast`` over the prompts' words.
"""

from __future__ import annotations

import itertools
import types

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import graphsplit
from tests.helpers import assert_stage1_holds_no_trainable

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402

from tests.conformance.unseen_checks import (  # noqa: E402
    assert_cache_round_trip,
    stage2_top_modules,
    word_tokenizer,
)
from tests.zoo import CaptionedImages  # noqa: E402
from tests.zoo.sd import build_frozen_sd  # noqa: E402

INSTANCE_PROMPT = "a photo of sks dog"
CLASS_PROMPT = "a photo of dog"
MAX_LENGTH = 16


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def accelerator():
    """``accelerate launch`` (no mixed precision) on the CPU, one process."""
    AcceleratorState._reset_state(True)
    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(True)


def tokenize_prompt(tokenizer, prompt, tokenizer_max_length=None):
    """The script's, verbatim."""
    if tokenizer_max_length is not None:
        max_length = tokenizer_max_length
    else:
        max_length = tokenizer.model_max_length

    text_inputs = tokenizer(
        prompt,
        truncation=True,
        padding="max_length",
        max_length=max_length,
        return_tensors="pt",
    )

    return text_inputs


def encode_prompt(text_encoder, input_ids, attention_mask, text_encoder_use_attention_mask=None):
    """The script's, verbatim."""
    text_input_ids = input_ids.to(text_encoder.device)

    if text_encoder_use_attention_mask:
        attention_mask = attention_mask.to(text_encoder.device)
    else:
        attention_mask = None

    prompt_embeds = text_encoder(
        text_input_ids,
        attention_mask=attention_mask,
        return_dict=False,
    )
    prompt_embeds = prompt_embeds[0]

    return prompt_embeds


class DreamBoothDataset(Dataset):
    """The script's ``DreamBoothDataset.__getitem__`` over generated instance / class images
    (already ``Resize`` / ``CenterCrop`` / ``ToTensor`` / ``Normalize([0.5], [0.5])``d)."""

    def __init__(self, length: int) -> None:
        self.instances = CaptionedImages(length=length, seed=1)
        self.classes = CaptionedImages(length=length, seed=2)
        self.tokenizer = word_tokenizer(f"{INSTANCE_PROMPT} {CLASS_PROMPT}".split())
        self.tokenizer.model_max_length = MAX_LENGTH
        self.instance_prompt, self.class_prompt = INSTANCE_PROMPT, CLASS_PROMPT
        self.tokenizer_max_length = None

    def __len__(self) -> int:
        return len(self.instances)

    def __getitem__(self, index):
        example = {}
        example["instance_images"] = self.instances[index]["pixel_values"]
        text_inputs = tokenize_prompt(
            self.tokenizer, self.instance_prompt, tokenizer_max_length=self.tokenizer_max_length
        )
        example["instance_prompt_ids"] = text_inputs.input_ids
        example["instance_attention_mask"] = text_inputs.attention_mask

        example["class_images"] = self.classes[index]["pixel_values"]
        class_text_inputs = tokenize_prompt(
            self.tokenizer, self.class_prompt, tokenizer_max_length=self.tokenizer_max_length
        )
        example["class_prompt_ids"] = class_text_inputs.input_ids
        example["class_attention_mask"] = class_text_inputs.attention_mask
        return example


def collate_fn(examples, with_prior_preservation=False):
    """The script's, verbatim."""
    has_attention_mask = "instance_attention_mask" in examples[0]

    input_ids = [example["instance_prompt_ids"] for example in examples]
    pixel_values = [example["instance_images"] for example in examples]

    if has_attention_mask:
        attention_mask = [example["instance_attention_mask"] for example in examples]

    # Concat class and instance examples for prior preservation.
    # We do this to avoid doing two forward passes.
    if with_prior_preservation:
        input_ids += [example["class_prompt_ids"] for example in examples]
        pixel_values += [example["class_images"] for example in examples]

        if has_attention_mask:
            attention_mask += [example["class_attention_mask"] for example in examples]

    pixel_values = torch.stack(pixel_values)
    pixel_values = pixel_values.to(memory_format=torch.contiguous_format).float()

    input_ids = torch.cat(input_ids, dim=0)

    batch = {
        "input_ids": input_ids,
        "pixel_values": pixel_values,
    }

    if has_attention_mask:
        attention_mask = torch.cat(attention_mask, dim=0)
        batch["attention_mask"] = attention_mask

    return batch


def build(accelerator, *, gradient_checkpointing: bool = False):
    """``main()``'s models, frozen, checkpointed and prepared as the script does; its loop body."""
    args = types.SimpleNamespace(
        train_text_encoder=True,
        with_prior_preservation=True,
        prior_loss_weight=1.0,
        offset_noise=True,
        gradient_checkpointing=gradient_checkpointing,
        pre_compute_text_embeddings=False,
        text_encoder_use_attention_mask=False,
        class_labels_conditioning=None,
        snr_gamma=None,
        learning_rate=5e-6,
    )
    vae, text_encoder, unet, noise_scheduler = build_frozen_sd()
    unet.requires_grad_(True)  # as from_pretrained returns them
    text_encoder.requires_grad_(True)

    def unwrap_model(model):
        model = accelerator.unwrap_model(model)
        return model

    if vae is not None:
        vae.requires_grad_(False)

    if not args.train_text_encoder:
        text_encoder.requires_grad_(False)

    if args.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
        if args.train_text_encoder:
            text_encoder.gradient_checkpointing_enable()

    params_to_optimize = (
        itertools.chain(unet.parameters(), text_encoder.parameters())
        if args.train_text_encoder
        else unet.parameters()
    )
    optimizer = torch.optim.AdamW(params_to_optimize, lr=args.learning_rate)

    # Prepare everything with our `accelerator`.
    if args.train_text_encoder:
        unet, text_encoder, optimizer = accelerator.prepare(unet, text_encoder, optimizer)
    else:
        unet, optimizer = accelerator.prepare(unet, optimizer)

    weight_dtype = torch.float32
    # Move vae and text_encoder to device and cast to weight_dtype
    if vae is not None:
        vae.to(accelerator.device, dtype=weight_dtype)

    unet.train()
    if args.train_text_encoder:
        text_encoder.train()

    def training_step(batch):
        pixel_values = batch["pixel_values"].to(dtype=weight_dtype)

        if vae is not None:
            # Convert images to latent space
            model_input = vae.encode(
                batch["pixel_values"].to(dtype=weight_dtype)
            ).latent_dist.sample()
            model_input = model_input * vae.config.scaling_factor
        else:
            model_input = pixel_values

        # Sample noise that we'll add to the model input
        if args.offset_noise:
            noise = torch.randn_like(model_input) + 0.1 * torch.randn(
                model_input.shape[0], model_input.shape[1], 1, 1, device=model_input.device
            )
        else:
            noise = torch.randn_like(model_input)
        bsz, channels, height, width = model_input.shape  # noqa: RUF059 (the script's)
        # Sample a random timestep for each image
        timesteps = torch.randint(
            0, noise_scheduler.config.num_train_timesteps, (bsz,), device=model_input.device
        )
        timesteps = timesteps.long()

        # Add noise to the model input according to the noise magnitude at each timestep
        # (this is the forward diffusion process)
        noisy_model_input = noise_scheduler.add_noise(model_input, noise, timesteps)

        # Get the text embedding for conditioning
        if args.pre_compute_text_embeddings:
            encoder_hidden_states = batch["input_ids"]
        else:
            encoder_hidden_states = encode_prompt(
                text_encoder,
                batch["input_ids"],
                batch["attention_mask"],
                text_encoder_use_attention_mask=args.text_encoder_use_attention_mask,
            )

        if unwrap_model(unet).config.in_channels == channels * 2:
            noisy_model_input = torch.cat([noisy_model_input, noisy_model_input], dim=1)

        if args.class_labels_conditioning == "timesteps":  # noqa: SIM108 (the script's)
            class_labels = timesteps
        else:
            class_labels = None

        # Predict the noise residual
        model_pred = unet(
            noisy_model_input,
            timesteps,
            encoder_hidden_states,
            class_labels=class_labels,
            return_dict=False,
        )[0]

        if model_pred.shape[1] == 6:
            model_pred, _ = torch.chunk(model_pred, 2, dim=1)

        # Get the target for loss depending on the prediction type
        if noise_scheduler.config.prediction_type == "epsilon":
            target = noise
        elif noise_scheduler.config.prediction_type == "v_prediction":
            target = noise_scheduler.get_velocity(model_input, noise, timesteps)
        else:
            raise ValueError(f"Unknown prediction type {noise_scheduler.config.prediction_type}")

        if args.with_prior_preservation:
            # Chunk the noise and model_pred into two parts and compute the loss on each part
            # separately.
            model_pred, model_pred_prior = torch.chunk(model_pred, 2, dim=0)
            target, target_prior = torch.chunk(target, 2, dim=0)
            # Compute prior loss
            prior_loss = F.mse_loss(
                model_pred_prior.float(), target_prior.float(), reduction="mean"
            )

        # Compute instance loss
        if args.snr_gamma is None:
            loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
        else:
            raise AssertionError("--snr_gamma: not a configuration tested here")

        if args.with_prior_preservation:
            # Add the prior loss to the instance loss.
            loss = loss + args.prior_loss_weight * prior_loss
        return loss

    trained = torch.nn.ModuleDict({"unet": unet, "text_encoder": text_encoder})
    return types.SimpleNamespace(step=training_step, trained=trained)


def _batch(size: int, first: int = 0) -> dict:
    data = DreamBoothDataset(first + size)
    return collate_fn([data[i] for i in range(first, first + size)], with_prior_preservation=True)


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "gradient_checkpointing"])
def built(request, accelerator):
    parts = build(accelerator, gradient_checkpointing=request.param)
    checkpointed = [
        name
        for name, module in parts.trained["text_encoder"].named_modules()
        if getattr(module, "gradient_checkpointing", False)
    ]
    assert bool(checkpointed) is request.param
    assert parts.trained["unet"].is_gradient_checkpointing is request.param
    return parts, graphsplit.split(parts.step, (_batch(2),))


def test_splits_and_verifies_exactly(built):
    parts, split = built
    assert split.path == "trace"
    assert_stage1_holds_no_trainable(split)
    for seed, (size, batch) in enumerate([(2, _batch(2)), (3, _batch(3, first=2))]):
        assert batch["pixel_values"].shape[0] == batch["input_ids"].shape[0] == 2 * size
        checks = graphsplit.verify(parts.step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]
        assert any(c.name.startswith("grad text_encoder.") and c.ok for c in checks)


def test_vae_cached_text_encoder_trained_in_stage2(built):
    parts, split = built
    assert stage2_top_modules(split) == {"unet", "text_encoder"}
    assert split.stage2.text_encoder is parts.trained["text_encoder"]
    batch = _batch(2)
    boundary = split.stage1(**batch)
    per_sample = {
        key: value for key, value in boundary.items() if split.boundary[key].batch_dim is not None
    }
    # Four rows (two instance, two class): the VAE's distribution and the ids the trained text
    # encoder reads (encode_prompt's input_ids.to(text_encoder.device)); the unused attention
    # masks are not stored.
    latents = per_sample.pop("vae_encode_latent_dist_parameters")
    assert (tuple(latents.shape), latents.dtype) == ((4, 8, 16, 16), torch.float32)
    [ids] = per_sample.values()
    assert torch.equal(ids, batch["input_ids"])


def test_cache_round_trip(built, tmp_path):
    parts, split = built
    loader = DataLoader(
        DreamBoothDataset(4), batch_size=2, collate_fn=lambda items: collate_fn(items, True)
    )
    assert_cache_round_trip(
        split, parts.step, loader, tmp_path, parts.trained, rows_per_batch=4, as_iterable=True
    )
