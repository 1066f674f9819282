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


# --- a backend's own error: sanitised, logged -----------------------------------------------------------

LLAMA_500 = (b'{"error": {"code": 500, "message": "vector::_M_range_check: __n (which is 7) >= this->size() '
             b'(which is 7) at /home/runner/llama.cpp/common/common.cpp:1424", "type": "server_error"}}')


@pytest.mark.parametrize("status", [400, 422, 500, 503])
def test_a_backends_own_error_is_replaced_by_a_safe_one_and_its_body_logged(status, caplog):
    st = state("plain", status)
    st.served, st.response_details = "127.0.0.1:9", "via_upstream"  # the upstream answered
    assert headers_reply(st) is None  # the body is read, to be logged
    with caplog.at_level("WARNING", logger="extproc.stages.decode_response"):
        out = decode(st, LLAMA_500)
    assert isinstance(out, Reject) and out.status == status
    text = repr(out)  # everything the client's body is rendered from
    assert "common.cpp" not in text and "llama.cpp" not in text and "_M_range_check" not in text
    assert out.code == "backend_error" and "rid" in out.message and "llm" in out.message
    assert any("common.cpp" in r.getMessage() and "rid" in r.getMessage() for r in caplog.records)


def test_envoys_own_replies_and_redirects_still_pass_through():
    for status, details in ((503, "upstream_reset_before_response_started{connection_failure}"),
                            (504, "response_timeout"), (503, "no_healthy_upstream")):
        st = state("plain", status)
        st.served, st.response_details = "127.0.0.1:9", details  # Envoy answered (the address was tried)
        assert headers_reply(st) == Mutate(skip_body=True)
    redirect = state("plain", 302)
    redirect.served, redirect.response_details = "127.0.0.1:9", "via_upstream"
    assert headers_reply(redirect) == Mutate(skip_body=True)


def test_without_code_details_an_upstream_address_means_the_backend_answered():
    st = state("plain", 500)
    st.served = "127.0.0.1:9"
    assert headers_reply(st) is None
    bare = state("plain", 503)
    assert headers_reply(bare) == Mutate(skip_body=True)
