"""Gradual shedding (extproc/qos/shedding.py and its use in extproc/qos/queue.py): the controller's
arithmetic with an injected clock (the level rises under sustained delay, falls once it passes, stays
within [0, k]), class ordering (P2 before P1, never P0), draws from an injected random source, the
config's defaults and errors, and that `immediate` keeps the estimated-wait rule."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from prometheus_client import CollectorRegistry

from extproc.qos.limiter import LimiterParams
from extproc.qos.queue import Admission, AdmissionConfig, PoolConfig, admission_of
from extproc.qos.shedding import GRADUAL, IMMEDIATE, Shedder, SheddingParams
from tests.extproc.qos.admission_common import P1, P2, load_admission, refusal, req


class Clock:
    def __init__(self, t=0.0):
        self.t = t

    def __call__(self):
        return self.t


def params(**kw):
    base = dict(mode=GRADUAL, target=0.1, interval=0.1, alpha=0.125, beta=1.25, max_probability=1.0, order=("P2",))
    base.update(kw)
    return SheddingParams(**base)


def test_level_follows_pie_arithmetic_rises_under_delay_and_falls_after():
    clock = Clock()
    s = Shedder(params(), clock, rand=lambda: 0.0)
    assert s.observe(0.0) == 0.0  # first observation: the reference, no update
    clock.t = 0.05
    assert s.observe(0.3) == 0.0 and s.updates == 0  # under one interval: nothing
    clock.t = 0.1
    # 0.125 * (0.3 - 0.1) / 0.1 + 1.25 * (0.3 - 0.0) / 0.1 = 0.25 + 3.75 -> clamped to 1 (one sheddable class)
    assert s.observe(0.3) == 1.0
    s.level = 0.0
    clock.t = 0.2
    assert s.observe(0.3) == pytest.approx(0.25)  # no derivative: the delay did not change
    clock.t = 0.3
    assert s.observe(0.3) == pytest.approx(0.5)
    clock.t = 0.4
    # the delay passes: 0.5 + 0.125 * (0.0 - 0.1) / 0.1 + 1.25 * (0.0 - 0.3) / 0.1 < 0 -> 0
    assert s.observe(0.0) == 0.0
    s = Shedder(params(beta=0.0), clock)  # the integral term alone
    levels = []
    for i in range(5, 40):  # sustained delay at twice the target: +0.125 per interval, never above 1
        clock.t = i / 10
        levels.append(s.observe(0.2))
    assert levels[1:9] == pytest.approx([0.125 * k for k in range(1, 9)])
    assert levels == sorted(levels) and levels[0] == 0.0 and levels[-1] == 1.0  # [0]: the reference
    assert all(0.0 <= v <= 1.0 for v in levels)


def test_idle_intervals_are_caught_up_so_an_idle_pool_decays():
    clock = Clock()
    s = Shedder(params(), clock)
    s.observe(0.1)
    s.level = 1.0
    clock.t = 0.4  # 4 intervals later, delay 0 (nothing waits): 4 x -0.125
    assert s.observe(0.0) == 0.0  # 1 + 0.125 * (0 - 0.1) / 0.1 + 1.25 * (0 - 0.1) / 0.1 < 0 at the first step
    s.level, s.prev = 1.0, 0.0
    clock.t = 0.8  # 4 more intervals at delay 0, no derivative: 1 - 4 x 0.125
    assert s.observe(0.0) == pytest.approx(0.5)
    clock.t = 1e6  # a long idle spell: bounded work, level 0
    assert s.observe(0.0) == 0.0


def test_classes_in_order_p2_before_p1_never_p0_and_max_probability():
    clock = Clock()
    s = Shedder(params(order=("P2", "P1")), clock)
    for level, p2, p1 in ((0.0, 0.0, 0.0), (0.4, 0.4, 0.0), (1.0, 1.0, 0.0), (1.5, 1.0, 0.5), (2.0, 1.0, 1.0)):
        s.level = level
        assert (s.probability("P2"), s.probability("P1"), s.probability("P0")) == pytest.approx((p2, p1, 0.0))
    s.observe(0.0)
    clock.t = 0.1
    assert s.observe(100.0) == 2.0  # clamped at k = 2 sheddable classes
    capped = Shedder(params(max_probability=0.5), clock)
    capped.level = 1.0
    assert capped.probability("P2") == 0.5


def test_draws_come_from_the_injected_random_source():
    draws = itertools.cycle([0.1, 0.5, 0.9])
    s = Shedder(params(), Clock(), rand=lambda: next(draws))
    s.level = 0.5
    assert [s.shed("P2") for _ in range(6)] == [True, False, False, True, False, False]
    assert [s.shed("P0") for _ in range(3)] == [False] * 3  # not sheddable: never drawn as shed
    s.level = 0.0
    assert not any(s.shed("P2") for _ in range(3))


def pool_cfg(shedding, **kw):
    base = dict(pool="llm", limiter=LimiterParams(initial=1, min_limit=1, max_limit=1), max_queue=100,
                max_queue_bytes=10**6, max_wait=5.0, sheddable=frozenset({"P2"}), retry_after=2, poll=0.001,
                fairness_window=1.0, shedding=shedding)
    base.update(kw)
    return PoolConfig(**base)


def run_p2_arrivals(mode, draws, n=8, alpha=0.125, beta=1.25):
    """One slot held, P1 requests waiting (queueing delay 4 x 1 s / 1 = 4 s, over the 1 s target and the 3 s
    maxWait's estimate rule), then n P2 arrivals one interval apart: which are shed at once."""
    async def main():
        clock = Clock()
        adm = Admission(clock=clock, registry=CollectorRegistry())
        sh = params(mode=mode, target=1.0, interval=0.1, alpha=alpha, beta=beta)
        adm.configure(AdmissionConfig({"llm": pool_cfg(sh, max_wait=3.0)}, {}, ()))
        pool = adm.pools["llm"]
        pool.hold = 1.0
        assert await adm.acquire(pool, req(), P1, 1, 0) is None  # holds the slot
        waiting = [asyncio.ensure_future(adm.acquire(pool, req(), P1, 1, 0)) for _ in range(4)]
        await asyncio.sleep(0)
        assert pool.queue.count == 4
        pool.shedder.rand = lambda: next(draws)
        out = []
        for i in range(n):
            clock.t = 0.1 * i
            fut = asyncio.ensure_future(adm.acquire(pool, req(), P2, 1, 0))
            await asyncio.sleep(0)
            out.append(fut.result().code if fut.done() else "queued")
        for f in waiting:
            f.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        return out, pool.shedder.level

    return asyncio.run(main())


def test_gradual_sheds_a_share_rising_with_the_level_immediate_sheds_every_one():
    out, level = run_p2_arrivals(GRADUAL, itertools.cycle([0.02, 0.9]), alpha=0.01, beta=0.0)
    # delay = waiting x 1 s / 1; level += 0.01 * (delay - 1) per interval: t=0 the reference (4 waiting, level 0:
    # queued), then 0.04 (draw 0.02: shed), 0.08 (0.9: queued, 6 wait), 0.13 (shed), 0.18 (queued, 7), 0.24,
    # 0.30 (queued, 8), 0.37: a share shed at once, the rest queue
    assert out == ["queued", "overloaded"] * 4 and level == pytest.approx(0.37)
    full = run_p2_arrivals(GRADUAL, itertools.cycle([0.9]))[0]  # PIE's defaults: 4x the target -> level 1 at once
    assert full == ["queued"] + ["overloaded"] * 7
    imm = run_p2_arrivals(IMMEDIATE, itertools.cycle([0.0]))[0]
    assert imm == ["overloaded"] * 8  # estimated wait (5 ahead x 1 s / 1) over maxWait 3 s: every one, at once


def test_config_defaults_and_class_order():
    snap = load_admission("      - {backend: llm, maxWait: 800ms, sheddable: [P1, P2], "
                          "shedding: {mode: gradual, interval: 50ms}}")
    sh = admission_of(snap).pools["llm"].shedding
    assert (sh.mode, sh.target, sh.interval, sh.alpha, sh.beta, sh.order) == (GRADUAL, 0.2, 0.05, 0.125, 1.25,
                                                                            ("P2", "P1"))
    default = admission_of(load_admission("      - {backend: llm}")).pools["llm"]
    assert default.shedding.mode == IMMEDIATE and not default.shedding.gradual


@pytest.mark.parametrize("entry, where", [
    ("      - {backend: llm, maxWait: 800ms, shedding: {mode: gradual, target: 900ms}}",
     "spec.qos.admission[0].shedding.target: target (0.9s) must be above 0 and below maxWait"),
    ("      - {backend: llm, shedding: {mode: sometimes}}", "spec.qos.admission[0].shedding.mode"),
    ("      - {backend: llm, shedding: {mode: gradual, maxProbability: 2}}",
     "spec.qos.admission[0].shedding.maxProbability"),
    ("      - {backend: llm, shedding: {mode: gradual, interval: 0s}}", "spec.qos.admission[0].shedding.interval"),
    ("      - {backend: llm, shedding: {mode: gradual, gain: 3}}", "spec.qos.admission[0].shedding.gain"),
])
def test_bad_shedding_config_is_refused_with_its_field(entry, where):
    error = refusal(entry)
    assert where in error and "q.yaml" in error


def test_a_reload_keeps_the_level():
    clock = Clock()
    adm = Admission(clock=clock, registry=CollectorRegistry())
    adm.configure(AdmissionConfig({"llm": pool_cfg(params(order=("P2", "P1")))}, {}, ()))
    pool = adm.pools["llm"]
    pool.shedder.level = 1.5
    adm.configure(AdmissionConfig({"llm": pool_cfg(params(order=("P2",)))}, {}, ()))
    assert adm.pools["llm"] is pool and pool.shedder.level == 1.0  # kept, within the new k
