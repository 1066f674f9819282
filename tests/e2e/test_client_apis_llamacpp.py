"""The client APIs on a real engine: Anthropic Messages and OpenAI Responses clients through Envoy and the
processor to the llama.cpp server (PyPI `llama-cpp-python[server]`, a tiny random-weight GGUF the test
writes with tests/llamacpp_model.py: its text is noise, the server and its dialect are real).

What only a real server shows: llama.cpp sends no usage in streams (the gateway estimates it for
`message_delta` / `response.completed`), refuses `response_format: json_schema` (a Responses
`text.format` is sent as llama.cpp's `json_object` + `schema`, learned by probing, and the server's
grammar constrains the answer) and reports real usage in its JSON answers.
"""

from __future__ import annotations

import anthropic
import openai
import orjson
import pytest
import yaml

from extproc.stack import free_port, stop_process, wait_http
from tests.conftest import REPO

pytestmark = pytest.mark.e2e
LLAMA = REPO / ".tools" / "llama-venv" / "bin" / "python"

if not LLAMA.exists():
    pytest.skip("the llama.cpp server is not installed (`make llama-setup` builds it into .tools/llama-venv; "
                "`make test` runs it)", allow_module_level=True)

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    import subprocess

    from tests.e2e.conftest import make_stack

    root = tmp_path_factory.mktemp("llama-apis")
    model = root / "tiny.gguf"
    subprocess.run([str(LLAMA), str(REPO / "tests" / "llamacpp_model.py"), str(model)], check=True, timeout=120)
    port = free_port()
    with open(root / "server.log", "wb") as log:
        server = subprocess.Popen(
            [str(LLAMA), "-m", "llama_cpp.server", "--model", str(model), "--model_alias", MODEL, "--host",
             "127.0.0.1", "--port", str(port), "--n_ctx", "512", "--n_threads", "1", "--verbose", "false"],
            stdout=log, stderr=subprocess.STDOUT)
    cfg = root / "gateway.yaml"
    cfg.write_text(yaml.safe_dump({"apiVersion": "adapter.ai/v1", "kind": "AdapterGateway",
                                   "metadata": {"name": "client-apis-llamacpp"}, "spec": {
        "backends": [{"name": "llama", "endpoints": [f"127.0.0.1:{port}"], "models": [MODEL],
                      "healthPath": "/v1/models"}],  # llama-cpp-python serves no /health
        "routes": [{"path": "/v1/messages", "kind": "anthropic-messages", "target": "llama"},
                   {"path": "/v1/responses", "kind": "openai-responses", "target": "llama"}]}}))
    st = make_stack(cfg, workers=1)
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models", 60, server, "llama.cpp server")
        st.start()
        yield st
    finally:
        st.stop()
        stop_process(server)


def test_messages_answer_with_the_servers_usage(stack):
    client = anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0, timeout=60)
    m = client.messages.create(model=MODEL, max_tokens=4, system="Answer.", messages=[{"role": "user", "content": "hi"}])
    assert m.type == "message" and m.model == MODEL and m.stop_reason in ("max_tokens", "end_turn")
    # the server's own count, passed through: llama-cpp-python has reported max_tokens + 1 (5 for 4, a
    # clean-clone run), so only its bound is checked here
    assert m.usage.input_tokens > 0 and 1 <= m.usage.output_tokens <= 5


def test_messages_stream_from_a_server_without_stream_usage_gets_an_estimate(stack):
    client = anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0, timeout=60)
    with client.messages.stream(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.stop_reason in ("max_tokens", "end_turn")
    # llama.cpp sent no usage chunk: the gateway's estimate (prompt characters / 4, one token per chunk)
    assert final.usage.input_tokens >= 1 and 1 <= final.usage.output_tokens <= 7  # 5 tokens, give or take a chunk


def test_responses_text_format_is_sent_as_llamacpp_takes_it(stack):
    """Responses' `text.format: json_schema` becomes chat's `response_format: json_schema`, which llama.cpp
    refuses (HTTP 500); the negotiated dialect sends `json_object` + `schema`, and the grammar holds."""
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    r = client.responses.create(model=MODEL, input="up?", max_output_tokens=12,
                                text={"format": {"type": "json_schema", "name": "probe", "schema": schema}})
    assert r.output_text.lstrip().startswith("{")
    if r.status == "completed":  # the grammar closed the object within the limit
        assert isinstance(orjson.loads(r.output_text)["ok"], bool)


def test_responses_stream_completes_with_usage(stack):
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60)
    with client.responses.stream(model=MODEL, input="hi", max_output_tokens=4) as stream:
        events = list(stream)
    final = events[-1]
    assert final.type in ("response.completed", "response.incomplete")
    assert final.response.usage.output_tokens >= 1 and final.response.usage.input_tokens >= 1
