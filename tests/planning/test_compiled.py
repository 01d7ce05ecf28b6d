"""Steps that call ``torch.compile``'d modules, planned through the modules they wrap.

Training scripts compile before the loop: diffusers' scripts ``unet = torch.compile(unet)``,
a Trainer with ``torch_compile=True`` (accelerate's ``prepare`` calls ``torch.compile(model,
backend=...)``), a frozen ``text_encoder = torch.compile(text_encoder)`` or ``vae.encoder =
torch.compile(vae.encoder)``. The step then calls an ``OptimizedModule`` whose ``_orig_mod`` is
the user's module. graphsplit plans the original's code and generated stage code calls the
user's compiled object where the step called it whole; names stay torch's own
(``unet._orig_mod.*``, what ``named_parameters()`` / ``state_dict()`` of the compiled object
give), so stage 2's state dict is the model's and the user's optimizer and checkpoint code
(``unwrap_model``: ``_orig_mod``) work unchanged.

The compiles use ``backend="eager"`` (dynamo's graph capture, no codegen): exactness is
checked bit for bit against the unsplit compiled step. The one inductor test is marked slow
(it compiles C++) and is bit for bit too: the boundary does not cut through a compiled graph
(stage 1 runs the same compiled text encoder on the same inputs as the unsplit step).
"""

from __future__ import annotations

import functools
import importlib.util
import shutil

import pytest
import torch
import torch.nn.functional as F
from diffusers.utils.torch_utils import is_compiled_module
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from torch._dynamo.eval_frame import OptimizedModule
from torch.utils.data import DataLoader

import graphsplit
from graphsplit import SplitError, TraceError
from tests import test_api_loop_body as script
from tests.helpers import line_of
from tests.integrations.kd import padded_samples, tiny_llama
from tests.zoo import CaptionedImages, build_partial_encoder_lora_step, build_sd_lora_step


def unwrap_model(model):  # diffusers' training scripts' own helper
    return model._orig_mod if is_compiled_module(model) else model


@pytest.fixture
def compiled_script(monkeypatch):
    """The diffusers loop body's globals, with the models the test compiles compiled."""

    def install(*compiled: str, backend: str = "eager"):
        parts = build_sd_lora_step(seed=0)
        models = {"vae": parts.vae, "text_encoder": parts.text_encoder, "unet": parts.unet}
        for name in compiled:
            models[name] = torch.compile(models[name], backend=backend)
        for name, value in {**models, "noise_scheduler": parts.scheduler}.items():
            monkeypatch.setattr(script, name, value)
        for option in ("noise_offset", "prediction_type", "snr_gamma"):
            monkeypatch.setattr(script.args, option, None if option != "noise_offset" else 0)
        return models

    return install


def _batches(count: int) -> list[dict]:
    return list(DataLoader(CaptionedImages(length=2 * count), batch_size=2))


def _same_loss(step, stage2, boundary, batch) -> None:
    torch.manual_seed(3)
    expected = step(batch)
    torch.manual_seed(3)
    assert torch.equal(stage2(**boundary), expected)


def test_a_compiled_lora_unet_is_called_compiled_by_stage2_under_its_own_names(
    compiled_script, tmp_path
):
    models = compiled_script("unet")
    unet = models["unet"]
    batch = _batches(1)[0]
    split = graphsplit.split(script.training_step, (batch,), path="trace")
    comparisons = graphsplit.verify(script.training_step, split, (batch,))
    assert len(comparisons) == 1 + sum(p.requires_grad for p in unet.parameters())
    assert all(c.ok for c in comparisons)

    # Stage 2 calls the user's compiled object, the whole UNet as one call.
    assert split.stage2.unet is unet and isinstance(unet, OptimizedModule)
    assert "self.unet(" in split.stage2.code and "_orig_mod(" not in split.stage2.code
    assert not any("torch.compile'd" in note for note in split.notes)  # compiled, as one call
    # torch's names: the compiled object's own, under the name the code calls it by.
    assert split.trainable == {
        f"unet.{name}" for name, p in unet.named_parameters() if p.requires_grad
    }
    assert all(name.startswith("unet._orig_mod.") for name in split.trainable)
    assert set(split.stage2.state_dict()) == {f"unet.{key}" for key in unet.state_dict()}
    assert list(split.boundary) == ["vae_encode_latent_dist_parameters", "text_encoder_0"]
    _same_loss(script.training_step, split.stage2, split.stage1(**batch), batch)

    # The saved stage 2 runs on its own and holds the same compiled object.
    spec = importlib.util.spec_from_file_location("stage2", split.save_code(tmp_path) / "stage2.py")
    saved = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(saved)
    standalone = saved.Stage2(split.stage2)
    assert standalone.unet is unet
    _same_loss(script.training_step, standalone, split.stage1(**batch), batch)


def test_the_scripts_optimizer_and_checkpoint_code_see_stage2_train_the_compiled_unet(
    compiled_script,
):
    unet = compiled_script("unet")["unet"]
    batches = _batches(2)
    split = graphsplit.split(script.training_step, (batches[0],), path="trace")
    boundaries = [split.stage1(**batch) for batch in batches]
    initial = {k: v.clone() for k, v in get_peft_model_state_dict(unwrap_model(unet)).items()}

    def train(steps) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            for name, param in unwrap_model(unet).named_parameters():
                if param.requires_grad:
                    param.copy_(initial[name.replace(".default", "")])
        optimizer = torch.optim.AdamW(filter(lambda p: p.requires_grad, unet.parameters()))
        for seed, step in enumerate(steps):
            torch.manual_seed(seed)
            step().backward()
            optimizer.step()
            optimizer.zero_grad()
        # The script's checkpoint: peft's state dict of the unwrapped (uncompiled) UNet.
        return {k: v.clone() for k, v in get_peft_model_state_dict(unwrap_model(unet)).items()}

    full = train([lambda b=b: script.training_step(b) for b in batches])
    staged = train([lambda b=b: split.stage2(**b) for b in boundaries])
    assert full.keys() == staged.keys() == initial.keys()
    assert any(not torch.equal(full[k], initial[k]) for k in full), "nothing trained"
    for key in full:
        assert torch.equal(full[key], staged[key]), key


def test_a_compiled_frozen_text_encoder_runs_compiled_in_stage1_and_caches(
    compiled_script, tmp_path
):
    models = compiled_script("text_encoder")
    script.vae.encoder = torch.compile(script.vae.encoder, backend="eager")  # a compiled part
    batches = _batches(2)
    split = graphsplit.split(script.training_step, (batches[0],), path="trace")
    assert all(c.ok for c in graphsplit.verify(script.training_step, split, (batches[0],)))

    assert list(split.boundary) == ["vae_encode_latent_dist_parameters", "text_encoder_0"]
    assert split.stage1.text_encoder is models["text_encoder"]
    assert "self.text_encoder(" in split.stage1.code
    assert isinstance(split.stage1.vae.encoder, OptimizedModule)  # vae.encode runs it compiled
    assert not hasattr(split.stage2, "text_encoder") and not hasattr(split.stage2, "vae")
    assert split.stage2.unet is models["unet"]

    graphsplit.cache(split, batches, tmp_path / "cache", progress=False)
    data = graphsplit.CachedDataset(tmp_path / "cache", split)
    cached = list(DataLoader(data, batch_size=2, collate_fn=graphsplit.collate))
    assert len(cached) == 2
    for batch, boundary in zip(batches, cached):
        _same_loss(script.training_step, split.stage2, boundary, batch)


class Trainerish:
    """A Trainer subclass's ``compute_loss`` (tests/integrations/kd.py's distillation), its
    model compiled as accelerate's ``prepare`` compiles it (``torch.compile(model,
    backend=...)``) for ``TrainingArguments(torch_compile=True)``."""

    def __init__(self, model, teacher) -> None:
        self.model = torch.compile(model, backend="eager")
        self.teacher = teacher.eval().requires_grad_(False)

    def compute_loss(self, inputs):
        with torch.no_grad():
            teacher_logits = self.teacher(**inputs).logits
        outputs = self.model(**inputs)
        distill = F.kl_div(
            F.log_softmax(outputs.logits, dim=-1),
            F.log_softmax(teacher_logits, dim=-1),
            log_target=True,
            reduction="batchmean",
        )
        return 0.5 * outputs.loss + 0.5 * distill


def _lora_student():
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    student = get_peft_model(tiny_llama(0, 16), config)
    with torch.no_grad():  # LoRA B starts at zero; a nonzero one makes the gradients honest
        for name, param in student.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.02)
    return student.train()


def test_a_trainers_compiled_lora_llama_trains_in_stage2_beside_a_cached_teacher():
    trainer = Trainerish(_lora_student(), tiny_llama(1, 16))
    inputs = torch.utils.data.default_collate(padded_samples(4))
    split = graphsplit.split(trainer.compute_loss, (inputs,), path="trace")
    assert all(c.ok for c in graphsplit.verify(trainer.compute_loss, split, (inputs,)))

    assert split.trainable == {
        f"model.{name}" for name, p in trainer.model.named_parameters() if p.requires_grad
    }
    assert all(".lora_" in name and name.startswith("model._orig_mod.") for name in split.trainable)
    # The teacher's log-probs are cached; stage 2 neither holds nor runs the teacher.
    assert "log_softmax_1" in split.boundary and not hasattr(split.stage2, "teacher")
    assert set(split.stage2.state_dict()) <= {f"model.{k}" for k in trainer.model.state_dict()}
    # The compiled LoRA model mixes frozen and trainable weights and its inputs are cacheable:
    # the trace went into it (its frozen embeddings are cached), so stage 2 holds its code as
    # operations, run uncompiled: compiling stage 2 compiles it again (test below).
    assert any(note.startswith("traced into model._orig_mod,") for note in split.notes)
    assert "self.model(" not in split.stage2.code
    assert (
        "stage 2 runs the code of the torch.compile'd model uncompiled: the trace went into it "
        "to cache its frozen part; to compile it again, compile stage 2 "
        "(stage2 = torch.compile(split.stage2))"
    ) in split.notes


def test_compiling_stage2_keeps_it_exact():
    """The fix the refusals name: split the code as written, compile stage 2."""
    step = build_partial_encoder_lora_step(seed=0)
    input_ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    target = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    split = graphsplit.split(step, (input_ids, target), path="trace")
    stage2 = torch.compile(split.stage2, backend="eager")
    boundary = split.stage1(input_ids, target)
    trained = [p for p in step.parameters() if p.requires_grad]

    expected = step(input_ids, target)
    expected_grads = torch.autograd.grad(expected, trained)
    loss = stage2(**boundary)
    assert torch.equal(loss, expected)
    for got, want in zip(torch.autograd.grad(loss, trained), expected_grads, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("partial", [False, True], ids=["compiled", "partial-of-compiled"])
def test_a_compiled_step_function_is_refused_naming_its_definition_and_the_fix(partial):
    batch = _batches(1)[0]
    step = torch.compile(script.training_step, backend="eager")
    with pytest.raises(SplitError) as caught:
        graphsplit.split(functools.partial(step) if partial else step, (batch,))
    message = str(caught.value)
    assert "torch.compile'd function training_step" in message
    assert line_of(script.training_step, "def training_step(batch):") in message
    assert "graphsplit.split(training_step, ...)" in message
    assert "stage2 = torch.compile(split.stage2)" in message
    assert "device-agnostic" not in message


def test_a_compiled_step_module_is_refused_naming_the_fix():
    parts = build_sd_lora_step(seed=0)
    batch = _batches(1)[0]
    with pytest.raises(SplitError) as caught:
        graphsplit.split(torch.compile(parts), (batch["pixel_values"], batch["input_ids"]))
    message = str(caught.value)
    assert "torch.compile'd SDLoRAStep" in message
    assert "model._orig_mod" in message and "torch.compile(split.stage2)" in message


def test_a_compiled_function_inside_the_step_is_refused_at_its_line_and_calls_run_it(
    compiled_script,
):
    models = compiled_script()
    vae, text_encoder, unet = models["vae"], models["text_encoder"], models["unet"]
    mse = torch.compile(
        lambda pred, target: F.mse_loss(pred.float(), target.float()), backend="eager"
    )

    def training_step(batch):
        latents = vae.encode(batch["pixel_values"]).latent_dist.mean
        states = text_encoder(batch["input_ids"], return_dict=False)[0]
        timesteps = torch.zeros(latents.shape[0], dtype=torch.long)
        pred = unet(latents, timesteps, states, return_dict=False)[0]
        return mse(pred, latents)  # the compiled function

    batch = _batches(1)[0]
    with pytest.raises(TraceError) as caught:
        graphsplit.split(training_step, (batch,), path="trace")
    message = str(caught.value)
    assert "torch.compile'd function" in message
    assert line_of(training_step, "return mse(pred, latents)") in message
    assert "torch.compile(split.stage2)" in message and "path='calls'" in message
    assert "device-agnostic" not in message

    split = graphsplit.split(training_step, (batch,))  # "auto": the module-level path
    assert split.path == "calls"
    assert all(c.ok for c in graphsplit.verify(training_step, split, (batch,)))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("c++") is None, reason="inductor on CPU compiles C++")
def test_an_inductor_compiled_frozen_text_encoder_stays_bit_for_bit(compiled_script):
    """Inductor's default backend: stage 1 runs the same compiled text encoder on the same
    input ids as the unsplit step, so the cached states are the unsplit step's, bit for bit."""
    compiled_script("text_encoder", backend="inductor")
    batch = _batches(1)[0]
    split = graphsplit.split(script.training_step, (batch,), path="trace")
    assert "self.text_encoder(" in split.stage1.code
    assert all(c.ok for c in graphsplit.verify(script.training_step, split, (batch,)))


def test_hooks_on_the_compiled_wrapper_are_refused_naming_the_fix():
    encoder = torch.nn.Linear(4, 4).requires_grad_(False)
    head = torch.nn.Linear(4, 1)
    compiled = torch.compile(encoder, backend="eager")
    compiled.register_forward_hook(lambda module, args, output: output * 2)

    def training_step(x):
        return head(compiled(x)).mean()

    with pytest.raises(TraceError) as caught:
        graphsplit.split(training_step, (torch.randn(2, 4),), path="trace")
    message = str(caught.value)
    assert "torch.compile'd Linear that has hooks registered on the compiled wrapper" in message
    assert line_of(training_step, "return head(compiled(x)).mean()") in message
    assert "compiled._orig_mod.register_forward_hook" in message


def test_hooks_on_the_compiled_modules_original_are_planned_and_kept():
    encoder = torch.nn.Linear(4, 4).requires_grad_(False)
    head = torch.nn.Linear(4, 1)
    compiled = torch.compile(encoder, backend="eager")
    encoder.register_forward_hook(lambda module, args, output: output * 2)

    def training_step(x):
        return head(compiled(x)).mean()

    x = torch.randn(2, 4)
    split = graphsplit.split(training_step, (x,), path="trace")
    assert all(c.ok for c in graphsplit.verify(training_step, split, (x,)))
    assert split.stage1.compiled is compiled
    assert torch.equal(split.stage1(x)["compiled"], encoder(x))  # the hook's doubling is cached


def test_a_frozen_encoder_compiled_in_place_is_planned_as_its_code_and_runs_compiled(
    compiled_script,
):
    """``module.compile()`` (what diffusers' ``compile_repeated_blocks`` calls per block)
    keeps the module itself and compiles its call: the stage calls the module, compiled."""
    models = compiled_script()
    models["text_encoder"].compile(backend="eager")
    batch = _batches(1)[0]
    split = graphsplit.split(script.training_step, (batch,), path="trace")
    assert all(c.ok for c in graphsplit.verify(script.training_step, split, (batch,)))

    assert list(split.boundary) == ["vae_encode_latent_dist_parameters", "text_encoder_0"]
    assert split.stage1.text_encoder is models["text_encoder"]
    assert models["text_encoder"]._compiled_call_impl is not None  # given back after planning
    _same_loss(script.training_step, split.stage2, split.stage1(**batch), batch)


@pytest.fixture
def accelerator_state():
    from accelerate.state import AcceleratorState

    # Accelerate's state is process-wide: an Accelerator made by an earlier test would keep its
    # own (no dynamo backend), and the one the test makes must not outlive it.
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


@pytest.mark.usefixtures("accelerator_state")
def test_a_model_accelerate_prepared_with_a_dynamo_backend_splits_beside_a_teacher():
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, dynamo_backend="eager")
    student = accelerator.prepare(_lora_student())
    assert isinstance(student, OptimizedModule)
    teacher = tiny_llama(1, 16).eval().requires_grad_(False)

    def training_step(batch):
        with torch.no_grad():
            teacher_logits = teacher(**batch).logits
        outputs = student(**batch)
        return outputs.loss + F.kl_div(
            F.log_softmax(outputs.logits, dim=-1),
            F.log_softmax(teacher_logits, dim=-1),
            log_target=True,
            reduction="batchmean",
        )

    inputs = torch.utils.data.default_collate(padded_samples(4))
    split = graphsplit.split(training_step, (inputs,), path="trace")
    assert all(c.ok for c in graphsplit.verify(training_step, split, (inputs,)))
    assert all(name.startswith("student._orig_mod.") for name in split.trainable)
    assert not hasattr(split.stage2, "teacher")
