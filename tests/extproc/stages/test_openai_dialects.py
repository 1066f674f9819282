"""The `openai` route in the backend's dialect (extproc/stages/openai_api.py `openai-usage`, backends/dialects.py),
through the compiled route's pipeline in process, with dialects fixed by config (`negotiate: false`):
a client's `json_schema` rewritten for llama.cpp, the `prompt` fallback refusing when the route says so,
a refused `priority` removed, and the estimated usage chunk added when the server sends none."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from extproc.config.loader import load_text
from extproc.types import HttpMessage, Mutate, Phase, Reject, RequestState

CONFIG = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: oai}
spec:
  backends:
    - {name: llama, endpoints: ["127.0.0.1:8001"], models: [m1], dialect: {preset: llamacpp, negotiate: false}}
    - {name: plain, endpoints: ["127.0.0.1:8002"], models: [m2],
       dialect: {structuredOutput: prompt, priority: refused, negotiate: false}}
  routes:
    - {path: /v1/, match: prefix, kind: openai, name: api, targets: [llama, plain]}
    - {path: /strict/, match: prefix, kind: openai, name: strict, targets: [plain],
       policy: {structuredFallback: refuse}}
"""
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.fixture(scope="module")
def snap():
    return load_text(CONFIG, "oai.yaml")


def send(snap, route: str, body: dict):
    st = RequestState(snapshot=snap, route=snap.routes[route], started=0.0, request_id="rid")
    pipeline = st.route.pipeline
    asyncio.run(pipeline.run(st, HttpMessage(Phase.REQUEST_HEADERS, headers={":path": "/v1/chat/completions",
                                                                                ":method": "POST"})))
    v = asyncio.run(pipeline.run(st, HttpMessage(Phase.REQUEST_BODY, body=orjson.dumps(body), end_of_stream=True)))
    return st, v


def asked(model: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hello there"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}, **extra}


def test_a_clients_json_schema_goes_to_llamacpp_as_json_object_with_schema(snap):
    st, v = send(snap, "api", asked("m1"))
    assert isinstance(v, Mutate) and st.backend == "llama"
    sent = orjson.loads(v.body)
    assert sent["response_format"] == {"type": "json_object", "schema": SCHEMA}
    assert dict(v.set_headers)["content-length"] == str(len(v.body))


def test_the_prompt_dialect_asks_in_the_prompt_and_drops_a_refused_priority(snap):
    st, v = send(snap, "api", asked("m2", priority=5))
    assert isinstance(v, Mutate) and st.backend == "plain"
    sent = orjson.loads(v.body)
    assert "response_format" not in sent and "priority" not in sent
    assert sent["messages"][0]["role"] == "system" and '"required":["ok"]' in sent["messages"][0]["content"]


def test_a_route_that_refuses_answers_501_naming_the_backend(snap):
    _, v = send(snap, "strict", asked("m2"))
    assert isinstance(v, Reject) and (v.status, v.code) == (501, "structured_output_unsupported")
    assert "plain" in v.message
    _, ok = send(snap, "strict", {"model": "m2", "messages": [{"role": "user", "content": "hi"}]})
    assert not isinstance(ok, Reject)  # no schema asked: nothing to refuse


CHUNK = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
DONE = b"data: [DONE]\n\n"


def stream(snap, include_usage: bool):
    body = {"model": "m1", "messages": [{"role": "user", "content": "tell me about the ledger"}], "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    st, _ = send(snap, "api", body)
    st.served = "127.0.0.1:8001"
    st.response_status = 200
    usage = st.route.pipeline
    out = [asyncio.run(usage.run(st, HttpMessage(Phase.RESPONSE_BODY, body=CHUNK)))]
    out.append(asyncio.run(usage.run(st, HttpMessage(Phase.RESPONSE_BODY, body=CHUNK + DONE, end_of_stream=True))))
    return st, out


def test_a_server_without_stream_usage_gets_the_estimate_as_its_usage_chunk(snap):
    st, (first, last) = stream(snap, include_usage=True)
    assert isinstance(last, Mutate) and last.body.endswith(DONE)
    events = [e for e in last.body.split(b"\n\n") if e.startswith(b"data: {")]
    usage = orjson.loads(events[-1][6:])
    assert usage["choices"] == [] and usage["usage"]["estimated"] is True
    assert usage["usage"]["prompt_tokens"] == len("tell me about the ledger") // 4
    assert usage["usage"]["completion_tokens"] >= 1
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + usage["usage"]["completion_tokens"]


def test_no_usage_chunk_is_added_when_the_client_did_not_ask(snap):
    _, (first, last) = stream(snap, include_usage=False)
    body = last.body if isinstance(last, Mutate) and last.body is not None else CHUNK + DONE
    assert b'"usage"' not in body and body.endswith(DONE)


def test_an_llm_answer_without_usage_is_estimated_from_its_text():
    """A backend that reports no usage on an llm route: decode-response keeps the answer, and the GenAI
    metric's output estimate (extproc/genai.py, labelled estimated) is its text's characters / 4."""
    from extproc.genai import ANSWER_ATTR, estimate_output_tokens
    from extproc.stages.decode_response import DecodeResponse

    snap = load_text("""\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: llm}
spec:
  modelRef: m
  backends: [{name: b, endpoints: ["127.0.0.1:8001"]}]
  routes: [{path: /a, target: b}]
""")
    answer = orjson.dumps({"choices": [{"message": {"content": "twelve chars"}}]})
    for usage, expected in ((None, 3), ({"prompt_tokens": 4, "completion_tokens": 5}, None)):
        st = RequestState(snapshot=snap, route=snap.routes["a"], started=0.0, request_id="rid")
        st.backend_request, st.response_status, st.input_doc = b"{}", 200, {}
        body = answer if usage is None else orjson.dumps({**orjson.loads(answer), "usage": usage})
        v = DecodeResponse().on_response_body(st, HttpMessage(Phase.RESPONSE_BODY, body=body, end_of_stream=True))
        assert isinstance(v, Mutate) and v.body == b'"twelve chars"'
        assert (ANSWER_ATTR in st.attrs) is (usage is None)
        assert (estimate_output_tokens(st) if usage is None else st.usage.completion_tokens) == (expected or 5)
