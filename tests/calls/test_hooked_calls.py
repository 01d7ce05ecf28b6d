"""A frozen call whose module holds hooked submodules is not answered from the cache.

Stage 2 answers a cached call by replacing its module's ``forward``: the module's own hooks run
around the answer, the hooks of the modules inside it do not run at all. Feature distillation
keeps a frozen layer's output through such a hook (FitNets' hint loss, torchdistill's
forward-hook feature stores); cached whole, the step read a stale feature, or none.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphsplit
from graphsplit.calls.verdicts import CallVerdict, Verdict, unhooked
from tests.conformance.unseen_checks import loss_and_grads


class Teacher(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _models():
    torch.manual_seed(0)
    teacher = Teacher().eval().requires_grad_(False)
    student = nn.Linear(6, 8)
    return teacher, student


def _hint_step(teacher, student, feats):
    def step(x, y):
        with torch.no_grad():
            logits = teacher(x)
        hint = F.mse_loss(student(x), feats["hint"])
        return F.cross_entropy(logits, y) * 0 + hint

    return step


def _batch(seed: int, size: int = 4):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, 6, generator=generator), torch.randint(
        0, 3, (size,), generator=generator
    )


def test_a_hook_inside_a_cached_call_keeps_it_in_stage2_and_the_feature_fresh():
    teacher, student, feats = *_models(), {}
    teacher.body[2].register_forward_hook(lambda module, args, out: feats.__setitem__("hint", out))
    step = _hint_step(teacher, student, feats)
    split = graphsplit.split(step, _batch(0))
    params = list(student.parameters())
    first, second = _batch(1), _batch(2)
    boundary = {key: value.detach() for key, value in split.stage1(*first).items()}
    split.stage1(*second)  # what caching runs next: its feature must not reach stage 2
    want = loss_and_grads(lambda: step(*first), params, 0)
    split.stage1(*second)
    got = loss_and_grads(lambda: split.stage2(**boundary), params, 0)
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True))
    # The teacher was opened: its head's call is cached, its body (with the hook) runs.
    verdicts = {(v.path, v.index): v.verdict for v in split.plan.verdicts}
    assert verdicts[("teacher.head", 0)] is Verdict.CACHED
    assert "or holds hooks that must run" in split.report()


def test_hooks_on_the_called_module_itself_run_around_the_answer():
    teacher, student, feats = *_models(), {}
    teacher.register_forward_hook(lambda module, args, out: feats.__setitem__("hint", out[:, :1]))
    step = _hint_step(teacher, student, feats)
    split = graphsplit.split(step, _batch(0))
    verdicts = {(v.path, v.index): v.verdict for v in split.plan.verdicts}
    assert verdicts == {("teacher", 0): Verdict.CACHED}
    boundary = {key: value.detach() for key, value in split.stage1(*_batch(1)).items()}
    split.stage1(*_batch(2))
    params = list(student.parameters())
    want = loss_and_grads(lambda: step(*_batch(1)), params, 0)
    got = loss_and_grads(lambda: split.stage2(**boundary), params, 0)
    assert torch.equal(got[0], want[0])


@pytest.mark.parametrize("hooked", ["pre", "post", "none", "weight_norm"])
def test_unhooked_names_the_hooked_submodules(hooked):
    teacher, _ = _models()
    if hooked == "pre":
        teacher.body[0].register_forward_pre_hook(lambda module, args: None)
    elif hooked == "post":
        teacher.head.register_forward_hook(lambda module, args, out: None)
    elif hooked == "weight_norm":  # torch's reparametrisation hook: pure, left alone
        torch.nn.utils.weight_norm(teacher.body[0])
    [verdict] = unhooked([CallVerdict("teacher", 0, Verdict.CACHED)], {"teacher": teacher})
    expected = {"pre": "hooks on body.0", "post": "hooks on head"}.get(hooked)
    if expected is None:
        assert verdict.verdict is Verdict.CACHED
    else:
        assert verdict.verdict is Verdict.HOOKED and verdict.detail == expected
        assert "a module inside it has forward hooks" in verdict.line()


def test_a_global_module_hook_keeps_calls_of_modules_with_children_in_stage2():
    teacher, _ = _models()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: None)
    try:
        [verdict] = unhooked([CallVerdict("teacher", 0, Verdict.CACHED)], {"teacher": teacher})
        [leaf] = unhooked([CallVerdict("head", 0, Verdict.CACHED)], {"head": teacher.head})
    finally:
        handle.remove()
    assert verdict.verdict is Verdict.HOOKED and "global hook" in verdict.detail
    assert leaf.verdict is Verdict.CACHED
