"""A real engine: the llama.cpp server (PyPI `llama-cpp-python[server]`) behind the real Envoy.

The model is a tiny random-weight GGUF the test writes (tests/llamacpp_model.py): its text is noise,
but the server is real, with its own dialect: it refuses `response_format: json_schema` (HTTP 500 with
its source file in the body), takes `json_object` with a `schema` and enforces it with a grammar, and
sends no usage chunk in streams. The gateway must learn that by probing (extproc/negotiate.py), encode
the brief's `/v1/analyze` route accordingly, estimate the stream's usage (and say so), and keep the
server's internals from the client.
The server lives in its own venv (`.tools/llama-venv`, `make llama-setup`, which `make test` runs).
"""

from __future__ import annotations

import base64
import subprocess
import time

import httpx
import openai
import orjson
import pytest
import yaml

from backends.dialects import PRESETS
from extproc.stack import free_port, stop_process, wait_http
from tests.conftest import REPO
from tests.promtext import wait_samples

pytestmark = pytest.mark.e2e
LLAMA = REPO / ".tools" / "llama-venv" / "bin" / "python"

if not LLAMA.exists():
    pytest.skip("the llama.cpp server is not installed (`make llama-setup` builds it into .tools/llama-venv; "
                "`make test` runs it)", allow_module_level=True)

MODEL = "qwen2.5-finance"
BRIEF = yaml.safe_load((REPO / "examples" / "finance-llm-adapter.yaml").read_text())
ANALYZE = next(r for r in BRIEF["spec"]["routes"] if r["path"] == "/v1/analyze")


def start_llama(model_path, port: int, log) -> subprocess.Popen:
    """The server, its access log (uvicorn's, one line per request) to `log`."""
    return subprocess.Popen(
        [str(LLAMA), "-m", "llama_cpp.server", "--model", str(model_path), "--model_alias", MODEL, "--host",
         "127.0.0.1", "--port", str(port), "--n_ctx", "512", "--n_threads", "1", "--verbose", "false"],
        stdout=log, stderr=subprocess.STDOUT)


def chat_requests(llama) -> int:
    """How many chat completions the server has been asked for so far (its access log)."""
    return llama["log"].read_text().count('"POST /v1/chat/completions HTTP/1.1"')


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    model = root / "tiny.gguf"
    subprocess.run([str(LLAMA), str(REPO / "tests" / "llamacpp_model.py"), str(model)], check=True, timeout=120)
    port = free_port()
    log = root / "server.log"
    with open(log, "wb") as out:
        proc = start_llama(model, port, out)
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models", 60, proc, "llama.cpp server")
        yield {"port": port, "model": model, "proc": proc, "log": log}
    finally:
        stop_process(proc)


def config(llama_port: int, down_port: int) -> str:
    """The brief's /v1/analyze route (as in examples/finance-llm-adapter.yaml) and the OpenAI API, on the
    llama.cpp server; the same server as a backend fixed to the `prompt` dialect (two routes: one falls
    back, one refuses), and as one fixed to OpenAI's dialect, not negotiated; and a backend whose server
    is down."""
    routes = [
        {**ANALYZE, "target": "llama"},
        # with a request template (bounded answers: the random model would write to the context's end)
        {**ANALYZE, "path": "/v1/analyze-prompt", "name": "analyze-prompt", "target": "llama-prompt",
         "request": '{"messages": [{"role": "user", "content": $.query}], "max_tokens": 16}'},
        {**ANALYZE, "path": "/v1/analyze-refuse", "name": "analyze-refuse", "target": "llama-prompt",
         "policy": {"structuredFallback": "refuse"}},
        {**ANALYZE, "path": "/v1/analyze-down", "name": "analyze-down", "target": "down"},
        {**ANALYZE, "path": "/v1/analyze-unnegotiated", "name": "analyze-unnegotiated",
         "target": "llama-unnegotiated"},
        {"path": "/v1/", "match": "prefix", "kind": "openai", "target": "llama"},
    ]
    spec = {
        "modelRef": BRIEF["spec"]["modelRef"], "protocol": "http",
        "backends": [
            # llama-cpp-python serves no /health (the openai kind's default): its model list instead
            {"name": "llama", "endpoints": [f"127.0.0.1:{llama_port}"], "healthPath": "/v1/models"},
            {"name": "llama-prompt", "endpoints": [f"127.0.0.1:{llama_port}"], "healthPath": "/v1/models",
             "dialect": {"structuredOutput": "prompt"}},
            {"name": "down", "endpoints": [f"127.0.0.1:{down_port}"], "timeout": "5s"},
            {"name": "llama-unnegotiated", "endpoints": [f"127.0.0.1:{llama_port}"], "healthPath": "/v1/models",
             "dialect": {"preset": "openai", "negotiate": False}},
        ],
        "routes": routes,
    }
    return yaml.safe_dump({"apiVersion": "adapter.ai/v1", "kind": "AdapterGateway",
                           "metadata": {"name": "llamacpp-e2e"}, "spec": spec}, allow_unicode=True)


@pytest.fixture(scope="module")
def stack(llama, tmp_path_factory):
    from tests.e2e.conftest import make_stack

    path = tmp_path_factory.mktemp("llama-stack") / "gateway.yaml"
    path.write_text(config(llama["port"], free_port()))
    st = make_stack(path, workers=1)
    st.start()
    yield st
    st.stop()


@pytest.fixture
def client(stack):
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60)


def wait_for(ready, timeout: float = 5.0) -> bool:
    """`ready()` once true, or False at the deadline (the server writes its access log after answering)."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def health(stack) -> tuple[int, dict]:
    r = httpx.get(f"{stack.url}/health/adapter?probe=protocol-negotiation", timeout=10)
    return r.status_code, r.json()


def test_the_probe_reports_the_dialect_llamacpp_speaks(stack):
    status, doc = health(stack)
    llama = doc["backends"]["llama"]
    assert llama["status"] == "ok", doc
    d = llama["dialect"]
    assert d["source"] == "probe" and d["engine"] == "llama-cpp-python", d
    # what the server really does: refuses json_schema, enforces json_object + schema, no stream usage
    assert d["structured"] == "json_object_schema" and d["stream_usage"] == "no"
    assert d["priority"] == "ignored" and d["lora"] == "none"
    (ep,) = d["endpoints"]
    assert ep["tried"]["json_schema"] == "refused (HTTP 500)" and ep["tried"]["json_object_schema"] == "enforced"
    assert doc["structured_output"]["v1-analyze"].startswith("json_object_schema")
    # the backend fixed to `prompt` by config: its routes fall back, or refuse, and the probe says so
    fixed = doc["backends"]["llama-prompt"]["dialect"]
    assert fixed["structured"] == "prompt" and fixed["fixed_by_config"] == ["structured"]
    assert doc["structured_output"]["analyze-prompt"].startswith("fallback")
    assert doc["structured_output"]["analyze-refuse"].startswith("refused")
    assert status == 503 and set(doc["failed"]) == {"backend down", "route analyze-refuse"}
    assert doc["backends"]["down"]["dialect"]["source"] == "default"
    assert doc["backends"]["llama-unnegotiated"]["dialect"] == {**PRESETS["openai"].as_dict(), "source": "config"}


def test_the_brief_route_answers_in_its_schema(stack):
    r = httpx.post(f"{stack.url}/v1/analyze", json={"query": "计算Q3营收"}, headers={"x-adapter-debug": "1"},
                   timeout=60)
    assert r.status_code == 200, r.text
    voucher = r.json()["voucher"]
    assert set(voucher) == {"amount", "account"}
    assert isinstance(voucher["amount"], (int, float))
    assert voucher["account"] in ANALYZE["outputSchema"]["properties"]["account"]["enum"]
    sent = orjson.loads(base64.b64decode(r.headers["x-adapter-backend-request"]))
    assert sent["response_format"] == {"type": "json_object", "schema": ANALYZE["outputSchema"]}


def test_a_backend_without_structured_output_gets_the_schema_in_the_prompt(stack, llama):
    """The prompt fallback: the schema in the system prompt, the answer validated, one repair retry.
    A random-weight model cannot write the JSON, so the answer is refused as not matching (502), after
    the one repair retry (the server saw two requests); nothing unvalidated reaches the client."""
    before = chat_requests(llama)
    r = httpx.post(f"{stack.url}/v1/analyze-prompt", json={"query": "计算Q3营收"}, headers={"x-adapter-debug": "1"},
                   timeout=60)
    assert r.status_code == 502, r.text
    assert r.json()["error"]["code"] == "model_output_invalid"
    assert "does not match the route's schema" in r.json()["error"]["message"]
    assert wait_for(lambda: chat_requests(llama) - before == 2), chat_requests(llama) - before


def test_a_route_that_refuses_says_why(stack):
    r = httpx.post(f"{stack.url}/v1/analyze-refuse", json={"query": "x"}, timeout=30)
    assert r.status_code == 501
    err = r.json()["error"]
    assert err["code"] == "structured_output_unsupported" and "llama-prompt" in err["message"]


def test_chat_and_completions_with_the_openai_client(client):
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.choices[0].finish_reason in ("length", "stop") and chat.usage.completion_tokens >= 1
    assert chat.usage.prompt_tokens > 0
    done = client.completions.create(model=MODEL, prompt="The revenue", max_tokens=3)
    assert done.usage.completion_tokens >= 1 and isinstance(done.choices[0].text, str)
    assert [m.id for m in client.models.list()] == [MODEL]


def test_a_client_json_schema_is_sent_as_llamacpp_takes_it(client):
    """The client asks in OpenAI's `json_schema`; the gateway sends llama.cpp's `json_object` + schema,
    so the server constrains the answer instead of failing with a 500."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "up?"}], max_tokens=12,
        response_format={"type": "json_schema", "json_schema": {"name": "probe", "schema": schema}})
    assert r.choices[0].message.content.lstrip().startswith("{")


def test_streamed_chat_gets_a_usage_chunk_marked_estimated(stack, client):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=5, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and chunks[-1].usage is not None and chunks[-1].choices == []
    u = usage[0]
    assert u.model_extra.get("estimated") is True  # the server sent none: the gateway's estimate, labelled
    assert u.prompt_tokens > 0 and u.completion_tokens >= 1 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert isinstance(text, str)
    # counted in the GenAI token metric as estimated (recorded when the request's end is reported)
    series = {"estimated": "true", "gen_ai_token_type": "output"}
    metrics = wait_samples(f"{stack.processor_admin_url}/metrics",
                           lambda s: s.total("gen_ai_client_token_usage_count", **series) >= 1)
    assert metrics.total("gen_ai_client_token_usage_count", **series) >= 1


def test_a_stream_without_include_usage_has_no_usage_chunk(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=3, stream=True))
    assert chunks and all(c.usage is None for c in chunks)


def test_a_server_500_does_not_reach_the_client_with_its_internals(stack):
    """llama.cpp's 500 names its source file; the client gets the route's error with the request id
    instead, the body goes to the gateway's log. On the brief's route: the backend fixed by config to
    OpenAI's dialect without negotiating (what the gateway did before: `json_schema`, refused with 500);
    on the openai route: a response format the server does not know."""
    r = httpx.post(f"{stack.url}/v1/analyze-unnegotiated", json={"query": "x"}, timeout=30)
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["code"] == "backend_error" and err["backend"] == "llama-unnegotiated"
    assert err["request_id"] in err["message"] and "site-packages" not in r.text and "app.py" not in r.text
    bad = httpx.post(f"{stack.url}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "response_format": {"type": "grammar"}})
    assert bad.status_code == 500
    err = bad.json()["error"]
    assert err["code"] == "backend_error" and err["request_id"] in err["message"]
    assert "site-packages" not in bad.text and "app.py" not in bad.text, bad.text


def test_server_down_is_a_503_naming_the_backend(stack):
    r = httpx.post(f"{stack.url}/v1/analyze-down", json={"query": "x"}, timeout=30)
    assert r.status_code == 503
    assert r.json()["error"]["backend"] == "down"
