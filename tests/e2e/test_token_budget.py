"""Tenant token budgets through a real Envoy: OpenAI's x-ratelimit-* headers decreasing monotonically, 429 with
Retry-After in the openai and the adapter dialect, exact-to-the-token reconciliation across a stack's two worker
processes (the memory store), and two gateways (two stacks) sharing one real redis-server: the tokens they admit
together never exceed the budget, Redis's count is exactly the usage the backend reported, and a Redis outage
fails open (requests served without budget headers, counted as store errors)."""

from __future__ import annotations

import concurrent.futures
import os
import time

import httpx
import openai
import pytest

from extproc.qos.budget_store import MemoryStore
from tests.e2e.conftest import make_stack, metric_sum
from tests.extproc.qos.test_budget_redis import needs_redis, redis_server

pytestmark = pytest.mark.e2e

MODEL = "qwen2.5-finance"


def config(path, tenants: str, store: str = "") -> str:
    # messageTimeout 10 s: under make test's parallel workers on 2 cores a processor reply once took over the
    # default 1 s and Envoy answered 504 (clean-clone run at d8eab6f); these tests count budgets, not latency
    path.write_text(f"""
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {{name: budgets}}
spec:
  modelRef: {MODEL}
  processor: {{messageTimeout: 10s}}
  {store}
  tenants:
{tenants}
  backends: [{{name: llm, endpoints: ["llm.invalid:8000"]}}]
  routes:
    - {{path: /v1/, match: prefix, kind: openai, targets: [llm]}}
    - path: /analyze
      target: llm
      transform: '{{"voucher": {{"amount": $.output.amount, "account": $.output.account}}}}'
""")
    return str(path)


def away_from_window_edge(window: int = 60, margin: float = 12.0) -> None:
    """Start a sequence of requests that must fall in one fixed window well inside it (windows are UTC
    minutes and days: a test that straddled a boundary would see a fresh budget half-way)."""
    left = window - time.time() % window
    if left < margin:
        time.sleep(left + 0.5)


def chat(stack, tenant: str, content: str = "hello budget", max_tokens: int | None = 8, stream: bool = False, **kw):
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return httpx.post(f"{stack.url}/v1/chat/completions", json=body, headers={"x-tenant-id": tenant}, timeout=20, **kw)


def usage_of(r: httpx.Response) -> int:
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        import json

        total = 0
        for line in r.text.splitlines():
            if line.startswith("data: {") and '"usage"' in line:
                u = json.loads(line[6:]).get("usage")
                if u:
                    total = u["prompt_tokens"] + u["completion_tokens"]
        return total
    u = r.json()["usage"]
    return u["prompt_tokens"] + u["completion_tokens"]


def wait_for(fn, expect, timeout: float = 15.0):
    """fn() until it returns `expect` (reconciliation runs when each request's end reaches its worker); the
    last value."""
    deadline = time.monotonic() + timeout
    value = fn()
    while value != expect and time.monotonic() < deadline:
        time.sleep(0.05)
        value = fn()
    return value


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    cfg = config(tmp_path_factory.mktemp("budget") / "gateway.yaml", """
    - {id: acme, budget: {requestsPerMinute: 1000, tokensPerDay: 10000000, estimatedCompletionTokens: 100}}
    - {id: globex, budget: {requestsPerMinute: 2}}
    - {id: initech, budget: {requestsPerMinute: 1}}
    - {id: free}""")
    st = make_stack(cfg, workers=2, simulate=True, agent=False)
    st.start()
    yield st
    st.stop()


def store_tokens(stack, tenant: str) -> tuple[int, int]:
    """(requests, tokens) of today's window in the stack's shared budget file."""
    s = MemoryStore(os.path.join(stack.supervisor.feed_dir))
    try:
        _, day = s.read_sync(tenant, time.time())
        return day.requests, day.tokens
    finally:
        s.close()


def test_headers_decrease_monotonically_across_both_workers_and_usage_is_exact(stack):
    away_from_window_edge()
    seen, used = [], 0
    for i in range(8):
        # half without max_tokens: charged 100 completion tokens, the simulator writes 16: refunded at the end
        r = chat(stack, "acme", content="budget " * (i + 1), stream=i % 2 == 1, max_tokens=None if i % 4 < 2 else 8)
        assert r.status_code == 200, r.text
        h = r.headers
        assert h["x-ratelimit-limit-requests"] == "1000" and h["x-ratelimit-limit-tokens"] == "10000000"
        assert h["x-ratelimit-reset-requests"].endswith("s") and h["x-ratelimit-reset-tokens"].endswith("s")
        seen.append((int(h["x-ratelimit-remaining-requests"]), int(h["x-ratelimit-remaining-tokens"])))
        used += usage_of(r)
    requests = [a for a, _ in seen]
    tokens = [b for _, b in seen]
    assert requests == list(range(requests[0], requests[0] - 8, -1))  # one less per request, whichever worker
    assert all(a >= b for a, b in zip(tokens, tokens[1:])), tokens  # refunds never make it go back up
    assert used > 0
    # once every request's end reached its worker, today's count is exactly the usage the backend reported
    assert wait_for(lambda: store_tokens(stack, "acme"), (8, used)) == (8, used)
    # ... which is below what the headers last showed as spent (the peak): refunds happened, the header held
    assert used < 10000000 - tokens[-1]
    # adapterctl status shows the same counts
    from extproc.status_cli import gather, pretty

    doc = gather(stack.processor_admin_url)
    acme = doc["budgets"]["tenants"]["acme"]
    assert doc["budgets"]["store"] == "memory"
    assert (acme["day"]["requests"], acme["day"]["tokens"]) == (8, used) and acme["day"]["limits"] == [None, 10000000]
    assert f"acme: minute {acme['minute']['requests']}/1000 requests" in pretty(doc)


def test_exhausted_budget_is_429_in_the_openai_dialect_that_the_openai_client_raises(stack):
    away_from_window_edge()
    assert chat(stack, "globex").status_code == 200
    assert chat(stack, "globex").status_code == 200
    r = chat(stack, "globex")
    assert r.status_code == 429
    assert 1 <= int(r.headers["retry-after"]) <= 60
    assert r.headers["x-adapter-error"] == "tenant_over_budget"
    assert r.headers["x-ratelimit-remaining-requests"] == "0" and r.headers["x-ratelimit-limit-requests"] == "2"
    err = r.json()["error"]
    assert err["type"] == "rate_limit_exceeded" and err["code"] == "tenant_over_budget"
    assert err["tenant"] == "globex" and err["budget"] == "requestsPerMinute" and err["limit"] == 2
    assert "globex" in err["message"] and "requestsPerMinute" in err["message"]
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0,
                           default_headers={"x-tenant-id": "globex"})
    with pytest.raises(openai.RateLimitError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert e.value.status_code == 429 and e.value.code == "tenant_over_budget"
    # others are unaffected
    assert chat(stack, "free").status_code == 200
    assert "x-ratelimit-remaining-requests" not in chat(stack, "free").headers  # no budget: no headers


def test_exhausted_budget_is_429_in_the_adapter_dialect_on_an_llm_route(stack):
    away_from_window_edge()
    def analyze():
        return httpx.post(f"{stack.url}/analyze", json={"query": "Q3"}, headers={"x-tenant-id": "initech"}, timeout=20)
    ok = analyze()
    assert ok.status_code == 200, ok.text
    assert ok.headers["x-ratelimit-remaining-requests"] == "0"
    r = analyze()
    assert r.status_code == 429 and 1 <= int(r.headers["retry-after"]) <= 60
    err = r.json()["error"]
    assert err["status"] == 429 and err["code"] == "tenant_over_budget" and err["route"] == "analyze"
    assert err["tenant"] == "initech" and err["budget"] == "requestsPerMinute" and err["retry_after_s"] >= 1


def redis_config(tmp_path, url: str, prefix: str, budget: int) -> str:
    return config(tmp_path / f"{prefix}.yaml", f"""
    - {{id: acme, budget: {{tokensPerDay: {budget}, estimatedCompletionTokens: 40}}}}""", store=f"budgetStore: {{kind: redis, url: '{url}', "
                  f"keyPrefix: {prefix}, timeout: 1s}}")


@needs_redis
def test_two_gateways_sharing_one_redis_never_admit_more_than_the_budget_and_count_exactly(tmp_path):
    if 86400 - time.time() % 86400 < 180:
        pytest.skip("within 3 minutes of UTC midnight: the day window would change during the test")
    budget = 600
    with redis_server() as url:
        cfg = redis_config(tmp_path, url, "two", budget)
        a = make_stack(cfg, workers=1, simulate=True, agent=False)
        b = make_stack(cfg, workers=1, simulate=True, agent=False)
        try:
            a.start()
            b.start()
            # each request is estimated at 3 (prompt) + 40 (max_tokens, or estimatedCompletionTokens without it)
            # tokens: 600 // 43 = 13 fit at once; the simulator writes 16 tokens without max_tokens, so those
            # are refunded 24 at their end and let more in
            def one(i):
                return chat((a, b)[i % 2], "acme", content="x" * 12, max_tokens=40 if i % 3 == 0 else None)
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                responses = list(pool.map(one, range(60)))
            ok = [r for r in responses if r.status_code == 200]
            refused = [r for r in responses if r.status_code == 429]
            assert len(ok) + len(refused) == 60, {r.status_code for r in responses}
            assert ok and refused
            assert {r.json()["error"]["budget"] for r in refused} == {"tokensPerDay"}
            used = sum(usage_of(r) for r in ok)
            assert used <= budget  # what both gateways admitted, as the backend counted it
            import redis

            client = redis.Redis.from_url(url)
            day = int(time.time() // 86400)
            key = f"two:{{acme}}:d:{day}"
            value = wait_for(lambda: (int(client.hget(key, "r") or 0), int(client.hget(key, "t") or 0)),
                             (len(ok), used))
            assert value == (len(ok), used)  # exact to the token
            client.close()
        finally:
            b.stop()
            a.stop()


@needs_redis
def test_redis_down_fails_open_without_budget_headers_and_is_counted(tmp_path):
    with redis_server() as url:
        cfg = redis_config(tmp_path, url, "down", 1000000)
        st = make_stack(cfg, workers=1, simulate=True, agent=False)
        try:
            st.start()
            r = chat(st, "acme")
            assert r.status_code == 200 and "x-ratelimit-remaining-tokens" in r.headers
            redis_url = url
        except BaseException:
            st.stop()
            raise
    try:  # the server is stopped now
        r = chat(st, "acme")
        assert r.status_code == 200, r.text
        assert "x-ratelimit-remaining-tokens" not in r.headers
        errors = wait_for(lambda: metric_sum(st.processor_admin_url + "/metrics",
                                             "adapter_processor_budget_store_errors_total") >= 1, True)
        assert errors, redis_url
    finally:
        st.stop()
