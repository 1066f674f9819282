"""Filter `saturation-filter`: the EPP rule (no sample or stale -> saturated; queue > 5; KV > 0.8) on recorded
fleet states; all saturated -> the framework's refusal, 503 no_capacity or 429 overloaded for sheddable requests."""

from __future__ import annotations

import pytest

from extproc.runtime import Runtime
from extproc.scheduling import Filter, NoCapacity
from extproc.scheduling.saturation_filter import SaturationFilter, SaturationFilterParameters
from extproc.stages.dispatch import dispatch
from tests.extproc.scheduling.conftest import E1, E2, E3, E4
from tests.extproc.scheduling.signal_fleet import (SIMULATOR, VLLM, VLLM_DP, VLLM_V0, Clock, built, fleet,
                                                   recorded, request_state)


def sat(rt: Runtime, **params) -> SaturationFilter:
    return SaturationFilter("sat", SaturationFilterParameters(**params), rt)


def test_is_a_filter_that_consumes_engine_metrics():
    f = sat(Runtime())
    assert isinstance(f, Filter) and f.consumes == ("engine_metrics",)
    p = f.params
    assert (p.queue_depth_threshold, p.kv_cache_util_threshold, p.metrics_staleness_threshold) == (5, 0.8, None)


def test_the_epp_rule_on_a_recorded_fleet():
    rt = Runtime()
    fleet(rt, {E1: recorded(VLLM), E2: recorded(VLLM_V0), E3: recorded(SIMULATOR), E4: recorded(VLLM_DP)})
    # E2: queue 7 > 5 and KV 0.91 > 0.8; E4: queue 7 > 5 (KV 0.7 is fine)
    assert sat(rt).filter(None, (E1, E2, E3, E4)) == [E1, E3]


def test_queue_and_kv_thresholds_are_each_enough_and_configurable():
    rt = Runtime()
    fleet(rt, {E1: recorded(VLLM), E2: recorded(VLLM_V0), E4: recorded(VLLM_DP)})
    assert sat(rt, queueDepthThreshold=7).filter(None, (E1, E2, E4)) == [E1, E4]  # 7 is not above 7; E2's KV is
    assert sat(rt, queueDepthThreshold=7, kvCacheUtilThreshold=0.95).filter(None, (E1, E2, E4)) == [E1, E2, E4]
    assert sat(rt, queueDepthThreshold=100, kvCacheUtilThreshold=0.5).filter(None, (E1, E2, E4)) == [E1]


def test_stale_samples_count_as_saturated():
    rt, clock = Runtime(), Clock()
    # busy interval 0.2 s: the bound is 4 x 0.2 = 0.8 s
    sig = fleet(rt, {E1: recorded(VLLM), E3: recorded(SIMULATOR)}, ages={E1: 0.79, E3: 0.81}, clock=clock)
    assert sig.stale_after(E1) == pytest.approx(0.8)
    assert sat(rt).filter(None, (E1, E3)) == [E1]
    clock.t += 0.02  # E1's sample ages past the bound too
    assert sat(rt).filter(None, (E1, E3)) == []
    assert sat(rt, metricsStalenessThreshold=5).filter(None, (E1, E3)) == [E1, E3]


def test_a_tracked_endpoint_never_scraped_is_saturated_an_untracked_one_passes():
    rt = Runtime()
    fleet(rt, {E1: None, E2: recorded(VLLM)})
    assert sat(rt).filter(None, (E1, E2, E3)) == [E2, E3]  # E3: no engine metrics known for it: no information


def saturated_fleet(b):
    fleet(b.runtime, {E1: recorded(VLLM_V0), E2: recorded(VLLM_DP), E3: recorded(VLLM), E4: recorded(SIMULATOR)},
          ages={E3: 60.0, E4: 60.0})  # E3 and E4: healthy numbers, but a minute old


PROFILE = ("    - {type: saturation-filter}\n    - {type: queue-scorer}\n",
           "[{pluginRef: saturation-filter}, {pluginRef: queue-scorer}]")


def test_all_saturated_is_no_capacity_in_the_profile():
    b = built(*PROFILE)
    saturated_fleet(b)
    with pytest.raises(NoCapacity) as e:
        b.decide(request_state(b))
    assert (e.value.filter, e.value.candidates, e.value.sheddable) == ("saturation-filter", 4, False)


@pytest.mark.parametrize("priority, status, code", [(None, 503, "no_capacity"), (0, 503, "no_capacity"),
                                                    (-1, 429, "overloaded")])
def test_all_saturated_refuses_through_dispatch(priority, status, code):
    b = built(*PROFILE)
    saturated_fleet(b)
    st = request_state(b, priority=priority)
    verdict = dispatch(st)
    assert verdict.status == status and verdict.code == code
    assert verdict.retry_after == (1 if status == 429 else None)
    assert st.endpoint is None and b.runtime.inflight.get(E1) == 0
    assert st.attrs["decision"]["filters"] == [{"plugin": "saturation-filter", "kept": []}]


def test_one_fresh_unsaturated_endpoint_takes_the_request():
    b = built(*PROFILE)
    saturated_fleet(b)
    b.runtime.signals._states[E4].scraped_at = b.runtime.signals._clock()  # E4's sample is fresh again
    st = request_state(b)
    dispatch(st)
    assert st.endpoint == E4


async def test_with_the_real_scraper_an_endpoint_that_stops_answering_goes_stale_and_is_filtered():
    from tests.extproc.datalayer.test_scraper import BUSY_TEXT, MetricsServer, until

    a, b_ = MetricsServer(BUSY_TEXT), MetricsServer(BUSY_TEXT)  # queue 3, KV 0.42, busy: scraped every 0.2 s
    head = ("apiVersion: adapter.ai/v1\nkind: AdapterGateway\nmetadata: {name: s}\nspec:\n  backends:\n"
            f'    - name: pool\n      kind: vllm\n      models: [m]\n      endpoints: ["{a.endpoint}", "{b_.endpoint}"]\n')
    b = built(*PROFILE, head=head)
    rt = b.runtime
    rt.start_signals()
    try:
        await until(lambda: rt.signals.sample(a.endpoint) and rt.signals.sample(b_.endpoint), "first samples")
        assert set(b.decide(request_state(b))) == {a.endpoint, b_.endpoint}
        a.close()  # its last sample stays, ageing; past 4 x 0.2 s it is stale, hence saturated
        await until(lambda: rt.signals.age(a.endpoint) > rt.signals.stale_after(a.endpoint), "a stale sample")
        assert rt.signals.sample(a.endpoint).queue == 3  # the numbers alone would pass
        for _ in range(10):
            st = request_state(b)
            dispatch(st)
            assert st.endpoint == b_.endpoint
        b_.close()
        await until(lambda: rt.signals.age(b_.endpoint) > rt.signals.stale_after(b_.endpoint), "b stale too")
        verdict = dispatch(request_state(b))
        assert (verdict.status, verdict.code) == (503, "no_capacity")
    finally:
        await rt.stop_signals()
        for server in (a, b_):
            try:
                server.close()
            except OSError:
                pass
