"""parse-json, encode-request, decode-response on a real snapshot: the llm route's whole mapping."""

from __future__ import annotations

import asyncio
import base64

import orjson
import pytest

from extproc import codec
from extproc.config.loader import load_file, load_text
from extproc.stages.decode_response import DecodeResponse
from extproc.stages.encode_request import EncodeRequest
from extproc.stages.parse_json import ParseJson
from extproc.types import HttpMessage, Mutate, Phase, Reject, RequestState
from tests.conftest import BRIEF_EXAMPLE


def new_state(snap, route="v1-analyze", debug=False) -> RequestState:
    return RequestState(snapshot=snap, route=snap.routes[route], started=0.0, request_id="rid", debug=debug)


def chat_response(content) -> bytes:
    return orjson.dumps({"id": "c1", "object": "chat.completion", "model": "qwen2.5-finance",
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                      "finish_reason": "stop"}],
                         "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}})


@pytest.fixture(scope="module")
def snap():
    return load_file(BRIEF_EXAMPLE)


def body(phase, data: bytes) -> HttpMessage:
    return HttpMessage(phase, body=data, end_of_stream=True)


def run_request(snap, payload: bytes, debug=False):
    """The route's request-body phase as the stream runs it: parse-json, dispatch, encode-request, merged."""
    st = new_state(snap, debug=debug)
    return st, asyncio.run(st.route.pipeline.run(st, body(Phase.REQUEST_BODY, payload)))


def test_brief_request_becomes_a_chat_completion_routed_to_the_backend(snap):
    st, v = run_request(snap, '{"query":"计算Q3营收"}'.encode())
    assert isinstance(v, Mutate) and v.clear_route_cache
    headers = dict(v.set_headers)
    assert headers[":path"] == "/v1/chat/completions"
    assert headers["x-adapter-backend"] == "finance-backend"
    assert headers["x-adapter-route-target"] == "v1-analyze"
    req = orjson.loads(v.body)
    assert req["model"] == "qwen2.5-finance"
    assert req["messages"][-1] == {"role": "user", "content": "计算Q3营收"}
    fmt = req["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["schema"]["required"] == ["amount", "account"]


@pytest.mark.parametrize("payload, code", [(b"{bad", "malformed_json"), (b"  ", "empty_body")])
def test_bad_json_is_a_400(snap, payload, code):
    _, v = run_request(snap, payload)
    assert isinstance(v, Reject) and v.status == 400 and v.reason == code
    # rendered where the stream renders it: the route's dialect, naming the route and request id
    ir = codec.encode(Phase.REQUEST_BODY, v, "adapter", "v1-analyze", "rid").immediate_response
    err = orjson.loads(ir.body)["error"]
    assert err["code"] == code and err["route"] == "v1-analyze" and err["request_id"] == "rid"


def test_transform_maps_model_output_to_the_voucher(snap):
    st, _ = run_request(snap, b'{"query":"q"}')
    st.response_status = 200
    assert DecodeResponse().on_response_headers(st, HttpMessage(Phase.RESPONSE_HEADERS, headers={})) is None
    v = DecodeResponse().on_response_body(st, body(Phase.RESPONSE_BODY, chat_response('{"amount": 12.5, "account": "6001"}')))
    assert isinstance(v, Mutate)
    assert orjson.loads(v.body) == {"voucher": {"amount": 12.5, "account": "6001"}}
    assert ("content-type", "application/json") in v.set_headers


def test_missing_output_path_is_a_502_naming_the_path(snap):
    st, _ = run_request(snap, b'{"query":"q"}')
    st.response_status = 200
    v = DecodeResponse().on_response_body(st, body(Phase.RESPONSE_BODY, chat_response('{"amount": 1}')))
    assert isinstance(v, Reject) and v.status == 502
    err = orjson.loads(v.body)["error"]
    assert err["code"] == "transform_path_missing" and err["path"] == "$.output.account"
    assert err["backend"] == "finance-backend"


def test_model_output_that_is_not_json_is_a_502(snap):
    st, _ = run_request(snap, b'{"query":"q"}')
    st.response_status = 200
    v = DecodeResponse().on_response_body(st, body(Phase.RESPONSE_BODY, chat_response("sure! the amount is 5")))
    assert isinstance(v, Reject) and v.status == 502 and v.reason == "model_output_not_json"


def test_errors_and_envoy_replies_pass_through_without_body_processing(snap):
    st, _ = run_request(snap, b'{"query":"q"}')
    st.response_status = 503
    v = DecodeResponse().on_response_headers(st, HttpMessage(Phase.RESPONSE_HEADERS, headers={}))
    assert isinstance(v, Mutate) and v.skip_body
    never_encoded = new_state(snap)  # e.g. Envoy's own 413 before the body reached us
    never_encoded.response_status = 413
    assert DecodeResponse().on_response_headers(never_encoded, HttpMessage(Phase.RESPONSE_HEADERS)).skip_body


def test_debug_reports_the_backend_request(snap):
    st, enc = run_request(snap, b'{"query":"q"}', debug=True)
    st.response_status = 200
    v = DecodeResponse().on_response_body(st, body(Phase.RESPONSE_BODY, chat_response('{"amount": 1, "account": "a"}')))
    headers = dict(v.set_headers)
    assert base64.b64decode(headers["x-adapter-backend-request"]) == enc.body
    assert headers["x-adapter-route"] == "v1-analyze"


def test_defaults_and_request_templates():
    snap = load_text("""
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: t}
spec:
  backends: [{name: llm, endpoints: ["127.0.0.1:9"], models: [m7]}]
  routes:
    - path: /r
      request: |
        {"messages": [{"role": "user", "content": $.ticket.text}], "max_tokens": $.limit ?? 64}
      transform: '{"label": $.output.label ?? "unknown", "tokens": $.usage.total_tokens}'
""")
    st = new_state(snap, route="r")
    assert ParseJson().on_request_body(st, body(Phase.REQUEST_BODY, b'{"ticket": {"text": "hi"}}')) is None
    v = EncodeRequest().on_request_body(st, body(Phase.REQUEST_BODY, b""))
    req = orjson.loads(v.body)
    assert req["max_tokens"] == 64 and req["model"] == "m7" and req["messages"][0]["content"] == "hi"
    # `label` has a default, so the model is not required to produce it
    assert req["response_format"]["json_schema"]["schema"].get("required") is None
    st.response_status = 200
    out = DecodeResponse().on_response_body(st, body(Phase.RESPONSE_BODY, chat_response("{}")))
    assert orjson.loads(out.body) == {"label": "unknown", "tokens": 14}
    # a request-template path missing from the client's JSON is the client's error: 400
    st2 = new_state(snap, route="r")
    ParseJson().on_request_body(st2, body(Phase.REQUEST_BODY, b'{"other": 1}'))
    bad = EncodeRequest().on_request_body(st2, body(Phase.REQUEST_BODY, b""))
    assert isinstance(bad, Reject) and bad.status == 400 and b"$.ticket.text" in bad.body
