"""Stage `token-budget` on compiled configs: estimate, charge, headers as dynamic metadata, 429 per dialect with
Retry-After, reconciliation from usage at `on_done`, no work for tenants without budgets, store-down policy,
and config errors (file, field path, reason)."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from backends.base import Usage
from extproc.config.loader import ConfigError, load_text
from extproc.errors import render
from extproc.qos.budget import METADATA_NAMESPACE
from extproc.request import parse_openai
from extproc.runtime import Runtime
from extproc.stages.token_budget import ATTR, CACHE, TokenBudgetAtBody, TokenBudgetAtHeaders
from extproc.types import HttpMessage, Mutate, Outcome, Phase, Reject, RequestState


def config(budget: str = "{tokensPerMinute: 100, requestsPerMinute: 5}", store: str = "") -> str:
    return f"""
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {{name: t}}
spec:
  modelRef: m
  {store}
  tenants:
    - {{id: acme, budget: {budget}}}
    - {{id: free}}
  backends: [{{name: b, endpoints: ["127.0.0.1:9"]}}]
  routes:
    - {{path: /v1/, match: prefix, kind: openai, targets: [b]}}
    - {{path: /analyze, kind: llm, target: b}}
    - {{path: /pass, kind: passthrough, target: b}}
"""


def chat(content: str, max_tokens: int | None = 10) -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": content}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body


def state(snap, tenant="acme", route="v1", body=None, runtime=None) -> RequestState:
    st = RequestState(snapshot=snap, route=snap.routes[route], started=0.0, tenant=tenant, request_id="r",
                      runtime=runtime)
    if body is not None:
        st.request = parse_openai("/v1/chat/completions", body, tenant)
    return st


def run(stage, st):
    return asyncio.run(stage.on_request_body(st, HttpMessage(Phase.REQUEST_BODY, body=b"{}")))


def headers(v: Mutate) -> dict[str, str]:
    ((ns, fields),) = v.dynamic_metadata
    assert ns == METADATA_NAMESPACE
    return {k.removeprefix("ratelimit_").replace("_", "-"): val for k, val in fields.items()}


def test_admitted_requests_carry_the_headers_and_remaining_decreases_monotonically(tmp_path):
    snap = load_text(config())
    rt = Runtime(state_dir=str(tmp_path))
    stage = TokenBudgetAtBody()
    seen = []
    for _ in range(4):
        st = state(snap, body=chat("x" * 40, 10), runtime=rt)  # 10 + 10 = 20 tokens each
        v = run(stage, st)
        h = headers(v)
        seen.append((int(h["remaining-requests"]), int(h["remaining-tokens"])))
        assert h["limit-requests"] == "5" and h["limit-tokens"] == "100"
        assert h["reset-tokens"].endswith("s")
        st.usage = Usage(10, 3)  # it used 13 of its 20
        stage.on_done(st, Outcome.OK)
    # each request leaves 7 of its 20 estimated tokens refunded: admissions see 100-20, 100-33, 100-46, ...
    # but the header's remaining is limit - peak, so it never goes back up
    assert [r for r, _ in seen] == [4, 3, 2, 1]
    assert [t for _, t in seen] == [80, 67, 54, 41]
    assert all(a[1] >= b[1] for a, b in zip(seen, seen[1:]))
    bs = rt.cache(CACHE)["state"]
    m, _ = bs.store.read_sync("acme", __import__("time").time())
    assert m.tokens == 4 * 13  # exact to the token once reconciled


def test_exhausted_budget_is_429_with_retry_after_in_each_dialect():
    snap = load_text(config("{requestsPerMinute: 1}"))
    stage = TokenBudgetAtBody()
    assert isinstance(run(stage, state(snap, body=chat("hi"))), Mutate)
    v = run(stage, state(snap, body=chat("hi")))
    assert isinstance(v, Reject) and v.status == 429 and v.code == "tenant_over_budget"
    assert 1 <= v.retry_after <= 60
    assert v.fields["tenant"] == "acme" and v.fields["budget"] == "requestsPerMinute" and v.fields["limit"] == 1
    assert dict(v.headers)["x-ratelimit-remaining-requests"] == "0"
    openai = orjson.loads(render("openai", v, "v1", "r"))["error"]
    assert openai["type"] == "rate_limit_exceeded" and openai["code"] == "tenant_over_budget"
    assert "acme" in openai["message"] and "requestsPerMinute" in openai["message"]
    adapter = orjson.loads(render("adapter", v, "analyze", "r"))["error"]
    assert adapter["status"] == 429 and adapter["tenant"] == "acme" and adapter["retry_after_s"] == v.retry_after


def test_an_estimate_over_the_limit_is_refused_without_retry_after():
    snap = load_text(config("{tokensPerMinute: 100}"))
    v = run(TokenBudgetAtBody(), state(snap, body=chat("x", max_tokens=500)))
    assert v.status == 429 and v.code == "request_over_budget" and v.retry_after is None
    assert v.fields["requested"] == 500


def test_tenants_without_a_budget_and_requests_without_a_tenant_cost_no_budget_work():
    snap = load_text(config())
    stage = TokenBudgetAtBody()
    st = state(snap, tenant="free", body=chat("hi"))
    assert run(stage, st) is None and ATTR not in st.attrs and not stage._own  # no store was even built
    assert run(stage, state(snap, tenant=None, body=chat("hi"))) is None and not stage._own


def test_processor_answers_refund_the_whole_estimate_and_headers_only_kinds_count_requests():
    snap = load_text(config("{tokensPerMinute: 100, requestsPerMinute: 10}"))
    stage = TokenBudgetAtBody()
    st = state(snap, body=chat("x" * 40, 50))
    run(stage, st)
    st.reply_status = 404  # e.g. model_not_found after admission: no backend saw it
    stage.on_done(st, Outcome.REJECTED)
    m, _ = stage._own["state"].store.read_sync("acme", __import__("time").time())
    assert (m.requests, m.tokens, m.peak) == (1, 0, 60)
    hs = TokenBudgetAtHeaders()
    st = state(snap, route="pass")
    v = asyncio.run(hs.on_request_headers(st, HttpMessage(Phase.REQUEST_HEADERS, headers={})))
    assert headers(v)["remaining-requests"] == "9" and st.attrs[ATTR][2] == 0  # no tokens estimated


def test_store_down_fails_open_by_default_and_closed_when_configured():
    # nothing listens on port 1: connection refused at once
    for mode, expect in (("open", None), ("closed", 503)):
        snap = load_text(config(store=f"budgetStore: {{kind: redis, url: 'redis://127.0.0.1:1/0', failureMode: {mode}}}"))
        stage = TokenBudgetAtBody()
        v = run(stage, state(snap, body=chat("hi")))
        if expect is None:
            assert v is None
        else:
            assert isinstance(v, Reject) and v.status == 503 and v.code == "budget_store_unavailable"
            assert v.retry_after == 1
        bs = stage._own["state"]
        assert bs.down and bs.metrics.store_errors.labels("redis")._value.get() == 1
        result = "store_down_admitted" if mode == "open" else "store_down_rejected"
        assert bs.metrics.decisions.labels("acme", result)._value.get() == 1


@pytest.mark.parametrize("budget,store,where,reason", [
    ("{}", "", "spec.tenants[0].budget", "at least one of requestsPerMinute"),
    ("{tokensPerMinute: 100, tokensPerDay: 50}", "", "spec.tenants[0].budget.tokensPerDay", "is below tokensPerMinute"),
    ("{tokensPerMinute: 0}", "", "spec.tenants[0].budget.tokensPerMinute", "greater than or equal to 1"),
    ("{tokensPerMinut: 5}", "", "spec.tenants[0].budget.tokensPerMinut", "unknown field"),
    ("{tokensPerMinute: 5}", "budgetStore: {kind: redis}", "spec.budgetStore.url", "needs a url"),
    ("{tokensPerMinute: 5}", "budgetStore: {kind: redis, url: 'http://x'}", "spec.budgetStore.url", "not a Redis URL"),
    ("{tokensPerMinute: 5}", "budgetStore: {url: 'redis://x:1'}", "spec.budgetStore.url", "only used with kind: redis"),
])
def test_bad_budget_config_names_file_field_and_reason(budget, store, where, reason):
    with pytest.raises(ConfigError) as e:
        load_text(config(budget, store), filename="gw.yaml")
    text = str(e.value)
    assert "gw.yaml:" in text and where in text and reason in text, text


def test_envoy_adds_the_ratelimit_headers_from_metadata_only_when_some_tenant_has_a_budget():
    from extproc.envoy_render import route_configuration

    def added(snap):
        entries = route_configuration(snap)["virtual_hosts"][0]["routes"]
        return {h["header"]["key"]: h["header"]["value"] for e in entries if "--" in e["name"]
                for h in e.get("response_headers_to_add", ())}

    with_budget = added(load_text(config()))
    assert with_budget["x-ratelimit-remaining-tokens"] == "%DYNAMIC_METADATA(adapter:ratelimit_remaining_tokens)%"
    assert sorted(k for k in with_budget if k.startswith("x-ratelimit-")) == sorted(
        f"x-ratelimit-{a}-{u}" for a in ("limit", "remaining", "reset") for u in ("requests", "tokens"))
    without = load_text(config().replace("budget: {tokensPerMinute: 100, requestsPerMinute: 5}", "cpu: {limit: 1}"))
    assert not any(k.startswith("x-ratelimit-") for k in added(without))
