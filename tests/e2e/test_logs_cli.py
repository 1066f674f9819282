"""`adapterctl logs -f` against a running stack (real Envoy, two processor workers, an OpenAI API simulator):
records of requests that end while it follows arrive from both workers, with route, tenant, status,
backend and endpoint; at `--level=debug` with the client's document and the backend request, secrets
redacted; `--route` filters; and once the follower is gone the workers stop writing."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.e2e
FAULTS = REPO / "tests" / "e2e" / "faults.yaml"
CHAT = {"model": "qwen2.5-finance", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def follow(st, *args: str, seconds: float = 8.0) -> subprocess.Popen:
    """`adapterctl logs -f --json` for `seconds`, returned once its follow file is there and the workers
    (which look at most once a second) have seen it."""
    state_dir = Path(httpx.get(f"{st.processor_admin_url}/config", timeout=5).json()["state_dir"])
    cli = subprocess.Popen([sys.executable, "-m", "extproc", "logs", "-f", "--json", "--admin",
                            st.processor_admin_url, "--for", str(seconds), *args],
                           cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not list(state_dir.glob("logs.follow.*")):
        assert time.monotonic() < deadline and cli.poll() is None, cli.stderr.read() if cli.poll() else "slow"
        time.sleep(0.1)
    time.sleep(1.2)
    return cli


def test_follow_at_debug_shows_every_request_redacted_and_stops_when_gone(stack_factory):
    st = stack_factory(FAULTS, simulate={"llm"})
    state_dir = Path(httpx.get(f"{st.processor_admin_url}/config", timeout=5).json()["state_dir"])
    cli = follow(st, "--level=debug")
    with httpx.Client(timeout=10) as client:
        for i in range(6):
            r = client.post(f"{st.url}/v1/analyze", json={"query": f"Q{i}", "api_key": "sk-live-secret"})
            assert r.status_code == 200, r.text
        assert client.post(f"{st.url}/v1/chat/completions", json=CHAT).status_code == 200
    out, err = cli.communicate(timeout=30)
    assert cli.returncode == 0, err
    recs = [json.loads(x) for x in out.splitlines()]
    analyze = {r["input"]["query"]: r for r in recs if r["route"] == "v1-analyze"}
    assert set(analyze) == {f"Q{i}" for i in range(6)}, (recs, err)
    a = analyze["Q0"]
    assert a["status"] == 200 and a["outcome"] == "ok" and a["backend"] == "llm" and a["served"]
    assert a["input"]["api_key"] == "[redacted]" and a["backend_request"] is not None and a["stages"]
    assert "sk-live-secret" not in out
    assert {r["worker"] for r in recs} <= {0, 1} and len({r["request_id"] for r in recs}) == len(recs)
    (chat,) = [r for r in recs if r["route"] == "v1-chat-completions"]
    assert chat["status"] == 200 and chat["kind"] == "passthrough"  # a headers-only route: its end from the access log
    # the follower is gone: its file is removed and the workers stop writing
    assert not list(state_dir.glob("logs.follow.*"))
    time.sleep(1.5)
    sizes = {p: p.stat().st_size for p in state_dir.glob("requests-*.jsonl")}
    httpx.post(f"{st.url}/v1/analyze", json={"query": "after"}, timeout=10)
    time.sleep(0.5)
    assert {p: p.stat().st_size for p in state_dir.glob("requests-*.jsonl")} == sizes


def test_route_filter_and_the_last_records_without_follow(stack_factory):
    st = stack_factory(FAULTS, simulate={"llm"})
    cli = follow(st, "--route", "v1-chat-completions", seconds=5.0)
    with httpx.Client(timeout=10) as client:
        client.post(f"{st.url}/v1/analyze", json={"query": "x"})
        client.post(f"{st.url}/v1/chat/completions", json=CHAT)
    out, err = cli.communicate(timeout=30)
    got = [json.loads(x)["route"] for x in out.splitlines()]
    assert got == ["v1-chat-completions"], (got, err)
    last = subprocess.run([sys.executable, "-m", "extproc", "logs", "--json", "--admin", st.processor_admin_url,
                           "--lines", "5"], cwd=REPO, capture_output=True, text=True, timeout=30)
    routes = [json.loads(x)["route"] for x in last.stdout.splitlines()]
    assert last.returncode == 0 and sorted(routes) == ["v1-analyze", "v1-chat-completions"], last
    down = subprocess.run([sys.executable, "-m", "extproc", "logs", "--admin", "http://127.0.0.1:1"],
                          cwd=REPO, capture_output=True, text=True, timeout=30)
    assert down.returncode == 3 and "cannot be reached" in down.stderr


DECISIONS = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: logs-decisions}
spec:
  tenancy: {source: header, header: x-tenant-id}
  tenants: [{id: acme}, {id: globex}]
  backends:
    - {name: llama-stable, kind: vllm, endpoints: ["vllm-stable:8000"], models: [llama-3-8b]}
    - {name: llama-canary, kind: vllm, endpoints: ["vllm-canary:8000"], models: [llama-3-8b]}
  plugins:
    - {type: in-flight-scorer}
  schedulingProfiles:
    - name: explained
      explain: true
      plugins: [{pluginRef: in-flight-scorer}]
  routes:
    - {path: /v1/, match: prefix, kind: openai, name: v1, targets: [llama-stable, llama-canary], plugins: [explained]}
  rollouts:
    - name: llama-v2
      route: v1
      arms: [{name: stable, backend: llama-stable}, {name: canary, backend: llama-canary, weight: 10}]
      key: {sources: [{header: x-user-id}], trustedHeaders: [x-user-id, x-canary], force: {header: x-canary}}
"""


def test_tenant_filter_and_each_requests_decisions_variant_endpoint_and_why(stack_factory, tmp_path):
    """`--tenant` keeps one tenant's requests; each record names the canary arm and how it was chosen (forced
    here), the endpoint picked and the one that served, and at debug the scheduling profile's explanation
    (candidates, scorers, the pick): the "why"; the pretty form shows the same on its first line."""
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(DECISIONS)
    st = stack_factory(cfg, simulate=True)
    cli = follow(st, "--tenant", "acme", "--level=debug", seconds=6.0)
    body = {"model": "llama-3-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with httpx.Client(timeout=10) as client:
        for tenant in ("acme", "globex", "acme"):
            r = client.post(f"{st.url}/v1/chat/completions", json=body,
                            headers={"x-tenant-id": tenant, "x-canary": "true", "x-user-id": "alice"})
            assert r.status_code == 200, r.text
    out, err = cli.communicate(timeout=30)
    recs = [json.loads(x) for x in out.splitlines()]
    assert len(recs) == 2 and {r["tenant"] for r in recs} == {"acme"}, (recs, err)
    for rec in recs:
        assert rec["variant"] == "llama-v2/canary" and rec["assignment"]["how"] == "forced", rec
        assert rec["backend"] == "llama-canary" and rec["endpoint"] and rec["served"] == rec["endpoint"]
        decision = rec["decision"]
        assert decision["profile"] == "explained" and decision["pick"] == rec["endpoint"]
        assert rec["endpoint"] in decision["candidates"] and decision["scorers"][0]["plugin"] == "in-flight-scorer"
    last = subprocess.run([sys.executable, "-m", "extproc", "logs", "--admin", st.processor_admin_url,
                           "--tenant", "acme", "--lines", "5"], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert last.returncode == 0, last.stderr
    lines = [x for x in last.stdout.splitlines() if x and not x.startswith(" ")]
    assert len(lines) == 2 and all("tenant=acme" in x and "variant=llama-v2/canary (forced" in x for x in lines), \
        last.stdout
