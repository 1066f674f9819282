"""Stage `client-api` (`anthropic-messages`, `openai-responses`) in process on compiled routes.

Request side: refusals in the API's dialect (405, empty body, malformed JSON, a field the translation
refuses, an unknown model from dispatch), the chat request that replaces the body with `:path` and an
exact content-length, and the model read for dispatch. Response side: content-length removed, a JSON
answer translated at its end (chunks before it held), an SSE stream translated chunk by chunk with
the same bytes out whatever the chunk boundaries (a property), usage counted, a stream without
`[DONE]` closed with the API's error, and backend / Envoy errors in the API's error shape.
"""

from __future__ import annotations

import asyncio

import orjson
import pytest
from hypothesis import given, settings, strategies as st

from backends.base import Usage
from extproc import codec
from extproc.config.loader import load_text
from extproc.types import HttpMessage, Mutate, Outcome, Phase, Reject, RequestState

CONFIG = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: apis}
spec:
  backends:
    - {name: alpha, kind: vllm, endpoints: ["127.0.0.1:8001"], models: [m1]}
    - {name: beta, kind: vllm, endpoints: ["127.0.0.1:9001"], models: [m2]}
  routes:
    - {path: /v1/messages, kind: anthropic-messages, name: msgs, targets: [alpha, beta], policy: {maxBodyBytes: 4000}}
    - {path: /v1/responses, kind: openai-responses, name: resps, targets: [alpha, beta]}
"""


@pytest.fixture(scope="module")
def snap():
    return load_text(CONFIG, "apis.yaml")


def run(snap, route: str, *msgs: HttpMessage, state: RequestState | None = None):
    st_ = state or RequestState(snapshot=snap, route=snap.routes[route], started=0.0, request_id="rid")
    out = []
    for m in msgs:
        if m.phase is Phase.RESPONSE_HEADERS:
            st_.response_status = int(m.headers[":status"])
            st_.response_details = (m.attributes or {}).get("response.code_details", "via_upstream")
        out.append(asyncio.run(st_.route.pipeline.run(st_, m)))
    return st_, out


def post(path="/v1/messages", end=False):
    return HttpMessage(Phase.REQUEST_HEADERS, headers={":path": path, ":method": "POST"}, end_of_stream=end)


def body(doc) -> HttpMessage:
    return HttpMessage(Phase.REQUEST_BODY, body=doc if isinstance(doc, bytes) else orjson.dumps(doc), end_of_stream=True)


def resp_headers(status=200, ctype="application/json", details="via_upstream"):
    return HttpMessage(Phase.RESPONSE_HEADERS, headers={":status": str(status), "content-type": ctype,
                                                         "content-length": "123"},
                       attributes={"response.code_details": details})


def chunk(data: bytes, end=False):
    return HttpMessage(Phase.RESPONSE_BODY, body=data, end_of_stream=end)


MESSAGES = {"model": "m2", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
RESPONSES = {"model": "m1", "input": "hi"}


def rendered(snap, route: str, verdict: Reject) -> dict:
    return orjson.loads(codec.encode(Phase.REQUEST_BODY, verdict, snap.routes[route].dialect, route,
                                     "rid").immediate_response.body)


# --- request ----------------------------------------------------------------------------------------


def test_request_is_replaced_by_the_chat_request_and_dispatched_by_model(snap):
    state, (_, v) = run(snap, "msgs", post(), body({**MESSAGES, "system": "s"}))
    assert isinstance(v, Mutate)
    hdrs = dict(v.set_headers)
    assert hdrs[":path"] == "/v1/chat/completions" and hdrs["content-type"] == "application/json"
    assert hdrs["x-adapter-backend"] == "beta" and int(hdrs["content-length"]) == len(v.body)
    assert v.remove_headers == ("accept-encoding",)  # the answer is rewritten: it must come uncompressed
    assert orjson.loads(v.body) == {"model": "m2", "max_tokens": 5, "messages": [
        {"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]}
    assert state.request.api == "anthropic.messages" and state.request.model == "m2"
    assert state.request.prompt_text() == "s\nhi" and state.request.max_tokens == 5


@pytest.mark.parametrize("route, path, doc, status, check", [
    ("msgs", "/v1/messages", {**MESSAGES, "max_tokens": None}, 400,
     lambda b: b["error"] == {"type": "invalid_request_error", "message": "max_tokens: an integer of at least 1 is required"}),
    ("msgs", "/v1/messages", b"{not json", 400, lambda b: b["type"] == "error" and "not valid JSON" in b["error"]["message"]),
    ("msgs", "/v1/messages", [1], 400, lambda b: b["error"]["type"] == "invalid_request_error"),
    ("msgs", "/v1/messages", {**MESSAGES, "model": "gpt-9"}, 404,
     lambda b: b["error"]["type"] == "not_found_error" and "gpt-9" in b["error"]["message"]),
    ("msgs", "/v1/messages", {**MESSAGES, "messages": [{"role": "user", "content": "x" * 5000}]}, 413,
     lambda b: b["error"]["type"] == "request_too_large"),
    ("resps", "/v1/responses", {**RESPONSES, "previous_response_id": "resp_1"}, 400,
     lambda b: b["error"]["param"] == "previous_response_id" and b["error"]["type"] == "invalid_request_error"),
    ("resps", "/v1/responses", {**RESPONSES, "model": "gpt-9"}, 404, lambda b: b["error"]["param"] == "model"),
])
def test_refusals_in_the_api_dialect(snap, route, path, doc, status, check):
    _, (_, v) = run(snap, route, post(path), body(doc))
    assert isinstance(v, Reject) and v.status == status
    assert check(rendered(snap, route, v))


def test_not_a_post_or_no_body_is_refused_at_request_headers(snap):
    _, (v,) = run(snap, "msgs", HttpMessage(Phase.REQUEST_HEADERS, headers={":path": "/v1/messages", ":method": "GET"}))
    assert isinstance(v, Reject) and v.status == 405
    _, (v,) = run(snap, "resps", post("/v1/responses", end=True))
    assert isinstance(v, Reject) and (v.status, v.code) == (400, "empty_body")


# --- response -----------------------------------------------------------------------------------


CHAT = {"id": "chatcmpl-1", "object": "chat.completion", "model": "m2",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


def test_json_answer_is_held_until_its_end_and_translated(snap):
    raw = orjson.dumps(CHAT)
    state, (_, _, h, c1, c2) = run(snap, "msgs", post(), body(MESSAGES), resp_headers(), chunk(raw[:10]),
                                   chunk(raw[10:], end=True))
    assert h.remove_headers == ("content-length",) and ("content-type", "application/json") in h.set_headers
    assert c1.body == b""
    assert orjson.loads(c2.body) == {"id": "msg_1", "type": "message", "role": "assistant", "model": "m2",
                                     "content": [{"type": "text", "text": "hello"}], "stop_reason": "end_turn",
                                     "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 1}}
    assert state.usage == Usage(3, 1)


def sse(*chunks: dict) -> bytes:
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


STREAM = sse({"id": "chatcmpl-2", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
             {"id": "chatcmpl-2", "choices": [{"index": 0, "delta": {"content": "Hel"}}]},
             {"id": "chatcmpl-2", "choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}]},
             {"id": "chatcmpl-2", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}})


def stream_through(snap, route, doc, parts: list[bytes]):
    msgs = [chunk(p, end=i == len(parts) - 1) for i, p in enumerate(parts)]
    state, out = run(snap, route, post(f"/v1/{'messages' if route == 'msgs' else 'responses'}"),
                     body({**doc, "stream": True}), resp_headers(ctype="text/event-stream"), *msgs)
    return state, out[2], [v.body for v in out[3:]]


def event_names(raw: bytes) -> list[str]:
    return [line[7:].decode() for line in raw.split(b"\n") if line.startswith(b"event: ")]


def test_stream_is_translated_chunk_by_chunk(snap):
    cut = STREAM.index(b"\n\n") + 12  # the first event and part of the second
    state, h, bodies = stream_through(snap, "msgs", MESSAGES, [STREAM[:cut], STREAM[cut:]])
    assert h.remove_headers == ("content-length",) and not h.set_headers
    assert event_names(bodies[0]) == ["message_start", "ping"]  # out with its chunk: nothing waits for the end
    assert event_names(b"".join(bodies)) == ["message_start", "ping", "content_block_start", "content_block_delta",
                                             "content_block_delta", "content_block_stop", "message_delta",
                                             "message_stop"]
    assert state.usage == Usage(4, 2) and state.observed is None
    assert state.delivered  # the closing events went out: a client may close after them


@settings(max_examples=60, deadline=None)
@given(st.sets(st.integers(1, len(STREAM) - 1), max_size=6), st.sampled_from(["msgs", "resps"]))
def test_chunk_boundaries_do_not_change_the_translated_stream(snap, cuts, route):
    doc = MESSAGES if route == "msgs" else RESPONSES
    bounds = [0, *sorted(cuts), len(STREAM)]
    _, _, whole = stream_through(snap, route, doc, [STREAM])
    _, _, split = stream_through(snap, route, doc, [STREAM[a:b] for a, b in zip(bounds, bounds[1:])])
    strip = (lambda raw: raw) if route == "msgs" else (lambda raw: orjson.dumps(
        [{k: v for k, v in orjson.loads(line[6:]).items() if k != "response"} for line in raw.split(b"\n")
         if line.startswith(b"data: ")]))  # response.* snapshots carry created_at (the clock)
    assert strip(b"".join(split)) == strip(b"".join(whole))


@pytest.mark.parametrize("route, last", [("msgs", "error"), ("resps", "response.failed")])
def test_stream_without_done_ends_with_the_api_error(snap, route, last):
    doc = MESSAGES if route == "msgs" else RESPONSES
    state, _, bodies = stream_through(snap, route, doc, [STREAM[:STREAM.index(b"data: [DONE]")]])
    names = event_names(b"".join(bodies))
    assert names[-1] == last and state.observed is Outcome.TRUNCATED and not state.delivered


def test_in_stream_backend_error_becomes_the_api_error(snap):
    raw = b'data: {"error": {"message": "engine died", "type": "server_error"}}\n\n'
    _, _, bodies = stream_through(snap, "msgs", MESSAGES, [raw])
    events = [orjson.loads(line[6:]) for line in bodies[0].split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == {"type": "error", "error": {"type": "api_error", "message": "backend beta: engine died"}}


def error_body(snap, route, doc, status, raw, details="via_upstream"):
    state, out = run(snap, route, post(f"/v1/{'messages' if route == 'msgs' else 'responses'}"), body(doc),
                     resp_headers(status, details=details), chunk(raw[:5]), chunk(raw[5:], end=True))
    assert out[3].body == b""
    return orjson.loads(out[4].body)


def test_backend_4xx_keeps_its_message_in_the_api_shape(snap):
    raw = orjson.dumps({"object": "error", "message": "max_tokens is too large", "type": "BadRequestError"})
    assert error_body(snap, "msgs", MESSAGES, 400, raw) == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "backend beta: max_tokens is too large"},
        "request_id": "rid"}
    b = error_body(snap, "resps", RESPONSES, 400, orjson.dumps({"error": {"message": "bad"}}))
    assert b["error"]["message"] == "backend alpha: bad" and b["error"]["type"] == "invalid_request_error"


def test_backend_5xx_body_is_not_returned(snap, caplog):
    raw = b"Traceback: /srv/engine.py line 3 secret"
    b = error_body(snap, "msgs", MESSAGES, 500, raw)
    assert b["error"]["type"] == "api_error" and "secret" not in orjson.dumps(b).decode()
    assert "logged its answer under request id rid" in b["error"]["message"]
    assert "secret" in caplog.text


def test_envoy_reply_names_its_reason_and_the_backend(snap):
    raw = orjson.dumps({"error": {"status": 503, "code": "upstream_reset_before_response_started{connection_failure}",
                                  "backend": "beta"}})
    b = error_body(snap, "msgs", MESSAGES, 503, raw, details="upstream_reset_before_response_started")
    assert b["error"]["type"] == "overloaded_error"
    assert b["error"]["message"] == ("the gateway could not get an answer from backend beta: "
                                     "upstream_reset_before_response_started{connection_failure}")


# --- hostile input: a clear refusal or a translation, never a stage error --------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda v: st.lists(v, max_size=4) | st.dictionaries(
        st.sampled_from(["model", "max_tokens", "messages", "role", "content", "type", "text", "tools", "tool_choice",
                         "input", "instructions", "name", "input_schema", "parameters", "call_id", "arguments",
                         "output", "tool_use_id", "id", "source", "system", "stream", "text", "format", "schema",
                         "image_url", "stop_sequences", "metadata", "user_id", "is_error"]), v, max_size=6),
    max_leaves=25)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["msgs", "resps"]), st.dictionaries(st.sampled_from(
    ["model", "max_tokens", "messages", "input", "instructions", "tools", "tool_choice", "system", "stream", "text",
     "stop_sequences", "metadata", "max_output_tokens", "temperature"]), json_values, max_size=8))
def test_any_json_body_is_translated_or_refused_in_dialect(snap, route, doc):
    _, (_, v) = run(snap, route, post(f"/v1/{'messages' if route == 'msgs' else 'responses'}"), body(doc))
    if isinstance(v, Reject):
        assert v.code != "stage_error" and 400 <= v.status < 500, v
        err = rendered(snap, route, v)
        assert err["error"]["message"]
    else:
        assert isinstance(v, Mutate) and orjson.loads(v.body)["messages"]


chunk_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=6),
    lambda v: st.lists(v, max_size=3) | st.dictionaries(
        st.sampled_from(["id", "choices", "index", "delta", "content", "tool_calls", "function", "name", "arguments",
                         "finish_reason", "stop_reason", "usage", "prompt_tokens", "completion_tokens",
                         "prompt_tokens_details", "cached_tokens", "error", "message", "created", "model"]), v,
        max_size=5),
    max_leaves=20)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["msgs", "resps"]), st.lists(st.one_of(
    st.binary(max_size=40),
    st.builds(lambda d: b"data: " + orjson.dumps(d) + b"\n\n", chunk_values),
    st.sampled_from([b"data: [DONE]\n\n", b": ping\n\n", b"event: x\n", b"\r\n\r\n", b"data: {\"choices\": [{}]}\n\n"])),
    min_size=1, max_size=8))
def test_any_backend_stream_is_translated_without_a_stage_error(snap, route, parts):
    doc = MESSAGES if route == "msgs" else RESPONSES
    _, h, bodies = stream_through(snap, route, doc, parts)
    assert isinstance(h, Mutate) and all(isinstance(b, bytes) for b in bodies)
    names = event_names(b"".join(bodies))
    assert names and names[-1] in ("message_stop", "error", "response.completed", "response.incomplete",
                                   "response.failed")


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["msgs", "resps"]), chunk_values)
def test_any_json_answer_is_translated_without_a_stage_error(snap, route, answer):
    doc = MESSAGES if route == "msgs" else RESPONSES
    _, out = run(snap, route, post(f"/v1/{'messages' if route == 'msgs' else 'responses'}"), body(doc),
                 resp_headers(), chunk(orjson.dumps(answer), end=True))
    translated = orjson.loads(out[-1].body)
    assert translated.get("type") in ("message", "error") or translated.get("object") == "response" \
        or "error" in translated
