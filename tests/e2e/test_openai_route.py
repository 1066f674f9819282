"""The `openai` route kind end to end: model dispatch over two vLLM simulators, streaming, usage.

The backends are OpenAI API *simulators* (backends/simulator_openai.py) decoding at 40 tokens/s,
so a streamed answer takes about a second to produce and the timing of its chunks is observable.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import REPO
from tests.promtext import scrape, wait_samples

pytestmark = pytest.mark.e2e
CONFIG = REPO / "examples" / "inference-backends.yaml"


@pytest.fixture(scope="module")
def stack():
    from tests.e2e.conftest import make_stack

    st = make_stack(CONFIG, simulate=frozenset({"vllm-finance", "vllm-general"}),
                    simulator_args=("--decode-tokens-per-s", "40"))
    st.start()
    yield st
    st.stop()


@pytest.fixture
def client(stack):
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=30)


def metric(stack, name: str, **labels) -> float:
    """The one series with exactly these labels (0 before its first count)."""
    return scrape(f"{stack.processor_admin_url}/metrics").value(name, 0.0, **labels)


def metric_after(stack, name: str, expected: float, **labels) -> float:
    """The series once it reached `expected` (usage is counted when the request's end is reported)."""
    return wait_samples(f"{stack.processor_admin_url}/metrics",
                        lambda s: s.value(name, 0.0, **labels) >= expected).value(name, 0.0, **labels)


TOKENS = {"route": "v1", "tenant": "none"}  # the `/v1/` openai route; no tenants configured


def test_models_lists_what_the_gateway_serves(client):
    ids = [m.id for m in client.models.list()]
    assert ids == ["qwen2.5-finance", "fin-lora", "llama-3-8b"]


def test_requests_go_to_the_backend_serving_the_model(stack, client):
    for model, backend in (("llama-3-8b", "vllm-general"), ("fin-lora", "vllm-finance")):
        settled(stack)  # the requests of the tests before have all been counted
        before = metric(stack, "adapter_processor_tokens_total", backend=backend, model=model, type="completion",
                        **TOKENS)
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert r.model == model and r.usage.completion_tokens == 3
        after = metric_after(stack, "adapter_processor_tokens_total", before + 3, backend=backend, model=model,
                             type="completion", **TOKENS)
        assert after - before == 3  # usage counted per route, backend and model


def test_unknown_model_is_a_404_the_client_understands(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    assert "gpt-9" in str(e.value) and "llama-3-8b" in str(e.value)


def settled(stack) -> None:
    """Wait until the processor has counted every ext_proc stream Envoy started (a request's usage is
    counted with it, when the worker learns its end): a count read next holds no earlier request's
    late report. Bounded (wait_samples' deadline)."""
    started = httpx.get(f"{stack.admin_url}/stats?filter=^http.adapter.ext_proc.streams_started$", timeout=5)
    want = float(started.text.split(":")[1])
    url = f"{stack.processor_admin_url}/metrics"
    got = wait_samples(url, lambda s: s.total("adapter_processor_requests_total") >= want)
    assert got.total("adapter_processor_requests_total") == want, (got.total("adapter_processor_requests_total"), want)


def backend_decoded(stack, backend: str) -> float:
    """The simulator's own count of the tokens it has decoded so far (all its models)."""
    return scrape(f"http://127.0.0.1:{stack.simulators[backend][1]}/metrics").total("vllm:generation_tokens_total")


def test_stream_arrives_chunk_by_chunk_and_usage_is_counted(stack, client):
    settled(stack)  # the requests of the tests before have all been counted
    before = metric(stack, "adapter_processor_tokens_total", backend="vllm-general", model="llama-3-8b",
                    type="completion", **TOKENS)
    decoded0 = backend_decoded(stack, "vllm-general")
    text, decoded_at_first = "", None
    stream = client.chat.completions.create(model="llama-3-8b", messages=[{"role": "user", "content": "tell"}],
                                            max_tokens=40, stream=True)
    for chunk in stream:
        if not chunk.choices:
            pytest.fail("a usage-only chunk reached a client that did not ask for it")
        text += chunk.choices[0].delta.content or ""
        if text and decoded_at_first is None:
            decoded_at_first = backend_decoded(stack, "vllm-general") - decoded0
    # the first token reached the client through Envoy and the processor while the backend was still
    # decoding the rest (40 tokens at 40 tokens/s); a buffered stream would arrive after all 40
    assert decoded_at_first is not None and 1 <= decoded_at_first < 40, decoded_at_first
    assert len(text.split()) == 40
    counted = metric_after(stack, "adapter_processor_tokens_total", before + 40, backend="vllm-general",
                           model="llama-3-8b", type="completion", **TOKENS) - before
    assert counted == 40  # from the usage chunk the processor asked for and then removed


def test_client_requested_usage_is_kept(client):
    chunks = list(client.chat.completions.create(
        model="qwen2.5-finance", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4


def test_completions_and_embeddings_pass_through(client):
    c = client.completions.create(model="llama-3-8b", prompt="Q3", max_tokens=2)
    assert c.object == "text_completion" and c.usage.completion_tokens == 2
    e = client.embeddings.create(model="qwen2.5-finance", input=["a", "b"])
    assert len(e.data) == 2 and len(e.data[0].embedding) > 0


def test_priority_and_malformed_body(stack, client):
    r = client.chat.completions.create(model="llama-3-8b", messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                       extra_body={"priority": -5})
    assert r.choices[0].finish_reason == "length"
    bad = httpx.post(f"{stack.url}/v1/chat/completions", content=b"{nope", timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "malformed_json"


def _chat_stream(client, fault: str):
    return client.chat.completions.create(model="llama-3-8b", messages=[{"role": "user", "content": "x"}],
                                          max_tokens=8, stream=True, extra_headers={"x-simulator-fault": fault})


def test_backend_5xx_reaches_the_client_as_a_json_error(client):
    """The status and OpenAI's error shape reach the client; the backend's own body (it can carry the
    server's internals) goes to the gateway's log, named by the request id the client gets."""
    with pytest.raises(openai.InternalServerError) as e:
        _chat_stream(client, "status=500")
    assert "simulated engine failure" not in str(e.value)
    assert e.value.code == "backend_error" and "logged its answer under request id" in e.value.body["message"]


def test_stream_ended_early_by_the_backend_becomes_an_error_event_and_a_clean_end(stack, client):
    received = []
    with pytest.raises(openai.APIError) as e:
        for chunk in _chat_stream(client, "truncate-after=3"):
            received.append(chunk)
    assert "ended the stream before it was complete" in str(e.value)
    assert len(received) == 4  # the role chunk and three content chunks arrived before the error
    raw = httpx.post(f"{stack.url}/v1/chat/completions", headers={"x-simulator-fault": "truncate-after=2"},
                     json={"model": "llama-3-8b", "messages": [{"role": "user", "content": "x"}], "max_tokens": 8,
                           "stream": True}, timeout=10)
    events = [e for e in raw.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and '"code":"backend_stream_truncated"' in events[-2]


def test_connection_reset_mid_stream_fails_fast_and_the_gateway_keeps_serving(stack, client):
    with pytest.raises((openai.APIError, httpx.HTTPError)) as e:
        for _ in _chat_stream(client, "reset-after=3"):
            pass
    # the reset reached the client as an error, not as the client's own 30 s read timeout (a hang)
    assert not isinstance(e.value, (openai.APITimeoutError, httpx.TimeoutException)), repr(e.value)
    r = client.chat.completions.create(model="llama-3-8b", messages=[{"role": "user", "content": "x"}], max_tokens=1)
    assert r.choices[0].message.content


def test_genai_convention_metrics_through_envoy(stack, client):
    """A streamed chat through Envoy and the processor records the OpenTelemetry GenAI metrics: request
    duration, TTFT and time per output token on the serving endpoint, and token usage from the usage
    chunk the processor asked for (estimated="false")."""
    settled(stack)
    url = f"{stack.processor_admin_url}/metrics"
    labels = {"gen_ai_operation_name": "chat", "gen_ai_provider_name": "vllm", "gen_ai_request_model": "llama-3-8b"}

    def count(s, name, **extra):
        return s.total(name, **labels, **extra)

    s0 = scrape(url)
    before = {n: count(s0, n) for n in ("gen_ai_server_request_duration_seconds_count",
                                        "gen_ai_server_time_to_first_token_seconds_count",
                                        "gen_ai_server_time_per_output_token_seconds_count")}
    out0 = count(s0, "gen_ai_client_token_usage_sum", gen_ai_token_type="output", estimated="false")
    stream = client.chat.completions.create(model="llama-3-8b", messages=[{"role": "user", "content": "tell"}],
                                            max_tokens=8, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    s1 = wait_samples(url, lambda s: count(s, "gen_ai_server_request_duration_seconds_count")
                      >= before["gen_ai_server_request_duration_seconds_count"] + 1)
    for name, n in before.items():
        assert count(s1, name) == n + 1, name
    assert count(s1, "gen_ai_client_token_usage_sum", gen_ai_token_type="output", estimated="false") - out0 == 8
    # the serving endpoint is named: the vllm-general simulator's port
    port = str(stack.simulators["vllm-general"][1])
    assert count(s1, "gen_ai_server_time_to_first_token_seconds_count", server_port=port) >= 1
    ttft = count(s1, "gen_ai_server_time_to_first_token_seconds_sum") - count(
        s0, "gen_ai_server_time_to_first_token_seconds_sum")
    duration = count(s1, "gen_ai_server_request_duration_seconds_sum") - count(
        s0, "gen_ai_server_request_duration_seconds_sum")
    assert 0 < ttft < duration  # 8 tokens at 40 tokens/s: the first comes well before the last
