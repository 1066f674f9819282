"""Stages `qos-admit` and `qos-engine` (extproc/stages/qos_*.py) in process, on compiled routes with a real
Runtime and an injected clock: the class from a trusted header only where the route trusts it, the matrix
driven by the SLO windows, the glitch breaker's 429 (Retry-After, the route's dialect) and its recovery,
and the engine priority in the body the backend gets."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from extproc import codec
from extproc.config.loader import load_text
from extproc.lifecycle import Completion
from extproc.qos.priority import PRIORITY_ATTR
from extproc.runtime import Runtime
from extproc.types import HttpMessage, Mutate, Outcome, Phase, Reject, RequestState

CONFIG = """
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: q}
spec:
  tenants: [{id: tenant-a}, {id: tenant-b}, {id: tenant-c}]
  backends:
    - {name: llm, endpoints: ["127.0.0.1:9"], models: [m]}
    - {name: plain, endpoints: ["127.0.0.1:10"], models: [n]}
  routes:
    - {path: /v1/, match: prefix, kind: openai, name: api, targets: [llm, plain]}
    - {path: /batch/, match: prefix, kind: openai, name: batch, targets: [llm]}
  qos:
    enginePriority: [llm]
    objectives: {premium: P0}
    routes:
      - {route: api, objectiveHeader: x-gateway-inference-objective}
      - {route: batch, workload: throughput}
    tenants: [{tenant: tenant-a, glitchThreshold: 8.5ms}, {tenant: tenant-b, glitchThreshold: 12ms}]
    slos: [{name: api-e2e, p99: 100ms}]
    matrix: {horizon: 1}
"""


class Clock:
    t = 1000.0

    def __call__(self):
        return self.t


@pytest.fixture
def env():
    snap = load_text(CONFIG, "q.yaml")
    rt = Runtime()
    rt.install(snap)
    clock = Clock()
    rt.qos.clock = clock
    return snap, rt, clock


def run(snap, rt, route, tenant="tenant-c", header=None, body=None, started=None):
    state = RequestState(snapshot=snap, route=snap.routes[route], started=started if started is not None else 0.0,
                         request_id="rid", tenant=tenant, runtime=rt)
    rt.lifecycle.start(state)
    h = {":path": f"/{'v1' if route == 'api' else 'batch'}/chat/completions", ":method": "POST"}
    if header:
        h["x-gateway-inference-objective"] = header
    pipeline = state.route.pipeline
    v = asyncio.run(pipeline.run(state, HttpMessage(Phase.REQUEST_HEADERS, headers=h)))
    if isinstance(v, Reject) or body is None:
        return state, v
    v = asyncio.run(pipeline.run(state, HttpMessage(Phase.REQUEST_BODY, body=orjson.dumps(body), end_of_stream=True)))
    return state, v


def finish(rt, state, duration, outcome_status=200):
    state.completion = Completion(status=outcome_status, duration=duration)
    state.response_status = outcome_status
    state.complete = True
    rt.lifecycle.stream_ended(state, "end")


def test_the_class_comes_from_the_trusted_header_only_where_trusted(env):
    snap, rt, _ = env
    st, _ = run(snap, rt, "api", header="premium")
    assert st.attrs[PRIORITY_ATTR].name == "P0"
    st, _ = run(snap, rt, "api", header="P2")
    assert st.attrs[PRIORITY_ATTR].name == "P2"
    st, _ = run(snap, rt, "batch", header="P0")  # batch trusts no header
    assert st.attrs[PRIORITY_ATTR].name == "P1"


def test_the_engine_gets_the_class_priority_on_backends_that_take_one(env):
    snap, rt, _ = env
    st, v = run(snap, rt, "api", header="P2", body={"model": "m", "messages": [], "priority": -9, "stream": True})
    assert isinstance(v, Mutate)
    sent = orjson.loads(v.body)
    assert sent["priority"] == 2 and sent["stream_options"] == {"include_usage": True}  # openai-parse's too
    assert ("content-length", str(len(v.body))) == [h for h in v.set_headers if h[0] == "content-length"][-1]
    # a backend not listed in enginePriority: the body is the client's
    st, v = run(snap, rt, "api", header="P2", body={"model": "n", "messages": [], "priority": -9})
    assert isinstance(v, Mutate) and v.body is None and st.target.name == "plain"


def test_the_matrix_raises_latency_work_and_lowers_throughput_work_while_the_slo_misses(env):
    snap, rt, clock = env
    st, _ = run(snap, rt, "api", started=clock.t)
    assert st.attrs[PRIORITY_ATTR].name == "P1"
    for _ in range(5):  # every request far over the SLO's 100 ms
        s, _ = run(snap, rt, "api", started=clock.t)
        finish(rt, s, 1.0)
    clock.t += 0.1  # the window closes: attainment 0 %, deviation -99 points
    st, _ = run(snap, rt, "api")
    assert st.attrs[PRIORITY_ATTR].name == "P0"
    st, _ = run(snap, rt, "batch")
    assert st.attrs[PRIORITY_ATTR].name == "P2"
    st, _ = run(snap, rt, "api", header="P2")  # an explicit class is not re-prioritised
    assert st.attrs[PRIORITY_ATTR].name == "P2"
    assert rt.qos.metrics.priority.labels("P0", "matrix")._value.get() >= 1
    for _ in range(5):
        s, _ = run(snap, rt, "api")
        finish(rt, s, 0.01)
    clock.t += 0.1  # a good window: back to P1 (the horizon is one window)
    st, _ = run(snap, rt, "api")
    assert st.attrs[PRIORITY_ATTR].name == "P1"


def test_the_breaker_sheds_non_critical_requests_after_three_windows_and_recovers(env):
    snap, rt, clock = env
    for w in range(3):
        s, v = run(snap, rt, "api", tenant="tenant-a")
        assert v is None or not isinstance(v, Reject), f"window {w}"
        finish(rt, s, 0.009)  # 9 ms > tenant-a's 8.5 ms
        s, _ = run(snap, rt, "api", tenant="tenant-b")
        finish(rt, s, 0.009)  # within tenant-b's 12 ms
        clock.t += 0.1
    _, v = run(snap, rt, "api", tenant="tenant-a")
    assert isinstance(v, Reject) and v.status == 429 and v.code == "tenant_glitch" and v.retry_after == 1
    resp = codec.encode(Phase.REQUEST_HEADERS, v, "openai", "api", "rid")
    ir = resp.immediate_response
    assert ir.status.code == 429
    assert {h.header.key: h.header.raw_value for h in ir.headers.set_headers}["retry-after"] == b"1"
    err = orjson.loads(ir.body)["error"]
    assert err["code"] == "tenant_glitch" and "type" in err  # the OpenAI error object
    st, v = run(snap, rt, "api", tenant="tenant-a", header="P0")  # critical: served
    assert not isinstance(v, Reject)
    _, v = run(snap, rt, "api", tenant="tenant-b")
    assert not isinstance(v, Reject)
    assert rt.qos.metrics.shed.labels("tenant-a", "api")._value.get() == 1
    assert rt.qos.view()["tenants"]["tenant-a"]["open"] is True
    finish(rt, st, 0.001)
    clock.t += 0.3  # three calm windows (one with the fast P0 request, two quiet)
    _, v = run(snap, rt, "api", tenant="tenant-a")
    assert not isinstance(v, Reject)
    assert rt.qos.view()["tenants"]["tenant-a"]["open"] is False
