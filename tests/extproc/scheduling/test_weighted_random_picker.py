"""Picker `weighted-random-picker`: pick with probability proportional to the total; the fallbacks are
the rest of a weighted sample without replacement (A-ES), zeros last, all zeros uniform."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from extproc.runtime import Runtime
from extproc.scheduling import Picker
from extproc.scheduling.weighted_random_picker import WeightedRandomPicker, WeightedRandomPickerParameters
from tests.extproc.scheduling.conftest import E1, E2, E3, E4

N = 20000


def picker(fallbacks: int = 2, seed: int = 11) -> WeightedRandomPicker:
    p = WeightedRandomPicker("wr", WeightedRandomPickerParameters(fallbacks=fallbacks), Runtime())
    p.rng = random.Random(seed)  # reproducible draws: the frequencies below are fixed numbers, not luck
    return p


def test_is_a_picker():
    assert isinstance(picker(), Picker) and WeightedRandomPicker.slot == "picker"


def test_the_pick_is_proportional_to_the_total():
    p = picker(0)
    counts = Counter(p.pick(None, {E1: 3.0, E2: 1.0, E3: 0.0})[0] for _ in range(N))
    assert counts[E3] == 0
    assert counts[E1] / N == pytest.approx(0.75, abs=0.015)
    assert counts[E2] / N == pytest.approx(0.25, abs=0.015)


def test_fallbacks_are_successive_weighted_draws_without_replacement():
    # weights 1, 1, 2: P(c first) = 1/2; P(a, then c) = 1/4 * 2/3 = 1/6; P(a, then b) = 1/4 * 1/3 = 1/12
    p = picker(2)
    orders = Counter(p.pick(None, {E1: 1.0, E2: 1.0, E3: 2.0}) for _ in range(N))
    assert all(len(o) == 3 and set(o) == {E1, E2, E3} for o in orders)
    assert sum(n for o, n in orders.items() if o[0] == E3) / N == pytest.approx(1 / 2, abs=0.015)
    assert orders[(E1, E3, E2)] / N == pytest.approx(1 / 6, abs=0.012)
    assert orders[(E1, E2, E3)] / N == pytest.approx(1 / 12, abs=0.01)
    assert orders[(E3, E1, E2)] / N == pytest.approx(1 / 4, abs=0.012)  # 1/2 * 1/2


def test_zero_totals_come_after_every_positive_one():
    p = picker(3)
    for _ in range(500):
        order = p.pick(None, {E1: 0.0, E2: 0.01, E3: 0.0, E4: 5.0})
        assert set(order[:2]) == {E2, E4} and set(order[2:]) == {E1, E3}


def test_all_zero_is_uniform():
    p = picker(0)
    counts = Counter(p.pick(None, {E1: 0.0, E2: 0.0, E3: 0.0, E4: 0.0})[0] for _ in range(N))
    assert all(c / N == pytest.approx(0.25, abs=0.015) for c in counts.values()) and len(counts) == 4


def test_fallbacks_parameter_bounds_the_list():
    assert len(picker(1).pick(None, {E1: 1, E2: 1, E3: 1, E4: 1})) == 2
    assert len(picker(16).pick(None, {E1: 1, E2: 1})) == 2
    assert picker().pick(None, {}) == ()


def test_built_from_config_it_keeps_its_name_and_the_workers_runtime_and_draws_from_its_own_generator():
    from tests.extproc.scheduling.fleet import FLEET, built, plugin

    b = built("    - {name: wr, type: weighted-random-picker, parameters: {fallbacks: 1}}\n", "[{pluginRef: wr}]")
    p = plugin(b, "wr")
    assert isinstance(p, WeightedRandomPicker) and p.name == "wr" and p.runtime is b.runtime
    # no scorer: every total is 0, so the order is uniform (the generator built with it, not a test's)
    firsts = Counter()
    for _ in range(4000):
        order = b.decide()
        assert len(order) == 2 and len(set(order)) == 2 and set(order) <= set(FLEET)
        firsts[order[0]] += 1
    assert set(firsts) == set(FLEET) and all(800 < n < 1200 for n in firsts.values()), firsts  # about 1000 each


def test_each_instance_has_its_own_urandom_seeded_generator():
    a = WeightedRandomPicker("a", WeightedRandomPickerParameters(), Runtime())
    b = WeightedRandomPicker("b", WeightedRandomPickerParameters(), Runtime())
    assert isinstance(a.rng, random.Random) and a.rng is not b.rng
    assert [a.rng.random() for _ in range(4)] != [b.rng.random() for _ in range(4)]
