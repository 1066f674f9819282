"""The glitch breaker through the real Envoy (extproc/qos/breaker.py, extproc/stages/qos_admit.py).

tenant-a's requests take longer than its 1 ms glitch threshold (the simulator decodes at 200 tokens/s),
so after 3 windows in a row its non-critical requests get 429 `tenant_glitch` with Retry-After in the
route's dialect (the OpenAI error object), while its critical (P0) requests and tenant-b (threshold 60 s)
are served; the breaker and the SLO's attainment show in the metrics and `adapterctl status`; once tenant-a stops sending slow
traffic, the breaker closes after its recovery windows and its requests are served again. One worker, so
the one breaker is the gateway's (each worker judges its own share otherwise: docs/qos.md).
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from extproc.cli import main

pytestmark = pytest.mark.e2e

CONFIG = """
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: qos-breaker}
spec:
  modelRef: qwen2.5-finance
  tenants: [{id: tenant-a}, {id: tenant-b}]
  backends: [{name: llm, endpoints: ["llm.invalid:8000"]}]
  routes:
    - {path: /v1/, match: prefix, kind: openai, name: api}
  qos:
    routes: [{route: api, objectiveHeader: x-gateway-inference-objective}]
    tenants: [{tenant: tenant-a, glitchThreshold: 1ms}, {tenant: tenant-b, glitchThreshold: 60s}]
    breaker: {windows: 3, recoveryWindows: 10, retryAfter: 2}
    slos: [{name: chat, route: api, p99: 60s, errorRate: 1}]
"""


def chat(st, tenant: str, objective: str | None = None) -> httpx.Response:
    headers = {"x-tenant-id": tenant}
    if objective:
        headers["x-gateway-inference-objective"] = objective
    return httpx.post(f"{st.url}/v1/chat/completions", headers=headers, timeout=10,
                      json={"model": "qwen2.5-finance", "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 4})


def status(st, capsys) -> dict:
    code = main(["status", "--json", "--admin", st.processor_admin_url])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)["qos"]


def test_a_spiking_tenant_is_shed_then_recovers(stack_factory, tmp_path, capsys):
    cfg = tmp_path / "qos.yaml"
    cfg.write_text(CONFIG)
    st = stack_factory(cfg, workers=1, simulate=True, simulator_args=("--decode-tokens-per-s", "200"))
    shed = None
    for _ in range(300):  # each request is a slow sample; three windows of them trip the breaker
        assert chat(st, "tenant-a", "P0").status_code == 200
        r = chat(st, "tenant-a")
        if r.status_code == 429:
            shed = r
            break
        assert r.status_code == 200, r.text
    assert shed is not None, "the breaker never opened"
    assert shed.headers["retry-after"] == "2"
    err = shed.json()["error"]
    assert err["code"] == "tenant_glitch" and err["type"] and "tenant-a" in err["message"]
    # while open: critical requests and the other tenant are served
    assert chat(st, "tenant-a", "P0").status_code == 200
    assert chat(st, "tenant-b").status_code == 200
    assert chat(st, "tenant-a", "P2").status_code == 429
    metrics = httpx.get(f"{st.processor_admin_url}/metrics", timeout=5).text
    assert 'adapter_qos_breaker_trips_total{tenant="tenant-a"} 1.0' in metrics
    assert 'adapter_qos_shed_total{route="api",tenant="tenant-a"}' in metrics
    assert 'adapter_qos_slo_requests_total{objective="e2e",result="met",slo="chat"}' in metrics
    # adapterctl status: published at most every 0.5 s; keep the spike going until it shows
    deadline = time.monotonic() + 10
    while True:
        assert chat(st, "tenant-a", "P0").status_code == 200
        doc = status(st, capsys)
        if doc["tenants"].get("tenant-a", {}).get("open") or time.monotonic() > deadline:
            break
    assert doc["tenants"]["tenant-a"]["open"] and doc["tenants"]["tenant-a"]["open_workers"] == [0]
    assert not doc["tenants"]["tenant-b"]["open"]
    chat_slo = doc["slos"]["chat"]  # every served request within 60 s and none failed; shed ones not counted
    assert chat_slo["total"]["e2e"]["counted"] > 0 and chat_slo["total"]["e2e"]["attainment"] == 1.0
    assert chat_slo["total"]["error"]["attainment"] == 1.0 and chat_slo["escalated_workers"] == []
    # the spike passes: no more slow tenant-a traffic; shed probes are no samples, quiet windows are calm
    deadline = time.monotonic() + 20
    while True:
        r = chat(st, "tenant-a")
        if r.status_code != 429 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert r.status_code == 200, r.text
