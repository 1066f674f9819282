"""Scorer `queue-scorer`: GIE's (max - q) / (max - min) over the candidates' engine queues, on recorded fleet states."""

from __future__ import annotations

import pytest

from extproc.runtime import Runtime
from extproc.scheduling import Scorer
from extproc.scheduling.queue_scorer import QueueScorer, QueueScorerParameters
from tests.extproc.scheduling.conftest import E1, E2, E3, E4
from tests.extproc.scheduling.signal_fleet import SIMULATOR, VLLM, VLLM_DP, VLLM_V0, built, fleet, recorded


def scorer(rt: Runtime) -> QueueScorer:
    return QueueScorer("queue", QueueScorerParameters(), rt)


def test_fixture_numbers():
    assert [recorded(n).queue for n in (VLLM, VLLM_V0, SIMULATOR, VLLM_DP)] == [3, 7, 2, 7]


def test_is_a_bounded_scorer_that_consumes_engine_metrics():
    s = scorer(Runtime())
    assert isinstance(s, Scorer) and s.bounded is True and s.consumes == ("engine_metrics",)


def test_gie_formula_on_a_recorded_fleet():
    rt = Runtime()
    fleet(rt, {E1: recorded(VLLM), E2: recorded(VLLM_V0), E3: recorded(SIMULATOR), E4: recorded(VLLM_DP)})
    # min 2 (E3), max 7 (E2, E4): (7 - q) / 5
    assert scorer(rt).score(None, (E1, E2, E3, E4)) == pytest.approx({E1: 0.8, E2: 0.0, E3: 1.0, E4: 0.0})
    # over the candidates only: without E3 the shortest queue is E1's 3
    assert scorer(rt).score(None, (E1, E2, E4)) == pytest.approx({E1: 1.0, E2: 0.0, E4: 0.0})


def test_equal_queues_are_neutral_and_unknown_endpoints_are_left_out():
    rt = Runtime()
    from extproc.datalayer.engine_metrics import EngineSample

    fleet(rt, {E1: recorded(VLLM_V0), E2: recorded(VLLM_DP), E3: None, E4: EngineSample("triton")})
    # E3 never scraped, E4's engine exports no queue, 127.0.0.1:9005 not tracked at all
    assert scorer(rt).score(None, (E1, E2, E3, E4, "127.0.0.1:9005")) == {E1: 1.0, E2: 1.0}
    assert scorer(rt).score(None, (E3, E4)) == {}


def test_in_a_profile_the_shortest_queue_wins_every_time():
    b = built("    - {type: queue-scorer}\n    - {type: max-score-picker, parameters: {fallbacks: 1}}\n",
              "[{pluginRef: queue-scorer}, {pluginRef: max-score-picker}]")
    fleet(b.runtime, {E1: recorded(VLLM), E2: recorded(VLLM_V0), E3: recorded(SIMULATOR), E4: recorded(VLLM_DP)})
    assert {b.decide() for _ in range(50)} == {(E3, E1)}
