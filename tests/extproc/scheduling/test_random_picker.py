"""Picker `random-picker`: a uniform random candidate and distinct random fallbacks, scores ignored."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from extproc.runtime import Runtime
from extproc.scheduling import Picker
from extproc.scheduling.random_picker import RandomPicker, RandomPickerParameters
from tests.extproc.scheduling.conftest import E1, E2, E3, E4

N = 20000


def picker(fallbacks: int = 2) -> RandomPicker:
    p = RandomPicker("rnd", RandomPickerParameters(fallbacks=fallbacks), Runtime())
    p.rng = random.Random(3)
    return p


def test_is_a_picker():
    assert isinstance(picker(), Picker) and RandomPicker.slot == "picker"


def test_uniform_whatever_the_scores():
    p = picker(0)
    counts = Counter(p.pick(None, {E1: 100.0, E2: 0.0, E3: 1.0, E4: 0.5})[0] for _ in range(N))
    assert len(counts) == 4 and all(c / N == pytest.approx(0.25, abs=0.015) for c in counts.values())


def test_fallbacks_are_distinct_candidates():
    p = picker(2)
    for _ in range(200):
        order = p.pick(None, {E1: 1, E2: 1, E3: 1, E4: 1})
        assert len(order) == 3 and len(set(order)) == 3 and set(order) <= {E1, E2, E3, E4}
    assert sorted(picker(9).pick(None, {E1: 0, E2: 0})) == [E1, E2]
    assert picker().pick(None, {}) == ()
