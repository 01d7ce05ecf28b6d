"""Conformance: Diffusion-DPO, diffusers' ``examples/research_projects/diffusion_dpo/
train_diffusion_dpo.py`` loop body, as a closure.

The script's models (``main()``): a frozen VAE, CLIP text encoder and UNet
(``requires_grad_(False)``), the UNet given a LoRA adapter with ``unet.add_adapter(LoraConfig(
r=rank, lora_alpha=rank, init_lora_weights="gaussian", target_modules=["to_k", "to_q", "to_v",
"to_out.0"]))`` and put in train mode. The batch is the script's ``collate_fn`` output: the
preferred and the rejected image concatenated on the channels (``(batch, 6, h, w)``, as
``preprocess_train`` builds it) and the caption's ids.

The loop body is copied from the script: the pair is unfolded onto the batch
(``torch.cat(pixel_values.chunk(2, dim=1))``), encoded by the VAE in chunks of
``args.vae_encode_batch_size`` (a Python loop over the batch's size), one noise and one
timestep per pair (``.chunk(2)[0].repeat(2, 1, 1, 1)``, ``.repeat(2)``), the prompt encoded by
the script's ``@torch.no_grad()`` ``encode_prompt`` and repeated for both halves, the policy
prediction, and the *reference* prediction: the same UNet with its adapters switched off
(``accelerator.unwrap_model(unet).disable_adapters()`` ... ``enable_adapters()``) under
``torch.no_grad()``; then the sigmoid DPO loss on ``ref_diff - model_diff``. The logged
``implicit_acc`` is computed as in the script. Changes: ``accelerator`` is a stand-in whose
``unwrap_model`` returns the model (one process, no DDP wrapper); the backward, optimizer and
logging lines that follow the loss are the caller's.

What must hold: the step splits exactly (loss and every LoRA gradient bit for bit, on the
example and on a batch of another size: the reference prediction must be the UNet's *without*
LoRA, as in eager), the VAE and the text encoder are cached (their weights are not held by
stage 2; the VAE's is a strict xfail: the pair folded onto the batch is not cached), the UNet
runs in stage 2 (both of its calls take the noisy latents), and a cache written through the
disk trains stage 2 exactly. The whole-step trace refuses the step (the reference call under
``torch.no_grad()``); the step rewritten as that refusal's fix line says must split exactly
or be refused (a strict xfail: the trace path drops ``disable_adapters()``).

Tiny configs: the zoo's ``tiny`` SD (VAE (32, 64), CLIP 32 wide, UNet (32, 64)), LoRA rank 4,
32 px.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

import graphsplit
from tests.helpers import assert_stage1_holds_no_trainable, line_of

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tests.conformance.unseen2_data_checks import assert_cache_round_trip  # noqa: E402
from tests.conformance.unseen_checks import stage2_top_modules  # noqa: E402
from tests.zoo import build_frozen_sd  # noqa: E402
from tests.zoo.data import tokenize  # noqa: E402

RESOLUTION = 32


@torch.no_grad()
def encode_prompt(text_encoder, input_ids):
    """The script's, verbatim."""
    text_input_ids = input_ids.to(text_encoder.device)
    attention_mask = None

    prompt_embeds = text_encoder(text_input_ids, attention_mask=attention_mask)
    prompt_embeds = prompt_embeds[0]

    return prompt_embeds


def collate_fn(examples):
    """The script's, verbatim."""
    pixel_values = torch.stack([example["pixel_values"] for example in examples])
    pixel_values = pixel_values.to(memory_format=torch.contiguous_format).float()
    final_dict = {"pixel_values": pixel_values}
    final_dict["input_ids"] = torch.stack([example["input_ids"] for example in examples])
    return final_dict


def build(vae_encode_batch_size: int = 8):
    """``main()``'s models (fp32, one process) and the loop body as a closure."""
    vae, text_encoder, unet, noise_scheduler = build_frozen_sd()
    args = types.SimpleNamespace(
        rank=4, vae_encode_batch_size=vae_encode_batch_size, loss_type="sigmoid", beta_dpo=2500
    )
    accelerator = types.SimpleNamespace(device=torch.device("cpu"), unwrap_model=lambda m: m)

    vae.requires_grad_(False)
    text_encoder.requires_grad_(False)
    unet.requires_grad_(False)
    weight_dtype = torch.float32

    # Set up LoRA.
    unet_lora_config = peft.LoraConfig(
        r=args.rank,
        lora_alpha=args.rank,
        init_lora_weights="gaussian",
        target_modules=["to_k", "to_q", "to_v", "to_out.0"],
    )
    torch.manual_seed(5)
    unet.add_adapter(unet_lora_config)
    # peft's gaussian init leaves lora_B at zero, so the policy would equal the reference and
    # every lora_A gradient would be zero: drawn small, as after some training steps.
    with torch.no_grad():
        for name, param in unet.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
    unet.train()

    def training_step(batch):
        # (batch_size, 2*channels, h, w) -> (2*batch_size, channels, h, w)
        pixel_values = batch["pixel_values"].to(dtype=weight_dtype)
        feed_pixel_values = torch.cat(pixel_values.chunk(2, dim=1))

        latents = []
        for i in range(0, feed_pixel_values.shape[0], args.vae_encode_batch_size):
            latents.append(
                vae.encode(
                    feed_pixel_values[i : i + args.vae_encode_batch_size]
                ).latent_dist.sample()
            )
        latents = torch.cat(latents, dim=0)
        latents = latents * vae.config.scaling_factor

        # Sample noise that we'll add to the latents
        noise = torch.randn_like(latents).chunk(2)[0].repeat(2, 1, 1, 1)

        # Sample a random timestep for each image
        bsz = latents.shape[0] // 2
        timesteps = torch.randint(
            0,
            noise_scheduler.config.num_train_timesteps,
            (bsz,),
            device=latents.device,
            dtype=torch.long,
        ).repeat(2)

        # Add noise to the model input according to the noise magnitude at each timestep
        # (this is the forward diffusion process)
        noisy_model_input = noise_scheduler.add_noise(latents, noise, timesteps)

        # Get the text embedding for conditioning
        encoder_hidden_states = encode_prompt(text_encoder, batch["input_ids"]).repeat(2, 1, 1)

        # Predict the noise residual
        model_pred = unet(
            noisy_model_input,
            timesteps,
            encoder_hidden_states,
        ).sample

        # Get the target for loss depending on the prediction type
        if noise_scheduler.config.prediction_type == "epsilon":
            target = noise
        elif noise_scheduler.config.prediction_type == "v_prediction":
            target = noise_scheduler.get_velocity(latents, noise, timesteps)
        else:
            raise ValueError(f"Unknown prediction type {noise_scheduler.config.prediction_type}")

        # Compute losses.
        model_losses = F.mse_loss(model_pred.float(), target.float(), reduction="none")
        model_losses = model_losses.mean(dim=list(range(1, len(model_losses.shape))))
        model_losses_w, model_losses_l = model_losses.chunk(2)

        # For logging
        raw_model_loss = 0.5 * (model_losses_w.mean() + model_losses_l.mean())  # noqa: F841
        model_diff = model_losses_w - model_losses_l  # These are both LBS (as is t)

        # Reference model predictions.
        accelerator.unwrap_model(unet).disable_adapters()
        with torch.no_grad():
            ref_preds = unet(
                noisy_model_input,
                timesteps,
                encoder_hidden_states,
            ).sample.detach()
            ref_loss = F.mse_loss(ref_preds.float(), target.float(), reduction="none")
            ref_loss = ref_loss.mean(dim=list(range(1, len(ref_loss.shape))))

            ref_losses_w, ref_losses_l = ref_loss.chunk(2)
            ref_diff = ref_losses_w - ref_losses_l
            raw_ref_loss = ref_loss.mean()  # noqa: F841

        # Re-enable adapters.
        accelerator.unwrap_model(unet).enable_adapters()

        # Final loss.
        logits = ref_diff - model_diff
        if args.loss_type == "sigmoid":
            loss = -1 * F.logsigmoid(args.beta_dpo * logits).mean()
        elif args.loss_type == "hinge":
            loss = torch.relu(1 - args.beta_dpo * logits).mean()
        elif args.loss_type == "ipo":
            losses = (logits - 1 / (2 * args.beta)) ** 2
            loss = losses.mean()
        else:
            raise ValueError(f"Unknown loss type {args.loss_type}")

        implicit_acc = (logits > 0).sum().float() / logits.size(0)
        implicit_acc += 0.5 * (logits == 0).sum().float() / logits.size(0)
        return loss

    def detached_step(batch):
        """Not the script's: the loop body as the trace path's refusal asks it rewritten
        (``.detach()`` instead of ``torch.no_grad()``, the script already detaches), with each
        half of the pair encoded by its own VAE call (so the trace path finds a cut)."""
        pixel_values = batch["pixel_values"].to(dtype=weight_dtype)
        latents = [vae.encode(half).latent_dist.sample() for half in pixel_values.chunk(2, dim=1)]
        latents = torch.cat(latents, dim=0)
        latents = latents * vae.config.scaling_factor
        noise = torch.randn_like(latents).chunk(2)[0].repeat(2, 1, 1, 1)
        bsz = latents.shape[0] // 2
        timesteps = torch.randint(
            0,
            noise_scheduler.config.num_train_timesteps,
            (bsz,),
            device=latents.device,
            dtype=torch.long,
        ).repeat(2)
        noisy_model_input = noise_scheduler.add_noise(latents, noise, timesteps)
        encoder_hidden_states = encode_prompt(text_encoder, batch["input_ids"]).repeat(2, 1, 1)
        model_pred = unet(noisy_model_input, timesteps, encoder_hidden_states).sample
        target = noise
        model_losses = F.mse_loss(model_pred.float(), target.float(), reduction="none")
        model_losses = model_losses.mean(dim=list(range(1, len(model_losses.shape))))
        model_losses_w, model_losses_l = model_losses.chunk(2)
        model_diff = model_losses_w - model_losses_l
        accelerator.unwrap_model(unet).disable_adapters()
        ref_preds = unet(noisy_model_input, timesteps, encoder_hidden_states).sample.detach()
        ref_loss = F.mse_loss(ref_preds.float(), target.float(), reduction="none")
        ref_loss = ref_loss.mean(dim=list(range(1, len(ref_loss.shape))))
        ref_losses_w, ref_losses_l = ref_loss.chunk(2)
        ref_diff = ref_losses_w - ref_losses_l
        accelerator.unwrap_model(unet).enable_adapters()
        logits = ref_diff - model_diff
        return -1 * F.logsigmoid(args.beta_dpo * logits).mean()

    params = [p for p in unet.parameters() if p.requires_grad]
    return types.SimpleNamespace(
        step=training_step,
        detached_step=detached_step,
        vae=vae,
        text_encoder=text_encoder,
        unet=unet,
        params=params,
    )


def _example(index: int) -> dict:
    """``preprocess_train``'s sample: ``jpg_0`` and ``jpg_1`` in [-1, 1] concatenated on the
    channels (swapped when ``label_0 == 0``, so the preferred image comes first) and the
    caption's ids."""
    generator = torch.Generator().manual_seed(900 + index)
    im_tup = tuple(
        torch.rand(3, RESOLUTION, RESOLUTION, generator=generator) * 2 - 1 for _ in range(2)
    )
    label_0 = index % 2
    if label_0 == 0:
        im_tup = im_tup[::-1]
    return {
        "pixel_values": torch.cat(im_tup, dim=0),
        "input_ids": tokenize(f"a photo of a cat number {index}"),
    }


def _batch(indices) -> dict:
    return collate_fn([_example(i) for i in indices])


_BUILT: dict = {}


def _built(vae_encode_batch_size: int = 8):
    if vae_encode_batch_size not in _BUILT:
        parts = build(vae_encode_batch_size)
        split = graphsplit.split(parts.step, (_batch([0, 1]),))
        _BUILT[vae_encode_batch_size] = (parts, split)
    return _BUILT[vae_encode_batch_size]


def _reference_differs_from_policy(parts, batch) -> bool:
    """The LoRA is real: with adapters off the UNet predicts otherwise (else the reference
    branch could be dropped or mixed up with the policy and no check would see it)."""
    unet = parts.unet
    latents = torch.randn(2, 4, 16, 16)
    t = torch.tensor([10, 500])
    states = torch.randn(2, 16, 32)
    with torch.no_grad():
        policy = unet(latents, t, states).sample
        unet.disable_adapters()
        reference = unet(latents, t, states).sample
        unet.enable_adapters()
    return not torch.equal(policy, reference)


def test_dpo_step_verifies_on_the_example_and_another_size():
    parts, split = _built()
    assert _reference_differs_from_policy(parts, _batch([0, 1]))
    assert_stage1_holds_no_trainable(split)
    for seed, batch in enumerate([_batch([0, 1]), _batch([2, 3, 4])]):
        checks = graphsplit.verify(parts.step, split, (batch,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]
    # the step leaves the adapters on, as the script does
    assert all(
        not layer.disable_adapters
        for layer in parts.unet.modules()
        if isinstance(layer, peft.tuners.tuners_utils.BaseTunerLayer)
    )


def test_dpo_caches_the_text_encoder_not_the_unet():
    parts, split = _built()
    held = stage2_top_modules(split)
    assert "text_encoder" not in held
    per_sample = {key: spec.shape[1:] for key, spec in split.boundary.items()}
    assert per_sample["text_encoder__0__last_hidden_state"] == (16, 32)
    # both UNet calls take the noisy latents: stage 2 runs the UNet, and trains its LoRA only
    assert "unet" in held
    trainable = {n for n, p in split.stage2.named_parameters() if p.requires_grad}
    assert trainable == {f"unet.{n}" for n, p in parts.unet.named_parameters() if p.requires_grad}


def test_dpo_cache_round_trip(tmp_path):
    parts, split = _built()
    loader = [_batch([4, 5]), _batch([6, 7, 8]), _batch([9])]
    assert_cache_round_trip(split, parts.step, loader, tmp_path / "cache", parts.params)


def test_dpo_caches_the_vae_latents():
    """The pair folded onto the batch (``torch.cat(pixel_values.chunk(2, dim=1))``: rows i
    and B+i are sample i's) is cached a pair an entry; stage 2 holds no VAE
    (graphsplit.calls.row_folds), and trains exactly from the cache (the round trip above)."""
    _parts, split = _built()
    stage2 = {name for name, _ in split.stage2.named_parameters()}
    assert not any(name.startswith("vae.") for name in stage2), sorted(stage2)[:3]
    latents = split.boundary["vae_quant_conv__0__out"]
    assert latents.batch_dim == 0 and latents.shape[:2] == (2, 2), latents
    vae = [v for v in split.plan.verdicts if v.path == "vae.quant_conv"]
    assert vae[0].cached and "2 rows a sample, strided" in vae[0].line()


def test_dpo_trace_path_refusal_names_the_reference_call():
    parts, _split = _built()
    with pytest.raises(graphsplit.TraceError) as info:
        graphsplit.split(parts.step, (_batch([0, 1]),), path="trace")
    message = str(info.value)
    assert line_of(build, "ref_preds = unet(\n") in message
    assert "torch.no_grad()" in message and "fix:" in message


def test_dpo_trace_path_with_the_detach_fix_is_refused_not_wrong():
    """Following the grad-mode refusal's fix (.detach() instead of no_grad) gave a trace plan
    that called the same ``unet`` node twice, the Python ``disable_adapters()`` between the
    calls dropped: split() accepted it and stage 2 ran the reference with the LoRA on (loss off
    by ~0.4). The tracer now marks a leaf call made while the step had changed a module under
    it; the rounds cannot trace into this UNet, so the call is refused, naming the user's call,
    the changed flag and the fix; the default path runs the step's own Python, exactly."""
    parts, _split = _built()
    batch = _batch([0, 1])
    with pytest.raises(graphsplit.TraceError) as info:
        graphsplit.split(parts.detached_step, (batch,), path="trace")
    message = str(info.value)
    assert "The step changes the state of unet before this call" in message
    assert "_disable_adapters" in message
    assert "ref_preds = unet(noisy_model_input" in message
    assert 'path="calls"' in message
    split = graphsplit.split(parts.detached_step, (batch,))
    assert split.path == "calls"
    for seed, other in enumerate([batch, _batch([2, 3, 4])]):
        checks = graphsplit.verify(parts.detached_step, split, (other,), seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]
