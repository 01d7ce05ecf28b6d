"""Planning defers the collector's passes and puts the user's thresholds back, whatever happens."""

from __future__ import annotations

import gc

import pytest
import torch

import graphsplit
from graphsplit.planning import gc_deferral
from graphsplit.planning.gc_deferral import PLANNING_THRESHOLDS, deferred_collections


@pytest.fixture
def thresholds():
    saved = gc.get_threshold()
    gc.set_threshold(500, 7, 9)
    yield
    gc.set_threshold(*saved)


def test_the_block_runs_with_planning_thresholds_and_the_previous_come_back(thresholds):
    with deferred_collections():
        assert gc.get_threshold() == PLANNING_THRESHOLDS
    assert gc.get_threshold() == (500, 7, 9)


def test_an_error_inside_the_block_puts_the_thresholds_back(thresholds):
    with pytest.raises(RuntimeError, match="boom"), deferred_collections():
        raise RuntimeError("boom")
    assert gc.get_threshold() == (500, 7, 9)


def test_a_collector_switched_off_by_threshold_stays_off(thresholds):
    gc.set_threshold(0)
    with deferred_collections():
        assert gc.get_threshold()[0] == 0
    assert gc.get_threshold()[0] == 0


def test_split_plans_under_the_deferral_and_restores(thresholds, monkeypatch):
    seen = []
    original = gc_deferral.gc.set_threshold

    def spy(*values):
        seen.append(values)
        original(*values)

    monkeypatch.setattr(gc_deferral.gc, "set_threshold", spy)
    step = torch.nn.Sequential(torch.nn.Linear(4, 4).requires_grad_(False), torch.nn.Linear(4, 1))
    graphsplit.split(lambda x: step(x).sum(), (torch.randn(2, 4),))
    assert seen == [PLANNING_THRESHOLDS, (500, 7, 9)]
    assert gc.get_threshold() == (500, 7, 9)
