"""Stage `decode-response` on compiled llm routes: which responses are read at all (only the answer to
a request we encoded, status < 300), the client body (the transform over output and input, or the
output as it is), usage, the backend's errors as 502s naming the backend, and the debug headers."""

from __future__ import annotations

import base64

import orjson
import pytest

from backends.base import Usage
from extproc.config.loader import load_text
from extproc.stages.decode_response import DEBUG_LIMIT, DecodeResponse
from extproc.types import HttpMessage, Mutate, Phase, Reject, RequestState

SNAP = load_text("""
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: dec}
spec:
  backends: [{name: llm, endpoints: ["127.0.0.1:9"], models: [m7]}]
  routes:
    - {path: /plain, name: plain, kind: llm}
    - {path: /echo, name: echo, kind: llm, transform: '{"label": $.output.label, "asked": $.input.q}'}
""")


def state(route: str, status: int | None = 200, sent: bytes | None = b'{"model": "m7"}', debug=False) -> RequestState:
    return RequestState(snapshot=SNAP, route=SNAP.routes[route], started=0.0, request_id="rid", debug=debug,
                        input_doc={"q": "why"}, backend_request=sent, response_status=status)


def chat(content: str) -> bytes:
    return orjson.dumps({"model": "m7", "choices": [{"message": {"role": "assistant", "content": content}}],
                         "usage": {"prompt_tokens": 5, "completion_tokens": 9}})


def decode(st, data: bytes):
    return DecodeResponse().on_response_body(st, HttpMessage(Phase.RESPONSE_BODY, body=data, end_of_stream=True))


def headers_reply(st):
    return DecodeResponse().on_response_headers(st, HttpMessage(Phase.RESPONSE_HEADERS, headers={}))


@pytest.mark.parametrize("status", [200, 201, 299])
def test_a_success_to_a_request_we_encoded_is_read(status):
    assert headers_reply(state("plain", status)) is None


@pytest.mark.parametrize("status, sent", [(300, b"{}"), (301, b"{}"), (404, b"{}"), (503, b"{}"), (200, None)])
def test_other_responses_pass_through_unread(status, sent):
    assert headers_reply(state("plain", status, sent)) == Mutate(skip_body=True)


def test_no_status_yet_is_read():
    assert headers_reply(state("plain", None)) is None


def test_without_a_transform_the_client_gets_the_output():
    st = state("plain")
    v = decode(st, chat("forty-two"))
    assert v == Mutate(set_headers=(("content-type", "application/json"),), remove_headers=("content-length",),
                       body=b'"forty-two"')
    assert st.usage == Usage(5, 9)


def test_the_transform_reads_the_output_and_the_clients_input():
    st = state("echo", None)  # no status seen: decoded as a 200
    v = decode(st, chat('{"label": "spam"}'))
    assert isinstance(v, Mutate) and orjson.loads(v.body) == {"label": "spam", "asked": "why"}
    assert v.remove_headers == ("content-length",) and st.usage == Usage(5, 9)


def test_a_backend_answer_without_content_is_a_502_naming_the_backend():
    st = state("plain")
    v = decode(st, b'{"choices": []}')
    assert isinstance(v, Reject) and (v.status, v.code) == (502, "backend_bad_response")
    assert v.message == "backend llm response has no choices[0].message.content" and v.fields == {"backend": "llm"}
    assert st.usage is None


def test_a_missing_output_path_is_a_502_naming_path_and_backend():
    v = decode(state("echo"), chat('{"other": 1}'))
    assert isinstance(v, Reject) and (v.status, v.code) == (502, "transform_path_missing")
    assert v.message == "response transform: $.output.label not found in the backend output"
    assert v.fields == {"path": "$.output.label", "backend": "llm"}


def test_debug_adds_route_backend_and_the_backend_request():
    st = state("plain", sent=b'{"model": "m7", "x": 1}', debug=True)
    v = decode(st, chat("ok"))
    assert v.set_headers == (("content-type", "application/json"), ("x-adapter-route", "plain"),
                             ("x-adapter-backend", "llm"),
                             ("x-adapter-backend-request", base64.b64encode(b'{"model": "m7", "x": 1}').decode()))


def test_debug_cuts_a_long_backend_request_and_omits_a_missing_one():
    big = b"x" * (DEBUG_LIMIT + 10)
    v = decode(state("plain", sent=big, debug=True), chat("ok"))
    assert base64.b64decode(dict(v.set_headers)["x-adapter-backend-request"]) == big[:DEBUG_LIMIT]
    none = decode(state("plain", sent=None, debug=True), chat("ok"))
    assert [k for k, _ in none.set_headers] == ["content-type", "x-adapter-route", "x-adapter-backend"]
