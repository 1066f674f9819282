"""Scorer `in-flight-scorer`: score = 1 - inflight / max inflight over the candidates (all idle: 1)."""

from __future__ import annotations

import pytest

from extproc.runtime import Runtime
from extproc.scheduling import Scorer
from extproc.scheduling.in_flight_scorer import InFlightScorer, InFlightScorerParameters
from tests.extproc.scheduling.conftest import E1, E2, E3, E4, build, gateway


def scorer(rt: Runtime) -> InFlightScorer:
    return InFlightScorer("inflight", InFlightScorerParameters(), rt)


def load(rt: Runtime, counts: dict[str, int]) -> None:
    for ep, n in counts.items():
        for _ in range(n):
            rt.inflight.started(ep)


def test_is_a_bounded_scorer():
    s = scorer(Runtime())
    assert isinstance(s, Scorer) and s.slot == "scorer" and s.bounded is True


def test_formula_against_the_busiest_candidate():
    rt = Runtime()
    load(rt, {E1: 3, E2: 1, E3: 0, E4: 6})
    assert scorer(rt).score(None, (E1, E2, E3)) == pytest.approx({E1: 0.0, E2: 2 / 3, E3: 1.0})
    # the busiest among the candidates only: E4's 6 counts when it is one
    assert scorer(rt).score(None, (E1, E2, E3, E4)) == pytest.approx({E1: 0.5, E2: 5 / 6, E3: 1.0, E4: 0.0})


def test_all_idle_scores_one_for_everyone():
    assert scorer(Runtime()).score(None, (E1, E2)) == {E1: 1.0, E2: 1.0}


def test_released_requests_count_no_more():
    rt = Runtime()
    load(rt, {E1: 2, E2: 1})
    rt.inflight.finished(E1)
    rt.inflight.finished(E1)
    assert scorer(rt).score(None, (E1, E2)) == {E1: 1.0, E2: 0.0}


def test_in_a_profile_the_idlest_endpoint_is_picked():
    b = build(gateway("    - {type: in-flight-scorer}\n    - {type: max-score-picker, parameters: {fallbacks: 0}}\n",
                      "    - name: p\n      plugins: [{pluginRef: in-flight-scorer}, {pluginRef: max-score-picker}]\n"))
    load(b.runtime, {E1: 2, E2: 1, E3: 2, E4: 1})
    picks = {b.decide()[0] for _ in range(100)}
    assert picks == {E2, E4}  # the least loaded two, ties at random
