"""Tests for the OpenAI API (vLLM) simulator, driven over real HTTP.

Simulators run as subprocesses (``python -m backends.simulator_openai``) and
are exercised with the real ``openai`` client, ``httpx`` (HTTP/1.1 and h2c)
and the Prometheus text they expose.  Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import h2.config
import h2.connection
import h2.errors
import h2.events
import httpx
import jsonschema
import openai
import pytest

from backends.simulator_openai import SimulatorSettings, build_app, count_tokens, serve
from extproc.stack import free_port
from tests.promtext import families, parse

pytestmark = pytest.mark.timeout(60)

REPO_ROOT = Path(__file__).resolve().parents[2]
BASE_MODEL = "qwen2.5-finance"
LORA = "fin-lora"
READY_LINE = re.compile(
    r"^simulator listening on http://127\.0\.0\.1:(\d+) \(OpenAI API simulator, not a real model\)$")
VLLM_METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
)
PORTFOLIO_SCHEMA = {
    "type": "object",
    "properties": {
        "ticker": {"type": "string", "minLength": 1, "maxLength": 5},
        "weights": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}, "minItems": 2},
        "rating": {"enum": ["buy", "hold", "sell"]},
        "as_of": {"type": "string", "format": "date"},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["ticker", "weights", "rating", "as_of", "note"],
    "additionalProperties": False,
}


# -- simulator processes -------------------------------------------------------


@dataclass
class Simulator:
    process: subprocess.Popen
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=20)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=20)


def _wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _start(log_path: Path, *args: str) -> Simulator:
    port = free_port()
    log_file = log_path.open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "backends.simulator_openai", "--port", str(port), *args],
        cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=log_file)
    log_file.close()
    sim = Simulator(process, port)

    def healthy() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"simulator exited with {process.returncode}: {log_path.read_text()}")
        try:
            return httpx.get(f"{sim.url}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    try:
        _wait_until(healthy, 15, "the simulator's /health")
    except BaseException:
        _stop(sim)
        raise
    return sim


def _stop(sim: Simulator) -> None:
    if sim.process.poll() is None:
        sim.process.send_signal(signal.SIGTERM)
        try:
            sim.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            sim.process.kill()
            sim.process.wait(timeout=5)


@pytest.fixture(scope="module")
def fast_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Simulator]:
    """Instant simulator with a LoRA adapter."""
    sim = _start(tmp_path_factory.mktemp("fast") / "stderr.log", "--lora", f"{LORA}:{BASE_MODEL}")
    yield sim
    _stop(sim)


@pytest.fixture(scope="module")
def paced_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Simulator]:
    """One running slot, 50 tokens/s decode: queueing and pacing are observable."""
    sim = _start(tmp_path_factory.mktemp("paced") / "stderr.log",
                 "--decode-tokens-per-s", "50", "--max-num-seqs", "1")
    yield sim
    _stop(sim)


def _metrics(sim: Simulator) -> str:
    response = httpx.get(f"{sim.url}/metrics", timeout=5)
    assert response.status_code == 200
    return response.text


def _sample(text: str, name: str, **labels: str) -> float:
    """Value of the one series named `name` whose labels include `labels`, from the parsed exposition."""
    matches = {lab: v for lab, v in parse(text).series(name).items() if set(labels.items()) <= set(lab)}
    assert len(matches) == 1, f"{name}{labels}: {matches or 'no sample'}"
    return next(iter(matches.values()))


def _gauge(sim: Simulator, name: str, model: str = BASE_MODEL) -> float:
    return _sample(_metrics(sim), name, model_name=model)


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# -- chat completions -----------------------------------------------------------


def test_chat_completion_shape_usage_and_length(fast_sim: Simulator) -> None:
    prompt = "How did the portfolio do this quarter? ünïcödé"
    result = fast_sim.client().chat.completions.create(
        model=BASE_MODEL, messages=_user(prompt), max_tokens=5, temperature=0.7)
    assert result.object == "chat.completion"
    assert result.id.startswith("chatcmpl-")
    assert result.model == BASE_MODEL
    [choice] = result.choices
    assert choice.message.role == "assistant"
    assert len(choice.message.content.split()) == 5
    assert choice.finish_reason == "length"
    assert result.usage.prompt_tokens == math.ceil(len(prompt.encode()) / 4) == count_tokens(prompt)
    assert result.usage.completion_tokens == 5
    assert result.usage.total_tokens == result.usage.prompt_tokens + 5


def test_chat_default_length_stop_and_determinism(fast_sim: Simulator) -> None:
    client = fast_sim.client()

    def ask(**kwargs) -> str:
        result = client.chat.completions.create(model=BASE_MODEL, messages=_user("hello"), **kwargs)
        if not kwargs:
            assert result.choices[0].finish_reason == "stop"
            assert result.usage.completion_tokens == 16
        return result.choices[0].message.content

    first = ask()
    assert len(first.split()) == 16
    assert ask() == first
    assert ask(seed=1) == ask(seed=1) != ask(seed=2)


def test_chat_n_choices_differ(fast_sim: Simulator) -> None:
    result = fast_sim.client().chat.completions.create(
        model=BASE_MODEL, messages=_user("options?"), n=3, max_tokens=8)
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert len({c.message.content for c in result.choices}) == 3
    assert result.usage.completion_tokens == 24


def test_lora_adapter_is_served(fast_sim: Simulator) -> None:
    result = fast_sim.client().chat.completions.create(model=LORA, messages=_user("hi"), max_tokens=2)
    assert result.model == LORA
    assert result.choices[0].finish_reason == "length"


def test_chat_stream_with_usage_matches_non_stream(fast_sim: Simulator) -> None:
    client = fast_sim.client()
    request = {"model": BASE_MODEL, "messages": _user("stream please"), "max_tokens": 7}
    chunks = list(client.chat.completions.create(
        **request, stream=True, stream_options={"include_usage": True}))

    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    first, *content, usage_chunk = chunks
    assert first.choices[0].delta.role == "assistant"
    assert first.choices[0].delta.content == ""
    assert len(content) == 7
    assert [c.choices[0].finish_reason for c in content] == [None] * 6 + ["length"]
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == 7
    assert usage_chunk.usage.prompt_tokens == count_tokens("stream please")

    streamed = "".join(c.choices[0].delta.content for c in content)
    assert streamed == client.chat.completions.create(**request).choices[0].message.content


def test_raw_sse_framing(fast_sim: Simulator) -> None:
    body = {"model": BASE_MODEL, "messages": _user("x"), "max_tokens": 2, "stream": True}
    response = httpx.post(f"{fast_sim.url}/v1/chat/completions", json=body, timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = response.text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])
    assert len(events[:-2]) == 3  # role chunk + 2 tokens; no usage chunk when not asked


def test_stream_chunks_arrive_incrementally(paced_sim: Simulator) -> None:
    """Each chunk reaches the client while the simulator is still decoding the rest: read at the
    first and the tenth content chunk, its token counter is below the answer's 50 tokens and the
    request still runs. Were the response buffered, the first chunk would arrive after the last
    token (50 tokens at 50 tokens/s: about a second later)."""
    client = paced_sim.client()
    client.models.list()  # warm the client and its connection up
    def now() -> tuple[float, float]:
        """(tokens generated, requests running), from one scrape: consistent even on a loaded machine."""
        text = _metrics(paced_sim)
        return (_sample(text, "vllm:generation_tokens_total", model_name=BASE_MODEL),
                _sample(text, "vllm:num_requests_running", model_name=BASE_MODEL))

    before = now()[0]
    seen: dict[int, tuple[float, float]] = {}  # content chunk -> (tokens generated so far, requests running)
    content = 0
    stream = client.chat.completions.create(
        model=BASE_MODEL, messages=_user("count to fifty"), max_tokens=50, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            content += 1
            if content in (1, 10):
                tokens, running = now()
                seen[content] = (tokens - before, running)
    assert content == 50
    for index, (tokens, running) in seen.items():
        assert index <= tokens < 50 and running == 1, (index, tokens, running)
    assert seen[10][0] > seen[1][0]  # decoding went on between the two reads


# -- structured output ----------------------------------------------------------


def test_json_schema_response_validates(fast_sim: Simulator) -> None:
    client = fast_sim.client()
    response_format = {"type": "json_schema",
                       "json_schema": {"name": "portfolio", "schema": PORTFOLIO_SCHEMA, "strict": True}}
    request = {"model": BASE_MODEL, "messages": _user("rate AAPL"), "response_format": response_format,
               "max_tokens": 3}
    result = client.chat.completions.create(**request)
    content = result.choices[0].message.content
    jsonschema.validate(json.loads(content), PORTFOLIO_SCHEMA, format_checker=jsonschema.FormatChecker())
    assert result.choices[0].finish_reason == "stop"  # structured output is not cut by max_tokens
    assert result.usage.completion_tokens == math.ceil(len(content) / 4)

    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**request, stream=True)
                       if c.choices)
    assert streamed == content


def test_json_object_response(fast_sim: Simulator) -> None:
    result = fast_sim.client().chat.completions.create(
        model=BASE_MODEL, messages=_user("json please"), response_format={"type": "json_object"})
    assert isinstance(json.loads(result.choices[0].message.content), dict)


# -- completions, embeddings, models --------------------------------------------


def test_completions_prompts_times_n(fast_sim: Simulator) -> None:
    prompts = ["first prompt", "second prompt here"]
    result = fast_sim.client().completions.create(model=BASE_MODEL, prompt=prompts, n=2, max_tokens=4)
    assert result.object == "text_completion"
    assert result.id.startswith("cmpl-")
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert all(len(c.text.split()) == 4 and c.finish_reason == "length" for c in result.choices)
    assert result.usage.prompt_tokens == sum(count_tokens(p) for p in prompts)
    assert result.usage.completion_tokens == 16


def test_completions_stream(fast_sim: Simulator) -> None:
    chunks = list(fast_sim.client().completions.create(
        model=BASE_MODEL, prompt="once upon a time", max_tokens=5, stream=True,
        stream_options={"include_usage": True}))
    *content, usage_chunk = chunks
    assert len(content) == 5 and all(c.object == "text_completion" for c in chunks)
    assert content[-1].choices[0].finish_reason == "length"
    assert len("".join(c.choices[0].text for c in content).split()) == 5
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 5


def test_embeddings_are_deterministic_unit_vectors(fast_sim: Simulator) -> None:
    client = fast_sim.client()
    result = client.embeddings.create(model=BASE_MODEL, input=["alpha", "beta", "alpha"])  # base64 on the wire
    vectors = [d.embedding for d in result.data]
    assert [d.index for d in result.data] == [0, 1, 2]
    assert all(len(v) == 16 and abs(math.fsum(x * x for x in v) - 1) < 1e-5 for v in vectors)
    assert vectors[0] == vectors[2] != vectors[1]
    assert result.usage.prompt_tokens == 2 * count_tokens("alpha") + count_tokens("beta")

    as_float = client.embeddings.create(model=BASE_MODEL, input="alpha", encoding_format="float")
    assert as_float.data[0].embedding == pytest.approx(vectors[0], abs=1e-6)


def test_models_list(fast_sim: Simulator) -> None:
    models = {m.id: m.to_dict() for m in fast_sim.client().models.list()}
    assert set(models) == {BASE_MODEL, "llama-3-8b", LORA}
    assert all(m["object"] == "model" and m["owned_by"] == "simulator" for m in models.values())
    assert models[BASE_MODEL]["parent"] is None
    assert models[LORA]["parent"] == BASE_MODEL
    assert models[BASE_MODEL]["max_model_len"] == 32768


# -- errors ------------------------------------------------------------------------


def test_unknown_model_is_not_found(fast_sim: Simulator) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        fast_sim.client().chat.completions.create(model="no-such-model", messages=_user("hi"))
    assert caught.value.status_code == 404
    assert caught.value.body == {"message": "The model `no-such-model` does not exist.",
                                 "type": "NotFoundError", "param": "model", "code": 404}


def test_bad_requests(fast_sim: Simulator) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        fast_sim.client().chat.completions.create(model=BASE_MODEL, messages=[])
    assert caught.value.body["type"] == "BadRequestError"
    assert caught.value.body["param"] == "messages"

    malformed = httpx.post(f"{fast_sim.url}/v1/chat/completions", content=b'{"model": "x",,}',
                           headers={"content-type": "application/json"}, timeout=5)
    assert malformed.status_code == 400
    error = malformed.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert "line 1 column 15" in error["message"]

    unsatisfiable = httpx.post(f"{fast_sim.url}/v1/chat/completions", timeout=5, json={
        "model": BASE_MODEL, "messages": _user("x"),
        "response_format": {"type": "json_schema", "json_schema": {"name": "never", "schema": False}}})
    assert unsatisfiable.status_code == 400 and unsatisfiable.json()["error"]["param"] == "response_format"

    too_long = httpx.post(f"{fast_sim.url}/v1/completions", timeout=5,
                          json={"model": BASE_MODEL, "prompt": "x", "max_tokens": 40000})
    assert too_long.status_code == 400
    assert "maximum context length is 32768" in too_long.json()["error"]["message"]


def test_unknown_path_and_wrong_method(fast_sim: Simulator) -> None:
    missing = httpx.get(f"{fast_sim.url}/v2/nothing", timeout=5)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
    wrong = httpx.get(f"{fast_sim.url}/v1/chat/completions", timeout=5)
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"


def test_health_ping_version(fast_sim: Simulator) -> None:
    assert httpx.get(f"{fast_sim.url}/health", timeout=5).status_code == 200
    assert httpx.get(f"{fast_sim.url}/ping", timeout=5).status_code == 200
    assert httpx.get(f"{fast_sim.url}/version", timeout=5).json() == {"version": "simulator-0.1"}


# -- transport and metrics -----------------------------------------------------------


def test_h2c_prior_knowledge(fast_sim: Simulator) -> None:
    with httpx.Client(http1=False, http2=True, timeout=5) as client:
        models = client.get(f"{fast_sim.url}/v1/models")
        assert models.status_code == 200 and models.http_version == "HTTP/2"
        body = {"model": BASE_MODEL, "messages": _user("h2"), "max_tokens": 3, "stream": True}
        with client.stream("POST", f"{fast_sim.url}/v1/chat/completions", json=body) as stream:
            assert stream.http_version == "HTTP/2"
            text = "".join(stream.iter_text())
        assert text.endswith("data: [DONE]\n\n")


def test_metrics_expose_vllm_names(fast_sim: Simulator) -> None:
    fast_sim.client().chat.completions.create(model=LORA, messages=_user("count me"), max_tokens=3)
    text = _metrics(fast_sim)
    names = parse(text, skip_created=False).names()
    for name in VLLM_METRICS:
        family = {name, f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        assert names & family, f"{name} missing from /metrics"
    assert not any(n.endswith("_created") for n in names)
    assert families(text)["vllm:prompt_tokens"] == "counter"
    # LoRA traffic is accounted to the base model, as vLLM does.
    assert _sample(text, "vllm:generation_tokens_total", model_name=BASE_MODEL) >= 3
    assert _sample(text, "vllm:request_success_total", model_name=BASE_MODEL, finished_reason="length") >= 1
    assert _sample(text, "vllm:time_to_first_token_seconds_count", model_name=BASE_MODEL) >= 1
    assert _sample(text, "vllm:kv_cache_usage_perc", model_name=BASE_MODEL) == 0.0
    assert _sample(text, "vllm:num_requests_running", model_name=BASE_MODEL) == 0.0
    assert "vllm:lora_requests_info" in names


# -- engine behaviour -------------------------------------------------------------------


async def test_priority_orders_waiting_requests(paced_sim: Simulator) -> None:
    """max_num_seqs=1: of two queued requests, the lower priority value runs first."""
    client = paced_sim.async_client()
    finished: list[str] = []

    async with httpx.AsyncClient(base_url=paced_sim.url, timeout=10) as http:
        async def wait_for(name: str, value: float) -> None:
            deadline = time.monotonic() + 5
            while _sample((await http.get("/metrics")).text, name, model_name=BASE_MODEL) != value:
                assert time.monotonic() < deadline, f"{name} never reached {value}"
                await asyncio.sleep(0.02)

        async def ask(name: str, priority: int) -> None:
            await client.chat.completions.create(model=BASE_MODEL, messages=_user(name), max_tokens=3,
                                                 extra_body={"priority": priority})
            finished.append(name)

        blocker = {"model": BASE_MODEL, "messages": _user("block"), "max_tokens": 500, "stream": True}
        async with http.stream("POST", "/v1/chat/completions", json=blocker):
            await wait_for("vllm:num_requests_running", 1)
            queued_first = asyncio.create_task(ask("queued-first-priority-10", 10))
            await wait_for("vllm:num_requests_waiting", 1)
            queued_second = asyncio.create_task(ask("queued-second-priority-1", 1))
            await wait_for("vllm:num_requests_waiting", 2)
        # leaving the block disconnects the blocker and frees the only slot
        await asyncio.wait_for(asyncio.gather(queued_first, queued_second), timeout=10)
    await client.close()
    assert finished == ["queued-second-priority-1", "queued-first-priority-10"]


def test_client_disconnect_frees_slot_and_queue(paced_sim: Simulator) -> None:
    url = f"{paced_sim.url}/v1/chat/completions"
    long_stream = {"model": BASE_MODEL, "messages": _user("a long answer"), "max_tokens": 500, "stream": True}
    aborted_before = _sample(_metrics(paced_sim), "vllm:request_success_total",
                             model_name=BASE_MODEL, finished_reason="abort")
    with httpx.Client(timeout=10) as running_client, httpx.Client(timeout=10) as waiting_client:
        with running_client.stream("POST", url, json=long_stream) as running:
            lines = running.iter_lines()
            assert next(lines).startswith("data: ")  # role chunk: admitted and prefilled
            text = _metrics(paced_sim)
            assert _sample(text, "vllm:num_requests_running", model_name=BASE_MODEL) == 1
            assert _sample(text, "vllm:kv_cache_usage_perc", model_name=BASE_MODEL) > 0

            with waiting_client.stream("POST", url, json=long_stream):
                _wait_until(lambda: _gauge(paced_sim, "vllm:num_requests_waiting") == 1, 5, "a waiting request")
            # the queued client went away: it leaves the queue
            _wait_until(lambda: _gauge(paced_sim, "vllm:num_requests_waiting") == 0, 5, "the queue to empty")
            assert _gauge(paced_sim, "vllm:num_requests_running") == 1
        # the streaming client went away mid-stream: its slot and KV cache are freed
        _wait_until(lambda: _gauge(paced_sim, "vllm:num_requests_running") == 0, 5, "the slot to be freed")
    text = _metrics(paced_sim)
    assert _sample(text, "vllm:kv_cache_usage_perc", model_name=BASE_MODEL) == 0
    assert _sample(text, "vllm:request_success_total", model_name=BASE_MODEL,
                   finished_reason="abort") == aborted_before + 1
    # the single slot really is free again
    result = paced_sim.client().chat.completions.create(model=BASE_MODEL, messages=_user("next"), max_tokens=2)
    assert result.choices[0].finish_reason == "length"


def test_h2_stream_reset_frees_slot(paced_sim: Simulator) -> None:
    """Envoy cancels an upstream h2 stream with RST_STREAM when its client goes away."""
    body = json.dumps({"model": BASE_MODEL, "messages": _user("reset me"), "max_tokens": 500,
                       "stream": True}).encode()
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    with socket.create_connection(("127.0.0.1", paced_sim.port), timeout=5) as sock:
        conn.initiate_connection()
        stream_id = conn.get_next_available_stream_id()
        conn.send_headers(stream_id, [
            (":method", "POST"), (":path", "/v1/chat/completions"), (":scheme", "http"),
            (":authority", f"127.0.0.1:{paced_sim.port}"), ("content-type", "application/json")])
        conn.send_data(stream_id, body, end_stream=True)
        sock.sendall(conn.data_to_send())
        data_frames = 0
        while data_frames < 2:  # role chunk and first token: the request is running
            data = sock.recv(65536)
            assert data, "connection closed early"
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.DataReceived):
                    data_frames += 1
                    conn.acknowledge_received_data(event.flow_controlled_length, stream_id)
            sock.sendall(conn.data_to_send())
        assert _gauge(paced_sim, "vllm:num_requests_running") == 1
        conn.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
        sock.sendall(conn.data_to_send())
        _wait_until(lambda: _gauge(paced_sim, "vllm:num_requests_running") == 0, 5, "the slot to be freed")


# -- process and in-process API ----------------------------------------------------------


def test_cli_ready_line_and_sigterm_exit(tmp_path: Path) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "backends.simulator_openai", "--port", "0", "--models", "m1"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        readable, _, _ = select.select([process.stdout], [], [], 15)
        assert readable, "no readiness line within 15 s"
        match = READY_LINE.match(process.stdout.readline().rstrip("\n"))
        assert match, "unexpected readiness line"
        port = int(match.group(1))
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()["data"][0]["id"] == "m1"
        process.send_signal(signal.SIGTERM)
        assert process.wait() == 0  # one signal, a clean exit (a hang fails on the test's timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=5)
        process.stdout.close()


async def test_serve_in_process() -> None:
    shutdown = asyncio.Event()
    ready: asyncio.Future = asyncio.get_running_loop().create_future()
    settings = SimulatorSettings(port=0, models=("m1",), loras=(("m1-lora", "m1"),))
    server = asyncio.create_task(serve(settings, shutdown, on_ready=lambda host, port: ready.set_result(port)))
    try:
        port = await asyncio.wait_for(ready, 10)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
            response = await client.post("/v1/chat/completions", json={
                "model": "m1-lora", "messages": _user("in process"), "max_tokens": 4})
            assert response.status_code == 200
            assert response.json()["usage"]["completion_tokens"] == 4
    finally:
        shutdown.set()
        await asyncio.wait_for(server, 5)


async def test_build_app_over_asgi_transport() -> None:
    app = build_app(SimulatorSettings(models=("m1",)))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://simulator") as client:
        response = await client.post("/v1/embeddings", json={"model": "m1", "input": "x"})
        assert response.status_code == 200
        assert len(response.json()["data"][0]["embedding"]) == 16
        not_found = await client.post("/v1/embeddings", json={"model": "m2", "input": "x"})
        assert not_found.status_code == 404


def test_settings_validation() -> None:
    with pytest.raises(ValueError):
        SimulatorSettings(models=("a",), loras=(("l", "missing-base"),))
    with pytest.raises(ValueError):
        SimulatorSettings(models=())
    with pytest.raises(ValueError):
        SimulatorSettings(decode_tokens_per_s=-1)
