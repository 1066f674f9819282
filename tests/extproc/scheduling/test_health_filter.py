"""Filter `health-filter`: drops endpoints whose last `failureThreshold` scrapes failed, counted by the real
scraper against real HTTP servers; passes endpoints with no information; a good scrape restores one."""

from __future__ import annotations

import pytest

from extproc.runtime import Runtime
from extproc.scheduling import Filter, NoCapacity
from extproc.scheduling.health_filter import HealthFilter, HealthFilterParameters
from extproc.scheduling.signals import EngineSignals
from tests.extproc.datalayer.test_scraper import BUSY_TEXT, servers  # noqa: F401 - the fixture
from tests.extproc.scheduling.conftest import E3
from tests.extproc.scheduling.signal_fleet import built, request_state


def health(rt: Runtime, **params) -> HealthFilter:
    return HealthFilter("health", HealthFilterParameters(**params), rt)


def test_is_a_filter_that_consumes_engine_metrics():
    f = health(Runtime())
    assert isinstance(f, Filter) and f.consumes == ("engine_metrics",) and f.params.failure_threshold == 3


@pytest.fixture
async def signals():
    made = []

    def make(rt: Runtime, endpoints) -> EngineSignals:
        # intervals of a minute: the loop's own first scrape, then only the scrapes the test makes
        sig = EngineSignals(busy_interval=60, idle_interval=60, inflight=rt.inflight.get)
        sig.start(endpoints)
        rt.signals = sig
        made.append(sig)
        return sig

    yield make
    for s in made:
        await s.stop()


async def settle(sig: EngineSignals):
    import asyncio

    while any(st.task is not None for st in sig._states.values()) or any(st.scrapes + st.errors == 0
                                                                         for st in sig._states.values()):
        await asyncio.sleep(0.01)


async def test_consecutive_failed_scrapes_drop_an_endpoint_and_a_good_one_restores_it(servers, signals):  # noqa: F811
    rt = Runtime()
    good, bad = servers(BUSY_TEXT), servers("oops", status=500)
    sig = signals(rt, {good.endpoint: (good.url, "vllm"), bad.endpoint: (bad.url, "vllm")})
    await settle(sig)  # the start's scrape: one failure for `bad`
    f = health(rt)
    eps = (good.endpoint, bad.endpoint, E3)
    assert sig.consecutive_errors(bad.endpoint) == 1 and sig.consecutive_errors(good.endpoint) == 0
    await sig.scrape(bad.endpoint)
    assert f.filter(None, eps) == list(eps)  # 2 < 3
    await sig.scrape(bad.endpoint)
    assert sig.consecutive_errors(bad.endpoint) == 3
    assert f.filter(None, eps) == [good.endpoint, E3]  # E3: not scraped at all, nothing known: passes
    assert health(rt, failureThreshold=4).filter(None, eps) == list(eps)
    bad.status, bad.body = 200, BUSY_TEXT
    assert await sig.scrape(bad.endpoint) is True
    assert sig.consecutive_errors(bad.endpoint) == 0 and sig.errors(bad.endpoint) == 3  # the total stays
    assert f.filter(None, eps) == list(eps)
    bad.status = 503
    await sig.scrape(bad.endpoint)
    assert sig.consecutive_errors(bad.endpoint) == 1  # counted again from zero


async def test_a_dead_port_counts_as_failures_too(servers, signals):  # noqa: F811
    rt = Runtime()
    gone = servers(BUSY_TEXT)
    gone.close()
    sig = signals(rt, {gone.endpoint: (gone.url, "vllm")})
    await settle(sig)
    for _ in range(2):
        await sig.scrape(gone.endpoint)
    assert health(rt).filter(None, (gone.endpoint,)) == []


async def test_a_changed_url_starts_the_count_over(servers, signals):  # noqa: F811
    rt = Runtime()
    bad = servers("x", status=500)
    sig = signals(rt, {bad.endpoint: (bad.url, "vllm")})
    await settle(sig)
    await sig.scrape(bad.endpoint)
    assert sig.consecutive_errors(bad.endpoint) == 2
    sig.update({bad.endpoint: (bad.url, "vllm")})  # same: kept
    assert sig.consecutive_errors(bad.endpoint) == 2
    sig.update({bad.endpoint: (bad.url + "?v=2", "vllm")})
    assert sig.consecutive_errors(bad.endpoint) == 0


async def test_every_endpoint_down_is_no_capacity(servers, signals):  # noqa: F811
    b = built("    - {type: health-filter, parameters: {failureThreshold: 1}}\n", "[{pluginRef: health-filter}]")
    bad = servers("x", status=500)
    sig = signals(b.runtime, {e: (bad.url, "vllm") for e in b.backend.endpoint_ids})
    await settle(sig)
    with pytest.raises(NoCapacity) as e:
        b.decide(request_state(b, priority=-2))
    assert e.value.filter == "health-filter" and e.value.sheddable is True
