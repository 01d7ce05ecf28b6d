"""IP-Adapter's training step on the module-level path: its per-sample loop over the batch.

IP-Adapter's trainer (tutorial_train.py) encodes the reference images with a frozen
``CLIPVisionModelWithProjection``, then zeroes the embeddings a Python list of ints says to
drop, one sample at a time: ``for image_embed, drop in zip(image_embeds,
batch["drop_image_embeds"]): if drop == 1: ...``. The whole-step trace refuses that loop; the
default ``path="auto"`` falls back to caching the image encoder's call, and stage 2 runs the
loop, the projection and the UNet as written. Tiny random configs, batches of 1, 2 and 3.
"""

from __future__ import annotations

import diffusers
import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

import graphsplit

TOKENS = 4
CROSS = 32


class IPAdapterStep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = transformers.CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=16,
            patch_size=8,
            projection_dim=16,
        )
        self.image_encoder = transformers.CLIPVisionModelWithProjection(config).eval()
        self.image_encoder.requires_grad_(False)
        self.image_proj_model = nn.Linear(16, TOKENS * CROSS)
        self.unet = diffusers.UNet2DConditionModel(
            block_out_channels=(32, 32),
            layers_per_block=1,
            sample_size=8,
            in_channels=4,
            out_channels=4,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=CROSS,
            attention_head_dim=4,
            norm_num_groups=8,
        )

    def forward(self, latents, text_embeds, clip_images, drop_image_embeds, timesteps):
        noise = torch.randn_like(latents)
        image_embeds = self.image_encoder(clip_images).image_embeds
        image_embeds_ = []
        for image_embed, drop in zip(image_embeds, drop_image_embeds):
            if drop == 1:
                image_embeds_.append(torch.zeros_like(image_embed))
            else:
                image_embeds_.append(image_embed)
        image_embeds = torch.stack(image_embeds_)
        ip_tokens = self.image_proj_model(image_embeds).view(-1, TOKENS, CROSS)
        encoder_hidden_states = torch.cat([text_embeds, ip_tokens], dim=1)
        noisy = latents + 0.5 * noise
        pred = self.unet(noisy, timesteps, encoder_hidden_states).sample
        return F.mse_loss(pred.float(), noise.float())


def batch(size: int, seed: int = 1) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {
        "latents": torch.randn(size, 4, 8, 8, generator=generator),
        "text_embeds": torch.randn(size, 3, CROSS, generator=generator),
        "clip_images": torch.randn(size, 3, 16, 16, generator=generator),
        "drop_image_embeds": [int(i % 2 == 1) for i in range(size)],
        "timesteps": torch.randint(0, 1000, (size,), generator=generator),
    }


def grads(step: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: param.grad.clone()
        for name, param in step.named_parameters()
        if param.grad is not None
    }


@pytest.mark.parametrize("size", [1, 2, 3])
def test_ip_adapter_splits_on_the_module_path_exactly(size):
    step = IPAdapterStep()
    example = batch(size)
    # At one sample the trace holds (a plan for batches of one); there, ask for the path.
    split = graphsplit.split(step, kwargs=example, path="calls" if size == 1 else "auto")
    assert isinstance(split, graphsplit.CallSplit)
    assert "image_encoder__0__image_embeds" in split.boundary
    assert split.boundary["image_encoder__0__image_embeds"].batch_dim == 0
    report = split.report()
    if size > 1:
        assert "path: calls, because the whole-step trace refused the step" in report
        assert "Python control flow depends on the batch size" in report
    assert "image_encoder call 0: cached" in report
    # Losses and gradients bit for bit, under the same seed.
    torch.manual_seed(7)
    loss = step(**example)
    loss.backward()
    expected = grads(step)
    step.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    loss_split = split.stage2(**split.stage1(**example))
    loss_split.backward()
    assert torch.equal(loss, loss_split)
    assert expected.keys() == grads(step).keys() and expected
    assert all(torch.equal(expected[n], g) for n, g in grads(step).items())
    assert all(c.ok for c in graphsplit.verify(step, split, kwargs=example))


def test_stage2_holds_no_image_encoder_and_runs_with_it_on_meta():
    step = IPAdapterStep()
    example = batch(2)
    split = graphsplit.split(step, kwargs=example)
    names = [name for name, _ in split.stage2.named_parameters()]
    assert not any(name.startswith("image_encoder.") for name in names)
    assert any(name.startswith("unet.") for name in names)
    assert {name for name, _ in split.stage1.named_parameters()} == {
        f"image_encoder.{name}" for name, _ in step.image_encoder.named_parameters()
    }
    cached = split.stage1(**example)
    torch.manual_seed(3)
    expected = step(**example)
    step.image_encoder.to("meta")
    torch.manual_seed(3)
    assert torch.equal(split.stage2(**cached), expected)


def test_cache_and_cached_dataset_round_trip(tmp_path):
    step = IPAdapterStep()
    examples = [batch(1, seed) for seed in range(4)]
    rows = [{key: value for key, value in ex.items()} for ex in examples]
    split = graphsplit.split(step, kwargs=batch(2))

    def collate(items):
        out = {
            key: torch.cat([item[key] for item in items])
            for key in items[0]
            if key != "drop_image_embeds"
        }
        out["drop_image_embeds"] = [d for item in items for d in item["drop_image_embeds"]]
        return out

    loader = torch.utils.data.DataLoader(rows, batch_size=2, collate_fn=collate)
    graphsplit.cache(split, loader, tmp_path / "cache")
    dataset = graphsplit.CachedDataset(tmp_path / "cache", split=split)
    first = next(iter(dataset.loader(batch_size=2, shuffle=False)))
    raw = collate(rows[:2])
    assert first["drop_image_embeds"].tolist() == raw["drop_image_embeds"]
    torch.manual_seed(5)
    expected = step(**raw)
    torch.manual_seed(5)
    assert torch.equal(split.stage2(**first), expected)


def test_path_trace_still_refuses_the_loop():
    with pytest.raises(graphsplit.TraceError, match="batch size"):
        graphsplit.split(IPAdapterStep(), kwargs=batch(2), path="trace")


def test_path_calls_skips_the_trace():
    split = graphsplit.split(IPAdapterStep(), kwargs=batch(2), path="calls")
    assert split.path == "calls" and not split.reason
    assert 'path: calls (asked for with path="calls")' in split.report()
