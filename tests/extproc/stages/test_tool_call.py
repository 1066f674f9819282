"""Stage `tool-call` on a real compiled tool route (the petstore OpenAPI document): the refusals it
makes before any call (body over the route's limit, not JSON, unknown tool with the JSON-RPC id kept),
the request it builds, and a response to a request it answered itself."""

from __future__ import annotations

import shutil

import orjson
import pytest

from extproc.config.loader import load_file
from extproc.stages.tool_call import ToolCall
from extproc.types import HttpMessage, Mutate, Phase, Reject, RequestState
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
