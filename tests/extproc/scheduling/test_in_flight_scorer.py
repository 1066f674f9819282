"""Scorer `in-flight-scorer`: score = 1 - inflight / max inflight over the candidates (all idle: 1), or
1 - inflight / capacity with a capacity (a parameter or an endpoint label)."""

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


# --- the absolute scale: against each endpoint's capacity -------------------------------------------

def capped(rt: Runtime, **params) -> InFlightScorer:
    return InFlightScorer("inflight", InFlightScorerParameters(**params), rt)


class Ctx:
    def __init__(self, labels=None):
        self.labels = labels or {}


def test_capacity_scores_against_the_endpoints_slots_not_the_busiest():
    rt = Runtime()
    load(rt, {E1: 2, E2: 1, E3: 8, E4: 11})
    got = capped(rt, capacity=8).score(Ctx(), (E1, E2, E3, E4))
    # relative would give the busiest candidate 0 and E1 (2 of 8 slots) 1 - 2/11
    assert got == pytest.approx({E1: 0.75, E2: 0.875, E3: 0.0, E4: 0.0})  # over capacity: 0, not negative
    assert capped(rt, capacity=8).score(Ctx(), (E1, E2)) == pytest.approx({E1: 0.75, E2: 0.875})  # no matter who else


def test_a_capacity_label_overrides_the_default_per_endpoint():
    rt = Runtime()
    load(rt, {E1: 2, E2: 2, E3: 2, E4: 2})
    labels = {E1: {"max-num-seqs": "4"}, E2: {"max-num-seqs": "16"}, E3: {"max-num-seqs": "zero"},
              E4: {"max-num-seqs": "-1"}}
    got = capped(rt, capacity=8, capacityLabel="max-num-seqs").score(Ctx(labels), (E1, E2, E3, E4))
    # E3's label is not a number and E4's not positive: both take `capacity`
    assert got == pytest.approx({E1: 0.5, E2: 0.875, E3: 0.75, E4: 0.75})


def test_an_endpoint_without_label_nor_capacity_is_scored_against_the_busiest_such():
    rt = Runtime()
    load(rt, {E1: 2, E2: 1, E3: 4, E4: 3})
    labels = {E1: {"slots": "8"}, E2: {"slots": "4"}}
    got = capped(rt, capacityLabel="slots").score(Ctx(labels), (E1, E2, E3, E4))
    assert got == pytest.approx({E1: 0.75, E2: 0.75, E3: 0.0, E4: 0.25})  # E3, E4: relative to E3's 4


def test_capacity_parameters_are_validated():
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        InFlightScorerParameters(capacity=0)
    with pytest.raises(ValidationError):
        InFlightScorerParameters(capacityLabel="")
    assert InFlightScorerParameters().capacity is None and InFlightScorerParameters().capacity_label is None


def test_a_decision_reads_the_in_flight_table_once_for_all_its_plugins(monkeypatch):
    b = build(gateway("    - {type: in-flight-scorer}\n    - {type: predicted-ttft-scorer}\n"
                      "    - {type: max-score-picker, parameters: {fallbacks: 0}}\n",
                      "    - name: p\n      plugins: [{pluginRef: in-flight-scorer}, {pluginRef: predicted-ttft-scorer},"
                      " {pluginRef: max-score-picker}]\n"))
    load(b.runtime, {E1: 2, E2: 1, E3: 2, E4: 1})
    reads = []
    real = b.runtime.inflight.loads
    monkeypatch.setattr(b.runtime.inflight, "loads", lambda eps: reads.append(eps) or real(eps))
    assert b.decide()[0] in (E2, E4)
    assert reads == [(E1, E2, E3, E4)]  # one read, shared through the decision's cycle
    b.decide()
    assert len(reads) == 2  # the next decision reads afresh
