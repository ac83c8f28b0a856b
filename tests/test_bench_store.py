"""benchmarks/bench_store.py without a GPU: the slot patterns its tables are measured with."""

from __future__ import annotations

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_store as bs  # noqa: E402


def test_runs_are_consecutive_slots_from_the_base():
    g = torch.Generator().manual_seed(0)
    slots = bs.slot_mapping("runs", 100, 640, 1280, "cpu", g)
    assert slots.dtype == torch.int64
    assert slots.tolist() == list(range(1280, 1380))


def test_random_slots_are_distinct_inside_the_span_and_not_in_order():
    g = torch.Generator().manual_seed(0)
    slots = bs.slot_mapping("random", 500, 640, 1280, "cpu", g)
    values = slots.tolist()
    assert len(set(values)) == 500 and min(values) >= 1280 and max(values) < 1280 + 640
    assert values != sorted(values)


def test_an_unknown_slot_pattern_is_refused_by_name():
    with pytest.raises(ValueError, match=r"slot pattern must be one of \('runs', 'random'\)"):
        bs.slot_mapping("strided", 4, 64, 0, "cpu", torch.Generator())
