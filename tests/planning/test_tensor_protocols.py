"""Traced values answer Python's questions as eager tensors do (issue 11, item 1).

Each model writes the construct the way DiffSynth-Studio or diffusers writes it: a
data-to-device helper that branches on ``isinstance``, einops on traced values, a traced size
as a slice bound, device moves, a 0-dim tensor index into a scheduler table, and module state
written while the step runs.
"""

from __future__ import annotations

import operator

import pytest
import torch
from torch import nn

import graphsplit
from graphsplit.errors import TraceError
from graphsplit.planning.rules.size_guards import GUARDS
from tests.helpers import batch, frozen, line_of, param_names, split_and_verify


def transfer_data_to_device(data, device, torch_float_dtype=None):
    """DiffSynth's ``DiffusionTrainingModule.transfer_data_to_device``, verbatim."""
    if data is None:
        return data
    elif isinstance(data, torch.Tensor):
        data = data.to(device)
        if torch_float_dtype is not None and data.dtype in [
            torch.float,
            torch.float16,
            torch.bfloat16,
        ]:
            data = data.to(torch_float_dtype)
        return data
    elif isinstance(data, (tuple, list)):
        return type(data)(transfer_data_to_device(x, device, torch_float_dtype) for x in data)
    elif isinstance(data, dict):
        return {k: transfer_data_to_device(v, device, torch_float_dtype) for k, v in data.items()}
    return data


class CastsTensorsOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = frozen(nn.Linear(4, 4))
        self.head = nn.Linear(4, 1).double()

    def forward(self, x):
        inputs = transfer_data_to_device({"emb": self.encoder(x)}, "cpu", torch.float64)
        return self.head(inputs["emb"]).mean()


def test_isinstance_tensor_holds_for_traced_values_so_the_cast_eager_does_is_traced():
    split = split_and_verify(CastsTensorsOnly(), (batch(3, 4),))
    casts = [n for n in split.cut.stage2 if n.op == "call_method" and n.target == "to"]
    assert torch.float64 in {arg for node in casts for arg in node.args}


class ScalarOverloads(nn.Module):
    """CLIP's ``_get_vector_norm``: torch functions with Tensor/Scalar overloads on traced values.

    While ``isinstance`` was answered through a faked ``__class__``, torch's argument parser
    took the proxy in ``torch.pow(x, 2)`` for a real tensor and the process crashed.
    """

    def __init__(self) -> None:
        super().__init__()
        self.encoder = frozen(nn.Linear(4, 4))
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        features = self.head(self.encoder(x))
        norm = torch.pow(torch.sum(torch.pow(features, 2), dim=-1, keepdim=True), 0.5)
        scaled = torch.pow(2.0, features) + torch.xlogy(2.0, features.abs() + 1)
        return (features / norm).sum() + scaled.mean()


def test_torch_functions_with_scalar_overloads_take_traced_values():
    split = split_and_verify(ScalarOverloads(), (batch(3, 4),))
    assert param_names(split.stage2, split._model) == {"head.weight", "head.bias"}


def test_isinstance_is_answered_for_python_code_only_and_only_while_tracing():
    import builtins

    before = builtins.isinstance
    split_and_verify(CastsTensorsOnly(), (batch(3, 4),))
    assert builtins.isinstance is before


class Einops(nn.Module):
    """Wan's ``patchify`` / ``unpatchify`` spelled with einops, around a trainable block."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = frozen(nn.Conv2d(3, 4, 1))
        self.block = nn.Linear(4, 4)

    def forward(self, pixels):
        from einops import rearrange, repeat

        latents = self.encoder(pixels)
        height, width = latents.shape[2:]
        tokens = rearrange(latents, "b c h w -> b (h w) c")
        tokens = self.block(tokens)
        doubled = repeat(tokens, "b n c -> b n (c r)", r=2)
        image = rearrange(doubled, "b (h w) c -> b c h w", h=height, w=width)
        return image.square().mean()


def test_einops_on_traced_values_is_one_node_per_call_and_follows_the_size():
    pytest.importorskip("einops")
    model = Einops()
    split = split_and_verify(model, (batch(2, 3, 4, 6),))
    assert split.stage2.code.count("einops_einops_rearrange(") == 2
    assert split.stage2.code.count("einops_einops_repeat(") == 1
    other = batch(3, 3, 6, 2, seed=1)  # another resolution: the axis lengths stay traced
    assert torch.equal(split.stage2(**split.stage1(other)), model(other))


class RopeTable(nn.Module):
    """Wan's DiT: ``self.freqs[0][:f].view(f, 1, 1, -1)`` with ``f`` a traced size."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = frozen(nn.Linear(4, 4))
        self.head = nn.Linear(4, 1)
        self.freqs = (torch.randn(32, 4), torch.randn(32, 4))

    def forward(self, x):
        hidden = self.encoder(x)
        f = hidden.shape[1]
        freqs = self.freqs[0][:f].view(1, f, -1)
        return self.head(hidden * freqs).mean()


def test_a_traced_size_as_a_slice_bound_of_a_real_tensor_stays_traced():
    model = RopeTable()
    split = split_and_verify(model, (batch(2, 5, 4),))
    other = batch(2, 7, 4, seed=1)
    assert torch.equal(split.stage2(**split.stage1(other)), model(other))


class IndexesWithASize(nn.Module):
    """``__index__`` outside torch: Python lists sized by a traced (non-batch) size."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = frozen(nn.Linear(4, 4))
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        hidden = self.encoder(x)
        scales = [1.0, 0.5, 0.25, 0.125, 2.0][: hidden.shape[1]]
        return self.head(hidden * torch.tensor(scales)[:, None]).mean()


def test_index_with_a_traced_size_is_a_guarded_python_int():
    split = split_and_verify(IndexesWithASize(), (batch(3, 4, 4),))
    guards = [guard for node in split.graph.nodes for guard in node.meta.get(GUARDS, ())]
    read = [guard for guard in guards if guard.value == 4 and guard.convert is operator.index]
    assert read and read[0].source.endswith(line_of(IndexesWithASize.forward, "scales ="))


class IndexesWithTheBatchSize(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        weights = [1.0, 0.5, 0.25, 0.125, 2.0, 3.0, 4.0][: x.shape[0]]
        return (self.head(x).squeeze(1) * torch.tensor(weights)).mean()


def test_index_with_the_batch_size_is_refused_naming_the_line_and_the_fix():
    with pytest.raises(TraceError) as caught:
        graphsplit.split(IndexesWithTheBatchSize(), (batch(3, 4),), path="trace")
    message = str(caught.value)
    assert "depends on the batch size" in message
    assert line_of(IndexesWithTheBatchSize.forward, "weights =") in message
    assert "fix:" in message and "instead of converting the batch size" in message


class MovesDevices(nn.Module):
    """Wan's VAE (``video.to("cpu")`` per sample, then ``.to(device)``) and a ``.cuda()`` move.

    ``device`` is where training runs: planning happens on ``meta`` whatever it is, so a
    CUDA device works on a machine without CUDA.
    """

    def __init__(self, device: str) -> None:
        super().__init__()
        self.vae = frozen(nn.Conv2d(3, 4, 1))
        self.head = nn.Conv2d(4, 1, 1)
        self.device = device

    def forward(self, video):
        latents = self.vae(video.to("cpu")).to(dtype=torch.float32, device=self.device)
        if self.device == "cuda":
            latents = latents.cuda()
        return self.head(latents).mean()


def test_device_moves_to_real_devices_stay_on_meta_while_planning():
    split_and_verify(MovesDevices("cpu"), (batch(2, 3, 4, 4),))
    split = graphsplit.split(MovesDevices("cuda"), (batch(2, 3, 4, 4),))
    assert "cuda" in split.stage1.code  # the stages move as the step did
    assert [spec.shape for spec in split.boundary.values()] == [(2, 4, 4, 4)]


class FlowMatchScheduler:
    """DiffSynth's ``FlowMatchScheduler.add_noise``: a 0-dim tensor index into ``sigmas``."""

    def __init__(self) -> None:
        self.timesteps = torch.linspace(1000.0, 0.0, 20)
        self.sigmas = self.timesteps / 1000.0

    def add_noise(self, original_samples, noise, timestep):
        if isinstance(timestep, torch.Tensor):
            timestep = timestep.cpu()
        timestep_id = torch.argmin((self.timesteps - timestep).abs())
        sigma = self.sigmas[timestep_id]
        sample = (1 - sigma) * original_samples + sigma * noise
        return sample


class FlowMatchStep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.vae = frozen(nn.Linear(4, 4))
        self.dit = nn.Linear(4, 4)
        self.scheduler = FlowMatchScheduler()

    def forward(self, x):
        latents = self.vae(x)
        timestep_id = torch.randint(0, 20, (1,))  # FlowMatchSFTLoss
        timestep = self.scheduler.timesteps[timestep_id].to(dtype=torch.float32, device=x.device)
        noise = torch.randn_like(latents)
        noisy = self.scheduler.add_noise(latents, noise, timestep)
        return nn.functional.mse_loss(self.dit(noisy), noise - latents)


def test_a_zero_dim_tensor_index_into_a_real_table_is_one_node():
    split = split_and_verify(FlowMatchStep(), (batch(3, 4),))
    reads = [
        node
        for node in split.cut.stage2
        if node.target is operator.getitem and node.args[1].name == "argmin"
    ]
    assert len(reads) == 1 and reads[0].args[0].op == "get_attr"


class QwenRope(nn.Module):
    """Qwen-Image's RoPE: moves its table on first use and caches per-size frequencies."""

    def __init__(self) -> None:
        super().__init__()
        self.pos_freqs = torch.randn(64, 4)
        self.rope_cache = {}

    def forward(self, length, device):
        if self.pos_freqs.device != device:
            self.pos_freqs = self.pos_freqs.to(device)
        key = f"{length}"
        if key not in self.rope_cache:
            self.rope_cache[key] = self.pos_freqs[:length].clone().contiguous()
        return self.rope_cache[key]


class RopeStep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = frozen(nn.Linear(4, 4))
        self.rope = QwenRope()
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        hidden = self.encoder(x)
        return self.head(hidden * self.rope(hidden.shape[1], hidden.device)).mean()


def test_module_state_written_while_tracing_is_restored():
    model = RopeStep()
    table = model.rope.pos_freqs
    split = graphsplit.split(model, (batch(3, 5, 4),))
    assert model.rope.pos_freqs is table and model.rope.rope_cache == {}
    assert all(c.ok for c in graphsplit.verify(model, split, (batch(3, 5, 4),), seed=0))
    assert not {"rope.pos_freqs"} & param_names(split.stage2, model)
    other = batch(3, 6, 4, seed=1)
    assert torch.equal(split.stage2(**split.stage1(other)), model(other))
