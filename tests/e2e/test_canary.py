"""A canary rollout through the real Envoy and processor, over two OpenAI-API simulators (two backends
serving the same model, arms `stable` and `canary`, 30 % canary keyed on the trusted `x-user-id`).

- 400 requests with distinct `x-user-id` split as the hash says, and within a binomial bound: the
  canary's share of n = 400 keys at p = 0.3 is 120 +- 3 sigma (sigma = sqrt(n p (1 - p)) = 9.2), so
  [93, 147]; counted by each simulator's own request counter, by the `x-adapter-variant` header of
  every response, and by the processor's `adapter_processor_variant_requests_total`.
- The same `x-user-id` always gets the same arm and the same header (stickiness), streamed or not.
- The header comes from dynamic metadata through Envoy's route (the openai route's response headers
  never reach the processor), also on a headers-only passthrough route (an A/A rollout `raw-aa`);
  `x-canary: true` forces the canary (trusted and configured here).
"""

from __future__ import annotations

import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from canary.assign import Arm, Rollout, assign
from tests.e2e.conftest import wait_metric
from tests.promtext import scrape

pytestmark = pytest.mark.e2e

ROLLOUT = Rollout("gpt-v2", canaries=(Arm("canary", 3000),))  # what the config below compiles into
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def write(path: Path) -> Path:
    doc = {
        "apiVersion": "adapter.ai/v1", "kind": "AdapterGateway", "metadata": {"name": "canary"},
        "spec": {
            "backends": [{"name": "gpt-stable", "models": ["m"], "endpoints": ["gpt-stable:8000"]},
                         {"name": "gpt-canary", "models": ["m"], "endpoints": ["gpt-canary:8000"]}],
            "routes": [
                {"path": "/v1/", "match": "prefix", "kind": "openai", "name": "v1",
                 "targets": ["gpt-stable", "gpt-canary"]},
                {"path": "/v1/completions", "kind": "passthrough", "name": "raw", "target": "gpt-stable"},
            ],
            "rollouts": [
                {"name": "gpt-v2", "route": "v1",
                 "arms": [{"name": "stable", "backend": "gpt-stable"},
                          {"name": "canary", "backend": "gpt-canary", "weight": 30}],
                 "key": {"sources": [{"header": "x-user-id"}], "trustedHeaders": ["x-user-id", "x-canary"],
                         "force": {"header": "x-canary"}}},
                {"name": "raw-aa", "route": "raw",
                 "arms": [{"name": "a", "backend": "gpt-stable"}, {"name": "b", "backend": "gpt-stable",
                                                                   "weight": 50}],
                 "key": {"sources": [{"header": "x-user-id"}], "trustedHeaders": ["x-user-id"]}},
            ],
        },
    }
    path.write_text(json.dumps(doc, indent=1))  # JSON is YAML
    return path


def served(st, backend: str) -> float:
    _, port = st.simulators[backend]
    return scrape(f"http://127.0.0.1:{port}/metrics").total("vllm:request_success_total")


def chat(client: httpx.Client, url: str, user: str | None, **extra) -> str | None:
    headers = {"x-user-id": user} if user is not None else {}
    headers.update(extra.pop("headers", {}))
    r = client.post(f"{url}/v1/chat/completions", json={**CHAT, **extra}, headers=headers)
    assert r.status_code == 200, r.text
    return r.headers.get("x-adapter-variant")


def test_a_30_percent_canary_splits_400_users_by_their_key_sticky_and_named_on_every_response(tmp_path,
                                                                                              stack_factory):
    st = stack_factory(write(tmp_path / "gw.yaml"), workers=2, simulate=True, run_dir=str(tmp_path / "run"))
    before = {b: served(st, b) for b in ("gpt-stable", "gpt-canary")}
    users = [f"user-{i}" for i in range(400)]
    with httpx.Client(timeout=20) as client, ThreadPoolExecutor(8) as pool:
        variants = dict(zip(users, pool.map(lambda u: chat(client, st.url, u), users)))
    expected = {u: f"gpt-v2/{assign(ROLLOUT, u).arm}" for u in users}
    assert variants == expected  # every response names its arm, the one the key hashes to
    n = sum(v == "gpt-v2/canary" for v in variants.values())
    sigma = math.sqrt(400 * 0.3 * 0.7)
    assert abs(n - 120) <= 3 * sigma, n  # [93, 147]

    # each simulator counted exactly its arm's requests
    deadline = time.monotonic() + 5
    while True:
        got = {b: served(st, b) - before[b] for b in before}
        if sum(got.values()) >= 400 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert got == {"gpt-stable": 400 - n, "gpt-canary": n}

    # sticky: the same user, again (three times, one streamed), gets the same arm and header
    with httpx.Client(timeout=20) as client:
        for u in users[:40]:
            assert {chat(client, st.url, u) for _ in range(2)} == {expected[u]}
            with client.stream("POST", f"{st.url}/v1/chat/completions", json={**CHAT, "stream": True},
                               headers={"x-user-id": u}) as r:
                assert r.status_code == 200 and r.headers["x-adapter-variant"] == expected[u]
                r.read()
        stable_user = next(u for u in users if expected[u] == "gpt-v2/stable")
        assert chat(client, st.url, stable_user, headers={"x-canary": "true"}) == "gpt-v2/canary"  # forced
        # a headers-only route (the processor never sees its response) names its arm too
        r = client.post(f"{st.url}/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2},
                        headers={"x-user-id": stable_user})
        raw_arm = assign(Rollout("raw-aa", canaries=(Arm("b", 5000),), baseline="a"), stable_user).arm
        assert r.status_code == 200 and r.headers["x-adapter-variant"] == f"raw-aa/{raw_arm}"

    # the processor's per-arm counter shows the split (counted at on_done)
    url = f"{st.processor_admin_url}/metrics"
    canary_total = n + sum(expected[u] == "gpt-v2/canary" for u in users[:40]) * 3 + 1  # + the forced one
    stable_total = 400 - n + sum(expected[u] == "gpt-v2/stable" for u in users[:40]) * 3
    labels = {"route": "v1", "rollout": "gpt-v2", "outcome": "ok"}
    assert wait_metric(url, "adapter_processor_variant_requests_total", canary_total, arm="canary",
                       **labels) == canary_total
    assert wait_metric(url, "adapter_processor_variant_requests_total", stable_total, arm="stable",
                       **labels) == stable_total
    assert wait_metric(url, "adapter_processor_variant_requests_total", 1, route="raw", rollout="raw-aa") == 1
