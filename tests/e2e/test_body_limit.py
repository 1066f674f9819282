"""`policy.maxBodyBytes` on a chunked request (no content-length) end to end: 413, and nothing reaches the backend.

A declared content-length is refused at request headers (tests/e2e/test_faults.py); a chunked body
declares nothing, so the route's limit is enforced on the buffered body, by `parse-json` (llm
routes) and `openai-parse` (openai routes). Above the listener-wide buffer (the largest route limit,
at least 64 KiB) Envoy answers 413 itself. What the backend received is read from the simulator
(`GET /simulator/requests`).
"""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.e2e

CONFIG = """
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: body-limit}
spec:
  modelRef: qwen2.5-finance
  backends: [{name: llm, endpoints: ["llm.invalid:8000"]}]
  routes:
    - {path: /v1/small, target: llm, transform: '{"a": $.output.a}', policy: {maxBodyBytes: 1Ki}}
    - {path: /v1/, match: prefix, kind: openai, policy: {maxBodyBytes: 1Ki}}
"""


def chunked(body: bytes, piece: int = 512):
    """The body as an iterator: httpx sends it with transfer-encoding chunked and no content-length."""
    return (body[i:i + piece] for i in range(0, len(body), piece))


def received(st) -> list[dict]:
    _, port = st.simulators["llm"]
    seen = httpx.get(f"http://127.0.0.1:{port}/simulator/requests", timeout=5).json()["requests"]
    return [r for r in seen if r["path"].startswith("/v1/")]


def test_a_chunked_body_over_the_route_limit_is_413_and_never_reaches_the_backend(stack_factory, tmp_path):
    cfg = tmp_path / "body-limit.yaml"
    cfg.write_text(CONFIG)
    st = stack_factory(cfg, workers=1, simulate=True)

    big_doc = b'{"query": "' + b"x" * 4096 + b'"}'
    r = httpx.post(f"{st.url}/v1/small", content=chunked(big_doc), timeout=10)
    assert r.request.headers.get("transfer-encoding") == "chunked" and "content-length" not in r.request.headers
    assert r.status_code == 413, r.text
    err = r.json()["error"]  # the adapter dialect
    assert err["code"] == "body_too_large" and err["limit"] == 1024 and err["route"] == "v1-small"
    assert f"{len(big_doc)} bytes" in err["message"]

    big_chat = (b'{"model": "qwen2.5-finance", "max_tokens": 2, "messages": [{"role": "user", "content": "'
                + b"x" * 4096 + b'"}]}')
    r = httpx.post(f"{st.url}/v1/chat/completions", content=chunked(big_chat), timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    err = r.json()["error"]  # the openai dialect
    assert err["code"] == "body_too_large" and err["type"] == "invalid_request_error" and err["limit"] == 1024

    # above Envoy's buffer (64 KiB here) Envoy refuses it itself
    r = httpx.post(f"{st.url}/v1/small", content=chunked(b'{"query": "' + b"x" * 200_000 + b'"}', 8192),
                   timeout=10)
    assert r.status_code == 413, r.text
    err = r.json()["error"]  # Envoy's own reply: it never buffered the body for the processor
    assert err["code"] == "request_payload_too_large" and err["route"] == "v1-small", err
    assert received(st) == []  # none of them reached the backend

    # the same routes take chunked bodies within the limit, and those do reach it
    ok = httpx.post(f"{st.url}/v1/small", content=chunked(b'{"query": "' + b"x" * 600 + b'"}'), timeout=10)
    assert ok.status_code == 200 and set(ok.json()) == {"a"}
    chat = (b'{"model": "qwen2.5-finance", "max_tokens": 2, "messages": [{"role": "user", "content": "'
            + b"x" * 600 + b'"}]}')
    ok = httpx.post(f"{st.url}/v1/chat/completions", content=chunked(chat), timeout=10,
                    headers={"content-type": "application/json"})
    assert ok.status_code == 200 and ok.json()["object"] == "chat.completion"
    got = received(st)
    assert [r["path"] for r in got] == ["/v1/chat/completions", "/v1/chat/completions"]
    assert got[1]["body_bytes"] == len(chat)  # forwarded as the client sent it
