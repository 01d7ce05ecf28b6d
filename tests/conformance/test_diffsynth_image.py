"""DiffSynth-Studio's own FLUX.1 and Qwen-Image LoRA steps, real random weights, split at batch 1.

The steps (``examples/diffsynth/image_steps.py``) are DiffSynth's ``forward(data)`` from
``examples/*/model_training/train.py`` on DiffSynth's pipeline, units, ``FlowMatchSFTLoss``,
``pipe.model_fn`` and model classes, unmodified; the models keep their fixed widths and are made
small only by their own arguments or by keeping a prefix of their repeated blocks (see that
module's docstring for exactly what). One sample per batch, as DiffSynth trains.

Each family is checked for: the step is DiffSynth's own and trains; ``graphsplit.split`` plans
it one sample per batch and ``graphsplit.verify`` finds loss and every LoRA gradient bit-equal;
stage 2 holds only DiT parameters (no text encoder, no VAE); what the boundary caches.

Needs ``diffsynth==2.1.12`` (see examples/diffsynth/README.md); skipped with the reason printed
where it cannot import. The models are 3072 wide (FLUX ~0.9 B parameters, ~4.1 GB resident;
Qwen-Image ~5.4 GB), so the module is marked slow, and each family's fixture is class-scoped so
the two are never resident together.

Qwen-Image's ``model_fn_qwen_image`` (the trainable side: it calls the DiT) reads
``txt_seq_lens = prompt_emb_mask.sum(dim=1).tolist()`` off the frozen prompt mask; planned one
sample per batch, the plan holds the example's value (187 prompt tokens here) and stage 1 checks
it on every batch (:mod:`graphsplit.planning.opaque.value_reads`): a prompt of another length is
refused there, naming DiffSynth's line. One plan serves one prompt length.
"""

from __future__ import annotations

import sys

import pytest
import torch

from examples.diffsynth.image_steps import DIFFSYNTH, WHY_NOT

if not DIFFSYNTH:
    print(f"tests/conformance/test_diffsynth_image.py skipped: {WHY_NOT}", file=sys.stderr)
    pytest.skip(WHY_NOT, allow_module_level=True)

import graphsplit
from examples.diffsynth.image_steps import (
    FLUX_T5_TOKENS,
    PromptTokens,
    flux_batch,
    flux_lora_step,
    qwen_image_batch,
    qwen_image_lora_step,
)
from graphsplit.planning.opaque.value_reads import answered_reads
from tests.helpers import line_of, param_names, split_and_verify

pytestmark = pytest.mark.slow


def _sources(split: graphsplit.Split) -> dict[str, str]:
    """Boundary name -> ``file.py:N`` of the user line that made it (file name only)."""
    return {name: spec.source.rsplit("/", 1)[-1] for name, spec in split.boundary.items()}


def _module_prefixes(split_stage: torch.nn.Module, model: torch.nn.Module) -> set[str]:
    """``pipe.<model>`` for every pipeline model a stage holds parameters of."""
    return {".".join(name.split(".")[:2]) for name in param_names(split_stage, model)}


# -- FLUX.1 ---------------------------------------------------------------------------------------
@pytest.fixture(scope="class")
def flux():
    step, batch = flux_lora_step(seed=0)
    split = split_and_verify(step, (), batch)
    return step, batch, split


class TestFlux:
    """FLUX.1: splits one sample per batch and verifies bit for bit."""

    def test_the_flux_step_is_diffsynths_own_with_lora_on_the_dit(self, flux):
        from diffsynth.models.flux_dit import FluxDiT
        from diffsynth.models.flux_text_encoder_t5 import FluxTextEncoderT5
        from diffsynth.pipelines.flux_image import FluxImagePipeline, model_fn_flux_image

        step, _, _ = flux
        assert type(step.pipe) is FluxImagePipeline
        assert step.pipe.model_fn is model_fn_flux_image
        assert (
            type(step.pipe.dit) is FluxDiT and type(step.pipe.text_encoder_2) is FluxTextEncoderT5
        )
        assert step.pipe.dit.x_embedder.out_features == 3072  # DiffSynth's width, not a tiny one
        assert (len(step.pipe.dit.blocks), len(step.pipe.dit.single_blocks)) == (1, 1)
        assert len(step.pipe.text_encoder_2.encoder.block) == 1
        t5 = step.pipe.text_encoder_2
        assert t5.shared.weight is t5.encoder.embed_tokens.weight  # tied, as DiffSynth builds it
        trainable = [name for name, p in step.named_parameters() if p.requires_grad]
        assert trainable and all(
            "lora_" in name and name.startswith("pipe.dit.") for name in trainable
        )
        assert not any(p.is_meta for p in step.parameters())

    def test_flux_lora_splits_one_sample_per_batch_and_verifies_exactly(self, flux):
        step, batch, split = flux  # split_and_verify compared loss and LoRA gradients bit for bit
        assert any(note.startswith("one sample per batch") for note in split.notes)
        other = flux_batch(seed=1)  # another sample through the same plan
        torch.manual_seed(1)
        expected = step(**other)
        torch.manual_seed(1)
        assert torch.equal(split.stage2(**split.stage1(**other)), expected)
        with pytest.raises(graphsplit.SplitError, match="this plan runs one sample per batch"):
            split.stage1(**{name: torch.cat([value, value]) for name, value in batch.items()})

    def test_flux_stage2_holds_only_the_dit_and_not_its_text_embedders(self, flux):
        step, _, split = flux
        assert _module_prefixes(split.stage2, step) == {"pipe.dit"}
        held = param_names(split.stage2, step)
        # The DiT's frozen text projections only see the prompt: their work moved to stage 1.
        moved = ("pipe.dit.context_embedder.", "pipe.dit.pooled_text_embedder.")
        assert not any(name.startswith(moved) for name in held)
        # Time and guidance embedders stay: they embed the timestep stage 2 draws.
        assert any(name.startswith("pipe.dit.time_embedder.") for name in held)
        assert param_names(split.stage1, step).isdisjoint(split.trainable)
        assert {
            "pipe.text_encoder_1",
            "pipe.text_encoder_2",
            "pipe.vae_encoder",
        } <= _module_prefixes(split.stage1, step)

    def test_flux_boundary_caches_the_latents_and_the_projected_prompt(self, flux):
        _, _, split = flux
        shapes = {spec.shape: spec for spec in split.boundary.values()}
        # The text ids (zeros of the T5 output's length) are not stored: stage 2 makes them,
        # reading the length off the projected prompt (planning/cut/twin_reads.py).
        assert set(shapes) == {(1, 16, 4, 4), (1, 3072), (1, FLUX_T5_TOKENS, 3072)}
        sources = _sources(split)
        latents = shapes[(1, 16, 4, 4)]  # the VAE encoder's output, not the image
        assert sources[latents.name].startswith("flux_image.py:")
        assert "check_same_read" in split.stage1.code
        assert all(spec.dtype == torch.float32 for spec in split.boundary.values())
        assert not any(
            spec.shape == (1, 3, 32, 32) for spec in split.boundary.values()
        )  # no pixels


# -- Qwen-Image -----------------------------------------------------------------------------------
@pytest.fixture(scope="class")
def qwen_image():
    return qwen_image_lora_step(seed=0)


@pytest.fixture(scope="class")
def qwen_split(qwen_image):
    step, batch = qwen_image
    return step, batch, split_and_verify(step, (), batch)


class TestQwenImage:
    """Qwen-Image: splits one sample per batch, its prompt length read as the plan's value."""

    def test_the_qwen_image_step_is_diffsynths_own_and_trains_at_batch_one(self, qwen_image):
        from diffsynth.models.qwen_image_dit import QwenImageDiT
        from diffsynth.models.qwen_image_text_encoder import QwenImageTextEncoder
        from diffsynth.pipelines.qwen_image import QwenImagePipeline, model_fn_qwen_image

        step, batch = qwen_image
        assert type(step.pipe) is QwenImagePipeline
        assert step.pipe.model_fn is model_fn_qwen_image
        assert type(step.pipe.dit) is QwenImageDiT
        assert type(step.pipe.text_encoder) is QwenImageTextEncoder
        assert step.pipe.dit.txt_in.in_features == 3584  # DiffSynth's widths, not tiny ones
        assert step.pipe.text_encoder.model.language_model.embed_tokens.num_embeddings == 152064
        assert len(step.pipe.dit.transformer_blocks) == 1
        assert not any(p.is_meta for p in step.parameters())
        # The unused head is one zero broadcast to its shape (stride 0): real, and 4 bytes.
        assert step.pipe.text_encoder.lm_head.weight.stride() == (0, 0)
        trainable = [name for name, p in step.named_parameters() if p.requires_grad]
        assert trainable and all("lora_" in n and n.startswith("pipe.dit.") for n in trainable)
        torch.manual_seed(0)
        loss = step(**batch)
        loss.backward()
        assert loss.dim() == 0 and torch.isfinite(loss)
        # The last block's text-stream output feeds nothing (DiffSynth's model_fn keeps the image
        # stream), so its to_add_out adapter gets no gradient, in DiffSynth's 60-block DiT too.
        no_grad = {name for name in trainable if step.get_parameter(name).grad is None}
        assert {name.split(".lora_")[0] for name in no_grad} == {
            "pipe.dit.transformer_blocks.0.attn.to_add_out"
        }
        step.zero_grad(set_to_none=True)

    def test_the_template_tokenizer_splices_the_prompt_into_diffsynths_template(self, qwen_image):
        from diffsynth.pipelines.qwen_image import QwenImageUnit_PromptEmbedder

        step, batch = qwen_image
        unit = next(u for u in step.pipe.units if isinstance(u, QwenImageUnit_PromptEmbedder))
        prompt = PromptTokens(batch["prompt_ids"])
        (states,) = unit.encode_prompt(step.pipe, [prompt])  # DiffSynth's own prompt path
        template = "<|im_start|>system\nDescribe the image"  # the head of DiffSynth's template
        encoded = step.pipe.tokenizer([f"{template}{{}}".format(prompt)])
        assert encoded.input_ids[0, : len(template)].tolist() == list(template.encode())
        assert torch.equal(encoded.input_ids[:, len(template) :], batch["prompt_ids"])
        assert encoded.attention_mask.shape == encoded.input_ids.shape
        assert states.shape[-1] == 3584 and states.shape[0] > batch["prompt_ids"].shape[1]

    def test_qwen_image_lora_splits_one_sample_per_batch_and_verifies_exactly(self, qwen_split):
        from diffsynth.pipelines.qwen_image import model_fn_qwen_image

        step, _, split = qwen_split  # split_and_verify: loss and LoRA gradients bit-equal
        assert any(note.startswith("one sample per batch") for note in split.notes)
        (read,) = answered_reads(split.graph)
        assert read.value == [187]  # 8 prompt tokens + the 179 template tokens DiffSynth keeps
        assert line_of(model_fn_qwen_image, "prompt_emb_mask.sum(dim=1).tolist()") in read.read_at
        # Stage 2 slices the RoPE table with the literal; stage 1 checks the value.
        assert "+ 187" in split.stage2.code
        assert "graphsplit_runtime_check_value(" in split.stage1.code
        other = qwen_image_batch(seed=1)  # another prompt of the same length
        torch.manual_seed(1)
        expected = step(**other)
        torch.manual_seed(1)
        assert torch.equal(split.stage2(**split.stage1(**other)), expected)

    def test_qwen_image_stage2_holds_only_the_dit(self, qwen_split):
        step, _, split = qwen_split
        assert _module_prefixes(split.stage2, step) == {"pipe.dit"}
        held = param_names(split.stage2, step)
        assert not any(name.startswith(("pipe.dit.txt_in.", "pipe.dit.txt_norm.")) for name in held)
        assert {"pipe.text_encoder", "pipe.vae"} <= _module_prefixes(split.stage1, step)
        assert param_names(split.stage1, step).isdisjoint(split.trainable)

    def test_qwen_image_boundary_caches_latents_and_projected_prompt_not_the_mask(self, qwen_split):
        _, _, split = qwen_split
        shapes = sorted(spec.shape for spec in split.boundary.values())
        assert shapes == [(1, 16, 4, 4), (1, 187, 3072)]  # VAE latents, txt_in(prompt states)

    def test_a_prompt_of_another_length_is_refused_in_stage_1_naming_diffsynths_line(
        self, qwen_split
    ):
        from diffsynth.pipelines.qwen_image import model_fn_qwen_image

        _, _, split = qwen_split
        split.plan_set.max_plans = 1  # refused, not given a plan of its own
        with pytest.raises(graphsplit.SplitError) as caught:
            split.stage1(**qwen_image_batch(seed=2, prompt_tokens=9))
        message = str(caught.value)
        assert "this plan was made for the value [187] read from frozen data here" in message
        assert "got [188]" in message
        assert line_of(model_fn_qwen_image, "prompt_emb_mask.sum(dim=1).tolist()") in message
        assert "fix:    pass a larger max_plans to graphsplit.split" in message
