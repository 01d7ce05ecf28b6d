"""Conformance: Stable Video Diffusion fine-tuning, SVD_Xtend's ``train_svd.py`` loop body.

The community script (pixeli99/SVD_Xtend): a frozen VAE (``tensor_to_vae_latent`` folds the
frames into the batch with ``einops.rearrange``), a frozen ``CLIPVisionModelWithProjection``
fed the first frame through the script's ``encode_image`` (``_resize_with_antialiasing`` to
224 px, then ``CLIPImageProcessor`` with ``return_tensors="pt"``), and the trained
``UNetSpatioTemporalConditionModel``. The loop body is copied from the script: EDM sigmas from
``rand_log_normal``, the noise-augmented conditioning frame encoded again by the VAE,
``timesteps = torch.Tensor([0.25 * sigma.log() for sigma in sigmas])``, ``added_time_ids`` from
fps 7, motion bucket 127 and ``noise_aug_strength = cond_sigmas[0]`` (``_get_add_time_ids``),
the conditioning dropout drawn from the script's own ``generator``, the EDM preconditioning
and weighting. Changes: ``unet.module`` (the DDP wrapper of a multi-process run) reads
``unet``, ``accelerator.device`` is the CPU, and an ``AutoencoderKL`` stands for the temporal
decoder VAE (only its encoder runs in training).

What must hold: the step splits exactly (loss and every UNet gradient bit for bit, on the
example and on a batch of another size), the image encoder's embedding is cached, the VAE's
latent distribution of the clip's frames (computed from the data alone) is cached, and a cache
written through the disk trains stage 2 exactly.

Tiny configs: VAE (8, 16) channels, 2 frames of 16 px (8 x 8 latents of 4 channels); CLIP
vision 32 wide, 2 layers, 224 px in 32 px patches; UNet (32, 64) channels, 8 input channels.
"""

from __future__ import annotations

import types

import pytest
import torch

import graphsplit
from tests.helpers import assert_stage1_holds_no_trainable

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
einops = pytest.importorskip("einops")

from einops import rearrange  # noqa: E402

from tests.conformance.unseen2_data_checks import assert_same_step  # noqa: E402

FRAMES = 2
SIZE = 16
EMBED = 32


# The script's module-level helpers, verbatim (comments shortened).
def rand_log_normal(shape, loc=0.0, scale=1.0, device="cpu", dtype=torch.float32):
    """Draws samples from an lognormal distribution."""
    u = torch.rand(shape, dtype=dtype, device=device) * (1 - 2e-7) + 1e-7
    return torch.distributions.Normal(loc, scale).icdf(u).exp()


def _resize_with_antialiasing(input, size, interpolation="bicubic", align_corners=True):
    h, w = input.shape[-2:]
    factors = (h / size[0], w / size[1])

    # First, we have to determine sigma
    sigmas = (
        max((factors[0] - 1.0) / 2.0, 0.001),
        max((factors[1] - 1.0) / 2.0, 0.001),
    )

    # Now kernel size. Good results are for 3 sigma, but that is kind of slow.
    ks = int(max(2.0 * 2 * sigmas[0], 3)), int(max(2.0 * 2 * sigmas[1], 3))

    # Make sure it is odd
    if (ks[0] % 2) == 0:
        ks = ks[0] + 1, ks[1]

    if (ks[1] % 2) == 0:
        ks = ks[0], ks[1] + 1

    input = _gaussian_blur2d(input, ks, sigmas)

    output = torch.nn.functional.interpolate(
        input, size=size, mode=interpolation, align_corners=align_corners
    )
    return output


def _compute_padding(kernel_size):
    """Compute padding tuple."""
    if len(kernel_size) < 2:
        raise AssertionError(kernel_size)
    computed = [k - 1 for k in kernel_size]

    # for even kernels we need to do asymmetric padding :(
    out_padding = 2 * len(kernel_size) * [0]

    for i in range(len(kernel_size)):
        computed_tmp = computed[-(i + 1)]

        pad_front = computed_tmp // 2
        pad_rear = computed_tmp - pad_front

        out_padding[2 * i + 0] = pad_front
        out_padding[2 * i + 1] = pad_rear

    return out_padding


def _filter2d(input, kernel):
    # prepare kernel
    b, c, h, w = input.shape
    tmp_kernel = kernel[:, None, ...].to(device=input.device, dtype=input.dtype)

    tmp_kernel = tmp_kernel.expand(-1, c, -1, -1)

    height, width = tmp_kernel.shape[-2:]

    padding_shape: list[int] = _compute_padding([height, width])
    input = torch.nn.functional.pad(input, padding_shape, mode="reflect")

    # kernel and input tensor reshape to align element-wise or batch-wise params
    tmp_kernel = tmp_kernel.reshape(-1, 1, height, width)
    input = input.view(-1, tmp_kernel.size(0), input.size(-2), input.size(-1))

    # convolve the tensor with the kernel.
    output = torch.nn.functional.conv2d(
        input, tmp_kernel, groups=tmp_kernel.size(0), padding=0, stride=1
    )

    out = output.view(b, c, h, w)
    return out


def _gaussian(window_size: int, sigma):
    if isinstance(sigma, float):
        sigma = torch.tensor([[sigma]])

    batch_size = sigma.shape[0]

    x = (
        torch.arange(window_size, device=sigma.device, dtype=sigma.dtype) - window_size // 2
    ).expand(batch_size, -1)

    if window_size % 2 == 0:
        x = x + 0.5

    gauss = torch.exp(-x.pow(2.0) / (2 * sigma.pow(2.0)))

    return gauss / gauss.sum(-1, keepdim=True)


def _gaussian_blur2d(input, kernel_size, sigma):
    if isinstance(sigma, tuple):
        sigma = torch.tensor([sigma], dtype=input.dtype)
    else:
        sigma = sigma.to(dtype=input.dtype)

    ky, kx = int(kernel_size[0]), int(kernel_size[1])
    bs = sigma.shape[0]
    kernel_x = _gaussian(kx, sigma[:, 1].view(bs, 1))
    kernel_y = _gaussian(ky, sigma[:, 0].view(bs, 1))
    out_x = _filter2d(input, kernel_x[..., None, :])
    out = _filter2d(out_x, kernel_y[..., None])

    return out


def tensor_to_vae_latent(t, vae):
    video_length = t.shape[1]

    t = rearrange(t, "b f c h w -> (b f) c h w")
    latents = vae.encode(t).latent_dist.sample()
    latents = rearrange(latents, "(b f) c h w -> b f c h w", f=video_length)
    latents = latents * vae.config.scaling_factor

    return latents


def _models():
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=SIZE,
    )
    image_encoder = transformers.CLIPVisionModelWithProjection(
        transformers.CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=224,
            patch_size=32,
            projection_dim=EMBED,
        )
    )
    # What ``CLIPImageProcessor()`` is without torchvision, which cannot load beside this
    # torch build: its PIL / NumPy backend. Named, because the DiffSynth tests' torchvision
    # stand-in (examples/diffsynth/diffsynth_import.py) would make transformers pick the
    # torchvision backend later in the same process.
    feature_extractor = transformers.CLIPImageProcessorPil()
    unet = diffusers.UNetSpatioTemporalConditionModel(
        sample_size=SIZE // 2,
        in_channels=8,
        out_channels=4,
        down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
        up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"),
        block_out_channels=(32, 64),
        addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=24,
        layers_per_block=1,
        cross_attention_dim=EMBED,
        num_attention_heads=(2, 4),
        num_frames=FRAMES,
    )
    return vae, image_encoder, feature_extractor, unet


def build():
    vae, image_encoder, feature_extractor, unet = _models()
    vae.requires_grad_(False)
    image_encoder.requires_grad_(False)
    unet.requires_grad_(True)
    unet.train()
    weight_dtype = torch.float32
    args = types.SimpleNamespace(conditioning_dropout_prob=0.1, seed=42)
    accelerator = types.SimpleNamespace(device=torch.device("cpu"))
    generator = torch.Generator(device=accelerator.device).manual_seed(args.seed)

    def encode_image(pixel_values):
        # pixel: [-1, 1]
        pixel_values = _resize_with_antialiasing(pixel_values, (224, 224))
        # We unnormalize it after resizing.
        pixel_values = (pixel_values + 1.0) / 2.0

        # Normalize the image with for CLIP input
        pixel_values = feature_extractor(
            images=pixel_values,
            do_normalize=True,
            do_center_crop=False,
            do_resize=False,
            do_rescale=False,
            return_tensors="pt",
        ).pixel_values

        pixel_values = pixel_values.to(device=accelerator.device, dtype=weight_dtype)
        image_embeddings = image_encoder(pixel_values).image_embeds
        return image_embeddings

    def _get_add_time_ids(
        fps,
        motion_bucket_id,
        noise_aug_strength,
        dtype,
        batch_size,
    ):
        add_time_ids = [fps, motion_bucket_id, noise_aug_strength]

        passed_add_embed_dim = unet.config.addition_time_embed_dim * len(add_time_ids)
        expected_add_embed_dim = unet.add_embedding.linear_1.in_features

        if expected_add_embed_dim != passed_add_embed_dim:
            raise ValueError(
                f"Model expects an added time embedding vector of length "
                f"{expected_add_embed_dim}, but a vector of {passed_add_embed_dim} was created."
            )

        add_time_ids = torch.tensor([add_time_ids], dtype=dtype)
        add_time_ids = add_time_ids.repeat(batch_size, 1)
        return add_time_ids

    def training_step(batch):
        # first, convert images to latent space.
        pixel_values = (
            batch["pixel_values"].to(weight_dtype).to(accelerator.device, non_blocking=True)
        )
        conditional_pixel_values = pixel_values[:, 0:1, :, :, :]

        latents = tensor_to_vae_latent(pixel_values, vae)

        # Sample noise that we'll add to the latents
        noise = torch.randn_like(latents)
        bsz = latents.shape[0]

        cond_sigmas = rand_log_normal(
            shape=[
                bsz,
            ],
            loc=-3.0,
            scale=0.5,
        ).to(latents)
        noise_aug_strength = cond_sigmas[0]  # TODO: support batch > 1
        cond_sigmas = cond_sigmas[:, None, None, None, None]
        conditional_pixel_values = (
            torch.randn_like(conditional_pixel_values) * cond_sigmas + conditional_pixel_values
        )
        conditional_latents = tensor_to_vae_latent(conditional_pixel_values, vae)[:, 0, :, :, :]
        conditional_latents = conditional_latents / vae.config.scaling_factor

        # Sample a random timestep for each image
        # P_mean=0.7 P_std=1.6
        sigmas = rand_log_normal(
            shape=[
                bsz,
            ],
            loc=0.7,
            scale=1.6,
        ).to(latents.device)
        # Add noise to the latents according to the noise magnitude at each timestep
        # (this is the forward diffusion process)
        sigmas = sigmas[:, None, None, None, None]
        noisy_latents = latents + noise * sigmas
        timesteps = torch.Tensor([0.25 * sigma.log() for sigma in sigmas]).to(accelerator.device)

        inp_noisy_latents = noisy_latents / ((sigmas**2 + 1) ** 0.5)

        # Get the text embedding for conditioning.
        encoder_hidden_states = encode_image(pixel_values[:, 0, :, :, :].float())

        added_time_ids = _get_add_time_ids(
            7,  # fixed
            127,  # motion_bucket_id = 127, fixed
            noise_aug_strength,  # noise_aug_strength == cond_sigmas
            encoder_hidden_states.dtype,
            bsz,
        )
        added_time_ids = added_time_ids.to(latents.device)

        # Conditioning dropout to support classifier-free guidance during inference.
        if args.conditioning_dropout_prob is not None:
            random_p = torch.rand(bsz, device=latents.device, generator=generator)
            # Sample masks for the edit prompts.
            prompt_mask = random_p < 2 * args.conditioning_dropout_prob
            prompt_mask = prompt_mask.reshape(bsz, 1, 1)
            # Final text conditioning.
            null_conditioning = torch.zeros_like(encoder_hidden_states)
            encoder_hidden_states = torch.where(
                prompt_mask, null_conditioning.unsqueeze(1), encoder_hidden_states.unsqueeze(1)
            )
            # Sample masks for the original images.
            image_mask_dtype = conditional_latents.dtype
            image_mask = 1 - (
                (random_p >= args.conditioning_dropout_prob).to(image_mask_dtype)
                * (random_p < 3 * args.conditioning_dropout_prob).to(image_mask_dtype)
            )
            image_mask = image_mask.reshape(bsz, 1, 1, 1)
            # Final image conditioning.
            conditional_latents = image_mask * conditional_latents

        # Concatenate the `conditional_latents` with the `noisy_latents`.
        conditional_latents = conditional_latents.unsqueeze(1).repeat(
            1, noisy_latents.shape[1], 1, 1, 1
        )
        inp_noisy_latents = torch.cat([inp_noisy_latents, conditional_latents], dim=2)

        # check https://arxiv.org/abs/2206.00364(the EDM-framework) for more details.
        target = latents
        model_pred = unet(
            inp_noisy_latents, timesteps, encoder_hidden_states, added_time_ids=added_time_ids
        ).sample

        # Denoise the latents
        c_out = -sigmas / ((sigmas**2 + 1) ** 0.5)
        c_skip = 1 / (sigmas**2 + 1)
        denoised_latents = model_pred * c_out + c_skip * noisy_latents
        weighing = (1 + sigmas**2) * (sigmas**-2.0)

        # MSE loss
        loss = torch.mean(
            (weighing.float() * (denoised_latents.float() - target.float()) ** 2).reshape(
                target.shape[0], -1
            ),
            dim=1,
        )
        loss = loss.mean()
        return loss

    params = [p for p in unet.parameters() if p.requires_grad]
    return types.SimpleNamespace(
        step=training_step,
        vae=vae,
        image_encoder=image_encoder,
        unet=unet,
        params=params,
        generator=generator,
    )


def _batch(size: int, seed: int = 0) -> dict:
    """``DummyDataset``'s sample, batched: ``pixel_values`` (frames, 3, h, w) in [-1, 1]."""
    generator = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.rand(size, FRAMES, 3, SIZE, SIZE, generator=generator) * 2 - 1}


_BUILT: list = []


def _built():
    if not _BUILT:
        parts = build()
        _BUILT.append((parts, graphsplit.split(parts.step, (_batch(2),))))
    return _BUILT[0]


def test_svd_step_verifies_on_the_example_and_another_size():
    parts, split = _built()
    assert_stage1_holds_no_trainable(split)
    for seed, batch in enumerate([_batch(2), _batch(3, seed=1)]):
        checks = graphsplit.verify(parts.step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


def test_svd_caches_the_image_embedding():
    parts, split = _built()
    # The whole-step trace refuses the step (``torch.Tensor([0.25 * sigma.log() ...])`` reads
    # values); the module-level path takes it.
    assert split.path == "calls"
    per_sample = {key: spec.shape[1:] for key, spec in split.boundary.items()}
    assert per_sample["image_encoder__0__image_embeds"] == (EMBED,)
    held = {name for name, _ in split.stage2.named_parameters()}
    assert not any(name.startswith("image_encoder.") for name in held)
    trainable = {n for n, p in split.stage2.named_parameters() if p.requires_grad}
    assert trainable == {f"unet.{n}" for n, _ in parts.unet.named_parameters()}


def test_svd_caches_the_frame_latents():
    """``rearrange(pixel_values, "b f c h w -> (b f) c h w")`` before ``vae.encode``: the
    frames' latents are cached ``FRAMES`` rows a sample (graphsplit.calls.row_folds)."""
    _parts, split = _built()
    latents = split.boundary["vae_quant_conv__0__out"]
    assert latents.batch_dim == 0 and latents.shape[1] == FRAMES, latents
    verdict = next(v for v in split.plan.verdicts if v.path == "vae.quant_conv" and v.index == 0)
    assert verdict.cached and f"{FRAMES} rows a sample, grouped" in verdict.line()


def test_svd_cache_round_trip(tmp_path):
    """As ``assert_cache_round_trip``, with the script's own ``generator`` (the conditioning
    dropout's) set alike before the unsplit step and before stage 2: it is not reseeded by
    ``torch.manual_seed`` and advances on every step."""
    parts, split = _built()
    loader = [_batch(2, seed=2), _batch(3, seed=3), _batch(1, seed=4)]
    info = graphsplit.cache(split, loader, tmp_path / "cache", progress=False)
    cached = graphsplit.CachedDataset(tmp_path / "cache", split)
    assert info.num_samples == len(cached) == 6
    assert [cached[row]["key"] for row in range(len(cached))] == [str(i) for i in range(6)]
    row = 0
    for seed, raw in enumerate(loader):
        size = len(raw["pixel_values"])
        rows = [cached[row + offset] for offset in range(size)]
        row += size

        def expected(raw=raw, seed=seed):
            parts.generator.manual_seed(100 + seed)
            return parts.step(raw)

        def actual(rows=rows, seed=seed):
            parts.generator.manual_seed(100 + seed)
            return split.stage2(**graphsplit.collate(rows))

        assert_same_step(expected, actual, parts.params, seed)
