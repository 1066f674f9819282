"""Timeouts end to end through a real Envoy: the ext_proc message timeout and each route's `policy.timeout`.

- `spec.processor.messageTimeout`: Envoy waits that long for each processor reply, then answers 504
  (docs/config.md; docs/operations.md names the code `ext_proc_error_per-message_timeout_exceeded`).
  The processor is made slow for real: its only worker is stopped with SIGSTOP (Envoy's stream is
  open, nothing answers) and continued with SIGCONT afterwards.
- `routes[].policy.timeout`: the Envoy route timeout of the backend request. A simulator decoding
  slowly (`--decode-tokens-per-s`) is slower than one route's timeout and faster than another's.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from tests.e2e.conftest import metric_sum, wait_metric

pytestmark = pytest.mark.e2e

CONFIG = """
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: timeouts}
spec:
  modelRef: qwen2.5-finance
  processor: {messageTimeout: 500ms}
  backends: [{name: llm, endpoints: ["llm.invalid:8000"]}]
  routes:
    - {path: /v1/quick, target: llm, transform: '{"a": $.output.a}', policy: {timeout: 300ms}}
    - {path: /v1/patient, target: llm, transform: '{"a": $.output.a}', policy: {timeout: 30s}}
"""


def _config(tmp_path) -> str:
    path = tmp_path / "timeouts.yaml"
    path.write_text(CONFIG)
    return str(path)


def _route_timeouts(st) -> dict[str, str]:
    """What the running Envoy holds: route name -> its route timeout (from the admin config dump)."""
    dump = httpx.get(f"{st.admin_url}/config_dump", params={"resource": "dynamic_route_configs"}, timeout=5).json()
    out = {}
    for cfg in dump["configs"]:
        for vhost in cfg["route_config"]["virtual_hosts"]:
            for route in vhost["routes"]:
                if "route" in route and "timeout" in route["route"]:
                    out[route["name"]] = route["route"]["timeout"]
    return out


def _ext_proc_message_timeouts(st) -> list[str]:
    """The running Envoy's ext_proc filter settings (admin config dump of its listeners)."""
    dump = httpx.get(f"{st.admin_url}/config_dump", params={"resource": "dynamic_listeners"}, timeout=5).json()
    found = []

    def walk(node):
        if isinstance(node, dict):
            if node.get("name") == "envoy.filters.http.ext_proc" and "typed_config" in node:
                found.append(node["typed_config"]["message_timeout"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(dump)
    return found


def until_ok(st, within: float = 15.0) -> httpx.Response:
    """POST /v1/patient until it is answered 200 (a busy machine may stall a worker past 500 ms too)."""
    deadline = time.monotonic() + within
    while (r := httpx.post(f"{st.url}/v1/patient", json={"query": "q"}, timeout=10)).status_code != 200:
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return r


def test_a_stalled_processor_gets_504_after_the_message_timeout(stack_factory, tmp_path):
    st = stack_factory(_config(tmp_path), workers=1, simulate=True)
    assert _ext_proc_message_timeouts(st) == ["0.500s"]
    assert until_ok(st).status_code == 200
    (worker,) = st.supervisor.pids
    os.kill(worker, signal.SIGSTOP)
    try:
        stalled = httpx.post(f"{st.url}/v1/patient", json={"query": "q"}, timeout=10)
    finally:
        os.kill(worker, signal.SIGCONT)
    assert stalled.status_code == 504, stalled.text
    err = stalled.json()["error"]
    assert err["status"] == 504 and err["code"] == "ext_proc_error_per-message_timeout_exceeded"
    assert err["route"] == "v1-patient"
    # the worker was only stalled: once continued it answers again (Envoy's health check recovers)
    r = until_ok(st)
    assert r.status_code == 200 and set(r.json()) == {"a"}


def test_each_route_has_its_own_backend_timeout(stack_factory, tmp_path):
    # 2 tokens/s: the structured answer (several 4-character tokens) takes seconds
    st = stack_factory(_config(tmp_path), workers=1, simulate=True,
                       simulator_args=("--decode-tokens-per-s", "2"))
    timeouts = _route_timeouts(st)
    assert timeouts["v1-quick--llm"] == "0.300s" and timeouts["v1-quick"] == "0.300s"
    assert timeouts["v1-patient--llm"] == "30s" and timeouts["v1-patient"] == "30s"

    quick = httpx.post(f"{st.url}/v1/quick", json={"query": "q"}, timeout=20)
    assert quick.status_code == 504, quick.text
    err = quick.json()["error"]  # Envoy's reply in the adapter dialect: status, code, message, backend, route
    assert err["status"] == 504 and err["code"] == "response_timeout"
    assert err["backend"] == "llm" and err["route"] == "v1-quick--llm" and err["request_id"]
    metrics = f"{st.processor_admin_url}/metrics"
    assert wait_metric(metrics, "adapter_processor_requests_total", 1, route="v1-quick", outcome="timeout") == 1

    patient = httpx.post(f"{st.url}/v1/patient", json={"query": "q"}, timeout=30)  # the same answer, in time
    assert patient.status_code == 200 and set(patient.json()) == {"a"}
    assert wait_metric(metrics, "adapter_processor_requests_total", 1, route="v1-patient", outcome="ok") == 1
    assert metric_sum(metrics, "adapter_processor_requests_total", route="v1-patient", outcome="timeout") == 0
