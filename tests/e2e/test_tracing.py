"""Tracing through the real Envoy and processor, into a real OTLP/gRPC receiver the test starts.

Envoy (`envoy.tracers.opentelemetry`, rendered from `spec.tracing`) and both processor workers
export to `tests/otlp_receiver.py` on a free port; an openai route picks between two OpenAI-API
simulators with a scheduling profile. Checked on the spans received:
- the client's `traceparent` is continued: Envoy's server span has the client's trace id and span
  as its parent, and every processor span is in the same trace;
- each processor phase span's parent is a span Envoy exported (its ext_proc gRPC client span, under
  the server span): Envoy propagates the trace to the ext_proc stream in its gRPC metadata
  (`adapter.trace_parent` = grpc-metadata on the phase spans);
- stage spans are children of phase spans; the scheduling decision is a child of the dispatch
  stage span with the chosen endpoint and the candidates count, and Envoy's upstream span
  (`router pool egress`) went to that endpoint;
- a request without `traceparent` gets a new trace from Envoy that the processor's spans join;
- with the collector stopped, requests are still answered (nothing blocks on export).
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_scheduling_profiles import Simulator
from tests.e2e.test_xds_live import procs  # noqa: F401  (a fixture: started processes, stopped by handle)
from tests.otlp_receiver import OtlpReceiver

pytestmark = pytest.mark.e2e

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
SERVER, CLIENT = 2, 3  # OTLP SpanKind


@pytest.fixture
def receiver():
    r = OtlpReceiver()
    yield r
    r.stop()


def write(path: Path, sims: list[Simulator], collector: str) -> Path:
    doc = {
        "apiVersion": "adapter.ai/v1", "kind": "AdapterGateway", "metadata": {"name": "traced"},
        "spec": {
            "backends": [{"name": "pool", "models": ["m"], "endpoints": [s.id for s in sims]}],
            "plugins": [{"type": "in-flight-scorer"}, {"type": "max-score-picker", "parameters": {"fallbacks": 1}}],
            "schedulingProfiles": [{"name": "spread", "plugins": [{"pluginRef": "in-flight-scorer"},
                                                                  {"pluginRef": "max-score-picker"}]}],
            "routes": [{"path": "/v1/", "match": "prefix", "kind": "openai", "targets": ["pool"],
                        "plugins": ["spread"]}],
            "tracing": {"endpoint": collector, "samplingRatio": 1.0, "exportTimeout": "1s"},
        },
    }
    path.write_text(json.dumps(doc, indent=1))  # JSON is YAML
    return path


def _has_decision(trace_id: str):
    def pred(spans) -> bool:
        mine = [s for s in spans if s.trace_id == trace_id]
        return (any(s.name == "scheduling decision" for s in mine)
                and any(s.service == "adapter-gateway-envoy" and s.kind == SERVER for s in mine))
    return pred


def test_one_trace_from_the_client_through_envoy_and_the_processor(tmp_path, procs, receiver, stack_factory):
    sims = [Simulator(procs), Simulator(procs)]
    st = stack_factory(write(tmp_path / "gw.yaml", sims, receiver.address), workers=2, run_dir=str(tmp_path / "run"))
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    r = httpx.post(f"{st.url}/v1/chat/completions", json=CHAT, timeout=10,
                   headers={"traceparent": f"00-{trace_id}-{client_span}-01"})
    assert r.status_code == 200, r.text
    spans = receiver.wait(_has_decision(trace_id), timeout=30)
    mine = [s for s in spans if s.trace_id == trace_id]
    by_id = {s.span_id: s for s in mine}
    envoy = [s for s in mine if s.service == "adapter-gateway-envoy"]
    proc = [s for s in mine if s.service == "adapter-gateway-processor"]
    [server] = [s for s in envoy if s.kind == SERVER]
    assert server.parent_id == client_span  # Envoy continued the client's trace
    phases = [s for s in proc if s.name.startswith("ext_proc ")]
    assert {p.attributes["adapter.phase"] for p in phases} >= {"request_headers", "request_body"}
    for p in phases:
        parent = by_id.get(p.parent_id)
        assert parent is not None and parent.service == "adapter-gateway-envoy", (p, parent)
        assert parent.kind == CLIENT and parent.parent_id == server.span_id, parent  # Envoy's ext_proc call
        assert "ExternalProcessor" in parent.name, parent.name
        assert p.attributes["adapter.trace_parent"] == "grpc-metadata"
    for s in proc:
        if s.name.startswith("stage "):
            assert by_id[s.parent_id].name.startswith("ext_proc "), s
    [decision] = [s for s in proc if s.name == "scheduling decision"]
    assert by_id[decision.parent_id].name == "stage dispatch"
    assert decision.attributes["adapter.scheduling.candidates"] == 2
    assert decision.attributes["adapter.scheduling.endpoint"] in {s.id for s in sims}
    # Envoy's upstream span (spawn_upstream_span: "router pool egress") went to the endpoint the decision chose
    [upstream] = [s for s in envoy if s.kind == CLIENT and "ExternalProcessor" not in s.name]
    assert upstream.parent_id == server.span_id and upstream.attributes["upstream_cluster"] == "pool"
    assert upstream.attributes["upstream_address"] == decision.attributes["adapter.scheduling.endpoint"]

    # no traceparent from the client: Envoy starts the trace, the processor's spans join it
    r = httpx.post(f"{st.url}/v1/chat/completions", json=CHAT, timeout=10)
    assert r.status_code == 200
    before = {s.trace_id for s in spans}
    spans = receiver.wait(lambda got: any(s.trace_id not in before and s.name == "scheduling decision"
                                          for s in got), timeout=30)
    [new] = {s.trace_id for s in spans if s.trace_id not in before and s.name == "scheduling decision"}
    spans = receiver.wait(_has_decision(new), timeout=30)
    roots = [s for s in spans if s.trace_id == new and s.parent_id == ""]
    assert [s.service for s in roots] == ["adapter-gateway-envoy"], roots  # one root: Envoy's server span

    # the collector goes away: requests are answered as before
    receiver.stop()
    with httpx.Client(timeout=10) as client:
        for _ in range(20):
            r = client.post(f"{st.url}/v1/chat/completions", json=CHAT,
                            headers={"traceparent": f"00-{secrets.token_hex(16)}-{client_span}-01"})
            assert r.status_code == 200, r.text
