"""The meta analysis: tensor checks hold, and the model comes back exactly as it was."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphsplit.planning.meta.analysis_view import analysis_view, meta_execution
from tests.helpers import frozen, split_and_verify


def test_a_torch_tensor_check_holds_during_the_analysis():
    # transformers' torch_compilable_check outside dynamo: cond._is_all_true().item()
    with meta_execution():
        cond = torch.ones(3, device="meta") > 0
        torch._check_tensor_all_with(ValueError, cond, lambda: "never raised")
        assert cond._is_all_true().item() is True


class CheckedEncoder(nn.Linear):
    """A frozen encoder that asserts on its input as LLaVA asserts its image-token count."""

    def forward(self, x):
        torch._check_tensor_all_with(ValueError, x.isfinite(), lambda: "x must be finite")
        return super().forward(x)


class ChecksItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = frozen(CheckedEncoder(4, 4))
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.encoder(x)).mean()


def test_a_step_with_a_tensor_check_splits_and_the_check_still_runs_for_real():
    split = split_and_verify(ChecksItsInput(), (torch.randn(2, 4),))
    assert {name for name, _ in split.stage2.named_modules() if name} == {"head"}
    bad = torch.full((2, 4), float("nan"))
    try:
        ChecksItsInput()(bad)
    except ValueError as exc:
        assert "finite" in str(exc)
    else:
        raise AssertionError("the eager check must still raise on real data")


class HooksOnFirstCall(nn.Module):
    """Installs a forward hook on first call and marks itself done, as transformers'
    ``maybe_install_capturing_hooks`` does; a second install would record everything twice."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = frozen(nn.Linear(4, 4))
        self.head = nn.Linear(4, 1)
        self.captured: list[torch.Tensor] = []

    def forward(self, x):
        if not getattr(self, "_hooked", False):
            self.layer.register_forward_hook(lambda m, i, o: self.captured.append(o))
            self._hooked = True
        self.captured.clear()
        h = self.layer(x)
        assert len(self.captured) == 1, "hook installed twice"
        return F.mse_loss(self.head(self.captured[0]), h[:, :1])


def test_hooks_installed_during_the_analysis_are_removed_with_the_marker():
    model = HooksOnFirstCall()
    with analysis_view(model), meta_execution():
        model(torch.randn(2, 4, device="meta"))
    assert not model.layer._forward_hooks and not hasattr(model, "_hooked")
    model(torch.randn(2, 4))  # installs once, for real
    assert len(model.layer._forward_hooks) == 1


def test_hooks_present_before_the_analysis_stay():
    model = HooksOnFirstCall()
    model(torch.randn(2, 4))
    hooks = dict(model.layer._forward_hooks)
    with analysis_view(model), meta_execution():
        model(torch.randn(2, 4, device="meta"))
    assert dict(model.layer._forward_hooks) == hooks and model._hooked
