"""Scorer `ttft-headroom-scorer`: max(0, SLO - predicted TTFT) / SLO, the prediction an online
exponentially weighted least-squares fit per endpoint of TTFT on (queue, prompt length)."""

from __future__ import annotations

import random

import pytest

from extproc.config.loader import ConfigError, load_text
from extproc.lifecycle import Completion
from extproc.scheduling import Scorer
from extproc.scheduling.ttft_headroom_scorer import (TtftHeadroomScorer, TtftHeadroomScorerParameters, TtftModel,
                                                     solve3)
from tests.extproc.scheduling.fleet import A185, BARE, FLEET, G0, G1, Clock, built, ctx, fleet, plugin, signals_with, state


def ttft(params: str = "{}"):
    return built(f"    - {{name: s, type: ttft-headroom-scorer, parameters: {params}}}\n"
                 "    - {type: max-score-picker, parameters: {fallbacks: 3}}\n",
                 "[{pluginRef: s}, {pluginRef: max-score-picker}]")


def truth(q: float, k: float) -> float:
    return 80.0 + 25.0 * q + 120.0 * k  # ms: 80 ms floor, 25 ms per queued request, 120 ms per 1000 chars


def feed(model: TtftModel, n: int, fn=truth, seed: int = 7, noise: float = 0.0):
    rng = random.Random(seed)
    for _ in range(n):
        q, k = rng.randint(0, 20), rng.uniform(0.05, 4.0)
        model.update(q, k, fn(q, k) + rng.gauss(0.0, noise))


def test_is_a_bounded_scorer_consuming_engine_metrics():
    s = TtftHeadroomScorer("s", TtftHeadroomScorerParameters(), None)
    assert isinstance(s, Scorer) and s.bounded is True and "engine_metrics" in s.consumes


def test_solve3():
    assert solve3([[2.0, 1.0, 0.0], [1.0, 3.0, 1.0], [0.0, 1.0, 4.0]], [3.0, 5.0, 5.0]) == pytest.approx([1.0, 1.0, 1.0])
    assert solve3([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 2.0]], [2.0, 3.0, 4.0]) == pytest.approx([3.0, 2.0, 2.0])
    assert solve3([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [0.0, 0.0, 1.0]], [1.0, 2.0, 3.0]) is None


def test_the_fit_recovers_the_coefficients_from_noiseless_observations():
    m = TtftModel(forgetting=0.98, ridge=1e-3)
    feed(m, 40)
    assert m.n == 40 and m.theta == pytest.approx([80.0, 25.0, 120.0], rel=1e-3)
    assert m.predict(10, 2.0) == pytest.approx(truth(10, 2.0), rel=1e-4)


def test_the_fit_converges_under_noise():
    m = TtftModel(forgetting=0.995, ridge=1e-3)
    feed(m, 2000, noise=20.0)
    t0, t1, t2 = m.theta
    assert abs(t0 - 80.0) < 10.0 and abs(t1 - 25.0) < 1.0 and abs(t2 - 120.0) < 5.0


def test_forgetting_tracks_an_endpoint_that_got_slower():
    m = TtftModel(forgetting=0.9, ridge=1e-3)
    feed(m, 300)

    def slower(q, k):
        return 2 * truth(q, k)

    feed(m, 60, fn=slower, seed=8)  # the old regime's weight is down to 0.9^60 = 0.2%
    assert m.predict(5, 1.0) == pytest.approx(slower(5, 1.0), rel=5e-3)
    flat = TtftModel(forgetting=1.0, ridge=1e-3)
    feed(flat, 300)
    feed(flat, 60, fn=slower, seed=8)  # without forgetting: 60 of 360 observations
    assert flat.predict(5, 1.0) < 0.8 * slower(5, 1.0)


def test_a_feature_that_never_varies_stays_solvable():
    m = TtftModel(forgetting=0.98, ridge=1e-3)
    for i in range(20):
        m.update(0, 1.0, 100.0)  # always idle, same prompt
    assert m.theta is not None and m.predict(0, 1.0) == pytest.approx(100.0, rel=1e-3)


def test_score_is_headroom_over_the_slo_and_cold_endpoints_are_neutral():
    b = ttft("{minSamples: 3}")
    s = plugin(b, "s")
    k = len("hi") / 1000.0
    for _ in range(3):
        s.observe(G0, 0.0, k, 400.0)
        s.observe(G1, 0.0, k, 1500.0)
    for _ in range(2):
        s.observe(A185, 0.0, k, 100.0)  # 2 < minSamples: still cold
    assert s.score(ctx(b, state(b)), FLEET) == pytest.approx({G0: 0.6, G1: 0.0, A185: 0.5, BARE: 0.5})
    # the request's own SLO (x-slo-ttft-ms), when it is a positive number
    assert s.score(ctx(b, state(b, x_slo_ttft_ms="500")), (G0,)) == pytest.approx({G0: 0.2})
    for bad in ("0", "-5", "soon", "nan", "inf"):
        assert s.score(ctx(b, state(b, x_slo_ttft_ms=bad)), (G0,)) == pytest.approx({G0: 0.6})
    assert ttft("{ttftSloMs: 2000, minSamples: 3}")  # the parameter is the default SLO
    s.params = s.params.model_copy(update={"ttft_slo_ms": 2000.0})
    assert s.score(ctx(b, state(b)), (G0, G1)) == pytest.approx({G0: 0.8, G1: 0.25})


def test_queue_is_the_engines_waiting_plus_running_else_the_gateways_in_flight():
    b = ttft()
    s = plugin(b, "s")
    for _ in range(2):
        b.runtime.inflight.started(G0)
    c = ctx(b, state(b))
    assert s.queue(c, G0) == 2.0 and s.queue(c, G1) == 0.0
    clock = Clock()
    signals_with(b.runtime, {G0: ("vllm", "vllm.txt"), G1: ("onnxruntime", "onnxruntime.txt")}, clock)
    assert s.queue(c, G0) == 3 + 12  # vLLM: 3 waiting, 12 running
    from extproc.datalayer.engine_metrics import parse_metrics
    from tests.extproc.scheduling.fleet import METRICS
    ort = parse_metrics("onnxruntime", (METRICS / "onnxruntime.txt").read_text())
    assert s.queue(c, G1) == float((ort.queue or 0) + (ort.running or 0))
    clock.t += 9.0  # stale: the in-flight count again
    assert s.queue(c, G0) == 2.0


def finish(b, st, endpoint: str, ttft_s: float | None, status: int = 200):
    st.endpoint = endpoint
    lc = b.runtime.lifecycle
    lc.start(st)
    st.completion = Completion(status=status, upstream=endpoint, first_upstream_byte=ttft_s)
    lc.stream_ended(st, "end")


def test_the_observer_fits_the_endpoint_that_served_with_the_features_it_was_scored_on():
    b = ttft("{minSamples: 1}")
    s = plugin(b, "s")
    prompt = "x" * 2000
    for _ in range(3):
        b.runtime.inflight.started(G1)
    st = state(b, prompt=prompt, stream=True)
    s.score(ctx(b, st), (G0, G1))
    assert st.attrs[s.key] == {G0: (0.0, 2.0), G1: (3.0, 2.0)}
    finish(b, st, G1, 0.300)
    assert set(s.models) == {G1} and s.models[G1].n == 1
    # not learned: non-streamed (its first byte is its last), failed, no first byte, not scored by this plugin
    st = state(b, prompt=prompt, stream=False)
    s.score(ctx(b, st), (G0, G1))
    finish(b, st, G0, 0.300)
    st = state(b, prompt=prompt, stream=True)
    s.score(ctx(b, st), (G0, G1))
    finish(b, st, G0, 0.300, status=500)
    st = state(b, prompt=prompt, stream=True)
    s.score(ctx(b, st), (G0, G1))
    finish(b, st, G0, None)
    finish(b, state(b, stream=True), G0, 0.300)
    assert set(s.models) == {G1}
    b2 = ttft("{streamingOnly: false, minSamples: 1}")
    s2 = plugin(b2, "s")
    st = state(b2, prompt=prompt, stream=False)
    s2.score(ctx(b2, st), (G0,))
    finish(b2, st, G0, 0.300)
    assert s2.models[G0].n == 1


def test_learned_through_requests_the_profile_prefers_the_endpoint_with_headroom():
    b = ttft("{minSamples: 4}")
    s = plugin(b, "s")
    rng = random.Random(3)
    inflight = b.runtime.inflight

    def load(ep, n):  # the gateway's in-flight count of `ep` becomes n
        while inflight.get(ep) < n:
            inflight.started(ep)
        while inflight.get(ep) > n:
            inflight.finished(ep)

    for i in range(60):  # a fleet where G0 is twice as slow as the others
        for e in FLEET:
            load(e, rng.randint(0, 6))
        st = state(b, prompt="y" * rng.randint(100, 3000), stream=True)
        s.score(ctx(b, st), FLEET)
        ep = FLEET[i % 4]
        q, k = st.attrs[s.key][ep]
        finish(b, st, ep, (truth(q, k) * (2.0 if ep == G0 else 1.0)) / 1000.0)
    assert all(s.models[e].n == 15 for e in FLEET)
    for e in FLEET:
        load(e, 0)
    load(G1, 4)  # G1 busier now
    st = state(b, prompt="y" * 1000, stream=True)
    got = s.score(ctx(b, st), FLEET)
    assert got == pytest.approx({G0: 1 - 2 * truth(0, 1.0) / 1000, G1: 1 - truth(4, 1.0) / 1000,
                                 A185: 1 - truth(0, 1.0) / 1000, BARE: 1 - truth(0, 1.0) / 1000}, rel=1e-3)
    assert b.decide(state(b, prompt="y" * 1000, stream=True))[0] in {A185, BARE}


def test_a_reload_keeps_the_models():
    b = ttft()
    s = plugin(b, "s")
    s.observe(G0, 1.0, 1.0, 200.0)
    b.reload(fleet("    - {name: s, type: ttft-headroom-scorer, parameters: {forgetting: 0.9}}\n"
                   "    - {type: max-score-picker, parameters: {fallbacks: 3}}\n",
                   "[{pluginRef: s}, {pluginRef: max-score-picker}]"))
    assert plugin(b, "s") is s and s.models[G0].n == 1 and s.models[G0].forgetting == 0.9


@pytest.mark.parametrize("params, message", [
    ("{ttftSloMs: 0}", "spec.plugins[0].parameters.ttftSloMs"),
    ("{forgetting: 0}", "spec.plugins[0].parameters.forgetting"),
    ("{forgetting: 1.01}", "spec.plugins[0].parameters.forgetting"),
    ("{minSamples: 0}", "spec.plugins[0].parameters.minSamples"),
    ("{neutralScore: -0.1}", "spec.plugins[0].parameters.neutralScore"),
    ("{ridge: -1}", "spec.plugins[0].parameters.ridge"),
    ("{sloMs: 500}", "spec.plugins[0].parameters.sloMs: unknown parameter"),
])
def test_parameters_are_strict(params, message):
    with pytest.raises(ConfigError) as e:
        load_text(fleet(f"    - {{name: s, type: ttft-headroom-scorer, parameters: {params}}}\n", "[{pluginRef: s}]"),
                  "c.yaml")
    assert message in str(e.value)
