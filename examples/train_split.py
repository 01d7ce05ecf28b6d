"""Two-stage LoRA training with graphsplit: one accelerate script, three tasks.

    # the usual unsplit training, for comparison
    accelerate launch examples/train_split.py --task full --output-dir out/full
    # stage 1: run the frozen VAE and text encoder once over the dataset (UNet on meta)
    accelerate launch examples/train_split.py --task cache --cache-dir out/cache
    # stage 2: train the LoRA UNet from the cache (VAE and text encoder on meta)
    accelerate launch examples/train_split.py --task train --cache-dir out/cache \\
        --output-dir out/split

On CPU, add ``--multi_gpu --num_processes 2`` after ``launch`` for two gloo processes. The
model is graphsplit's zoo Stable-Diffusion LoRA step (real diffusers / transformers / peft
classes, random weights) and the data are procedural captioned images, so nothing downloads.
The step is written as diffusers' ``train_text_to_image_lora.py`` writes it: the models are
locals, the loop body is a function of the batch (``make_training_step``), and graphsplit
splits that function. With the same arguments, ``train`` on one process reproduces ``full``
exactly: the same loss at every step (``losses.json``) and the same LoRA weights
(``pytorch_lora_weights.safetensors``, peft's key names).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from peft import get_peft_model_state_dict
from safetensors.torch import save_file
from torch.utils.data import DataLoader, default_collate

import graphsplit

# The tiny real models this example trains live in the repository's tests/zoo.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.zoo.data import CaptionedImages
from tests.zoo.sd import SD_SIZES, build_sd_lora_step

CHECKPOINT = "pytorch_lora_weights.safetensors"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=("full", "cache", "train"), required=True)
    parser.add_argument("--cache-dir", type=Path, default=Path("out/cache"))
    parser.add_argument("--output-dir", type=Path, default=Path("out/lora"))
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps (full, train)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--resolution", type=int, help="image side (default: the size's)")
    parser.add_argument("--num-samples", type=int, default=16, help="dataset length")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0, help="weights, data and training noise")
    parser.add_argument("--shard-bytes", type=int, default=256 << 20, help="cache shard size")
    parser.add_argument("--size", choices=("tiny", "small"), default="tiny", help="model size")
    args = parser.parse_args(argv)
    args.resolution = args.resolution or SD_SIZES[args.size].resolution
    return args


def models(args: argparse.Namespace, **on_meta: bool):
    """``vae, text_encoder, unet, noise_scheduler`` as the script's ``main()`` holds them.

    ``frozen_on_meta`` / ``trainable_on_meta`` build the encoders / the UNet without weights.
    """
    step = build_sd_lora_step(seed=args.seed, size=args.size, **on_meta)
    return step.vae, step.text_encoder, step.unet, step.scheduler


def make_training_step(vae, text_encoder, unet, noise_scheduler):
    """The body of diffusers' training loop, as a function of the batch over the models."""

    def training_step(batch):
        # Convert images to latent space
        latents = vae.encode(batch["pixel_values"]).latent_dist.sample()
        latents = latents * vae.config.scaling_factor
        # Sample noise that we'll add to the latents, and a random timestep for each image
        noise = torch.randn_like(latents)
        bsz = latents.shape[0]
        timesteps = torch.randint(
            0, noise_scheduler.config.num_train_timesteps, (bsz,), device=latents.device
        )
        noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
        # Get the text embedding for conditioning, predict the noise residual
        encoder_hidden_states = text_encoder(batch["input_ids"], return_dict=False)[0]
        model_pred = unet(noisy_latents, timesteps, encoder_hidden_states, return_dict=False)[0]
        return F.mse_loss(model_pred.float(), noise.float(), reduction="mean")

    return training_step


def dataset_and_batch(args: argparse.Namespace, device: torch.device):
    """The image-caption dataset and its first batch, which graphsplit traces the step with."""
    dataset = CaptionedImages(args.num_samples, args.resolution, seed=args.seed)
    first = without_keys([dataset[i] for i in range(min(args.batch_size, len(dataset)))])
    return dataset, {name: value.to(device) for name, value in first.items()}


def without_keys(items: list[dict]) -> dict[str, torch.Tensor]:
    """Collate dataset items into the step's batch (``pixel_values``, ``input_ids``)."""
    return default_collate([{k: v for k, v in item.items() if k != "key"} for item in items])


def train_loop(accelerator, step, optimizer, loader, args) -> list[float]:
    """``args.steps`` AdamW steps of ``step(batch)``, cycling through ``loader``.

    Returns this process's losses. Both ``full`` and ``train`` run this loop from the same seed,
    so the step's random draws (VAE sample, noise, timesteps) come out the same.
    """
    torch.manual_seed(args.seed + accelerator.process_index)  # the step's noise and timesteps
    losses: list[float] = []
    batches = iter(loader)
    while len(losses) < args.steps:
        try:
            batch = next(batches)
        except StopIteration:
            batches = iter(loader)
            continue
        loss = step(batch)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        accelerator.print(f"step {len(losses)}: loss {losses[-1]:.6f}")
    return losses


def save(accelerator, unet, losses: list[float], output_dir: Path) -> None:
    """Write the LoRA weights with peft's names, and the per-step losses, on the main process."""
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        lora = get_peft_model_state_dict(unet)  # keys like "...to_q.lora_A.weight"
        save_file(
            {k: v.detach().cpu().contiguous() for k, v in lora.items()}, output_dir / CHECKPOINT
        )
        (output_dir / "losses.json").write_text(json.dumps(losses))
        print(f"saved {len(lora)} LoRA tensors to {output_dir / CHECKPOINT}")


def task_full(args, accelerator) -> None:
    """Train the whole step, frozen encoders included, as a script without graphsplit would."""
    vae, text_encoder, unet, noise_scheduler = models(args)
    for module in (vae, text_encoder, unet):
        module.to(accelerator.device)
    dataset, _ = dataset_and_batch(args, accelerator.device)
    loader = DataLoader(dataset, args.batch_size, shuffle=False, collate_fn=without_keys)
    optimizer = torch.optim.AdamW([p for p in unet.parameters() if p.requires_grad], lr=args.lr)
    prepared, optimizer, loader = accelerator.prepare(unet, optimizer, loader)
    training_step = make_training_step(vae, text_encoder, prepared, noise_scheduler)
    losses = train_loop(accelerator, training_step, optimizer, loader, args)
    save(accelerator, unet, losses, args.output_dir)


def task_cache(args, accelerator) -> None:
    """Stage 1: only the frozen weights are real; each process writes every n-th shard."""
    vae, text_encoder, unet, noise_scheduler = models(args, trainable_on_meta=True)
    vae.to(accelerator.device)
    text_encoder.to(accelerator.device)
    dataset, example = dataset_and_batch(args, accelerator.device)
    training_step = make_training_step(vae, text_encoder, unet, noise_scheduler)
    split = graphsplit.split(training_step, (example,))  # finds the models in its closure
    if accelerator.is_main_process:
        print(split.report())
    loader = DataLoader(dataset, args.batch_size, shuffle=False)  # plain: cache() shards it
    info = graphsplit.cache(
        split, loader, args.cache_dir, accelerator=accelerator, shard_bytes=args.shard_bytes
    )
    accelerator.print(info)


def task_train(args, accelerator) -> None:
    """Stage 2: only the LoRA UNet is real; batches are the cached boundary tensors."""
    vae, text_encoder, unet, noise_scheduler = models(args, frozen_on_meta=True)
    unet.to(accelerator.device)
    _, example = dataset_and_batch(args, accelerator.device)
    training_step = make_training_step(vae, text_encoder, unet, noise_scheduler)
    split = graphsplit.split(training_step, (example,))  # stage 2 calls this same `unet`
    # Refuses a cache made by other stage-1 code or boundary; the frozen weights are on meta
    # here, so their digest was checked by the cache task (graphsplit warns about that).
    cached = graphsplit.CachedDataset(args.cache_dir, split)
    loader = DataLoader(cached, args.batch_size, shuffle=False, collate_fn=graphsplit.collate)
    optimizer = torch.optim.AdamW([p for p in unet.parameters() if p.requires_grad], lr=args.lr)
    stage2, optimizer, loader = accelerator.prepare(split.stage2, optimizer, loader)
    losses = train_loop(accelerator, lambda batch: stage2(**batch), optimizer, loader, args)
    save(accelerator, unet, losses, args.output_dir)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    {"full": task_full, "cache": task_cache, "train": task_train}[args.task](args, accelerator)
    accelerator.wait_for_everyone()  # no process tears the group down under another
    accelerator.end_training()


if __name__ == "__main__":
    main()
