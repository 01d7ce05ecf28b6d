"""state.py's attribute restore (shared with meta.analysis_view) and the builtins that
meta execution gets back inside a trace."""

from __future__ import annotations

import builtins
from types import SimpleNamespace

import torch

from graphsplit.planning.meta.analysis_view import meta_execution
from graphsplit.planning.patching.module_state import (
    is_helper_object,
    module_state_restored,
    restore_attributes,
)
from graphsplit.planning.patching.patcher import Patcher
from graphsplit.planning.patching.traced_builtins import replace_python_builtins


class _Scheduler:
    def __init__(self) -> None:
        self.alphas = torch.ones(3)


def test_restore_attributes_undoes_additions_and_rebinding_by_identity():
    obj = SimpleNamespace(kept=[1], rebound=torch.zeros(2))
    saved = dict(vars(obj))
    obj.rebound = torch.zeros(2)  # equal values, another object: must be put back
    obj.added = "proxy"
    restore_attributes(obj, saved)
    assert vars(obj) == {"kept": saved["kept"], "rebound": saved["rebound"]}
    assert obj.rebound is saved["rebound"] and obj.kept is saved["kept"]


def test_restore_attributes_puts_back_a_deleted_attribute():
    obj = SimpleNamespace(first=1, second=2)
    saved = dict(vars(obj))
    del obj.first
    restore_attributes(obj, saved)
    assert vars(obj) == {"first": 1, "second": 2}


def test_helper_objects_are_plain_objects_with_attributes():
    assert is_helper_object(_Scheduler())
    for value in (1, 2.0, True, "s", None, {}, [], (), torch.zeros(1), torch.nn.Linear(1, 1)):
        assert not is_helper_object(value)


def test_module_state_restored_undoes_helper_and_hook_state():
    module = torch.nn.Linear(2, 2)
    module.scheduler = _Scheduler()
    alphas = module.scheduler.alphas
    with module_state_restored(module):
        module.scheduler.alphas = torch.zeros(3)
        module.register_forward_hook(lambda *args: None)
        module.cache = {"key": 1}
    assert module.scheduler.alphas is alphas
    assert not module._forward_hooks
    assert "cache" not in vars(module)


def _builtins() -> tuple[object, ...]:
    return (builtins.isinstance, builtins.len, builtins.list, builtins.callable)


def test_meta_execution_runs_with_python_builtins_inside_a_trace():
    with meta_execution():  # torch's lazy imports first, with Python's own builtins
        torch.ones(2) + 1
    originals = _builtins()
    with Patcher() as patcher:
        replace_python_builtins(patcher, (SimpleNamespace,))
        replaced = _builtins()
        with meta_execution():
            inside = _builtins()
            device = torch.ones(2).device.type
        after = _builtins()
    assert all(new is not old for new, old in zip(replaced, originals, strict=True))
    assert inside == originals and device == "meta"
    assert after == replaced
    assert _builtins() == originals
    with meta_execution():  # outside a trace: nothing to put back
        assert _builtins() == originals
