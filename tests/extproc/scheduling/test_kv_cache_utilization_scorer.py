"""Scorer `kv-cache-utilization-scorer`: 1 - KV use (GIE's), bounded (clamped, not min-max), on recorded fleet states."""

from __future__ import annotations

import pytest

from extproc.runtime import Runtime
from extproc.scheduling import Scorer
from extproc.scheduling.kv_cache_utilization_scorer import (KVCacheUtilizationScorer,
                                                            KVCacheUtilizationScorerParameters)
from tests.extproc.scheduling.conftest import E1, E2, E3, E4
from tests.extproc.scheduling.signal_fleet import SIMULATOR, VLLM, VLLM_DP, VLLM_V0, built, fleet, recorded


def scorer(rt: Runtime) -> KVCacheUtilizationScorer:
    return KVCacheUtilizationScorer("kv", KVCacheUtilizationScorerParameters(), rt)


def test_fixture_numbers():
    assert [recorded(n).kv_usage for n in (VLLM, VLLM_V0, VLLM_DP)] == [0.4219, 0.9132, 0.7]
    assert recorded(SIMULATOR).kv_usage == pytest.approx(0.053955078125)


def test_is_a_bounded_scorer_that_consumes_engine_metrics():
    s = scorer(Runtime())
    assert isinstance(s, Scorer) and s.bounded is True and s.consumes == ("engine_metrics",)


def test_one_minus_kv_use_on_a_recorded_fleet():
    rt = Runtime()
    fleet(rt, {E1: recorded(VLLM), E2: recorded(VLLM_V0), E3: recorded(VLLM_DP),
               E4: recorded("onnxruntime", "onnxruntime")})
    # ONNX Runtime exports no KV gauge: left out
    assert scorer(rt).score(None, (E1, E2, E3, E4)) == pytest.approx({E1: 0.5781, E2: 0.0868, E3: 0.3})


def test_through_a_profile_the_scores_are_clamped_not_rescaled():
    b = built("    - {type: kv-cache-utilization-scorer}\n    - {type: max-score-picker, parameters: {fallbacks: 3}}\n",
              "[{pluginRef: kv-cache-utilization-scorer, weight: 2}, {pluginRef: max-score-picker}]")
    fleet(b.runtime, {E1: recorded(VLLM), E2: recorded(VLLM_V0), E3: recorded(VLLM_DP), E4: None})
    st = b.state()
    assert b.decide(st) == (E1, E3, E2, E4)
    assert st.attrs["decision"]["total"] == pytest.approx({E1: 2 * 0.5781, E2: 2 * 0.0868, E3: 0.6, E4: 0.0})
