"""Scheduling profiles through the real Envoy and processor, over two OpenAI-API simulators.

- A profile with `label-filter` (plus `in-flight-scorer` and `max-score-picker`) sends every request
  to the one labelled endpoint of two, checked by each simulator's own request counter; a reload
  that moves the label moves the traffic.
- A profile whose filter matches no endpoint refuses: 503 `no_capacity`, and 429 `overloaded` with
  Retry-After for a sheddable request (priority < 0), in the OpenAI error format the client parses.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import Simulator
from tests.e2e.test_xds_live import procs  # noqa: F401  (a fixture: started processes, stopped by handle)

pytestmark = pytest.mark.e2e


def write(path: Path, labelled: Simulator, other: Simulator) -> Path:
    doc = {
        "apiVersion": "adapter.ai/v1", "kind": "AdapterGateway", "metadata": {"name": "profiles"},
        "spec": {
            "backends": [{"name": "pool", "models": ["m"], "endpoints": [
                {"address": other.id, "labels": {"gpu": "v100"}},
                {"address": labelled.id, "labels": {"gpu": "a100"}},
            ]}],
            "plugins": [
                {"name": "a100", "type": "label-filter", "parameters": {"matchLabels": {"gpu": "a100"}}},
                {"name": "h100", "type": "label-filter", "parameters": {"matchLabels": {"gpu": "h100"}}},
                {"type": "in-flight-scorer"},
                {"type": "max-score-picker", "parameters": {"fallbacks": 0}},
            ],
            "schedulingProfiles": [
                {"name": "on-a100", "plugins": [{"pluginRef": "a100"}, {"pluginRef": "in-flight-scorer"},
                                                {"pluginRef": "max-score-picker"}]},
                {"name": "on-h100", "plugins": [{"pluginRef": "h100"}, {"pluginRef": "in-flight-scorer"}]},
            ],
            "routes": [
                {"path": "/v1/", "match": "prefix", "kind": "openai", "targets": ["pool"], "plugins": ["on-a100"]},
                {"path": "/v1/completions", "kind": "openai", "targets": ["pool"], "plugins": ["on-h100"]},
            ],
        },
    }
    path.write_text(json.dumps(doc, indent=1))  # JSON is YAML
    return path


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def chat_many(url: str, n: int) -> None:
    with httpx.Client(timeout=10) as client:
        for _ in range(n):
            r = client.post(f"{url}/v1/chat/completions", json=CHAT)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 2


def counts_after(sims: tuple[Simulator, Simulator], before: tuple[float, float], total: int) -> tuple[float, float]:
    """Each simulator's new requests, once they add up to `total` (a simulator counts at the request's end)."""
    deadline = time.monotonic() + 5
    while True:
        got = tuple(s.served() - b for s, b in zip(sims, before))
        if sum(got) >= total or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def test_a_label_filter_profile_sends_every_request_to_the_labelled_endpoint(tmp_path, procs, stack_factory):
    a, b = Simulator(procs), Simulator(procs)
    cfg = write(tmp_path / "gw.yaml", labelled=a, other=b)
    st = stack_factory(cfg, workers=2, run_dir=str(tmp_path / "run"))
    before = (a.served(), b.served())
    chat_many(st.url, 30)
    assert counts_after((a, b), before, 30) == (30, 0)
    # the label moves to the other endpoint: the same profile (reconfigured in each worker) follows it
    write(cfg, labelled=b, other=a)
    assert st.reload().accepted
    before = (a.served(), b.served())
    chat_many(st.url, 20)
    assert counts_after((a, b), before, 20) == (0, 20)


def test_a_profile_with_no_endpoint_left_refuses_in_the_openai_format(tmp_path, procs, stack_factory):
    a, b = Simulator(procs), Simulator(procs)
    st = stack_factory(write(tmp_path / "gw.yaml", labelled=a, other=b), workers=1, run_dir=str(tmp_path / "run"))
    before = (a.served(), b.served())
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    r = httpx.post(f"{st.url}/v1/completions", json=body, timeout=10)
    assert r.status_code == 503 and "retry-after" not in r.headers
    err = r.json()["error"]
    assert (err["code"], err["type"], err["profile"], err["backend"]) == ("no_capacity", "server_error", "on-h100",
                                                                          "pool")
    r = httpx.post(f"{st.url}/v1/completions", json={**body, "priority": -1}, timeout=10)
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "overloaded" and r.json()["error"]["type"] == "rate_limit_exceeded"
    time.sleep(0.3)
    assert (a.served(), b.served()) == before  # refused by the processor: no backend saw them
