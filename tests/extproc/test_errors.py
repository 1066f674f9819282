"""Structured errors rendered per dialect: the exact body each kind of client parses."""

from __future__ import annotations

import asyncio
import shutil

import orjson
import pytest

from extproc import codec
from extproc.config.loader import load_text
from extproc.errors import DIALECTS, render, reject
from extproc.types import HttpMessage, Phase, Reject, RequestState
from tests.conftest import DATA


def body(dialect: str, err: Reject, route: str | None = "r1", request_id: str = "rid-1") -> dict:
    return orjson.loads(render(dialect, err, route, request_id))


# --- adapter ---------------------------------------------------------------------------------------


def test_adapter_body_is_status_code_message_fields_route_request_id():
    err = reject(413, "body_too_large", "request body exceeds 1024 bytes", limit=1024)
    assert body("adapter", err) == {"error": {"status": 413, "code": "body_too_large",
                                              "message": "request body exceeds 1024 bytes", "limit": 1024,
                                              "route": "r1", "request_id": "rid-1"}}


def test_adapter_body_key_order_is_status_code_message_then_fields():
    err = reject(400, "bad", "m", a=1)
    assert list(body("adapter", err)["error"]) == ["status", "code", "message", "a", "route", "request_id"]


def test_adapter_without_route_omits_route_but_keeps_request_id():
    err = reject(400, "bad", "m")
    assert body("adapter", err, route=None, request_id="") == {
        "error": {"status": 400, "code": "bad", "message": "m", "request_id": ""}}


def test_adapter_retry_after_becomes_retry_after_s():
    err = reject(429, "tenant_over_quota", "slow down", retry_after=3, tenant="acme")
    e = body("adapter", err)["error"]
    assert e["retry_after_s"] == 3 and e["tenant"] == "acme"
    assert "retry_after" not in e


def test_adapter_no_retry_after_key_when_none():
    assert "retry_after_s" not in body("adapter", reject(400, "bad", "m"))["error"]


def test_adapter_fields_that_are_none_are_dropped():
    err = reject(400, "bad", "m", tenant=None, limit=0, flag=False)
    e = body("adapter", err)["error"]
    assert "tenant" not in e
    assert e["limit"] == 0 and e["flag"] is False  # only None is dropped, not falsy values


def test_adapter_is_what_reject_body_returns():
    err = reject(400, "bad", "m", x=1)
    assert orjson.loads(err.body) == {"error": {"status": 400, "code": "bad", "message": "m", "x": 1,
                                                "request_id": ""}}


# --- openai ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("status, kind", [
    (400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
    (404, "invalid_request_error"), (409, "conflict_error"), (413, "invalid_request_error"),
    (422, "invalid_request_error"), (429, "rate_limit_exceeded"),
    (500, "server_error"), (502, "server_error"), (503, "server_error"), (504, "server_error"),
    (418, "invalid_request_error"),  # an unlisted 4xx is the client's mistake
])
def test_openai_type_per_status(status, kind):
    assert body("openai", reject(status, "c", "m"))["error"]["type"] == kind


def test_openai_body_shape_with_param():
    err = reject(404, "model_not_found", "The model `x` does not exist", param="model")
    assert body("openai", err) == {"error": {
        "message": "The model `x` does not exist", "type": "invalid_request_error", "param": "model",
        "code": "model_not_found", "status": 404, "route": "r1", "request_id": "rid-1"}}


def test_openai_key_order_matches_the_openai_error_object():
    e = body("openai", reject(400, "c", "m", extra=1))["error"]
    assert list(e)[:5] == ["message", "type", "param", "code", "status"]


def test_openai_param_is_null_when_absent_and_not_duplicated():
    e = body("openai", reject(400, "c", "m"))["error"]
    assert "param" in e and e["param"] is None
    e = body("openai", reject(400, "c", "m", param="messages[0]"))["error"]
    assert e["param"] == "messages[0]" and list(e).count("param") == 1


def test_openai_retry_after_and_none_fields():
    err = reject(429, "rate_limited", "m", retry_after=7, tenant=None, limit=5)
    e = body("openai", err)["error"]
    assert e["retry_after_s"] == 7 and e["limit"] == 5 and "tenant" not in e
    assert e["type"] == "rate_limit_exceeded" and e["status"] == 429


def test_openai_without_route_omits_route():
    e = body("openai", reject(400, "c", "m"), route=None)["error"]
    assert "route" not in e and e["request_id"] == "rid-1"


# --- kserve ----------------------------------------------------------------------------------------


def test_kserve_is_only_the_message():
    err = reject(404, "model_not_found", "Request for unknown model: 'm' is not found", retry_after=4,
                 param="model", limit=1)
    assert body("kserve", err) == {"error": "Request for unknown model: 'm' is not found"}


# --- tool ------------------------------------------------------------------------------------------


def test_tool_without_jsonrpc_id_is_the_adapter_shape():
    err = reject(404, "unknown_tool", "no tool named 'x'", retry_after=2, tool="x", hint=None)
    assert body("tool", err) == body("adapter", err)
    assert body("tool", err) == {"error": {"status": 404, "code": "unknown_tool", "message": "no tool named 'x'",
                                           "tool": "x", "retry_after_s": 2, "route": "r1", "request_id": "rid-1"}}


def test_tool_with_jsonrpc_id_is_a_jsonrpc_error_object():
    err = reject(400, "invalid_arguments", "bad args", jsonrpc_id=7, pointer="/petId", hint=None)
    assert body("tool", err) == {"jsonrpc": "2.0", "id": 7, "error": {
        "code": -32602, "message": "bad args",
        "data": {"pointer": "/petId", "status": 400, "code": "invalid_arguments", "route": "r1",
                 "request_id": "rid-1"}}}


def test_tool_jsonrpc_server_errors_are_internal_error():
    err = reject(502, "service_unreachable", "down", jsonrpc_id="abc")
    out = body("tool", err)
    assert out["id"] == "abc" and out["error"]["code"] == -32603
    assert out["error"]["data"]["status"] == 502


def test_tool_jsonrpc_null_id_is_still_jsonrpc():
    # JSON-RPC allows `"id": null`; the marker is the key's presence, not its value
    out = body("tool", reject(400, "c", "m", jsonrpc_id=None))
    assert out["jsonrpc"] == "2.0" and out["id"] is None and out["error"]["code"] == -32602


# --- fallback and the codec ------------------------------------------------------------------------


def test_unknown_dialect_falls_back_to_adapter():
    err = reject(400, "bad", "m", x=1, retry_after=1)
    assert render("klingon", err, "r1", "rid-1") == render("adapter", err, "r1", "rid-1")


def test_dialects_are_the_five_renderers():
    err = reject(400, "c", "m")
    assert DIALECTS == ("adapter", "openai", "kserve", "tool", "anthropic")
    assert len({render(d, err, "r", "i") for d in ("adapter", "openai", "kserve", "anthropic")}) == 4


# --- anthropic (anthropic-messages routes) -----------------------------------------------------------


@pytest.mark.parametrize("status, kind", [(400, "invalid_request_error"), (401, "authentication_error"),
                                          (403, "permission_error"), (404, "not_found_error"),
                                          (413, "request_too_large"), (429, "rate_limit_error"),
                                          (500, "api_error"), (502, "api_error"), (503, "overloaded_error"),
                                          (504, "timeout_error"), (529, "overloaded_error")])
def test_anthropic_body_is_the_messages_api_error_object(status, kind):
    err = reject(status, "some_code", "what went wrong", limit=3)
    assert body("anthropic", err) == {"type": "error", "error": {"type": kind, "message": "what went wrong"},
                                      "request_id": "rid-1"}


@pytest.mark.parametrize("dialect", ["adapter", "openai", "kserve", "tool", "anthropic"])
def test_codec_renders_the_given_dialect_and_sets_retry_after_and_error_header(dialect):
    err = reject(429, "tenant_over_quota", "over quota", retry_after=5)
    ir = codec.encode(Phase.REQUEST_HEADERS, err, dialect, "r1", "rid-1").immediate_response
    assert ir.body == render(dialect, err, "r1", "rid-1")
    headers = {h.header.key: h.header.raw_value.decode() for h in ir.headers.set_headers}
    assert headers["retry-after"] == "5" and headers["x-adapter-error"] == "tenant_over_quota"
    assert ir.status.code == 429


# --- a JSON-RPC tool call refused by the tool route ---------------------------------------------------

TOOL_CONFIG = """\
apiVersion: adapter.ai/v1
kind: AdapterGateway
metadata: {name: tools}
spec:
  backends:
    - {name: petstore, kind: rest, endpoints: ["127.0.0.1:18999"]}
  routes:
    - {path: /tools/petstore, kind: tool, target: petstore, openapi: pets.yaml}
"""


def test_refused_jsonrpc_tool_call_gets_a_jsonrpc_error(tmp_path):
    shutil.copy(DATA / "openapi" / "petstore.yaml", tmp_path / "pets.yaml")
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text(TOOL_CONFIG)
    snap = load_text(TOOL_CONFIG, str(cfg))
    route = snap.routes["tools-petstore"]
    assert route.dialect == "tool"
    st = RequestState(snapshot=snap, route=route, started=0.0, request_id="rid")
    call = b'{"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "noSuchTool", "arguments": {}}}'
    v = asyncio.run(route.pipeline.run(st, HttpMessage(Phase.REQUEST_BODY, body=call, end_of_stream=True)))
    assert isinstance(v, Reject) and v.status == 404
    out = orjson.loads(render(route.dialect, v, route.name, "rid"))
    assert out.get("jsonrpc") == "2.0" and out.get("id") == 7 and out["error"]["code"] == -32602


def test_tool_jsonrpc_500_is_internal_error_and_499_invalid_params():
    assert body("tool", reject(500, "c", "m", jsonrpc_id=1))["error"]["code"] == -32603
    assert body("tool", reject(499, "c", "m", jsonrpc_id=1))["error"]["code"] == -32602
    assert body("tool", reject(399, "c", "m", jsonrpc_id=1))["error"]["code"] == -32603
