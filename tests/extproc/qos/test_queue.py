"""The gateway queue and admission per pool (extproc/qos/queue.py): order (priority class, then deadline),
bounds (requests, bytes, time), 429/503 by class, slots released exactly once (a request cancelled while
queued, one admitted and cancelled before dispatch), the gateway-wide count over two workers' slot files,
and the config's errors. Outcomes and order are asserted, never durations."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from extproc.qos.limiter import LimiterParams
from extproc.qos.queue import SLOT_ATTR, Admission, AdmissionConfig, AdmissionQueue, PoolConfig, Waiter
from extproc.types import Reject
from tests.extproc.qos.admission_common import P0, P1, P2, load_admission, refusal, req


def waiter(seq, cls=P1, tenant="t", deadline=math.inf, tokens=1, size=0):
    return Waiter(SimpleNamespace(attrs={}, tenant=tenant), cls.rank, cls.name, tenant, deadline, tokens, 1.0, size,
                  seq, float(seq))


def test_order_is_class_then_deadline_then_arrival():
    q = AdmissionQueue()
    ws = [waiter(0, P2, deadline=1.0), waiter(1, P1, deadline=9.0), waiter(2, P1, deadline=3.0),
          waiter(3, P0, deadline=50.0), waiter(4, P1, deadline=3.0), waiter(5, P2, deadline=0.5)]
    for w in ws:
        q.push(w)
    assert q.count == 6 and q.ahead(P1.rank) == 4 and q.ahead(P0.rank) == 1
    order = []
    while (w := q.pop()) is not None:
        order.append(w.seq)
    assert order == [3, 2, 4, 1, 5, 0]
    assert q.count == 0 and q.bytes == 0


def test_requests_the_matrix_raised_wait_behind_the_class_own_and_before_their_base_class():
    q = AdmissionQueue()
    raised = [Waiter(SimpleNamespace(attrs={}, tenant="noisy"), P0.rank, P0.name, "noisy", 0.1, 1, 1.0, 0, i, float(i),
                     raised=True) for i in range(3)]  # earlier deadlines than P0's own: still after them
    own = [waiter(10, P0, deadline=5.0), waiter(11, P0, deadline=9.0)]
    for w in (raised[0], own[0], raised[1], waiter(20, P1, deadline=0.0), raised[2], own[1]):
        q.push(w)
    assert q.ahead(P0.rank) == 2 and q.ahead(P0.rank, raised=True) == 5 and q.ahead(P1.rank) == 6
    assert q.depth(P0.rank) == 5 and q.depth(P1.rank) == 1
    assert {b.name for b in q.bands.values()} == {"P0", "P0/matrix", "P1"}
    q.remove(raised[1])
    assert q.depth(P0.rank) == 4
    order = []
    while (w := q.pop()) is not None:
        order.append(w.seq)
    assert order == [10, 11, 0, 2, 20]


def test_acquire_puts_a_matrix_raised_request_behind_the_class_own():
    from extproc.qos.priority import BASE_ATTR

    async def main():
        adm = admission(max_queue=10)
        pool = adm.pools["llm"]
        holders = [req(), req()]
        for h in holders:
            assert await adm.acquire(pool, h, P1, 1, 0) is None
        admitted = []

        async def wait(name, cls, base):
            s = req()
            s.attrs[BASE_ATTR] = (base, "matrix" if base is not cls else "header")
            v = await adm.acquire(pool, s, cls, 1, 0)
            admitted.append(name)
            return s, v

        tasks = [asyncio.create_task(wait("raised", P0, P1)), asyncio.create_task(wait("p1", P1, P1)),
                 asyncio.create_task(wait("p0", P0, P0))]
        await asyncio.sleep(0)
        assert adm.view()["pools"]["llm"]["waiting"] == {"P0/matrix": 1, "P1": 1, "P0": 1}
        for h in holders:
            adm.release(h)
            await asyncio.sleep(0)
        assert admitted == ["p0", "raised"]
        first, _ = await tasks[2]
        adm.release(first)
        results = await asyncio.gather(*tasks)
        assert admitted == ["p0", "raised", "p1"] and all(v is None for _, v in results)
        queued = {c: adm._registry.get_sample_value("adapter_qos_queue_requests_total",
                                                    {"pool": "llm", "class": c, "result": "queued"})
                  for c in ("P0", "P0/matrix", "P1")}
        assert queued == {"P0": 1.0, "P0/matrix": 1.0, "P1": 1.0}

    asyncio.run(main())


def test_removed_waiters_are_skipped_and_their_bytes_leave():
    q = AdmissionQueue()
    a, b, c = waiter(0, size=10), waiter(1, size=20), waiter(2, size=30)
    for w in (a, b, c):
        q.push(w)
    q.remove(b)
    q.remove(b)  # twice: counted once
    assert q.count == 2 and q.bytes == 40
    assert [q.pop().seq, q.pop().seq, q.pop()] == [0, 2, None]


def pool_cfg(**kw):
    base = dict(pool="llm", limiter=LimiterParams(initial=2, min_limit=1, max_limit=2), max_queue=3,
                max_queue_bytes=1000, max_wait=5.0, sheddable=frozenset({"P2"}), retry_after=2, poll=0.001,
                fairness_window=1.0)
    base.update(kw)
    return PoolConfig(**base)


def admission(state_dir=None, worker=0, **kw):
    adm = Admission(worker, state_dir, registry=CollectorRegistry())
    adm.configure(AdmissionConfig({"llm": pool_cfg(**kw)}, {}, ()))
    return adm


async def saturated(**kw):
    """`admission(**kw)` with both slots of its pool (limit 2) taken by P1 requests that are never released:
    (admission, pool)."""
    adm = admission(**kw)
    pool = adm.pools["llm"]
    for _ in range(2):
        await adm.acquire(pool, req(), P1, 1, 0)
    return adm, pool


async def one_waiting(size=0, **kw):
    """`saturated(**kw)` and one P1 request of `size` bytes waiting in its queue: (admission, pool, its task)."""
    adm, pool = await saturated(**kw)
    t = asyncio.create_task(adm.acquire(pool, req(), P1, 1, size))
    await asyncio.sleep(0)
    return adm, pool, t


def test_queued_requests_go_in_class_order_as_slots_free():
    async def main():
        adm = admission()
        pool = adm.pools["llm"]
        holders = [req(), req()]
        for h in holders:
            assert await adm.acquire(pool, h, P1, 1, 0) is None
        assert pool.inflight() == 2
        admitted = []

        async def wait(name, cls):
            s = req()
            v = await adm.acquire(pool, s, cls, 1, 0)
            admitted.append((name, v))
            return s

        tasks = [asyncio.create_task(wait("p2", P2)), asyncio.create_task(wait("p1", P1)),
                 asyncio.create_task(wait("p0", P0))]
        await asyncio.sleep(0)
        assert pool.queue.count == 3
        adm.release(holders[0])
        await asyncio.sleep(0)
        adm.release(holders[1])
        await asyncio.sleep(0)
        assert [n for n, _ in admitted] == ["p0", "p1"]
        first = await tasks[2]
        adm.release(first)
        await asyncio.gather(*tasks)
        assert [n for n, v in admitted] == ["p0", "p1", "p2"] and all(v is None for _, v in admitted)
        for t in tasks:
            adm.release(t.result())
        adm.release(t.result())  # twice: released once
        assert pool.inflight() == 0 and pool.own == 0

    asyncio.run(main())


def test_full_queue_sheds_p2_with_429_and_refuses_others_with_503():
    async def main():
        adm, pool, t = await one_waiting(max_queue=1)
        shed = await adm.acquire(pool, req(), P2, 1, 0)
        refused = await adm.acquire(pool, req(), P0, 1, 0)
        assert isinstance(shed, Reject) and shed.status == 429 and shed.code == "overloaded" and shed.retry_after == 2
        assert isinstance(refused, Reject) and refused.status == 503 and refused.code == "queue_full"
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t

    asyncio.run(main())


def test_bytes_bound():
    async def main():
        adm, pool, t = await one_waiting(60, max_queue_bytes=100)
        v = await adm.acquire(pool, req(), P1, 1, 60)
        assert isinstance(v, Reject) and v.status == 503 and v.code == "queue_full"
        t.cancel()
        await asyncio.gather(t, return_exceptions=True)
        assert pool.queue.bytes == 0

    asyncio.run(main())


def test_wait_bound_times_out_p1_with_503_and_p2_with_429():
    async def main():
        adm, pool = await saturated(max_wait=0.02)
        a, b = await asyncio.gather(adm.acquire(pool, req(), P1, 1, 0), adm.acquire(pool, req(), P2, 1, 0))
        assert (a.status, a.code) == (503, "queue_timeout")
        assert (b.status, b.code) == (429, "overloaded")
        assert pool.queue.count == 0 and pool.inflight() == 2

    asyncio.run(main())


def test_p2_shed_at_once_when_its_estimated_wait_is_over_the_bound():
    async def main():
        adm, pool = await saturated(max_wait=1.0)
        pool.hold = 10.0  # slots are held 10 s on average: 1 ahead / limit 2 * 10 s = 5 s > 1 s
        v = await adm.acquire(pool, req(), P2, 1, 0)
        assert (v.status, v.code) == (429, "overloaded") and pool.queue.count == 0

    asyncio.run(main())


def test_cancelled_while_queued_leaks_nothing_and_admitted_then_cancelled_gives_back_its_slot():
    async def main():
        adm = admission()
        pool = adm.pools["llm"]
        holders = [req(), req()]
        for h in holders:
            await adm.acquire(pool, h, P1, 1, 0)
        queued = [asyncio.create_task(adm.acquire(pool, req(), P1, 1, 10)) for _ in range(3)]
        await asyncio.sleep(0)
        assert pool.queue.count == 3 and pool.queue.bytes == 30
        queued[0].cancel()  # the client went away while its request waited
        await asyncio.gather(queued[0], return_exceptions=True)
        assert pool.queue.count == 2 and pool.queue.bytes == 20
        # admitted by a release, cancelled before its coroutine resumed (the stream was reset then)
        adm.release(holders[0])
        assert pool.inflight() == 2 and pool.queue.count == 1
        queued[1].cancel()
        await asyncio.gather(queued[1], return_exceptions=True)
        assert pool.inflight() == 2  # its slot went to the next in line
        assert await queued[2] is None
        adm.release(holders[1])
        assert pool.inflight() == 1
        assert pool.own == 1 and pool.queue.count == 0

    asyncio.run(main())


def test_workers_share_the_limit_through_their_slot_files(tmp_path):
    async def main():
        w0 = admission(str(tmp_path), 0)
        w1 = admission(str(tmp_path), 1)
        p0, p1 = w0.pools["llm"], w1.pools["llm"]
        a = req()
        assert await w0.acquire(p0, a, P1, 1, 0) is None
        assert await w1.acquire(p1, req(), P1, 1, 0) is None
        assert p0.inflight() == 2 and p1.inflight() == 2  # the limit (2) is the gateway's, not each worker's
        t = asyncio.create_task(w1.acquire(p1, req(), P1, 1, 0))
        await asyncio.sleep(0.01)
        assert not t.done() and p1.queue.count == 1  # worker 1 waits for a slot ...
        w0.release(a)  # ... that worker 0 frees: seen by worker 1's poll
        assert await asyncio.wait_for(t, 5) is None
        assert p0.inflight() == 2

    asyncio.run(main())


def test_ttft_of_streamed_requests_feeds_the_limiter():
    async def main():
        adm = admission(limiter=LimiterParams(initial=2, min_limit=1, max_limit=50, samples=1))
        pool = adm.pools["llm"]
        s = req(stream=True)
        await adm.acquire(pool, s, P1, 1, 0)
        s.first_body = s.attrs[SLOT_ATTR].admitted + 0.1
        adm.release(s)
        assert pool.limiter.updates == 1 and pool.limiter.min_rtt == pytest.approx(0.1)
        s = req(stream=False)  # an unstreamed body's first byte is its last: no TTFT sample
        await adm.acquire(pool, s, P1, 1, 0)
        s.first_body = s.attrs[SLOT_ATTR].admitted + 5
        adm.release(s)
        assert pool.limiter.updates == 1

    asyncio.run(main())


@pytest.mark.parametrize("entry, where", [
    ("      - {backend: nope}", "spec.qos.admission[0].backend: unknown backend 'nope'"),
    ("      - {backend: llm, maxWait: 2s}", "spec.qos.admission[0].maxWait"),
    ("      - {backend: llm, sheddable: [P9]}", "spec.qos.admission[0].sheddable[0]: unknown priority class 'P9'"),
    ("      - {backend: llm, minLimit: 10, initialLimit: 4}", "spec.qos.admission[0].initialLimit"),
    ("      - {backend: llm, smoothing: 0}", "smoothing"),
])
def test_bad_config_is_refused_with_its_field(entry, where):
    error = refusal(entry)
    assert where in error and "q.yaml" in error


def test_pipeline_gets_the_stage_before_dispatch_only_for_listed_pools():
    snap = load_admission("      - {backend: llm, maxWait: 500ms}")
    names = [s.name for s in snap.routes["api"].pipeline.stages]
    assert names.index("qos-queue") == names.index("dispatch") - 1
    assert names.count("qos-queue") == 2  # bodiless requests are admitted at headers, the others at the body
    off = load_admission("      - {backend: llm, enabled: false}")
    assert "qos-queue" not in [s.name for s in off.routes["api"].pipeline.stages]


def test_a_reload_keeps_the_learnt_limit_the_queue_and_slots_and_a_removed_pool_lets_its_waiters_go():
    async def main():
        adm = admission(limiter=LimiterParams(initial=2, min_limit=1, max_limit=2))
        pool = adm.pools["llm"]
        pool.limiter.value, pool.limiter.updates = 1.0, 5  # as if learnt from 5 batches
        holder = req()
        await adm.acquire(pool, holder, P1, 1, 0)
        t = asyncio.create_task(adm.acquire(pool, req(), P1, 1, 0))
        await asyncio.sleep(0)
        adm.configure(AdmissionConfig({"llm": pool_cfg(max_queue=10, limiter=LimiterParams(initial=4, max_limit=8))},
                                      {}, ()))
        assert adm.pools["llm"] is pool and pool.limiter.limit == 1 and pool.queue.count == 1
        assert pool.cfg.max_queue == 10
        adm.configure(None)  # admission taken out of the config: whoever waits goes on unlimited
        assert await asyncio.wait_for(t, 5) is None
        assert adm.pools == {}
        adm.release(holder)  # a slot of the removed pool is still released into it
        assert pool.own == 1  # (the waiter let go holds the other, until its on_done)

    asyncio.run(main())


def test_a_stuck_pool_does_not_keep_every_waiter_that_left():
    q = AdmissionQueue()
    ws = [waiter(i, size=1) for i in range(1000)]
    for w in ws:
        q.push(w)
    for w in ws[:990]:  # timed out or cancelled, and nothing was ever admitted
        q.remove(w)
    assert q.count == 10 and q.bytes == 10
    assert sum(len(h) for b in q.bands.values() for h in b.flows.values()) <= 2 * 64 + 10
    assert [q.pop().seq for _ in range(10)] == list(range(990, 1000)) and q.pop() is None


def test_status_adds_up_the_workers_published_pools(tmp_path):
    from extproc.qos.queue import admission_view
    from extproc.status_cli import pretty

    snap = load_admission("      - {backend: llm, maxWait: 500ms}")

    async def main():
        w0, w1 = admission(str(tmp_path), 0), admission(str(tmp_path), 1)
        for w in (w0, w1):
            await w.acquire(w.pools["llm"], req(), P1, 1, 0)
        t = asyncio.create_task(w1.acquire(w1.pools["llm"], req(), P2, 1, 0))
        await asyncio.sleep(0)
        w0.publish()
        w1.publish()
        view = admission_view(snap, str(tmp_path))
        t.cancel()
        await asyncio.gather(t, return_exceptions=True)
        return view

    view = asyncio.run(main())
    pool = view["pools"]["llm"]
    assert pool["in_flight"] == 2 and pool["waiting"] == {"P2": 1}
    assert {w: v["limit"] for w, v in pool["workers"].items()} == {"0": 2, "1": 2}
    text = pretty({"config": {}, "admission": view})
    assert "pool llm: in flight 2 (gateway-wide); limit worker 0 2, worker 1 2; waiting P2 1" in text


def test_reserve_keeps_slots_for_the_critical_class_own_requests():
    from extproc.qos.priority import BASE_ATTR

    async def main():
        adm = admission(limiter=LimiterParams(initial=8, min_limit=1, max_limit=8), reserve=0.25,
                        reserved=frozenset({"P0"}), max_queue=10)
        pool = adm.pools["llm"]
        assert pool.reserve_slots() == 2 and adm.view()["pools"]["llm"]["reserve_slots"] == 2
        for _ in range(6):
            assert await adm.acquire(pool, req(), P1, 1, 0) is None
        p1 = asyncio.create_task(adm.acquire(pool, req(), P1, 1, 0))  # 6 of 8: P1 waits
        raised = req()
        raised.attrs[BASE_ATTR] = (P1, "matrix")
        r = asyncio.create_task(adm.acquire(pool, raised, P0, 1, 0))  # raised into P0: not its own
        await asyncio.sleep(0)
        assert pool.queue.count == 2 and pool.inflight() == 6
        own = [await adm.acquire(pool, req(), P0, 1, 0) for _ in range(2)]  # P0's own: up to the limit
        assert own == [None, None] and pool.inflight() == 8
        p1.cancel()
        r.cancel()
        await asyncio.gather(p1, r, return_exceptions=True)

    asyncio.run(main())


def test_reserve_is_at_most_half_the_limit_and_zero_by_default():
    async def main():
        adm = admission(limiter=LimiterParams(initial=3, min_limit=1, max_limit=3), reserve=0.5,
                        reserved=frozenset({"P0"}))
        assert adm.pools["llm"].reserve_slots() == 1  # ceil(1.5) = 2, at most floor(3 / 2) = 1
        assert admission().pools["llm"].reserve_slots() == 0

    asyncio.run(main())


def test_reserve_config_defaults_to_the_critical_classes_and_refuses_bad_classes():
    from extproc.qos.queue import admission_of

    snap = load_admission("      - {backend: llm, reserve: 0.1}")
    pool = admission_of(snap).pools["llm"]
    assert pool.reserve == 0.1 and pool.reserved == frozenset({"P0"})
    assert "reserveClasses" in refusal("      - {backend: llm, reserve: 0.1, reserveClasses: [P9]}")
    assert "sheddable" in refusal("      - {backend: llm, reserve: 0.1, reserveClasses: [P2]}")
    assert "reserve" in refusal("      - {backend: llm, reserve: 0.9}")


def test_the_wait_in_the_queue_is_the_attributions_queue_component_not_the_processors():
    """On a route with serverTiming, the qos-queue stage records its time in admission (the wait included) as
    (phase, seconds); Timing.components reports it as `queue` and takes it out of that phase's processor time.
    A request admitted at once has a `queue` of microseconds; a route without serverTiming records nothing."""
    from extproc.attribution import QUEUE_ATTR, TIMING_ATTR, Timing, header_value
    from extproc.stages.qos_queue import QosQueueAtBody
    from extproc.types import Phase

    spec = SimpleNamespace(mode="always", tenants=(), header=None)
    route = SimpleNamespace(name="api", timeout=None, backends_for_model=lambda model: [SimpleNamespace(name="llm")])

    def timed(with_timing=True):
        s = req()
        s.route, s.request, s.runtime = route, None, None
        s.served = s.endpoint = s.first_byte = None
        if with_timing:
            s.attrs[TIMING_ATTR] = Timing(spec)
        return s

    async def run():
        adm = admission()
        pool = adm.pools["llm"]
        holders = [req(), req()]
        for h in holders:
            assert await adm.acquire(pool, h, P1, 1, 0) is None
        stage = QosQueueAtBody(AdmissionConfig({"llm": pool.cfg}, {}, ()), P1)
        stage._own = adm
        msg = SimpleNamespace(body=b"{}")
        waiting = timed()
        task = asyncio.create_task(stage.on_request_body(waiting, msg))
        await asyncio.sleep(0.05)
        assert pool.queue.count == 1 and QUEUE_ATTR not in waiting.attrs
        adm.release(holders[0])
        assert await task is None
        phase, waited = waiting.attrs[QUEUE_ATTR]
        assert phase is Phase.REQUEST_BODY and waited >= 0.05
        timing = waiting.attrs[TIMING_ATTR]
        timing.processor["processor_request_headers"] = 0.001
        timing.processor["processor_request_body"] = waited + 0.002  # the phase's message held the wait
        out = timing.components(waiting, None)
        assert out["queue"] == waited and out["processor_request_headers"] == 0.001
        assert abs(out["processor_request_body"] - 0.002) < 1e-9
        assert 'queue;dur=' in header_value(out, None) and 'desc="gateway admission"' in header_value(out, None)
        # admitted at once: microseconds in admission, none of it waiting
        adm.release(holders[1])
        at_once = timed()
        assert await stage.on_request_body(at_once, msg) is None
        assert 0 < at_once.attrs[QUEUE_ATTR][1] < 0.01
        # no serverTiming on the route: nothing recorded
        plain = timed(with_timing=False)
        adm.release(waiting)
        assert await stage.on_request_body(plain, msg) is None and QUEUE_ATTR not in plain.attrs
        # a route without admission: queue 0 and the header says there is no gateway queue
        none = Timing(spec).components(timed(), None)
        assert none["queue"] == 0.0 and 'desc="no gateway queue"' in header_value(none, None)

    asyncio.run(run())
