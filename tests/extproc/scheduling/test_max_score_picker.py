"""Picker `max-score-picker`: highest total first, ties at random (per-worker RNG), `fallbacks` more."""

from __future__ import annotations

import random
from collections import Counter

from extproc.runtime import Runtime
from extproc.scheduling import Picker
from extproc.scheduling.max_score_picker import MaxScorePicker, MaxScorePickerParameters
from tests.extproc.scheduling.conftest import E1, E2, E3, E4


def picker(fallbacks: int = 2) -> MaxScorePicker:
    return MaxScorePicker("best", MaxScorePickerParameters(fallbacks=fallbacks), Runtime())


def test_is_a_picker_of_the_picker_slot():
    p = picker()
    assert isinstance(p, Picker) and p.slot == "picker" and not p.standalone


def test_orders_by_total_highest_first_and_names_fallbacks():
    scored = {E1: 0.5, E2: 2.0, E3: 1.0, E4: 0.0}
    assert picker(3).pick(None, scored) == (E2, E3, E1, E4)
    assert picker(1).pick(None, scored) == (E2, E3)
    assert picker(0).pick(None, scored) == (E2,)
    assert picker(16).pick(None, scored) == (E2, E3, E1, E4)  # never more than the candidates


def test_default_fallbacks_is_two():
    assert MaxScorePickerParameters().fallbacks == 2
    assert len(picker().pick(None, {E1: 1, E2: 2, E3: 3, E4: 4})) == 3


def test_ties_are_broken_at_random_and_never_beat_a_higher_score():
    p = picker(1)
    p.rng = random.Random(7)  # reproducible
    firsts = Counter()
    for _ in range(2000):
        order = p.pick(None, {E1: 1.0, E2: 1.0, E3: 1.0, E4: 0.9})
        firsts[order[0]] += 1
        assert E4 not in order  # the lower score is never among the first two
    assert set(firsts) == {E1, E2, E3}
    assert all(550 < n < 780 for n in firsts.values()), firsts  # about a third each


def test_no_candidates_no_pick():
    assert picker().pick(None, {}) == ()


def test_each_instance_has_its_own_urandom_seeded_generator():
    a, b = picker(), picker()
    assert a.rng is not b.rng
    assert [a.rng.random() for _ in range(4)] != [b.rng.random() for _ in range(4)]


def test_configure_keeps_the_generator_and_applies_the_new_fallbacks():
    p = picker(0)
    rng = p.rng
    p.configure(p.params, MaxScorePickerParameters(fallbacks=1))
    assert p.rng is rng and p.pick(None, {E1: 1, E2: 2, E3: 0}) == (E2, E1)


def test_built_from_config_it_keeps_its_name_and_the_workers_runtime_and_spreads_a_profile_without_scorers():
    from tests.extproc.scheduling.fleet import FLEET, built, plugin

    b = built("    - {name: best, type: max-score-picker, parameters: {fallbacks: 0}}\n", "[{pluginRef: best}]")
    p = plugin(b, "best")
    assert isinstance(p, MaxScorePicker) and p.name == "best" and p.runtime is b.runtime and p.params.fallbacks == 0
    # no scorer: every total is equal, so the order is the tie-break alone (its own urandom-seeded generator)
    firsts = Counter(b.decide()[0] for _ in range(4000))
    assert set(firsts) == set(FLEET) and all(800 < n < 1200 for n in firsts.values()), firsts  # about 1000 each
