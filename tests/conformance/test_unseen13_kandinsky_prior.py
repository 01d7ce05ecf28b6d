"""Conformance: ``examples/kandinsky2_2/text_to_image/train_text_to_image_prior.py``
(huggingface/diffusers) as ``accelerate launch train_text_to_image_prior.py`` runs it.

Kandinsky 2.2's *prior* learns to map a caption to a CLIP image embedding: the frozen
``CLIPTextModelWithProjection`` gives ``text_embeds`` (the projected prompt) and
``last_hidden_state``, the frozen ``CLIPVisionModelWithProjection`` gives the target
``image_embeds``, normalised by ``clip_mean`` / ``clip_std`` -- which the script takes as
``prior.clip_mean.clone()`` *before* ``accelerator.prepare``: a clone of a trainable
``nn.Parameter``, so a tensor that requires grad (a ``CloneBackward0`` node), read by the step
as a closure variable inside ``torch.no_grad()``. The ``PriorTransformer`` is trained in full
(``prediction_type="sample"``: the target is the clean, normalised image embedding), with the
caption's boolean ``text_mask`` as its attention mask and min-SNR weighting (``--snr_gamma``).
Noise, timesteps and ``add_noise`` are drawn under ``torch.no_grad()`` as the script writes it.

The loop body is the script's, verbatim, moved into ``training_step(batch)``; the models are
``main()``'s locals (closure variables); the data is the script's ``preprocess_train``
(``CLIPImageProcessor`` on PIL images, the tokenizer with ``padding="max_length"``,
``attention_mask.bool()``) and its ``collate_fn``.

What must hold: split with the default path; the step verifies exactly (loss and every prior
gradient bit for bit) on the example and on a batch of another size; the text encoder's two
outputs and the normalised image embedding are cached, neither frozen CLIP model is in stage 2
(only ``prior``); and a cache written through the disk trains stage 2 exactly.

Tiny configs: diffusers' own ``test_kandinsky_prior.py`` dummies (CLIP 32 wide, prior 2 heads
of 12, one layer), with 2 CLIP layers, a 28 px image tower and 16 text positions.

It used to fail: stage 2 gave ``prior.clip_mean`` and ``prior.clip_std`` gradients that the
eager step does not (eager: ``None``, as every op on the clones runs under ``no_grad``). The
closure tensors ``clip_mean`` / ``clip_std`` are clones of trainable parameters (they require
grad, ``grad_fn=CloneBackward0``); torch.fx holds them as tensor constants, which the analysis
took for data, so dropping the ``torch.no_grad()`` around ``(image_embeds - clip_mean) /
clip_std`` looked exact. Now a held constant that requires grad reads the parameters its
``grad_fn`` ends at (graphsplit/planning/analyse/constant_grads.py): the trace refuses the
``no_grad`` around trainable-dependent work, and the default path takes the module-level path,
which runs the normalisation as the script wrote it in stage 2 and caches both CLIP towers. The
two minimal reproductions below pin the mechanism (under ``no_grad``, and a product with the
clone whose gradient the cache would lose).
"""

from __future__ import annotations

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
PIL_Image = pytest.importorskip("PIL.Image")

from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from diffusers import DDPMScheduler, PriorTransformer  # noqa: E402
from diffusers.training_utils import compute_snr  # noqa: E402
from transformers import (  # noqa: E402
    CLIPImageProcessorPil,
    CLIPTextConfig,
    CLIPTextModelWithProjection,
    CLIPVisionConfig,
    CLIPVisionModelWithProjection,
)

from tests.conformance.unseen2_data_checks import assert_cache_round_trip  # noqa: E402
from tests.conformance.unseen_checks import (  # noqa: E402
    loss_and_grads,
    stage2_top_modules,
    word_tokenizer,
)
from tests.zoo import CaptionedImages  # noqa: E402

MAX_LENGTH = 16
WIDTH = 32


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


class PriorDataset(Dataset):
    """The script's ``dataset["train"].with_transform(preprocess_train)`` over captioned images."""

    def __init__(self, length: int) -> None:
        self.items = CaptionedImages(length=length, resolution=40)
        captions = [self.items.caption_of(i) for i in range(length)]
        self.tokenizer = word_tokenizer(" ".join(captions).split())
        self.tokenizer.model_max_length = MAX_LENGTH
        # The PIL backend, named: torchvision may be a stand-in (examples/diffsynth).
        self.image_processor = CLIPImageProcessorPil(
            crop_size=28,
            do_center_crop=True,
            do_normalize=True,
            do_resize=True,
            image_mean=[0.48145466, 0.4578275, 0.40821073],
            image_std=[0.26862954, 0.26130258, 0.27577711],
            resample=3,
            size=28,
        )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        image, caption = self.items._generate(index)
        pixels = ((image + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).numpy()
        examples = {"image": [PIL_Image.fromarray(pixels)], "text": [caption]}
        image_processor, tokenizer = self.image_processor, self.tokenizer

        # The script's tokenize_captions / preprocess_train (one example), verbatim in substance.
        inputs = tokenizer(
            examples["text"],
            max_length=tokenizer.model_max_length,
            padding="max_length",
            truncation=True,
            return_tensors="pt",
        )
        text_input_ids = inputs.input_ids
        text_mask = inputs.attention_mask.bool()
        images = [image.convert("RGB") for image in examples["image"]]
        clip_pixel_values = image_processor(images, return_tensors="pt").pixel_values
        return {
            "clip_pixel_values": clip_pixel_values[0],
            "text_input_ids": text_input_ids[0],
            "text_mask": text_mask[0],
        }


def collate_fn(examples):
    """The script's, verbatim."""
    clip_pixel_values = torch.stack([example["clip_pixel_values"] for example in examples])
    clip_pixel_values = clip_pixel_values.to(memory_format=torch.contiguous_format).float()
    text_input_ids = torch.stack([example["text_input_ids"] for example in examples])
    text_mask = torch.stack([example["text_mask"] for example in examples])
    return {
        "clip_pixel_values": clip_pixel_values,
        "text_input_ids": text_input_ids,
        "text_mask": text_mask,
    }


def build(accelerator):
    """``main()``'s models, as the script loads, freezes and prepares them, and its loop body."""
    args = types.SimpleNamespace(snr_gamma=5.0, learning_rate=1e-4)
    # Load scheduler, image_processor, tokenizer and models.
    noise_scheduler = DDPMScheduler(beta_schedule="squaredcos_cap_v2", prediction_type="sample")
    weight_dtype = torch.float32
    torch.manual_seed(0)
    image_encoder = CLIPVisionModelWithProjection(
        CLIPVisionConfig(
            hidden_size=WIDTH,
            image_size=28,
            projection_dim=WIDTH,
            intermediate_size=37,
            num_attention_heads=4,
            num_channels=3,
            num_hidden_layers=2,
            patch_size=14,
        )
    ).eval()
    text_encoder = CLIPTextModelWithProjection(
        CLIPTextConfig(
            bos_token_id=0,
            eos_token_id=2,  # the word tokenizer's </s>
            hidden_size=WIDTH,
            projection_dim=WIDTH,
            intermediate_size=37,
            layer_norm_eps=1e-05,
            num_attention_heads=4,
            num_hidden_layers=2,
            pad_token_id=0,
            vocab_size=64,
            max_position_embeddings=MAX_LENGTH,
        )
    ).eval()
    prior = PriorTransformer(
        num_attention_heads=2, attention_head_dim=12, embedding_dim=WIDTH, num_layers=1,
        num_embeddings=MAX_LENGTH,
    )  # fmt: skip
    with torch.no_grad():  # as from_pretrained loads them: the CLIP image-embedding statistics
        prior.clip_mean.normal_(std=0.1)
        prior.clip_std.uniform_(0.5, 1.5)

    # Freeze text_encoder and image_encoder
    text_encoder.requires_grad_(False)
    image_encoder.requires_grad_(False)

    # Set prior to trainable.
    prior.train()

    optimizer = torch.optim.AdamW(prior.parameters(), lr=args.learning_rate)

    clip_mean = prior.clip_mean.clone()
    clip_std = prior.clip_std.clone()

    prior, optimizer = accelerator.prepare(prior, optimizer)

    image_encoder.to(accelerator.device, dtype=weight_dtype)
    text_encoder.to(accelerator.device, dtype=weight_dtype)

    clip_mean = clip_mean.to(weight_dtype).to(accelerator.device)
    clip_std = clip_std.to(weight_dtype).to(accelerator.device)

    def training_step(batch):
        # Convert images to latent space
        text_input_ids, text_mask, clip_images = (
            batch["text_input_ids"],
            batch["text_mask"],
            batch["clip_pixel_values"].to(weight_dtype),
        )
        with torch.no_grad():
            text_encoder_output = text_encoder(text_input_ids)
            prompt_embeds = text_encoder_output.text_embeds
            text_encoder_hidden_states = text_encoder_output.last_hidden_state

            image_embeds = image_encoder(clip_images).image_embeds
            # Sample noise that we'll add to the image_embeds
            noise = torch.randn_like(image_embeds)
            bsz = image_embeds.shape[0]
            # Sample a random timestep for each image
            timesteps = torch.randint(
                0, noise_scheduler.config.num_train_timesteps, (bsz,), device=image_embeds.device
            )
            timesteps = timesteps.long()
            image_embeds = (image_embeds - clip_mean) / clip_std
            noisy_latents = noise_scheduler.add_noise(image_embeds, noise, timesteps)

            target = image_embeds

        # Predict the noise residual and compute loss
        model_pred = prior(
            noisy_latents,
            timestep=timesteps,
            proj_embedding=prompt_embeds,
            encoder_hidden_states=text_encoder_hidden_states,
            attention_mask=text_mask,
        ).predicted_image_embedding

        if args.snr_gamma is None:
            loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
        else:
            # Compute loss-weights as per Section 3.4 of https://huggingface.co/papers/2303.09556.
            # Since we predict the noise instead of x_0, the original formulation is slightly
            # changed. This is discussed in Section 4.2 of the same paper.
            snr = compute_snr(noise_scheduler, timesteps)
            mse_loss_weights = torch.stack(
                [snr, args.snr_gamma * torch.ones_like(timesteps)], dim=1
            ).min(dim=1)[0]
            if noise_scheduler.config.prediction_type == "epsilon":
                mse_loss_weights = mse_loss_weights / snr
            elif noise_scheduler.config.prediction_type == "v_prediction":
                mse_loss_weights = mse_loss_weights / (snr + 1)

            loss = F.mse_loss(model_pred.float(), target.float(), reduction="none")
            loss = loss.mean(dim=list(range(1, len(loss.shape)))) * mse_loss_weights
            loss = loss.mean()
        return loss

    assert clip_mean.requires_grad and clip_mean.grad_fn is not None  # the script's clone
    return types.SimpleNamespace(step=training_step, prior=prior, clip_mean=clip_mean)


def _batch(size: int, first: int = 0) -> dict:
    data = PriorDataset(first + size)
    return collate_fn([data[i] for i in range(first, first + size)])


@pytest.fixture(scope="module")
def built(accelerator):
    parts = build(accelerator)
    return parts, graphsplit.split(parts.step, (_batch(2),))


def test_splits_and_verifies_exactly(built):
    parts, split = built
    assert split.path == "calls"
    assert "around work that depends on trainable parameters (prior.clip_mean)" in split.reason
    assert_stage1_holds_no_trainable(split)
    for seed, batch in enumerate([_batch(2), _batch(3, first=2)]):
        checks = graphsplit.verify(parts.step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


def test_both_clip_towers_are_cached(built):
    parts, split = built
    assert stage2_top_modules(split) == {"prior"}
    assert split.stage2.prior is parts.prior
    held = [name for name, _ in split.stage2.named_parameters()]
    assert held and all(name.startswith("prior.") for name in held), held
    boundary = split.stage1(**_batch(2))
    per_sample = {
        key: tuple(value.shape[1:])
        for key, value in boundary.items()
        if split.boundary[key].batch_dim is not None
    }
    # Both CLIP towers' outputs and the mask the prior reads: nothing of either tower to run
    # (the rest of the boundary is the scheduler's tables, stored once).
    assert per_sample == {
        "clip_pixel_values__shape": (4,),  # the unstored inputs' shapes
        "text_input_ids__shape": (2,),
        "text_mask": (MAX_LENGTH,),
        "text_encoder__0__text_embeds": (WIDTH,),
        "text_encoder__0__last_hidden_state": (MAX_LENGTH, WIDTH),
        "image_encoder__0__image_embeds": (WIDTH,),
    }


def test_cache_round_trip(built, tmp_path):
    parts, split = built
    loader = DataLoader(PriorDataset(5), batch_size=2, collate_fn=collate_fn)
    # clip_mean / clip_std are in the script's optimizer but get no gradient (eager: None).
    stats = {"clip_mean", "clip_std"}
    named = [(n, p) for n, p in parts.prior.named_parameters() if p.requires_grad]
    params = [param for name, param in named if name not in stats]
    cached = assert_cache_round_trip(split, parts.step, loader, tmp_path / "cache", params)
    for param in parts.prior.parameters():
        param.grad = None
    split.stage2(**graphsplit.collate([cached[0], cached[1]])).backward()
    assert all(param.grad is None for name, param in named if name in stats)


def _clone_of_trainable():
    torch.manual_seed(0)
    frozen = torch.nn.Linear(4, 4).requires_grad_(False)
    trained = torch.nn.Linear(4, 4)
    snapshot = trained.bias.clone()  # as clip_mean = prior.clip_mean.clone()
    return frozen, trained, snapshot, torch.randn(3, 4)


def test_minimal_reproduction_under_no_grad():
    frozen, trained, snapshot, x = _clone_of_trainable()

    def step(x):
        with torch.no_grad():
            target = frozen(x) - snapshot
        return F.mse_loss(trained(x), target)

    split = graphsplit.split(step, (x,))  # it verified with grad trained.bias MISMATCH
    checks = graphsplit.verify(step, split, (x,))
    assert checks and all(check.ok for check in checks)
    with pytest.raises(
        graphsplit.TraceError, match=r"depends on trainable parameters \(trained.bias\)"
    ):
        graphsplit.split(step, (x,), path="trace")


def test_minimal_reproduction_with_grad_lost_through_the_cache():
    frozen, trained, snapshot, x = _clone_of_trainable()

    def step(x):
        target = frozen(x) * snapshot
        return F.mse_loss(trained(x), target)

    split = graphsplit.split(step, (x,))
    boundary = {key: value.detach() for key, value in split.stage1(x).items()}  # as cached
    params = list(trained.parameters())
    want = loss_and_grads(lambda: step(x), params, 0)
    got = loss_and_grads(lambda: split.stage2(**boundary), params, 0)
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True))
