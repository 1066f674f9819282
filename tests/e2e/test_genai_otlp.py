"""The GenAI metrics over OTLP through the real Envoy and processor, into a real OTLP/gRPC receiver.

Two processor workers export (`spec.otlpMetrics`, every 300 ms) to `tests/otlp_receiver.py` on a
free port; an openai route serves model `m` from an OpenAI-API simulator that reports usage and
model `n` from one whose dialect refuses `stream_options` (so its streams carry no usage and the
gateway estimates). Checked on what the receiver got, against the processor's own Prometheus
`/metrics` for the same requests:
- the four metrics with the conventions' names, units and bucket boundaries;
- every Prometheus series has an OTLP series (newest cumulative point per worker, summed over the
  workers) with the same attributes, count and buckets;
- `server.address`/`server.port` name the simulator that served (Envoy's upstream address);
- token usage of model `n` is `estimated=true`, of model `m` `estimated=false`;
- with the collector stopped, requests are answered as before; a collector started on that port
  then gets totals equal to Prometheus' again (cumulative temporality).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import Simulator
from tests.e2e.test_xds_live import procs  # noqa: F401  (a fixture: started processes, stopped by handle)
from tests.genai_metrics import histogram_points
from tests.otlp_receiver import OtlpReceiver
from tests.promtext import scrape

pytestmark = pytest.mark.e2e

UNITS = {"gen_ai.server.request.duration": "s", "gen_ai.server.time_to_first_token": "s",
         "gen_ai.server.time_per_output_token": "s", "gen_ai.client.token.usage": "{token}"}
TTFT_BOUNDS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TOKEN_BOUNDS = tuple(float(4 ** k) for k in range(14))  # 1, 4, ..., 67108864


@pytest.fixture
def receiver():
    r = OtlpReceiver()
    yield r
    r.stop()


def write(path: Path, counted: Simulator, bare: Simulator, collector: str) -> Path:
    doc = {
        "apiVersion": "adapter.ai/v1", "kind": "AdapterGateway", "metadata": {"name": "genai-otlp"},
        "spec": {
            "backends": [
                {"name": "pool", "kind": "vllm", "models": ["m"], "endpoints": [counted.id],
                 "dialect": {"preset": "vllm"}},
                {"name": "bare", "models": ["n"], "endpoints": [bare.id],
                 "dialect": {"preset": "openai", "streamUsage": "refused"}},
            ],
            "routes": [{"path": "/v1/", "match": "prefix", "kind": "openai", "targets": ["pool", "bare"]}],
            "otlpMetrics": {"endpoint": collector, "interval": "300ms", "exportTimeout": "1s"},
        },
    }
    path.write_text(json.dumps(doc, indent=1))  # JSON is YAML
    return path


def prometheus(url: str) -> dict:
    """{(otel name, attributes): (count, cumulative buckets)} from the processor's /metrics."""
    return {k: (p["count"], p["buckets"]) for k, p in histogram_points(scrape(url)).items() if p.get("count")}


def otlp(receiver: OtlpReceiver) -> dict:
    """The same shape from the receiver: the newest point per worker, summed over the workers."""
    out: dict = {}
    for name in UNITS:
        for p in receiver.latest(name):
            entry = out.setdefault((name, tuple(sorted(p.attributes.items()))), [0, {}])
            entry[0] += p.count
            total = 0
            for bound, n in zip(p.bounds + (float("inf"),), p.bucket_counts):
                total += n
                entry[1][float(bound)] = entry[1].get(float(bound), 0) + total
    return {k: (count, buckets) for k, (count, buckets) in out.items() if count}


def agree(receiver: OtlpReceiver, url: str, requests: int, timeout: float = 30) -> dict:
    """Wait until Prometheus counted `requests` durations and the receiver has the same series and counts."""
    deadline = time.monotonic() + timeout
    while True:
        prom, got = prometheus(url), otlp(receiver)
        durations = sum(c for (name, _), (c, _) in prom.items() if name == "gen_ai.server.request.duration")
        if durations == requests and prom == got:
            return got
        if time.monotonic() > deadline:
            missing = {k: (v, got.get(k)) for k, v in prom.items() if got.get(k) != v}
            raise AssertionError(f"after {timeout} s Prometheus counted {durations} of {requests} requests; series "
                                 f"that differ (prometheus, otlp): {missing}; only in otlp: {set(got) - set(prom)}")
        time.sleep(0.2)


def test_the_genai_metrics_reach_an_otlp_collector_and_agree_with_prometheus(tmp_path, procs, receiver,
                                                                              stack_factory):
    counted, bare = Simulator(procs, model="m"), Simulator(procs, model="n")
    st = stack_factory(write(tmp_path / "gw.yaml", counted, bare, receiver.address), workers=2,
                       run_dir=str(tmp_path / "run"))
    url = f"{st.processor_admin_url}/metrics"
    with httpx.Client(timeout=30) as client:
        def chat(model: str, stream: bool) -> None:
            body = {"model": model, "messages": [{"role": "user", "content": "tell me more"}], "max_tokens": 6,
                    "stream": stream}
            r = client.post(f"{st.url}/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            if stream:
                assert r.text.rstrip().endswith("data: [DONE]"), r.text

        for _ in range(3):
            chat("m", True)
        chat("m", False)
        for _ in range(2):
            chat("n", True)
        series = agree(receiver, url, 6)

        points = receiver.points
        assert {p.name for p in points} == set(UNITS)
        for p in points:
            assert p.unit == UNITS[p.name] and p.service == "adapter-gateway-processor", p
        assert {p.bounds for p in points if p.name == "gen_ai.server.time_to_first_token"} == {TTFT_BOUNDS}
        assert {p.bounds for p in points if p.name == "gen_ai.client.token.usage"} == {TOKEN_BOUNDS}
        tokens = {dict(attrs)["gen_ai.request.model"]: dict(attrs)
                  for (name, attrs) in series if name == "gen_ai.client.token.usage"}
        assert tokens["m"]["estimated"] is False and tokens["m"]["gen_ai.provider.name"] == "vllm"
        assert (tokens["m"]["server.address"], tokens["m"]["server.port"]) == ("127.0.0.1", counted.port)
        assert tokens["n"]["estimated"] is True and tokens["n"]["gen_ai.provider.name"] == "openai"
        assert (tokens["n"]["server.address"], tokens["n"]["server.port"]) == ("127.0.0.1", bare.port)
        assert receiver.count("gen_ai.client.token.usage", **{"gen_ai.request.model": "n", "estimated": True}) == 4
        assert receiver.count("gen_ai.server.time_to_first_token") == 5  # the streamed ones

        # the collector goes away: requests are answered as before; one that comes back on the port
        # gets totals that agree with Prometheus again
        port = receiver.port
        receiver.stop()
        for _ in range(10):
            chat("m", True)
        late = OtlpReceiver(port=port)
        try:
            agree(late, url, 16)
        finally:
            late.stop()
