"""SLO windows (extproc/qos/slo.py) and the engine that closes them (extproc/qos/engine.py), with an
injected clock: per-request measurement, per-window and horizon attainment, deviation and the matrix's
hysteresis, windows closed lazily (empty ones included), the per-worker status files added up."""

from __future__ import annotations

import json

import pytest

from backends.base import Usage
from extproc.config.loader import load_text
from extproc.lifecycle import Completion
from extproc.qos.engine import QosRuntime, aggregate, qos_of
from extproc.qos.slo import Sample, Slo, SloState, SloWindows, measure, p99
from extproc.request import InferenceRequest
from extproc.types import Outcome, RequestState


def slo(**kw) -> Slo:
    base = dict(name="s", route=None, tenant=None, priority_class=None, ttft=None, tpot=None, e2e=None,
                error_rate=None, target=99.0)
    return Slo(**{**base, **kw})


def state(started=10.0, first_body=None, duration=None, stream=False, usage=None) -> RequestState:
    st = RequestState(snapshot=None, route=None, started=started)
    st.request = InferenceRequest(api="openai.chat", stream=stream)
    st.first_body = first_body
    st.usage = usage
    if duration is not None:
        st.completion = Completion(status=200, duration=duration)
    return st


def test_measure_takes_ttft_tpot_and_e2e_from_the_lifecycle():
    s = measure(state(first_body=10.2, duration=1.2, stream=True, usage=Usage(5, 11)), Outcome.OK, now=99.0)
    assert s.ttft == pytest.approx(0.2) and s.e2e == 1.2 and s.error is False
    assert s.tpot == pytest.approx((1.2 - 0.2) / 10)


def test_measure_without_a_completion_uses_now_and_no_ttft_for_unstreamed():
    s = measure(state(started=10.0), Outcome.OK, now=10.25)
    assert s == Sample(e2e=0.25, error=False)


@pytest.mark.parametrize("outcome, error", [(Outcome.BACKEND_ERROR, True), (Outcome.TIMEOUT, True),
                                            (Outcome.TRUNCATED, True)])
def test_backend_failures_are_errors_and_not_latency_samples(outcome, error):
    assert measure(state(duration=5.0), outcome, now=0) == Sample(error=error)


@pytest.mark.parametrize("outcome", [Outcome.REJECTED, Outcome.CANCELLED])
def test_refusals_and_client_cancels_say_nothing_about_service(outcome):
    assert measure(state(duration=5.0), outcome, now=0) is None


def test_p99_is_nearest_rank():
    assert p99([]) is None
    assert p99([3.0]) == 3.0
    assert p99([float(i) for i in range(1, 101)]) == 99.0
    assert p99([float(i) for i in range(1, 201)]) == 198.0


def test_attainment_per_objective_and_deviation_in_points():
    st = SloState(slo(ttft=0.5, e2e=2.0, error_rate=1.0, target=90.0), horizon=10)
    for i in range(10):  # 8 of 10 TTFTs within 0.5 s, 10 of 10 e2e, 1 error in 11
        st.add(Sample(ttft=0.4 if i < 8 else 0.6, e2e=1.0, error=False))
    st.add(Sample(error=True))
    w = st.close(0)
    assert dict(w.counted) == {"ttft": 10, "e2e": 10, "error": 11}
    assert dict(w.met) == {"ttft": 8, "e2e": 10, "error": 10}
    assert w.p99 == 1.0
    assert st.attainment() == {"ttft": (8, 10), "e2e": (10, 10), "error": (10, 11)}
    # ttft: 80 - 90 = -10; e2e: 100 - 90 = +10; error: 90.909 - 99 = -8.09; the worst is -10
    assert st.deviation() == pytest.approx(-10.0)


def test_the_horizon_drops_old_windows():
    st = SloState(slo(e2e=1.0), horizon=2)
    st.add(Sample(e2e=5.0))
    st.close(0)
    st.add(Sample(e2e=0.1))
    st.close(1)
    assert st.attainment() == {"e2e": (1, 2)}
    st.close(2)  # empty
    assert st.attainment() == {"e2e": (1, 1)}
    st.close(3)
    assert st.attainment() == {"e2e": (0, 0)} and st.deviation() is None
    assert st.totals[1]["e2e"] == 2  # the counters since start keep everything


def test_escalation_has_hysteresis_between_below_and_recover():
    st = SloState(slo(e2e=1.0, target=99.0), horizon=1)

    def window(met, total):
        for i in range(total):
            st.add(Sample(e2e=0.5 if i < met else 2.0))
        st.close(0)
        return st.update_escalation(-5.0, -2.0)

    assert window(95, 100) is False  # -4: not below -5
    assert window(93, 100) is True  # -6
    assert window(96, 100) is True  # -3: between: stays escalated
    assert window(97, 100) is False  # -2: back inside the ±2 band
    assert window(96, 100) is False  # -3 from below: not escalated either (hysteresis)


def test_windows_select_by_route_tenant_and_class():
    w = SloWindows()
    w.configure([slo(name="a", route="r1", e2e=1.0), slo(name="b", tenant="t", e2e=1.0),
                 slo(name="c", priority_class="P0", e2e=1.0), slo(name="all", e2e=1.0)], horizon=5)
    w.record(Sample(e2e=0.1), "r1", "t", "P1")
    w.record(Sample(e2e=0.1), "r2", None, "P0")
    counts = {n: st.current.counted["e2e"] for n, st in w.states.items()}
    assert counts == {"a": 1, "b": 1, "c": 1, "all": 2}


CONFIG = """
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: q}
spec:
  tenants: [{id: tenant-a}]
  backends: [{name: llm, endpoints: ["127.0.0.1:9"], models: [m]}]
  routes: [{path: /v1/, match: prefix, kind: openai, name: api}]
  qos:
    window: 100ms
    matrix: {horizon: 2}
    slos: [{name: chat, route: api, p99: 1s}]
"""


class Clock:
    def __init__(self, t=0.0):
        self.t = t

    def __call__(self):
        return self.t


def test_the_engine_closes_windows_lazily_and_escalates_on_deviation(tmp_path):
    cfg = qos_of(load_text(CONFIG, "q.yaml"))
    clock = Clock(100.0)
    q = QosRuntime(0, str(tmp_path), clock=clock)
    q.configure(cfg)
    q.advance()  # the first window opens at 100.0 s
    for _ in range(10):
        q.record(Sample(e2e=3.0, error=False), "api", None, "P1")
    assert q.windows_closed == 0 and not q.escalated("api", None, "P1")
    clock.t = 100.1
    q.advance()
    assert q.windows_closed == 1 and q.escalated("api", None, "P1")  # 0 % attained: -99 points
    assert q.metrics.slo_requests.labels("chat", "e2e", "missed")._value.get() == 10
    doc = json.loads((tmp_path / "qos-0.json").read_text())
    assert doc["slos"]["chat"]["horizon"]["e2e"] == {"met": 0, "counted": 10} and doc["slos"]["chat"]["escalated"]
    clock.t = 100.35  # three windows later: the horizon (2) holds only empty ones
    q.advance()
    assert q.windows_closed == 4 and not q.escalated("api", None, "P1")
    clock.t = 1000.0  # a long idle gap closes at most the look-back, not 9000 windows
    q.advance()
    assert q.windows_closed < 40


def test_a_reload_keeps_unchanged_slos_windows():
    cfg = qos_of(load_text(CONFIG, "q.yaml"))
    q = QosRuntime(clock=Clock(0.0))
    q.configure(cfg)
    q.record(Sample(e2e=0.1, error=False), "api", None, "P1")
    kept = q.slo.states["chat"]
    q.configure(qos_of(load_text(CONFIG.replace("v1/", "v1/", 1), "q.yaml")))
    assert q.slo.states["chat"] is kept
    q.configure(qos_of(load_text(CONFIG.replace("p99: 1s", "p99: 2s"), "q.yaml")))
    assert q.slo.states["chat"] is not kept


def test_status_adds_up_the_workers_files(tmp_path):
    cfg = qos_of(load_text(CONFIG, "q.yaml"))
    for worker, (met, total) in enumerate([(10, 10), (0, 10)]):
        q = QosRuntime(worker, str(tmp_path), clock=Clock(0.0))
        q.configure(cfg)
        for i in range(total):
            q.record(Sample(e2e=0.5 if i < met else 5.0, error=False), "api", None, "P1")
        q.slo.close(0, -5.0, -2.0)
        q.publish()
    agg = aggregate(str(tmp_path))
    assert [w["worker"] for w in agg["workers"]] == [0, 1]
    chat = agg["slos"]["chat"]
    assert chat["horizon"]["e2e"] == {"met": 10, "counted": 20, "attainment": 0.5}
    assert chat["deviation"] == pytest.approx(50.0 - 99.0)
    assert chat["escalated_workers"] == [1]
    assert aggregate(str(tmp_path / "none")) is None


def test_status_pretty_shows_attainment_deviation_and_breakers(tmp_path):
    from extproc.status_cli import pretty

    cfg = qos_of(load_text(CONFIG.replace("  tenants: [{id: tenant-a}]", "  tenants: [{id: tenant-a}]").replace(
        "    slos:", "    tenants: [{tenant: tenant-a, glitchThreshold: 8.5ms}]\n    slos:"), "q.yaml"))
    q = QosRuntime(3, str(tmp_path), clock=Clock(0.0))
    q.configure(cfg)
    for i in range(4):
        q.record(Sample(e2e=0.5 if i else 5.0, error=False), "api", "tenant-a", "P1")
    q.slo.close(0, -5.0, -2.0)
    for i in range(3):
        q.record(Sample(e2e=0.02, error=False), "api", "tenant-a", "P1")
        q.breaker.close(i)
    q.publish()
    text = pretty({"config": {"workers": []}, "qos": aggregate(str(tmp_path))})
    assert "slo chat: e2e 75.0% of 4 (target 99.0%); deviation -24.0 points; matrix escalated in workers [3]" in text
    assert ("tenant tenant-a: glitch breaker SHEDDING (breaker open in workers [3]); last window P99 20.00 ms "
            "(threshold 8.5 ms), trips 1") in text
