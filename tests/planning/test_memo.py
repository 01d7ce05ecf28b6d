"""The op memo and the one-mode FLOP count: same answers as the fake mode and FlopCounterMode."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.flop_counter import FlopCounterMode

from graphsplit.planning.meta.analysis_view import META, analysis_view, meta_execution
from graphsplit.planning.meta.op_recorder import recorded


def _metadata(tensor: torch.Tensor) -> tuple:
    return (tuple(tensor.shape), tensor.stride(), tensor.storage_offset(), tensor.dtype)


def _memo():
    from graphsplit.planning.meta import analysis_view as meta

    return meta._fake_mode_and_memo()[1]


def _block(x: torch.Tensor, weight: torch.Tensor) -> list[torch.Tensor]:
    h = F.linear(x, weight)  # t (a view of the weight), mm/addmm, _unsafe_view
    v = h.transpose(0, 1).reshape(-1)  # a view, then a copy
    return [h, v, torch.softmax(h, dim=-1), h.expand(2, *h.shape), h.clone()]


def test_repeated_signatures_give_the_same_metadata_as_the_first_run():
    weight = torch.empty(6, 4, device=META)
    x = torch.empty(3, 4, device=META)
    with analysis_view(nn.Module()), meta_execution():
        memo = _memo()
        first = _block(x, weight)
        hits = memo.hits
        second = _block(x, weight)  # answered by the memo
        assert memo.hits >= hits + len(second)
    for a, b in zip(first, second):
        assert type(a) is FakeTensor and type(b) is FakeTensor
        assert _metadata(a) == _metadata(b)
        assert b is not a


def test_a_memoised_view_shares_its_base_and_moves_with_its_writes():
    with analysis_view(nn.Module()), meta_execution():
        memo = _memo()
        base = torch.empty(4, 6) + 1
        views = [base.view(24)]
        hits = memo.hits
        views.append(base.view(24))
        assert memo.hits == hits + 1  # the second view comes from the memo
        for view in views:
            assert view.untyped_storage()._cdata == base.untyped_storage()._cdata
            assert view._base is base
        before = base._version
        views[1].mul_(2)  # in place, through the memoised view
        assert base._version == before + 1


def test_in_place_ops_are_not_memoised_and_bump_versions_every_time():
    with analysis_view(nn.Module()), meta_execution():
        h = torch.empty(2, 3) + 0
        versions = [h._version]
        for _ in range(3):
            out = h.mul_(2)
            assert out is h
            versions.append(h._version)
    assert versions == sorted(set(versions))  # strictly increasing


def test_random_ops_are_recorded_every_time():
    def draws() -> torch.Tensor:
        x = torch.empty(2, 3) + 0
        return F.dropout(x, 0.5, training=True) + torch.randn_like(x)

    with analysis_view(nn.Module()), meta_execution():
        _, first = recorded(draws)
        _, second = recorded(draws)
    assert first == second
    assert sum(op.draws_random for op in first.ops) >= 2


def test_flops_match_flop_counter_mode():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.GELU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 5))
    x = torch.empty(2, 3, 8, 8, device=META)

    def step() -> torch.Tensor:
        h = model(x)
        q = h.view(2, 1, 1, 5)
        return F.scaled_dot_product_attention(q, q, q) @ torch.empty(5, 7)

    with analysis_view(model), meta_execution():
        _, record = recorded(step)
        counter = FlopCounterMode(display=False)
        with counter:
            step()
    assert record.flops == counter.get_total_flops() > 0


def test_each_analysis_has_its_own_memo():
    from graphsplit.planning.meta import analysis_view as meta

    with analysis_view(nn.Module()):
        first = meta._fake_mode_and_memo()
        with meta_execution():
            torch.empty(2, 3) + 1
        assert first[1].results
    with analysis_view(nn.Module()):
        second = meta._fake_mode_and_memo()
        assert second[1] is not first[1] and not second[1].results


def _fake_description(tensor: torch.Tensor) -> tuple:
    attributes = {key: value for key, value in vars(tensor).items() if key != "fake_mode"}
    return (
        type(tensor),
        _metadata(tensor),
        tensor.device,
        tensor.requires_grad,
        tensor.is_leaf,
        tensor.untyped_storage().nbytes(),
        torch._C._dispatch_keys(tensor),
        sorted(attributes.items(), key=lambda item: item[0]),
    )


def test_quick_construction_makes_the_constructors_fake_tensor():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from graphsplit.planning.meta.op_memo import OpMemo

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    memo = OpMemo(mode)
    assert memo._attributes is not None  # the probe agreed: the quick path is in use
    with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
        quick = memo.new_fake(torch.empty_strided((4, 5), (1, 4), device=META), META)
        made = FakeTensor(mode, torch.empty_strided((4, 5), (1, 4), device=META), META)
    assert _fake_description(quick) == _fake_description(made)
    assert quick.fake_mode is made.fake_mode is mode


def test_fake_twins_equal_the_converters_and_share_storages_as_it_does():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from graphsplit.planning.meta.op_memo import OpMemo

    with META:
        tensors = [
            nn.Parameter(torch.empty(6, 4)),  # trainable
            nn.Parameter(torch.empty(6, 4), requires_grad=False),  # frozen
            torch.empty(3, 2, 5).transpose(0, 2),  # a buffer with its own strides
        ]
        base = nn.Parameter(torch.empty(8, 3), requires_grad=False)
    # A tensor sharing base's storage (tied weights held as two views).
    sharing = base.detach()[2:]
    reference = FakeTensorMode(allow_non_fake_inputs=True)
    converter = reference.fake_tensor_converter
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    memo = OpMemo(mode)
    for tensor in tensors:
        twin = memo.fake_twin(tensor)
        assert _fake_description(twin) == _fake_description(
            converter.from_real_tensor(reference, tensor)
        )
        assert memo.fake_twin(tensor) is twin  # recorded in the converter's memo
        assert mode.fake_tensor_converter.from_real_tensor(mode, tensor) is twin
    twin = memo.fake_twin(base)
    shared = memo.fake_twin(sharing)  # not the quick case: the storage is known already
    assert shared.untyped_storage()._cdata == twin.untyped_storage()._cdata
    assert _metadata(shared) == _metadata(sharing)
