"""Scorer `rtt-scorer`: min RTT / RTT(e), from the eBPF agent's per-upstream srtt, else a TTFB EWMA."""

from __future__ import annotations

import time

import pytest

from ebpf.snapshot import SnapshotData, SnapshotWriter, UpstreamSample
from extproc.config.loader import ConfigError, load_text
from extproc.lifecycle import Completion
from extproc.runtime import Runtime
from extproc.scheduling import Scorer
from extproc.scheduling.rtt_scorer import RttScorer, RttScorerParameters
from extproc.types import Outcome
from tests.extproc.scheduling.fleet import A185, BARE, FLEET, G0, G1, built, ctx, fleet, plugin, state


def rtt(params: str):
    return built(f"    - {{name: s, type: rtt-scorer, parameters: {params}}}\n"
                 "    - {type: max-score-picker, parameters: {fallbacks: 3}}\n",
                 "[{pluginRef: s}, {pluginRef: max-score-picker}]")


def publish(path, upstreams, age_s: float = 0.0):
    data = SnapshotData(upstreams=upstreams, source="ebpf",
                        written_mono_ns=time.monotonic_ns() - int(age_s * 1e9))
    SnapshotWriter(path).write(data)


def up(endpoint: str, window_mean_us: float = 0.0, window_count: int = 0, last: int = 0, count: int = 0):
    addr, port = endpoint.rsplit(":", 1)
    return UpstreamSample(addr, int(port), window_mean_us=window_mean_us, window_count=window_count,
                          last_srtt_us=last, count=count or window_count)


def finish(b, endpoint: str, ttfb_s: float | None, outcome_status: int = 200, stream: bool = True):
    """One request through the worker's real lifecycle, ending with Envoy's report for `endpoint`."""
    st = state(b, stream=stream)
    st.endpoint = endpoint
    lc = b.runtime.lifecycle
    lc.start(st)
    st.completion = Completion(status=outcome_status, upstream=endpoint, first_upstream_byte=ttfb_s)
    lc.stream_ended(st, "end")
    return st


def scores(b, cands=FLEET):
    return plugin(b, "s").score(ctx(b, state(b)), cands)


def test_is_a_bounded_scorer():
    s = RttScorer("s", RttScorerParameters(), None)
    assert isinstance(s, Scorer) and s.bounded is True


def test_per_endpoint_srtt_from_the_agents_snapshot(tmp_path):
    path = tmp_path / "agent.snap"
    b = rtt(f"{{snapshot: {path}}}")
    # published after the config's compile, which can take seconds on a loaded machine (staleAfterS 2)
    publish(path, [up(G0, 200.0, 10), up(G1, 400.0, 3), up(A185, 0.0, 0, last=800, count=5),
                   up("10.9.9.9:8000", 50.0, 1)])  # an upstream that is no candidate sets no scale
    assert scores(b) == pytest.approx({G0: 1.0, G1: 0.5, A185: 0.25, BARE: 0.5})  # BARE unseen: unknownScore
    assert plugin(b, "s").rtts(ctx(b, state(b)), FLEET)[0] == "ebpf"
    for _ in range(10):
        assert b.decide(state(b))[0] == G0


def test_the_default_snapshot_is_the_tenancys(tmp_path):
    path = tmp_path / "tenancy.snap"
    b = rtt("{}")
    publish(path, [up(G1, 100.0, 2), up(G0, 300.0, 2)])  # after the compile (staleAfterS 2)
    object.__setattr__(b.snap.tenancy, "snapshot", str(path))
    assert plugin(b, "s").snapshot_path(ctx(b, state(b))) == str(path)
    assert scores(b, (G0, G1)) == pytest.approx({G0: 1 / 3, G1: 1.0})


def test_a_stale_or_missing_snapshot_falls_back_to_the_ttfb_ewma(tmp_path):
    path = tmp_path / "agent.snap"
    publish(path, [up(G0, 200.0, 10), up(G1, 400.0, 3)], age_s=30.0)
    b = rtt(f"{{snapshot: {path}, staleAfterS: 5}}")
    assert scores(b) == dict.fromkeys(FLEET, 0.5)  # stale, nothing learned yet: every one unknown
    finish(b, G1, 0.050)
    finish(b, A185, 0.200)
    assert plugin(b, "s").rtts(ctx(b, state(b)), FLEET) == ("ttfb", pytest.approx({G1: 50.0, A185: 200.0}))
    assert scores(b) == pytest.approx({G0: 0.5, G1: 1.0, A185: 0.25, BARE: 0.5})
    b2 = rtt(f"{{snapshot: {tmp_path / 'none.snap'}}}")
    finish(b2, G0, 0.010)
    assert scores(b2)[G0] == 1.0


def test_source_ebpf_never_uses_ttfb_and_ttfb_never_reads_the_snapshot(tmp_path):
    path = tmp_path / "agent.snap"
    publish(path, [up(G0, 900.0, 1), up(G1, 300.0, 1)])
    b = rtt(f"{{snapshot: {tmp_path / 'none.snap'}, source: ebpf}}")
    finish(b, G0, 0.010)
    assert scores(b) == dict.fromkeys(FLEET, 0.5)
    b = rtt(f"{{snapshot: {path}, source: ttfb}}")
    finish(b, G0, 0.010)
    assert scores(b) == {G0: 1.0, G1: 0.5, A185: 0.5, BARE: 0.5}


def test_only_ok_requests_with_a_first_byte_teach_the_ewma():
    b = rtt("{source: ttfb}")
    s = plugin(b, "s")
    finish(b, G0, 0.100, outcome_status=503)
    finish(b, G1, None)
    assert s.ttfb == {}
    st = finish(b, A185, 0.100)
    assert st.outcome is Outcome.OK and s.ttfb[A185][0] == pytest.approx(100.0)


def test_the_ewma_converges_on_a_changed_endpoint_in_a_known_number_of_observations():
    s = RttScorer("s", RttScorerParameters(alpha=0.2, maxAgeS=60), None)
    for i in range(50):
        s.observe(G0, 100.0, now=float(i))
    assert s.ttfb_ms(G0, now=50.0) == pytest.approx(100.0)
    for i in range(30):  # the endpoint got slower: error shrinks by (1 - alpha) per observation
        s.observe(G0, 300.0, now=50.0 + i)
    assert s.ttfb_ms(G0, now=80.0) == pytest.approx(300.0 - 200.0 * 0.8 ** 30)
    assert abs(s.ttfb_ms(G0, now=80.0) - 300.0) < 0.3
    assert s.ttfb[G0][2] == 80


def test_an_estimate_not_refreshed_for_max_age_is_forgotten():
    s = RttScorer("s", RttScorerParameters(maxAgeS=10), None)
    s.observe(G0, 500.0, now=0.0)
    assert s.ttfb_ms(G0, now=10.0) == 500.0 and s.ttfb_ms(G0, now=10.5) is None
    s.observe(G0, 20.0, now=11.0)  # after the gap: a fresh start, not an average with the old value
    assert s.ttfb_ms(G0, now=11.0) == 20.0 and s.ttfb[G0][2] == 1
    s.observe(G0, float("nan"), now=12.0)
    s.observe(G0, -1.0, now=12.0)
    assert s.ttfb[G0][2] == 1


def test_the_observer_is_registered_kept_across_reloads_and_removed_on_close():
    b = rtt("{source: ttfb}")
    s = plugin(b, "s")
    assert s.on_done in b.runtime.lifecycle.observers
    finish(b, G0, 0.040)
    b.reload(fleet("    - {name: s, type: rtt-scorer, parameters: {source: ttfb, alpha: 0.5}}\n"
                   "    - {type: max-score-picker, parameters: {fallbacks: 3}}\n",
                   "[{pluginRef: s}, {pluginRef: max-score-picker}]"))
    assert plugin(b, "s") is s and s.ttfb_ms(G0) == pytest.approx(40.0) and s.params.alpha == 0.5
    b.reload(fleet("    - {type: random-picker}\n", "[{pluginRef: random-picker}]"), generation=3)
    assert s.on_done not in b.runtime.lifecycle.observers
    rt = Runtime()
    RttScorer("x", RttScorerParameters(), rt).close()
    assert len(rt.lifecycle.observers) == 1  # the runtime's own release only


@pytest.mark.parametrize("params, message", [
    ("{source: kernel}", "spec.plugins[0].parameters.source"),
    ("{alpha: 0}", "spec.plugins[0].parameters.alpha"),
    ("{alpha: 1.5}", "spec.plugins[0].parameters.alpha"),
    ("{maxAgeS: 0}", "spec.plugins[0].parameters.maxAgeS"),
    ("{staleAfterS: -1}", "spec.plugins[0].parameters.staleAfterS"),
    ("{unknownScore: 2}", "spec.plugins[0].parameters.unknownScore"),
    ("{snapshot: ''}", "spec.plugins[0].parameters.snapshot"),
    ("{maxAge: 5}", "spec.plugins[0].parameters.maxAge: unknown parameter"),
])
def test_parameters_are_strict(params, message):
    with pytest.raises(ConfigError) as e:
        load_text(fleet(f"    - {{name: s, type: rtt-scorer, parameters: {params}}}\n", "[{pluginRef: s}]"), "c.yaml")
    assert message in str(e.value)
