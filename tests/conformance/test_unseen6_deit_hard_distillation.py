"""Conformance: DeiT's hard-label distillation (facebookresearch/deit), as ``engine.py`` runs it.

The student is transformers' ``DeiTForImageClassificationWithTeacher`` (a [CLS] head and a
distillation-token head) in train mode; the teacher a frozen ``ResNetForImageClassification``
in eval mode (``teacher_model.eval()`` in ``main.py``; no parameter of it is in the optimizer,
here ``requires_grad_(False)``). ``main.py`` with ``--distillation-type hard
--distillation-alpha 0.5 --smoothing 0`` and no mixup builds
``DistillationLoss(torch.nn.CrossEntropyLoss(), teacher_model, 'hard', 0.5, tau)``, and
``train_one_epoch`` runs, per batch of the loader's ``(samples, targets)``::

    outputs = model(samples)
    loss = criterion(samples, outputs, targets)

``DistillationLoss.forward`` is ``losses.py``'s (the teacher called on the raw ``inputs`` under
``torch.no_grad()``, ``F.cross_entropy(outputs_kd, teacher_outputs.argmax(dim=1))``,
``base_loss * (1 - alpha) + distillation_loss * alpha``), with one change: the teacher is a
transformers model, so its logits are ``.logits`` (DeiT's timm teacher returns a tensor). The
student's two heads are passed as the ``(outputs, outputs_kd)`` tuple DeiT's own
``DistilledVisionTransformer`` returns in training.

What must hold: the step splits exactly (loss and every student gradient bit for bit, on the
example and on a batch of another size), the teacher's work is cached (its logits or their
argmax in the boundary, its weights not held by stage 2), and a cache written through the
disk trains stage 2 exactly.

The default path traces into the criterion (the script's own module holding the frozen
teacher, fed the raw ``samples`` beside the student's ``outputs``) and caches the teacher's
argmax; it used to keep the criterion whole and cache nothing (the module-level path, which
opens it too, cached the teacher's logits: still tested).

A control (not DeiT's code): the same loss with the teacher called in the step body instead of
inside the criterion module.

Tiny configs: DeiT 32 wide, 2 layers, 16 px in 4 px patches, 10 classes; ResNet basic blocks
(8, 16) channels.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import graphsplit
from tests.helpers import assert_stage1_holds_no_trainable

transformers = pytest.importorskip("transformers")

from tests.conformance.unseen2_data_checks import assert_same_step  # noqa: E402

CLASSES = 10
IMAGE = 16


class DistillationLoss(torch.nn.Module):
    """DeiT's ``losses.py``, verbatim but for the teacher's ``.logits``."""

    def __init__(
        self,
        base_criterion: torch.nn.Module,
        teacher_model: torch.nn.Module,
        distillation_type: str,
        alpha: float,
        tau: float,
    ):
        super().__init__()
        self.base_criterion = base_criterion
        self.teacher_model = teacher_model
        assert distillation_type in ["none", "soft", "hard"]
        self.distillation_type = distillation_type
        self.alpha = alpha
        self.tau = tau

    def forward(self, inputs, outputs, labels):
        """
        Args:
            inputs: The original inputs that are feed to the teacher model
            outputs: the outputs of the model to be trained. It is expected to be
                either a Tensor, or a Tuple[Tensor, Tensor], with the original output
                in the first position and the distillation predictions as the second output
            labels: the labels for the base criterion
        """
        outputs_kd = None
        if not isinstance(outputs, torch.Tensor):
            # assume that the model outputs a tuple of [outputs, outputs_kd]
            outputs, outputs_kd = outputs
        base_loss = self.base_criterion(outputs, labels)
        if self.distillation_type == "none":
            return base_loss

        if outputs_kd is None:
            raise ValueError(
                "When knowledge distillation is enabled, the model is "
                "expected to return a Tuple[Tensor, Tensor] with the output of the "
                "class_token and the dist_token"
            )
        # don't backprop throught the teacher
        with torch.no_grad():
            teacher_outputs = self.teacher_model(inputs).logits

        if self.distillation_type == "soft":
            T = self.tau
            # taken from https://github.com/peterliht/knowledge-distillation-pytorch/blob/master/model/net.py#L100
            # with slight modifications
            distillation_loss = (
                F.kl_div(
                    F.log_softmax(outputs_kd / T, dim=1),
                    # We provide the teacher's targets in log probability because we use
                    # log_target=True (as recommended in pytorch) but it is possible to give
                    # just the probabilities and set log_target=False.
                    F.log_softmax(teacher_outputs / T, dim=1),
                    reduction="sum",
                    log_target=True,
                )
                * (T * T)
                / outputs_kd.numel()
            )
            # We divide by outputs_kd.numel() to have the legacy PyTorch behavior.
            # But we also experiments output_kd.size(0)
            # see issue 61(https://github.com/facebookresearch/deit/issues/61) for more details
        elif self.distillation_type == "hard":
            distillation_loss = F.cross_entropy(outputs_kd, teacher_outputs.argmax(dim=1))

        loss = base_loss * (1 - self.alpha) + distillation_loss * self.alpha
        return loss


def _models():
    torch.manual_seed(0)
    teacher_model = transformers.ResNetForImageClassification(
        transformers.ResNetConfig(
            embedding_size=8,
            hidden_sizes=[8, 16],
            depths=[1, 1],
            layer_type="basic",
            num_labels=CLASSES,
        )
    )
    teacher_model.eval()
    teacher_model.requires_grad_(False)
    model = transformers.DeiTForImageClassificationWithTeacher(
        transformers.DeiTConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=IMAGE,
            patch_size=4,
            num_labels=CLASSES,
        )
    )
    model.train()
    return teacher_model, model


def build(form: str):
    teacher_model, model = _models()
    criterion = DistillationLoss(torch.nn.CrossEntropyLoss(), teacher_model, "hard", 0.5, 3.0)

    if form == "deit":

        def training_step(samples, targets):
            outputs = model(samples)
            # DeiT's DistilledVisionTransformer returns (x, x_dist) in training
            outputs = (outputs.cls_logits, outputs.distillation_logits)
            loss = criterion(samples, outputs, targets)
            return loss

    else:  # control: the teacher called in the step body, not inside a module

        def training_step(samples, targets):
            outputs = model(samples)
            with torch.no_grad():
                teacher_outputs = teacher_model(samples).logits
            base_loss = F.cross_entropy(outputs.cls_logits, targets)
            distillation_loss = F.cross_entropy(
                outputs.distillation_logits, teacher_outputs.argmax(dim=1)
            )
            return base_loss * 0.5 + distillation_loss * 0.5

    params = [p for p in model.parameters() if p.requires_grad]
    return teacher_model, model, training_step, params


def _batch(size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The loader's ``(samples, targets)``: normalised images and class indices."""
    generator = torch.Generator().manual_seed(seed)
    samples = torch.randn(size, 3, IMAGE, IMAGE, generator=generator)
    targets = torch.randint(0, CLASSES, (size,), generator=generator)
    return samples, targets


_BUILT: dict[str, tuple] = {}


def _built(form: str):
    if form not in _BUILT:
        teacher_model, model, step, params = build(form)
        split = graphsplit.split(step, _batch(2))
        _BUILT[form] = (teacher_model, model, step, params, split)
    return _BUILT[form]


FORMS = ["deit", "control"]


@pytest.mark.parametrize("form", FORMS)
def test_deit_step_verifies_on_the_example_and_another_size(form):
    *_, step, _params, split = _built(form)
    assert_stage1_holds_no_trainable(split)
    for seed, batch in enumerate([_batch(2), _batch(3, seed=1)]):
        checks = graphsplit.verify(step, split, batch, seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]


def _assert_caches_the_teacher(split, model):
    held = {name for name, _ in split.stage2.named_parameters()}
    assert not any("teacher_model" in name for name in held), sorted(held)
    trainable = {n for n, p in split.stage2.named_parameters() if p.requires_grad}
    assert {name.split(".", 1)[1] for name in trainable} == {
        n for n, p in model.named_parameters() if p.requires_grad
    }
    # The student reads the images and the labels; the teacher's hard label (its logits'
    # argmax, 8 B a sample) is cached with them.
    per_sample = {key: (spec.shape[1:], spec.dtype) for key, spec in split.boundary.items()}
    assert per_sample.pop("samples") == ((3, IMAGE, IMAGE), torch.float32)
    assert per_sample.pop("targets") == ((), torch.int64)
    assert list(per_sample.values()) == [((), torch.int64)], per_sample


def test_deit_caches_the_teacher_called_inside_the_criterion():
    """The module-level path opens ``criterion`` (a module holding only the frozen teacher,
    every call of it fed the student's outputs) and caches the teacher's call inside it: its
    logits cross, the teacher's weights are not held."""
    _teacher, model, step, _params, _split = _built("deit")
    split = graphsplit.split(step, _batch(2), path="calls")
    for seed, batch in enumerate([_batch(2), _batch(3, seed=1)]):
        checks = graphsplit.verify(step, split, batch, seed=seed)
        assert checks and all(c.ok for c in checks), [c for c in checks if not c.ok]
    held = {name for name, _ in split.stage2.named_parameters()}
    assert not any("teacher_model" in name for name in held), sorted(held)
    trainable = {n for n, p in split.stage2.named_parameters() if p.requires_grad}
    assert {name.split(".", 1)[1] for name in trainable} == {
        n for n, p in model.named_parameters() if p.requires_grad
    }
    per_sample = {key: (spec.shape[1:], spec.dtype) for key, spec in split.boundary.items()}
    assert per_sample.pop("samples") == ((3, IMAGE, IMAGE), torch.float32)
    assert per_sample.pop("targets") == ((), torch.int64)
    assert list(per_sample) == ["criterion_teacher_model__0__logits"]
    assert "opened: criterion: every call takes an input that depends on a trainable" in (
        split.report()
    )


def test_control_caches_the_teacher_called_in_the_step_body():
    _teacher, model, _step, _params, split = _built("control")
    assert split.path == "trace"
    _assert_caches_the_teacher(split, model)


@pytest.mark.parametrize("form", FORMS)
def test_deit_cache_round_trip(form, tmp_path):
    """The loader's batches as DeiT's ``DataLoader`` yields them (``[samples, targets]``
    lists), cached as they are, every sample once and in order, each batch trained exactly."""
    *_, step, params, split = _built(form)
    loader = [list(_batch(2, seed=2)), list(_batch(3, seed=3)), list(_batch(1, seed=4))]
    info = graphsplit.cache(split, loader, tmp_path / "cache", progress=False)
    cached = graphsplit.CachedDataset(tmp_path / "cache", split)
    assert info.num_samples == len(cached) == 6
    assert [cached[row]["key"] for row in range(len(cached))] == [str(i) for i in range(6)]
    row = 0
    for seed, (samples, targets) in enumerate(loader):
        rows = [cached[row + offset] for offset in range(len(samples))]
        row += len(samples)
        assert_same_step(
            lambda samples=samples, targets=targets: step(samples, targets),
            lambda rows=rows: split.stage2(**graphsplit.collate(rows)),
            params,
            seed,
        )


def test_auto_traces_into_the_criterion_and_caches_the_teacher():
    """The criterion is the script's own module holding the frozen teacher, fed the batch's
    ``samples`` beside the student's ``outputs``: the trace goes into it (it used to keep it
    whole, tainted by ``outputs``, and cache nothing), and the teacher's call on ``samples``
    alone is cached."""
    _teacher, model, _step, _params, split = _built("deit")
    assert split.path == "trace"
    assert any(note.startswith("traced into criterion") for note in split.notes), split.notes
    _assert_caches_the_teacher(split, model)
