"""Stage `tool-call` on a real compiled tool route (the petstore OpenAPI document): the refusals it
makes before any call (body over the route's limit, not JSON, not a call, bad arguments, unknown tool
with the JSON-RPC id kept), the exact request it builds (headers, body, the recorded backend request),
and the service's answer in each caller's protocol (OpenAI, Anthropic, MCP, JSON-RPC), status 200
with the service's status in `x-adapter-tool-status`; a response to a request it answered itself passes."""

from __future__ import annotations

import shutil

import orjson
import pytest

from extproc.config.loader import load_file
from extproc.stages.tool_call import ToolCall
from extproc.types import Continue, HttpMessage, Mutate, Phase, Reject, RequestState
from tests.conftest import DATA


@pytest.fixture
def route(tmp_path):
    shutil.copy(DATA / "openapi" / "petstore.yaml", tmp_path / "pets.yaml")
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text("""\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: tools}
spec:
  backends: [{name: petstore, kind: rest, endpoints: ["127.0.0.1:18999"]}]
  routes: [{path: /tools/petstore, kind: tool, target: petstore, openapi: pets.yaml, policy: {maxBodyBytes: 200}}]
""")
    snap = load_file(cfg)
    return snap, snap.routes["tools-petstore"]


def body(data: bytes) -> HttpMessage:
    return HttpMessage(Phase.REQUEST_BODY, body=data, end_of_stream=True)


def test_refusals_before_any_call(route):
    snap, r = route
    stage = ToolCall()

    def call(data: bytes):
        return stage.on_request_body(RequestState(snapshot=snap, route=r, started=0.0), body(data))

    big = call(b'{"name": "listPets", "arguments": {"x": "' + b"a" * 300 + b'"}}')
    assert isinstance(big, Reject) and big.status == 413
    bad = call(b'{"name": ')
    assert isinstance(bad, Reject) and (bad.status, bad.code) == (400, "malformed_json")
    assert bad.message.startswith("request body is not valid JSON: ") and bad.fields == {}
    unknown = call(orjson.dumps({"jsonrpc": "2.0", "id": 7, "method": "tools/call",
                                 "params": {"name": "noSuchTool", "arguments": {}}}))
    assert isinstance(unknown, Reject) and (unknown.status, unknown.code) == (404, "unknown_tool")
    assert unknown.fields["jsonrpc_id"] == 7


def test_a_call_becomes_the_backend_request_and_a_self_answered_request_passes_its_response(route):
    snap, r = route
    stage = ToolCall()
    state = RequestState(snapshot=snap, route=r, started=0.0)
    verdict = stage.on_request_body(state, body(b'{"name": "listPets", "arguments": {}}'))
    assert isinstance(verdict, Mutate) and verdict.body == b""
    headers = dict(verdict.set_headers)
    assert headers[":method"] == "GET" and headers[":path"].startswith("/") and headers["content-length"] == "0"
    assert "content-type" not in headers  # no body, no type
    assert stage.on_response_headers(state, HttpMessage(Phase.RESPONSE_HEADERS, headers={":status": "200"})) is None
    refused = RequestState(snapshot=snap, route=r, started=0.0)  # e.g. answered 413: no call was made
    skip = stage.on_response_headers(refused, HttpMessage(Phase.RESPONSE_HEADERS, headers={":status": "413"}))
    assert isinstance(skip, Mutate) and skip.skip_body


def test_a_call_with_a_body_is_sent_as_json_with_its_length(route):
    snap, r = route
    state = RequestState(snapshot=snap, route=r, started=0.0)
    verdict = ToolCall().on_request_body(state, body(orjson.dumps(
        {"jsonrpc": "2.0", "id": "a", "method": "tools/call",
         "params": {"name": "createPets", "arguments": {"id": 1, "name": "rex"}}})))
    assert isinstance(verdict, Mutate) and orjson.loads(verdict.body) == {"id": 1, "name": "rex"}
    headers = dict(verdict.set_headers)
    assert (headers[":method"], headers[":path"]) == ("POST", "/v1/pets")  # the document's server base path
    assert headers["content-type"] == "application/json" and headers["content-length"] == str(len(verdict.body))
    assert state.attrs["jsonrpc_id"] == "a"  # the MCP call is answered with its id as sent


def test_an_openai_call_becomes_the_exact_service_request(route):
    snap, r = route
    state = RequestState(snapshot=snap, route=r, started=0.0, tenant="acme")
    doc = {"id": "call_1", "type": "function",
           "function": {"name": "showPetById", "arguments": '{"petId": "a b/c"}'}}
    verdict = ToolCall().on_request_body(state, body(orjson.dumps(doc)))
    assert verdict == Mutate(set_headers=((":method", "GET"), (":path", "/v1/pets/a%20b%2Fc"),
                                          ("accept", "application/json"), ("content-length", "0")), body=b"")
    call = state.attrs["tool_call"]
    assert (call.name, call.arguments, call.call_id, call.protocol) == ("showPetById", {"petId": "a b/c"},
                                                                        "call_1", "openai")
    assert "jsonrpc_id" not in state.attrs
    assert (state.request.api, state.request.tenant, state.request.body) == ("tool", "acme", doc)
    assert orjson.loads(state.backend_request) == {"method": "GET", "target": "/v1/pets/a%20b%2Fc",
                                                   "headers": {"accept": "application/json"}, "body": None}


def test_a_call_with_a_body_records_the_built_request(route):
    snap, r = route
    state = RequestState(snapshot=snap, route=r, started=0.0)
    doc = {"type": "tool_use", "id": "tu_1", "name": "createPets", "input": {"id": 3, "name": "tom"}}
    verdict = ToolCall().on_request_body(state, body(orjson.dumps(doc)))
    sent = b'{"id":3,"name":"tom"}'
    assert verdict == Mutate(set_headers=((":method", "POST"), (":path", "/v1/pets"),
                                          ("content-type", "application/json"), ("accept", "application/json"),
                                          ("content-length", str(len(sent)))), body=sent)
    assert orjson.loads(state.backend_request) == {
        "method": "POST", "target": "/v1/pets",
        "headers": {"content-type": "application/json", "accept": "application/json"},
        "body": {"id": 3, "name": "tom"}}
    assert state.attrs["tool_call"].protocol == "anthropic" and "jsonrpc_id" not in state.attrs


def test_a_plain_mcp_call_has_no_jsonrpc_id(route):
    snap, r = route
    state = RequestState(snapshot=snap, route=r, started=0.0)
    verdict = ToolCall().on_request_body(state, body(b'{"name": "listPets", "arguments": {"limit": 5}}'))
    assert isinstance(verdict, Mutate) and dict(verdict.set_headers)[":path"] == "/v1/pets?limit=5"
    assert state.attrs["tool_call"].protocol == "mcp" and "jsonrpc_id" not in state.attrs


def test_a_jsonrpc_call_with_a_null_id_keeps_it(route):
    snap, r = route
    state = RequestState(snapshot=snap, route=r, started=0.0)
    ToolCall().on_request_body(state, body(b'{"jsonrpc": "2.0", "id": null, "method": "tools/call", '
                                           b'"params": {"name": "listPets"}}'))
    assert state.attrs["jsonrpc_id"] is None and "jsonrpc_id" in state.attrs


def test_bad_arguments_are_a_400_naming_each_field(route):
    snap, r = route
    state = RequestState(snapshot=snap, route=r, started=0.0)
    verdict = ToolCall().on_request_body(state, body(orjson.dumps(
        {"name": "createPets", "arguments": {"id": "x", "name": 5}})))
    assert isinstance(verdict, Reject) and (verdict.status, verdict.code) == (400, "invalid_tool_arguments")
    assert verdict.message.startswith("invalid arguments for tool 'createPets'")
    assert verdict.fields == {"tool": "createPets", "errors": [
        {"pointer": "/id", "path": "id", "message": "must be integer, not a string"},
        {"pointer": "/name", "path": "name", "message": "must be string, not a number"}]}
    assert "tool_call" not in state.attrs and state.request is None and state.backend_request is None


def test_a_jsonrpc_refusal_carries_the_id_and_other_refusals_do_not(route):
    snap, r = route
    stage = ToolCall()

    def call(doc):
        return stage.on_request_body(RequestState(snapshot=snap, route=r, started=0.0), body(orjson.dumps(doc)))

    rpc = call({"jsonrpc": "2.0", "id": "q1", "method": "tools/call",
                "params": {"name": "createPets", "arguments": {"id": 1}}})
    assert isinstance(rpc, Reject) and rpc.code == "invalid_tool_arguments"
    assert rpc.fields["jsonrpc_id"] == "q1" and rpc.fields["tool"] == "createPets"
    plain = call({"name": "createPets", "arguments": {"id": 1}})
    assert isinstance(plain, Reject) and "jsonrpc_id" not in plain.fields
    for doc in ([1, 2], "listPets", {"nothing": True}):  # not a call at all: JSON, but no tool call in it
        v = call(doc)
        assert isinstance(v, Reject) and (v.status, v.code) == (400, "malformed_tool_call") and v.fields == {}
    unknown = call({"name": "nope"})
    assert isinstance(unknown, Reject) and unknown.status == 404 and "jsonrpc_id" not in unknown.fields


def answered(route, doc: dict, status: int | None, resp_headers: dict | None) -> tuple[ToolCall, RequestState]:
    snap, r = route
    stage, state = ToolCall(), RequestState(snapshot=snap, route=r, started=0.0)
    assert isinstance(stage.on_request_body(state, body(orjson.dumps(doc))), Mutate)
    state.response_status = status
    assert stage.on_response_headers(state, HttpMessage(Phase.RESPONSE_HEADERS, headers=resp_headers)) is None
    return stage, state


RESULT_HEADERS = {":status": "201", "content-type": "application/json", "location": "/v1/pets/3"}


def reply(stage, state, data: bytes):
    v = stage.on_response_body(state, HttpMessage(Phase.RESPONSE_BODY, body=data, end_of_stream=True))
    assert isinstance(v, Mutate) and v.remove_headers == ("content-length",)
    return dict(v.set_headers), orjson.loads(v.body), v


def test_the_answer_becomes_an_openai_tool_message(route):
    stage, state = answered(route, {"id": "call_9", "type": "function",
                                    "function": {"name": "createPets", "arguments": '{"id": 3, "name": "t"}'}},
                            201, RESULT_HEADERS)
    headers, out, v = reply(stage, state, b'{"id": 3}')
    assert v.set_headers == ((":status", "200"), ("content-type", "application/json"), ("x-adapter-tool-status", "201"))
    assert out["role"] == "tool" and out["tool_call_id"] == "call_9" and set(out) == {"role", "tool_call_id", "content"}
    assert orjson.loads(out["content"]) == {"status": 201, "ok": True, "content_type": "application/json",
                                            "headers": {"location": "/v1/pets/3"}, "body": {"id": 3}}


def test_an_error_answer_becomes_an_anthropic_error_block(route):
    stage, state = answered(route, {"type": "tool_use", "id": "tu_2", "name": "showPetById",
                                    "input": {"petId": "9"}}, 404, {"content-type": "application/json"})
    headers, out, _ = reply(stage, state, b'{"code": 404, "message": "no such pet"}')
    assert headers["x-adapter-tool-status"] == "404" and headers[":status"] == "200"
    assert out == {"type": "tool_result", "tool_use_id": "tu_2", "is_error": True, "content": orjson.dumps(
        {"status": 404, "ok": False, "content_type": "application/json",
         "body": {"code": 404, "message": "no such pet"}}).decode()}


def test_an_mcp_jsonrpc_call_is_answered_as_jsonrpc_with_its_id(route):
    stage, state = answered(route, {"jsonrpc": "2.0", "id": 41, "method": "tools/call",
                                    "params": {"name": "showPetById", "arguments": {"petId": "1"}}},
                            200, {"content-type": "application/json"})
    _, out, _ = reply(stage, state, b'{"id": 1, "name": "rex"}')
    text = orjson.dumps({"status": 200, "ok": True, "content_type": "application/json",
                         "body": {"id": 1, "name": "rex"}}).decode()
    assert out == {"jsonrpc": "2.0", "id": 41, "result": {
        "content": [{"type": "text", "text": text}], "isError": False, "structuredContent": {"id": 1, "name": "rex"}}}


def test_a_plain_mcp_call_gets_the_bare_result_and_no_status_is_zero(route):
    stage, state = answered(route, {"name": "listPets", "arguments": {}}, None, None)
    headers, out, _ = reply(stage, state, b"")
    assert headers["x-adapter-tool-status"] == "0"
    assert out == {"content": [{"type": "text", "text": '{"status":0,"ok":false,"body":null}'}], "isError": True}


def test_a_response_body_with_no_call_made_passes_as_it_is(route):
    """Found by tests/fuzz/test_fuzz_stream.py: a response body on a stream that made no call (no
    request body came) raised KeyError 'tool_call' in the stage (500 stage_error)."""
    snap, r = route
    state = RequestState(snapshot=snap, route=r, started=0.0)
    verdict = ToolCall().on_response_body(state, HttpMessage(Phase.RESPONSE_BODY, body=b'{"a": 1}', end_of_stream=True))
    assert verdict == Continue()
