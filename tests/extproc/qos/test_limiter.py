"""The TTFT gradient limiter (extproc/qos/limiter.py): its formula on one batch, and convergence against a
simulated backend (an engine with `max_num_seqs` slots whose TTFT grows once more requests are let in than
it runs at once), with an injected clock; no timing."""

from __future__ import annotations

import math

import pytest

from extproc.qos.limiter import GradientLimiter, LimiterParams


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def engine_ttft(concurrency: float, max_num_seqs: int, prefill: float = 0.05, decode_s: float = 1.0) -> float:
    """A continuous-batching engine: up to `max_num_seqs` requests run at once, each prefilled in `prefill`
    seconds; the rest wait in the engine's queue for a running request to finish (about `decode_s`), so a
    request's first token comes after its wait in the queue plus its prefill."""
    queued = max(0.0, concurrency - max_num_seqs)
    return prefill + queued / max_num_seqs * decode_s


def drive(lim: GradientLimiter, clock: Clock, max_num_seqs: int, batches: int, offered: float = math.inf):
    limits = []
    for _ in range(batches):
        inflight = min(lim.limit, offered)
        for _ in range(lim.params.samples):
            clock.t += 0.01
            lim.sample(engine_ttft(inflight, max_num_seqs), int(inflight))
        limits.append(lim.limit)
    return limits


def test_one_batch_is_the_formula():
    clock = Clock()
    lim = GradientLimiter(LimiterParams(initial=16, min_limit=1, max_limit=100, tolerance=1.25, smoothing=0.5,
                                        samples=2), clock)
    assert not lim.sample(0.1, 16)
    assert lim.sample(0.1, 16)  # first batch: minRTT = sampleRTT = 0.1, gradient 1, headroom sqrt(16) = 4
    assert lim.value == pytest.approx(0.5 * 16 + 0.5 * (16 * 1 + 4))
    v = lim.value
    lim.sample(0.25, 18)
    lim.sample(0.25, 18)  # sampleRTT 0.25: gradient = 1.25 * 0.1 / 0.25 = 0.5
    assert lim.value == pytest.approx(0.5 * v + 0.5 * (v * 0.5 + math.sqrt(v)))
    assert lim.min_rtt == pytest.approx(0.1)


def test_app_limited_pool_does_not_grow_and_bounds_hold():
    clock = Clock()
    lim = GradientLimiter(LimiterParams(initial=10, min_limit=4, max_limit=12, samples=1), clock)
    for _ in range(50):
        lim.sample(0.05, 2)  # never used half the limit: no headroom
    assert lim.limit == 10
    for _ in range(50):
        lim.sample(0.05, 12)
    assert lim.limit == 12  # max
    for _ in range(200):
        lim.sample(10.0, 12)  # TTFT 200x its minimum: the limit falls to its floor, not below
    assert lim.limit == 4


def test_converges_near_the_engines_capacity_and_follows_it():
    clock = Clock()
    lim = GradientLimiter(LimiterParams(initial=4, min_limit=1, max_limit=1000), clock)
    limits = drive(lim, clock, max_num_seqs=16, batches=400)
    tail = limits[-100:]
    # at equilibrium TTFT = tolerance * minRTT / (1 - 1/sqrt(limit)): a limit a little above 16 (the engine
    # queues a few), far below the 1000 an unbounded client would push
    assert 16 <= min(tail) and max(tail) <= 20, tail[-10:]
    assert engine_ttft(max(tail), 16) < 3 * engine_ttft(1, 16)
    # the engine loses half its slots (a replica restarts with --max-num-seqs 8): the limit follows it down
    limits = drive(lim, clock, max_num_seqs=8, batches=400)
    assert 8 <= min(limits[-100:]) and max(limits[-100:]) <= 11, limits[-10:]


def test_min_rtt_forgets_after_two_windows_only_for_uncongested_batches():
    clock = Clock()
    lim = GradientLimiter(LimiterParams(initial=8, samples=1, min_rtt_window=10.0), clock)
    lim.sample(0.05, 1)
    clock.t = 15.0
    lim.sample(0.2, 8)
    assert lim.min_rtt == pytest.approx(0.05)  # previous bucket still counts
    clock.t = 25.0
    lim.sample(0.3, 8)  # congested (8 in flight, limit 8): may not replace the forgotten minimum
    assert lim.min_rtt == pytest.approx(0.05)
    lim.sample(0.2, 1)
    assert lim.min_rtt == pytest.approx(0.2)  # an uncongested batch re-learns a backend slower for good


def test_sustained_overload_over_many_windows_does_not_ratchet_the_limit_up():
    clock = Clock()
    lim = GradientLimiter(LimiterParams(initial=4, max_limit=1000, min_rtt_window=1.0), clock)
    limits = drive(lim, clock, max_num_seqs=16, batches=2000)  # 160 s of saturation: 80 minimum windows
    assert 16 <= min(limits[-500:]) and max(limits[-500:]) <= 20, limits[-10:]


def test_a_backend_slower_for_good_is_relearnt_once_the_load_eases():
    clock = Clock()
    lim = GradientLimiter(LimiterParams(initial=4, max_limit=1000, min_rtt_window=1.0), clock)
    drive(lim, clock, max_num_seqs=16, batches=300)

    def feed(batches, offered):
        for _ in range(batches):
            inflight = min(lim.limit, offered)
            for _ in range(lim.params.samples):
                clock.t += 0.01
                lim.sample(4 * engine_ttft(inflight, 16), inflight)  # every request prefills 4x slower

    feed(500, 1000)
    assert lim.min_rtt == pytest.approx(engine_ttft(1, 16))  # saturated: the old minimum is kept ...
    assert lim.limit < 16  # ... and the limit is too low for the engine's 16 slots
    feed(100, 1)  # a quiet spell: uncongested batches re-learn the minimum
    assert lim.min_rtt == pytest.approx(4 * engine_ttft(1, 16))
    feed(500, 1000)
    assert lim.limit >= 16  # back at the engine's capacity


def test_configure_keeps_what_was_learnt():
    clock = Clock()
    lim = GradientLimiter(LimiterParams(initial=4, max_limit=1000), clock)
    drive(lim, clock, 16, 200)
    learnt = lim.limit
    lim.configure(LimiterParams(initial=2, max_limit=1000, smoothing=0.1))
    assert lim.limit == learnt
    lim.configure(LimiterParams(initial=2, max_limit=10))
    assert lim.limit == 10
