"""Latency attribution through a real Envoy and the OpenAI API simulator (extproc/attribution.py):
the `Server-Timing` header's syntax and presence (only on routes with serverTiming, only for trusted
requests in `trusted` mode), the components reflecting the simulator's prefill delay (compared in
order between a short and a long prompt, never against absolute times), the metrics, and
`adapterctl attribution` against the running stack."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from tests.conftest import REPO
from tests.e2e.conftest import metric_sum, wait_metric
from tests.extproc.test_attribution import parse_server_timing

pytestmark = pytest.mark.e2e
LATENCY = "adapter_processor_latency_seconds"
# the simulator prefills 2000 tokens a second (its simple latency model): a prompt of about 3000 tokens
# waits over a second before its first token, a prompt of one word a millisecond
SIMULATOR = ("--prefill-tokens-per-s", "2000", "--decode-tokens-per-s", "200")
LONG = " ".join(["revenue"] * 3000)
SHORT = "hi"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    from tests.e2e.conftest import make_stack

    run = tmp_path_factory.mktemp("attribution")
    cfg = run / "gateway.yaml"
    cfg.write_text(f"""
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {{name: attribution}}
spec:
  modelRef: qwen2.5-finance
  tenancy: {{source: header, header: x-tenant-id, snapshot: {run / "agent.snap"}}}
  tenants: [{{id: acme}}, {{id: globex}}]
  backends: [{{name: llm, kind: vllm, endpoints: ["llm.invalid:8000"], models: [qwen2.5-finance]}}]
  routes:
    - {{path: /v1/chat/completions, kind: openai, serverTiming: {{tenants: [acme]}}}}
    - {{path: /v1/completions, kind: openai}}
    - path: /v1/analyze
      request: '{{"messages": [{{"role": "user", "content": $.query}}], "max_tokens": 4}}'
      transform: '{{"answer": $.output}}'
      serverTiming: always
    - path: /v1/internal
      request: '{{"messages": [{{"role": "user", "content": $.query}}], "max_tokens": 4}}'
      transform: '{{"answer": $.output}}'
      serverTiming: {{header: x-internal-timing}}
""")
    st = make_stack(cfg, simulate=True, agent=False, simulator_args=SIMULATOR)
    st.start()
    st.agent_snapshot = run / "agent.snap"  # the tests publish the tenant agent's snapshot themselves
    yield st
    st.stop()


def chat(st, tenant: str, content: str, stream: bool = False, path: str = "/v1/chat/completions") -> httpx.Response:
    body = {"model": "qwen2.5-finance", "messages": [{"role": "user", "content": content}], "max_tokens": 4,
            "stream": stream}
    if path == "/v1/completions":
        body = {"model": "qwen2.5-finance", "prompt": content, "max_tokens": 4}
    r = httpx.post(st.url + path, json=body, headers={"x-tenant-id": tenant}, timeout=30)
    assert r.status_code == 200, r.text
    return r


def durations(header: str) -> dict[str, float]:
    return {name: float(params["dur"]) for name, params in parse_server_timing(header).items() if "dur" in params}


def test_the_header_is_well_formed_and_names_each_component_it_knows_at_response_headers(gateway):
    r = httpx.post(gateway.url + "/v1/analyze", json={"query": SHORT}, headers={"x-tenant-id": "globex"}, timeout=30)
    assert r.status_code == 200, r.text
    metrics = parse_server_timing(r.headers["server-timing"])
    # what is known when the response headers pass: Envoy's part before the processor (Envoy's
    # request.time attribute), the request phases (llm routes read request headers and body), queue,
    # the upstream's first byte, the total; the response phases and the first token come later
    assert {"envoy", "processor_request_headers", "processor_request_body", "queue", "upstream_ttfb",
            "total"} <= set(metrics), metrics
    assert "processor_response_body" not in metrics and "upstream_first_token" not in metrics
    url = gateway.processor_admin_url + "/metrics"
    wait_metric(url, LATENCY + "_count", 1, timeout=10, route="v1-analyze", component="upstream_ttfb")
    assert metric_sum(url, LATENCY + "_count", route="v1-analyze", component="upstream_first_token") == 0  # unstreamed
    assert metrics["queue"] == {"dur": "0.000", "desc": "no gateway queue"}
    d = durations(r.headers["server-timing"])
    assert all(v >= 0 for v in d.values())
    parts = sum(d[k] for k in ("envoy", "processor_request_headers", "processor_request_body", "upstream_ttfb"))
    assert parts <= d["total"] + 0.005  # disjoint parts of the time to the response headers (each rounded to 1 us)


def test_trusted_mode_sends_the_header_only_to_the_listed_tenant_or_the_configured_header(gateway):
    assert "server-timing" in chat(gateway, "acme", SHORT).headers
    assert "server-timing" not in chat(gateway, "globex", SHORT).headers  # a known tenant, not listed
    internal = "/v1/internal"
    plain = httpx.post(gateway.url + internal, json={"query": SHORT}, headers={"x-tenant-id": "globex"}, timeout=30)
    assert plain.status_code == 200 and "server-timing" not in plain.headers
    marked = httpx.post(gateway.url + internal, json={"query": SHORT},
                        headers={"x-tenant-id": "globex", "x-internal-timing": "1"}, timeout=30)
    assert marked.status_code == 200 and "server-timing" in marked.headers


def test_a_route_without_server_timing_sends_no_header_and_records_no_attribution(gateway):
    r = chat(gateway, "acme", SHORT, path="/v1/completions")
    assert "server-timing" not in r.headers
    assert metric_sum(gateway.processor_admin_url + "/metrics", LATENCY + "_count", route="v1-completions") == 0


def test_upstream_ttfb_reflects_the_prefill_delay_on_a_buffered_route(gateway):
    def ttfb(query: str) -> float:
        r = httpx.post(gateway.url + "/v1/analyze", json={"query": query}, headers={"x-tenant-id": "globex"},
                       timeout=30)
        assert r.status_code == 200, r.text
        return durations(r.headers["server-timing"])["upstream_ttfb"]

    short, long_ = ttfb(SHORT), ttfb(LONG)
    assert long_ > short  # unstreamed: the first byte comes after the prefill


def test_streams_first_token_follows_the_prefill_and_comes_after_the_first_byte(gateway):
    url = gateway.processor_admin_url + "/metrics"
    route = "v1-chat-completions"

    def streamed(content: str) -> tuple[float, float, str]:
        before = {c: metric_sum(url, LATENCY + "_sum", route=route, component=c)
                  for c in ("upstream_ttfb", "upstream_first_token")}
        n = metric_sum(url, LATENCY + "_count", route=route, component="upstream_first_token")
        r = chat(gateway, "acme", content, stream=True)
        assert "data: [DONE]" in r.text
        wait_metric(url, LATENCY + "_count", n + 1, timeout=10, route=route, component="upstream_first_token")
        after = {c: metric_sum(url, LATENCY + "_sum", route=route, component=c) for c in before}
        return after["upstream_ttfb"] - before["upstream_ttfb"], \
            after["upstream_first_token"] - before["upstream_first_token"], r.headers["server-timing"]

    short_ttfb, short_token, _ = streamed(SHORT)
    long_ttfb, long_token, header = streamed(LONG)
    assert long_token > short_token  # the first token waits for the prefill
    assert long_token > long_ttfb  # the simulator sends its headers before prefilling
    # a streamed route's header has the first byte, not the first token (not known yet at response headers)
    assert "upstream_ttfb" in durations(header) and "upstream_first_token" not in durations(header)


def test_metrics_split_by_route_and_component(gateway):
    url = gateway.processor_admin_url + "/metrics"
    n = metric_sum(url, LATENCY + "_count", route="v1-chat-completions", component="queue")
    chat(gateway, "acme", SHORT)
    chat(gateway, "acme", SHORT, stream=True)
    wait_metric(url, LATENCY + "_count", n + 2, timeout=10, route="v1-chat-completions", component="queue")
    # envoy, upstream_ttfb and upstream_first_token come with Envoy's access-log entry (flushed every 100 ms)
    wait_metric(url, LATENCY + "_count", 1, timeout=10, route="v1-chat-completions", component="upstream_first_token")
    for component in ("envoy", "processor_request_headers", "processor_request_body", "processor_response_headers",
                      "processor_response_body", "queue", "upstream_ttfb", "upstream_first_token"):
        assert metric_sum(url, LATENCY + "_count", route="v1-chat-completions", component=component) >= 1, component


def test_envoys_share_is_measured_by_envoy_and_holds_the_time_envoy_waited_for_the_clients_body(gateway):
    """Envoy's share of a request (from its access-log entry: its whole time minus the processor's spans and
    the upstream's window) holds what happens in Envoy alone. A client that sends its headers and then its
    body 0.5 s later makes Envoy wait for the body before the processor's body phase and before the upstream
    gets anything: that wait is in `envoy` (less the processor's header phase, which runs meanwhile), and it
    is not in the upstream's first byte."""
    import socket
    import time
    from urllib.parse import urlparse

    url = gateway.processor_admin_url + "/metrics"
    route = "v1-analyze"
    components = ("envoy", "processor_request_headers", "upstream_ttfb")

    def measured(send) -> dict[str, float]:
        before = {c: metric_sum(url, LATENCY + "_sum", route=route, component=c) for c in components}
        n = metric_sum(url, LATENCY + "_count", route=route, component="envoy")
        send()
        wait_metric(url, LATENCY + "_count", n + 1, timeout=10, route=route, component="envoy")
        wait_metric(url, LATENCY + "_count", n + 1, timeout=10, route=route, component="upstream_ttfb")
        return {c: metric_sum(url, LATENCY + "_sum", route=route, component=c) - before[c] for c in components}

    def slow_client() -> None:
        body = json.dumps({"query": SHORT}).encode()
        target = urlparse(gateway.url)
        with socket.create_connection((target.hostname, target.port), timeout=30) as s:
            s.sendall(f"POST /v1/analyze HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                      f"x-tenant-id: globex\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode())
            time.sleep(0.5)
            s.sendall(body)
            reply = b""
            while chunk := s.recv(65536):
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 200"), reply[:200]

    def fast_client() -> None:
        r = httpx.post(gateway.url + "/v1/analyze", json={"query": SHORT}, headers={"x-tenant-id": "globex"},
                       timeout=30)
        assert r.status_code == 200, r.text

    entries = metric_sum(url, "adapter_processor_feedback_entries_total", result="timing")
    slow, fast = measured(slow_client), measured(fast_client)
    # both requests' entries reached the worker that served them (the per-worker access loggers' filter)
    assert metric_sum(url, "adapter_processor_feedback_entries_total", result="timing") >= entries + 2
    assert slow["envoy"] + slow["processor_request_headers"] >= 0.5
    assert fast["envoy"] < slow["envoy"]
    assert all(v >= 0 for v in (*slow.values(), *fast.values()))


def test_network_rtt_comes_from_the_tenant_agents_snapshot_for_the_endpoint_that_served(gateway):
    from ebpf.snapshot import SnapshotData, SnapshotWriter, UpstreamSample

    def analyze() -> dict[str, dict[str, str]]:
        r = httpx.post(gateway.url + "/v1/analyze", json={"query": SHORT}, headers={"x-tenant-id": "globex"},
                       timeout=30)
        assert r.status_code == 200, r.text
        return parse_server_timing(r.headers["server-timing"])

    if not gateway.agent_snapshot.exists():  # no agent yet: no RTT is claimed
        assert "network_rtt" not in analyze()
    port = gateway.simulators["llm"][1]
    writer = SnapshotWriter(gateway.agent_snapshot)
    writer.write(SnapshotData(source="ebpf", upstreams=[
        UpstreamSample(addr="127.0.0.1", port=port, count=9, last_srtt_us=90, window_count=3, window_mean_us=1234.0),
        UpstreamSample(addr="127.0.0.1", port=1, count=5, last_srtt_us=7, window_count=5, window_mean_us=7.0)]))
    metrics = analyze()
    assert metrics["network_rtt"] == {"dur": "1.234", "desc": "ebpf srtt"}  # the window mean of that endpoint
    url = gateway.processor_admin_url + "/metrics"
    wait_metric(url, LATENCY + "_count", 1, timeout=10, route="v1-analyze", component="network_rtt")


def test_adapterctl_attribution_prints_quantiles_per_route_and_component(gateway):
    url = gateway.processor_admin_url + "/metrics"
    for _ in range(3):
        r = httpx.post(gateway.url + "/v1/analyze", json={"query": SHORT}, headers={"x-tenant-id": "globex"},
                       timeout=30)
        assert r.status_code == 200
    wait_metric(url, LATENCY + "_count", 3, timeout=10, route="v1-analyze", component="queue")

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "extproc", "attribution", "--admin",
                               gateway.processor_admin_url, *args], cwd=REPO, capture_output=True, text=True,
                              timeout=60)

    out = cli("--json", "--route", "v1-analyze")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert set(doc["routes"]) == {"v1-analyze"}
    route = doc["routes"]["v1-analyze"]
    assert route["requests"] >= 3
    rows = route["components"]
    assert {"envoy", "processor_request_headers", "processor_request_body", "processor_response_headers",
            "processor_response_body", "queue", "upstream_ttfb"} <= set(rows)
    for name, row in rows.items():
        assert row["p50_ms"] <= row["p90_ms"] <= row["p99_ms"], (name, row)
    text = cli()
    assert text.returncode == 0 and "route v1-analyze:" in text.stdout and "upstream_ttfb" in text.stdout
    # a window with no request in it: nothing to show, said so
    quiet = cli("--window", "0.5", "--route", "v1-analyze", "--json")
    assert quiet.returncode == 0 and json.loads(quiet.stdout)["routes"] == {}
