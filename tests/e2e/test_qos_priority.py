"""Priority classes reach the engine through the real Envoy (extproc/stages/qos_admit.py, qos_engine.py).

Asserted at the backend: the simulator records the `priority` each request was queued with
(`GET /simulator/requests`). The class comes from the trusted `x-gateway-inference-objective` header
(a class or an objective name) or the default class, and replaces the client's own `priority`. The
simulator mirrors vLLM's `--scheduling-policy`: started with `fcfs`, a non-zero priority is a 400, which
is why a backend is listed in `spec.qos.enginePriority` only when its engine runs the priority policy.
"""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.e2e

CONFIG = """
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: qos-priority}
spec:
  modelRef: qwen2.5-finance
  backends: [{name: llm, endpoints: ["llm.invalid:8000"]}]
  routes:
    - {path: /v1/, match: prefix, kind: openai, name: api}
  qos:
    enginePriority: [llm]
    objectives: {premium-chat: P0, nightly-batch: P2}
    routes: [{route: api, objectiveHeader: x-gateway-inference-objective}]
"""
HEADER = "x-gateway-inference-objective"


def chat(st, objective: str | None, stream: bool = False, **extra) -> httpx.Response:
    headers = {HEADER: objective} if objective else {}
    return httpx.post(f"{st.url}/v1/chat/completions", headers=headers, timeout=10,
                      json={"model": "qwen2.5-finance", "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 2, "stream": stream, **extra})


def recorded(st) -> list[int]:
    _, port = st.simulators["llm"]
    seen = httpx.get(f"http://127.0.0.1:{port}/simulator/requests", timeout=5).json()["requests"]
    return [r.get("priority") for r in seen if r["path"] == "/v1/chat/completions"]


def test_the_class_priority_reaches_a_priority_scheduling_engine(stack_factory, tmp_path):
    cfg = tmp_path / "qos.yaml"
    cfg.write_text(CONFIG)
    st = stack_factory(cfg, workers=1, simulate=True, simulator_args=("--scheduling-policy", "priority"))
    before = len(recorded(st))  # requests the gateway itself may have sent at start (dialect probes)
    for objective, extra in [("P0", {}), ("nightly-batch", {}), (None, {}), ("P2", {"priority": -50}),
                             ("no-such-objective", {})]:
        r = chat(st, objective, **extra)
        assert r.status_code == 200, r.text
    r = chat(st, "premium-chat", stream=True)
    assert r.status_code == 200 and "data: [DONE]" in r.text
    # P0 -> 0, P2 -> 2, default P1 -> 1, the client's -50 replaced, an unknown objective: the default
    assert recorded(st)[before:] == [0, 2, 1, 2, 1, 0]


def test_an_fcfs_engine_refuses_a_non_zero_priority_like_vllm(stack_factory, tmp_path):
    cfg = tmp_path / "qos.yaml"
    cfg.write_text(CONFIG)
    st = stack_factory(cfg, workers=1, simulate=True, simulator_args=("--scheduling-policy", "fcfs"))
    before = len(recorded(st))
    assert chat(st, "P0").status_code == 200  # priority 0: what vLLM accepts without the policy
    r = chat(st, "P2")
    assert r.status_code == 400, r.text
    assert "Got priority 2 but Priority scheduling is not enabled." in r.json()["error"]["message"]
    assert [p for p in recorded(st)[before:] if p is not None] == [0]  # the refused one never queued
