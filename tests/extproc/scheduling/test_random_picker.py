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


def test_built_from_config_it_keeps_its_name_parameters_and_the_workers_runtime():
    from tests.extproc.scheduling.fleet import FLEET, built, plugin

    b = built("    - {name: rnd, type: random-picker, parameters: {fallbacks: 1}}\n", "[{pluginRef: rnd}]")
    p = plugin(b, "rnd")
    assert isinstance(p, RandomPicker) and p.name == "rnd" and p.runtime is b.runtime and p.params.fallbacks == 1
    for _ in range(50):  # its own generator, as built (not replaced by the test): 1 + 1 distinct candidates
        order = b.decide()
        assert len(order) == 2 and len(set(order)) == 2 and set(order) <= set(FLEET)


def test_each_instance_has_its_own_urandom_seeded_generator():
    a = RandomPicker("a", RandomPickerParameters(), Runtime())
    b = RandomPicker("b", RandomPickerParameters(), Runtime())
    assert isinstance(a.rng, random.Random) and a.rng is not b.rng
    # two workers do not draw alike (64 random bits each: equal sequences have probability 2**-64)
    assert [a.rng.random() for _ in range(4)] != [b.rng.random() for _ in range(4)]
    cands = {E1: 0, E2: 0, E3: 0, E4: 0}
    assert len({a.pick(None, cands) for _ in range(200)}) > 1  # its own draws vary
